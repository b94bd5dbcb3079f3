// cases.hpp: the named benchmark cases shared by `attend bench` and bench/attend_bench, with
// their shapes, targets and the inputs they run on.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"

namespace attend::bench {

// One attention problem: query (batch, heads, query_len, head_dim), key and value
// (batch, heads, key_len, head_dim), output like query.
struct AttentionShape {
  int64_t batch = 1;
  int64_t heads = 1;
  int64_t query_len = 1;
  int64_t key_len = 1;
  int64_t head_dim = 1;
  bool causal = false;
  // Key and value of one head shared by all heads (multi-query attention): stored as
  // (batch, 1, key_len, head_dim) and passed as a view with stride 0 over the heads.
  bool shared_kv = false;
  // The score rules of the case (attend/score_rules.hpp), bottom-right aligned.
  struct Rules {
    int64_t window_left = -1;  // sliding window of this many keys back (-1: none)
    int64_t documents = 0;     // packed documents of fixed unequal lengths (0: none)
    bool alibi = false;        // built-in ALiBi, default slopes
    double softcap = 0;        // logit soft-capping (0: none)
    bool user_alibi = false;   // ALiBi written as a user score_mod (attend/score_mod.hpp)
    // The positional and document rules given as a dense (Lq, Lk) bool mask instead (what a
    // user without them passes, and what PyTorch 1.13 computes with).
    bool as_mask = false;
  } rules = {};
  // Of query, key, value and output (and dO, dQ, dK, dV): float32, bfloat16 or float16,
  // computed as AttentionOptions::compute's default picks (ComputePrecision::kAuto).
  DType dtype = DType::kFloat32;
  // Grouped-query attention: K and V of this many heads (dividing heads) when > 0.
  int64_t kv_heads = 0;
  // AttentionOptions::compute; kFloat16 (kBFloat16) where the CPU has float16 (bfloat16)
  // products, else kAuto.
  ComputePrecision compute = ComputePrecision::kAuto;
  bool has_rules() const;

  // attend::attention_flops(batch·heads, Lq, Lk, E, E, false) without positional or document
  // rules; with causal, a window or documents, 4·B·H·E·(visible scores): what the rules let
  // through, counted exactly (Lq 4 causal against 8192 keys sees nearly every score, not half).
  double flops() const;
  // Scores that take part in the softmax, per (batch, head).
  double visible_scores() const;
  // Share of (64-query, 128-key) tiles with a visible score: what the block-sparse kernel
  // visits (1 without positional or document rules).
  double visited_fraction() const;
  // Bytes of K and V read once: 2·B·Hkv·Lk·E·(bytes of dtype); Hkv = 1 with shared_kv.
  double key_value_bytes() const;
  // K/V heads: 1 with shared_kv, kv_heads when set, else heads.
  int64_t kv_head_count() const;
  // Bytes of the float32 weights (B, H, Lq, Lk).
  double weights_bytes() const;
};

// Throughput targets are shares of what the same run measures on the same machine (the FMA
// peak, the read bandwidth), so that they mean the same on any machine.
enum class TargetKind : uint8_t {
  kNone,
  kMaxMicroseconds,   // median time per call
  kMinPercentOfPeak,  // 100 · (attention_flops / median time) / FMA peak
  kMinPercentOfRead,  // 100 · (key_value_bytes / median time) / read bandwidth
  kMaxWeightsRatio,   // time / (time without weights + time to write the weights)
  kMinSpeedup,        // time of the baseline case (float32) / time: reduced precision
};

struct CaseTarget {
  TargetKind kind = TargetKind::kNone;
  double value = 0;
};

// "<= 0.5 us", ">= 81% of peak", ">= 71% of read", "<= 1.5x", ">= 1.7x"; "-" for none.
std::string describe_target(const CaseTarget& target);
// Whether `measured` (in the unit of target.kind) meets the target; true for kNone.
bool target_met(const CaseTarget& target, double measured);

// What one timed call runs.
enum class Workload : uint8_t {
  kAttention,       // scaled_dot_product_attention_into on (B, H, L, E) tensors
  kMultiHeadLayer,  // MultiHeadAttention(H·E, H).forward on (B, L, H·E), projections included
  kSpatialBlock,    // SpatialSelfAttention(H·E channels, H) on (B, H·E, 64, 64): L = 4096
  // scaled_dot_product_attention_backward_into on (B, H, L, E) tensors, after one forward
  // that saved the output and log-sum-exp; FLOPs = attention_backward_flops (2.5 × forward).
  kAttentionBackward,
  // Paged decoding (attend/kv_cache.hpp): PagedLayout::sequences sequences, each with the
  // shape's Lq queries of H heads over its cached keys (Hkv heads, E), in one call:
  // paged_attention_into on blocks in the layout's order, or PagedKvCache::attend for the
  // quantized formats (which need the cache's scales).
  kPagedDecode,
  // AttentionPlan::run on (B, H, L, E) tensors, the plan made once (attend/plan.hpp).
  kPlanned,
};

// The cache of a kPagedDecode case: K/V storage format (float32, float16, bfloat16, int8,
// float8_e4m3, float8_e5m2), block size and order, and the batch's sequence lengths: the
// shape's key_len for one sequence, else seeded lengths in [100, key_len].
struct PagedLayout {
  DType format = DType::kFloat32;
  int64_t block_size = 16;
  bool shuffled = false;
  int64_t sequences = 1;
};

struct BenchCase {
  std::string name;
  AttentionShape shape;  // the attention inside the workload (its FLOPs are the ones counted)
  Workload workload = Workload::kAttention;
  bool need_weights = false;
  bool single_thread = false;  // a latency case: always one thread
  CaseTarget target;
  std::string summary;  // one line for listings
  // The float32 case this one's speed is compared with, measured in the same run (its time
  // divided by this one's: kMinSpeedup); "" for none.
  std::string baseline = {};
  PagedLayout paged = {};  // kPagedDecode only
  // bfloat16 products on AVX512_BF16 even where AMX tiles would run them (set_amx_enabled
  // false around the timed calls): both paths in one run on an AMX host.
  bool amx_off = false;
  // The kMinSpeedup target where AMX tiles run the products (0: the same as elsewhere).
  double amx_speedup = 0;

  // FLOPs of one call: shape.flops(), or attention_backward_flops for kAttentionBackward.
  double flops() const;
  // Decoding (up to 16 queries per head over at least 1024 keys, attention alone, or paged):
  // bounded by reading K and V, so reported in GB/s of K/V beside the read bandwidth probe.
  bool memory_bound() const;
  // Bytes of K and V (and their scales) as stored, read once by one call.
  double key_value_bytes() const;
  // A paged case's sequence lengths (seeded, deterministic).
  std::vector<int64_t> paged_lengths() const;
};

// The table, in the order `attend bench` runs it.
const std::vector<BenchCase>& bench_cases();
// The case called `name` (exact, case-sensitive), or nullptr.
const BenchCase* find_bench_case(std::string_view name);

// The products a backward or module case's bfloat16 inputs get (the precision policy,
// boundary/operands.hpp), for the peak it is measured against; attention cases read theirs
// from the kernel's name.
struct Bf16Peaks {
  bool bf16 = false;  // bfloat16 products (AVX512_BF16 or AMX tiles)
  bool amx = false;   // on AMX tiles
};
Bf16Peaks module_bf16_peaks(const BenchCase& c);
// "phrase, unet, s3, ..." (every name in the table, reserved ones included).
std::string known_case_names();

// Inputs and outputs of one problem, allocated once and reused by every timed call.
struct CaseTensors {
  Tensor query, key, value, output;
  Tensor weights;  // empty unless weights were requested
  // key and value as the attention sees them: (B, H, Lk, E), stride 0 over the heads when
  // they hold one head (shared_kv).
  TensorView key_view() const;
  TensorView value_view() const;
  int64_t heads = 1;
  // The rules' inputs (segment ids, the dense mask, slopes, the user rule) and the options
  // they make; shared so that copies keep the user rule's address.
  std::shared_ptr<struct RuleInputs> rules;
  // Options of one call: causal and the rules (threads and backend left to the caller).
  AttentionOptions options() const;
};

// Query, key and value filled with deterministic pseudo-random values in [-1, 1); output and
// weights (when `need_weights`) allocated and zeroed so that their pages are faulted in.
CaseTensors make_case_tensors(const AttentionShape& shape, bool need_weights);

// A callable running one call of a module workload (kMultiHeadLayer, kSpatialBlock,
// kAttentionBackward) of `c`
// on `num_threads` threads, with its module and inputs built once (deterministic seeds).
std::function<void()> make_module_workload(const BenchCase& c, int num_threads);

// One call of scaled_dot_product_attention_into on `tensors` (weights written when the
// tensors hold them).
void run_attention(CaseTensors& tensors, const AttentionShape& shape, int num_threads,
                   Backend backend);

}  // namespace attend::bench
