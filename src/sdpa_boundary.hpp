// sdpa_boundary.hpp: validation and normalization shared by the forward (sdpa.cpp) and the
// backward (sdpa_backward.cpp) API boundaries: public views in, one SdpaParams out.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"
#include "sdpa_params.hpp"

namespace attend::detail {

struct Problem {
  Shape scores_shape;  // (batch..., Lq, Lk)
  Shape output_shape;  // (batch..., Lq, Ev)
  // Query heads per K/V head (grouped-query attention, grouped_query.hpp); 1 without.
  int64_t kv_group = 1;
};

// float32, float16 or bfloat16: what query, key, value, bias (and dO, O) may be.
bool is_attention_float(DType d);
// "name (2, 3, 4)"
std::string describe(const char* name, const TensorView& t);
// Null data, rank/stride mismatch, negative sizes or strides, byte offsets that overflow.
void check_view(const char* name, const TensorView& t);
// Bytes from a view's first element to one past the last it can touch (0 when empty): fixed
// by shape, strides and dtype, so a plan computes it once (plan.cpp).
int64_t byte_extent(const TensorView& t);
// Byte range [first, last) that a view can touch; empty views touch nothing (null first).
struct ByteRange {
  const char* first = nullptr;
  const char* last = nullptr;
};
ByteRange byte_range(const TensorView& t);
// [data, data + extent): a view's range from its byte_extent (a plan's, computed once).
ByteRange byte_range(const void* data, int64_t extent);
bool ranges_overlap(const ByteRange& a, const ByteRange& b);
bool overlaps(const TensorView& a, const TensorView& b);
// Strides (elements) of a view broadcast to (batch..., rows, columns) = `target`.
OperandStrides broadcast_strides(const char* name, const TensorView& t, const Shape& target);
// Strides of a (batch..., rows, columns) view whose column stride is 1.
OperandStrides plain_strides(const TensorView& t);
// Strides of a (batch..., rows) view: `row` steps along the last dimension.
OperandStrides row_vector_strides(const TensorView& t);
// The view when it is float32 with a contiguous last dimension, else a float32 copy.
TensorView as_kernel_float(const TensorView& t, std::optional<Tensor>& storage);
// An output to write: the view itself when it is float32 with a contiguous last dimension,
// else a float32 staging tensor in `storage` (the caller converts it back afterwards).
TensorView writable_kernel_float(const TensorView& out, std::optional<Tensor>& storage);

// Checks query, key, value, mask, bias and the options; the shapes of scores and output.
Problem validate_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                        const AttentionOptions& options);
// An output view: shape, dtype, no zero strides, no overlap with an input.
void check_output(const char* name, const TensorView& out, const Shape& expected, DType dtype,
                  const TensorView& q, const TensorView& k, const TensorView& v,
                  const AttentionOptions& options);
// A (..., Lq) float32 logsumexp view.
void check_logsumexp(const char* name, const TensorView& lse, const Shape& scores_shape);

// Converted copies of inputs that were not float32 with a contiguous last dimension.
// Converted copies of the score rules' inputs (float32 slopes and sinks, int32 segment ids).
struct ScoreRuleInputs {
  std::optional<Tensor> alibi_slopes, sinks, segment_query, segment_key;
  std::vector<float> default_slopes;
};
struct KernelInputs {
  std::optional<Tensor> query, key, value, mask, bias;
  ScoreRuleInputs rules;
};
// The precision policy: whether inputs of `input_dtype` computed at `compute`
// (AttentionOptions::compute) take bfloat16 products: kBFloat16 always, kAuto for bfloat16
// inputs where the CPU has them (cpu_features.hpp). attend::Error for kBFloat16 or kFloat16
// without their instructions, naming why. Used by make_params and by the layers that choose
// their projections' operands (multihead, spatial).
bool wants_bf16_products(DType input_dtype, ComputePrecision compute);
// Whether `compute` asks for float16 products (kFloat16 only: never chosen by kAuto, since
// they accumulate in float16 for a while: kernels/isa/avx512_fp16-inl.h); attend::Error where
// the CPU (or the SIMD cap) has no AVX512_FP16.
bool wants_f16_products(ComputePrecision compute);

// SdpaParams with sizes, inputs, mask, bias and options filled (outputs null); the inputs in
// the precision of the products (AttentionOptions::compute): float32, or bfloat16 or float16
// for the forward's query tiles (never `for_backward`; float16 only where its chains stay
// finite, else float32 products on the float16 operands). attend::Error for a precision the CPU lacks.
SdpaParams make_params(const TensorView& query, const TensorView& key, const TensorView& value,
                       const Problem& problem, const AttentionOptions& options,
                       KernelInputs& storage, bool for_backward = false);

// K and V read in place from block storage (a paged cache's blocks; the key spans of
// sdpa_params.hpp): blocks (num_blocks, block_size, Hkv, D) of any K/V format (kv_format.hpp)
// whose last dimension is contiguous and whose block stride is a whole number of row
// strides, the same for K, V and the scales (readable_in_place); the `length` keys at the
// rows the block table `table` names (table[n]: the block of keys [n·block_size, ...)); the
// scaled formats' scales (num_blocks, block_size, Hkv), null otherwise.
struct StoredKeys {
  TensorView key_blocks, value_blocks;
  const TensorView* key_scales = nullptr;
  const TensorView* value_scales = nullptr;
  const int32_t* table = nullptr;
  int64_t length = 0;
  // A view (Hkv, length, D) of `dtype` with the blocks' strides, for the checks of the dense
  // problem (never read).
  TensorView stand_in(bool value, DType dtype) const;
  // Rows from one block to the next (SdpaParams::block_rows); 0 for a row stride of 0.
  int64_t block_rows() const {
    return key_blocks.strides[1] > 0 ? key_blocks.strides[0] / key_blocks.strides[1] : 0;
  }
  // Whether the kernels can read these blocks in place (else a gathered copy).
  bool readable_in_place() const;
};

// scaled_dot_product_attention_into of `query` (H, Lq, E) over the stored keys: validated as
// the dense problem, float32 products on K and V widened in registers (row groups), outputs
// checked by the caller.
void run_over_stored_keys(const TensorView& query, const StoredKeys& stored,
                          const AttentionOutputViews& outputs, const AttentionOptions& options);

}  // namespace attend::detail
