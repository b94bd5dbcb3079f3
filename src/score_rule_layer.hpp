// score_rule_layer.hpp: the one definition of how a raw score becomes the score that enters
// the softmax (attend/score_rules.hpp states the steps), used by the reference, the fused
// forward (row groups and query tiles) and the fused backward. The kernels evaluate these
// definitions a vector at a time; each vector form cites the function here it renders.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attend/score_mod.hpp"
#include "attend/score_rules.hpp"
#include "sdpa_params.hpp"

namespace attend::detail {

// ---- Exclusion by position: causal, sliding window, prefix-LM -------------------------

// The keys query i sees by position: [0, prefix_end) ∪ [first, last] (the second part empty
// when first > last).
struct VisibleKeys {
  int64_t prefix_end;
  int64_t first;
  int64_t last;
  bool contains(int64_t j) const { return j < prefix_end || (first <= j && j <= last); }
  // One past the last visible key (0 when none).
  int64_t end() const { return std::max(prefix_end, first <= last ? last + 1 : 0); }
  // One past `last`, or past the prefix: for the last row of a tile, one past the last key any
  // of its rows may see (last never decreases with the row; first may pass it).
  int64_t reach() const { return std::max<int64_t>(prefix_end, last + 1); }
  // The first visible key (end() when none).
  int64_t begin() const { return prefix_end > 0 ? 0 : std::min(first, end()); }
};

// causal: j <= i';  window: i' − left <= j <= i' + right;  prefix: j < P.
inline VisibleKeys visible_keys(const SdpaParams& p, int64_t i) {
  const int64_t aligned = i + p.diagonal_offset;
  int64_t first = 0, last = p.key_len - 1;
  if (p.causal) last = std::min(last, aligned);
  if (p.window_left >= 0) first = std::max(first, aligned - p.window_left);
  if (p.window_right >= 0) last = std::min(last, aligned + p.window_right);
  return {std::min(p.prefix, p.key_len), first, last};
}

// Whether position alone (causal, window, prefix) hides every key from every query: a block of
// context parallelism that needs no call. visible_keys' first and last never decrease with i.
inline bool excludes_every_key(const SdpaParams& p) {
  if (p.query_len == 0 || p.key_len == 0) return true;
  const VisibleKeys top = visible_keys(p, 0), bottom = visible_keys(p, p.query_len - 1);
  return top.prefix_end == 0 && (bottom.last < 0 || top.first >= p.key_len);
}

inline bool has_positional_rules(const SdpaParams& p) {
  return p.causal || p.window_left >= 0 || p.window_right >= 0;
}

// ---- Exclusion by content: documents, mask, user mask -----------------------------------

inline int64_t head_of(const SdpaParams& p, int64_t b) { return b % p.heads; }

// Global positions (AttentionOptions::block) of local query i and key j: what the user rules
// and the dropout draw see, so that a block computes exactly the whole problem's scores.
inline int64_t global_query(const SdpaParams& p, int64_t i) { return i + p.query_position; }
inline int64_t global_key(const SdpaParams& p, int64_t j) { return j + p.key_position; }

// The user rules' view of a tile of `rows` queries from local q0 and `columns` keys from
// local k0 (element (r, c) at r·query_step + c·key_step), at global positions.
inline RuleTile rule_tile(const SdpaParams& p, int64_t b, int64_t q0, int64_t k0, int64_t rows,
                          int64_t columns, int64_t query_step, int64_t key_step) {
  return RuleTile{b / p.heads, head_of(p, b), global_query(p, q0), global_key(p, k0),
                  rows,        columns,       query_step,          key_step};
}

inline int32_t query_segment(const SdpaParams& p, int64_t b, int64_t i) {
  return p
      .segment_query[p.batch_offset(p.segment_query_strides, b) + i * p.segment_query_strides.row];
}
inline int32_t key_segment(const SdpaParams& p, int64_t b, int64_t j) {
  return p.segment_key[p.batch_offset(p.segment_key_strides, b) + j * p.segment_key_strides.row];
}

// Rules that exclude single (query, key) pairs and so need a look at every pair of a tile.
inline bool has_pairwise_rules(const SdpaParams& p) {
  return p.mask != nullptr || p.segment_query != nullptr ||
         (p.user_rules != nullptr && p.user_rules->mask != nullptr);
}

// Whether any rule may exclude a key (a row may then have no visible key at all).
inline bool may_exclude(const SdpaParams& p) {
  return has_positional_rules(p) || has_pairwise_rules(p);
}

// The user's mask rule on one pair (the kernels call it a tile at a time).
inline bool user_mask_keeps(const SdpaParams& p, int64_t b, int64_t i, int64_t j) {
  const UserScoreRules& u = *p.user_rules;
  unsigned char keep = 1;
  u.mask(u.mask_mod, rule_tile(p, b, i, j, 1, 1, 0, 0), &keep);
  return keep != 0;
}

// Step 6: whether key j takes part in the softmax of query i of batch index b.
inline bool is_visible(const SdpaParams& p, int64_t b, int64_t i, int64_t j) {
  if (!visible_keys(p, i).contains(j)) return false;
  if (p.segment_query && query_segment(p, b, i) != key_segment(p, b, j)) return false;
  if (p.mask && p.mask[p.batch_offset(p.mask_strides, b) + i * p.mask_strides.row +
                       j * p.mask_strides.column] == 0) {
    return false;
  }
  if (p.user_rules && p.user_rules->mask && !user_mask_keeps(p, b, i, j)) return false;
  return true;
}

// Whether some key is_visible() to row i of batch index b: is_visible over the row's
// positional range with the operands' row pointers found once (the backward asks this of
// every row). `keep`: Lk bytes of scratch when a user mask rule exists.
inline bool row_has_visible_key(const SdpaParams& p, int64_t b, int64_t i, unsigned char* keep) {
  const VisibleKeys keys = visible_keys(p, i);
  if (!has_pairwise_rules(p)) return keys.begin() < keys.end();
  const int32_t* segments =
      p.segment_query ? p.segment_key + p.batch_offset(p.segment_key_strides, b) : nullptr;
  const int32_t segment = p.segment_query ? query_segment(p, b, i) : 0;
  const uint8_t* mask =
      p.mask ? p.mask + p.batch_offset(p.mask_strides, b) + i * p.mask_strides.row : nullptr;
  const UserScoreRules* u = p.user_rules && p.user_rules->mask ? p.user_rules : nullptr;
  if (u) {
    u->mask(u->mask_mod, rule_tile(p, b, i, 0, 1, p.key_len, 0, 1), keep);
  }
  // From the last key down: a query's own position (the diagonal) is usually visible.
  for (int64_t j = keys.end() - 1; j >= keys.begin(); --j) {
    if (!keys.contains(j)) continue;
    if (segments && segments[j * p.segment_key_strides.row] != segment) continue;
    if (mask && mask[j * p.mask_strides.column] == 0) continue;
    if (u && keep[j] == 0) continue;
    return true;
  }
  return false;
}

// Rows with no visible key get the listing's uniform weights (or kZero's zeros) by a fix-up
// after the softmax; with a sink their weights come out 0 by themselves (exp(-1e9 − sink)).
inline bool fixes_fully_excluded_rows(const SdpaParams& p) {
  return may_exclude(p) && p.sinks == nullptr;
}

// ---- Modification: softcap, bias, ALiBi, user score rule (steps 2-5) --------------------

// Step 2, the built-in rules on the scaled score alone (before bias, ALiBi and the user
// rule): softcap. A new built-in rule of this kind is added here, in has_score_shaping,
// shaped_score and shaped_score_derivative, and a vector at a time in score_rules-inl.h
// (ShapeScores, ShapeGradients); the reference and both kernels, forward and backward, reach
// it only through these.

// cap·tanh(s / cap).
template <class T>
T softcapped(T s, T cap) {
  using std::tanh;
  return cap * tanh(s / cap);
}

// Whether step 2 changes any score.
inline bool has_score_shaping(const SdpaParams& p) { return p.softcap > 0; }

// Step 2 on the scaled score s, in T (float: the few-query kernel; double: the reference).
template <class T>
T shaped_score(const SdpaParams& p, T s) {
  if (p.softcap > 0) s = softcapped(s, static_cast<T>(p.softcap));
  return s;
}

// ∂s2/∂s at the scaled score s, in double: softcap's 1 − tanh²(s / cap).
inline double shaped_score_derivative(const SdpaParams& p, double s) {
  if (p.softcap > 0) {
    const double t = std::tanh(s / p.softcap);
    return 1.0 - t * t;
  }
  return 1.0;
}

// Step 4: ALiBi's term slope·(j − i') for query i and key j, in float.
inline float alibi_term(const SdpaParams& p, int64_t head, int64_t i, int64_t j) {
  return p.alibi_slopes[head] * static_cast<float>(j - (i + p.diagonal_offset));
}
// Whether a user rule changes the scores (step 5).
inline bool has_user_modification(const SdpaParams& p) {
  return p.user_rules != nullptr && p.user_rules->modify != nullptr;
}

// Whether steps 2, 4 or 5 apply (bias alone keeps the kernels' log2-domain fast path).
inline bool has_score_mods(const SdpaParams& p) {
  return has_score_shaping(p) || p.alibi_slopes != nullptr || has_user_modification(p);
}

// Whether the scores' gradient differs from the modified scores' (steps 2 or 5 apply; bias
// and ALiBi add terms, whose derivative is 1).
inline bool has_score_derivatives(const SdpaParams& p) {
  return has_score_shaping(p) || has_user_modification(p);
}

// Steps 2-4 (softcap, bias, ALiBi) on the scaled score s of (b, i, j), in double (the
// reference's precision).
inline double builtin_modified_score(const SdpaParams& p, int64_t b, int64_t i, int64_t j,
                                     double s) {
  s = shaped_score(p, s);
  if (p.bias) {
    s += p.bias[p.batch_offset(p.bias_strides, b) + i * p.bias_strides.row +
                j * p.bias_strides.column];
  }
  if (p.alibi_slopes) {
    s += static_cast<double>(p.alibi_slopes[head_of(p, b)]) *
         static_cast<double>(j - (i + p.diagonal_offset));
  }
  return s;
}

// The user rule (step 5) on one score: its value, and its derivative when `derivative` is not
// null. The user's rule sees a float.
inline double user_modified_score(const SdpaParams& p, int64_t b, int64_t i, int64_t j, double s,
                                  double* derivative) {
  const UserScoreRules& u = *p.user_rules;
  const RuleTile one = rule_tile(p, b, i, j, 1, 1, 0, 0);
  auto value = static_cast<float>(s);
  if (derivative) {
    float grad = 1.0f;
    u.modify_gradient(u.score_mod, one, &value, &grad);
    *derivative = grad;
  }
  u.modify(u.score_mod, one, &value);
  return value;
}

// Steps 2-5 on the scaled score s of (b, i, j), in double.
inline double modified_score(const SdpaParams& p, int64_t b, int64_t i, int64_t j, double s) {
  s = builtin_modified_score(p, b, i, j, s);
  if (has_user_modification(p)) s = user_modified_score(p, b, i, j, s, nullptr);
  return s;
}

// Derivatives of steps 2-5 at the scaled score s, in double: with s2 = step 2 of s and
// s5 = user(s2 + bias + ALiBi), ∂s5/∂bias = user' and ∂s5/∂s = user'·shaping.
struct ScoreDerivatives {
  double user = 1.0;     // ∂s5/∂s4: the user rule's derivative at the score it saw
  double shaping = 1.0;  // ∂s2/∂s (shaped_score_derivative)
};
inline ScoreDerivatives modified_score_derivatives(const SdpaParams& p, int64_t b, int64_t i,
                                                   int64_t j, double s) {
  ScoreDerivatives d;
  if (has_score_shaping(p)) d.shaping = shaped_score_derivative(p, s);
  if (has_user_modification(p)) {
    (void)user_modified_score(p, b, i, j, builtin_modified_score(p, b, i, j, s), &d.user);
  }
  return d;
}

// Steps 2-6 for row i of batch index b over keys [begin, begin + count), one row at a time
// (the few-query kernel): scores[c] holds q_i·k_(begin + c) and becomes the log2-domain score
// that enters the softmax, -1e9·log2 e where excluded. keep: count bytes of scratch when a
// user mask rule exists. Returns whether some key is visible.
inline bool apply_score_rules_to_row(const SdpaParams& p, int64_t b, int64_t i, int64_t begin,
                                     int64_t count, float* scores, unsigned char* keep) {
  constexpr float kLog2eFloat = 1.4426950408889634f;
  const int64_t head = head_of(p, b);
  const float* bias =
      p.bias ? p.bias + p.batch_offset(p.bias_strides, b) + i * p.bias_strides.row : nullptr;
  for (int64_t c = 0; c < count; ++c) {
    float s = shaped_score(p, scores[c] * p.scale);
    if (bias) s += bias[(begin + c) * p.bias_strides.column];
    if (p.alibi_slopes) s += alibi_term(p, head, i, begin + c);
    scores[c] = s;
  }
  const UserScoreRules* u = p.user_rules;
  const RuleTile row = rule_tile(p, b, i, begin, 1, count, 0, 1);
  if (u && u->modify) u->modify(u->score_mod, row, scores);
  if (u && u->mask) u->mask(u->mask_mod, row, keep);
  const VisibleKeys keys = visible_keys(p, i);
  const uint8_t* mask =
      p.mask ? p.mask + p.batch_offset(p.mask_strides, b) + i * p.mask_strides.row : nullptr;
  const int32_t segment = p.segment_query ? query_segment(p, b, i) : 0;
  bool any = false;
  for (int64_t c = 0; c < count; ++c) {
    const int64_t j = begin + c;
    const bool visible =
        keys.contains(j) && (!p.segment_query || key_segment(p, b, j) == segment) &&
        (!mask || mask[j * p.mask_strides.column] != 0) && (!(u && u->mask) || keep[c] != 0);
    scores[c] = visible ? scores[c] * kLog2eFloat : kExcludedScore * kLog2eFloat;
    any = any || visible;
  }
  return any;
}

// ---- Sinks --------------------------------------------------------------------------------

// Head h's sink logit, or -inf without sinks (exp(-inf) = 0 joins no denominator).
inline float sink_of(const SdpaParams& p, int64_t b) {
  return p.sinks ? p.sinks[head_of(p, b)] : -INFINITY;
}

}  // namespace attend::detail
