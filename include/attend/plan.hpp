// attend/plan.hpp: prepared attention calls, for decode loops that call attention with the
// same shapes thousands of times a second.
//
// A plan validates shapes, strides, dtypes and options once and fills the kernels' parameters;
// run() then only checks that the tensors it gets have the planned layout (a few comparisons),
// sets their data pointers and runs the kernel chosen at planning. The result is bitwise the
// one scaled_dot_product_attention_into gives for the same arguments.
//
//   AttentionPlan plan(q, k, v, out, options);      // validates; may throw attend::Error
//   for (...) plan.run(q, k, v, out);                // same layout, new data
//
// Key length: with `variable_key_length` (and no option that has a key dimension: mask,
// bias, segment ids, weights), run() takes key and value of any length Lk >= 1 and any
// strides (a growing cache); the causal diagonal follows Lk as in the unprepared call.
// Everything else must match the planned views exactly (attend::Error otherwise, before any
// output is touched).
//
// The tensors of `options` (mask, bias, ALiBi slopes, sinks, segment ids, user rules) are
// captured when the plan is made: they must stay alive and unchanged while it is used.
// A plan is immutable after construction: several threads may run one plan at once on
// different tensors.
//
// float32 operands whose last dimension is contiguous take the prepared path (prepared() is
// true) unless an option makes the call copy them; other dtypes or layouts run the unprepared
// call with the planned options (the same result, the usual per-call cost).
#pragma once

#include <memory>

#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"

namespace attend {

class AttentionPlan {
 public:
  // query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev), output (..., Lq, Ev): the
  // layout of every call (their data is read only to validate, not kept).
  AttentionPlan(const TensorView& query, const TensorView& key, const TensorView& value,
                const TensorView& output, const AttentionOptions& options = {},
                bool variable_key_length = false);
  AttentionPlan(AttentionPlan&&) noexcept;
  AttentionPlan& operator=(AttentionPlan&&) noexcept;
  ~AttentionPlan();

  // One call. `logsumexp` (..., Lq) float32 is written when given (needs need_logsumexp in
  // the planned options).
  void run(const TensorView& query, const TensorView& key, const TensorView& value,
           const TensorView& output, const TensorView* logsumexp = nullptr) const;

  // Whether run() takes the prepared path (see above).
  bool prepared() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace attend
