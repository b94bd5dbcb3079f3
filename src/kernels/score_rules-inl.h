// score_rules-inl.h: the score rules of score_rule_layer.hpp a vector at a time, for score
// tiles laid out as the query tiles lay them out: scores[j·tq + r] for key k0 + j and query
// q0 + r, queries along the lanes (tq a multiple of the lanes). Used by the forward's query
// tiles and by the backward. Compiled once per Highway target (include after
// kernel_common-inl.h).
#if defined(ATTEND_KERNELS_SCORE_RULES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_SCORE_RULES_INL_H_
#undef ATTEND_KERNELS_SCORE_RULES_INL_H_
#else
#define ATTEND_KERNELS_SCORE_RULES_INL_H_
#endif

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>

#include "attend/score_rules.hpp"
#include "score_rule_layer.hpp"
#include "shape_policy.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// What the rules leave of a (query tile, key tile) pair: nothing (never computed), every
// pair (no per-element exclusion), or some pairs.
enum class TileVerdict : uint8_t { kEmpty, kFull, kPartial };

// The rows of one query tile as the rules see them: each row's visible keys by position
// (visible_keys: [0, prefix_end) ∪ [first, last]) and its document, as int32 lanes.
// first and last never decrease with the query index, so the tile's first and last rows
// bound the whole tile.
struct RowRules {
  hwy::AlignedFreeUniquePtr<int32_t[]> first, last, segment;  // [Tq]
  int64_t prefix_end = 0;
  int64_t rows = 0;
  int32_t min_segment = 0, max_segment = 0;

  void Allocate(int64_t tq) {
    first = hwy::AllocateAligned<int32_t>(static_cast<size_t>(tq));
    last = hwy::AllocateAligned<int32_t>(static_cast<size_t>(tq));
    segment = hwy::AllocateAligned<int32_t>(static_cast<size_t>(tq));
  }
  bool ok() const { return first && last && segment; }

  // Rows [q0, q0 + rows) of batch index b; lanes past the last row repeat it. With group > 1,
  // packed rows of a grouped-query tile (shape_policy.hpp: UnpackRow; never with documents):
  // row q0 + r is query UnpackRow(q0 + r, group).query.
  void Load(const SdpaParams& p, int64_t b, int64_t q0, int64_t row_count, int64_t tq,
            int64_t group = 1) {
    rows = row_count;
    // The batch index's query segment ids, found once (query_segment per row divides).
    const int32_t* segments =
        p.segment_query ? p.segment_query + p.batch_offset(p.segment_query_strides, b) : nullptr;
    for (int64_t r = 0; r < tq; ++r) {
      const int64_t row = q0 + std::min(r, rows - 1);
      const int64_t i = group == 1 ? row : UnpackRow(row, group).query;
      const VisibleKeys keys = visible_keys(p, i);
      prefix_end = keys.prefix_end;
      first[r] = static_cast<int32_t>(std::clamp<int64_t>(keys.first, -1, p.key_len));
      last[r] = static_cast<int32_t>(std::clamp<int64_t>(keys.last, -1, p.key_len));
      segment[r] = segments ? segments[i * p.segment_query_strides.row] : 0;
    }
    min_segment = *std::min_element(segment.get(), segment.get() + rows);
    max_segment = *std::max_element(segment.get(), segment.get() + rows);
  }

  // Keys [k0, k0 + keys) against the loaded rows, by position and document (the mask and
  // user masks are judged by KeepTile::Fill).
  TileVerdict Classify(const SdpaParams& p, int64_t b, int64_t k0, int64_t keys) const {
    if (!may_exclude(p)) return TileVerdict::kFull;
    const int64_t k_last = k0 + keys - 1;
    const bool in_prefix = k_last < prefix_end;
    if (!in_prefix && k0 >= prefix_end && (k_last < first[0] || k0 > last[rows - 1])) {
      return TileVerdict::kEmpty;
    }
    bool full = in_prefix || (first[rows - 1] <= k0 && k_last <= last[0]);
    if (p.segment_query) {
      const int32_t* segments = p.segment_key + p.batch_offset(p.segment_key_strides, b);
      const int64_t stride = p.segment_key_strides.row;
      int32_t lo = segments[k0 * stride], hi = lo;
      for (int64_t j = k0 + 1; j <= k_last; ++j) {
        const int32_t s = segments[j * stride];
        lo = std::min(lo, s);
        hi = std::max(hi, s);
      }
      if (hi < min_segment || lo > max_segment) return TileVerdict::kEmpty;
      full = full && lo == hi && min_segment == max_segment && lo == min_segment;
    }
    full = full && p.mask == nullptr && !(p.user_rules && p.user_rules->mask);
    return full ? TileVerdict::kFull : TileVerdict::kPartial;
  }
};

// The verdicts of the mask and the user's mask rule on one (key tile, query tile):
// keep[j·tq + r] nonzero where both keep the pair.
struct KeepTile {
  hwy::AlignedFreeUniquePtr<uint8_t[]> keep, user;
  int64_t tq = 0;
  bool needed = false;

  void Allocate(int64_t tk, int64_t tile_queries) {
    needed = true;
    keep = hwy::AllocateAligned<uint8_t>(static_cast<size_t>(tk * tile_queries));
    user = hwy::AllocateAligned<uint8_t>(static_cast<size_t>(tk * tile_queries));
  }
  bool ok() const { return !needed || (keep && user); }

  // Keys [k0, k0 + keys) of rows [q0, q0 + rows) of batch index b (`mask`: the batch index's
  // mask, or null). Returns whether any pair is kept (else the tile is skipped).
  // tile_queries (<= the allocated tile's) is the stride of the verdicts' key rows.
  bool Fill(const SdpaParams& p, int64_t b, const uint8_t* mask, int64_t q0, int64_t rows,
            int64_t k0, int64_t keys, int64_t tile_queries) {
    tq = tile_queries;
    uint8_t* k = keep.get();
    for (int64_t j = 0; j < keys; ++j) std::fill_n(k + j * tq, tq, uint8_t{mask == nullptr});
    if (mask) {
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* m = mask + (q0 + r) * p.mask_strides.row + k0 * p.mask_strides.column;
        for (int64_t j = 0; j < keys; ++j) {
          k[j * tq + r] = static_cast<uint8_t>(m[j * p.mask_strides.column] != 0);
        }
      }
    }
    if (p.user_rules && p.user_rules->mask) {
      const UserScoreRules& u = *p.user_rules;
      u.mask(u.mask_mod, rule_tile(p, b, q0, k0, rows, keys, 1, tq), user.get());
      for (int64_t j = 0; j < keys; ++j) {
        for (int64_t r = 0; r < rows; ++r) k[j * tq + r] &= user[j * tq + r];
      }
    }
    uint8_t any = 0;
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t r = 0; r < rows; ++r) any |= k[j * tq + r];
    }
    return any != 0;
  }
};

// tanh(x) = sign(x)·(1 − t)/(1 + t) with t = 2^(−2|x|·log2 e) in (0, 1]: one Exp2 of a
// non-positive argument and one division, a third of Highway's Tanh (Expm1). Its error is a
// few ulps of 1 in absolute terms (relative near 0), within the softcap's allowance in the
// error model (16 ulps of the cap); tanh(±large) = ±1, NaN stays NaN.
HWY_INLINE VF Tanh(DF d, VF x) {
  const VF sign = hn::And(hn::SignBit(d), x);
  const VF abs_x = hn::Xor(x, sign);
  const VF t = Exp2(d, hn::Mul(abs_x, hn::Set(d, -2.0f * kLog2e)));
  const VF one = hn::Set(d, 1.0f);
  return hn::Xor(hn::Div(hn::Sub(one, t), hn::Add(one, t)), sign);
}

// scores[j·tq + r] += bias(q0 + r, k0 + j)·unit (unit: log2 e in the log2 domain, else 1).
inline void AddBias(const SdpaParams& p, const float* bias, int64_t q0, int64_t rows, int64_t k0,
                    int64_t keys, int64_t tq, float unit, float* scores) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = bias + (q0 + r) * p.bias_strides.row + k0 * p.bias_strides.column;
    for (int64_t j = 0; j < keys; ++j) scores[j * tq + r] += row[j * p.bias_strides.column] * unit;
  }
}

// Step 4 for packed rows [q0, q0 + tq) of a grouped-query tile (group > 1; UnpackRow): each
// lane its own head's slope (batch index b + member) and query position, alibi_term's
// slope·(j − i') in float as ModifyScores computes it.
inline void AddPackedAlibi(const SdpaParams& p, int64_t b, int64_t q0, int64_t k0, int64_t keys,
                           int64_t tq, int64_t group, float* scores) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  for (int64_t r = 0; r < tq; r += kLanes) {
    HWY_ALIGN float slopes[hn::MaxLanes(d)];
    HWY_ALIGN int32_t aligned[hn::MaxLanes(di)];
    for (int64_t l = 0; l < kLanes; ++l) {
      const PackedRow row = UnpackRow(q0 + r + l, group);
      slopes[l] = p.alibi_slopes[head_of(p, b + row.member)];
      aligned[l] = static_cast<int32_t>(row.query + p.diagonal_offset);
    }
    const VF slope = hn::Load(d, slopes);
    const auto aligned_v = hn::Load(di, aligned);
    for (int64_t j = 0; j < keys; ++j) {
      const auto distance = hn::Sub(hn::Set(di, static_cast<int32_t>(k0 + j)), aligned_v);
      float* s = scores + j * tq + r;
      hn::Store(hn::Add(hn::Load(d, s), hn::Mul(slope, hn::ConvertTo(d, distance))), d, s);
    }
  }
}

// Step 2 (shaped_score, score_rule_layer.hpp) on natural-unit scores[j·tq + r], keys j <
// `keys`, every lane r < tq: softcap's cap·Tanh(s / cap).
inline void ShapeScores(const SdpaParams& p, int64_t keys, int64_t tq, float* scores) {
  const DF d;
  if (p.softcap > 0) {
    const VF cap = hn::Set(d, p.softcap), inverse_cap = hn::Set(d, 1.0f / p.softcap);
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t r = 0; r < tq; r += kLanes) {
        float* s = scores + j * tq + r;
        hn::Store(hn::Mul(cap, Tanh(d, hn::Mul(hn::Load(d, s), inverse_cap))), d, s);
      }
    }
  }
}

// The backward through step 2 (shaped_score_derivative): grad[j·tq + r] ×= ∂s2/∂s, from the
// scores after step 2 that ShapeScores wrote (`shaped`, the same layout): softcap's
// 1 − tanh² = 1 − (s2 / cap)².
inline void ShapeGradients(const SdpaParams& p, const float* shaped, int64_t keys, int64_t tq,
                           float* grad) {
  const DF d;
  if (p.softcap > 0) {
    const VF one = hn::Set(d, 1.0f), inv_cap = hn::Set(d, 1.0f / p.softcap);
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t r = 0; r < tq; r += kLanes) {
        const VF t = hn::Mul(hn::Load(d, shaped + j * tq + r), inv_cap);
        float* g = grad + j * tq + r;
        hn::Store(hn::Mul(hn::Load(d, g), hn::NegMulAdd(t, t, one)), d, g);
      }
    }
  }
}

// Steps 2-5 (score_rule_layer.hpp) on natural-unit scores, then × log2 e:
// ShapeScores, + bias, + alibi_term (slope·(j − i') in float, as there), the user rule.
// For the backward, copies of the scores after step 2 (`after_shaping`, for ShapeGradients)
// and before step 5 (`before_user`) are kept when those are not null. group > 1: the packed
// rows of a grouped-query tile (AddPackedAlibi; no bias or user rule there).
inline void ModifyScores(const SdpaParams& p, int64_t b, const float* bias, int64_t q0,
                         int64_t rows, int64_t k0, int64_t keys, int64_t tq, float* scores,
                         float* after_shaping = nullptr, float* before_user = nullptr,
                         int64_t group = 1) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const int64_t head = head_of(p, b);
  ShapeScores(p, keys, tq, scores);
  if (after_shaping) std::copy_n(scores, keys * tq, after_shaping);
  if (bias) AddBias(p, bias, q0, rows, k0, keys, tq, 1.0f, scores);
  if (p.alibi_slopes && group > 1) {
    AddPackedAlibi(p, b, q0, k0, keys, tq, group, scores);
  } else if (p.alibi_slopes) {
    const VF slope = hn::Set(d, p.alibi_slopes[head]);
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t r = 0; r < tq; r += kLanes) {
        // j − i' for lane l: (k0 + j) − (q0 + r + l + offset).
        const auto distance =
            hn::Sub(hn::Set(di, static_cast<int32_t>(k0 + j - (q0 + r + p.diagonal_offset))),
                    hn::Iota(di, 0));
        float* s = scores + j * tq + r;
        hn::Store(hn::Add(hn::Load(d, s), hn::Mul(slope, hn::ConvertTo(d, distance))), d, s);
      }
    }
  }
  if (has_user_modification(p)) {
    if (before_user) std::copy_n(scores, keys * tq, before_user);
    const UserScoreRules& u = *p.user_rules;
    u.modify(u.score_mod, rule_tile(p, b, q0, k0, rows, keys, 1, tq), scores);
  }
  const VF log2e = hn::Set(d, kLog2e);
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t r = 0; r < tq; r += kLanes) {
      float* s = scores + j * tq + r;
      hn::Store(hn::Mul(hn::Load(d, s), log2e), d, s);
    }
  }
}

// Step 6: scores of pairs that are_visible() refuses become `excluded` (the listing's -1e9 in
// the log2 domain, or -inf for the backward); visible[r] |= some key of row r is visible.
inline void ApplyExclusions(const SdpaParams& p, int64_t b, const RowRules& rows_rules,
                            const KeepTile& keep, int64_t k0, int64_t keys, int64_t tq,
                            TileVerdict verdict, float* scores, uint8_t* visible, int64_t rows,
                            float excluded_score = kExcludedScore * kLog2e) {
  if (verdict == TileVerdict::kFull) {
    for (int64_t r = 0; r < rows; ++r) visible[r] = 1;
    return;
  }
  const DF d;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint8_t, decltype(di)> d8;
  using MI = hn::Mask<decltype(di)>;
  const VF excluded = hn::Set(d, excluded_score);
  constexpr int64_t kMaxVectors = 4;
  const int64_t vectors = tq / kLanes;
  hn::Vec<decltype(di)> seen[kMaxVectors];
  for (int64_t v = 0; v < vectors; ++v) seen[v] = hn::Zero(di);
  const MI all = hn::FirstN(di, static_cast<size_t>(kLanes));
  const int32_t* key_segments =
      p.segment_query ? p.segment_key + p.batch_offset(p.segment_key_strides, b) : nullptr;
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t key = k0 + j;
    const bool in_prefix = key < rows_rules.prefix_end;
    const auto key_plus_one = hn::Set(di, static_cast<int32_t>(key + 1));
    const auto key_minus_one = hn::Set(di, static_cast<int32_t>(key - 1));
    const auto key_segment_v =
        hn::Set(di, key_segments ? key_segments[key * p.segment_key_strides.row] : int32_t{0});
    for (int64_t v = 0; v < vectors; ++v) {
      // visible_keys: first <= key <= last, or key < prefix_end.
      MI vis =
          in_prefix
              ? all
              : hn::And(hn::Lt(hn::Load(di, rows_rules.first.get() + v * kLanes), key_plus_one),
                        hn::Lt(key_minus_one, hn::Load(di, rows_rules.last.get() + v * kLanes)));
      if (p.segment_query) {
        vis = hn::And(vis,
                      hn::Eq(hn::Load(di, rows_rules.segment.get() + v * kLanes), key_segment_v));
      }
      if (keep.needed) {
        const auto kept = hn::PromoteTo(di, hn::LoadU(d8, keep.keep.get() + j * tq + v * kLanes));
        vis = hn::And(vis, hn::Ne(kept, hn::Zero(di)));
      }
      float* s = scores + j * tq + v * kLanes;
      hn::Store(hn::IfThenElse(hn::RebindMask(d, vis), hn::Load(d, s), excluded), d, s);
      seen[v] = hn::Or(seen[v], hn::VecFromMask(di, vis));
    }
  }
  HWY_ALIGN int32_t lanes[hn::MaxLanes(di)];
  for (int64_t v = 0; v < vectors; ++v) {
    hn::Store(seen[v], di, lanes);
    for (int64_t l = 0; l < kLanes && v * kLanes + l < rows; ++l) {
      visible[v * kLanes + l] |= static_cast<uint8_t>(lanes[l] != 0);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_SCORE_RULES_INL_H_
