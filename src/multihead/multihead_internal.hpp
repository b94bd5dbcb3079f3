// multihead_internal.hpp: what MultiHeadAttention's forward (multihead.cpp) and backward
// (multihead_backward.cpp) share: validation, the attention mask, float32 row matrices, the
// projection GEMM and the per-head views of projected tensors.
#pragma once

#include <cstdint>
#include <optional>

#include "attend/multihead.hpp"
#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"

namespace attend::detail {

bool same_view(const TensorView& a, const TensorView& b);

// The sizes of one call, after validation. Unbatched inputs are treated as N = 1.
struct MultiHeadProblem {
  bool batched = true;
  int64_t batch = 0;      // N
  int64_t query_len = 0;  // L
  int64_t key_len = 0;    // S
  int64_t embed_dim = 0;  // E
  int64_t num_heads = 0;  // H
  int64_t head_dim = 0;   // D = E / H
  int num_threads = 1;    // resolved (never 0)
  // Shape of forward()'s output and of backward()'s grad_output: (N, L, E) or (L, E).
  Shape output_shape() const;
};

// Checks query (N, L, E), key (N, S, kdim), value (N, S, vdim) (or unbatched, all 2-D):
// ranks, strides, dtypes, batch sizes, feature sizes, S > 0. attend::Error naming the problem.
MultiHeadProblem validate_multihead_inputs(const TensorView& query, const TensorView& key,
                                           const TensorView& value, int64_t embed_dim,
                                           int64_t num_heads, int64_t kdim, int64_t vdim,
                                           int num_threads);

// How the forward groups the input projections: one GEMM per distinct input.
enum class ProjectionGrouping {
  kPackedSelf,    // query, key, value one view, packed in_proj: QKV (N, L, 3, H, D)
  kPackedMemory,  // key and value one view, packed in_proj: Q (N, L, H, D), KV (N, S, 2, H, D)
  kSeparate,      // Q (N, L, H, D), K (N, S, H, D), V (N, S, H, D)
};
ProjectionGrouping projection_grouping(const TensorView& query, const TensorView& key,
                                       const TensorView& value, bool packed_in_projection);

// key_padding_mask and attn_mask combined as one (N, 1 or H, L, S) view for the attention,
// broadcast through zero strides; `storage` holds the combined uint8 mask when both are given.
// Validates both masks (attend::Error naming the mask).
struct AttentionMask {
  std::optional<TensorView> view;
  Tensor storage;
};
AttentionMask build_attention_mask(const MultiHeadForwardOptions& options,
                                   const MultiHeadProblem& problem);

// The options of the one SDPA call over every head (forward and backward alike).
AttentionOptions attention_options(const MultiHeadForwardOptions& options,
                                   const AttentionMask& mask, int num_threads);

// A (rows, features) matrix with column stride 1 over the (N, L, F) or (L, F) view `x`, in
// float32 (data) or, with `bf16`, in bfloat16 (data_bf16, for bfloat16 products): `x` itself
// when its dtype and layout allow, else a converted copy kept in `storage`.
struct RowMatrix {
  const float* data = nullptr;
  int64_t row_stride = 0;
  const uint16_t* data_bf16 = nullptr;  // instead of data
};
RowMatrix as_row_matrix(const TensorView& x, Tensor& storage, bool bf16 = false);

// output(rows, out) = input(rows, in) · weight(out, in)ᵀ + bias(out); weight row stride `in`.
// A bfloat16 input takes the products the precision policy gives the projections
// (boundary/operands.hpp, ProductSite::kProjections, as for kAuto): AMX tiles where the CPU
// has them, AVX512_BF16 on AMD, float32 products on the bfloat16 values on Intel without AMX.
void project(const RowMatrix& input, int64_t rows, const float* weight, int64_t out_features,
             int64_t in_features, const float* bias, float* output, int64_t output_row_stride,
             int num_threads);

// One projected tensor (Q, K or V, or a gradient of one): token t of batch n, head h starts at
// data + n·batch_stride + t·token_stride + h·D.
struct Projected {
  const float* data = nullptr;
  int64_t batch_stride = 0;
  int64_t token_stride = 0;

  // The (N, H, length, D) view the attention call reads or writes.
  TensorView heads_view(int64_t batch, int64_t heads, int64_t length, int64_t head_dim) const {
    return TensorView(const_cast<float*>(data), DType::kFloat32,
                      Shape({batch, heads, length, head_dim}),
                      Shape({batch_stride, head_dim, token_stride, 1}));
  }
  // The same view into `copy`, a converted copy (any dtype) of the tensor starting at `base`.
  TensorView heads_view_in(const Tensor& copy, const float* base, int64_t batch, int64_t heads,
                           int64_t length, int64_t head_dim) const {
    TensorView view = heads_view(batch, heads, length, head_dim);
    view.data = static_cast<char*>(const_cast<void*>(copy.data())) +
                (data - base) * static_cast<int64_t>(dtype_size(copy.dtype()));
    view.dtype = copy.dtype();
    return view;
  }
};

}  // namespace attend::detail
