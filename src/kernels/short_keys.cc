// short_keys.cc: attention over a few keys (Lk <= kMaxShortKeys) and a few queries per head
// (shape_policy.hpp: ShortKeysDeclines), one Highway source compiled for every SIMD target.
//
// Reads  query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev), float32 in place.
// Writes output (..., Lq, Ev) and, on request, logsumexp (..., Lq).
//
// One work item per batch index b; per query row i, in three passes over at most 16 keys:
//   1. dots d_j = Σ_e q_i[e]·k_j[e], lanes along E; four keys' sums at once (QuadSums on x86);
//   2. scores in the log2 domain, s_j = (scale·d_j + slope_h·(j − i'))·log2 e with the ALiBi
//      term only with slopes, -inf for a key outside the row's visible keys (causal, window,
//      prefix: visible_keys) or past Lk, with the keys along the lanes: m = max(max_j s_j,
//      sink_h·log2 e), p_j = 2^(s_j − m), l = Σ_j p_j (+ 2^(sink − m) with a sink);
//   3. o_i = (Σ_j p_j·v_j) / l over the visible keys, V rows read as vectors along Ev,
//      lse_i = m·ln 2 + ln l.
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

// A row's scores: kMaxShortKeys rounded up to whole vectors, and one vector more, which
// QuadSums' whole-vector stores of the last four keys may reach.
constexpr int64_t kShortScores = (kMaxShortKeys + kLanes - 1) / kLanes * kLanes + kLanes;

// The work items need no buffers (ParallelItems' workspace).
struct NoWorkspace {
  explicit NoWorkspace(const SdpaParams&) {}
  bool ok() const { return true; }
};

// dots[j] = Σ_e q[e]·key[j·stride + e] for j < Lk (dots[Lk, ⌈Lk/4⌉·4 + lanes) may be written).
HWY_INLINE void ShortDots(const SdpaParams& p, const float* HWY_RESTRICT q,
                          const float* HWY_RESTRICT key, int64_t stride, float* HWY_RESTRICT dots) {
  const DF d;
  const int64_t e_len = p.head_dim, lk = p.key_len;
  const int64_t vector_end = e_len / kLanes * kLanes;
#if ATTEND_QUAD_SUMS
  if (vector_end == e_len) {
    for (int64_t j = 0; j < lk; j += 4) {
      // Keys past Lk repeat the last one (their sums land past Lk and are excluded).
      const float* k0 = key + j * stride;
      const float* k1 = key + std::min(j + 1, lk - 1) * stride;
      const float* k2 = key + std::min(j + 2, lk - 1) * stride;
      const float* k3 = key + std::min(j + 3, lk - 1) * stride;
      VF a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
      for (int64_t e = 0; e < e_len; e += kLanes) {
        const VF qv = hn::LoadU(d, q + e);
        a0 = hn::MulAdd(qv, hn::LoadU(d, k0 + e), a0);
        a1 = hn::MulAdd(qv, hn::LoadU(d, k1 + e), a1);
        a2 = hn::MulAdd(qv, hn::LoadU(d, k2 + e), a2);
        a3 = hn::MulAdd(qv, hn::LoadU(d, k3 + e), a3);
      }
      hn::StoreU(QuadSums(a0, a1, a2, a3), d, dots + j);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < lk; ++j) {
    const float* k = key + j * stride;
    VF acc = hn::Zero(d);
    for (int64_t e = 0; e < vector_end; e += kLanes) {
      acc = hn::MulAdd(hn::LoadU(d, q + e), hn::LoadU(d, k + e), acc);
    }
    float dot = hn::GetLane(hn::SumOfLanes(d, acc));
    for (int64_t e = vector_end; e < e_len; ++e) dot += q[e] * k[e];
    dots[j] = dot;
  }
}

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
// bits where key j < Lk is visible to row i (keep), and j − i' with ALiBi (distance); the
// slots up to Lk rounded up to whole vectors are set.
constexpr int64_t kShortPad = (kMaxShortKeys + kLanes - 1) / kLanes * kLanes;
struct ShortRows {
  int64_t begin[kMaxShortQueries];
  int64_t end[kMaxShortQueries];
  HWY_ALIGN float keep[kMaxShortQueries * kShortPad];
  HWY_ALIGN float distance[kMaxShortQueries * kShortPad];

  explicit ShortRows(const SdpaParams& p) {
    const float all_ones = std::bit_cast<float>(~uint32_t{0});
    const int64_t padded = (p.key_len + kLanes - 1) / kLanes * kLanes;  // the slots read
    for (int64_t i = 0; i < p.query_len; ++i) {
      const VisibleKeys keys = visible_keys(p, i);
      begin[i] = keys.begin();
      end[i] = keys.end();
      for (int64_t j = 0; j < padded; ++j) {
        keep[i * kShortPad + j] = j < p.key_len && keys.contains(j) ? all_ones : 0.0f;
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
  const DF d;
  VF acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = hn::Zero(d);
  for (int64_t j = begin; j < end; ++j) {
    const VF weight = hn::Set(d, w[j]);
    const float* row = v + j * v_stride;
    for (int c = 0; c < NV; ++c) acc[c] = hn::MulAdd(weight, hn::LoadU(d, row + c * kLanes), acc[c]);
  }
  const VF factor = hn::Set(d, inv_sum);
  for (int c = 0; c < NV; ++c) hn::StoreU(hn::Mul(acc[c], factor), d, o + c * kLanes);
}

// Rows [0, Lq) of batch index b.
void ShortKeysItem(const SdpaParams& p, const ShortRows& rows, int64_t b) {
  const DF d;
  const SdpaParams::BatchCoordinates at = p.batch_coordinates(b);
  const ShortTile tile{p.query + at.offset(p.query_strides),
                       p.key + at.offset(p.key_strides),
                       p.value + at.offset(p.value_strides),
                       p.output + at.offset(p.output_strides),
                       p.logsumexp ? p.logsumexp + at.offset(p.logsumexp_strides) : nullptr,
                       p.key_strides.row,
                       p.value_strides.row};
  const int64_t lk = p.key_len, ev = p.value_dim;
  const int64_t padded = (lk + kLanes - 1) / kLanes * kLanes;
  const int64_t head = head_of(p, b);
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const float sink = p.sinks ? p.sinks[head] * kLog2e : kMinusInf;
  const bool fix_rows = fixes_fully_excluded_rows(p);
  const VF minus_inf = hn::Set(d, kMinusInf);
  // Natural-domain scores scale·d (+ slope·(j − i')), then ·log2 e.
  const VF scale = hn::Set(d, p.scale);
  const VF slope = hn::Set(d, p.alibi_slopes ? p.alibi_slopes[head] : 0.0f);
  const VF log2e = hn::Set(d, kLog2e);
  // Every row's softmax first (rows' weights: probs[i·kShortScores + j], 1/l: inv_sums[i];
  // 0 for a row written as fully excluded), then every row's P·V: the rows' dependency
  // chains (dots, maximum, 2^x, sum, divide) overlap instead of each P·V waiting on its own.
  HWY_ALIGN float probs[kMaxShortQueries * kShortScores];
  float inv_sums[kMaxShortQueries];
  for (int64_t i = 0; i < p.query_len; ++i) {
    float* s = probs + i * kShortScores;
    ShortDots(p, tile.query + i * p.query_strides.row, tile.key, tile.key_stride, s);
    const float* keep = rows.keep + i * kShortPad;
    const float* distance = rows.distance + i * kShortPad;
    VF max_v = minus_inf;
    for (int64_t j = 0; j < padded; j += kLanes) {
      VF x = hn::Mul(hn::Load(d, s + j), scale);
      if (p.alibi_slopes) x = hn::MulAdd(slope, hn::Load(d, distance + j), x);
      x = hn::IfThenElse(hn::MaskFromVec(hn::Load(d, keep + j)), hn::Mul(x, log2e), minus_inf);
      hn::Store(x, d, s + j);
      max_v = hn::Max(max_v, x);
    }
    const float row_max = std::max(hn::GetLane(hn::MaxOfLanes(d, max_v)), sink);
    // m = 0 when every score is -inf (then every p_j is 0).
    const float m = row_max == kMinusInf ? 0.0f : row_max;
    const VF m_v = hn::Set(d, m);
    VF sum_v = hn::Zero(d);
    for (int64_t j = 0; j < padded; j += kLanes) {
      const VF prob = Exp2(d, hn::Sub(hn::Load(d, s + j), m_v));
      hn::Store(prob, d, s + j);
      sum_v = hn::Add(sum_v, prob);
    }
    float sum = hn::GetLane(hn::SumOfLanes(d, sum_v));
    if (p.sinks) sum += std::exp2(sink - m);
    inv_sums[i] = 0.0f;
    if (rows.begin[i] >= rows.end[i] && fix_rows) {
      WriteExcludedRow(p, tile, i);
      continue;
    }
    if (tile.logsumexp) tile.logsumexp[i * p.logsumexp_strides.row] = logsumexp_of_part(row_max, sum);
    inv_sums[i] = 1.0f / sum;
  }
  // P·V over each row's visible keys [begin, end) (keys hidden inside it have p_j = 0), four
  // vectors of output columns at a time.
  const float* v = tile.value;
  const int64_t v_stride = tile.value_stride;
  for (int64_t i = 0; i < p.query_len; ++i) {
    const int64_t begin = rows.begin[i], end = rows.end[i];
    if (begin >= end && fix_rows) continue;
    const float* s = probs + i * kShortScores;
    const float inv_sum = inv_sums[i];
    float* o = tile.output + i * p.output_strides.row;
    int64_t c = 0;
    for (; c + 4 * kLanes <= ev; c += 4 * kLanes) {
      WeightedValues<4>(s, v + c, v_stride, begin, end, inv_sum, o + c);
    }
    const int64_t vectors = (ev - c) / kLanes;
    if (vectors == 3) WeightedValues<3>(s, v + c, v_stride, begin, end, inv_sum, o + c);
    if (vectors == 2) WeightedValues<2>(s, v + c, v_stride, begin, end, inv_sum, o + c);
    if (vectors == 1) WeightedValues<1>(s, v + c, v_stride, begin, end, inv_sum, o + c);
    for (c += vectors * kLanes; c < ev; ++c) {
      float acc = 0.0f;
      for (int64_t j = begin; j < end; ++j) acc += s[j] * v[j * v_stride + c];
      o[c] = acc * inv_sum;
    }
  }
}

int64_t ShortKeysLanes() { return kLanes; }

void FusedShortKeys(const SdpaParams& p) {
  if (p.query_len == 0) return;
  const ShortRows rows(p);
  const double multiply_adds = static_cast<double>(p.batch) * static_cast<double>(p.query_len) *
                               static_cast<double>(p.key_len) *
                               static_cast<double>(p.head_dim + p.value_dim);
  ParallelItems<NoWorkspace>(p, multiply_adds, p.batch,
                             [&](NoWorkspace&, int64_t b) { ShortKeysItem(p, rows, b); });
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
