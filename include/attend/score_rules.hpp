// attend/score_rules.hpp: the variants of the score, as options of AttentionOptions.
//
// Every path (reference, fused forward, fused backward) turns a raw score into the score that
// enters the softmax by the same steps, in this order, for batch index b, head h (the last
// batch dimension), query i and key j, with i' = i + offset the query's aligned position
// (offset = Lk − Lq for CausalAlignment::kBottomRight, 0 for kTopLeft). For one block of a
// larger problem (AttentionOptions::block), i and j are global positions and Lq, Lk the
// whole problem's lengths:
//
//   1. s = (q_i · k_j) · scale
//   2. s = cap · tanh(s / cap)                        softcap (Gemma 2)
//   3. s = s + bias_ij                                bias
//   4. s = s + slope_h · (j − i')                     ALiBi (Press et al. 2022)
//   5. s = score_mod(s, b, h, i, j)                   a user rule (attend/score_mod.hpp)
//   6. s = -1e9 where key j is excluded, as the listing's masked_fill:
//        causal        j > i'
//        window        j < i' − left  or  j > i' + right
//        prefix-LM     keys j < P are visible whatever causal and the window say
//        documents     segment_q[i] != segment_k[j]
//        mask          mask_ij == 0
//        user rule     mask_mod(b, h, i, j) == false
//   7. softmax over the keys and, with sinks, one more logit sink_h with no value:
//        w_j = exp(s_j) / (Σ_k exp(s_k) + exp(sink_h))
//
// A row with every key excluded gets the listing's uniform weights (or zeros with
// FullyMaskedRows::kZero); with a sink its weights are exp(-1e9 − sink) = 0 and its output 0.
#pragma once

#include <cstdint>
#include <vector>

namespace attend {

// Which diagonal "causal" (and the window, and ALiBi's distance) is aligned to.
enum class CausalAlignment : uint8_t {
  // Query i sits at position i + Lk − Lq: the last query sees every key (a decoder with a KV
  // cache, FlashAttention). The default.
  kBottomRight,
  // Query i sits at position i: PyTorch's is_causal (the first query sees key 0 only).
  kTopLeft,
};

// The value of step 6: a score where its key is excluded, as `masked_fill(mask == 0, -1e9)` in
// the listing.
inline constexpr float kExcludedScore = -1e9f;

// A side of a sliding window that is not bounded.
inline constexpr int64_t kUnboundedWindow = -1;

// Query i sees key j when i' − left <= j <= i' + right (each side >= 0, or kUnboundedWindow).
// Combines with causal (which then bounds the right side at 0). Mistral: {4095, 0}.
struct SlidingWindow {
  int64_t left = kUnboundedWindow;
  int64_t right = kUnboundedWindow;
};

// ALiBi's slopes for `heads` heads, as the paper's reference code: a geometric sequence
// 2^(-8/n), 2^(-16/n), ... for the largest power of two n <= heads, then every other slope of
// the sequence for 2n for the remaining heads.
std::vector<float> default_alibi_slopes(int64_t heads);

}  // namespace attend
