// attend/rope.hpp: rotary position embeddings (RoPE, Su et al. 2021), applied in place to
// queries and keys before attention.
//
// For a head of dimension D (rotary_dim R <= D rotated, the rest left alone), pair k in
// [0, R/2) turns by the angle pos·θ_k, θ_k = base^(−2k/R):
//
//   (a, b) → (a·cos − b·sin, b·cos + a·sin)
//
// where the pair is (x[k], x[k + R/2]) in the half-split convention (GPT-NeoX, Hugging Face
// Llama's rotate_half) or (x[2k], x[2k+1]) in the interleaved one (GPT-J, Meta's Llama).
// cos and sin are computed in float64 and each output rounded once.
#pragma once

#include <cstdint>

#include "attend/tensor.hpp"

namespace attend {

enum class RopeConvention : uint8_t {
  kHalfSplit,    // pairs (x[k], x[k + R/2])
  kInterleaved,  // pairs (x[2k], x[2k + 1])
};

struct RopeOptions {
  double base = 10000.0;  // > 0, finite
  RopeConvention convention = RopeConvention::kHalfSplit;
  // Leading dimensions rotated (partial rotary, GPT-NeoX's rotary_pct); 0: all of D. Even.
  int64_t rotary_dim = 0;
};

// x (..., L, D) float32, float16 or bfloat16, any strides: the token at index l of the
// second-to-last dimension has position position_offset + l (>= 0). For a (B, L, H, D)
// tensor pass the (B, H, L, D) view of it.
void apply_rope(const TensorView& x, int64_t position_offset, const RopeOptions& options = {});

// x (tokens, ..., D), e.g. a packed (total, H, D) ragged batch: token t (the first dimension)
// has position positions[t]; positions int32 or int64 (tokens), each >= 0.
void apply_rope_at(const TensorView& x, const TensorView& positions,
                   const RopeOptions& options = {});

}  // namespace attend
