// attend/attention_options.hpp: the options of one attention call (AttentionOptions) and the
// enums they choose from. A vocabulary header: types and constants only, including nothing
// but the standard library and the other vocabulary headers (error.hpp, tensor.hpp,
// score_rules.hpp, score_mod.hpp), so that the kernels and the reference may read it without
// depending on the API that calls them (scripts/check-floors.sh). The calls: attend/sdpa.hpp.
#pragma once

#include <cstdint>
#include <optional>

#include "attend/score_mod.hpp"
#include "attend/score_rules.hpp"
#include "attend/tensor.hpp"

namespace attend {

// What a query row whose every key is excluded (by mask or causality) produces.
enum class FullyMaskedRows : uint8_t {
  // Exactly what the listing computes: every score is -1e9, so the weights are uniform
  // (1/Lk) and the output is the mean of V. The default.
  kUniform,
  // Zero weights and a zero output row.
  kZero,
};

// Which implementation runs. kAuto picks the fastest one that accepts the problem; the
// reference (the listing, literally, in float64) is always available and last in line.
enum class Backend : uint8_t { kAuto, kFused, kReference };

// Where a call's queries and keys sit in a larger problem (context parallelism: one block of
// the scores, attend/mpi/ring.hpp): queries are rows [query_offset, query_offset + Lq) and
// keys rows [key_offset, key_offset + Lk) of a problem of query_len × key_len positions.
struct BlockPositions {
  int64_t query_offset = 0;
  int64_t key_offset = 0;
  int64_t query_len = 0;  // the whole problem's Lq, >= query_offset + this call's Lq
  int64_t key_len = 0;    // the whole problem's Lk, >= key_offset + this call's Lk
};

// Precision of the two matrix products, Q·Kᵀ and weights·V. The softmax, its statistics and
// every accumulation stay float32 whatever is chosen. `attend::bf16_compute_path()` says what
// this CPU runs.
enum class ComputePrecision : uint8_t {
  // bfloat16 inputs: bfloat16 products where the CPU has them natively (AVX512_BF16) and the
  // query-tile kernel runs (more than half a vector of queries per head), float32 products
  // otherwise. float32 and float16 inputs: float32 products.
  kAuto,
  // float32 products (inputs converted exactly).
  kFloat32,
  // bfloat16 products: inputs rounded to bfloat16 (nearest even), and the weights rounded to
  // bfloat16 before weights·V (those products exact, accumulated in float32). Natively on
  // AVX512_BF16; attend::Error on a CPU (or SIMD cap) without it. Decoding shapes (a few
  // queries per head, memory-bound) compute the rounded inputs' products in float32.
  kBFloat16,
  // float16 products on AVX512_FP16 (float16 chains of 128, then float32: README "Precision").
  kFloat16,
};

struct AttentionOptions {
  // bool or integer dtype, broadcastable to (..., Lq, Lk); an entry equal to zero excludes
  // that key for that query. A floating mask is refused: pass additive masks as `bias`.
  std::optional<TensorView> mask;
  // float32 or float16, broadcastable to (..., Lq, Lk); added to the scaled scores before
  // masking.
  std::optional<TensorView> bias;
  // Query i sees key j only when j <= i' (i' = i + Lk − Lq with the default alignment, as a
  // decoder with a KV cache needs; i with kTopLeft, as PyTorch's is_causal). Combines with
  // every other rule.
  bool causal = false;
  CausalAlignment causal_alignment = CausalAlignment::kBottomRight;
  // Query i sees key j only when i' − left <= j <= i' + right.
  std::optional<SlidingWindow> window;
  // ALiBi: slope_h · (j − i') added to the scores of head h (the last batch dimension, of
  // size H; 1 without batch dimensions). `alibi` alone takes default_alibi_slopes(H);
  // alibi_slopes, float32 (H), gives them (and implies alibi).
  bool alibi = false;
  std::optional<TensorView> alibi_slopes;
  // Logit soft-capping: s = cap · tanh(s / cap) after scaling, before bias and masks. > 0.
  std::optional<double> softcap;
  // Attention sinks: float32 (H), one extra logit per head in every row's softmax
  // denominator, with no value.
  std::optional<TensorView> sinks;
  // Document masking: integer segment ids of the queries (..., Lq) and the keys (..., Lk),
  // broadcast over the batch dimensions; query i sees key j only in its own document. Both
  // or neither.
  std::optional<TensorView> segment_ids_query;
  std::optional<TensorView> segment_ids_key;
  // Prefix-LM: keys j < prefix are visible to every query (with causal or a window, which
  // rule the rest). 0 <= prefix <= Lk.
  int64_t prefix = 0;
  // This call is one block of a larger problem: every rule sees the global positions
  // i + query_offset and j + key_offset (causal and its alignment to the global lengths, the
  // window, ALiBi, prefix, user rules, the dropout draw), so the block's scores are exactly
  // those of the whole problem's. The softmax runs over this call's keys: merge blocks by
  // their log-sum-exp. mask, bias and segment ids are the block's own (..., Lq, Lk).
  std::optional<BlockPositions> block;
  // Rules written by the user (attend/score_mod.hpp); they apply after the built-in ones.
  std::optional<UserScoreRules> user_rules;
  // Grouped-query attention: the heads of key and value (their last batch dimension). 0 takes
  // them from key's shape; a positive value must match it (a check for callers that mean it).
  int64_t num_kv_heads = 0;
  // Multiplies Q·Kᵀ; default 1/sqrt(E). Any finite value.
  std::optional<double> scale;
  FullyMaskedRows fully_masked_rows = FullyMaskedRows::kUniform;
  // Dropout probability p in [0, 1). The keep/drop draw for (batch, query, key) comes from
  // Philox-4x32-10 keyed by `seed`, so a seed reproduces the same bits at any thread count.
  double dropout = 0.0;
  uint64_t seed = 0;
  // Also return the weights (after dropout), float32 (..., Lq, Lk).
  bool need_weights = false;
  // Also return the log-sum-exp of each query row's scores (what the backward pass needs).
  bool need_logsumexp = false;
  // Threads to use; 0 means the OpenMP default. The result does not depend on it.
  int num_threads = 0;
  Backend backend = Backend::kAuto;
  ComputePrecision compute = ComputePrecision::kAuto;
  // need_weights refuses to allocate more than this many bytes for the weights.
  uint64_t max_weights_bytes = uint64_t{16} << 30;
};

// The built-in score rules' options that hold values (attend/score_rules.hpp), in declaration
// order: f(name, member) for each, `name` being the member's name. For the code that treats
// every rule alike by its type: context parallelism's agreement between ranks
// (src/mpi/ring_common.cpp) and the Python bindings' numbers, so that a new rule given by a
// number, a flag, an enum or a per-head tensor is one line here for them. Not here: the inputs
// indexed by position (mask, bias, segment ids), which every block of a problem holds its
// own of, and the user's rules. `options`: AttentionOptions, const or not.
template <class Options, class F>
void for_each_score_rule(Options& options, F&& f) {
  f("causal", options.causal);
  f("causal_alignment", options.causal_alignment);
  f("window", options.window);
  f("alibi", options.alibi);
  f("alibi_slopes", options.alibi_slopes);
  f("softcap", options.softcap);
  f("sinks", options.sinks);
  f("prefix", options.prefix);
}

}  // namespace attend
