// attend/sdpa.hpp: scaled dot-product attention, the listing of the seed documents.
//
//   scores  = Q·Kᵀ · scale (+ bias)                          (..., Lq, Lk)
//   scores  = scores.masked_fill(excluded, -1e9)              mask == 0, or causal
//   weights = softmax(scores, dim = -1)
//   weights = dropout(weights, p)                             zero w.p. p, else / (1 - p)
//   output  = weights · V                                     (..., Lq, Ev)
//
// Shapes: query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev) with 0 to 4 leading batch
// dimensions, equal across query, key and value, except that the last batch dimension (the
// heads) of key and value may be Hkv dividing query's H: grouped-query attention (multi-query
// for Hkv = 1), query head h reading K/V head h / (H / Hkv), without copying K or V (at most
// 3 batch dimensions then). mask and bias broadcast to (..., Lq, Lk).
// The variants of the score (causal alignment, sliding window, ALiBi, softcap, sinks,
// documents, prefix-LM, user rules) and the order they apply in: attend/score_rules.hpp; the
// options of a call (AttentionOptions): attend/attention_options.hpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "attend/attention_options.hpp"
#include "attend/tensor.hpp"

namespace attend {

struct AttentionResult {
  Tensor output;   // (..., Lq, Ev), dtype of query
  Tensor weights;  // (..., Lq, Lk) float32 when need_weights, else empty
  // (..., Lq) float32 when need_logsumexp, else empty: lse_i = log Σ_j exp(s_ij) over the
  // scores after masking (natural log). Rows with every key excluded: -1e9 + log(Lk) for
  // FullyMaskedRows::kUniform (what the listing's scores give), -inf for kZero.
  Tensor logsumexp;
};

// Validates every argument (throws attend::Error naming the problem), then runs.
AttentionResult scaled_dot_product_attention(const TensorView& query, const TensorView& key,
                                             const TensorView& value,
                                             const AttentionOptions& options = {});

// Same, writing into caller-provided views: `output` (..., Lq, Ev) of query's dtype and,
// when `weights` is not null, float32 (..., Lq, Lk). Outputs may be strided (e.g. the
// (batch, length, heads, dim) layout of a multi-head module) but must not overlap an input.
void scaled_dot_product_attention_into(const TensorView& query, const TensorView& key,
                                       const TensorView& value, const TensorView& output,
                                       const TensorView* weights,
                                       const AttentionOptions& options = {});

// All the outputs of one call, as caller-provided views: output (..., Lq, Ev) of query's
// dtype; optional weights float32 (..., Lq, Lk) and logsumexp float32 (..., Lq).
struct AttentionOutputViews {
  TensorView output;
  std::optional<TensorView> weights;
  std::optional<TensorView> logsumexp;
};
void scaled_dot_product_attention_into(const TensorView& query, const TensorView& key,
                                       const TensorView& value, const AttentionOutputViews& outputs,
                                       const AttentionOptions& options = {});

// The implementation a call with these arguments runs on this CPU (and SIMD cap): "fused
// short keys" (at most 8 queries against at most 16 keys per head, up to 8 lanes), "fused
// rows" (few queries per head: lanes along E), "fused tiles" (queries along the lanes),
// "fused grouped-query tiles" (few queries per head, but the G query heads sharing a K/V head
// give G·Lq rows: one query tile over them), each with " + key split (N chunks)" (few work
// items over many keys), or "reference".
// Validates the arguments as the call does.
std::string attention_kernel(const TensorView& query, const TensorView& key,
                             const TensorView& value, const AttentionOptions& options = {});

// FLOP count of one call: 4·batch·Lq·Lk·E for E == Ev (2·Lq·Lk·E for Q·Kᵀ and 2·Lq·Lk·Ev
// for weights·V), halved (approximately) for causal. The one formula used by every
// benchmark.
double attention_flops(int64_t batch, int64_t query_len, int64_t key_len, int64_t head_dim,
                       int64_t value_dim, bool causal);

}  // namespace attend
