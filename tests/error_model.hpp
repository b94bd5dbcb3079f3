// error_model.hpp: how far an SDPA result may be from the exact one, row by row.
//
// Tolerances come from a rounding-error analysis (norms × unit roundoff), not from magic
// numbers. For output row i (one batch index, one query), with u = 2^-24 the float32 unit
// roundoff and γ_n = n·u / (1 − n·u):
//
//   A_i = |scale| · ||q_i||₂ · max_j ||k_j||₂ + max_j |bias_ij|
//         An upper bound (Cauchy–Schwarz) of |scale| · max_j Σ_e |q_ie||k_je| + max |bias|,
//         the size of the terms in the scores of row i; O((Lq + Lk)·E) to evaluate instead
//         of the O(Lq·Lk·E) of the exact sum.
//   δ_i = (γ_E + 4u) · A_i
//         Error of every score: the E-term float32 dot product (γ_E) plus one rounding each
//         for the scale multiply, the bias add, the subtraction of the row maximum and the
//         folding of log2(e) into the scale.
//   ρ_i = 2δ_i + (Lk + 8)·u
//         Relative error of a weight: perturbing every score by at most δ_i changes
//         exp(s_j − m) / Σ_k exp(s_k − m) by a factor within e^{±2δ_i}; then exp itself (a
//         few u), the running-maximum rescales and the Lk-term sum (γ_Lk), the division and
//         the rounding of the stored weight.
//   ε_i = (2δ_i + (Lk + E + 8)·u) · max_j ||v_j||_∞ · keep
//         Absolute error of every element of the output row: the weights' error (as above)
//         times the largest value, plus the Lk-term float32 sum of weights·V; keep = 1/(1−p)
//         with dropout (the kept weights of a row sum to at most keep).
//
// The tolerances are kSafety (4) times these first-order bounds. A float16 output adds one
// float16 ulp (2^-10 relative, 2^-24 absolute below the normal range): the two results can
// round to neighbouring float16 values. Weights get a tiny absolute floor (2^-100) so that
// weights near float32 underflow (exp of −70 and below) do not need relative accuracy.
//
// A float64 accumulation (the library's reference backend checked against the test's own
// float64 listing) only rounds the scale to float32 (δ_i = u·A_i) and the stored results:
// ρ_i = 2δ_i + 2u, ε_i = (2δ_i + 2u) · max ||v||_∞ · keep.
//
// The bound means something only when it is small: meaningful() says that every row's
// output tolerance is under 1% of max ||v||_∞ · keep and every weight's relative tolerance
// under 1%. Scores of size 1e6 (Q and K of ±1e3 with the default scale) make δ_i ≈ 8 and any
// two float32 kernels may disagree on which key dominates: such cases are flagged
// ill-conditioned in the case grid and only checked for what stays true (finite results,
// properties).
//
// Paged attention (paged_row_tolerance below) is checked the same way against the float64
// listing over the cache's stored keys and values, the quantized formats' dequantized
// (scale · code): float32 products on the stored values, each score within δ = (γ_E + 6u)·A
// (the scale of a quantized key adds one rounding).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attend/sdpa.hpp"
#include "independent_reference.hpp"

namespace attend::test {

enum class Accumulation { kFloat32, kFloat64 };

// The backends the contract and dropout tests run, with the accumulation their tolerance
// assumes.
struct BackendCase {
  Backend backend;
  Accumulation accumulation;
  const char* name;
};
inline constexpr BackendCase kBackends[] = {
    {Backend::kReference, Accumulation::kFloat64, "reference"},
    {Backend::kAuto, Accumulation::kFloat32, "auto"},
};

inline constexpr double kUnitRoundoff = 1.0 / 16777216.0;  // 2^-24
inline constexpr double kSafety = 4.0;
inline constexpr double kWeightsFloor = 7.888609052210118e-31;      // 2^-100
inline constexpr double kHalfUlp = 1.0 / 1024.0;                    // float16 spacing at 1
inline constexpr double kHalfSubnormalUlp = 5.9604644775390625e-8;  // 2^-24
inline constexpr double kMeaningfulFraction = 1e-2;

inline double gamma_n(int64_t n) {
  const double nu = static_cast<double>(n) * kUnitRoundoff;
  return nu / (1.0 - nu);
}

struct ErrorModelOptions {
  Accumulation accumulation = Accumulation::kFloat32;
  double dropout = 0.0;      // weights are scaled by 1 / (1 − dropout)
  bool half_output = false;  // output stored as float16
};

struct Tolerances {
  // Per output row (batch index b, query i), flat index b·Lq + i.
  std::vector<double> output;            // absolute, for every element of the row
  std::vector<double> weights_relative;  // relative to the expected weight
  std::vector<double> value_scale;       // max_j ||v_j||_∞ · keep of the row's batch

  // Absolute tolerance of weight (row, j) whose expected value is `expected`.
  double weight(int64_t row, double expected) const {
    return weights_relative[static_cast<size_t>(row)] * std::abs(expected) + kWeightsFloor;
  }
  // Whether the tolerances could catch an error of 1% (see the file comment).
  bool meaningful() const {
    for (size_t r = 0; r < output.size(); ++r) {
      if (!(output[r] < kMeaningfulFraction * value_scale[r])) return false;
      if (!(weights_relative[r] < kMeaningfulFraction)) return false;
    }
    return true;
  }
};

// Tolerances for comparing a result of problem `p` with the exact (float64) one.
inline Tolerances sdpa_tolerances(const ReferenceProblem& p, const ErrorModelOptions& options) {
  const int64_t Lq = p.query_len, Lk = p.key_len, E = p.head_dim, Ev = p.value_dim;
  const double u = kUnitRoundoff;
  const double keep = 1.0 / (1.0 - options.dropout);
  // Non-finite inputs are skipped: they make NaN results, which the comparison matches
  // as such, and must not turn the tolerances of the other rows into NaN.
  const auto norm2 = [](const double* x, int64_t n) {
    double sum = 0.0;
    for (int64_t e = 0; e < n; ++e) sum += std::isfinite(x[e]) ? x[e] * x[e] : 0.0;
    return std::sqrt(sum);
  };

  Tolerances t;
  for (int64_t b = 0; b < p.batch(); ++b) {
    double max_key_norm = 0.0, max_value = 0.0;
    for (int64_t j = 0; j < Lk; ++j) {
      max_key_norm =
          std::max(max_key_norm, norm2(&p.key[static_cast<size_t>((b * Lk + j) * E)], E));
      for (int64_t e = 0; e < Ev; ++e) {
        const double v = p.value[static_cast<size_t>((b * Lk + j) * Ev + e)];
        if (std::isfinite(v)) max_value = std::max(max_value, std::abs(v));
      }
    }
    for (int64_t i = 0; i < Lq; ++i) {
      double max_bias = 0.0;
      for (int64_t j = 0; j < Lk && p.has_bias; ++j) {
        const double bias = bias_at(p, b, i, j);
        if (std::isfinite(bias)) max_bias = std::max(max_bias, std::abs(bias));
      }
      const double query_norm = norm2(&p.query[static_cast<size_t>((b * Lq + i) * E)], E);
      const double a = std::abs(p.scale) * query_norm * max_key_norm + max_bias;
      // Softcap: tanh contracts the dot product's error; its own evaluation adds a few ulps
      // of the cap (counted as 16).
      const double softcap_error = 16 * u * p.softcap;

      double score_error, weight_error, output_error;
      if (options.accumulation == Accumulation::kFloat32) {
        score_error = (gamma_n(E) + 4 * u) * a + softcap_error;
        weight_error = 2 * score_error + static_cast<double>(Lk + 8) * u;
        output_error = 2 * score_error + static_cast<double>(Lk + E + 8) * u;
      } else {
        score_error = u * a + softcap_error;
        weight_error = 2 * score_error + 2 * u;
        output_error = weight_error;
      }
      const double value_scale = max_value * keep;
      double output_tolerance = kSafety * output_error * value_scale;
      if (options.half_output) output_tolerance += kHalfUlp * value_scale + kHalfSubnormalUlp;
      t.output.push_back(output_tolerance);
      t.weights_relative.push_back(kSafety * weight_error);
      t.value_scale.push_back(value_scale);
    }
  }
  return t;
}

// Paged attention's tolerances for one output row (paged_decode_test.cc, paged_batch_test.cc,
// kv_cache_storm_test.cc), against the float64 listing over the stored (dequantized) keys and
// values of every cache format: `a` is A of the row (|scale|·||q||·max||k|| over the keys it
// attends, plus the bound of ALiBi and softcap), `key_len` Lk, `head_dim` E.
struct PagedRowTolerance {
  double score_error;  // δ = (γ_E + 6u)·A
  int64_t key_len, head_dim;

  // Every element of the output row: kSafety·(2δ + (Lk + E + 8)·u)·max|v|.
  double output(double max_value) const {
    return kSafety *
           (2 * score_error + static_cast<double>(key_len + head_dim + 8) * kUnitRoundoff) *
           max_value;
  }
  // A weight, relative to its exact value: kSafety·(2δ + (Lk + 8)·u).
  double weight_relative() const {
    return kSafety * (2 * score_error + static_cast<double>(key_len + 8) * kUnitRoundoff);
  }
  // The row's log-sum-exp: kSafety·(δ + (Lk + 8)·u + u·|lse|).
  double logsumexp(double lse) const {
    return kSafety * (score_error + static_cast<double>(key_len + 8) * kUnitRoundoff +
                      std::abs(lse) * kUnitRoundoff);
  }
};

inline PagedRowTolerance paged_row_tolerance(double a, int64_t key_len, int64_t head_dim) {
  return {(gamma_n(head_dim) + 6 * kUnitRoundoff) * a, key_len, head_dim};
}

// bfloat16's unit roundoff: 8 significant bits, a relative 2^-8 from nearest-even rounding.
inline constexpr double kBf16UnitRoundoff = 1.0 / 256.0;

// The same row with bfloat16 products (the grouped-query tiles over a paged cache:
// boundary/operands.hpp, stored_kv_bf16_products), against the float64 listing on the
// operands as the kernel rounds them: the queries rounded to bfloat16, K and V as stored
// (int8 and fp8 codes and bfloat16 are exact in bfloat16; float16 and float32 K/V rounded to
// bfloat16 by the test too where the kernel rounds them). Then the products of bfloat16 pairs
// are exact in float32 and accumulate as float32 dot products do, the key's scale one
// rounding (the score error δ of paged_row_tolerance), and the one new error is P's: each
// probability P_j (times V's scale, one rounding) rounded to bfloat16 for P·V while the sum l
// keeps it in float32, so Σ_j |ΔP_j|·|v_j| / l <= 2^-8·max|v|: the output's tolerance gains
// kSafety·2^-8·max|v|.
inline double paged_bf16_output_tolerance(const PagedRowTolerance& t, double max_value) {
  return t.output(max_value) + kSafety * kBf16UnitRoundoff * max_value;
}

}  // namespace attend::test
