// partial_softmax.hpp: the rules for softmax results over a part of the keys (a key chunk, a
// ring step's key block, a sink) and for a row that sees no key at all, in one place for
// every path that combines such parts.
//
// A part over keys J of row i is kept in one of two forms:
//   - unnormalized, inside one call (the key split, the batch decode scheduler; key_split-inl.h
//     MergeRow): m = max_{j∈J} s_j (log2 domain), l = Σ_{j∈J} 2^(s_j − m), o = Σ_{j∈J}
//     2^(s_j − m)·v_j; merged with M = max m_c: o = Σ_c 2^(m_c − M)·o_c / Σ_c 2^(m_c − M)·l_c;
//   - normalized, between calls (ring attention's blocks, the sinks): o = that sum / l and the
//     natural log-sum-exp lse = m·ln 2 + ln l (logsumexp_of_part below); merged by
//     merge_logsumexp.
// Both forms skip a part that saw no key (m = −inf, lse = −inf). A row that saw no key in any
// part gets the listing's answer (FullyMaskedRows): its scores are all kExcludedScore, so its
// log-sum-exp is fully_excluded_logsumexp(Lk), or −inf where such rows are zeroed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attend/score_rules.hpp"

namespace attend::detail {

// The natural log-sum-exp of a part from its log2-domain maximum m and its sum l = Σ 2^(s − m).
inline float logsumexp_of_part(float max_log2, float sum) {
  return static_cast<float>(static_cast<double>(max_log2) * 0.6931471805599453 +
                            std::log(static_cast<double>(sum)));
}

// The listing's log-sum-exp of a row whose every one of key_len keys is excluded:
// log Σ_j exp(kExcludedScore) = -1e9 + log Lk.
inline float fully_excluded_logsumexp(int64_t key_len) {
  return static_cast<float>(double{kExcludedScore} + std::log(static_cast<double>(key_len)));
}

// Two normalized parts over disjoint keys, (o_a, lse_a) and (o_b, lse_b), both finite:
// lse = log(exp(lse_a) + exp(lse_b)) (computed from the larger, so neither exp overflows) and
// o = keep·o_a + add·o_b with keep = exp(lse_a − lse), add = exp(lse_b − lse). A sink is a
// part with no value (o_b = 0): only `keep` applies.
struct LogSumExpMerge {
  double logsumexp;
  float keep;
  float add;
};
inline LogSumExpMerge merge_logsumexp(double lse_a, double lse_b) {
  const double top = std::max(lse_a, lse_b);
  const double merged = top + std::log(std::exp(lse_a - top) + std::exp(lse_b - top));
  return {merged, static_cast<float>(std::exp(lse_a - merged)),
          static_cast<float>(std::exp(lse_b - merged))};
}

}  // namespace attend::detail
