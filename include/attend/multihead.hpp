// attend/multihead.hpp: multi-head attention with learned projections, as
// torch.nn.MultiheadAttention(batch_first=True), in three steps (the annotated transformer):
//
//   1. project:   Q = query·W_Qᵀ + b_Q   (N, L, E)     K = key·W_Kᵀ + b_K   (N, S, E)
//                 V = value·W_Vᵀ + b_V   (N, S, E)     viewed per head as (N, H, ·, D), D = E/H
//   2. attend:    heads = SDPA(Q, K, V, mask)          (N, H, L, D), written as (N, L, H, D)
//   3. concatenate and project:  output = heads·W_Oᵀ + b_O   (N, L, E)
//
// Masks follow the library's rule: ZERO EXCLUDES. key_padding_mask is nonzero for real
// tokens and zero for padding (the opposite of PyTorch's, where True marks padding).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"

namespace attend {

struct MultiHeadOptions {
  bool bias = true;  // in_proj_bias and out_proj.bias
  int64_t kdim = 0;  // features of `key`; 0 means embed_dim
  int64_t vdim = 0;  // features of `value`; 0 means embed_dim
};

struct MultiHeadForwardOptions {
  // (N, S) bool or integer (or (S) for unbatched input): zero marks a padding key.
  std::optional<TensorView> key_padding_mask;
  // (L, S) or (N·num_heads, L, S) bool or integer (unbatched: (L, S) or (num_heads, L, S)):
  // zero excludes key j for query i.
  std::optional<TensorView> attn_mask;
  // Query i sees key j only when j <= i + (S - L) (for L == S: the lower triangle).
  bool causal = false;
  bool need_weights = true;
  // Weights (N, L, S) averaged over heads when true, else per head (N, H, L, S).
  bool average_weights_over_heads = true;
  // Dropout on the attention weights, p in [0, 1), reproducible from `seed`.
  double dropout = 0.0;
  uint64_t seed = 0;
  int num_threads = 0;  // 0: the OpenMP default; results do not depend on it
  Backend backend = Backend::kAuto;
  // Precision of the products, the projections' and the attention's (AttentionOptions::
  // compute): kAuto runs bfloat16 inputs in bfloat16 products where the CPU has them
  // (AVX512_BF16; attend::bf16_compute_path()), everything else in float32. With bfloat16
  // products the inputs and weights are rounded to bfloat16, Q, K, V and the heads are kept
  // in bfloat16, accumulation is float32, and the output is bfloat16 unless float32_output.
  // A forward that fills a tape (for backward()) computes in float32 products.
  ComputePrecision compute = ComputePrecision::kAuto;
  bool float32_output = false;
  // need_weights refuses (attend::Error, before any work) per-head weights (N, H, L, S)
  // larger than this many bytes.
  uint64_t max_weights_bytes = uint64_t{16} << 30;
};

struct MultiHeadResult {
  // (N, L, E) or (L, E): float32, or bfloat16 when computed in bfloat16 products (see
  // MultiHeadForwardOptions::compute).
  Tensor output;
  Tensor weights;  // float32, see average_weights_over_heads; empty unless need_weights
};

// What forward() keeps for backward(): the projections as the forward computed them, the
// attention output before the output projection and the attention's log-sum-exp (never the
// (N, H, L, S) weights). Float32, contiguous; N = 1 for unbatched input. The forward projects
// each distinct input with one GEMM, so Q, K and V share tensors when the inputs do:
struct MultiHeadTape {
  // (N, L, H, D) = Q; or (N, L, 3, H, D) = [Q, K, V] when query, key and value were one view
  // and in_proj is packed (self-attention).
  Tensor query_projection;
  // (N, S, H, D) = K; or (N, S, 2, H, D) = [K, V] when key and value were one view (packed
  // in_proj); empty when K is in query_projection.
  Tensor key_projection;
  // (N, S, H, D) = V; empty when V is in query_projection or key_projection.
  Tensor value_projection;
  Tensor heads;      // (N, L, H, D) = (N, L, E) attention output, heads concatenated
  Tensor logsumexp;  // (N, H, L) log Σ_j exp(score_ij) of each head's query row
};

// Gradients of a loss with respect to forward()'s inputs and to every parameter, float32.
struct MultiHeadGradients {
  // One gradient per distinct input, of that input's shape. When key is the same view as
  // query, its gradient (the sum over every role the tensor played) is in `query` and `key`
  // is empty; likewise `value` is empty when value is the same view as query or key (for
  // self-attention only `query` is filled; for cross-attention over one memory, `query` and
  // `key`), as autograd gives one gradient per tensor.
  Tensor query, key, value;
  // Under the state_dict names, the shapes of the parameters.
  std::map<std::string, Tensor> parameters;
};

class MultiHeadAttention {
 public:
  // Parameters are initialized as nn.MultiheadAttention._reset_parameters does (Xavier
  // uniform on the (3E, E) in_proj_weight, or on q/k/v_proj_weight separately when kdim or
  // vdim differ; zero biases; out_proj.weight U(-1/sqrt(E), 1/sqrt(E))), drawn from a fixed
  // generator keyed by `seed` (the same seed gives the same parameters, not torch's values).
  MultiHeadAttention(int64_t embed_dim, int64_t num_heads, const MultiHeadOptions& options = {},
                     uint64_t seed = 0);

  // query (N, L, E) or (L, E); key (N, S, kdim); value (N, S, vdim); float32, float16 or
  // bfloat16 (float16 computed in float32; bfloat16 see MultiHeadForwardOptions::compute).
  // Self-attention when query, key and value are the same view.
  MultiHeadResult forward(const TensorView& query, const TensorView& key, const TensorView& value,
                          const MultiHeadForwardOptions& options = {}) const;
  // Same, also filling `tape` (when not null) with what backward() needs.
  MultiHeadResult forward(const TensorView& query, const TensorView& key, const TensorView& value,
                          const MultiHeadForwardOptions& options, MultiHeadTape* tape) const;

  // Gradients from grad_output (the shape of forward()'s output: (N, L, E) or (L, E); float32,
  // float16 or bfloat16) given the same query, key, value and options as the forward that
  // filled `tape` (masks and causal must match; dropout is regenerated from the seed;
  // need_weights is ignored). The parameters must not have changed since that forward.
  // Validates the inputs, grad_output and the tape's shapes (attend::Error naming them).
  // Bitwise identical at any thread count.
  MultiHeadGradients backward(const TensorView& grad_output, const TensorView& query,
                              const TensorView& key, const TensorView& value,
                              const MultiHeadTape& tape,
                              const MultiHeadForwardOptions& options = {}) const;

  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t head_dim() const { return embed_dim_ / num_heads_; }
  int64_t kdim() const { return kdim_; }
  int64_t vdim() const { return vdim_; }
  bool has_bias() const { return bias_; }
  // True when W_Q, W_K, W_V live in one (3E, E) in_proj_weight (kdim == vdim == embed_dim).
  bool packed_in_projection() const { return packed_; }

  // Writable views of the parameters (float32, contiguous); write through them to set values.
  // in_proj_weight (3E, E) exists only when packed_in_projection(); q/k/v_proj_weight
  // ((E, E), (E, kdim), (E, vdim)) always do (slices of in_proj_weight when packed).
  // Bias accessors throw attend::Error when the module has no bias.
  TensorView in_proj_weight() const;
  TensorView q_proj_weight() const;
  TensorView k_proj_weight() const;
  TensorView v_proj_weight() const;
  TensorView in_proj_bias() const;     // (3E)
  TensorView out_proj_weight() const;  // (E, E)
  TensorView out_proj_bias() const;    // (E)

  // The parameters under PyTorch's state_dict names ("in_proj_weight", "in_proj_bias",
  // "out_proj.weight", "out_proj.bias", or "q_proj_weight", "k_proj_weight", "v_proj_weight").
  std::map<std::string, TensorView> state_dict() const;
  // Copies every expected tensor from `tensors` (float32, float16, bfloat16 or float64,
  // converted to float32). Throws attend::Error naming a missing tensor, or one whose shape
  // differs (with the expected and actual shapes); the module is unchanged on error.
  // Tensors with other names are ignored.
  void load_state_dict(const std::map<std::string, Tensor>& tensors);
  // Loads a safetensors file holding a state_dict (see load_state_dict).
  void load(const std::string& safetensors_path);
  // Saves the state_dict as a safetensors file (float32), atomically.
  void save(const std::string& safetensors_path) const;

 private:
  int64_t embed_dim_, num_heads_, kdim_, vdim_;
  bool bias_, packed_;
  Tensor in_proj_weight_;                                 // (3E, E) when packed
  Tensor q_proj_weight_, k_proj_weight_, v_proj_weight_;  // when not packed
  Tensor in_proj_bias_;                                   // (3E) when bias
  Tensor out_proj_weight_, out_proj_bias_;
};

}  // namespace attend
