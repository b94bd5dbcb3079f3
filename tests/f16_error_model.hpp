// f16_error_model.hpp: what float16 products (ComputePrecision::kFloat16) add to
// error_model.hpp's tolerances: the float16 chains of src/kernels/isa/avx512_fp16-inl.h
// (kernels/isa/f16_chains.hpp) and the weights' rounding to float16.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "error_model.hpp"
#include "independent_reference.hpp"
#include "kernels/isa/f16_chains.hpp"

namespace attend::test {

// float16 products (ComputePrecision::kFloat16; src/kernels/isa/avx512_fp16-inl.h). A
// product of depth D accumulates in float16 chains of kF16ChainRoundings roundings (2^-11
// each) over 2·kF16ChainPairs products, subnormal results kept (2^-25 absolute each), then
// adds the ⌈D / (2·kF16ChainPairs)⌉ chains in float32:
//   |C − C_exact| <= γ16_R·Σ|a·b| + chains·R·2^-25 + γ_{chains+1}·Σ|a·b|,  R = kF16ChainRoundings.
inline constexpr double kHalfUnitRoundoff = 1.0 / 2048.0;          // 2^-11
inline constexpr double kHalfSubnormalRounding = 2.98023223876953125e-8;  // 2^-25

inline double gamma_half(int64_t n) {
  const double nu = static_cast<double>(n) * kHalfUnitRoundoff;
  return nu / (1.0 - nu);
}

// The bound above for a product of depth `depth` whose terms' magnitudes sum to `sum_abs`.
inline double f16_product_error(int64_t depth, double sum_abs) {
  const int64_t per_chain = 2 * detail::kF16ChainPairs;
  const int64_t chains = std::max<int64_t>((depth + per_chain - 1) / per_chain, 1);
  const int64_t r = detail::kF16ChainRoundings;
  return gamma_half(r) * sum_abs +
         static_cast<double>(chains * r) * kHalfSubnormalRounding +
         gamma_n(chains + 1) * sum_abs;
}

// What float16 products add to an output element of a row of problem `p` (absolute, per
// unit of max|v|·keep), beyond rounding the inputs: Q·Kᵀ's chain error on every score,
// δ = |scale|·f16_product_error(E, ||q||·max||k||) (Cauchy–Schwarz for Σ|q·k|), moves the
// weights by e^{±2δ} (2δ of max|v|); rounding each weight to float16 moves it by at most
// 2^-11 of itself plus 2^-25 (a subnormal), Lk·2^-25 over the row (l >= 1); P·V's chains
// add f16_product_error(Lk, Σ p·|v| <= max|v|). The largest over the rows of every batch
// index: `output` per unit of max|v|·keep, `weights` the weights' relative error (2δ).
struct F16ProductTerms {
  double output = 0;  // per unit of max|v|·keep
  double weights = 0;  // relative
};
inline F16ProductTerms f16_product_terms(const ReferenceProblem& p) {
  const int64_t Lq = p.query_len, Lk = p.key_len, E = p.head_dim, Ev = p.value_dim;
  // ||x||₂ over the finite entries (non-finite inputs make NaN results, matched as such).
  const auto norm2 = [](const double* x, int64_t n) {
    double sum = 0.0;
    for (int64_t e = 0; e < n; ++e) sum += std::isfinite(x[e]) ? x[e] * x[e] : 0.0;
    return std::sqrt(sum);
  };
  double max_query = 0, max_key = 0, max_value = 0;
  for (int64_t r = 0; r < p.batch() * Lq; ++r) {
    max_query = std::max(max_query, norm2(&p.query[static_cast<size_t>(r * E)], E));
  }
  for (int64_t r = 0; r < p.batch() * Lk; ++r) {
    max_key = std::max(max_key, norm2(&p.key[static_cast<size_t>(r * E)], E));
    for (int64_t e = 0; e < Ev; ++e) {
      const double v = p.value[static_cast<size_t>(r * Ev + e)];
      if (std::isfinite(v)) max_value = std::max(max_value, std::abs(v));
    }
  }
  const double score = std::abs(p.scale) * f16_product_error(E, max_query * max_key);
  // P·V's chains over Σ_j p_j·|v_j| <= l·max|v|, divided by l >= 1.
  const double value_chains = max_value > 0 ? f16_product_error(Lk, max_value) / max_value : 0.0;
  F16ProductTerms t;
  t.weights = 2 * score;
  t.output = 2 * score + kHalfUnitRoundoff + static_cast<double>(Lk) * kHalfSubnormalRounding +
             value_chains;
  return t;
}

}  // namespace attend::test
