// row_groups-inl.h: the few-query kernel (RowGroupAttention): lanes along E and Ev, up to
// kRowGroup rows per work item sharing each load of K and V (or, decoding, rows of several batch
// indices reading their own K and V, or up to kSharedRowGroup heads sharing one K/V head).
// Compiled once per Highway target (include after forward_common-inl.h).
#if defined(ATTEND_KERNELS_ROW_GROUPS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_ROW_GROUPS_INL_H_
#undef ATTEND_KERNELS_ROW_GROUPS_INL_H_
#else
#define ATTEND_KERNELS_ROW_GROUPS_INL_H_
#endif

#include <hwy/aligned_allocator.h>
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "attend/error.hpp"
#include "dropout.hpp"
#include "half.hpp"
#include "kv_format.hpp"
#include "score_rule_layer.hpp"
#include "sdpa_params.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// ---------------------------------------------------------------------------------------
// Few queries (decoding, short phrases): a query tile would leave most lanes empty, so the
// lanes run along E and Ev instead. A work item is a group of up to kRowGroup consecutive
// query rows of one batch index; each phase runs over the group's rows, whose independent
// dependency chains (horizontal sums, max, exp, divisions) then overlap, and the rows share
// each load of K and V. With one query per batch index (decoding) a group holds the rows of
// kRowGroup consecutive batch indices instead, each reading its own K and V: separate
// memory streams, where one stream per core leaves memory parallelism unused; or, where those
// batch indices are query heads sharing one K/V head, up to kSharedRowGroup of them
// (RowGroups::SharedRows), which read each K/V byte from memory once.
//
// Per row i:  s_j = (q_i·k_j)·scale·log2 e (+ bias), excluded → -1e9·log2 e, for the
// visible keys j < key_end_i;  m = max_j s_j;  p_j = 2^(s_j − m);  l = Σ p_j;
// output = Σ_j p_j·keep_j·v_j / l / (1 − p). The group's score rows all run to the largest
// key_end of the group (rounded up to whole vectors); lanes past a row's own key_end hold
// -inf, so their probabilities are exactly 0.

// Rows per group: their score accumulators (4 per row) and the shared K vectors must fit
// in the register file (32 registers on AVX-512, 16 below).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kRowGroup = 4;
#else
constexpr int kRowGroup = 2;
#endif

// Rows per group when the rows share one K/V head (decoding with grouped queries: 8 of the
// query heads of one K/V head where 8 divides their number; RowGroups::SharedRows), so that each
// K/V byte is read from memory once per head group. Their dots run over L1-sized blocks of keys in
// sub-groups of at most kRowGroup rows (whose accumulators fit the registers): the first sub-group
// reads a block from memory, the others from L1.
constexpr int kSharedRowGroup = 8;
constexpr int kMaxRowGroup = kSharedRowGroup > kRowGroup ? kSharedRowGroup : kRowGroup;

// Row buffers live in the workspace object itself up to these sizes (short phrases: no
// allocation per call), on the heap beyond.
constexpr int64_t kInlineKeys = 256;
constexpr int64_t kInlineValueDim = 256;

// K and V as stored: KvPtr, kKvUnit and LoadKV (kv_loads-inl.h).
// Whether LoadKV2 widens two vectors with fewer instructions than two LoadKV: float8 through
// float16 bits, whose sign extension, shift and mask then run once on 2·kLanes codes (a full
// vector of 16-bit lanes), leaving one extract and the two float16 conversions (3 vector
// instructions per kLanes codes for E4M3 against LoadKV's 4).
template <DType K>
constexpr bool kKvPairs = ATTEND_F16C_FP8 && (K == DType::kFloat8E4M3 || K == DType::kFloat8E5M2);

// Two vectors of K or V from `p` (elements [0, kLanes) into lo, [kLanes, 2·kLanes) into hi):
// the lanes of LoadKV(p) and LoadKV(p + kLanes), bit for bit.
template <DType K>
HWY_INLINE void LoadKV2(DF d, KvPtr<K> p, VF& lo, VF& hi) {
#if ATTEND_F16C_FP8
  if constexpr (kKvPairs<K>) {
    const hn::Repartition<int16_t, DF> d16;   // 2·kLanes lanes: a full vector
    const hn::Rebind<int8_t, decltype(d16)> d8;
    const hn::Half<decltype(d16)> d16h;       // kLanes lanes
    const hn::Rebind<hwy::float16_t, DF> dh;
    const auto code = hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p)));
    // As LoadKV: E5M2 is a float16's top byte; E4M3 shifted into float16's places, bit 14
    // (a copy of the sign) cleared.
    const auto bits = K == DType::kFloat8E5M2
                          ? hn::ShiftLeft<8>(code)
                          : hn::And(hn::ShiftLeft<7>(code), hn::Set(d16, int16_t{-16512}));
    lo = hn::PromoteTo(d, hn::BitCast(dh, hn::LowerHalf(d16h, bits)));
    hi = hn::PromoteTo(d, hn::BitCast(dh, hn::UpperHalf(d16h, bits)));
    return;
  }
#endif
  lo = LoadKV<K>(d, p);
  hi = LoadKV<K>(d, p + kLanes);
}

// Bytes of one element of K or V as stored.
template <DType K>
constexpr int64_t kv_bytes() {
  return static_cast<int64_t>(sizeof(std::remove_pointer_t<KvPtr<K>>));
}

// Element i of K or V, as float32, divided by kKvUnit<K> (as LoadKV's lanes).
template <DType K>
HWY_INLINE float KvAt(KvPtr<K> p, int64_t i) {
  if constexpr (K == DType::kFloat32) {
    return p[i];
  } else {
    return widen_kv(K, p, i) / kKvUnit<K>;
  }
}

// Keys ahead of the one being read at which a new run of storage rows (a block after a jump
// in the block table) is prefetched: the hardware prefetcher follows a run once started but
// cannot know where the next block lives, so each block would otherwise start with a miss
// per stream. 16 keys: one block of 16 ahead, several hundred ns at a stream's pace.
constexpr int64_t kPrefetchKeys = 16;

// Keys ahead at which rows shared by a group (one K/V stream for the core) are prefetched
// whole: a single stream keeps too few misses in flight to read at the core's share of the
// memory bandwidth. Float32: 32 keys of 128 elements, 16 KiB ahead, so that the rows in
// flight and the block being re-read (the dots' 16 KiB of K for the second sub-group of rows,
// P·V's 16 KiB chunk of V for its later column passes) fit in a 48 KiB L1 together. The
// narrower formats prefetch 64 keys ahead (16 KiB or less at E 128). BENCHMARKS.md: "Two K/V
// streams per core, and the shared stream's prefetch distance".
template <DType K>
constexpr int64_t kStreamAheadKeys = K == DType::kFloat32 ? 32 : 64;

// Bytes ahead at which a group whose rows read their own K (QuadScores with kShared false: G
// heads, G streams) prefetches every K row, through the slots (a block table's jumps are
// prefetched like the rows within a block), and at which a row reading its own V
// (AccumulateRowsBlock with G = 1) prefetches every V row. The widened formats spend 2–3
// instructions per vector, so the reorder window holds too few of the next lines' loads to
// keep enough misses in flight, and the hardware prefetcher restarts at every block of a
// paged cache. 8 KiB for a group's K: 16 keys of 4 int8 heads at E = 128, 4 keys of 4
// float32 heads; 4 KiB for one V: 32 int8 rows of 128, 8 float32 rows.
constexpr int64_t kOwnKeysAheadBytes = 8192;
constexpr int64_t kOwnValuesAheadBytes = 4096;
// Spans of own rows of at most this many bytes (a group's K, one row's V) are not prefetched
// row by row: they are short (decode64-plan: 64 keys, 64 KiB of K per group of 4 heads, 16 KiB
// of V per head, from L2), and the prefetches' instructions cost more than they save there.
constexpr int64_t kOwnPrefetchMinBytes = 64 * 1024;

// Keys ahead that put `bytes_ahead` bytes of rows of `row_bytes` each in flight (at least 1).
constexpr int64_t KeysAhead(int64_t bytes_ahead, int64_t row_bytes) {
  return row_bytes <= 0 ? 1 : std::max<int64_t>((bytes_ahead + row_bytes - 1) / row_bytes, 1);
}

// Prefetches the first `bytes` of key j's row (base + slot[j]·stride) when j < end.
template <DType K>
HWY_INLINE void PrefetchRow(KvPtr<K> base, const int64_t* slot, int64_t j, int64_t end,
                            int64_t stride, int64_t bytes) {
  if (j >= end) return;
  const char* row = reinterpret_cast<const char*>(base + slot[j] * stride);
  for (int64_t o = 0; o < bytes; o += 64) hwy::Prefetch(row + o);
}

// Whether a key of [j, j + 4) (before key_end) may start a new run of slots: the ends of the
// four lie further apart than consecutive slots (a jump that a later one undid would be
// missed: only a prefetch is lost).
HWY_INLINE bool RunStartsIn4(const int64_t* slot, int64_t j, int64_t key_end) {
  if (j >= key_end) return false;
  const int64_t last = std::min(j + 4, key_end) - 1;
  return slot[last] - slot[j - 1] != last - j + 1;
}

// Where key j (< key_end) starts a run of slots, prefetches the `elements` of its row and of
// the next key's from `base` (row slot · stride).
template <DType K>
HWY_INLINE void PrefetchRunStart(KvPtr<K> base, const int64_t* slot, int64_t j, int64_t key_end,
                                 int64_t stride, int64_t elements) {
  if (j >= key_end || slot[j] == slot[j - 1] + 1) return;
  const int64_t bytes = elements * kv_bytes<K>();
  for (int64_t k = j; k < std::min(j + 2, key_end); ++k) {
    const char* row = reinterpret_cast<const char*>(base + slot[k] * stride);
    for (int64_t o = 0; o < bytes; o += 64) hwy::Prefetch(row + o);
  }
}

struct RowWorkspace {
  float* scores;   // [kMaxRowGroup][score_stride]: Lk rounded up to lanes
  float* out;      // [kMaxRowGroup][out_stride]:   Ev rounded up to lanes
  // The storage row of each key of the current span (key_slot): without a block table,
  // slot_storage + span.begin, filled once per call (key j's row is j), else the span's
  // rows in slot_storage, resolved per item (SpanSlots).
  const int64_t* slots;
  int64_t* slot_storage;  // [score_stride]
  bool slots_of_keys;
  int64_t score_stride;
  int64_t out_stride;
  // The operands of the batch index tile_batch[r] (-1: none yet), row r's when a group
  // spans batch indices (one query per batch index: decoding), tiles[0] otherwise.
  Tile tiles[kMaxRowGroup] = {};
  int64_t tile_batch[kMaxRowGroup];

  explicit RowWorkspace(const SdpaParams& p) {
    std::fill_n(tile_batch, kMaxRowGroup, int64_t{-1});
    const auto lanes = static_cast<size_t>(kLanes);
    score_stride = static_cast<int64_t>(hwy::RoundUpTo(static_cast<size_t>(p.key_len), lanes));
    out_stride = static_cast<int64_t>(
        hwy::RoundUpTo(static_cast<size_t>(std::max<int64_t>(p.value_dim, 1)), lanes));
    if (score_stride <= kInlineKeys) {
      scores = inline_scores_;
      slot_storage = inline_slots_;
    } else {
      heap_scores_ = hwy::AllocateAligned<float>(static_cast<size_t>(kMaxRowGroup * score_stride));
      scores = heap_scores_.get();
      heap_slots_ = hwy::AllocateAligned<int64_t>(static_cast<size_t>(score_stride));
      slot_storage = heap_slots_.get();
    }
    slots = slot_storage;
    slots_of_keys = p.block_table == nullptr;
    if (slots_of_keys && slot_storage != nullptr) SpanSlots(p, 0, p.key_len, slot_storage);
    positional = has_positional_rules(p) || p.prefix > 0;
    plain = !has_score_mods(p) && p.bias == nullptr && !has_pairwise_rules(p);
    fix_rows = fixes_fully_excluded_rows(p);
    needs_keep = p.user_rules != nullptr && p.user_rules->mask != nullptr;
    if (needs_keep) {
      keep_storage = hwy::AllocateAligned<uint8_t>(static_cast<size_t>(p.key_len));
      keep = keep_storage.get();
    }
    if (out_stride <= kInlineValueDim) {
      out = inline_out_;
    } else {
      heap_out_ = hwy::AllocateAligned<float>(static_cast<size_t>(kMaxRowGroup * out_stride));
      out = heap_out_.get();
    }
  }
  // Lk bytes for a user mask rule's verdicts on one row (null without one).
  unsigned char* keep = nullptr;
  hwy::AlignedFreeUniquePtr<uint8_t[]> keep_storage;
  // The call's rules, judged once per thread: whether rows may start after key 0 or end
  // before the last (positional); scores need only scaling (plain); rows that see no key get
  // the listing's fix-up (fix_rows).
  bool positional = false, plain = true, fix_rows = false;
  RowWorkspace(const RowWorkspace&) = delete;
  RowWorkspace& operator=(const RowWorkspace&) = delete;
  bool ok() const {
    return scores != nullptr && slot_storage != nullptr && out != nullptr &&
           (keep != nullptr || !needs_keep);
  }
  bool needs_keep = false;

 private:
  alignas(64) float inline_scores_[kMaxRowGroup * kInlineKeys];
  alignas(64) float inline_out_[kMaxRowGroup * kInlineValueDim];
  alignas(64) int64_t inline_slots_[kInlineKeys];
  hwy::AlignedFreeUniquePtr<float[]> heap_scores_;
  hwy::AlignedFreeUniquePtr<int64_t[]> heap_slots_;
  hwy::AlignedFreeUniquePtr<float[]> heap_out_;
};

// Σ_e a[e]·b[e] for four rows b0..b3 at once (lanes along e, scalar tail).
template <DType K>
HWY_INLINE void Dot4(const float* HWY_RESTRICT a, KvPtr<K> b0, KvPtr<K> b1, KvPtr<K> b2,
                     KvPtr<K> b3, int64_t n, float* HWY_RESTRICT out) {
  const DF d;
  VF acc0 = hn::Zero(d), acc1 = hn::Zero(d), acc2 = hn::Zero(d), acc3 = hn::Zero(d);
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) {
    const VF av = hn::LoadU(d, a + e);
    acc0 = hn::MulAdd(av, LoadKV<K>(d, b0 + e), acc0);
    acc1 = hn::MulAdd(av, LoadKV<K>(d, b1 + e), acc1);
    acc2 = hn::MulAdd(av, LoadKV<K>(d, b2 + e), acc2);
    acc3 = hn::MulAdd(av, LoadKV<K>(d, b3 + e), acc3);
  }
  float s0 = hn::GetLane(hn::SumOfLanes(d, acc0)), s1 = hn::GetLane(hn::SumOfLanes(d, acc1));
  float s2 = hn::GetLane(hn::SumOfLanes(d, acc2)), s3 = hn::GetLane(hn::SumOfLanes(d, acc3));
  for (; e < n; ++e) {
    s0 += a[e] * KvAt<K>(b0, e);
    s1 += a[e] * KvAt<K>(b1, e);
    s2 += a[e] * KvAt<K>(b2, e);
    s3 += a[e] * KvAt<K>(b3, e);
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

#if ATTEND_QUAD_SUMS
// Scores of keys [0, key_end) for G rows, four keys at a time (E a multiple of kLanes):
// scores[r][j] = q_r·k_r,j with key j at key[r] + slot[j]·key_stride, stored as whole vectors;
// lanes past key_end are left unset in the last vector (the caller pads them). kShared: the rows
// share one K (key[0]), each of whose vectors is then loaded once for the G rows; else each row
// reads its own K (rows of different heads: G streams from memory, where one would leave the core's
// memory parallelism unused), each of whose rows is prefetched kOwnKeysAheadBytes ahead for
// the group. kPaged: the slots jump between blocks (a block table); the rows shared by the
// group are prefetched at each block's start (a template argument, so that contiguous K pays
// nothing). Prefetches reach up to prefetch_end (≥ key_end: the slots valid from `slot`; 0:
// none).
template <int G, bool kShared, bool kPaged, DType K>
HWY_INLINE void QuadScores(const float* const* query, const KvPtr<K>* key, const int64_t* slot,
                           int64_t key_stride, int64_t head_dim, int64_t key_end, float* scores,
                           int64_t score_stride, int64_t prefetch_end) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const auto lanes = hn::Iota(di, 0);
  VF pending[G];
  for (int r = 0; r < G; ++r) pending[r] = hn::Zero(d);
  const int64_t row_bytes = head_dim * kv_bytes<K>();
  const int64_t ahead = KeysAhead(kOwnKeysAheadBytes, G * row_bytes);
  const bool own_ahead = !kShared && prefetch_end * G * row_bytes > kOwnPrefetchMinBytes;
  int64_t j = 0;
  for (; j + 4 <= key_end; j += 4) {
    VF acc[G][4];
    for (int r = 0; r < G; ++r) {
      for (int c = 0; c < 4; ++c) acc[r][c] = hn::Zero(d);
    }
    int64_t row[4];
    for (int c = 0; c < 4; ++c) row[c] = slot[j + c] * key_stride;
    if (!kShared && own_ahead) {
      for (int c = 0; c < 4; ++c) {
        for (int r = 0; r < G; ++r) {
          PrefetchRow<K>(key[r], slot, j + ahead + c, prefetch_end, key_stride, row_bytes);
        }
      }
    }
    if (kPaged && kShared && RunStartsIn4(slot, j + kPrefetchKeys, prefetch_end)) {
      for (int c = 0; c < 4; ++c) {
        PrefetchRunStart<K>(key[0], slot, j + kPrefetchKeys + c, prefetch_end, key_stride,
                            head_dim);
      }
    }
    if constexpr (kShared) {
      for (int c = 0; c < 4; ++c) {
        PrefetchRow<K>(key[0], slot, j + kStreamAheadKeys<K> + c, prefetch_end, key_stride,
                       head_dim * kv_bytes<K>());
      }
    }
    int64_t e = 0;
    if constexpr (!kShared && kKvPairs<K>) {
      // Two vectors of each K row at a time (LoadKV2); each sum still runs in e order.
      for (; e + 2 * kLanes <= head_dim; e += 2 * kLanes) {
        for (int r = 0; r < G; ++r) {
          VF k[4], k2[4];
          for (int c = 0; c < 4; ++c) LoadKV2<K>(d, key[r] + row[c] + e, k[c], k2[c]);
          const VF q = hn::LoadU(d, query[r] + e);
          const VF q2 = hn::LoadU(d, query[r] + e + kLanes);
          for (int c = 0; c < 4; ++c) acc[r][c] = hn::MulAdd(q, k[c], acc[r][c]);
          for (int c = 0; c < 4; ++c) acc[r][c] = hn::MulAdd(q2, k2[c], acc[r][c]);
        }
      }
    }
    for (; e < head_dim; e += kLanes) {
      VF k[4];
      if constexpr (kShared) {
        for (int c = 0; c < 4; ++c) k[c] = LoadKV<K>(d, key[0] + row[c] + e);
      }
      for (int r = 0; r < G; ++r) {
        if constexpr (!kShared) {
          for (int c = 0; c < 4; ++c) k[c] = LoadKV<K>(d, key[r] + row[c] + e);
        }
        const VF q = hn::LoadU(d, query[r] + e);
        for (int c = 0; c < 4; ++c) acc[r][c] = hn::MulAdd(q, k[c], acc[r][c]);
      }
    }
    const int64_t first_lane = j % kLanes;
    const auto in_quad = hn::RebindMask(
        d, hn::And(hn::Gt(lanes, hn::Set(di, static_cast<int32_t>(first_lane - 1))),
                   hn::Lt(lanes, hn::Set(di, static_cast<int32_t>(first_lane + 4)))));
    for (int r = 0; r < G; ++r) {
      const VF quad = QuadSums(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      pending[r] = hn::IfThenElse(in_quad, quad, pending[r]);
      if (first_lane + 4 == kLanes) {
        hn::Store(pending[r], d, scores + r * score_stride + j + 4 - kLanes);
      }
    }
  }
  // The last 1–3 keys: dot products put into their lanes one by one.
  for (; j < key_end; ++j) {
    const int64_t lane = j % kLanes;
    const auto at_lane = hn::RebindMask(d, hn::Eq(lanes, hn::Set(di, static_cast<int32_t>(lane))));
    for (int r = 0; r < G; ++r) {
      VF acc = hn::Zero(d);
      for (int64_t e = 0; e < head_dim; e += kLanes) {
        acc = hn::MulAdd(hn::LoadU(d, query[r] + e),
                         LoadKV<K>(d, key[r] + slot[j] * key_stride + e), acc);
      }
      pending[r] = hn::IfThenElse(at_lane, hn::SumOfLanes(d, acc), pending[r]);
      if (lane == kLanes - 1) hn::Store(pending[r], d, scores + r * score_stride + j + 1 - kLanes);
    }
  }
  if (key_end % kLanes != 0) {
    for (int r = 0; r < G; ++r) {
      hn::Store(pending[r], d, scores + r * score_stride + key_end - key_end % kLanes);
    }
  }
}
#endif  // ATTEND_QUAD_SUMS

// Scores of keys [0, key_end) (key j at key + slot[j]·key_stride) for one row with any E:
// Dot4 and a scalar tail, each score
// put into its lane of a register vector that is stored whole (a vector load of bytes
// written by scalar stores would stall store-to-load forwarding).
template <DType K>
HWY_INLINE void RowScores(const float* query, KvPtr<K> key, const int64_t* slot, int64_t key_stride,
                          int64_t head_dim, int64_t key_end, float* scores) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const auto lanes = hn::Iota(di, 0);
  VF pending = hn::Zero(d);
  const auto put = [&](int64_t k, float score) {
    const int64_t lane = k % kLanes;
    pending =
        hn::IfThenElse(hn::RebindMask(d, hn::Eq(lanes, hn::Set(di, static_cast<int32_t>(lane)))),
                       hn::Set(d, score), pending);
    if (lane == kLanes - 1) hn::Store(pending, d, scores + k - lane);
  };
  int64_t j = 0;
  for (; j + 4 <= key_end; j += 4) {
    float dots[4];
    Dot4<K>(query, key + slot[j] * key_stride, key + slot[j + 1] * key_stride,
            key + slot[j + 2] * key_stride, key + slot[j + 3] * key_stride, head_dim, dots);
    for (int k = 0; k < 4; ++k) put(j + k, dots[k]);
  }
  for (; j < key_end; ++j) {
    float s = 0;
    for (int64_t e = 0; e < head_dim; ++e) s += query[e] * KvAt<K>(key, slot[j] * key_stride + e);
    put(j, s);
  }
  if (key_end % kLanes != 0) hn::Store(pending, d, scores + key_end - key_end % kLanes);
}

// Accumulators a block of P·V may hold (G rows × N vectors), beside the N loaded V vectors
// and a broadcast probability: 32 registers on AVX-512, 16 below.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kPvAccumulators = 16;
#else
constexpr int kPvAccumulators = 8;
#endif

// Vectors per column block for G rows reading one V: the largest power of two, at most 8,
// with G·N accumulators in kPvAccumulators. Wider blocks mean fewer passes over a key chunk's
// V rows (decode-gqa's 128 columns: 2 passes for 4 rows on AVX-512, not 4; one for 1 row).
template <int G>
constexpr int ColumnBlock() {
  int n = 8;
  while (n > 1 && G * n > kPvAccumulators) n /= 2;
  return n;
}

// out_r[c] (+)= Σ_j prob_r[j]·V[j][c] for G rows reading one V (V[j] at value + slot[j]·
// value_stride; G > 1: rows sharing a K/V head, each V vector loaded once for all of them)
// and the N vector columns from c0, starting from zero when `first`; when `last`, stores
// out_r·factor_r into dest_r instead of out_r. V is read in key order, each byte once per
// column block; per column the sum runs in key order whatever N is (the same bits for any
// block width). The first block prefetches whole rows (`columns`) up to slot_end (the slots
// valid from `slot`): kOwnValuesAheadBytes ahead with G = 1 (a row reading its own V), else
// (one stream for the core) kStreamAheadKeys<K> ahead. kPaged, G > 1: as in QuadScores.
template <int G, int N, DType K, bool kPaged>
HWY_INLINE void AccumulateRowsBlock(const float* const* prob, KvPtr<K> value, const int64_t* slot,
                                    int64_t value_stride, int64_t keys, int64_t slot_end,
                                    int64_t columns, int64_t c0, bool first, bool last,
                                    const float* factor, float* const* out, float* const* dest) {
  const DF d;
  VF acc[G][N];
  for (int r = 0; r < G; ++r) {
    for (int n = 0; n < N; ++n) {
      acc[r][n] = first ? hn::Zero(d) : hn::Load(d, out[r] + c0 + n * kLanes);
    }
  }
  const int64_t row_bytes = columns * kv_bytes<K>();
  const int64_t ahead = G > 1 ? kStreamAheadKeys<K> : KeysAhead(kOwnValuesAheadBytes, row_bytes);
  const bool ahead_rows = G > 1 || slot_end * row_bytes > kOwnPrefetchMinBytes;
  for (int64_t j = 0; j < keys; ++j) {
    if (G > 1 && kPaged && j % 4 == 0 && RunStartsIn4(slot, j + kPrefetchKeys, keys)) {
      for (int64_t k = j; k < j + 4; ++k) {
        PrefetchRunStart<K>(value + c0, slot, k + kPrefetchKeys, keys, value_stride, N * kLanes);
      }
    }
    if (c0 == 0 && ahead_rows) {
      PrefetchRow<K>(value, slot, j + ahead, slot_end, value_stride, row_bytes);
    }
    const KvPtr<K> v = value + slot[j] * value_stride + c0;
    VF vn[N];
    if constexpr (kKvPairs<K> && N % 2 == 0) {
      for (int n = 0; n < N; n += 2) LoadKV2<K>(d, v + n * kLanes, vn[n], vn[n + 1]);
    } else {
      for (int n = 0; n < N; ++n) vn[n] = LoadKV<K>(d, v + n * kLanes);
    }
    for (int r = 0; r < G; ++r) {
      const VF pj = hn::Set(d, prob[r][j]);
      for (int n = 0; n < N; ++n) acc[r][n] = hn::MulAdd(pj, vn[n], acc[r][n]);
    }
  }
  for (int r = 0; r < G; ++r) {
    for (int n = 0; n < N; ++n) {
      if (last) {
        hn::StoreU(hn::Mul(acc[r][n], hn::Set(d, factor[r])), d, dest[r] + c0 + n * kLanes);
      } else {
        hn::Store(acc[r][n], d, out[r] + c0 + n * kLanes);
      }
    }
  }
}

// AccumulateRowsBlock over the vector columns c0 ≤ c < columns (a multiple of kLanes) in
// blocks of N vectors, then N/2, ..., 1.
template <int G, DType K, bool kPaged, int N = ColumnBlock<G>()>
HWY_INLINE void AccumulateRows(const float* const* prob, KvPtr<K> value, const int64_t* slot,
                               int64_t value_stride, int64_t keys, int64_t slot_end,
                               int64_t columns, bool first, bool last, const float* factor,
                               float* const* out, float* const* dest, int64_t c0 = 0) {
  for (; c0 + N * kLanes <= columns; c0 += N * kLanes) {
    AccumulateRowsBlock<G, N, K, kPaged>(prob, value, slot, value_stride, keys, slot_end,
                                         columns, c0, first, last, factor, out, dest);
  }
  if constexpr (N > 1) {
    AccumulateRows<G, K, kPaged, N / 2>(prob, value, slot, value_stride, keys, slot_end,
                                        columns, first, last, factor, out, dest, c0);
  }
}

// x[j] *= scales[slot_j · stride] · unit for the keys j < count of a span (slots: SpanSlots;
// unit: kKvUnit; x aligned). A vector of keys whose slots run consecutively (within a block)
// reads its scales as one vector when they are contiguous (stride 1). `ends_decide`: every
// vector of keys spans at most two blocks (no block table, or blocks of at least kLanes
// rows), so its first and last slots lying kLanes − 1 apart prove the run.
HWY_INLINE void ApplyRowScalesAt(const float* scales, int64_t stride, const int64_t* slots,
                                 int64_t count, float unit, bool ends_decide, float* x) {
  const DF d;
  const VF unit_v = hn::Set(d, unit);
  int64_t j = 0;
  if (stride == 1 && ends_decide) {
    for (; j + kLanes <= count; j += kLanes) {
      if (slots[j + kLanes - 1] - slots[j] == kLanes - 1) {
        const VF scale = hn::Mul(hn::LoadU(d, scales + slots[j]), unit_v);
        hn::Store(hn::Mul(hn::Load(d, x + j), scale), d, x + j);
      } else {
        for (int64_t k = j; k < j + kLanes; ++k) x[k] *= scales[slots[k]] * unit;
      }
    }
  }
  for (; j < count; ++j) x[j] *= scales[slots[j] * stride] * unit;
}

template <int G, DType K>
class RowGroupAttention {
 public:
  RowGroupAttention(const SdpaParams& p, RowWorkspace& ws) : p_(p), ws_(ws) {}

  // Row r of the group: query row queries[r] of the batch index whose operands tiles[r]
  // points at, over the keys of `span`. shared: the rows share K and V (one batch index,
  // or K and V broadcast over the batch dimensions that differ).
  void Run(const Tile* const* tiles, const int64_t* queries, bool shared, KeySpan span) {
    span = Setup(tiles, queries, span);  // 0. rows, visible keys, storage rows
    Dots(shared);                        // 1. s = q·k (· the key's scale)
    Rules(span);                         // 2. scaling, score rules, row maxima
    Probabilities();                     // 3. p = 2^(s − m) and their sums
    Normalize(span);                     // 4. weights, dropout
    Accumulate(shared);                  // 5. output = P·V·factor
    Finish(span);                        // 6. log-sum-exp, excluded rows, partials
  }

 private:
  // 0. The rows, their visible keys (the span trimmed to them) and the storage row of each key.
  // Keys before every row's first visible key (a sliding window's far past) are not
  // computed: the span starts at the group's first visible key, rounded down to whole
  // vectors (and whole dropout words of 4 keys). The sink joins the first chunk only.
  HWY_INLINE KeySpan Setup(const Tile* const* tiles, const int64_t* queries, KeySpan span) {
    sinks_ = p_.sinks != nullptr && span.begin == 0;
    if (ws_.positional) {
      for (int r = 0; r < G; ++r) visible_keys_[r] = visible_keys(p_, queries[r]);
      if (p_.window_left >= 0) {  // only a window's left side starts rows after key 0
        int64_t group_begin = span.begin + span.count;
        for (int r = 0; r < G; ++r) group_begin = std::min(group_begin, visible_keys_[r].begin());
        const int64_t skip =
            std::clamp<int64_t>((group_begin - span.begin) / 16 * 16, 0, span.count);
        span.begin += skip;
        span.count -= skip;
      }
    } else {
      for (int r = 0; r < G; ++r) visible_keys_[r] = VisibleKeys{0, 0, p_.key_len - 1};
    }
    group_key_end_ = 0;  // from here on, key indices count from span.begin
    for (int r = 0; r < G; ++r) {
      tile_[r] = tiles[r];
      row_[r] = queries[r];
      key_end_[r] = std::clamp<int64_t>(visible_keys_[r].end() - span.begin, 0, span.count);
      group_key_end_ = std::max(group_key_end_, key_end_[r]);
      scores_[r] = ws_.scores + r * ws_.score_stride;
      query_[r] = tile_[r]->query + row_[r] * p_.query_strides.row;
      if constexpr (K == DType::kFloat32) {
        key_[r] = tile_[r]->key;
        value_[r] = tile_[r]->value;
      } else {
        key_[r] = static_cast<KvPtr<K>>(tile_[r]->key_stored);
        value_[r] = static_cast<KvPtr<K>>(tile_[r]->value_stored);
      }
    }
    padded_end_ = static_cast<int64_t>(
        hwy::RoundUpTo(static_cast<size_t>(group_key_end_), static_cast<size_t>(kLanes)));
    // The storage row of each key of the span: the block table resolved once per item.
    if (ws_.slots_of_keys) {
      ws_.slots = ws_.slot_storage + span.begin;
    } else {
      SpanSlots(p_, span.begin, group_key_end_, ws_.slot_storage);
    }
    return span;
  }

  // 1. Dot products of the keys before the group's last visible key; the keys' scales of a
  // quantized cache: s_j = scale_j · (q · code_j).
  HWY_INLINE void Dots(bool shared) {
    ComputeDots(group_key_end_, shared);
    if constexpr (is_scaled_kv_format(K)) {
      slot_ends_decide_ = p_.block_table == nullptr || p_.block_size >= kLanes;
      for (int r = 0; r < G; ++r) {
        ApplyRowScalesAt(tile_[r]->key_scales, p_.key_scale_strides.row, ws_.slots, group_key_end_,
                         kKvUnit<K>, slot_ends_decide_, scores_[r]);
      }
    }
  }

  // 1a. s_j = q_r·k_j for the keys [0, key_end) of the span, into row r of ws_.scores:
  // QuadScores (four keys' sums at once) where E is whole vectors, RowScores otherwise.
  void ComputeDots(int64_t key_end, bool shared) {
#if ATTEND_QUAD_SUMS
    if (p_.head_dim % kLanes == 0) {
      if constexpr (G > kRowGroup) {
        // Blocks of keys whose K rows fill half the L1 cache (16 KiB, whole vectors), each
        // taken by the sub-groups of kRowGroup rows in turn (the same sums per row).
        const int64_t block = std::clamp<int64_t>(
            (int64_t{16} << 10) / std::max<int64_t>(p_.head_dim * kv_bytes<K>(), 1) / 16 * 16,
            16, 256);
        for (int64_t k = 0; k < key_end; k += block) {
          SubGroupDots<0>(shared, k, std::min(block, key_end - k), key_end - k);
        }
      } else {
        SubGroupDots<0>(shared, 0, key_end, key_end);  // one sub-group: the G rows
      }
      return;
    }
#endif
    (void)shared;  // RowScores reads each row's own K
    for (int r = 0; r < G; ++r) {
      RowScores<K>(query_[r], key_[r], ws_.slots, p_.key_strides.row, p_.head_dim, key_end,
                   scores_[r]);
    }
  }

#if ATTEND_QUAD_SUMS
  // Scores of the keys [k, k + keys) for rows R0 ≤ r < G, kRowGroup rows at a time (QuadScores
  // of R rows into rows R0.. of ws_.scores); the first sub-group prefetches ahead up to
  // prefetch_end keys from k, the later ones read the block from L1.
  template <int R0>
  HWY_INLINE void SubGroupDots(bool shared, int64_t k, int64_t keys, int64_t prefetch_end) {
    constexpr int R = G - R0 < kRowGroup ? G - R0 : kRowGroup;
    const auto quads = [&](auto shared_keys, auto paged) {
      QuadScores<R, decltype(shared_keys)::value, decltype(paged)::value, K>(
          query_ + R0, key_ + R0, ws_.slots + k, p_.key_strides.row, p_.head_dim, keys,
          ws_.scores + R0 * ws_.score_stride + k, ws_.score_stride, prefetch_end);
    };
    if (shared) {
      paged_ ? quads(std::true_type{}, std::true_type{})
             : quads(std::true_type{}, std::false_type{});
    } else {
      paged_ ? quads(std::false_type{}, std::true_type{})
             : quads(std::false_type{}, std::false_type{});
    }
    if constexpr (R0 + R < G) SubGroupDots<R0 + R>(shared, k, keys, shared ? 0 : prefetch_end);
  }
#endif

  // 2. The score rules (score_rule_layer.hpp), row by row over scores_[r][0, padded_end_):
  // s_j ← s_j·scale·log2(e), and an excluded key's score -inf (the rule layer's -1e9·log2(e));
  // visible_[r] (whether any key of the span is visible) and row_max_[r] = max_j s_j. Lanes
  // past each row's key_end become -inf after scaling (the scale may be negative), so
  // 2^(-inf) = 0 leaves sums and outputs alone. Plain rows (ws_.plain: no modifications or
  // pairwise rules) are judged by position a vector at a time (2a, 2b); the others go
  // through the rule layer (2c).
  HWY_INLINE void Rules(KeySpan span) {
    const bool plain = ws_.plain;
    for (int r = 0; r < G; ++r) {
      const VisibleKeys& keys = visible_keys_[r];
      if (plain && (keys.first <= span.begin || keys.prefix_end >= keys.first)) {
        RulesAllVisible(r);
      } else if (plain) {
        RulesByPosition(r, span);
      } else {
        RulesOfLayer(r, span);
      }
    }
  }

  // 2a. Every key of the span before key_end is visible: only the tail lanes are not.
  HWY_INLINE void RulesAllVisible(int r) {
    const DF d;
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    float* scores = scores_[r];
    VF max_v = neg_inf;
    const VF factor_v = hn::Set(d, p_.scale * kLog2e);
    for (int64_t j = 0; j < padded_end_; j += kLanes) {
      VF s = hn::Mul(hn::Load(d, scores + j), factor_v);
      if (j + kLanes > key_end_[r]) {
        s = hn::IfThenElse(
            hn::FirstN(d, static_cast<size_t>(std::max<int64_t>(key_end_[r] - j, 0))), s,
            neg_inf);
      }
      hn::Store(s, d, scores + j);
      max_v = hn::Max(max_v, s);
    }
    visible_[r] = key_end_[r] > 0;
    row_max_[r] = hn::GetLane(hn::MaxOfLanes(d, max_v));
  }

  // 2b. A window's left edge (or a prefix before it) inside the span: lane l of vector j
  // holds key span.begin + j + l, visible iff before key_end and (in the prefix or from the
  // window's first key on); keys before the window and past the prefix get -inf as well.
  HWY_INLINE void RulesByPosition(int r, KeySpan span) {
    const DF d;
    const hn::RebindToSigned<DF> di;
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    float* scores = scores_[r];
    VF max_v = neg_inf;
    const VisibleKeys& keys = visible_keys_[r];
    const VF factor_v = hn::Set(d, p_.scale * kLog2e);
    const auto prefix_end = hn::Set(di, static_cast<int32_t>(std::clamp<int64_t>(
                                            keys.prefix_end - span.begin, -1, span.count)));
    const auto first = hn::Set(di, static_cast<int32_t>(std::clamp<int64_t>(
                                       keys.first - span.begin, -1, span.count + 1)));
    const auto end = hn::Set(di, static_cast<int32_t>(key_end_[r]));
    for (int64_t j = 0; j < padded_end_; j += kLanes) {
      const auto lane = hn::Iota(di, static_cast<int32_t>(j));
      const auto visible = hn::And(
          hn::Lt(lane, end), hn::Or(hn::Lt(lane, prefix_end), hn::Not(hn::Lt(lane, first))));
      const VF s = hn::IfThenElse(hn::RebindMask(d, visible),
                                  hn::Mul(hn::Load(d, scores + j), factor_v), neg_inf);
      hn::Store(s, d, scores + j);
      max_v = hn::Max(max_v, s);
    }
    const int64_t begin = span.begin, last = begin + key_end_[r] - 1;
    visible_[r] = std::min(keys.prefix_end, last + 1) > begin ||
                  std::max(keys.first, begin) <= std::min(keys.last, last);
    row_max_[r] = hn::GetLane(hn::MaxOfLanes(d, max_v));
  }

  // 2c. Modifications or pairwise rules: the rule layer's apply_score_rules_to_row (scaling
  // included), the tail lanes -inf.
  HWY_INLINE void RulesOfLayer(int r, KeySpan span) {
    const DF d;
    float* scores = scores_[r];
    VF max_v = hn::Set(d, -std::numeric_limits<float>::infinity());
    std::fill(scores + key_end_[r], scores + padded_end_,
              -std::numeric_limits<float>::infinity());
    visible_[r] = apply_score_rules_to_row(p_, tile_[r]->batch, row_[r], span.begin,
                                           key_end_[r], scores, ws_.keep);
    for (int64_t j = 0; j < padded_end_; j += kLanes) {
      max_v = hn::Max(max_v, hn::Load(d, scores + j));
    }
    row_max_[r] = hn::GetLane(hn::MaxOfLanes(d, max_v));
  }

  // 3. Probabilities 2^(s − m) and their sums (m = 0 when every score is -inf).
  // The head's sink (first chunk only) joins the maximum here and the sum below.
  HWY_INLINE void Probabilities() {
    const DF d;
    VF sum_v[G], m_v[G];
    for (int r = 0; r < G; ++r) {
      if (sinks_) {
        sink_[r] = p_.sinks[head_of(p_, tile_[r]->batch)] * kLog2e;
        row_max_[r] = std::max(row_max_[r], sink_[r]);
      }
      m_v[r] = hn::Set(d, std::isinf(row_max_[r]) && row_max_[r] < 0 ? 0.0f : row_max_[r]);
      sum_v[r] = hn::Zero(d);
    }
    for (int64_t j = 0; j < padded_end_; j += kLanes) {
      for (int r = 0; r < G; ++r) {
        const VF prob = Exp2(d, hn::Sub(hn::Load(d, scores_[r] + j), m_v[r]));
        hn::Store(prob, d, scores_[r] + j);
        sum_v[r] = hn::Add(sum_v[r], prob);
      }
    }
    for (int r = 0; r < G; ++r) {
      sum_[r] = hn::GetLane(hn::SumOfLanes(d, sum_v[r]));
      if (sinks_) sum_[r] += std::exp2(sink_[r] - row_max_[r]);
    }
  }

  // 4. Normalize (into the weights when requested), dropout. A chunk of a key split leaves
  // the normalization to the merge (and never has weights: see PlanKeySplit).
  HWY_INLINE void Normalize(KeySpan span) {
    const float keep_scale = 1.0f / (1.0f - p_.dropout);
    for (int r = 0; r < G; ++r) {
      const Tile& tile = *tile_[r];
      out_factor_[r] = span.partial ? keep_scale : keep_scale / sum_[r];
      float* scores = scores_[r];
      if (tile.weights) {
        const float inv_sum = 1.0f / sum_[r];
        for (int64_t j = 0; j < key_end_[r]; ++j) scores[j] *= inv_sum * keep_scale;
        out_factor_[r] = 1.0f;
      }
      if (p_.dropout > 0) {
        const uint32_t threshold = dropout_threshold(p_.dropout);
        for_each_dropped(p_.seed, threshold, tile.batch, global_query(p_, row_[r]),
                         global_key(p_, span.begin), key_end_[r],
                         [scores](int64_t c) { scores[c] = 0.0f; });
      }
      if (tile.weights) {
        float* w = tile.weights + row_[r] * p_.weights_strides.row;
        std::fill(w, w + span.begin, 0.0f);
        std::copy_n(scores, key_end_[r], w + span.begin);
        std::fill(w + span.begin + key_end_[r], w + p_.key_len, 0.0f);
      }
      out_[r] = ws_.out + r * ws_.out_stride;
      dest_[r] = span.partial ? span.partial->out + r * span.partial->out_stride
                              : tile.output + row_[r] * p_.output_strides.row;
    }
  }

  // 5. Output = P·V·factor, the vector columns in chunks of keys whose V rows fit in half
  // the L1 cache (16 KiB: read from memory once, from L1 for the remaining column blocks),
  // the last few columns one at a time. Rows with their own V read it row by row, in key
  // order; rows sharing V load each of its vectors once for all of them. The values' scales
  // of a quantized cache: Σ_j p_j·(scale_j · code_j) = Σ_j (p_j·scale_j)·code_j.
  HWY_INLINE void Accumulate(bool shared) {
    if constexpr (is_scaled_kv_format(K)) {
      for (int r = 0; r < G; ++r) {
        ApplyRowScalesAt(tile_[r]->value_scales, p_.value_scale_strides.row, ws_.slots,
                         group_key_end_, kKvUnit<K>, slot_ends_decide_, scores_[r]);
      }
    }
    const int64_t vector_columns = p_.value_dim - p_.value_dim % kLanes;
    const int64_t key_chunk = std::clamp<int64_t>(
        (int64_t{16} << 10) / std::max<int64_t>(vector_columns * kv_bytes<K>(), 1) / 16 * 16,
        16, 256);
    if (paged_) {
      AccumulateVectorColumns<true>(shared, vector_columns, key_chunk);
    } else {
      AccumulateVectorColumns<false>(shared, vector_columns, key_chunk);
    }
    for (int r = 0; r < G; ++r) {
      for (int64_t c = vector_columns; c < p_.value_dim; ++c) {
        float acc = 0;
        for (int64_t j = 0; j < key_end_[r]; ++j) {
          acc += scores_[r][j] * KvAt<K>(value_[r], ws_.slots[j] * p_.value_strides.row + c);
        }
        dest_[r][c] = acc * out_factor_[r];
      }
      // No key at all: AccumulateRows never ran; the exclusion fix below writes the row.
      if (group_key_end_ == 0) std::fill_n(dest_[r], p_.value_dim, 0.0f);
    }
  }

  template <bool kPaged>
  HWY_INLINE void AccumulateVectorColumns(bool shared, int64_t vector_columns, int64_t key_chunk) {
    for (int64_t k0 = 0; k0 < group_key_end_; k0 += key_chunk) {
      const int64_t keys = std::min(key_chunk, group_key_end_ - k0);
      const bool first = k0 == 0, last = k0 + key_chunk >= group_key_end_;
      if (shared) {
        const float* prob[G];
        for (int r = 0; r < G; ++r) prob[r] = scores_[r] + k0;
        AccumulateRows<G, K, kPaged>(prob, value_[0], ws_.slots + k0, p_.value_strides.row,
                                     keys, group_key_end_ - k0, vector_columns, first, last,
                                     out_factor_, out_, dest_);
      } else {
        for (int r = 0; r < G; ++r) {
          const float* prob = scores_[r] + k0;
          AccumulateRows<1, K, kPaged>(&prob, value_[r], ws_.slots + k0, p_.value_strides.row,
                                       keys, group_key_end_ - k0, vector_columns, first, last,
                                       &out_factor_[r], &out_[r], &dest_[r]);
        }
      }
    }
  }

  // 6. Log-sum-exp, rows with every key excluded; or what the merge of a split needs.
  HWY_INLINE void Finish(KeySpan span) {
    if (span.partial) {
      for (int r = 0; r < G; ++r) {
        span.partial->max[r] = row_max_[r];
        span.partial->sum[r] = sum_[r];
        span.partial->visible[r] = visible_[r];
      }
      return;
    }
    for (int r = 0; r < G; ++r) {
      const Tile& tile = *tile_[r];
      const bool excluded_row = !visible_[r] && ws_.fix_rows;
      if (tile.logsumexp) {
        tile.logsumexp[row_[r] * p_.logsumexp_strides.row] =
            excluded_row ? FullyExcludedLogSumExp(p_) : LogSumExp(row_max_[r], sum_[r]);
      }
      if (excluded_row) WriteFullyExcludedRow(p_, tile, row_[r]);
    }
  }

  const SdpaParams& p_;
  RowWorkspace& ws_;
  const Tile* tile_[G];  // operands of each row's batch index
  int64_t row_[G];       // each row's query index
  VisibleKeys visible_keys_[G];
  int64_t key_end_[G];
  bool visible_[G];
  float row_max_[G];
  float sink_[G];  // the head's sink, first chunk only (sinks_)
  bool sinks_ = false;
  bool slot_ends_decide_ = false;  // ApplyRowScalesAt's ends_decide
  const bool paged_ = p_.block_table != nullptr;  // QuadScores' and Accumulate's `paged`
  int64_t group_key_end_ = 0;  // the rows' last visible key + 1 (keys counted from the span)
  int64_t padded_end_ = 0;     // group_key_end_ rounded up to whole vectors
  float sum_[G];
  float out_factor_[G];
  float* scores_[G];
  const float* query_[G];
  KvPtr<K> key_[G];
  KvPtr<K> value_[G];
  float* out_[G];
  float* dest_[G];
};

// Work items: groups of up to kRowGroup consecutive rows of one batch index or, with one
// query per batch index (decoding), the rows of up to RowGroups::size consecutive batch
// indices.
template <int G, DType K>
void RunRowGroup(const SdpaParams& p, RowWorkspace& ws, int64_t b0, int64_t q0, bool across,
                 KeySpan span) {
  const Tile* tiles[G];
  int64_t queries[G];
  for (int r = 0; r < G; ++r) {
    const int64_t b = across ? b0 + r : b0;
    Tile& tile = ws.tiles[across ? r : 0];
    if (ws.tile_batch[across ? r : 0] != b) {  // reuse the base pointers (finding them divides)
      SetTileBatch(p, b, tile);
      ws.tile_batch[across ? r : 0] = b;
    }
    tiles[r] = &tile;
    queries[r] = across ? 0 : q0 + r;
  }
  // Rows of different batch indices still share K and V when those are broadcast over the
  // batch dimensions that differ (stride 0: multi-query attention); rows of one batch index
  // share its tile.
  bool shared = true;
  for (int r = 1; across && r < G; ++r) {
    shared = shared && tiles[r]->key == tiles[0]->key && tiles[r]->value == tiles[0]->value &&
             tiles[r]->key_stored == tiles[0]->key_stored &&
             tiles[r]->value_stored == tiles[0]->value_stored &&
             tiles[r]->key_scales == tiles[0]->key_scales &&
             tiles[r]->value_scales == tiles[0]->value_scales;
  }
  RowGroupAttention<G, K>(p, ws).Run(tiles, queries, shared, span);
}

// The row groups of a call: item → (first batch index, first query, rows).
struct RowGroups {
  bool across;  // one query per batch index: a group spans `size` batch indices
  int size;     // rows per group: kRowGroup, or the heads sharing one K/V head (SharedRows)
  int64_t per_batch;
  int64_t count;

  explicit RowGroups(const SdpaParams& p)
      : across(p.query_len == 1),
        size(across ? SharedRows(p) : kRowGroup),
        per_batch(across ? 1 : (p.query_len + kRowGroup - 1) / kRowGroup),
        count(across ? (p.batch + size - 1) / size : p.batch * per_batch) {}
  int64_t first_batch(int64_t item) const { return across ? item * size : item / per_batch; }
  int64_t first_query(int64_t item) const {
    return across ? 0 : (item - first_batch(item) * per_batch) * kRowGroup;
  }
  // Whether K and V are broadcast (stride 0) over the last batch dimension, as
  // split_kv_heads and multi-query views make them: its `heads` query heads read one K/V head.
  static bool Broadcast(const SdpaParams& p) {
    constexpr int d = kMaxBatchRank - 1;
    return p.batch_shape[d] > 1 && p.key_strides.batch[d] == 0 &&
           p.value_strides.batch[d] == 0 && p.key_scale_strides.batch[d] == 0 &&
           p.value_scale_strides.batch[d] == 0;
  }
  // Decoding: the query heads of one K/V head as one group (each K/V byte read once per
  // group) when they are at most kRowGroup, or kSharedRowGroup of them when that divides
  // their number; kRowGroup otherwise. Only these sizes are compiled (RunOfType), which
  // bounds fused_sdpa.cc's compile time (every K/V format and target: the CI's critical
  // path; BENCHMARKS.md, "CI time"), so G 5–7 read K/V in groups of kRowGroup.
  static int SharedRows(const SdpaParams& p) {
    const int64_t heads = p.batch_shape[kMaxBatchRank - 1];
    if (!Broadcast(p)) return kRowGroup;
    if (heads <= kRowGroup) return static_cast<int>(heads);
    return heads % kSharedRowGroup == 0 ? kSharedRowGroup : kRowGroup;
  }
  // Consecutive items that read the same K and V (RunItems' share): the query heads of one
  // K/V head in whole row groups, with each head's row groups.
  int64_t share(const SdpaParams& p) const {
    const int64_t heads = p.batch_shape[kMaxBatchRank - 1];
    const bool broadcast = Broadcast(p);
    if (across) return broadcast && heads % size == 0 ? heads / size : 1;
    return (broadcast ? heads : 1) * per_batch;
  }
  int64_t rows(const SdpaParams& p, int64_t item) const {
    const int64_t left = across ? p.batch - first_batch(item) : p.query_len - first_query(item);
    return std::min<int64_t>(size, left);
  }
  void Run(const SdpaParams& p, RowWorkspace& ws, int64_t item, KeySpan span) const {
    switch (p.kv_format) {
      case DType::kFloat16:
        return RunOfType<DType::kFloat16>(p, ws, item, span);
      case DType::kBFloat16:
        return RunOfType<DType::kBFloat16>(p, ws, item, span);
      case DType::kInt8:
        return RunOfType<DType::kInt8>(p, ws, item, span);
      case DType::kFloat8E4M3:
        return RunOfType<DType::kFloat8E4M3>(p, ws, item, span);
      case DType::kFloat8E5M2:
        return RunOfType<DType::kFloat8E5M2>(p, ws, item, span);
      default:
        return RunOfType<DType::kFloat32>(p, ws, item, span);
    }
  }
  template <DType K>
  void RunOfType(const SdpaParams& p, RowWorkspace& ws, int64_t item, KeySpan span) const {
    const int64_t b0 = first_batch(item), q0 = first_query(item), n = rows(p, item);
    static_assert(kMaxRowGroup == kSharedRowGroup && kRowGroup <= 4);
    if (n > kRowGroup && n != kSharedRowGroup) {  // SharedRows makes no other sizes
      throw Error("fused attention: internal error: a row group of " + std::to_string(n) +
                  " rows");
    }
    switch (n) {
      case kSharedRowGroup:
        return RunRowGroup<kSharedRowGroup, K>(p, ws, b0, q0, across, span);
      case 4:
        return RunRowGroup<4, K>(p, ws, b0, q0, across, span);
      case 3:
        return RunRowGroup<3, K>(p, ws, b0, q0, across, span);
      case 2:
        return RunRowGroup<2, K>(p, ws, b0, q0, across, span);
      default:
        return RunRowGroup<1, K>(p, ws, b0, q0, across, span);
    }
  }
};

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_ROW_GROUPS_INL_H_
