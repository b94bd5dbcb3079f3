// cases.cc: the benchmark case table and the inputs the cases run on.
#include "bench/cases.hpp"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <utility>

#include "attend/kv_cache.hpp"
#include "attend/multihead.hpp"
#include "attend/plan.hpp"
#include "attend/sdpa_backward.hpp"
#include "attend/spatial.hpp"
#include "boundary/operands.hpp"
#include "cpu_features.hpp"
#include "score_rule_layer.hpp"
#include "score_rules.hpp"

namespace attend::bench {

bool AttentionShape::has_rules() const {
  return rules.window_left >= 0 || rules.documents > 0 || rules.alibi || rules.softcap > 0 ||
         rules.user_alibi;
}

namespace {

// Document d of `documents` packed over `length` positions: lengths in the proportions 8, 2,
// 6, 1, 4, 7, 3, 1 (of 32), repeated, the last one taking the rest. Returns [start, end).
std::vector<int64_t> document_starts(int64_t length, int64_t documents) {
  constexpr int64_t kParts[] = {8, 2, 6, 1, 4, 7, 3, 1};
  std::vector<int64_t> starts;
  int64_t position = 0;
  for (int64_t d = 0; d < documents && position < length; ++d) {
    starts.push_back(position);
    position += std::max<int64_t>(1, length * kParts[d % 8] / 32);
  }
  return starts;
}

// The case's positional rules (causal, the window; bottom-right aligned) as the kernels get
// them: fill_positional_rules over the options the case runs with.
detail::SdpaParams positional_rules(const AttentionShape& s) {
  AttentionOptions options;
  options.causal = s.causal;
  if (s.rules.window_left >= 0) options.window = SlidingWindow{s.rules.window_left, 0};
  detail::SdpaParams p;
  p.query_len = s.query_len;
  p.key_len = s.key_len;
  detail::fill_positional_rules(p, options);
  return p;
}

// The keys query i sees: [first, last] (empty when first > last), from the rule layer's
// visible_keys (`rules`: positional_rules(s)) and its document (the segment ids set_rules
// builds: the document of the query's aligned position).
std::pair<int64_t, int64_t> visible_range(const detail::SdpaParams& rules,
                                          const std::vector<int64_t>& starts, int64_t i) {
  const detail::VisibleKeys keys = detail::visible_keys(rules, i);
  int64_t first = keys.first, last = keys.last;
  if (!starts.empty()) {
    const int64_t aligned = i + rules.diagonal_offset;
    const auto next = std::upper_bound(starts.begin(), starts.end(),
                                       std::clamp<int64_t>(aligned, 0, rules.key_len - 1));
    first = std::max(first, *(next - 1));
    if (next != starts.end()) last = std::min(last, *next - 1);
  }
  return {first, last};
}

}  // namespace

double AttentionShape::visible_scores() const {
  const std::vector<int64_t> starts = document_starts(key_len, rules.documents);
  const detail::SdpaParams positional = positional_rules(*this);
  double count = 0;
  for (int64_t i = 0; i < query_len; ++i) {
    const auto [first, last] = visible_range(positional, starts, i);
    count += static_cast<double>(std::max<int64_t>(0, last - first + 1));
  }
  return count;
}

double AttentionShape::visited_fraction() const {
  constexpr int64_t kQueryTile = 64, kKeyTile = 128;
  const std::vector<int64_t> starts = document_starts(key_len, rules.documents);
  const detail::SdpaParams positional = positional_rules(*this);
  const int64_t key_tiles = (key_len + kKeyTile - 1) / kKeyTile;
  int64_t visited = 0, total = 0;
  for (int64_t q0 = 0; q0 < query_len; q0 += kQueryTile) {
    std::vector<char> seen(static_cast<size_t>(key_tiles), 0);
    for (int64_t i = q0; i < std::min(query_len, q0 + kQueryTile); ++i) {
      const auto [first, last] = visible_range(positional, starts, i);
      for (int64_t t = first / kKeyTile; first <= last && t <= last / kKeyTile; ++t) {
        seen[static_cast<size_t>(t)] = 1;
      }
    }
    for (char tile : seen) visited += tile;
    total += key_tiles;
  }
  return static_cast<double>(visited) / static_cast<double>(total);
}

double AttentionShape::flops() const {
  if (!causal && rules.window_left < 0 && rules.documents == 0) {
    return attention_flops(batch * heads, query_len, key_len, head_dim, head_dim, causal);
  }
  return 4.0 * static_cast<double>(batch * heads * head_dim) * visible_scores();
}

int64_t AttentionShape::kv_head_count() const {
  return shared_kv ? 1 : (kv_heads > 0 ? kv_heads : heads);
}

double AttentionShape::key_value_bytes() const {
  return 2.0 * static_cast<double>(batch * kv_head_count()) * static_cast<double>(key_len) *
         static_cast<double>(head_dim) * static_cast<double>(dtype_size(dtype));
}

double AttentionShape::weights_bytes() const {
  return static_cast<double>(batch * heads) * static_cast<double>(query_len) *
         static_cast<double>(key_len) * sizeof(float);
}

double BenchCase::flops() const {
  if (workload != Workload::kAttentionBackward) return shape.flops();
  return 2.5 * shape.flops();  // attend::attention_backward_flops on the visible scores
}

bool BenchCase::memory_bound() const {
  return workload == Workload::kPagedDecode ||
         (workload == Workload::kAttention && shape.query_len <= 16 && shape.key_len >= 1024);
}

std::vector<int64_t> BenchCase::paged_lengths() const {
  if (paged.sequences <= 1) return {shape.key_len};
  std::mt19937 random(7);
  std::uniform_int_distribution<int64_t> length(100, shape.key_len);
  std::vector<int64_t> lengths(static_cast<size_t>(paged.sequences));
  for (int64_t& l : lengths) l = length(random);
  return lengths;
}

double BenchCase::key_value_bytes() const {
  if (workload != Workload::kPagedDecode) return shape.key_value_bytes();
  int64_t tokens = 0;
  for (int64_t l : paged_lengths()) tokens += l;
  const bool scaled = paged.format == DType::kInt8 || paged.format == DType::kFloat8E4M3 ||
                      paged.format == DType::kFloat8E5M2;
  const double per_token_head =
      2.0 * static_cast<double>(shape.head_dim) * static_cast<double>(dtype_size(paged.format)) +
      (scaled ? 2.0 * sizeof(float) : 0.0);
  return static_cast<double>(tokens * shape.kv_head_count()) * per_token_head;
}

std::string describe_target(const CaseTarget& target) {
  char text[64];
  switch (target.kind) {
    case TargetKind::kNone:
      return "-";
    case TargetKind::kMaxMicroseconds:
      std::snprintf(text, sizeof(text), "<= %g us", target.value);
      break;
    case TargetKind::kMinPercentOfPeak:
      std::snprintf(text, sizeof(text), ">= %g%% of peak", target.value);
      break;
    case TargetKind::kMinPercentOfRead:
      std::snprintf(text, sizeof(text), ">= %g%% of read", target.value);
      break;
    case TargetKind::kMaxWeightsRatio:
      std::snprintf(text, sizeof(text), "<= %gx", target.value);
      break;
    case TargetKind::kMinSpeedup:
      std::snprintf(text, sizeof(text), ">= %gx", target.value);
      break;
  }
  return text;
}

bool target_met(const CaseTarget& target, double measured) {
  switch (target.kind) {
    case TargetKind::kMaxMicroseconds:
    case TargetKind::kMaxWeightsRatio:
      return measured <= target.value;
    case TargetKind::kMinPercentOfPeak:
    case TargetKind::kMinPercentOfRead:
    case TargetKind::kMinSpeedup:
      return measured >= target.value;
    case TargetKind::kNone:
      break;
  }
  return true;
}

const std::vector<BenchCase>& bench_cases() {
  // Shapes (B, H, Lq, Lk, E) and targets. The throughput targets were first set in GFLOP/s
  // and GB/s for 2 Zen 5 cores (AVX-512, FMA peak about 530 GFLOP/s); here they are the
  // shares of that machine's FMA peak (decode: of its read bandwidth) that those figures
  // stood for: 430 of 530 GFLOP/s is 81 %.
  static const std::vector<BenchCase> cases = {
      {.name = "phrase",
       .shape = {1, 8, 4, 4, 32, false},
       .single_thread = true,
       .target = {TargetKind::kMaxMicroseconds, 0.5},
       .summary = "a short phrase: latency on one thread"},
      {.name = "unet",
       .shape = {1, 4, 4096, 4096, 32, false},
       .target = {TargetKind::kMinPercentOfPeak, 81},
       .summary = "Stable Diffusion U-Net self-attention, 64x64 latents"},
      {.name = "s3",
       .shape = {1, 8, 1024, 1024, 64, false},
       .target = {TargetKind::kMinPercentOfPeak, 83},
       .summary = "encoder layer, L 1024, E 64"},
      {.name = "s4",
       .shape = {1, 16, 2048, 2048, 128, false},
       .target = {TargetKind::kMinPercentOfPeak, 89},
       .summary = "large heads, L 2048, E 128"},
      {.name = "s4-causal",
       .shape = {1, 16, 2048, 2048, 128, true},
       .target = {TargetKind::kMinPercentOfPeak, 81},
       .summary = "s4 with a causal mask (half the FLOPs)"},
      {.name = "decode",
       .shape = {1, 32, 1, 8192, 128, false},
       .target = {TargetKind::kMinPercentOfRead, 90},
       .summary = "one query against an 8192-entry KV cache"},
      {.name = "unet-weights",
       .shape = {1, 4, 4096, 4096, 32, false},
       .need_weights = true,
       .target = {TargetKind::kMaxWeightsRatio, 1.5},
       .summary = "unet also returning the 4x4096x4096 weights"},
      {.name = "phrase-mha",
       .shape = {1, 8, 4, 4, 32, false},
       .workload = Workload::kMultiHeadLayer,
       .single_thread = true,
       .target = {TargetKind::kMaxMicroseconds, 10},
       .summary = "the phrase's whole MHA layer (256 wide, 8 heads), projections included"},
      {.name = "unet-block",
       .shape = {1, 4, 4096, 4096, 32, false},
       .workload = Workload::kSpatialBlock,
       .target = {TargetKind::kMaxMicroseconds, 25000},
       .summary = "SpatialSelfAttention(128, 4 heads) on (1, 128, 64, 64)"},
      // The backward pass: >= 50% of the FMA peak at E = 128.
      {.name = "unet-bwd",
       .shape = {1, 4, 4096, 4096, 32, false},
       .workload = Workload::kAttentionBackward,
       .target = {TargetKind::kNone, 0},  // a target at E = 128 only
       .summary = "unet's backward: dQ, dK, dV from dO (2.5x the forward's FLOPs)"},
      {.name = "s4-bwd",
       .shape = {1, 16, 2048, 2048, 128, false},
       .workload = Workload::kAttentionBackward,
       .target = {TargetKind::kMinPercentOfPeak, 50},
       .summary = "s4's backward"},
      {.name = "s4-causal-bwd",
       .shape = {1, 16, 2048, 2048, 128, true},
       .workload = Workload::kAttentionBackward,
       .target = {TargetKind::kMinPercentOfPeak, 50},
       .summary = "s4-causal's backward"},
      // Reduced precision (issue 13): bfloat16 and float16 inputs and outputs, beside the
      // float32 case named as the baseline (measured in the same run). Targets where the CPU
      // has the instruction (AVX512_BF16 for bfloat16); where it does not, the command
      // judges the case by the fallback's target, no slower than 0.9x float32.
      {.name = "s4-bf16",
       .shape = {1, 16, 2048, 2048, 128, false, false, {}, DType::kBFloat16},
       .target = {TargetKind::kMinSpeedup, 1.7},
       .summary = "s4 in bfloat16",
       .baseline = "s4",
       .amx_speedup = 3.0},
      // s4-bf16 with AMX switched off: the AVX512_BF16 register blocks beside the AMX tiles
      // (issue 26); the same as s4-bf16 on a host without AMX.
      {.name = "s4-bf16-avx512",
       .shape = {1, 16, 2048, 2048, 128, false, false, {}, DType::kBFloat16, 0,
                 ComputePrecision::kBFloat16},
       .target = {TargetKind::kNone, 0},
       .summary = "s4-bf16 on AVX512_BF16 (AMX tiles switched off)",
       .baseline = "s4",
       .amx_off = true},
      {.name = "unet-bf16",
       .shape = {1, 4, 4096, 4096, 32, false, false, {}, DType::kBFloat16},
       .target = {TargetKind::kMinSpeedup, 1.5},
       .summary = "unet in bfloat16",
       .baseline = "unet"},
      {.name = "s4-causal-bf16",
       .shape = {1, 16, 2048, 2048, 128, true, false, {}, DType::kBFloat16},
       .target = {TargetKind::kMinSpeedup, 1.5},
       .summary = "s4-causal in bfloat16",
       .baseline = "s4-causal"},
      {.name = "s4-bwd-bf16",
       .shape = {1, 16, 2048, 2048, 128, false, false, {}, DType::kBFloat16},
       .workload = Workload::kAttentionBackward,
       .target = {TargetKind::kMinSpeedup, 1.5},
       .summary = "s4's backward in bfloat16",
       .baseline = "s4-bwd",
       .amx_speedup = 2.0},
      {.name = "decode-bf16",
       .shape = {1, 32, 1, 8192, 128, false, false, {}, DType::kBFloat16},
       .target = {TargetKind::kMinPercentOfRead, 85},
       .summary = "decode with a bfloat16 KV cache (half the bytes)",
       .baseline = "decode"},
      {.name = "unet-block-bf16",
       .shape = {1, 4, 4096, 4096, 32, false, false, {}, DType::kBFloat16},
       .workload = Workload::kSpatialBlock,
       .target = {TargetKind::kMinSpeedup, 1.4},
       .summary = "unet-block on a bfloat16 map: projections and attention in bfloat16",
       .baseline = "unet-block"},
      {.name = "s4-fp16",
       .shape = {1, 16, 2048, 2048, 128, false, false, {}, DType::kFloat16},
       .target = {TargetKind::kMinSpeedup, 1.7},
       .summary = "s4 in float16",
       .baseline = "s4"},
      // s4-fp16 with float16 products (ComputePrecision::kFloat16, issue 26): kAuto keeps
      // float32 products for float16 inputs, since float16 products accumulate in float16.
      {.name = "s4-fp16-native",
       .shape = {1, 16, 2048, 2048, 128, false, false, {}, DType::kFloat16, 0,
                 ComputePrecision::kFloat16},
       .target = {TargetKind::kMinSpeedup, 1.7},
       .summary = "s4-fp16 with float16 products (AVX512_FP16)",
       .baseline = "s4"},
      {.name = "unet-fp16",
       .shape = {1, 4, 4096, 4096, 32, false, false, {}, DType::kFloat16},
       .target = {TargetKind::kMinSpeedup, 1.5},
       .summary = "unet in float16",
       .baseline = "unet"},
      {.name = "decode-fp16",
       .shape = {1, 32, 1, 8192, 128, false, false, {}, DType::kFloat16},
       .target = {TargetKind::kMinPercentOfRead, 85},
       .summary = "decode with a float16 KV cache (half the bytes)",
       .baseline = "decode"},
      // Serving (issue 21): decoding read at the memory's speed for every cache format,
      // in GB/s of K/V as stored (scales included) against the read probe of the same run.
      {.name = "decode-gqa",
       .shape = {.heads = 32, .key_len = 8192, .head_dim = 128, .kv_heads = 8},
       .target = {TargetKind::kMinPercentOfRead, 85},
       .summary = "decode with 32 query heads on 8 K/V heads (grouped-query)"},
      {.name = "decode-paged",
       .shape = {.heads = 32, .key_len = 8192, .head_dim = 128},
       .workload = Workload::kPagedDecode,
       .target = {TargetKind::kMinPercentOfRead, 85},
       .summary = "decode over a paged cache, blocks of 16 in shuffled order",
       .baseline = "decode",
       .paged = {.block_size = 16, .shuffled = true}},
      {.name = "decode-paged-64",
       .shape = {.heads = 32, .key_len = 8192, .head_dim = 128},
       .workload = Workload::kPagedDecode,
       .target = {TargetKind::kMinPercentOfRead, 85},
       .summary = "decode over a paged cache, blocks of 64 in shuffled order",
       .baseline = "decode",
       .paged = {.block_size = 64, .shuffled = true}},
      {.name = "decode-int8",
       .shape = {.heads = 32, .key_len = 8192, .head_dim = 128},
       .workload = Workload::kPagedDecode,
       .target = {TargetKind::kMinPercentOfRead, 75},
       .summary = "decode over an int8 PagedKvCache (scale per token and head)",
       .baseline = "decode",
       .paged = {.format = DType::kInt8}},
      {.name = "decode-fp8",
       .shape = {.heads = 32, .key_len = 8192, .head_dim = 128},
       .workload = Workload::kPagedDecode,
       .target = {TargetKind::kMinPercentOfRead, 75},
       .summary = "decode over a float8_e4m3 PagedKvCache (scale per token and head)",
       .baseline = "decode",
       .paged = {.format = DType::kFloat8E4M3}},
      {.name = "decode-verify4",
       .shape = {.heads = 32,
                 .query_len = 4,
                 .key_len = 8192,
                 .head_dim = 128,
                 .causal = true,
                 .kv_heads = 4},
       .target = {TargetKind::kNone, 0},
       .summary = "speculative verification: 4 causal queries, 8 query heads per K/V head"},
      {.name = "decode-verify1",
       .shape = {.heads = 32,
                 .query_len = 1,
                 .key_len = 8192,
                 .head_dim = 128,
                 .causal = true,
                 .kv_heads = 4},
       .target = {TargetKind::kNone, 0},
       .summary = "decode-verify4's problem with one query (its time is verify4's yardstick)"},
      // bfloat16 K/V (and queries): with the default precision, bfloat16 products where the
      // CPU has AVX512_BF16 and the policy picks them (AMD): verify4's 32 rows per K/V head
      // run as a grouped-query tile on vdpbf16ps (its float32 form is bound by the FMA peak:
      // BENCHMARKS.md "Speculative verification as compute tiles"); verify1's 8 rows stay in
      // the row groups, float32 products on the widened K/V. Target: verify4 within 1.3x
      // verify1's time (speedup over decode-verify1-bf16 >= 0.77 = 1/1.3).
      {.name = "decode-verify1-bf16",
       .shape = {.heads = 32,
                 .query_len = 1,
                 .key_len = 8192,
                 .head_dim = 128,
                 .causal = true,
                 .dtype = DType::kBFloat16,
                 .kv_heads = 4},
       .target = {TargetKind::kNone, 0},
       .summary = "decode-verify1 with bfloat16 Q, K, V (half the K/V bytes)",
       .baseline = "decode-verify1"},
      {.name = "decode-verify4-bf16",
       .shape = {.heads = 32,
                 .query_len = 4,
                 .key_len = 8192,
                 .head_dim = 128,
                 .causal = true,
                 .dtype = DType::kBFloat16,
                 .kv_heads = 4},
       .target = {TargetKind::kMinSpeedup, 0.77},
       .summary = "decode-verify4 with bfloat16 Q, K, V: grouped-query tile on bfloat16 products",
       .baseline = "decode-verify1-bf16"},
      // Speculative verification over quantized paged caches (issue 21, item 4): decode-verify4's
      // 32 rows per K/V head (8 query heads × 4 queries), 64 FLOPs per int8 byte. On
      // AVX512_BF16 the grouped-query tiles on bfloat16 products (codes exact, scales in
      // float32; boundary/operands.hpp, stored_kv_bf16_products), else the row groups; the -f32
      // case opts out (ComputePrecision::kFloat32: the row groups' float32 products), the
      // yardstick of the speedup.
      {.name = "decode-verify4-int8-f32",
       .shape = {.heads = 32,
                 .query_len = 4,
                 .key_len = 8192,
                 .head_dim = 128,
                 .causal = true,
                 .kv_heads = 4,
                 .compute = ComputePrecision::kFloat32},
       .workload = Workload::kPagedDecode,
       .target = {TargetKind::kNone, 0},
       .summary = "decode-verify4 over an int8 PagedKvCache with float32 products (row groups)",
       .paged = {.format = DType::kInt8}},
      {.name = "decode-verify4-int8",
       .shape = {.heads = 32,
                 .query_len = 4,
                 .key_len = 8192,
                 .head_dim = 128,
                 .causal = true,
                 .kv_heads = 4},
       .workload = Workload::kPagedDecode,
       .target = {TargetKind::kNone, 0},
       .summary = "decode-verify4 over an int8 PagedKvCache: grouped-query tile, bfloat16 products",
       .baseline = "decode-verify4-int8-f32",
       .paged = {.format = DType::kInt8}},
      {.name = "decode-verify4-fp8",
       .shape = {.heads = 32,
                 .query_len = 4,
                 .key_len = 8192,
                 .head_dim = 128,
                 .causal = true,
                 .kv_heads = 4},
       .workload = Workload::kPagedDecode,
       .target = {TargetKind::kNone, 0},
       .summary = "decode-verify4 over a float8_e4m3 PagedKvCache: grouped-query tile, bfloat16 "
                  "products",
       .baseline = "decode-verify4-int8-f32",
       .paged = {.format = DType::kFloat8E4M3}},
      {.name = "decode-batch",
       .shape = {.heads = 32, .key_len = 8192, .head_dim = 128, .causal = true, .kv_heads = 4},
       .workload = Workload::kPagedDecode,
       .target = {TargetKind::kMinPercentOfRead, 85},
       .summary = "32 sequences of seeded lengths 100..8192, 8 query heads per K/V head",
       .paged = {.block_size = 16, .sequences = 32}},
      // The whole call through a prepared plan (attend/plan.hpp), one thread.
      {.name = "phrase-plan",
       .shape = {1, 8, 4, 4, 32, false},
       .workload = Workload::kPlanned,
       .single_thread = true,
       .target = {TargetKind::kMaxMicroseconds, 0.3},
       .summary = "the phrase through AttentionPlan::run: latency on one thread"},
      {.name = "decode64-plan",
       .shape = {1, 8, 1, 64, 64, false},
       .workload = Workload::kPlanned,
       .single_thread = true,
       .target = {TargetKind::kMaxMicroseconds, 1},
       .summary = "one token over a 64-key cache through AttentionPlan::run, one thread"},
      // No target: decode with one K/V head for all 32 query heads (multi-query
      // attention), K and V (1 MiB each) passed with stride 0 over the heads.
      {.name = "decode-mqa",
       .shape = {1, 32, 1, 8192, 128, false, true},
       .target = {TargetKind::kNone, 0},
       .summary = "decode with one K/V head shared by the 32 query heads (stride 0)"},
      // No target: decode with few heads over a long cache, one row group on
      // AVX-512: both cores busy only through the key split.
      {.name = "decode-4heads",
       .shape = {1, 4, 1, 32768, 128, false},
       .target = {TargetKind::kNone, 0},
       .summary = "one query on each of 4 heads against a 32768-entry KV cache"},
      // No target: a single query tile (64 queries on AVX-512) against many keys
      // (a chunk of a long prompt's prefill): both cores busy only through the key split.
      {.name = "one-tile",
       .shape = {1, 1, 64, 16384, 64, false},
       .target = {TargetKind::kNone, 0},
       .summary = "64 queries of one head against 16384 keys"},
      // Score rules (issue 12): GFLOP/s on the visible scores only, beside the dense cases.
      {.name = "window",
       .shape = {1, 16, 16384, 16384, 64, true, false, {.window_left = 512}},
       .target = {TargetKind::kNone, 0},
       .summary = "causal sliding window of 512 keys over 16384 (Mistral's rule)"},
      {.name = "window-mask",
       .shape = {1, 16, 16384, 16384, 64, true, false, {.window_left = 512, .as_mask = true}},
       .target = {TargetKind::kNone, 0},
       .summary = "window's rule as a dense (16384, 16384) bool mask"},
      {.name = "window-dense",
       .shape = {1, 16, 16384, 16384, 64, true},
       .target = {TargetKind::kNone, 0},
       .summary = "window's shape, causal without the window: every score computed"},
      {.name = "documents",
       .shape = {1, 16, 8192, 8192, 64, true, false, {.documents = 8}},
       .target = {TargetKind::kNone, 0},
       .summary = "8 packed documents of unequal lengths, causal within each"},
      {.name = "softcap",
       .shape = {1, 16, 2048, 2048, 128, false, false, {.softcap = 30}},
       .target = {TargetKind::kNone, 0},
       .summary = "s4 with logit soft-capping at 30 (Gemma 2)"},
      {.name = "alibi",
       .shape = {1, 16, 2048, 2048, 128, false, false, {.alibi = true}},
       .target = {TargetKind::kNone, 0},
       .summary = "s4 with ALiBi's default slopes"},
      {.name = "user-mod",
       .shape = {1, 16, 2048, 2048, 128, false, false, {.user_alibi = true}},
       .target = {TargetKind::kNone, 0},
       .summary = "s4 with ALiBi written as a user score_mod"},
      {.name = "window-bwd",
       .shape = {1, 16, 16384, 16384, 64, true, false, {.window_left = 512}},
       .workload = Workload::kAttentionBackward,
       .target = {TargetKind::kNone, 0},
       .summary = "window's backward"},
      {.name = "documents-bwd",
       .shape = {1, 16, 8192, 8192, 64, true, false, {.documents = 8}},
       .workload = Workload::kAttentionBackward,
       .target = {TargetKind::kNone, 0},
       .summary = "documents' backward"},
      {.name = "softcap-bwd",
       .shape = {1, 16, 2048, 2048, 128, false, false, {.softcap = 30}},
       .workload = Workload::kAttentionBackward,
       .target = {TargetKind::kNone, 0},
       .summary = "softcap's backward"},
      {.name = "alibi-bwd",
       .shape = {1, 16, 2048, 2048, 128, false, false, {.alibi = true}},
       .workload = Workload::kAttentionBackward,
       .target = {TargetKind::kNone, 0},
       .summary = "alibi's backward"},
  };
  return cases;
}

Bf16Peaks module_bf16_peaks(const BenchCase& c) {
  if (c.workload == Workload::kAttention || c.shape.dtype != DType::kBFloat16 ||
      !detail::native_bf16_products()) {
    return {};
  }
  const auto site = c.workload == Workload::kAttentionBackward
                        ? detail::ProductSite::kAttentionBackward
                        : detail::ProductSite::kAttention;
  const detail::Bf16Products path =
      detail::bf16_products(DType::kBFloat16, ComputePrecision::kAuto, site);
  return {path != detail::Bf16Products::kFloat32, path == detail::Bf16Products::kAmxTiles};
}

const BenchCase* find_bench_case(std::string_view name) {
  for (const BenchCase& c : bench_cases()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

std::string known_case_names() {
  std::string names;
  for (const BenchCase& c : bench_cases()) names += (names.empty() ? "" : ", ") + c.name;
  return names;
}

namespace {

// `t` (float32) converted to `dtype` (rounded to nearest even), or itself.
Tensor in_dtype(Tensor& t, DType dtype) {
  if (dtype == t.dtype()) return std::move(t);
  Tensor converted(dtype, t.shape());
  convert(t.view(), converted.view());
  return converted;
}

// Deterministic values in [-1, 1): a 64-bit linear congruential generator, top 24 bits.
void fill_uniform(Tensor& tensor, uint64_t seed) {
  float* data = tensor.data_as<float>();
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    data[i] = static_cast<float>(state >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }
}

}  // namespace

namespace {
// (B, kv heads, Lk, E) storage as (B, H, Lk, E): stride 0 over the heads when it holds one.
TensorView over_heads(const Tensor& t, int64_t heads) {
  const Shape& s = t.shape();
  if (s[1] != 1 || heads == 1) return t.view();  // every head, or grouped-query
  // The attention only reads inputs: the view's non-const pointer is never written through.
  return TensorView(const_cast<void*>(t.data()), t.dtype(), Shape{s[0], heads, s[2], s[3]},
                    Shape{s[1] * s[2] * s[3], 0, s[3], 1});
}
}  // namespace

// ALiBi as a user would write it (attend/score_mod.hpp): the built-in rule's formula.
struct AlibiMod {
  const float* slopes;
  int32_t offset;  // Lk − Lq
  template <class Score>
  Score operator()(Score score, int32_t, int32_t h, int32_t q, int32_t kv) const {
    return score + slopes[h] * static_cast<float>(kv - (q + offset));
  }
};

struct RuleInputs {
  Tensor segment_ids, mask;
  std::vector<float> slopes;
  AlibiMod alibi{nullptr, 0};
  AttentionOptions options;
};

TensorView CaseTensors::key_view() const { return over_heads(key, heads); }

AttentionOptions CaseTensors::options() const { return rules->options; }

namespace {

// Causal and the rules of `s` as options (the inputs they need kept in `r`).
void set_rules(const AttentionShape& s, RuleInputs& r) {
  AttentionOptions& o = r.options;
  o.causal = s.causal;
  const bool unavailable =
      (s.compute == ComputePrecision::kFloat16 && !detail::native_f16_products()) ||
      (s.compute == ComputePrecision::kBFloat16 && !detail::native_bf16_products());
  o.compute = unavailable ? ComputePrecision::kAuto : s.compute;
  const std::vector<int64_t> starts = document_starts(s.key_len, s.rules.documents);
  if (s.rules.as_mask) {
    // (Lq, Lk): what visible_range lets through, broadcast over batch and heads.
    r.mask = Tensor::zeros(DType::kBool, Shape{s.query_len, s.key_len});
    const detail::SdpaParams positional = positional_rules(s);
    for (int64_t i = 0; i < s.query_len; ++i) {
      const auto [first, last] = visible_range(positional, starts, i);
      for (int64_t j = first; j <= last; ++j) r.mask.data_as<uint8_t>()[i * s.key_len + j] = 1;
    }
    o.mask = r.mask.view();
    o.causal = false;  // in the mask
  } else {
    if (s.rules.window_left >= 0) o.window = SlidingWindow{s.rules.window_left, 0};
    if (s.rules.documents > 0) {
      r.segment_ids = Tensor(DType::kInt32, Shape{s.key_len});
      for (int64_t j = 0; j < s.key_len; ++j) {
        r.segment_ids.data_as<int32_t>()[j] = static_cast<int32_t>(
            std::upper_bound(starts.begin(), starts.end(), j) - starts.begin());
      }
      o.segment_ids_query = r.segment_ids.view();  // Lq == Lk in these cases
      o.segment_ids_key = r.segment_ids.view();
    }
  }
  o.alibi = s.rules.alibi;
  if (s.rules.softcap > 0) o.softcap = s.rules.softcap;
  if (s.rules.user_alibi) {
    r.slopes = default_alibi_slopes(s.heads);
    r.alibi = AlibiMod{r.slopes.data(), static_cast<int32_t>(s.key_len - s.query_len)};
    o.user_rules = make_score_rules(r.alibi);
  }
}

}  // namespace
TensorView CaseTensors::value_view() const { return over_heads(value, heads); }

CaseTensors make_case_tensors(const AttentionShape& shape, bool need_weights) {
  const Shape query_shape{shape.batch, shape.heads, shape.query_len, shape.head_dim};
  const Shape key_shape{shape.batch, shape.kv_head_count(), shape.key_len, shape.head_dim};
  CaseTensors tensors;
  tensors.heads = shape.heads;
  tensors.query = Tensor(DType::kFloat32, query_shape);
  tensors.key = Tensor(DType::kFloat32, key_shape);
  tensors.value = Tensor(DType::kFloat32, key_shape);
  fill_uniform(tensors.query, 1);
  fill_uniform(tensors.key, 2);
  fill_uniform(tensors.value, 3);
  for (Tensor* t : {&tensors.query, &tensors.key, &tensors.value}) *t = in_dtype(*t, shape.dtype);
  tensors.output = Tensor::zeros(shape.dtype, query_shape);
  tensors.rules = std::make_shared<RuleInputs>();
  set_rules(shape, *tensors.rules);
  if (need_weights) {
    tensors.weights = Tensor::zeros(
        DType::kFloat32, Shape{shape.batch, shape.heads, shape.query_len, shape.key_len});
  }
  return tensors;
}

namespace {

// One backward call on (B, H, L, E) tensors; the forward runs once, here.
std::function<void()> make_backward_workload(const AttentionShape& s, int num_threads) {
  struct State {
    CaseTensors tensors;
    Tensor grad_output, logsumexp, grad_query, grad_key, grad_value;
    AttentionOptions options;
  };
  auto state = std::make_shared<State>();
  state->tensors = make_case_tensors(s, false);
  State& st = *state;
  st.options = st.tensors.options();
  st.options.num_threads = num_threads;
  st.options.need_logsumexp = true;
  AttentionResult forward = scaled_dot_product_attention(
      st.tensors.query.view(), st.tensors.key_view(), st.tensors.value_view(), st.options);
  st.tensors.output = std::move(forward.output);
  st.logsumexp = std::move(forward.logsumexp);
  st.grad_output = Tensor(DType::kFloat32, st.tensors.query.shape());
  fill_uniform(st.grad_output, 6);
  st.grad_output = in_dtype(st.grad_output, s.dtype);
  st.grad_query = Tensor::zeros(s.dtype, st.tensors.query.shape());
  st.grad_key = Tensor::zeros(s.dtype, st.tensors.key.shape());
  st.grad_value = Tensor::zeros(s.dtype, st.tensors.value.shape());
  return [state] {
    State& t = *state;
    scaled_dot_product_attention_backward_into(
        t.grad_output.view(), t.tensors.query.view(), t.tensors.key_view(), t.tensors.value_view(),
        t.tensors.output.view(), t.logsumexp.view(),
        {t.grad_query.view(), t.grad_key.view(), t.grad_value.view(), {}, {}}, t.options);
  };
}

}  // namespace

// One paged decoding call (Workload::kPagedDecode) over a cache filled once.
std::function<void()> make_paged_workload(const BenchCase& c, int num_threads) {
  const AttentionShape& s = c.shape;
  const PagedLayout& layout = c.paged;
  const std::vector<int64_t> lengths = c.paged_lengths();
  const auto batch = static_cast<int64_t>(lengths.size());
  const int64_t kv_heads = s.kv_head_count(), bs = layout.block_size, lq = s.query_len;
  int64_t blocks = 0, widest = 1, tokens = 0;
  for (int64_t l : lengths) {
    blocks += (l + bs - 1) / bs;
    widest = std::max(widest, (l + bs - 1) / bs);
    tokens += l;
  }
  struct State {
    std::unique_ptr<PagedKvCache> cache;
    std::vector<int64_t> ids;
    Tensor key_blocks, value_blocks, tables, seq_lens, query, cu_q, output;
    AttentionOptions options;
  };
  auto state = std::make_shared<State>();
  State& st = *state;
  st.options.causal = s.causal;
  st.options.num_threads = num_threads;
  st.options.compute = s.compute;
  st.query = Tensor(DType::kFloat32, Shape{batch * lq, s.heads, s.head_dim});
  fill_uniform(st.query, 1);
  st.output = Tensor::zeros(DType::kFloat32, Shape{batch * lq, s.heads, s.head_dim});
  st.cu_q = Tensor(DType::kInt32, Shape{batch + 1});
  for (int64_t b = 0; b <= batch; ++b) st.cu_q.data_as<int32_t>()[b] = static_cast<int32_t>(b * lq);
  const bool scaled = layout.format == DType::kInt8 || layout.format == DType::kFloat8E4M3 ||
                      layout.format == DType::kFloat8E5M2;
  if (scaled) {  // the cache quantizes as it appends; its blocks in append order
    KvCacheConfig config;
    config.num_blocks = blocks;
    config.block_size = bs;
    config.kv_heads = kv_heads;
    config.head_dim = s.head_dim;
    config.dtype = layout.format;
    st.cache = std::make_unique<PagedKvCache>(config);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t id = st.cache->add_sequence();
      st.ids.push_back(id);
      Tensor k(DType::kFloat32, Shape{lengths[static_cast<size_t>(b)], kv_heads, s.head_dim});
      Tensor v(DType::kFloat32, k.shape());
      fill_uniform(k, static_cast<uint32_t>(2 + 2 * b));
      fill_uniform(v, static_cast<uint32_t>(3 + 2 * b));
      Tensor cu(DType::kInt32, Shape{2});
      cu.data_as<int32_t>()[0] = 0;
      cu.data_as<int32_t>()[1] = static_cast<int32_t>(k.shape()[0]);
      st.cache->append({id}, k.view(), v.view(), cu.view());
    }
    return [state] {
      State& t = *state;
      t.cache->attend(t.ids, t.query.view(), t.cu_q.view(), t.output.view(), t.options);
    };
  }
  // Raw blocks listed in order or shuffled (seeded), each block's heads one after the other
  // as PagedKvCache keeps them: storage (num_blocks, Hkv, block_size, E), passed as the
  // (num_blocks, block_size, Hkv, E) view paged_attention_into takes.
  Tensor keys(DType::kFloat32, Shape{blocks, kv_heads, bs, s.head_dim});
  Tensor values(DType::kFloat32, keys.shape());
  fill_uniform(keys, 2);
  fill_uniform(values, 3);
  st.key_blocks = in_dtype(keys, layout.format);
  st.value_blocks = in_dtype(values, layout.format);
  std::vector<int32_t> order(static_cast<size_t>(blocks));
  std::iota(order.begin(), order.end(), 0);
  if (layout.shuffled) std::shuffle(order.begin(), order.end(), std::mt19937(11));
  st.tables = Tensor::zeros(DType::kInt32, Shape{batch, widest});
  st.seq_lens = Tensor(DType::kInt32, Shape{batch});
  size_t next = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t l = lengths[static_cast<size_t>(b)];
    st.seq_lens.data_as<int32_t>()[b] = static_cast<int32_t>(l);
    for (int64_t n = 0; n < (l + bs - 1) / bs; ++n) {
      st.tables.data_as<int32_t>()[b * widest + n] = order[next++];
    }
  }
  (void)tokens;
  return [state] {
    State& t = *state;
    const auto block_view = [](const Tensor& storage) {
      const Shape& d = storage.shape();
      return TensorView(const_cast<void*>(storage.data()), storage.dtype(),
                        Shape{d[0], d[2], d[1], d[3]},
                        Shape{d[1] * d[2] * d[3], d[3], d[2] * d[3], 1});
    };
    paged_attention_into(t.query.view(), t.cu_q.view(), block_view(t.key_blocks),
                         block_view(t.value_blocks), t.tables.view(), t.seq_lens.view(),
                         t.output.view(), t.options);
  };
}

std::function<void()> make_module_workload(const BenchCase& c, int num_threads) {
  const AttentionShape& s = c.shape;
  if (c.workload == Workload::kAttentionBackward) return make_backward_workload(s, num_threads);
  if (c.workload == Workload::kPagedDecode) return make_paged_workload(c, num_threads);
  if (c.workload == Workload::kPlanned) {
    struct State {
      CaseTensors tensors;
      std::unique_ptr<AttentionPlan> plan;
    };
    auto state = std::make_shared<State>();
    state->tensors = make_case_tensors(s, false);
    CaseTensors& t = state->tensors;
    AttentionOptions options = t.options();
    options.num_threads = num_threads;
    state->plan = std::make_unique<AttentionPlan>(t.query.view(), t.key_view(), t.value_view(),
                                                  t.output.view(), options);
    return [state] {
      CaseTensors& u = state->tensors;
      state->plan->run(u.query.view(), u.key_view(), u.value_view(), u.output.view());
    };
  }
  const int64_t width = s.heads * s.head_dim;
  if (c.workload == Workload::kMultiHeadLayer) {
    // input (B, L, H·E) -> MHA self-attention -> (B, L, H·E); weights not requested.
    auto module = std::make_shared<MultiHeadAttention>(width, s.heads, MultiHeadOptions{}, 7);
    auto input = std::make_shared<Tensor>(DType::kFloat32, Shape{s.batch, s.query_len, width});
    fill_uniform(*input, 4);
    *input = in_dtype(*input, s.dtype);
    MultiHeadForwardOptions options;
    options.need_weights = false;
    options.causal = s.causal;
    options.num_threads = num_threads;
    return [module, input, options] {
      const TensorView x = input->view();
      (void)module->forward(x, x, x, options);
    };
  }
  // (B, H·E, 64, 64) feature map -> GroupNorm, MHA over 4096 positions, residual.
  auto block = std::make_shared<SpatialSelfAttention>(width, s.heads, SpatialAttentionOptions{}, 7);
  auto map = std::make_shared<Tensor>(DType::kFloat32, Shape{s.batch, width, 64, 64});
  fill_uniform(*map, 5);
  *map = in_dtype(*map, s.dtype);
  return [block, map, num_threads] { (void)block->forward(map->view(), num_threads); };
}

void run_attention(CaseTensors& tensors, const AttentionShape& shape, int num_threads,
                   Backend backend) {
  // query (B, H, Lq, E), key and value (B, H, Lk, E) -> output (B, H, Lq, E) and, when
  // allocated, weights (B, H, Lq, Lk).
  (void)shape;
  AttentionOptions options = tensors.options();
  options.num_threads = num_threads;
  options.backend = backend;
  options.need_weights = !tensors.weights.empty();
  const TensorView weights_view = tensors.weights.view();
  scaled_dot_product_attention_into(tensors.query.view(), tensors.key_view(), tensors.value_view(),
                                    tensors.output.view(),
                                    options.need_weights ? &weights_view : nullptr, options);
}

}  // namespace attend::bench
