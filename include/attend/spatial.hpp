// attend/spatial.hpp: attention over image feature maps.
//
// SpatialSelfAttention is the attention block of a denoising U-Net: every pixel of an
// (N, C, H, W) map is a token of C features, so a (1, 128, 64, 64) map is a sequence of 4096
// tokens. PatchEmbedding is the front of a vision transformer: non-overlapping p x p patches
// become tokens.
#pragma once

#include <cstdint>

#include "attend/multihead.hpp"
#include "attend/tensor.hpp"

namespace attend {

struct SpatialAttentionOptions {
  // GroupNorm groups before attention (channels must be divisible by it); 0 disables the norm.
  int64_t group_norm_groups = 32;
  double eps = 1e-5;
};

// output = x + MHA(t, t, t) mapped back to (N, C, H, W), where t = flatten(GroupNorm(x)):
//   (N, C, H, W) -> GroupNorm -> (N, H·W, C) -> self-attention -> (N, C, H, W) -> + x
class SpatialSelfAttention {
 public:
  SpatialSelfAttention(int64_t channels, int64_t num_heads,
                       const SpatialAttentionOptions& options = {}, uint64_t seed = 0);

  // x: (N, C, H, W) float32, float16 or bfloat16 (any strides). Returns (N, C, H, W) float32,
  // or bfloat16 for a bfloat16 x where the CPU has bfloat16 products (then the projections and
  // the attention run in them, as MultiHeadForwardOptions::compute describes; GroupNorm and
  // the residual stay float32).
  Tensor forward(const TensorView& x, int num_threads = 0) const;

  MultiHeadAttention& attention() { return attention_; }
  const MultiHeadAttention& attention() const { return attention_; }
  // GroupNorm's affine parameters (C), writable; initialized to ones and zeros. Empty views
  // when the norm is disabled.
  TensorView norm_weight() const { return norm_weight_.view(); }
  TensorView norm_bias() const { return norm_bias_.view(); }
  int64_t channels() const { return channels_; }

 private:
  int64_t channels_;
  SpatialAttentionOptions options_;
  MultiHeadAttention attention_;
  Tensor norm_weight_, norm_bias_;
};

struct PatchEmbeddingOptions {
  bool class_token = true;          // prepend a learned (D) token
  bool position_embeddings = true;  // add a learned (1 + patches, D) table
  // Image size the position table is built for; required when position_embeddings is true
  // (forward then accepts only this size).
  int64_t image_height = 0;
  int64_t image_width = 0;
};

// (N, C, H, W) -> (N, [1 +] P, D), P = (H / p)·(W / p) patches in row-major order: a
// convolution with kernel = stride = p, computed as one GEMM over flattened patches.
class PatchEmbedding {
 public:
  PatchEmbedding(int64_t in_channels, int64_t patch_size, int64_t embed_dim,
                 const PatchEmbeddingOptions& options = {}, uint64_t seed = 0);

  // x: (N, C, H, W) float32, float16 or bfloat16, H and W multiples of patch_size.
  Tensor forward(const TensorView& x, int num_threads = 0) const;

  // Writable parameters: projection weight (D, C, p, p) as torch.nn.Conv2d (initialized like
  // it, U(-1/sqrt(C·p·p), 1/sqrt(C·p·p))), bias (D), class token (D) and position table
  // (1 + P or P, D), both N(0, 0.02²). Absent parts are empty views.
  TensorView projection_weight() const { return weight_.view(); }
  TensorView projection_bias() const { return bias_.view(); }
  TensorView class_token() const { return class_token_.view(); }
  TensorView position_embeddings() const { return positions_.view(); }

 private:
  int64_t in_channels_, patch_size_, embed_dim_;
  PatchEmbeddingOptions options_;
  Tensor weight_, bias_, class_token_, positions_;
};

}  // namespace attend
