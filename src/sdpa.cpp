// sdpa.cpp: the API boundary. Validate once, normalize dtypes and layouts into SdpaParams,
// pick the first kernel that accepts the problem (the reference last), run.
#include "attend/sdpa.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "cpu_features.hpp"
#include "grouped_query.hpp"
#include "kernels/fused_sdpa.hpp"
#include "kernels/kernel_list.hpp"
#include "half.hpp"
#include "kernels/isa/f16_chains.hpp"
#include "kv_format.hpp"
#include "score_rules.hpp"
#include "sdpa_boundary.hpp"
#include "sdpa_params.hpp"
#include "shape_policy.hpp"

namespace attend::detail {

namespace {

bool is_mask_dtype(DType d) { return !is_floating(d); }

}  // namespace

bool is_attention_float(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

std::string describe(const char* name, const TensorView& t) {
  return std::string(name) + " " + t.shape.str();
}

void check_view(const char* name, const TensorView& t) {
  if (t.strides.rank() != t.shape.rank()) {
    throw Error(std::string(name) + ": strides " + t.strides.str() + " do not match shape " +
                t.shape.str());
  }
  for (int d = 0; d < t.rank(); ++d) {
    if (t.shape[d] < 0) throw Error(describe(name, t) + " has a negative dimension");
    if (t.strides[d] < 0) {
      throw Error(std::string(name) + ": negative stride " + std::to_string(t.strides[d]) +
                  " in dimension " + std::to_string(d) + " is not supported");
    }
  }
  const int64_t count = t.shape.numel();  // throws on overflow
  if (t.data == nullptr && count > 0) {
    throw Error(std::string(name) + ": data pointer is null for shape " + t.shape.str());
  }
  if (count == 0) return;
  // The byte offset of the last element must be representable (byte_range, the kernels).
  int64_t last_offset = 0;
  bool overflow = false;
  for (int d = 0; d < t.rank(); ++d) {
    int64_t term;
    overflow |= __builtin_mul_overflow(t.shape[d] - 1, t.strides[d], &term);
    overflow |= __builtin_add_overflow(last_offset, term, &last_offset);
  }
  int64_t bytes;
  overflow |= __builtin_add_overflow(last_offset, 1, &last_offset);
  overflow |=
      __builtin_mul_overflow(last_offset, static_cast<int64_t>(dtype_size(t.dtype)), &bytes);
  if (overflow) {
    throw Error(std::string(name) + ": byte offset of the last element of shape " + t.shape.str() +
                " with strides " + t.strides.str() + " overflows");
  }
}

int64_t byte_extent(const TensorView& t) {
  if (t.numel() == 0) return 0;
  int64_t last_offset = 0;
  for (int d = 0; d < t.rank(); ++d) last_offset += (t.shape[d] - 1) * t.strides[d];
  const auto size = static_cast<int64_t>(dtype_size(t.dtype));
  return last_offset * size + size;
}

ByteRange byte_range(const void* data, int64_t extent) {
  const auto* first = static_cast<const char*>(data);
  return extent > 0 ? ByteRange{first, first + extent} : ByteRange{};
}

ByteRange byte_range(const TensorView& t) { return byte_range(t.data, byte_extent(t)); }

bool ranges_overlap(const ByteRange& a, const ByteRange& b) {
  return a.first && b.first && a.first < b.last && b.first < a.last;
}

bool overlaps(const TensorView& a, const TensorView& b) {
  return ranges_overlap(byte_range(a), byte_range(b));
}

// Strides (elements) of a view broadcast to (batch..., rows, columns); `target` is that shape.
OperandStrides broadcast_strides(const char* name, const TensorView& t, const Shape& target) {
  if (t.rank() > target.rank()) {
    throw Error(describe(name, t) + " has more dimensions than the scores " + target.str());
  }
  Shape aligned;  // per target dim: the view's stride, 0 where it broadcasts
  for (int d = 0; d < target.rank(); ++d) {
    const int source = d - (target.rank() - t.rank());
    if (source < 0) {
      aligned.push_back(0);
      continue;
    }
    if (t.shape[source] == target[d]) {
      aligned.push_back(target[d] == 1 ? 0 : t.strides[source]);
    } else if (t.shape[source] == 1) {
      aligned.push_back(0);
    } else {
      throw Error(describe(name, t) + " does not broadcast to the scores " + target.str() +
                  " (dimension " + std::to_string(source) + ")");
    }
  }
  OperandStrides s;
  const int batch_rank = target.rank() - 2;
  for (int d = 0; d < batch_rank; ++d) s.batch[kMaxBatchRank - batch_rank + d] = aligned[d];
  s.row = aligned[batch_rank];
  s.column = aligned[batch_rank + 1];
  return s;
}

// Strides of a (batch..., rows, columns) view whose column stride is 1.
OperandStrides plain_strides(const TensorView& t) {
  OperandStrides s;
  const int batch_rank = t.rank() - 2;
  for (int d = 0; d < batch_rank; ++d) {
    s.batch[kMaxBatchRank - batch_rank + d] = t.shape[d] == 1 ? 0 : t.strides[d];
  }
  s.row = t.strides[batch_rank];
  s.column = 1;
  return s;
}

// A float32 view with a contiguous last dimension: the view itself when it already is one,
// otherwise a converted copy kept alive in `storage`.
TensorView as_kernel_float(const TensorView& t, std::optional<Tensor>& storage) {
  if (t.dtype == DType::kFloat32 && (t.strides.back(0) == 1 || t.shape.back(0) <= 1)) {
    TensorView v = t;
    v.strides[v.rank() - 1] = 1;
    return v;
  }
  storage.emplace(DType::kFloat32, t.shape);
  convert(t, storage->view());
  return storage->view();
}

// A float32 view with a contiguous last dimension to write into: `out` itself when it is
// one, else a staging tensor kept in `storage` (copied back by the caller).
TensorView writable_kernel_float(const TensorView& out, std::optional<Tensor>& storage) {
  if (out.dtype == DType::kFloat32 && (out.strides.back(0) == 1 || out.shape.back(0) <= 1)) {
    TensorView v = out;
    v.strides[v.rank() - 1] = 1;
    return v;
  }
  storage.emplace(DType::kFloat32, out.shape);
  return storage->view();
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
  const ByteRange out_range = byte_range(out);
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
    if (input && ranges_overlap(out_range, byte_range(*input))) {
      throw Error(std::string(name) + " overlaps the memory of " + input_name);
    }
  }
}

bool wants_f16_products(ComputePrecision compute) {
  if (compute != ComputePrecision::kFloat16) return false;
  if (!native_f16_products()) {
    throw Error(std::string("compute precision float16 needs float16 products, but ") +
                why_no_f16_products() +
                "; use ComputePrecision::kFloat32 (float16 inputs are computed in float32)");
  }
  return true;
}

bool wants_bf16_products(DType input_dtype, ComputePrecision compute) {
  switch (compute) {
    case ComputePrecision::kFloat32:
      return false;
    case ComputePrecision::kFloat16:
      wants_f16_products(compute);  // refused here where the CPU cannot
      return false;
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
};

// float16 operands computed in float32: K and V read as float16 where the target widens them
// exactly and the query tiles' copy fits (or the row groups read them), else float32 copies.
OperandChoice widened_f16(bool rows, int64_t key_len, int64_t head_dim, int64_t value_dim) {
  if (exact_f16_widening() && (rows || FitsPackedFloats(key_len, head_dim, value_dim))) {
    return {Products::kHalfKeysValues, DType::kFloat16};
  }
  return {};
}

// The largest magnitude of the float16 rows [0, rows) × [0, cols) of every batch index of
// `p` at `data` with `strides` (+inf when one is infinite or NaN): the magnitude's order is
// the integer order of the bits without the sign.
double max_abs_f16(const SdpaParams& p, const uint16_t* data, const OperandStrides& strides,
                   int64_t rows, int64_t cols) {
  uint16_t most = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const uint16_t* base = data + p.batch_offset(strides, b);
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* row = base + r * strides.row;
      for (int64_t c = 0; c < cols; ++c) most = std::max<uint16_t>(most, row[c] & 0x7fffu);
    }
  }
  return most >= 0x7c00u ? INFINITY : f32_from_f16(most);
}

// Whether every float16 chain of the products stays finite (kernels/isa/f16_chains.hpp):
// Q·Kᵀ's with max|q|·max|k|, P·V's with max|v| (the probabilities are at most 1).
bool f16_chains_fit(const SdpaParams& p) {
  const double q = max_abs_f16(p, p.query_half, p.query_strides, p.query_len, p.head_dim);
  const double k = max_abs_f16(p, p.key_half, p.key_strides, p.key_len, p.head_dim);
  const double v = max_abs_f16(p, p.value_half, p.value_strides, p.key_len, p.value_dim);
  return F16ChainsFit(q, k) && F16ChainsFit(v, 1.0);
}

// The products a call computes (AttentionOptions::compute): bfloat16 ones only in the query
// tiles, on a CPU that has them; attend::Error for a precision this CPU cannot compute.
// Decoding shapes (the row groups) read half-precision K and V as they are, widening them as
// they load: the same float32 arithmetic on half the bytes; the query tiles widen them once
// per thread and batch index instead of a float32 copy of the whole operands.
OperandChoice choose_operands(const TensorView& query, const TensorView& value,
                              const AttentionOptions& options, bool for_backward) {
  const bool bf16 = wants_bf16_products(query.dtype, options.compute);
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
  const int64_t key_len = value.shape.back(1), head_dim = query.shape.back(0);
  const int64_t value_dim = value.shape.back(0);
  if (f16) {  // float16 products in the query tiles where their copy of K and V fits
    if (!rows && FitsPackedBf16(key_len, head_dim, value_dim)) {
      return {Products::kHalfProducts, DType::kFloat16};
    }
    return widened_f16(rows, key_len, head_dim, value_dim);
  }
  if (rows) {
    if (requested) return {Products::kHalfKeysValues, DType::kBFloat16};
    if (options.compute != ComputePrecision::kAuto) return {};
    if (query.dtype == DType::kBFloat16) return {Products::kHalfKeysValues, DType::kBFloat16};
    if (query.dtype == DType::kFloat16 && exact_f16_widening()) {
      return {Products::kHalfKeysValues, DType::kFloat16};
    }
    return {};
  }
  if (bf16) {
    if (FitsPackedBf16(key_len, head_dim, value_dim))
      return {Products::kHalfProducts, DType::kBFloat16};
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
  OperandChoice choice = choose_operands(query, value, options, for_backward);
  // kBFloat16 or kFloat16 asked: every operand rounded to that precision, whatever the kernel.
  const DType rounding = options.compute == ComputePrecision::kBFloat16 ? DType::kBFloat16
                         : options.compute == ComputePrecision::kFloat16 ? DType::kFloat16
                                                                          : DType::kFloat32;
  const auto float_operand = [&](const TensorView& t, std::optional<Tensor>& copy) {
    return rounding != DType::kFloat32 ? as_kernel_float_rounded(t, rounding, copy)
                                       : as_kernel_float(t, copy);
  };

  SdpaParams p;
  // Q, K and V as `choice` says; again with float32 products where float16 chains would
  // overflow (f16_chains_fit).
  const auto attach_operands = [&](TensorView& q, TensorView& k, TensorView& v) {
    const bool half_query = choice.products == Products::kHalfProducts;
    const bool half_kv = choice.products != Products::kFloat32;
    const auto operand = [&](bool half, const TensorView& t, std::optional<Tensor>& copy) {
      return half ? as_kernel_half(t, choice.half, copy) : float_operand(t, copy);
    };
    q = operand(half_query, query, storage.query);
    k = operand(half_kv, key, storage.key);
    v = operand(half_kv, value, storage.value);
    p.half_dtype = choice.half;
    p.query_half = p.key_half = p.value_half = nullptr;
    p.query = p.key = p.value = nullptr;
    p.key_stored = p.value_stored = nullptr;
    p.kv_format = DType::kFloat32;
    if (half_query) {
      p.query_half = q.data_as<const uint16_t>();
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
  if (p.f16_products() && !f16_chains_fit(p)) {
    choice = widened_f16(false, p.key_len, p.head_dim, p.value_dim);
    attach_operands(q, k, v);
  }
  p.amx_tiles = p.bf16_products() && amx_bf16_products() &&
                FitsAmxTiles(p.key_len, p.head_dim, p.value_dim);

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

OperandStrides row_vector_strides(const TensorView& t) {
  OperandStrides s;
  const int batch_rank = t.rank() - 1;
  for (int d = 0; d < batch_rank; ++d) {
    s.batch[kMaxBatchRank - batch_rank + d] = t.shape[d] == 1 ? 0 : t.strides[d];
  }
  s.row = t.strides[batch_rank];
  return s;
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

namespace {

// K and V of `p` read in place from `stored` (its views stood in for key and value: the
// strides are the blocks' already).
void attach_stored_keys(SdpaParams& p, const StoredKeys& stored) {
  const TensorView& kb = stored.key_blocks;
  p.kv_format = kb.dtype;
  if (kb.dtype == DType::kFloat32) {
    p.key = stored.key_blocks.data_as<const float>();
    p.value = stored.value_blocks.data_as<const float>();
  } else {
    p.key = p.value = nullptr;
    p.key_stored = stored.key_blocks.data;
    p.value_stored = stored.value_blocks.data;
  }
  p.key_len = stored.length;
  p.block_table = stored.table;
  p.block_size = kb.shape[1];
  p.block_rows = stored.block_rows();
  // Scales (num_blocks, block_size, Hkv): one per (slot, head).
  const auto scale_strides = [&](const TensorView& scales) {
    OperandStrides s;
    s.batch[kMaxBatchRank - 1] = scales.strides[2];
    s.row = scales.strides[1];
    return s;
  };
  if (stored.key_scales) {
    p.key_scales = stored.key_scales->data_as<const float>();
    p.key_scale_strides = scale_strides(*stored.key_scales);
    p.value_scales = stored.value_scales->data_as<const float>();
    p.value_scale_strides = scale_strides(*stored.value_scales);
  }
}

void run(const TensorView& query, const TensorView& key, const TensorView& value,
         const Problem& problem, const AttentionOutputViews& outputs,
         const AttentionOptions& options, const StoredKeys* stored = nullptr) {
  KernelInputs inputs;
  SdpaParams p = make_params(query, key, value, problem, options, inputs);
  if (stored) attach_stored_keys(p, *stored);

  std::optional<Tensor> output_copy, weights_copy, lse_copy;
  const TensorView out = writable_kernel_float(outputs.output, output_copy);
  p.output = out.data_as<float>();
  p.output_strides = plain_strides(out);
  if (outputs.weights) {
    const TensorView w = writable_kernel_float(*outputs.weights, weights_copy);
    p.weights = w.data_as<float>();
    p.weights_strides = plain_strides(w);
  }
  if (outputs.logsumexp) {
    p.logsumexp = outputs.logsumexp->data_as<float>();
    p.logsumexp_strides = row_vector_strides(*outputs.logsumexp);
  }

  if (p.batch * p.query_len > 0) {
    if (problem.kv_group > 1) {
      run_kernel(split_kv_heads(p, problem.kv_group), options.backend);
    } else {
      run_kernel(p, options.backend);
    }
  }

  if (output_copy) convert(output_copy->view(), outputs.output);
  if (weights_copy) convert(weights_copy->view(), *outputs.weights);
}

}  // namespace

TensorView StoredKeys::stand_in(bool value, DType dtype) const {
  const TensorView& b = value ? value_blocks : key_blocks;
  return TensorView(b.data, dtype, Shape({b.shape[2], length, b.shape[3]}),
                    Shape({b.strides[2], b.strides[1], b.strides[3]}));
}

bool StoredKeys::readable_in_place() const {
  const int64_t rows = block_rows();
  const auto fits = [&](const TensorView& t) {
    const Shape& st = t.strides;
    return t.rank() == 4 && st[3] == 1 && st[1] > 0 && st[0] == rows * st[1] && t.shape[1] <= rows;
  };
  const auto scales_fit = [&](const TensorView* s) {
    return s == nullptr ||
           (s->rank() == 3 && s->dtype == DType::kFloat32 && s->strides[0] == rows * s->strides[1]);
  };
  // float16 only where the SIMD target widens it exactly (F16C), as the dense call does.
  return rows > 0 && is_kv_format(key_blocks.dtype) && key_blocks.dtype == value_blocks.dtype &&
         key_blocks.strides[0] % key_blocks.strides[1] == 0 && fits(key_blocks) &&
         fits(value_blocks) && scales_fit(key_scales) && scales_fit(value_scales) &&
         (key_scales == nullptr) == (value_scales == nullptr) &&
         (key_blocks.dtype != DType::kFloat16 || exact_f16_widening());
}

void run_over_stored_keys(const TensorView& query, const StoredKeys& stored,
                          const AttentionOutputViews& outputs, const AttentionOptions& options) {
  // Checked as the dense problem of the query's dtype; run on float32 stand-ins (never read:
  // attach_stored_keys points the kernel at the blocks) with float32 products.
  const Problem problem = validate_inputs(query, stored.stand_in(false, query.dtype),
                                          stored.stand_in(true, query.dtype), options);
  AttentionOptions o = options;
  o.compute = ComputePrecision::kFloat32;
  run(query, stored.stand_in(false, DType::kFloat32), stored.stand_in(true, DType::kFloat32),
      problem, outputs, o, &stored);
}

}  // namespace attend::detail

namespace attend {

using detail::Problem;

AttentionResult scaled_dot_product_attention(const TensorView& query, const TensorView& key,
                                             const TensorView& value,
                                             const AttentionOptions& options) {
  const Problem problem = detail::validate_inputs(query, key, value, options);
  AttentionResult result;
  AttentionOutputViews outputs;
  if (options.need_weights) {
    const auto count = static_cast<uint64_t>(problem.scores_shape.numel());
    if (count > options.max_weights_bytes / sizeof(float)) {  // count · 4 may not fit 64 bits
      const std::string bytes =
          count <= UINT64_MAX / sizeof(float) ? std::to_string(count * sizeof(float)) : "over 2^64";
      throw Error("weights " + problem.scores_shape.str() + " would take " + bytes +
                  " bytes, over the limit of " + std::to_string(options.max_weights_bytes) +
                  " (max_weights_bytes)");
    }
    result.weights = Tensor(DType::kFloat32, problem.scores_shape);
    outputs.weights = result.weights.view();
  }
  if (options.need_logsumexp) {
    const Shape& s = problem.scores_shape;
    result.logsumexp = Tensor(DType::kFloat32, Shape::from(s.data(), s.rank() - 1));
    outputs.logsumexp = result.logsumexp.view();
  }
  result.output = Tensor(query.dtype, problem.output_shape);
  outputs.output = result.output.view();
  detail::run(query, key, value, problem, outputs, options);
  return result;
}

void scaled_dot_product_attention_into(const TensorView& query, const TensorView& key,
                                       const TensorView& value, const AttentionOutputViews& outputs,
                                       const AttentionOptions& options) {
  const Problem problem = detail::validate_inputs(query, key, value, options);
  detail::check_output("output", outputs.output, problem.output_shape, query.dtype, query, key,
                       value, options);
  if (outputs.weights) {
    detail::check_output("weights", *outputs.weights, problem.scores_shape, DType::kFloat32, query,
                         key, value, options);
    if (detail::overlaps(*outputs.weights, outputs.output)) {
      throw Error("weights overlaps the memory of output");
    }
  }
  if (outputs.logsumexp) {
    detail::check_logsumexp("logsumexp", *outputs.logsumexp, problem.scores_shape);
    detail::check_output("logsumexp", *outputs.logsumexp, outputs.logsumexp->shape, DType::kFloat32,
                         query, key, value, options);
    if (detail::overlaps(*outputs.logsumexp, outputs.output) ||
        (outputs.weights && detail::overlaps(*outputs.logsumexp, *outputs.weights))) {
      throw Error("logsumexp overlaps the memory of another output");
    }
  }
  detail::run(query, key, value, problem, outputs, options);
}

void scaled_dot_product_attention_into(const TensorView& query, const TensorView& key,
                                       const TensorView& value, const TensorView& output,
                                       const TensorView* weights, const AttentionOptions& options) {
  AttentionOutputViews outputs;
  outputs.output = output;
  if (weights) outputs.weights = *weights;
  scaled_dot_product_attention_into(query, key, value, outputs, options);
}

std::string attention_kernel(const TensorView& query, const TensorView& key,
                             const TensorView& value, const AttentionOptions& options) {
  const Problem problem = detail::validate_inputs(query, key, value, options);
  detail::KernelInputs inputs;
  detail::SdpaParams p = detail::make_params(query, key, value, problem, options, inputs);
  // The plan only asks whether weights are written (they rule out the key split).
  float unused = 0;
  if (options.need_weights) p.weights = &unused;
  if (problem.kv_group > 1) p = detail::split_kv_heads(p, problem.kv_group);
  return detail::chosen_kernel(p, options.backend);
}

double attention_flops(int64_t batch, int64_t query_len, int64_t key_len, int64_t head_dim,
                       int64_t value_dim, bool causal) {
  const double pairs =
      static_cast<double>(batch) * static_cast<double>(query_len) * static_cast<double>(key_len);
  const double flops = 2.0 * pairs * static_cast<double>(head_dim + value_dim);
  return causal ? flops / 2 : flops;
}

}  // namespace attend
