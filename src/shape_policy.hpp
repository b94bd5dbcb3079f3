// shape_policy.hpp: how the forward's shape picks its kernel, its work items and the
// operands it reads — every rule in one place, read by the boundary (sdpa.cpp:
// choose_operands) and by the kernels (fused_sdpa.cc, key_split-inl.h, packing-inl.h,
// query_tiles-inl.h), so both sides apply the same numbers. Plain C++: the SIMD width comes
// in as `lanes` (float32 lanes of the dispatched target).
//
//   1. Row groups or query tiles: RunsInRowGroups.
//   2. The query tiles' height: TileVectors (1 to kMaxTileVectors vectors of queries).
//   3. The key split: PlanKeySplit (chunks of keys as extra work items).
//   4. Per-thread copies of K and V: ShouldPackKeysAndValues (interleaved float32 K/V),
//      FitsPackedFloats (also half-precision K/V widened by the tiles), FitsPackedBf16
//      (bfloat16 pairs for the products); beyond them the operands are read in place or
//      converted to float32 before the call.
//   5. Grouped-query tiles (PackGQA): PacksGroupedQueries, and the one map of a packed row
//      to its query head and query position, UnpackRow.
//   6. Short keys: ShortKeysDeclines (a few queries against a few keys, first in the kernel
//      list: kernels/short_keys.cc).
#pragma once

#include <algorithm>
#include <cstdint>

#include "score_rule_layer.hpp"
#include "sdpa_params.hpp"

namespace attend::detail {

// 1. Row groups (lanes along E, a few queries per head: decoding) while a query tile would
// be at most half full, else query tiles (queries along the lanes).
inline bool RunsInRowGroups(int64_t query_len, int64_t lanes) { return 2 * query_len <= lanes; }

// 2. A query tile holds as many vectors of queries as the queries fill, up to 4 (64 queries
// on AVX-512): enough rows to amortize each K and V broadcast over 4 FMAs.
constexpr int64_t kMaxTileVectors = 4;
inline int64_t TileVectors(int64_t query_len, int64_t lanes) {
  return std::clamp<int64_t>((query_len + lanes - 1) / lanes, 1, kMaxTileVectors);
}

// 3. Key split (FlashDecoding's split-KV): with fewer work items than kSplitItems (decoding
// over a long cache with few heads, a few query tiles against many keys), the keys are cut
// into chunks that run as separate work items, so that every core reads its share of K and
// V; the chunks' partial results are then merged by their maxima and sums (key_split-inl.h).
// The split depends on the shape only, never on the thread count, so results are bitwise
// the same at any thread count. Chunks are whole multiples of kSplitGranule keys (whole key
// tiles, and a multiple of 4 as dropout draws 4 keys per word). Not with weights, whose
// normalization needs the whole row in one place.
constexpr int64_t kSplitItems = 16;     // work items wanted: the cores of a large machine
constexpr int64_t kSplitGranule = 256;  // keys: ≥ 16 KiB of K and V per row at E = 8
//
// Work items that read the same K and V (the query heads of one K/V head, a head's several
// row groups: `share` consecutive items, RowGroups::share) run each chunk of kShareChunk
// keys one after the other on one thread: K and V come from memory once per chunk and from
// cache (512 keys of E = Ev = 128 float32: 512 KiB) for the group's other items.
constexpr int64_t kShareChunk = 512;
static_assert(kShareChunk % kSplitGranule == 0);
//
// A batch of sequences in one call (paged decoding: key_split-inl.h's RunBatchItems) cuts
// each sequence exactly as its own dense call would (PlanKeySplit of the sequence's shape,
// never of the batch or the thread count: bitwise the dense call's results), and runs the
// units of every sequence as one work list, largest first, over all threads. With a shared
// K/V head (grouped queries) a sequence of ≥ 2·kShareChunk keys is cut into kShareChunk-key
// chunks, a shorter one is shorter than that anyway: no unit reads more than 2·kShareChunk
// keys of K and V (tests/paged_batch_test.cc), so a batch of many sequences is balanced to
// within about that many tokens per thread however unequal its lengths. Without one (G 1),
// each sequence is cut for kSplitItems units as a dense call is.
struct KeySplit {
  int64_t chunks;
  int64_t chunk_len;
};
inline KeySplit PlanKeySplit(const SdpaParams& p, int64_t items, int64_t share = 1) {
  if (p.weights == nullptr && share > 1 && p.key_len >= 2 * kShareChunk) {
    return {(p.key_len + kShareChunk - 1) / kShareChunk, kShareChunk};
  }
  const int64_t wanted = std::min((kSplitItems + items - 1) / items, p.key_len / kSplitGranule);
  if (p.weights != nullptr || wanted < 2) return {1, p.key_len};
  const int64_t chunk_len =
      (p.key_len + wanted * kSplitGranule - 1) / (wanted * kSplitGranule) * kSplitGranule;
  return {(p.key_len + chunk_len - 1) / chunk_len, chunk_len};
}

// 4. Floats one thread's contiguous float32 copy of a batch index's K [Lk][E] and V [Lk][Ev]
// may take (32 MiB): the query tiles' packed copy of interleaved K/V and their widened copy
// of half-precision K/V (PackKeysAndValues).
constexpr int64_t kMaxPackedFloats = int64_t{8} << 20;
inline bool FitsPackedFloats(int64_t key_len, int64_t head_dim, int64_t value_dim) {
  return static_cast<double>(key_len) * static_cast<double>(head_dim + value_dim) <=
         static_cast<double>(kMaxPackedFloats);
}

// Query tiles read all of K and V once per tile. When the rows of K or V are not adjacent
// (heads interleaved, as in (N, L, H, D) views or the (N, L, 3, H, D) projections of a
// multi-head layer), a batch index's keys are spread over H (or 3H) times the memory, and
// every pass over them misses in L2 and the TLB (unet's shape, L 4096 and E 32, with rows
// 384 floats apart: BENCHMARKS.md, "Key split and packed K/V"). Each thread then first
// copies the K and V of the batch index it works on into a contiguous buffer, which its
// tiles of that batch index read: one copy per thread and batch index against one pass per
// query tile. Only with more than one full query tile per batch index, and not for the
// chunks of a key split (few tiles).
inline bool ShouldPackKeysAndValues(const SdpaParams& p, int64_t lanes) {
  const bool interleaved = p.key_strides.row != p.head_dim || p.value_strides.row != p.value_dim;
  return interleaved && p.query_len > kMaxTileVectors * lanes &&
         FitsPackedFloats(p.key_len, p.head_dim, p.value_dim);
}

// Bytes one thread's packed bfloat16 K and V may take (the query tiles' Bf16Operands:
// Lk·⌈E/2⌉ + ⌈Lk/2⌉·Ev pairs of 4 bytes): beyond it, the products are float32.
constexpr double kMaxPackedBf16Bytes = 256.0 * (1 << 20);
inline bool FitsPackedBf16(int64_t key_len, int64_t head_dim, int64_t value_dim) {
  const double pairs = static_cast<double>(key_len) * static_cast<double>((head_dim + 1) / 2) +
                       static_cast<double>((key_len + 1) / 2) * static_cast<double>(value_dim);
  return 4.0 * pairs <= kMaxPackedBf16Bytes;
}

// The same for the AMX tiles' layout (amx::TileOperands: K rows [Lk + 32][E'] and Vᵀ
// [Ev'][Lk' + 32] of bfloat16, E' and Lk' rounded up to 32, Ev' to 16): beyond it, the
// products stay on AVX512_BF16 (tiny E would otherwise pad every key to 32 elements).
inline bool FitsAmxTiles(int64_t key_len, int64_t head_dim, int64_t value_dim) {
  const auto up = [](int64_t n, int64_t to) { return static_cast<double>((n + to - 1) / to * to); };
  const double halves = static_cast<double>(key_len + 32) * up(head_dim, 32) +
                        up(value_dim, 16) * (up(key_len, 32) + 32);
  return 2.0 * halves <= kMaxPackedBf16Bytes;
}

// 5. Grouped-query tiles (PackGQA, after FlashAttention's pack_gqa). Where G query heads
// share one K/V head (the kernels' batch (..., Hkv, G) with K and V broadcast, stride 0, over
// G: grouped_query.hpp, or a caller's stride-0 K/V as in decode-mqa) and the row groups would
// run (few queries per head), the G·Lq rows of one K/V head form the rows of query tiles, so
// that K and V are read once per group and Q·Kᵀ and P·V run as register-blocked tiles (no
// horizontal sums): 2·G·Lq FLOPs per K/V element, compute-bound for a per-row loop at
// G·Lq = 32 (decode-verify4: 8 heads × 4 queries; BENCHMARKS.md).
//
// Threshold: the same rule as 1. on the packed rows, a query tile more than half full
// (2·G·Lq > lanes), and at least kMinGroupedRows rows (a tile of fewer gives fewer than 8
// FMAs per K or V broadcast, and the row groups already share each K/V load among up to 4
// rows): G·Lq >= 9 on AVX-512, >= 8 below; decode-gqa's G·Lq = 4 and decode-verify1's 8 stay
// in the row groups. Float32 K and V read in place, or half-precision K and V computed in
// float32 (SdpaParams::half_kv) widened once per thread and K/V head as the query tiles widen
// them (FitsPackedFloats), so that half-precision inputs keep giving the bits of the widened
// ones; or bfloat16 products (vdpbf16ps, not AMX tiles) on bfloat16 Q, K and V packed per
// thread and key span as the query tiles pack them (FitsPackedBf16), which the boundary
// chooses for these shapes (GroupsQueryRows) where the precision policy gives the query tiles
// bfloat16 products: 2·G·Lq FLOPs per 2-byte K/V element, 32 per byte at decode-verify4's
// G·Lq = 32, past what float32 FMAs reach at memory speed; or bfloat16 products on float32
// queries and K/V as stored in any format, in place or through a block table
// (SdpaParams::bf16_kv_products: a paged cache's blocks, int8 and fp8 by default, 64 FLOPs
// per int8 byte at G·Lq = 32; boundary/operands.hpp, stored_kv_bf16_products), widened into
// the same per-thread pairs. Not float16 products, not AMX tiles. Only the rules that
// depend on the query position and the head alone (causal, window, prefix, ALiBi, softcap,
// sinks): not a mask, bias, documents, user rules, dropout or weights, which index per
// (batch, query) pair the tiles' rule layer reads a tile at a time.
constexpr int64_t kMinGroupedRows = 8;
//
// The group: the last batch dimension's size when K and V are broadcast over it, else 1.
inline int64_t SharedKeyValueGroup(const SdpaParams& p) {
  constexpr int last = kMaxBatchRank - 1;
  const bool shared = p.key_strides.batch[last] == 0 && p.value_strides.batch[last] == 0;
  return shared ? p.batch_shape[last] : 1;
}
// The shape part: G query heads of Lq queries each on one K/V head make a grouped-query tile.
// The rules the grouped tiles take, one test for the kernel (on SdpaParams) and the boundary
// (on AttentionOptions, choosing bfloat16 operands for them): none of those indexed per
// (batch, query) pair, nor dropout or weights.
inline bool GroupedTilesTakeRules(bool mask, bool bias, bool segments, bool user_rules,
                                  double dropout, bool weights) {
  return !mask && !bias && !segments && !user_rules && dropout == 0.0 && !weights;
}
inline bool GroupsQueryRows(int64_t group, int64_t query_len, int64_t lanes) {
  return group >= 2 && RunsInRowGroups(query_len, lanes) &&
         !RunsInRowGroups(group * query_len, lanes) && group * query_len >= kMinGroupedRows;
}
inline bool PacksGroupedQueries(const SdpaParams& p, int64_t lanes) {
  if (!GroupsQueryRows(SharedKeyValueGroup(p), p.query_len, lanes)) return false;
  const bool float32_in_place = p.key != nullptr && p.value != nullptr && !p.stored_kv();
  const bool half_widened = p.half_kv() && p.value_half != nullptr &&
                            FitsPackedFloats(p.key_len, p.head_dim, p.value_dim);
  const bool float32_products =
      (float32_in_place || half_widened) && p.query != nullptr && !p.half_products();
  // bfloat16 pairs from bfloat16 Q, K and V in place, or from float32 queries and K/V as
  // stored or through the block table (bf16_kv_products).
  const bool pairs_from = p.bf16_kv_products ? p.query != nullptr && p.query_half == nullptr
                                             : p.value_half != nullptr && p.block_table == nullptr;
  const bool bf16_pairs = p.bf16_products() && !p.amx_tiles && pairs_from &&
                          FitsPackedBf16(p.key_len, p.head_dim, p.value_dim);
  const bool operands = (float32_products && p.block_table == nullptr) || bf16_pairs;
  const bool row_rules_only =
      GroupedTilesTakeRules(p.mask != nullptr, p.bias != nullptr, p.segment_query != nullptr,
                            p.user_rules != nullptr, p.dropout, p.weights != nullptr);
  return operands && row_rules_only;
}

// Packed row R of a K/V head's G·Lq rows, query-major (R = i·G + g: the query position never
// decreases with R, as the tiles' rule layer assumes of its rows) is query position i of
// member g of the group, batch index first + g for the group's first batch index `first`
// (head_of gives the true query head: ALiBi slopes, sinks). Every reader and writer of a
// packed row (Q rows, the rule layer, the merge's O rows) goes through this map.
struct PackedRow {
  int64_t member;  // g in [0, G)
  int64_t query;   // i in [0, Lq)
};
inline PackedRow UnpackRow(int64_t row, int64_t group) { return {row % group, row / group}; }

// 6. Short keys (kernels/short_keys.cc): with at most kMaxShortKeys keys and kMaxShortQueries
// queries per head (the `phrase` problem: 4 queries × 4 keys), the whole call is a few
// hundred multiply-adds per head, and the row groups' and tiles' per-item bookkeeping (key
// spans, padded score rows, online-softmax state) costs more than the products. One work item
// per batch index then computes each row's Lk scores (four keys' dot products summed at
// once), its softmax over one vector of keys and P·V, with no key split and no workspace.
// Float32 K and V read in place only, and only the rules of a row's position and head:
// causal, window, prefix, ALiBi, sinks, logsumexp, fully excluded rows. Declined (to the row
// groups or the query tiles, which run them): step 2's shaping (softcap), mask, bias, documents (segment ids),
// user rules, dropout, weights, half-precision, stored or paged K/V, half-precision products.
// Up to 8 float32 lanes: on AVX-512 the kernel runs 256-bit vectors (with 16 lanes a row's 4
// keys would fill a quarter of a vector; BENCHMARKS.md, "Short keys", compares a 16-lane form
// with the row groups' groups of 4 rows; "Per-call cost of the short keys").
constexpr int64_t kMaxShortKeys = 16;
constexpr int64_t kMaxShortQueries = 8;
constexpr int64_t kMaxShortLanes = 8;
inline const char* ShortKeysDeclines(const SdpaParams& p, int64_t lanes) {
  if (lanes > kMaxShortLanes) return "more than 8 lanes (the row groups)";
  if (p.key_len > kMaxShortKeys) return "more than 16 keys";
  if (p.query_len > kMaxShortQueries) return "more than 8 queries per head";
  // (A plan asks with its operands' pointers not yet set: the formats decide.)
  if (p.half_products() || p.half_kv() || p.stored_kv() || p.block_table != nullptr) {
    return "operands other than float32 in place";
  }
  if (p.weights != nullptr || p.dropout != 0.0f) return "weights or dropout";
  if (p.mask != nullptr || p.bias != nullptr || p.segment_query != nullptr ||
      p.user_rules != nullptr || has_score_shaping(p)) {
    return "a mask, bias, documents, user rules or a step-2 score shaping (softcap)";
  }
  return nullptr;
}

}  // namespace attend::detail
