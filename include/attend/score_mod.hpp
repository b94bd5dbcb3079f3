// attend/score_mod.hpp: attention variants written by the user (FlexAttention's score_mod and
// mask_mod), run inside the fused forward and backward.
//
//   auto alibi = [&](auto score, int32_t b, int32_t h, int32_t q, int32_t kv) {
//     return score + slopes[h] * static_cast<float>(kv - q);
//   };
//   auto same_document = [&](int32_t b, int32_t h, int32_t q, int32_t kv) {
//     return documents[q] == documents[kv];
//   };
//   options.user_rules = attend::make_score_rules(alibi, same_document);
//
// score_mod(score, b, h, q, kv) returns the modified score (step 5 of attend/score_rules.hpp:
// after scale, softcap, bias and ALiBi, in natural units); mask_mod(b, h, q, kv) returns
// whether key kv takes part in query q's softmax (step 6). b is the batch index over the
// batch dimensions before the last, h the index in the last one (the head); q and kv are the
// query and key indices, all int32_t (int32 arithmetic and its conversion to float vectorize
// on every x86-64 level; calls with user rules must have batch, Lq and Lk below 2^31). Either
// rule may be attend::kNoScoreMod / attend::kNoMaskMod.
//
// Contract:
// - Pure and deterministic: the same arguments give the same result, whichever thread asks
//   and however often (the backward recomputes scores; tiles may be evaluated more than once).
// - No exceptions, no allocation, no locks: they run in the kernels' inner loops on every
//   thread at once.
// - score_mod is generic in the score's type (`auto score`): the backward calls it with
//   attend::Dual<float> to obtain ∂score_mod/∂score. Use +, −, ·, / with floats and
//   attend::tanh / attend::exp on the score; anything else of the score is not supported.
// - The callables must outlive the attention call that uses them.
//
// The kernels call the rules once per tile of scores (up to 128 keys × 64 queries) through one
// function pointer; inside, the user's callables are inlined into a plain loop compiled in the
// user's translation unit. Results match a built-in rule written the same way bit for bit when
// both are compiled without contraction of a·b + c into fused multiply-adds (GCC's default
// in ISO C++ mode; clang needs -ffp-contract=off).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace attend {

// A value with its derivative with respect to the score (forward-mode differentiation).
template <class T>
struct Dual {
  T value;
  T derivative;
};
template <class T>
Dual<T> operator+(Dual<T> a, Dual<T> b) {
  return {a.value + b.value, a.derivative + b.derivative};
}
template <class T>
Dual<T> operator+(Dual<T> a, T b) {
  return {a.value + b, a.derivative};
}
template <class T>
Dual<T> operator+(T a, Dual<T> b) {
  return {a + b.value, b.derivative};
}
template <class T>
Dual<T> operator-(Dual<T> a, Dual<T> b) {
  return {a.value - b.value, a.derivative - b.derivative};
}
template <class T>
Dual<T> operator-(Dual<T> a, T b) {
  return {a.value - b, a.derivative};
}
template <class T>
Dual<T> operator-(T a, Dual<T> b) {
  return {a - b.value, -b.derivative};
}
template <class T>
Dual<T> operator-(Dual<T> a) {
  return {-a.value, -a.derivative};
}
template <class T>
Dual<T> operator*(Dual<T> a, Dual<T> b) {
  return {a.value * b.value, a.derivative * b.value + a.value * b.derivative};
}
template <class T>
Dual<T> operator*(Dual<T> a, T b) {
  return {a.value * b, a.derivative * b};
}
template <class T>
Dual<T> operator*(T a, Dual<T> b) {
  return {a * b.value, a * b.derivative};
}
template <class T>
Dual<T> operator/(Dual<T> a, T b) {
  return {a.value / b, a.derivative / b};
}
template <class T>
Dual<T> operator/(Dual<T> a, Dual<T> b) {
  return {a.value / b.value,
          (a.derivative * b.value - a.value * b.derivative) / (b.value * b.value)};
}
inline float tanh(float x) { return std::tanh(x); }
inline float exp(float x) { return std::exp(x); }
template <class T>
Dual<T> tanh(Dual<T> a) {
  const T t = std::tanh(a.value);
  return {t, a.derivative * (T(1) - t * t)};
}
template <class T>
Dual<T> exp(Dual<T> a) {
  const T e = std::exp(a.value);
  return {e, a.derivative * e};
}

// Where a rule is evaluated: element (r, c) of a tile is query first_query + r and key
// first_key + c, at offset r·query_step + c·key_step of the arrays the rule reads and writes.
struct RuleTile {
  int64_t batch;  // b: index over the batch dimensions before the last
  int64_t head;   // h: index in the last batch dimension
  int64_t first_query, first_key;
  int64_t rows, columns;
  int64_t query_step, key_step;
};

// The user's rules, type-erased: what AttentionOptions::user_rules holds. Built by
// make_score_rules; each function pointer is null when its rule is absent.
struct UserScoreRules {
  const void* score_mod = nullptr;
  const void* mask_mod = nullptr;
  // scores[...] = score_mod(scores[...], b, h, q, kv) over the tile.
  void (*modify)(const void* score_mod, const RuleTile& tile, float* scores) = nullptr;
  // grad[...] *= ∂score_mod/∂s at s = scores[...] (the scores before the rule).
  void (*modify_gradient)(const void* score_mod, const RuleTile& tile, const float* scores,
                          float* grad) = nullptr;
  // keep[...] = mask_mod(b, h, q, kv) over the tile (1 keeps, 0 excludes).
  void (*mask)(const void* mask_mod, const RuleTile& tile, unsigned char* keep) = nullptr;
};

struct NoScoreMod {};
struct NoMaskMod {};
inline constexpr NoScoreMod kNoScoreMod{};
inline constexpr NoMaskMod kNoMaskMod{};

namespace detail {

// Calls f(q, kv, element) for every element of the tile (q, kv: the query and key indices,
// int32), the step-1 dimension innermost (the kernels' query tiles run queries along memory,
// the row kernel keys): a loop the compiler can vectorize when the rule allows it.
template <class F>
void for_each_in_tile(const RuleTile& t, const F& f) {
  const auto q0 = static_cast<int32_t>(t.first_query), k0 = static_cast<int32_t>(t.first_key);
  const auto rows = static_cast<int32_t>(t.rows), columns = static_cast<int32_t>(t.columns);
  if (t.query_step == 1 && t.key_step != 1) {
    for (int32_t c = 0; c < columns; ++c) {
      const int64_t column = c * t.key_step;
      for (int32_t r = 0; r < rows; ++r) f(q0 + r, k0 + c, column + r);
    }
  } else {
    for (int32_t r = 0; r < rows; ++r) {
      const int64_t row = r * t.query_step;
      for (int32_t c = 0; c < columns; ++c) f(q0 + r, k0 + c, row + c * t.key_step);
    }
  }
}

template <class ScoreMod>
void modify_tile(const void* rule, const RuleTile& t, float* scores) {
  const ScoreMod& score_mod = *static_cast<const ScoreMod*>(rule);
  const auto b = static_cast<int32_t>(t.batch), h = static_cast<int32_t>(t.head);
  for_each_in_tile(t, [&](int32_t q, int32_t kv, int64_t at) {
    scores[at] = score_mod(scores[at], b, h, q, kv);
  });
}

template <class ScoreMod>
void modify_gradient_tile(const void* rule, const RuleTile& t, const float* scores, float* grad) {
  const ScoreMod& score_mod = *static_cast<const ScoreMod*>(rule);
  const auto b = static_cast<int32_t>(t.batch), h = static_cast<int32_t>(t.head);
  for_each_in_tile(t, [&](int32_t q, int32_t kv, int64_t at) {
    grad[at] *= score_mod(Dual<float>{scores[at], 1.0f}, b, h, q, kv).derivative;
  });
}

template <class MaskMod>
void mask_tile(const void* rule, const RuleTile& t, unsigned char* keep) {
  const MaskMod& mask_mod = *static_cast<const MaskMod*>(rule);
  const auto b = static_cast<int32_t>(t.batch), h = static_cast<int32_t>(t.head);
  for_each_in_tile(t, [&](int32_t q, int32_t kv, int64_t at) {
    keep[at] = static_cast<unsigned char>(mask_mod(b, h, q, kv) ? 1 : 0);
  });
}

}  // namespace detail

// The rules for AttentionOptions::user_rules; the callables must outlive the calls using them.
// Lvalues only (a temporary would be gone before the call): name the lambdas first.
template <class ScoreMod, class MaskMod = const NoMaskMod>
UserScoreRules make_score_rules(ScoreMod& score_mod, MaskMod& mask_mod = kNoMaskMod) {
  using S = std::remove_const_t<ScoreMod>;
  using M = std::remove_const_t<MaskMod>;
  UserScoreRules rules;
  if constexpr (!std::is_same_v<S, NoScoreMod>) {
    rules.score_mod = &score_mod;
    rules.modify = &detail::modify_tile<S>;
    rules.modify_gradient = &detail::modify_gradient_tile<S>;
  }
  if constexpr (!std::is_same_v<M, NoMaskMod>) {
    rules.mask_mod = &mask_mod;
    rules.mask = &detail::mask_tile<M>;
  }
  return rules;
}

}  // namespace attend
