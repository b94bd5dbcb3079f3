// boundary/operands.cpp: see operands.hpp.
#include "boundary/operands.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "boundary/views.hpp"
#include "cpu_features.hpp"
#include "half.hpp"
#include "kernels/fused_sdpa.hpp"
#include "kernels/isa/f16_chains.hpp"
#include "kv_format.hpp"
#include "score_rules.hpp"
#include "shape_policy.hpp"

namespace attend::detail {

bool wants_f16_products(ComputePrecision compute) {
  if (compute != ComputePrecision::kFloat16) return false;
  if (!native_f16_products()) {
    throw Error(std::string("compute precision float16 needs float16 products, but ") +
                why_no_f16_products() +
                "; use ComputePrecision::kFloat32 (float16 inputs are computed in float32)");
  }
  return true;
}

Bf16Cpu this_cpu_bf16() {
  Bf16Cpu cpu;
  cpu.why_no_bf16 = why_no_bf16_products();
  cpu.amx = amx_bf16_products();
  cpu.dot_product_wins = cpu_vendor() == CpuVendor::kAmd;
  return cpu;
}

Bf16Products choose_bf16_products(const Bf16Cpu& cpu, DType input_dtype, ComputePrecision compute,
                                  ProductSite site, bool amx_fits) {
  const bool native = cpu.why_no_bf16[0] == '\0';
  // Every site has AMX tiles; only the forward's query tiles bound their operands' size.
  const bool amx = native && cpu.amx && (amx_fits || site != ProductSite::kAttention);
  switch (compute) {
    case ComputePrecision::kFloat32:
      return Bf16Products::kFloat32;
    case ComputePrecision::kFloat16:
      wants_f16_products(compute);  // refused here where the CPU cannot
      return Bf16Products::kFloat32;
    case ComputePrecision::kBFloat16:
      if (!native) {
        throw Error(std::string("compute precision bfloat16 needs bfloat16 products, but ") +
                    cpu.why_no_bf16 + "; use ComputePrecision::kFloat32");
      }
      return amx ? Bf16Products::kAmxTiles : Bf16Products::kAvx512Bf16;
    case ComputePrecision::kAuto:
      break;
  }
  if (input_dtype != DType::kBFloat16 || !native) return Bf16Products::kFloat32;
  if (amx) return Bf16Products::kAmxTiles;
  return cpu.dot_product_wins ? Bf16Products::kAvx512Bf16 : Bf16Products::kFloat32;
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

// A float32 view of `t` rounded to `dtype` (bfloat16 or float16: ComputePrecision::kBFloat16
// or kFloat16 on a kernel without those products).
TensorView as_kernel_float_rounded(const TensorView& t, DType dtype,
                                   std::optional<Tensor>& storage) {
  if (t.dtype == dtype) return as_kernel_float(t, storage);
  std::optional<Tensor> rounded;
  return as_kernel_float(as_kernel_half(t, dtype, rounded), storage);
}

// What the kernel reads: float32 operands; bfloat16 or float16 operands for half-precision
// products (query tiles); or float32 queries with K and V in their half precision (row
// groups; query tiles, which widen them per thread), bfloat16 or float16, rounded to the
// requested precision first for kBFloat16 and kFloat16.
enum class Products : uint8_t { kFloat32, kHalfProducts, kHalfKeysValues };
struct OperandChoice {
  Products products = Products::kFloat32;
  DType half = DType::kBFloat16;  // of K and V (and Q for kHalfProducts) when not kFloat32
  bool amx = false;               // bfloat16 products on AMX tiles (Bf16Products::kAmxTiles)
};

// float16 operands computed in float32: K and V read as float16 where the target widens them
// exactly and the query tiles' copy fits (or the row groups read them), else float32 copies.
OperandChoice widened_f16(bool rows, int64_t key_len, int64_t head_dim, int64_t value_dim) {
  if (exact_f16_widening() && (rows || FitsPackedFloats(key_len, head_dim, value_dim))) {
    return {Products::kHalfKeysValues, DType::kFloat16};
  }
  return {};
}

// The largest magnitude of a float16 view's elements (+inf when one is infinite or NaN): the
// magnitude's order is the integer order of the bits without the sign. Walks the view's own
// shape and strides (K and V may have fewer batch indices than Q: grouped-query heads).
double max_abs_f16(const TensorView& t) {
  const auto* data = static_cast<const uint16_t*>(t.data);
  const int rank = t.rank();
  const int64_t cols = rank > 0 ? t.shape.back(0) : 1;
  const int64_t col_stride = rank > 0 ? t.strides.back(0) : 1;
  const int64_t rows = cols > 0 ? t.numel() / cols : 0;
  std::vector<int64_t> index(static_cast<size_t>(std::max(rank - 1, 0)), 0);
  uint16_t most = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t offset = 0;
    for (int d = 0; d + 1 < rank; ++d) offset += index[static_cast<size_t>(d)] * t.strides[d];
    for (int64_t c = 0; c < cols; ++c) {
      most = std::max<uint16_t>(most, data[offset + c * col_stride] & 0x7fffu);
    }
    for (int d = rank - 2; d >= 0; --d) {  // the next row, last batch dimension fastest
      if (++index[static_cast<size_t>(d)] < t.shape[d]) break;
      index[static_cast<size_t>(d)] = 0;
    }
  }
  return most >= 0x7c00u ? INFINITY : f32_from_f16(most);
}

// Whether every float16 chain of the products stays finite (kernels/isa/f16_chains.hpp):
// Q·Kᵀ's with max|q|·max|k|, P·V's with max|v| (the probabilities are at most 1).
bool f16_chains_fit(const TensorView& q, const TensorView& k, const TensorView& v) {
  return F16ChainsFit(max_abs_f16(q), max_abs_f16(k)) && F16ChainsFit(max_abs_f16(v), 1.0);
}

// Whether the grouped-query tiles take the rules of `options` (PacksGroupedQueries declines
// the rest, which then run in the row groups).
bool grouped_tiles_take(const AttentionOptions& options) {
  return GroupedTilesTakeRules(options.mask.has_value(), options.bias.has_value(),
                               options.segment_ids_query.has_value(),
                               options.user_rules.has_value(), options.dropout,
                               options.need_weights);
}

// The products a call computes (AttentionOptions::compute): bfloat16 ones only in the query
// tiles (and the grouped-query tiles), as the precision policy says (bf16_products);
// attend::Error for a precision this CPU cannot compute.
// Decoding shapes (the row groups) read half-precision K and V as they are, widening them as
// they load: the same float32 arithmetic on half the bytes; the query tiles widen them once
// per thread and batch index instead of a float32 copy of the whole operands.
// kv_group: query heads per K/V head (Problem::kv_group).
OperandChoice choose_operands(const TensorView& query, const TensorView& value,
                              const AttentionOptions& options, bool for_backward,
                              int64_t kv_group) {
  const int64_t key_len = value.shape.back(1), head_dim = query.shape.back(0);
  const int64_t value_dim = value.shape.back(0);
  // The query tiles' AMX operands fit (FitsAmxTiles), or the products take the policy's
  // other choice for this shape.
  const Bf16Products path = bf16_products(query.dtype, options.compute, ProductSite::kAttention,
                                          FitsAmxTiles(key_len, head_dim, value_dim));
  const bool bf16 = path != Bf16Products::kFloat32;
  const bool f16 = wants_f16_products(options.compute);
  const bool requested = options.compute == ComputePrecision::kBFloat16;
  if (options.backend == Backend::kReference || for_backward) {
    if ((requested || f16) && options.backend == Backend::kReference) {
      throw Error(std::string("compute precision ") + (f16 ? "float16" : "bfloat16") +
                  " runs on the fused backend (the reference computes in float64)");
    }
    return {};  // float32 (on the rounded inputs for kBFloat16 and kFloat16: see make_params)
  }
  const bool rows = RunsInRowGroups(query.shape.back(1), fused_lanes());
  if (f16) {  // float16 products in the query tiles where their copy of K and V fits
    if (!rows && FitsPackedBf16(key_len, head_dim, value_dim)) {
      return {Products::kHalfProducts, DType::kFloat16};
    }
    return widened_f16(rows, key_len, head_dim, value_dim);
  }
  if (rows) {
    // The G·Lq rows of a K/V head as one grouped-query tile (shape_policy.hpp, 5.): bfloat16
    // products there where the policy gives them to the query tiles on AVX512_BF16 (or they
    // are asked for), the same error model as the query tiles' (tests/bf16_test.cc).
    if ((requested || path == Bf16Products::kAvx512Bf16) &&
        GroupsQueryRows(kv_group, query.shape.back(1), fused_lanes()) &&
        FitsPackedBf16(key_len, head_dim, value_dim) && grouped_tiles_take(options)) {
      return {Products::kHalfProducts, DType::kBFloat16};
    }
    if (requested) return {Products::kHalfKeysValues, DType::kBFloat16};
    if (options.compute != ComputePrecision::kAuto) return {};
    if (query.dtype == DType::kBFloat16) return {Products::kHalfKeysValues, DType::kBFloat16};
    if (query.dtype == DType::kFloat16 && exact_f16_widening()) {
      return {Products::kHalfKeysValues, DType::kFloat16};
    }
    return {};
  }
  if (bf16) {
    if (path == Bf16Products::kAmxTiles) return {Products::kHalfProducts, DType::kBFloat16, true};
    if (FitsPackedBf16(key_len, head_dim, value_dim)) {
      return {Products::kHalfProducts, DType::kBFloat16};
    }
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

bool stored_kv_bf16_products(DType format, const AttentionOptions& options, int64_t kv_group,
                             int64_t query_len, int64_t key_len, int64_t head_dim,
                             int64_t value_dim) {
  if (options.backend == Backend::kReference || !native_bf16_products()) return false;
  if (!GroupsQueryRows(kv_group, query_len, fused_lanes()) ||
      !FitsPackedBf16(key_len, head_dim, value_dim) || !grouped_tiles_take(options)) {
    return false;
  }
  switch (options.compute) {
    case ComputePrecision::kBFloat16:
      return true;
    case ComputePrecision::kAuto:
      break;
    default:
      return false;
  }
  if (is_scaled_kv_format(format)) return true;
  return format == DType::kBFloat16 &&
         bf16_products(DType::kBFloat16, ComputePrecision::kAuto, ProductSite::kAttention,
                       false) == Bf16Products::kAvx512Bf16;
}

SdpaParams make_params(const TensorView& query, const TensorView& key, const TensorView& value,
                       const Problem& problem, const AttentionOptions& options,
                       KernelInputs& storage, bool for_backward, bool half_queries) {
  const int batch_rank = query.rank() - 2;
  OperandChoice choice = choose_operands(query, value, options, for_backward, problem.kv_group);
  // kBFloat16 or kFloat16 asked: every operand rounded to that precision, whatever the kernel.
  const DType rounding = options.compute == ComputePrecision::kBFloat16 ? DType::kBFloat16
                         : options.compute == ComputePrecision::kFloat16 ? DType::kFloat16
                                                                          : DType::kFloat32;
  const auto float_operand = [&](const TensorView& t, std::optional<Tensor>& copy) {
    return rounding != DType::kFloat32 ? as_kernel_float_rounded(t, rounding, copy)
                                       : as_kernel_float(t, copy);
  };

  SdpaParams p;
  // Half-precision K and V computed in float32 on a shape only the query tiles take: the
  // queries, of the same dtype, read as they are too (widened as the tiles load them).
  const bool tiles_only = half_queries && !RunsInRowGroups(query.shape.back(1), fused_lanes());
  // Q, K and V as `choice` says; again with float32 products where float16 chains would
  // overflow (f16_chains_fit).
  const auto attach_operands = [&](TensorView& q, TensorView& k, TensorView& v) {
    const bool half_query = choice.products == Products::kHalfProducts;
    const bool half_kv = choice.products != Products::kFloat32;
    const bool widened_query = tiles_only && choice.products == Products::kHalfKeysValues &&
                               query.dtype == choice.half;
    const auto operand = [&](bool half, const TensorView& t, std::optional<Tensor>& copy) {
      return half ? as_kernel_half(t, choice.half, copy) : float_operand(t, copy);
    };
    q = operand(half_query || widened_query, query, storage.query);
    k = operand(half_kv, key, storage.key);
    v = operand(half_kv, value, storage.value);
    p.half_dtype = choice.half;
    p.query_half = p.key_half = p.value_half = p.query_widened = nullptr;
    p.query = p.key = p.value = nullptr;
    p.key_stored = p.value_stored = nullptr;
    p.kv_format = DType::kFloat32;
    if (half_query) {
      p.query_half = q.data_as<const uint16_t>();
    } else if (widened_query) {
      p.query_widened = q.data_as<const uint16_t>();
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
  };
  TensorView q, k, v;
  attach_operands(q, k, v);
  for (int d = 0; d < batch_rank; ++d) p.batch_shape[kMaxBatchRank - batch_rank + d] = q.shape[d];
  p.batch = 1;
  for (int64_t d : p.batch_shape) p.batch *= d;
  p.query_len = q.shape.back(1);
  p.key_len = k.shape.back(1);
  p.head_dim = q.shape.back(0);
  p.value_dim = v.shape.back(0);
  if (p.f16_products() && !f16_chains_fit(q, k, v)) {
    choice = widened_f16(false, p.key_len, p.head_dim, p.value_dim);
    attach_operands(q, k, v);
  }
  p.amx_tiles = p.bf16_products() && choice.amx;

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
