// tiny_decoder.hpp: a small decoder-only model served from the paged KV cache.
//
// Per layer (pre-norm, as Llama): x += Wo·attention(RoPE(Wq·n), RoPE(Wk·n), Wv·n) with
// n = rmsnorm(x), K and V appended to the layer's PagedKvCache; x += W2·relu(W1·rmsnorm(x)).
// Logits = rmsnorm(x)·Embᵀ (tied embedding). H query heads share Hkv K/V heads (GQA).
// Weights are drawn from a seeded generator: the model is random, its tokens meaningless,
// but every step is the real work of a decoder.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attend/kv_cache.hpp"
#include "attend/tensor.hpp"

namespace attend::example {

struct TinyDecoderConfig {
  int64_t vocab = 256;
  int64_t model_dim = 128;
  int64_t heads = 8;
  int64_t kv_heads = 2;
  int64_t layers = 2;
  int64_t mlp_dim = 256;
  // Cache: blocks of block_size tokens, enough for every live sequence.
  int64_t cache_blocks = 1024;
  int64_t block_size = 16;
  uint64_t seed = 1;
  int num_threads = 0;  // 0: the OpenMP default
};

class TinyDecoder {
 public:
  explicit TinyDecoder(const TinyDecoderConfig& config);

  // A new request; returns its sequence id (one for every layer's cache).
  int64_t add_sequence();
  // Frees the sequence's cache blocks.
  void remove_sequence(int64_t id);

  // One step of a batch mixing prefill chunks and decodes: tokens[s] are the new tokens of
  // sequence ids[s] (a prompt or its chunk, or the one last generated token). Appends their
  // keys and values to the caches and returns the greedy next token of each sequence (the
  // argmax of its last new token's logits); logits (B, vocab) are kept for last_logits().
  std::vector<int32_t> step(const std::vector<int64_t>& ids,
                            const std::vector<std::vector<int32_t>>& tokens);
  const std::vector<float>& last_logits() const { return logits_; }

  // The logits of the last token of `tokens` computed from scratch, without the cache
  // (dense causal attention over the whole sequence): what step() must agree with.
  std::vector<float> logits_without_cache(const std::vector<int32_t>& tokens) const;

  // Bytes of key/value storage over all layers, and blocks in use.
  uint64_t cache_bytes() const;
  int64_t cache_blocks_used() const;
  const TinyDecoderConfig& config() const { return config_; }

 private:
  struct Layer {
    Tensor wq, wk, wv, wo, w1, w2;  // (out, in)
    std::unique_ptr<PagedKvCache> cache;
  };
  // A forward's intermediate (T, ·) rows, kept by step() from one step to the next so that
  // a step allocates (and the kernel zeroes pages) only when a batch is larger than before.
  struct Buffers {
    std::vector<float> normed, q, k, v, heads, hidden, scratch;
  };
  // x (T, model_dim) through the layers; positions[t] of each token; `attend_layer` runs
  // attention of layer l on q (T, H, E), k/v (T, Hkv, E) into out (T, H, E).
  template <class Attend>
  void forward(std::vector<float>& x, const std::vector<int64_t>& positions,
               const Attend& attend_layer, Buffers& buffers) const;
  // Logits (rows.size(), vocab) of the rows `rows` of x.
  std::vector<float> logits_of(const std::vector<float>& x, const std::vector<int64_t>& rows,
                               Buffers& buffers) const;

  TinyDecoderConfig config_;
  int64_t head_dim_;
  Tensor embedding_;  // (vocab, model_dim)
  std::vector<Layer> layers_;
  std::vector<float> logits_;
  Buffers buffers_;
};

}  // namespace attend::example
