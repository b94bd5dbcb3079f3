// attend/varlen.hpp: ragged batches, FlashAttention's "varlen" convention. The B sequences of
// a batch are packed one after another, without padding:
//
//   query (total_q, H, E), key (total_k, Hkv, E), value (total_k, Hkv, Ev)
//   cu_seqlens_q, cu_seqlens_k: int32 (B + 1), 0 = cu[0] <= cu[1] <= ... <= cu[B] = total
//
// Sequence s has the queries cu_seqlens_q[s] .. cu_seqlens_q[s+1] − 1 and the keys
// cu_seqlens_k[s] .. cu_seqlens_k[s+1] − 1; attention never crosses sequences. Every score
// rule of AttentionOptions (causal with either alignment, window, ALiBi, softcap, sinks,
// prefix, user rules) applies within each sequence as in a dense call on that sequence alone
// (bottom-right causal: query i of sequence s at position i + Lk_s − Lq_s), and Hkv may
// divide H (grouped-query attention). The result equals, bitwise, B dense calls on the
// sequences' (H, L, D) views. Not supported: mask, bias, segment ids (the packing is the
// document structure), dropout, need_weights.
//
// Work: no padding is computed. Sequences whose work (H·Lq·Lk) is at least a thread's share
// run one after another on all threads; the rest run in parallel, one thread each, the
// largest first. A sequence with queries but no keys is refused (softmax over no keys).
#pragma once

#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"

namespace attend {

// output (total_q, H, Ev), query's dtype; logsumexp, when given: float32 (total_q, H),
// natural log (needs no option).
void varlen_attention_into(const TensorView& query, const TensorView& key, const TensorView& value,
                           const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                           const TensorView& output, const AttentionOptions& options = {},
                           const TensorView* logsumexp = nullptr);

// Returns the output (total_q, H, Ev).
Tensor varlen_attention(const TensorView& query, const TensorView& key, const TensorView& value,
                        const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                        const AttentionOptions& options = {});

// Gradients: grad_output and output (total_q, H, Ev), logsumexp (total_q, H) from the forward;
// writes grad_query (total_q, H, E), grad_key (total_k, Hkv, E), grad_value (total_k, Hkv, Ev)
// (keys of sequences without queries get 0). dK and dV of grouped-query attention are summed
// over each group in a fixed order: bitwise the same at any thread count.
void varlen_attention_backward_into(const TensorView& grad_output, const TensorView& query,
                                    const TensorView& key, const TensorView& value,
                                    const TensorView& output, const TensorView& logsumexp,
                                    const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                    const TensorView& grad_query, const TensorView& grad_key,
                                    const TensorView& grad_value,
                                    const AttentionOptions& options = {});

}  // namespace attend
