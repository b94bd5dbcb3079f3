// paged_attention.hpp: attention over K/V blocks through block tables, shared by
// paged_attention_into and PagedKvCache::attend (paged_attention.cpp).
#pragma once

#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"

namespace attend::detail {

// query (total queries, H, E) packed by cu_seqlens_q; key_blocks/value_blocks (num_blocks,
// block_size, Hkv, E/Ev) views; block_tables (B, max blocks) int32; seq_lens (B,) int32.
// shared_blocks: a block may appear in several sequences' tables (forked sequences of one
// PagedKvCache, read only here). key_scales/value_scales: (num_blocks, block_size, Hkv) float32
// for the scaled formats (int8, float8), else null.
void paged_attention(const TensorView& query, const TensorView& cu_seqlens_q,
                     const TensorView& key_blocks, const TensorView& value_blocks,
                     const TensorView& block_tables, const TensorView& seq_lens,
                     const TensorView& output, const AttentionOptions& options,
                     const TensorView* logsumexp, const TensorView* key_mass, bool shared_blocks,
                     const TensorView* key_scales = nullptr,
                     const TensorView* value_scales = nullptr);

}  // namespace attend::detail
