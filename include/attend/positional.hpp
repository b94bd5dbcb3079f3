// attend/positional.hpp: what gives attention its notion of order and of words.
//
// Attention alone is blind to position; a Transformer adds a positional encoding to the token
// embeddings before the first projection:
//   PE(pos, 2i)     = sin(pos / 10000^(2i/d))
//   PE(pos, 2i + 1) = cos(pos / 10000^(2i/d))
#pragma once

#include <cstdint>

#include "attend/tensor.hpp"

namespace attend {

// The sinusoidal encoding of positions [offset, offset + length), float32 (length, dim).
// Computed in float64, rounded once. dim may be odd (the last column is a sine).
Tensor sinusoidal_positional_encoding(int64_t length, int64_t dim, int64_t offset = 0);

// x += encoding, in place, broadcast over the batch: x float32 (N, L, d) or (L, d) (any
// strides, no overlapping elements), encoding float32 (L, d) (e.g. rows [0, L) of a table).
void add_positional_encoding(const TensorView& x, const TensorView& encoding);

// A learned table of position vectors (max_length, dim), initialized N(0, 0.02²) from `seed`
// (as ViT and GPT-2 do). forward(L, offset) returns rows [offset, offset + L).
class PositionEmbedding {
 public:
  PositionEmbedding(int64_t max_length, int64_t dim, uint64_t seed = 0);
  Tensor forward(int64_t length, int64_t offset = 0) const;  // (length, dim)
  TensorView table() const { return table_.view(); }         // writable (max_length, dim)

 private:
  Tensor table_;
};

// Token embeddings: a (vocab_size, dim) table initialized N(0, 1) from `seed` (as
// torch.nn.Embedding). forward(ids) maps integer ids (..., L) to float32 (..., L, dim); an id
// outside [0, vocab_size) is an attend::Error naming it and its position.
class TokenEmbedding {
 public:
  TokenEmbedding(int64_t vocab_size, int64_t dim, uint64_t seed = 0);
  Tensor forward(const TensorView& ids) const;
  TensorView table() const { return table_.view(); }  // writable (vocab_size, dim)
  int64_t vocab_size() const { return table_.shape()[0]; }
  int64_t dim() const { return table_.shape()[1]; }

 private:
  Tensor table_;
};

}  // namespace attend
