// attend/kv_cache.hpp: a paged key/value cache (vLLM's layout) and attention over it.
//
// Storage: fixed-size blocks, key_blocks (num_blocks, block_size, Hkv, E) and value_blocks
// (num_blocks, block_size, Hkv, Ev), float32, float16 or bfloat16, or int8, float8_e4m3 or
// float8_e5m2 with a float32 scale per token and head (num_blocks, block_size, Hkv): a
// PagedKvCache's own, or the caller's (key_scales, value_scales). A sequence's tokens
// live in the blocks its block table lists: token t at block_table[t / block_size], row
// t % block_size. Leading entries may be -1: blocks evicted by a sliding window (the
// sequence's // first of its first listed block).
//
// paged_attention_into runs a batch that mixes prefill chunks and single-token decodes: the
// queries are packed as in attend/varlen.hpp (query (total_q, H, E), cu_seqlens_q); sequence
// s attends to its seq_lens[s] cached tokens (the new ones already appended), its queries
// being the last Lq_s of them: causal (bottom-right, the default alignment) puts query i at
// position seq_lens[s] − Lq_s + i. Every score rule of AttentionOptions applies per sequence
// as in a dense call on the sequence's cached keys (not: mask, bias, segment ids, dropout,
// need_weights; prefix and top-left alignment not with evicted blocks), and Hkv may divide H.
// The result is that of the dense call on the listed keys (see below for how exactly).
//
// Bad block tables (entries out of range, a block listed twice in the batch, too few entries
// for a length, -1 after a listed block) are refused with attend::Error before anything is
// read from the blocks or written to the output. (PagedKvCache::attend lets forked sequences
// share blocks: it knows they are read only.)
//
// How a sequence's keys are read: up to 16 queries per sequence (decoding, speculative
// verification), the kernel reads the blocks in place through the block table, whatever
// their order, widening half-precision and quantized formats in registers (float32
// products on the stored values: the same results as the dense call on the widened
// keys, to float32 rounding). Longer chunks of queries (prefill) gather the sequence's kept
// keys into a contiguous copy of the query's dtype (quantized formats dequantized) and run
// the dense call on it (bitwise).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "attend/rope.hpp"
#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"

namespace attend {

// query (total_q, H, E), cu_seqlens_q int32 (B + 1); key_blocks and value_blocks as above;
// block_tables int32 (B, max_blocks_per_sequence); seq_lens int32 (B); output (total_q, H, Ev)
// of query's dtype; logsumexp float32 (total_q, H) when given.
// key_mass, when given: float32 (B, max_blocks_per_sequence · block_size), for eviction
// policies (H2O, SnapKV): entry (s, t) is the attention weight that the call's queries of
// sequence s, over all heads, give to its cached token t (Σ_h Σ_i w_hit); 0 past the length
// and for evicted tokens. It costs a pass that materializes each sequence's weights
// (H, Lq, Lk kept) as need_weights does.
// key_scales and value_scales: for blocks of int8, float8_e4m3 or float8_e5m2 (and only for
// those), float32 (num_blocks, block_size, Hkv), one scale per token and head as
// PagedKvCache keeps them: stored code x stands for scale · x (kv_format.hpp). Every scale a
// call reads (the listed tokens') must be finite.
void paged_attention_into(const TensorView& query, const TensorView& cu_seqlens_q,
                          const TensorView& key_blocks, const TensorView& value_blocks,
                          const TensorView& block_tables, const TensorView& seq_lens,
                          const TensorView& output, const AttentionOptions& options = {},
                          const TensorView* logsumexp = nullptr,
                          const TensorView* key_mass = nullptr,
                          const TensorView* key_scales = nullptr,
                          const TensorView* value_scales = nullptr);

struct KvCacheConfig {
  int64_t num_blocks = 0;  // >= 1
  int64_t block_size = 16;
  int64_t kv_heads = 1;
  int64_t head_dim = 64;
  int64_t value_dim = 0;  // 0: head_dim
  // float32, float16 or bfloat16; or a quantized format with one float32 scale per token
  // and head (key_scales(), value_scales()): x ≈ scale·q, scale = max|x| / max_code over the
  // head's E: int8 (max_code 127, q rounded to nearest), float8_e4m3 (448) or float8_e5m2
  // (57344), q rounded to nearest even. Every format is read in place by decoding.
  DType dtype = DType::kFloat32;
};

// A cache with its block tables and free list. Thread safety: the bookkeeping is behind a
// mutex, so threads may add, append to, evict, attend over and remove *different* sequences
// at once; appending to a sequence while another thread appends to or attends over the same
// one is refused (attend::Error), not raced.
class PagedKvCache {
 public:
  explicit PagedKvCache(const KvCacheConfig& config);

  const KvCacheConfig& config() const { return config_; }
  // (num_blocks, block_size, Hkv, E) and (num_blocks, block_size, Hkv, Ev) views of the
  // storage, which keeps each block's heads one after the other (Hkv, block_size, dim), as
  // vLLM's CPU cache does: a head's rows of a block are one contiguous run for decoding to
  // stream (the views' strides say so).
  TensorView key_blocks() const;
  TensorView value_blocks() const;
  // int8 caches: (num_blocks, block_size, Hkv) float32 scales; empty views otherwise.
  TensorView key_scales() const;
  TensorView value_scales() const;
  int64_t free_blocks() const;
  // Bytes of key and value storage.
  uint64_t bytes() const {
    return keys_.nbytes() + values_.nbytes() + key_scales_.nbytes() + value_scales_.nbytes();
  }

  // A new empty sequence; returns its id.
  int64_t add_sequence();
  // A new sequence holding `id`'s tokens (beams, a shared prompt): the two share their blocks;
  // the first append to a sequence whose last block is shared and partly filled copies that
  // block first (copy on write). Returns the new id.
  int64_t fork(int64_t id);
  // Returns the sequence's blocks to the free list (those no other sequence shares).
  void remove_sequence(int64_t id);
  // Tokens appended so far (evicted ones included: positions stay absolute).
  int64_t length(int64_t id) const;
  // Block table, -1 for evicted blocks.
  std::vector<int32_t> block_table(int64_t id) const;

  // Writes the new tokens of sequences ids[s]: key (total_new, Hkv, E) and value
  // (total_new, Hkv, Ev) of any floating dtype, cu_seqlens int32 (B + 1) packing them.
  // Allocates blocks from the free list (lowest free index first); a cache without enough
  // free blocks is refused before anything is written. With `rope`, the keys are rotated
  // (attend/rope.hpp) at their positions in their sequence (its length before the append,
  // plus their index among its new tokens) as they are written; `key` itself is not changed.
  void append(const std::vector<int64_t>& ids, const TensorView& key, const TensorView& value,
              const TensorView& cu_seqlens, const RopeOptions* rope = nullptr);

  // Returns to the free list the blocks of `id` whose every token is older than the last
  // `window` tokens (j < length − window): what a sliding window of that size never sees
  // again from the next query on.
  void evict_outside_window(int64_t id, int64_t window);

  // Attention of the batch: sequence s = ids[s] has the packed queries of cu_seqlens_q
  // (the last of its cached tokens), as paged_attention_into. Quantized caches are read in
  // place too (decoding: scale·q widened in registers); a longer chunk of queries, and
  // key_mass, read a dequantized copy (scale·q in float32, then the query's dtype).
  void attend(const std::vector<int64_t>& ids, const TensorView& query,
              const TensorView& cu_seqlens_q, const TensorView& output,
              const AttentionOptions& options = {}, const TensorView* logsumexp = nullptr,
              const TensorView* key_mass = nullptr) const;

 private:
  struct Sequence {
    int64_t length = 0;
    std::vector<int32_t> blocks;  // -1: evicted
    mutable int readers = 0;      // attend() calls in flight (const: attend is const)
    bool writing = false;
  };
  Sequence& find(int64_t id);
  const Sequence& find(int64_t id) const;
  int32_t take_block();
  void release_block(int32_t block);  // one sharer fewer; free at none
  // Whether appending `count` tokens writes into a partly filled block another sequence
  // shares, and the copy that gives `seq` its own.
  bool shared_tail(const Sequence& seq, int64_t count) const;
  void copy_tail_block(Sequence& seq);

  KvCacheConfig config_;
  Tensor keys_, values_;
  Tensor key_scales_, value_scales_;  // quantized formats only
  mutable std::mutex mutex_;
  std::vector<int32_t> free_;     // kept sorted descending: the lowest index is at the back
  std::vector<int32_t> sharers_;  // per block: sequences listing it (0: free)
  std::map<int64_t, Sequence> sequences_;
  int64_t next_id_ = 0;
};

}  // namespace attend
