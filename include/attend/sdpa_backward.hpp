// attend/sdpa_backward.hpp: gradients of scaled dot-product attention (the listing).
//
// With P = softmax(S), S = Q·Kᵀ·scale + bias (excluded scores replaced by -1e9), the kept
// weights P̃ = P ⊙ Z / (1 − p) (Z: the forward's dropout draws) and O = P̃·V:
//
//   dV = P̃ᵀ·dO                                  (..., Lk, Ev)
//   dP̃ = dO·Vᵀ,  dP = dP̃ ⊙ Z / (1 − p)          (..., Lq, Lk), never materialized
//   D_i = Σ_j P̃_ij·dP̃_ij = dO_i · O_i            one number per query row
//   dS = P ⊙ (dP − D), and 0 where excluded      masked_fill passes no gradient
//   dQ = scale·dS·K,  dK = scale·dSᵀ·Q,  dBias = dS summed over bias's broadcast dimensions
//   dSink_h = −Σ_i P_sink,i·D_i over the rows of head h, P_sink,i = exp(sink_h − lse_i)
//
// The score rules (attend/score_rules.hpp) pass their derivatives: softcap's 1 − tanh² and a
// user score_mod's (evaluated with attend::Dual) multiply dS on its way to Q and K (the bias
// gradient takes the user rule's only); exclusions pass no gradient.
//
// P is recomputed tile by tile from the forward's log-sum-exp (P_ij = exp(S_ij − lse_i)),
// so the backward needs O(L) extra memory (O(Lq·Lk) only for a bias gradient), and the
// dropout draws are regenerated from the seed. Rows with every key excluded: with
// FullyMaskedRows::kUniform the weights are the constant 1/Lk, so only dV receives a
// gradient from them; with kZero they pass none. Results are bitwise identical at any
// thread count (a fixed reduction order, no atomics).
#pragma once

#include <optional>

#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"

namespace attend {

struct AttentionGradients {
  Tensor query;  // dQ, the shape and dtype of query
  Tensor key;    // dK, the shape and dtype of key
  Tensor value;  // dV, the shape and dtype of value
  Tensor bias;   // dBias, the shape and dtype of options.bias; empty without a bias
  Tensor sinks;  // dSinks (H), the dtype of options.sinks; empty without sinks
};

// Caller-provided gradient views (any strides with a contiguous last dimension is fastest;
// they must not overlap each other or an input). `bias` is computed only when present.
struct AttentionGradientViews {
  TensorView query;
  TensorView key;
  TensorView value;
  std::optional<TensorView> bias;
  std::optional<TensorView> sinks;
};

// grad_output (..., Lq, Ev) and output (..., Lq, Ev): dO and the forward's O, dtype of query.
// logsumexp (..., Lq) float32: the forward's (AttentionOptions::need_logsumexp).
// query, key, value and `options` as given to the forward (mask, bias, causal, scale,
// fully_masked_rows, dropout and seed must be the same; need_weights is ignored).
// Validates every argument (attend::Error naming the problem), then runs.
AttentionGradients scaled_dot_product_attention_backward(
    const TensorView& grad_output, const TensorView& query, const TensorView& key,
    const TensorView& value, const TensorView& output, const TensorView& logsumexp,
    const AttentionOptions& options = {});

void scaled_dot_product_attention_backward_into(const TensorView& grad_output,
                                                const TensorView& query, const TensorView& key,
                                                const TensorView& value, const TensorView& output,
                                                const TensorView& logsumexp,
                                                const AttentionGradientViews& gradients,
                                                const AttentionOptions& options = {});

// FLOP count of one backward call (a multiply-add counts as 2): 2.5 × attention_flops (five
// products of the forward's sizes: S, dP̃, dV, dQ, dK), the convention of FlashAttention's
// benchmarks.
double attention_backward_flops(int64_t batch, int64_t query_len, int64_t key_len, int64_t head_dim,
                                int64_t value_dim, bool causal);

}  // namespace attend
