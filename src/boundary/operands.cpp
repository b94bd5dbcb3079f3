// boundary/operands.cpp: see operands.hpp.
#include "boundary/operands.hpp"

#include <cmath>
#include <string>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "boundary/views.hpp"
#include "cpu_features.hpp"
#include "kernels/fused_sdpa.hpp"
#include "score_rules.hpp"
#include "shape_policy.hpp"

namespace attend::detail {

bool wants_bf16_products(DType input_dtype, ComputePrecision compute) {
  switch (compute) {
    case ComputePrecision::kFloat32:
      return false;
    case ComputePrecision::kFloat16:
      throw Error("compute precision float16: " +
                  std::string(cpu_precision_support().avx512_fp16
                                  ? "float16 products are not implemented yet"
                                  : "this CPU has no AVX512_FP16") +
                  "; use ComputePrecision::kFloat32 (float16 inputs are computed in float32)");
    case ComputePrecision::kBFloat16:
      if (!native_bf16_products()) {
        throw Error(std::string("compute precision bfloat16 needs bfloat16 products, but ") +
                    why_no_bf16_products() + "; use ComputePrecision::kFloat32");
      }
      return true;
    case ComputePrecision::kAuto:
      break;
  }
  return input_dtype == DType::kBFloat16 && native_bf16_products();
}

namespace {

// A view of `dtype` (bfloat16 or float16) with a contiguous last dimension: the view itself
// when it already is one, otherwise a copy rounded to `dtype` (nearest even) kept in `storage`.
TensorView as_kernel_half(const TensorView& t, DType dtype, std::optional<Tensor>& storage) {
  if (t.dtype == dtype && (t.strides.back(0) == 1 || t.shape.back(0) <= 1)) {
    TensorView v = t;
    v.strides[v.rank() - 1] = 1;
    return v;
  }
  storage.emplace(dtype, t.shape);
  convert(t, storage->view());
  return storage->view();
}

TensorView as_kernel_bf16(const TensorView& t, std::optional<Tensor>& storage) {
  return as_kernel_half(t, DType::kBFloat16, storage);
}

// A float32 view of `t` rounded to bfloat16 (ComputePrecision::kBFloat16 on a kernel without
// bfloat16 products).
TensorView as_kernel_float_rounded_to_bf16(const TensorView& t, std::optional<Tensor>& storage) {
  if (t.dtype == DType::kBFloat16) return as_kernel_float(t, storage);
  std::optional<Tensor> rounded;
  return as_kernel_float(as_kernel_bf16(t, rounded), storage);
}

// What the kernel reads: float32 operands; bfloat16 operands for bfloat16 products (query
// tiles); or float32 queries with K and V in their half precision (row groups; query tiles,
// which widen them per thread), bfloat16 or float16, rounded to bfloat16 first for kBFloat16.
enum class Products : uint8_t { kFloat32, kBFloat16, kHalfKeysValues };
struct OperandChoice {
  Products products = Products::kFloat32;
  DType half = DType::kBFloat16;  // of K and V (and Q for kBFloat16) when not kFloat32
};

// The products a call computes (AttentionOptions::compute): bfloat16 ones only in the query
// tiles, on a CPU that has them; attend::Error for a precision this CPU cannot compute.
// Decoding shapes (the row groups) read half-precision K and V as they are, widening them as
// they load: the same float32 arithmetic on half the bytes; the query tiles widen them once
// per thread and batch index instead of a float32 copy of the whole operands.
OperandChoice choose_operands(const TensorView& query, const TensorView& value,
                              const AttentionOptions& options, bool for_backward) {
  const bool bf16 = wants_bf16_products(query.dtype, options.compute);
  const bool requested = options.compute == ComputePrecision::kBFloat16;
  if (options.backend == Backend::kReference || for_backward) {
    if (requested && options.backend == Backend::kReference) {
      throw Error(
          "compute precision bfloat16 runs on the fused backend (the reference computes "
          "in float64)");
    }
    return {};  // float32 (on the rounded inputs for kBFloat16: see make_params)
  }
  const bool rows = RunsInRowGroups(query.shape.back(1), fused_lanes());
  if (rows) {
    if (requested) return {Products::kHalfKeysValues, DType::kBFloat16};
    if (options.compute != ComputePrecision::kAuto) return {};
    if (query.dtype == DType::kBFloat16) return {Products::kHalfKeysValues, DType::kBFloat16};
    if (query.dtype == DType::kFloat16 && exact_f16_widening()) {
      return {Products::kHalfKeysValues, DType::kFloat16};
    }
    return {};
  }
  const int64_t key_len = value.shape.back(1), head_dim = query.shape.back(0);
  const int64_t value_dim = value.shape.back(0);
  if (bf16) {
    if (FitsPackedBf16(key_len, head_dim, value_dim))
      return {Products::kBFloat16, DType::kBFloat16};
    return {};
  }
  // Half-precision inputs computed in float32: the query tiles widen K and V per thread and
  // batch index (PackKeysAndValues), exactly, where the copy fits.
  if (options.compute == ComputePrecision::kAuto &&
      FitsPackedFloats(key_len, head_dim, value_dim)) {
    if (query.dtype == DType::kBFloat16) return {Products::kHalfKeysValues, DType::kBFloat16};
    if (query.dtype == DType::kFloat16 && exact_f16_widening()) {
      return {Products::kHalfKeysValues, DType::kFloat16};
    }
  }
  return {};
}

}  // namespace

SdpaParams make_params(const TensorView& query, const TensorView& key, const TensorView& value,
                       const Problem& problem, const AttentionOptions& options,
                       KernelInputs& storage, bool for_backward) {
  const int batch_rank = query.rank() - 2;
  const OperandChoice choice = choose_operands(query, value, options, for_backward);
  // kBFloat16 asked: every operand rounded to bfloat16, whatever the kernel.
  const bool rounded = options.compute == ComputePrecision::kBFloat16;
  const auto float_operand = [&](const TensorView& t, std::optional<Tensor>& copy) {
    return rounded ? as_kernel_float_rounded_to_bf16(t, copy) : as_kernel_float(t, copy);
  };
  const auto half_operand = [&](const TensorView& t, std::optional<Tensor>& copy) {
    return choice.half == DType::kBFloat16 ? as_kernel_bf16(t, copy)
                                           : as_kernel_half(t, DType::kFloat16, copy);
  };
  const bool half_query = choice.products == Products::kBFloat16;
  const bool half_kv = choice.products != Products::kFloat32;
  const TensorView q =
      half_query ? half_operand(query, storage.query) : float_operand(query, storage.query);
  const TensorView k = half_kv ? half_operand(key, storage.key) : float_operand(key, storage.key);
  const TensorView v =
      half_kv ? half_operand(value, storage.value) : float_operand(value, storage.value);

  SdpaParams p;
  for (int d = 0; d < batch_rank; ++d) p.batch_shape[kMaxBatchRank - batch_rank + d] = q.shape[d];
  p.batch = 1;
  for (int64_t d : p.batch_shape) p.batch *= d;
  p.query_len = q.shape.back(1);
  p.key_len = k.shape.back(1);
  p.head_dim = q.shape.back(0);
  p.value_dim = v.shape.back(0);
  p.half_dtype = choice.half;
  if (half_query) {
    p.query_half = q.data_as<const uint16_t>();
    p.amx_tiles = amx_bf16_products() && FitsAmxTiles(p.key_len, p.head_dim, p.value_dim);
  } else {
    p.query = q.data_as<const float>();
  }
  if (half_kv) {  // the query tiles read key_half; the row groups read K and V as stored
    p.key_half = k.data_as<const uint16_t>();
    p.value_half = v.data_as<const uint16_t>();
    if (!half_query) {
      p.kv_format = choice.half;
      p.key_stored = k.data;
      p.value_stored = v.data;
    }
  } else {
    p.key = k.data_as<const float>();
    p.value = v.data_as<const float>();
  }
  p.query_strides = plain_strides(q);
  p.key_strides = plain_strides(k);
  p.value_strides = plain_strides(v);

  if (options.mask) {
    TensorView m = *options.mask;
    if (dtype_size(m.dtype) != 1) {
      storage.mask.emplace(DType::kBool, m.shape);  // nonzero → 1: 256 must not wrap to 0
      convert(m, storage.mask->view());
      m = storage.mask->view();
    }
    p.mask = m.data_as<const uint8_t>();
    p.mask_strides = broadcast_strides("mask", m, problem.scores_shape);
  }
  if (options.bias) {
    TensorView b = *options.bias;
    if (b.dtype != DType::kFloat32) {
      storage.bias.emplace(DType::kFloat32, b.shape);
      convert(b, storage.bias->view());
      b = storage.bias->view();
    }
    p.bias = b.data_as<const float>();
    p.bias_strides = broadcast_strides("bias", b, problem.scores_shape);
  }

  fill_score_rules(p, options, problem.scores_shape, storage.rules);
  p.scale = static_cast<float>(options.scale ? *options.scale
                                             : 1.0 / std::sqrt(static_cast<double>(p.head_dim)));
  p.zero_fully_masked_rows = options.fully_masked_rows == FullyMaskedRows::kZero;
  p.dropout = static_cast<float>(options.dropout);
  p.seed = options.seed;
  p.num_threads = options.num_threads > 0 ? options.num_threads : default_num_threads();
  return p;
}

}  // namespace attend::detail
