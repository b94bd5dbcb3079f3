// boundary/validation.cpp: see validation.hpp.
#include "boundary/validation.hpp"

#include <cmath>
#include <string>
#include <utility>

#include "attend/error.hpp"
#include "boundary/views.hpp"
#include "grouped_query.hpp"
#include "score_rules.hpp"

namespace attend::detail {

namespace {

bool is_mask_dtype(DType d) { return !is_floating(d); }

}  // namespace

bool is_attention_float(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

Problem validate_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                        const AttentionOptions& options) {
  check_view("query", q);
  check_view("key", k);
  check_view("value", v);
  for (auto [name, t] : {std::pair{"query", &q}, std::pair{"key", &k}, std::pair{"value", &v}}) {
    if (t->rank() < 2 || t->rank() > 2 + kMaxBatchRank) {
      throw Error(describe(name, *t) + ": expected (..., length, dim) with 0 to " +
                  std::to_string(kMaxBatchRank) + " batch dimensions");
    }
    if (!is_attention_float(t->dtype)) {
      throw Error(std::string(name) + ": dtype " + dtype_name(t->dtype) +
                  " is not supported (float32, float16 or bfloat16)");
    }
  }
  if (k.dtype != q.dtype || v.dtype != q.dtype) {
    throw Error(std::string("query, key and value must share one dtype, got ") +
                dtype_name(q.dtype) + ", " + dtype_name(k.dtype) + ", " + dtype_name(v.dtype));
  }
  if (k.rank() != q.rank() || v.rank() != q.rank()) {
    throw Error("query, key and value must have the same number of dimensions: " +
                describe("query", q) + ", " + describe("key", k) + ", " + describe("value", v));
  }
  const int batch_rank = q.rank() - 2;
  const int64_t kv_group = kv_group_of(q, k, v, options);  // batch dimensions, GQA
  if (k.shape.back(0) != q.shape.back(0)) {
    throw Error(describe("key", k) + " does not match " + describe("query", q) +
                " in the last dimension (E)");
  }
  if (v.shape.back(1) != k.shape.back(1)) {
    throw Error(describe("value", v) + " does not match " + describe("key", k) +
                " in the key length (Lk)");
  }
  if (q.shape.back(0) == 0) throw Error(describe("query", q) + ": head dimension E is 0");
  if (k.shape.back(1) == 0) {
    throw Error(describe("key", k) + ": key length Lk is 0, softmax over no keys is undefined");
  }

  Problem problem;
  problem.kv_group = kv_group;
  for (int d = 0; d < batch_rank; ++d) problem.scores_shape.push_back(q.shape[d]);
  problem.output_shape = problem.scores_shape;
  problem.scores_shape.push_back(q.shape.back(1));
  problem.scores_shape.push_back(k.shape.back(1));
  problem.output_shape.push_back(q.shape.back(1));
  problem.output_shape.push_back(v.shape.back(0));
  (void)problem.scores_shape.numel();

  if (options.mask) {
    check_view("mask", *options.mask);
    if (!is_mask_dtype(options.mask->dtype)) {
      throw Error(std::string("mask: dtype ") + dtype_name(options.mask->dtype) +
                  " is floating point; a mask must be bool or integer (zero excludes). For an "
                  "additive float mask (0 keeps, -inf drops) pass it as the bias instead");
    }
    (void)broadcast_strides("mask", *options.mask, problem.scores_shape);
  }
  if (options.bias) {
    check_view("bias", *options.bias);
    if (!is_attention_float(options.bias->dtype)) {
      throw Error(std::string("bias: dtype ") + dtype_name(options.bias->dtype) +
                  " is not supported (float32, float16 or bfloat16)");
    }
    (void)broadcast_strides("bias", *options.bias, problem.scores_shape);
  }
  if (options.scale && !std::isfinite(*options.scale)) {
    throw Error("scale must be finite, got " + std::to_string(*options.scale));
  }
  if (!(options.dropout >= 0.0 && options.dropout < 1.0)) {
    throw Error("dropout must be in [0, 1), got " + std::to_string(options.dropout));
  }
  validate_score_rules(options, problem.scores_shape);
  if (options.num_threads < 0) {
    throw Error("num_threads must be >= 0 (0 = default), got " +
                std::to_string(options.num_threads));
  }
  return problem;
}

void check_output(const char* name, const TensorView& out, const Shape& expected, DType dtype,
                  const TensorView& q, const TensorView& k, const TensorView& v,
                  const AttentionOptions& options) {
  check_view(name, out);
  if (out.shape != expected) {
    throw Error(describe(name, out) + " does not match the expected shape " + expected.str());
  }
  if (out.dtype != dtype) {
    throw Error(std::string(name) + ": dtype " + dtype_name(out.dtype) + " should be " +
                dtype_name(dtype));
  }
  // Every element of an output must be written once: no zero strides, and no aliasing.
  const bool empty = out.numel() == 0;
  for (int d = 0; d < out.rank() && !empty; ++d) {
    if (out.strides[d] == 0 && out.shape[d] > 1) {
      throw Error(std::string(name) + ": zero stride in dimension " + std::to_string(d) +
                  " would write several results to one element");
    }
  }
  for (auto [input_name, input] :
       {std::pair{"query", &q}, std::pair{"key", &k}, std::pair{"value", &v},
        std::pair{"mask", options.mask ? &*options.mask : nullptr},
        std::pair{"bias", options.bias ? &*options.bias : nullptr},
        std::pair{"alibi_slopes", options.alibi_slopes ? &*options.alibi_slopes : nullptr},
        std::pair{"sinks", options.sinks ? &*options.sinks : nullptr},
        std::pair{"segment_ids_query",
                  options.segment_ids_query ? &*options.segment_ids_query : nullptr},
        std::pair{"segment_ids_key",
                  options.segment_ids_key ? &*options.segment_ids_key : nullptr}}) {
    if (input && overlaps(out, *input)) {
      throw Error(std::string(name) + " overlaps the memory of " + input_name);
    }
  }
}

void check_logsumexp(const char* name, const TensorView& lse, const Shape& scores_shape) {
  check_view(name, lse);
  Shape expected = Shape::from(scores_shape.data(), scores_shape.rank() - 1);
  if (lse.shape != expected) {
    throw Error(describe(name, lse) + " does not match the expected shape " + expected.str() +
                " (..., Lq)");
  }
  if (lse.dtype != DType::kFloat32) {
    throw Error(std::string(name) + ": dtype " + dtype_name(lse.dtype) + " should be float32");
  }
}

}  // namespace attend::detail
