// boundary/validation.hpp: the checks of one attention call's arguments, shared by the forward
// (sdpa.cpp), the backward (sdpa_backward.cpp) and serving: query, key, value, mask, bias and
// the options (attend::Error naming the problem), the problem's shapes, and the output views.
#pragma once

#include "attend/attention_options.hpp"
#include "attend/tensor.hpp"

namespace attend::detail {

struct Problem {
  Shape scores_shape;  // (batch..., Lq, Lk)
  Shape output_shape;  // (batch..., Lq, Ev)
  // Query heads per K/V head (grouped-query attention, grouped_query.hpp); 1 without.
  int64_t kv_group = 1;
};

// float32, float16 or bfloat16: what query, key, value, bias (and dO, O) may be.
bool is_attention_float(DType d);

// Checks query, key, value, mask, bias and the options; the shapes of scores and output.
Problem validate_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                        const AttentionOptions& options);
// An output view: shape, dtype, no zero strides, no overlap with an input.
void check_output(const char* name, const TensorView& out, const Shape& expected, DType dtype,
                  const TensorView& q, const TensorView& k, const TensorView& v,
                  const AttentionOptions& options);
// A (..., Lq) float32 logsumexp view.
void check_logsumexp(const char* name, const TensorView& lse, const Shape& scores_shape);

}  // namespace attend::detail
