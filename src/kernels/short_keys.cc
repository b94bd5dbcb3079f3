// short_keys.cc: attention over a few keys (Lk <= kMaxShortKeys) and a few queries per head
// (shape_policy.hpp: ShortKeysDeclines), one Highway source compiled for every SIMD target.
//
// Reads  query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev), float32 in place.
// Writes output (..., Lq, Ev) and, on request, logsumexp (..., Lq).
//
// One work item per batch index b on several threads, one for all of them on one thread (the
// constants made once, the operands' offsets stepped from index to index); per query row i,
// in three passes over at most 16 keys (vectors of at most 8 lanes: 256-bit on AVX-512):
//   1. dots d_j = Σ_e q_i[e]·k_j[e], lanes along E; four keys' sums at once (QuadSums on x86);
//   2. scores in the log2 domain, s_j = (scale·d_j + slope_h·(j − i'))·log2 e with the ALiBi
//      term only with slopes, -inf for a key outside the row's visible keys (causal, window,
//      prefix: visible_keys) or past Lk, with the keys along the lanes: m = max(max_j s_j,
//      sink_h·log2 e), p_j = 2^(s_j − m), l = Σ_j p_j (+ 2^(sink − m) with a sink);
//   3. o_i = (Σ_j p_j·v_j) / l over the visible keys, V rows read as vectors along Ev,
//      lse_i = m·ln 2 + ln l.
// With Lk <= 4 on 8 lanes (AVX2, AVX-512), step 2 runs two rows per vector (one per 128-bit
// block), with the same operations per lane and per row, so the same results.
// E = Ev of 1, 2, 4, 8 or 16 whole vectors run loops of known length (the same operations).
// A row with no visible key (and no sink) gets the listing's answer (partial_softmax.hpp):
// the average of V's rows and lse = -1e9 + ln Lk, or zeros and -inf with
// zero_fully_masked_rows (the forward's WriteFullyExcludedRow without weights and dropout).
// Each row is computed by one thread with the same instructions whatever the thread count.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/short_keys.cc"
#include "kernels/short_keys.hpp"

#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "partial_softmax.hpp"
#include "score_rule_layer.hpp"
#include "shape_policy.hpp"
#include "simd_dispatch.hpp"

// Exp2, QuadSums, ParallelItems.
#include "kernels/kernel_common-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The kernel's vectors: the target's own, but 8 lanes (256 bits) on AVX-512, where a row's
// few keys would fill a quarter of a 16-lane vector and the reductions across its four blocks
// cost more than they save. SD/SV/kShortLanes stand for DF/VF/kLanes below.
#undef ATTEND_SHORT_256
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
#define ATTEND_SHORT_256 1
using SD = hn::FixedTag<float, 8>;
#else
#define ATTEND_SHORT_256 0
using SD = DF;
#endif
using SV = hn::Vec<SD>;
constexpr int64_t kShortLanes = static_cast<int64_t>(hn::MaxLanes(SD()));

// Two rows per vector for Lk <= 4 (ShortKeysItem): 256-bit vectors of two 4-lane blocks.
#undef ATTEND_SHORT_PAIRS
#if ATTEND_SHORT_256 || (HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2)
#define ATTEND_SHORT_PAIRS 1
#else
#define ATTEND_SHORT_PAIRS 0
#endif

#if ATTEND_SHORT_256
// QuadSums (kernel_common-inl.h) on 256-bit vectors: [Σ acc0, Σ acc1, Σ acc2, Σ acc3] in
// lanes 0..3 of both 128-bit blocks, the same steps as the AVX2 target's.
HWY_INLINE SV ShortQuadSums(SV acc0, SV acc1, SV acc2, SV acc3) {
  const SD d;
  const SV ab = hn::Add(hn::InterleaveLower(d, acc0, acc1), hn::InterleaveUpper(d, acc0, acc1));
  const SV cd = hn::Add(hn::InterleaveLower(d, acc2, acc3), hn::InterleaveUpper(d, acc2, acc3));
  const hn::Repartition<double, SD> d64;
  const auto ab64 = hn::BitCast(d64, ab), cd64 = hn::BitCast(d64, cd);
  const SV quad = hn::Add(hn::BitCast(d, hn::InterleaveLower(d64, ab64, cd64)),
                          hn::BitCast(d, hn::InterleaveUpper(d64, ab64, cd64)));
  return hn::Add(quad, SV{_mm256_permute2f128_ps(quad.raw, quad.raw, 1)});
}

// Exp2 (kernel_common-inl.h, AVX-512 form) on 256-bit vectors: the same instructions per lane
// (vreduceps, vscalefps with AVX512VL), so the same results.
HWY_INLINE SV ShortExp2(SD d, SV x) {
  const SV f{_mm256_reduce_ps(x.raw, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  return SV{_mm256_scalef_ps(Exp2Fraction(d, f).raw, hn::Sub(x, f).raw)};
}
#else
#if ATTEND_QUAD_SUMS
HWY_INLINE SV ShortQuadSums(SV acc0, SV acc1, SV acc2, SV acc3) {
  return QuadSums(acc0, acc1, acc2, acc3);
}
#endif
HWY_INLINE SV ShortExp2(SD d, SV x) { return Exp2(d, x); }
#endif

// A row's scores: kMaxShortKeys rounded up to whole vectors, and one vector more, which
// QuadSums' whole-vector stores of the last four keys may reach.
constexpr int64_t kShortScores =
    (kMaxShortKeys + kShortLanes - 1) / kShortLanes * kShortLanes + kShortLanes;

// The work items need no buffers (ParallelItems' workspace).
struct NoWorkspace {
  explicit NoWorkspace(const SdpaParams&) {}
  bool ok() const { return true; }
};

#if ATTEND_QUAD_SUMS
// Keys j..j+3's dot products with q over e_len = whole vectors, as ShortQuadSums gives them
// (lanes 0..3 of every 128-bit block); keys past `last` repeat key `last` (their sums land
// past Lk and are excluded).
HWY_INLINE SV FourDots(const float* HWY_RESTRICT q, const float* HWY_RESTRICT key,
                       int64_t stride, int64_t j, int64_t last, int64_t e_len) {
  const SD d;
  const float* k0 = key + j * stride;
  const float* k1 = key + std::min(j + 1, last) * stride;
  const float* k2 = key + std::min(j + 2, last) * stride;
  const float* k3 = key + std::min(j + 3, last) * stride;
  SV a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  for (int64_t e = 0; e < e_len; e += kShortLanes) {
    const SV qv = hn::LoadU(d, q + e);
    a0 = hn::MulAdd(qv, hn::LoadU(d, k0 + e), a0);
    a1 = hn::MulAdd(qv, hn::LoadU(d, k1 + e), a1);
    a2 = hn::MulAdd(qv, hn::LoadU(d, k2 + e), a2);
    a3 = hn::MulAdd(qv, hn::LoadU(d, k3 + e), a3);
  }
  return ShortQuadSums(a0, a1, a2, a3);
}
#endif

// dots[j] = Σ_e q[e]·key[j·stride + e] for j < Lk (dots[Lk, ⌈Lk/4⌉·4 + lanes) may be written).
// E = NE·lanes when NE > 0 (loops of known length, unrolled), any E when NE is 0; the sums
// are the same either way.
template <int NE>
HWY_INLINE void ShortDots(const SdpaParams& p, const float* HWY_RESTRICT q,
                          const float* HWY_RESTRICT key, int64_t stride, float* HWY_RESTRICT dots) {
  const SD d;
  const int64_t e_len = NE > 0 ? NE * kShortLanes : p.head_dim, lk = p.key_len;
  const int64_t vector_end = e_len / kShortLanes * kShortLanes;
#if ATTEND_QUAD_SUMS
  if (vector_end == e_len) {
    for (int64_t j = 0; j < lk; j += 4) {
      hn::StoreU(FourDots(q, key, stride, j, lk - 1, e_len), d, dots + j);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < lk; ++j) {
    const float* k = key + j * stride;
    SV acc = hn::Zero(d);
    for (int64_t e = 0; e < vector_end; e += kShortLanes) {
      acc = hn::MulAdd(hn::LoadU(d, q + e), hn::LoadU(d, k + e), acc);
    }
    float dot = hn::GetLane(hn::SumOfLanes(d, acc));
    for (int64_t e = vector_end; e < e_len; ++e) dot += q[e] * k[e];
    dots[j] = dot;
  }
}

#if ATTEND_SHORT_PAIRS
// The first four keys' dot products (Lk <= 4; keys past Lk repeat the last one) as QuadSums
// gives them: lanes 0..3 of both blocks; E = N·lanes when N > 0.
template <int N>
HWY_INLINE SV ShortQuadDots(const SdpaParams& p, const float* HWY_RESTRICT q,
                            const float* HWY_RESTRICT key, int64_t stride) {
  return FourDots(q, key, stride, 0, p.key_len - 1, N > 0 ? N * kShortLanes : p.head_dim);
}
#endif

// Batch index b's operands.
struct ShortTile {
  const float* query;
  const float* key;
  const float* value;
  float* output;
  float* logsumexp;
  int64_t key_stride, value_stride;
};

// Row i (output o) sees no key: the listing's output and log-sum-exp (see the top).
void WriteExcludedRow(const SdpaParams& p, const ShortTile& tile, int64_t i) {
  float* o = tile.output + i * p.output_strides.row;
  std::fill_n(o, p.value_dim, 0.0f);
  if (tile.logsumexp) {
    tile.logsumexp[i * p.logsumexp_strides.row] =
        p.zero_fully_masked_rows ? -std::numeric_limits<float>::infinity()
                                 : fully_excluded_logsumexp(p.key_len);
  }
  if (p.zero_fully_masked_rows) return;
  const float uniform = 1.0f / static_cast<float>(p.key_len);
  for (int64_t j = 0; j < p.key_len; ++j) {
    const float* v = tile.value + j * tile.value_stride;
    for (int64_t c = 0; c < p.value_dim; ++c) o[c] += uniform * v[c];
  }
}

// What the positional rules leave of each row: the same for every batch index, found once
// per call. Row i's visible keys [begin_i, end_i) and, per key slot j < kShortPad, all-ones
// bits where key j < Lk is visible to row i (keep, row i at keep + i·keep_row: one row shared
// by all when no positional rule applies), and j − i' with ALiBi (distance); the slots up to
// Lk rounded up to whole vectors are set.
constexpr int64_t kShortPad = (kMaxShortKeys + kShortLanes - 1) / kShortLanes * kShortLanes;
//
// With pairs (Lk <= 4 and E whole vectors on 8 lanes), the same per pair of rows 2t, 2t + 1
// instead, as one vector: slots 4h + j (j < 4) for row 2t + h (h = 1 past Lq: not kept).
struct ShortRows {
  int64_t begin[kMaxShortQueries];
  int64_t end[kMaxShortQueries];
  int64_t keep_row;
  bool pairs;
  HWY_ALIGN float keep[kMaxShortQueries * kShortPad];
  HWY_ALIGN float distance[kMaxShortQueries * kShortPad];

  explicit ShortRows(const SdpaParams& p) {
    const float all_ones = std::bit_cast<float>(~uint32_t{0});
    const int64_t padded = (p.key_len + kShortLanes - 1) / kShortLanes * kShortLanes;
    const bool same_rows = !has_positional_rules(p);
    pairs = ATTEND_SHORT_PAIRS && p.key_len <= 4 && p.head_dim % kShortLanes == 0;
    if (pairs) {
      keep_row = kShortLanes;  // per pair
      const int64_t rows = (p.query_len + 1) / 2 * 2;
      for (int64_t i = 0; i < rows; ++i) {
        const VisibleKeys keys = visible_keys(p, std::min(i, p.query_len - 1));
        if (i < p.query_len) {
          begin[i] = keys.begin();
          end[i] = keys.end();
        }
        float* keep_i = keep + i * 4;
        float* distance_i = distance + i * 4;
        for (int64_t j = 0; j < 4; ++j) {
          keep_i[j] = i < p.query_len && j < p.key_len && keys.contains(j) ? all_ones : 0.0f;
          distance_i[j] = static_cast<float>(j - (i + p.diagonal_offset));
        }
      }
      return;
    }
    keep_row = same_rows ? 0 : kShortPad;
    for (int64_t i = 0; i < p.query_len; ++i) {
      const VisibleKeys keys = visible_keys(p, i);
      begin[i] = keys.begin();
      end[i] = keys.end();
      if (i == 0 || !same_rows) {
        for (int64_t j = 0; j < padded; ++j) {
          keep[i * keep_row + j] = j < p.key_len && keys.contains(j) ? all_ones : 0.0f;
        }
      }
      if (p.alibi_slopes == nullptr) continue;
      for (int64_t j = 0; j < padded; ++j) {
        distance[i * kShortPad + j] = static_cast<float>(j - (i + p.diagonal_offset));
      }
    }
  }
};

// o[c] = inv_sum · Σ_{j ∈ [begin, end)} w[j]·v[j·v_stride + c] for c < NV·lanes: NV
// accumulators in registers, each V row read once.
template <int NV>
HWY_INLINE void WeightedValues(const float* HWY_RESTRICT w, const float* HWY_RESTRICT v,
                               int64_t v_stride, int64_t begin, int64_t end, float inv_sum,
                               float* HWY_RESTRICT o) {
  const SD d;
  SV acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = hn::Zero(d);
  for (int64_t j = begin; j < end; ++j) {
    const SV weight = hn::Set(d, w[j]);
    const float* row = v + j * v_stride;
    for (int c = 0; c < NV; ++c) {
      acc[c] = hn::MulAdd(weight, hn::LoadU(d, row + c * kShortLanes), acc[c]);
    }
  }
  const SV factor = hn::Set(d, inv_sum);
  for (int c = 0; c < NV; ++c) hn::StoreU(hn::Mul(acc[c], factor), d, o + c * kShortLanes);
}

// What is the same for every batch index of a call: its constants, made once per work item.
struct ShortConstants {
  SV minus_inf, scale, log2e;
  bool fix_rows;
  explicit ShortConstants(const SdpaParams& p)
      : minus_inf(hn::Set(SD(), -std::numeric_limits<float>::infinity())),
        scale(hn::Set(SD(), p.scale)),
        log2e(hn::Set(SD(), kLog2e)),
        fix_rows(fixes_fully_excluded_rows(p)) {}
};

// Rows [0, Lq) of one batch index (operands `tile`, head `head`). E = Ev = N·lanes when N > 0
// (loops of known length), any E and Ev when N is 0: the same operations in the same order
// either way. kPairs: rows.pairs (two rows per vector), known where the loop over batch
// indices is made, so that the constants of 2^x stay out of it.
template <int N, bool kPairs>
HWY_INLINE void ShortKeysTile(const SdpaParams& p, const ShortRows& rows, const ShortConstants& c,
                              const ShortTile& tile, int64_t head) {
  const SD d;
  const int64_t lk = p.key_len, ev = N > 0 ? N * kShortLanes : p.value_dim;
  const int64_t padded = (lk + kShortLanes - 1) / kShortLanes * kShortLanes;
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const float sink = p.sinks ? p.sinks[head] * kLog2e : kMinusInf;
  const bool fix_rows = c.fix_rows;
  const SV minus_inf = c.minus_inf;
  // Natural-domain scores scale·d (+ slope·(j − i')), then ·log2 e.
  const SV scale = c.scale, log2e = c.log2e;
  const SV slope = hn::Set(d, p.alibi_slopes ? p.alibi_slopes[head] : 0.0f);
  // Every row's softmax first (row i's weights: weights[i][j], 1/l: inv_sums[i]; 0 for a row
  // written as fully excluded), then every row's P·V: the rows' dependency chains (dots,
  // maximum, 2^x, sum, divide) overlap instead of each P·V waiting on its own.
  HWY_ALIGN float probs[kMaxShortQueries * kShortScores];
  const float* weights[kMaxShortQueries];
  float inv_sums[kMaxShortQueries];
  // Row i's end of the softmax from its maximum (with the sink) and m (0 for -inf).
  const auto finish_row = [&](int64_t i, float row_max, float m, float sum) {
    if (p.sinks) sum += std::exp2(sink - m);
    inv_sums[i] = 0.0f;
    if (rows.begin[i] >= rows.end[i] && fix_rows) {
      WriteExcludedRow(p, tile, i);
      return;
    }
    if (tile.logsumexp)
      tile.logsumexp[i * p.logsumexp_strides.row] = logsumexp_of_part(row_max, sum);
    inv_sums[i] = 1.0f / sum;
  };
#if ATTEND_SHORT_PAIRS
  if (kPairs) {
    // Rows 2t (lanes 0..3) and 2t + 1 (lanes 4..7) in one vector, keys along each block:
    // per lane the operations of the row-at-a-time loop below, and per block the maximum and
    // SumOfLanes' sum in its order (lanes past Lk hold 2^-inf = 0 there), so the same bits.
    const SV sink_v = hn::Set(d, sink);
    const SV zero = hn::Zero(d);
    for (int64_t i = 0; i < p.query_len; i += 2) {
      const int64_t i1 = std::min(i + 1, p.query_len - 1);
      float* s = probs + i * kShortLanes / 2;
      weights[i] = s;
      if (i + 1 < p.query_len) weights[i + 1] = s + 4;
      const SV dots0 =
          ShortQuadDots<N>(p, tile.query + i * p.query_strides.row, tile.key, tile.key_stride);
      const SV dots1 =
          ShortQuadDots<N>(p, tile.query + i1 * p.query_strides.row, tile.key, tile.key_stride);
      SV x = hn::Mul(hn::ConcatUpperLower(d, dots1, dots0), scale);
      if (p.alibi_slopes) x = hn::MulAdd(slope, hn::Load(d, rows.distance + i * 4), x);
      x = hn::IfThenElse(hn::MaskFromVec(hn::Load(d, rows.keep + i * 4)), hn::Mul(x, log2e),
                         minus_inf);
      SV max_v = hn::Max(x, hn::Shuffle1032(x));
      max_v = hn::Max(hn::Shuffle0321(max_v), max_v);
      const SV row_max = hn::Max(max_v, sink_v);
      const SV m_v = hn::IfThenElse(hn::Eq(row_max, minus_inf), zero, row_max);
      const SV prob = ShortExp2(d, hn::Sub(x, m_v));
      hn::Store(prob, d, s);
      SV sum_v = hn::Add(prob, hn::Shuffle1032(prob));
      sum_v = hn::Add(hn::Shuffle0321(sum_v), sum_v);
      const hn::Half<SD> dh;
      finish_row(i, hn::GetLane(row_max), hn::GetLane(m_v), hn::GetLane(sum_v));
      if (i + 1 < p.query_len) {
        finish_row(i + 1, hn::GetLane(hn::UpperHalf(dh, row_max)),
                   hn::GetLane(hn::UpperHalf(dh, m_v)), hn::GetLane(hn::UpperHalf(dh, sum_v)));
      }
    }
  } else  // NOLINT(readability/braces): the rows one at a time below
#endif
  for (int64_t i = 0; i < p.query_len; ++i) {
    float* s = probs + i * kShortScores;
    weights[i] = s;
    ShortDots<N>(p, tile.query + i * p.query_strides.row, tile.key, tile.key_stride, s);
    const float* keep = rows.keep + i * rows.keep_row;
    const float* distance = rows.distance + i * kShortPad;
    SV max_v = minus_inf;
    for (int64_t j = 0; j < padded; j += kShortLanes) {
      SV x = hn::Mul(hn::Load(d, s + j), scale);
      if (p.alibi_slopes) x = hn::MulAdd(slope, hn::Load(d, distance + j), x);
      x = hn::IfThenElse(hn::MaskFromVec(hn::Load(d, keep + j)), hn::Mul(x, log2e), minus_inf);
      hn::Store(x, d, s + j);
      max_v = hn::Max(max_v, x);
    }
    const float row_max = std::max(hn::GetLane(hn::MaxOfLanes(d, max_v)), sink);
    // m = 0 when every score is -inf (then every p_j is 0).
    const float m = row_max == kMinusInf ? 0.0f : row_max;
    const SV m_v = hn::Set(d, m);
    SV sum_v = hn::Zero(d);
    for (int64_t j = 0; j < padded; j += kShortLanes) {
      const SV prob = ShortExp2(d, hn::Sub(hn::Load(d, s + j), m_v));
      hn::Store(prob, d, s + j);
      sum_v = hn::Add(sum_v, prob);
    }
    finish_row(i, row_max, m, hn::GetLane(hn::SumOfLanes(d, sum_v)));
  }
  // P·V over each row's visible keys [begin, end) (keys hidden inside it have p_j = 0), four
  // vectors of output columns at a time.
  const float* v = tile.value;
  const int64_t v_stride = tile.value_stride;
  for (int64_t i = 0; i < p.query_len; ++i) {
    const int64_t begin = rows.begin[i], end = rows.end[i];
    if (begin >= end && fix_rows) continue;
    const float* s = weights[i];
    const float inv_sum = inv_sums[i];
    float* o = tile.output + i * p.output_strides.row;
    int64_t c = 0;
    for (; c + 4 * kShortLanes <= ev; c += 4 * kShortLanes) {
      WeightedValues<4>(s, v + c, v_stride, begin, end, inv_sum, o + c);
    }
    const int64_t vectors = (ev - c) / kShortLanes;
    if (vectors == 3) WeightedValues<3>(s, v + c, v_stride, begin, end, inv_sum, o + c);
    if (vectors == 2) WeightedValues<2>(s, v + c, v_stride, begin, end, inv_sum, o + c);
    if (vectors == 1) WeightedValues<1>(s, v + c, v_stride, begin, end, inv_sum, o + c);
    if constexpr (N == 0) {  // columns past whole vectors (none when N > 0)
      for (c += vectors * kShortLanes; c < ev; ++c) {
        float acc = 0.0f;
        for (int64_t j = begin; j < end; ++j) acc += s[j] * v[j * v_stride + c];
        o[c] = acc * inv_sum;
      }
    }
  }
  (void)lk;
}

// Batch indices [b_begin, b_end), one after another: one range per call when it runs on one
// thread (the constants made once, the operands' offsets stepped from one index to the next).
template <int N, bool kPairs>
void ShortKeysRange(const SdpaParams& p, const ShortRows& rows, int64_t b_begin, int64_t b_end) {
  if (b_begin >= b_end) return;
  const ShortConstants c(p);
  // Batch index b's coordinates and head, stepped from b_begin's (no division per index).
  SdpaParams::BatchCoordinates at = p.batch_coordinates(b_begin);
  int64_t head = head_of(p, b_begin);
  for (int64_t b = b_begin;;) {
    const ShortTile tile{p.query + at.offset(p.query_strides),
                         p.key + at.offset(p.key_strides),
                         p.value + at.offset(p.value_strides),
                         p.output + at.offset(p.output_strides),
                         p.logsumexp ? p.logsumexp + at.offset(p.logsumexp_strides) : nullptr,
                         p.key_strides.row,
                         p.value_strides.row};
    ShortKeysTile<N, kPairs>(p, rows, c, tile, head);
    if (++b == b_end) return;
    for (int k = 0; k < at.count; ++k) {
      if (++at.index[k] < p.batch_shape[at.dim[k]]) break;
      at.index[k] = 0;
    }
    head = head + 1 == p.heads ? 0 : head + 1;
  }
}

template <int N>
void ShortKeysItems(const SdpaParams& p, const ShortRows& rows, int64_t b_begin, int64_t b_end) {
  if (rows.pairs) return ShortKeysRange<N, true>(p, rows, b_begin, b_end);
  ShortKeysRange<N, false>(p, rows, b_begin, b_end);
}

int64_t ShortKeysLanes() { return kShortLanes; }

// One batch index per work item on several threads; all of them in one item on one thread.
template <int N>
void RunShortKeys(const SdpaParams& p, const ShortRows& rows, double multiply_adds) {
  if (ParallelThreads(p, multiply_adds, p.batch) <= 1) {
    ParallelItems<NoWorkspace>(p, multiply_adds, 1, [&](NoWorkspace&, int64_t) {
      ShortKeysItems<N>(p, rows, 0, p.batch);
    });
    return;
  }
  ParallelItems<NoWorkspace>(p, multiply_adds, p.batch, [&](NoWorkspace&, int64_t b) {
    ShortKeysItems<N>(p, rows, b, b + 1);
  });
}

void FusedShortKeys(const SdpaParams& p) {
  if (p.query_len == 0) return;
  const ShortRows rows(p);
  const double multiply_adds = static_cast<double>(p.batch) * static_cast<double>(p.query_len) *
                               static_cast<double>(p.key_len) *
                               static_cast<double>(p.head_dim + p.value_dim);
  // E = Ev of 1, 2, 4, 8 or 16 whole vectors (the common head sizes) run loops of known length.
  const int64_t vectors = p.head_dim / kShortLanes;
  if (p.head_dim == p.value_dim && p.head_dim == vectors * kShortLanes) {
    switch (vectors) {
      case 1: return RunShortKeys<1>(p, rows, multiply_adds);
      case 2: return RunShortKeys<2>(p, rows, multiply_adds);
      case 4: return RunShortKeys<4>(p, rows, multiply_adds);
      case 8: return RunShortKeys<8>(p, rows, multiply_adds);
      case 16: return RunShortKeys<16>(p, rows, multiply_adds);
      default: break;
    }
  }
  RunShortKeys<0>(p, rows, multiply_adds);
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attend::detail {

HWY_EXPORT(FusedShortKeys);
HWY_EXPORT(ShortKeysLanes);

const char* fused_short_keys_rejects(const SdpaParams& params) {
  return ShortKeysDeclines(params, ATTEND_DISPATCH(ShortKeysLanes)());
}

void fused_short_keys(const SdpaParams& params) { ATTEND_DISPATCH(FusedShortKeys)(params); }

}  // namespace attend::detail
#endif  // HWY_ONCE
