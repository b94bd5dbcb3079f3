// independent_gradients.hpp: the gradient of the listing, derived by hand and written for
// the tests only (no library code), in float64, with a componentwise rounding-error bound for
// a float32 implementation.
//
// Loss L = Σ O ⊙ G (G plays dO). With P the softmax weights, f_ij the dropout factor (0 or
// 1/(1 − p); 1 without dropout) and P̃ = P ⊙ f:
//   dP_ij = f_ij·(G_i·V_j);  D_i = Σ_j P_ij·dP_ij;  dS_ij = P_ij·(dP_ij − D_i), 0 if excluded
//   dQ_i = scale·Σ_j dS_ij·K_j;  dK_j = scale·Σ_i dS_ij·Q_i;  dV_j = Σ_i P̃_ij·G_i
//   dBias[β] = Σ over the scores positions that read bias element β of dS.
//
// Error bound of a float32 implementation (the fused backward), per element, from the
// forward's model (error_model.hpp: A_i, δ_i = (γ_E + 4u)·A_i, ε_i):
//   weights   e_P = ρ_i·P,  ρ_i = 2δ_i + (Lk + 16)·u + 4u·(A_i + log Lk)   (P from the
//             forward's float32 log-sum-exp, itself rounded relative to A_i + log Lk)
//   dP        e_dP = γ_{Ev+2}·f·Σ_c |G_ic·V_jc|
//   D         e_D = γ_{Ev+2}·Σ_c |G_ic·O_ic| + ε_i·Σ_c |G_ic|   (from the forward's output O)
//   dS        e_dS = e_P·(|dP| + |D|) + P·(e_dP + e_D)
//   dQ        |scale|·(Σ_j e_dS'·|K_je| + e_D·|Σ_j P_ij·K_je| + γ_{Lk+2}·Σ_j |dS·K_je|), with
//             e_dS' = e_dS without its D part: D's error is one number per row
//   dK        |scale|·(Σ_i e_dS·|Q_ie| + γ_{Lq+2}·Σ_i |dS·Q_ie|)
//   dV        Σ_i f·e_P·|G_ic| + γ_{Lq+2}·Σ_i |P̃·G_ic|
//   dBias     Σ e_dS + γ_{n+2}·Σ |dS| over the n positions summed
// each times kSafety; a float16 gradient adds its rounding (2^-11 relative + 2^-24).
//
// `bf16`: bfloat16 inputs through bfloat16 products (the fused backward's bf16_backward): the
// products of bfloat16 operands are exact, and the kernel rounds P̃ before dV and dS before
// dK and dQ (u_b = 2^-9 relative each), which adds
//   dV  u_b·Σ_i |P̃·G_ic|,   dK  |scale|·u_b·Σ_i |dS·Q_ie|,   dQ  |scale|·u_b·Σ_j |dS·K_je|;
// O is stored in bfloat16 (D gets u_b·Σ_c |G_ic·O_ic|) and so are the gradients (u_b
// relative, plus 2^-133, bfloat16's smallest subnormal).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "error_model.hpp"
#include "independent_reference.hpp"

namespace attend::test {

struct Gradients {
  std::vector<double> query, key, value, bias;  // row-major, shapes of the inputs and bias
  std::vector<double> sinks;  // per batch index (the caller sums those of one head)
};

struct GradientCheck {
  Gradients exact;
  Gradients tolerance;  // absolute, per element
};

// `grad_output` is G (batch..., Lq, Ev) row-major; `half_inputs`: the dtype is float16.
inline GradientCheck independent_gradients(const ReferenceProblem& p,
                                           const std::vector<double>& grad_output, bool half_inputs,
                                           bool bf16 = false) {
  const double u_b = bf16 ? 1.0 / 512 : 0.0;
  const int64_t Lq = p.query_len, Lk = p.key_len, E = p.head_dim, Ev = p.value_dim;
  const double u = kUnitRoundoff;
  const auto at = [](const std::vector<double>& v, int64_t index) -> double {
    return v[static_cast<size_t>(index)];
  };
  int64_t bias_count = 1;
  for (int64_t d : p.bias_shape) bias_count *= d;
  GradientCheck r;
  Gradients& g = r.exact;
  Gradients& t = r.tolerance;
  for (Gradients* x : {&g, &t}) {
    x->query.assign(static_cast<size_t>(p.batch() * Lq * E), 0.0);
    x->key.assign(static_cast<size_t>(p.batch() * Lk * E), 0.0);
    x->value.assign(static_cast<size_t>(p.batch() * Lk * Ev), 0.0);
    x->bias.assign(p.has_bias ? static_cast<size_t>(bias_count) : 0, 0.0);
    x->sinks.assign(p.sinks.size(), 0.0);
  }
  std::vector<double> bias_abs_sum(g.bias.size()), bias_terms(g.bias.size());  // zeros
  const ReferenceResult forward = independent_attention(p);
  // The forward's error bound ε_i of every output row.
  ErrorModelOptions forward_model;  // dropout p from the largest factor 1/(1 − p)
  for (double f : p.dropout_factor) {
    if (f > 0) forward_model.dropout = std::max(forward_model.dropout, 1 - 1 / f);
  }
  const Tolerances forward_tolerance = sdpa_tolerances(p, forward_model);
  const double scale = std::abs(p.scale);

  std::vector<double> weight(static_cast<size_t>(Lk)), factor(static_cast<size_t>(Lk));
  std::vector<double> grad_weight(static_cast<size_t>(Lk)), grad_score(static_cast<size_t>(Lk));
  std::vector<double> error_score(static_cast<size_t>(Lk)), error_weight(static_cast<size_t>(Lk));
  std::vector<char> visible(static_cast<size_t>(Lk));
  std::vector<double> cap_slope(static_cast<size_t>(Lk));
  for (int64_t b = 0; b < p.batch(); ++b) {
    const auto q = [&](int64_t i, int64_t e) { return at(p.query, (b * Lq + i) * E + e); };
    const auto k = [&](int64_t j, int64_t e) { return at(p.key, (b * Lk + j) * E + e); };
    const auto v = [&](int64_t j, int64_t c) { return at(p.value, (b * Lk + j) * Ev + c); };
    double max_key_norm = 0;
    for (int64_t j = 0; j < Lk; ++j) {
      double n = 0;
      for (int64_t e = 0; e < E; ++e) n += k(j, e) * k(j, e);
      max_key_norm = std::max(max_key_norm, std::sqrt(n));
    }
    for (int64_t i = 0; i < Lq; ++i) {
      const int64_t row = b * Lq + i;
      const auto dout = [&](int64_t c) { return at(grad_output, row * Ev + c); };
      // Weights as the forward computes them (dropout factor separate).
      double max_bias = 0, query_norm = 0;
      for (int64_t e = 0; e < E; ++e) query_norm += q(i, e) * q(i, e);
      for (int64_t j = 0; j < Lk; ++j) {
        factor[static_cast<size_t>(j)] =
            p.dropout_factor.empty() ? 1.0 : at(p.dropout_factor, row * Lk + j);
        visible[static_cast<size_t>(j)] = is_visible(p, b, i, j);
        if (p.has_bias) max_bias = std::max(max_bias, std::abs(bias_at(p, b, i, j)));
      }
      // P without dropout (the forward's weights hold P̃ = P·f).
      // Softcap: s = cap·tanh(raw / cap) + bias, ∂s/∂raw = 1 − tanh²(raw / cap).
      std::vector<double> scores(static_cast<size_t>(Lk));
      std::fill(cap_slope.begin(), cap_slope.end(), 1.0);
      bool any_visible = false;
      for (int64_t j = 0; j < Lk; ++j) {
        double dot = 0;
        for (int64_t e = 0; e < E; ++e) dot += q(i, e) * k(j, e);
        const bool vis = visible[static_cast<size_t>(j)] != 0;
        any_visible |= vis;
        double raw = dot * p.scale;
        if (p.softcap > 0) {
          const double tanh_raw = std::tanh(raw / p.softcap);
          raw = p.softcap * tanh_raw;
          cap_slope[static_cast<size_t>(j)] = 1.0 - tanh_raw * tanh_raw;
        }
        scores[static_cast<size_t>(j)] = vis ? raw + bias_at(p, b, i, j) : -1e9;
      }
      // The sink: one more logit in the denominator, with no value.
      const double sink = p.sinks.empty() ? -INFINITY : p.sinks[static_cast<size_t>(b)];
      double m = sink;
      for (double score : scores) m = std::max(m, score);
      double sum = std::exp(sink - m);
      for (int64_t j = 0; j < Lk; ++j) sum += std::exp(scores[static_cast<size_t>(j)] - m);
      const bool zero_row = !any_visible && p.zero_fully_masked_rows;
      const double a = scale * std::sqrt(query_norm) * max_key_norm + max_bias;
      const double delta = (gamma_n(E) + 4 * u) * a + 16 * u * p.softcap;
      const double rho = 2 * delta + static_cast<double>(Lk + 16) * u +
                         4 * u * (a + std::log(static_cast<double>(Lk)));
      double output_abs = 0, grad_abs = 0;
      for (int64_t c = 0; c < Ev; ++c) {
        output_abs += std::abs(dout(c) * at(forward.output, row * Ev + c));
        grad_abs += std::abs(dout(c));
      }
      double row_dot = 0;
      for (int64_t j = 0; j < Lk; ++j) {
        const size_t jj = static_cast<size_t>(j);
        weight[jj] = zero_row ? 0.0 : std::exp(scores[jj] - m) / sum;
        double dot = 0, dot_abs = 0;
        for (int64_t c = 0; c < Ev; ++c) {
          dot += dout(c) * v(j, c);
          dot_abs += std::abs(dout(c) * v(j, c));
        }
        grad_weight[jj] = factor[jj] * dot;
        error_weight[jj] = gamma_n(Ev + 2) * factor[jj] * dot_abs;  // e_dP
        row_dot += weight[jj] * grad_weight[jj];
      }
      const double half_output = half_inputs ? kHalfUlp / 2 : u_b;
      const double error_row_dot =
          gamma_n(Ev + 2) * output_abs +
          forward_tolerance.output[static_cast<size_t>(row)] / kSafety * grad_abs +
          half_output * output_abs;
      // dSink_b += −P_sink·D (the sink's own dP is 0).
      if (!p.sinks.empty()) {
        const double p_sink = std::exp(sink - m) / sum;
        g.sinks[static_cast<size_t>(b)] -= p_sink * row_dot;
        t.sinks[static_cast<size_t>(b)] +=
            rho * p_sink * std::abs(row_dot) + p_sink * error_row_dot;
      }
      std::vector<double> row_error_direction(static_cast<size_t>(E), 0.0);
      for (int64_t j = 0; j < Lk; ++j) {
        const size_t jj = static_cast<size_t>(j);
        const bool vis = visible[jj] != 0;
        grad_score[jj] = vis ? weight[jj] * (grad_weight[jj] - row_dot) : 0.0;
        // Q and K see dS through softcap's slope (its float error: 2·(δ/cap + 4u) of dS).
        const double grad_raw = grad_score[jj] * cap_slope[jj];
        const double error_slope =
            p.softcap > 0 ? 2 * (delta / p.softcap + 4 * u) * std::abs(grad_score[jj]) : 0.0;
        const double e_p = rho * weight[jj];
        // The error of D_i is one number per row: in dQ_i it enters as
        // e_D·|Σ_j P_ij·K_j| (added below), not as Σ_j P_ij·e_D·|K_j|.
        const double error_own = vis ? e_p * (std::abs(grad_weight[jj]) + std::abs(row_dot)) +
                                           weight[jj] * error_weight[jj] + error_slope
                                     : 0.0;
        error_score[jj] = vis ? error_own + weight[jj] * error_row_dot : 0.0;
        for (int64_t e = 0; e < E; ++e) {
          const size_t qi = static_cast<size_t>(row * E + e);
          const size_t kj = static_cast<size_t>((b * Lk + j) * E + e);
          g.query[qi] += p.scale * grad_raw * k(j, e);
          t.query[qi] += scale * (error_own * std::abs(k(j, e)) +
                                  (gamma_n(Lk + 2) + u_b) * std::abs(grad_raw * k(j, e)));
          if (vis) row_error_direction[static_cast<size_t>(e)] += weight[jj] * k(j, e);
          g.key[kj] += p.scale * grad_raw * q(i, e);
          t.key[kj] += scale * (error_score[jj] * std::abs(q(i, e)) +
                                (gamma_n(Lq + 2) + u_b) * std::abs(grad_raw * q(i, e)));
        }
        const double kept = weight[jj] * factor[jj];
        for (int64_t c = 0; c < Ev; ++c) {
          const size_t vj = static_cast<size_t>((b * Lk + j) * Ev + c);
          g.value[vj] += kept * dout(c);
          t.value[vj] += factor[jj] * e_p * std::abs(dout(c)) +
                         (gamma_n(Lq + 2) + u_b) * std::abs(kept * dout(c));
        }
        if (p.has_bias) {
          const size_t beta =
              static_cast<size_t>(broadcast_flat_index(p.bias_shape, p.batch_shape, b, i, j));
          g.bias[beta] += grad_score[jj];
          t.bias[beta] += error_score[jj];
          bias_abs_sum[beta] += std::abs(grad_score[jj]);
          bias_terms[beta] += 1;
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        t.query[static_cast<size_t>(row * E + e)] +=
            scale * error_row_dot * std::abs(row_error_direction[static_cast<size_t>(e)]);
      }
    }
  }
  for (size_t n = 0; n < g.bias.size(); ++n) {  // the float64 sums of dS over β's positions
    t.bias[n] += gamma_n(static_cast<int64_t>(bias_terms[n]) + 2) * bias_abs_sum[n];
  }
  // Plus the floor the forward's weights get (kWeightsFloor, 2^-100): terms near float32
  // underflow are flushed to zero in the kernels (FTZ/DAZ), so gradients of that size (the
  // soak met dBias -1.8e-70 and dV -4.6e-37) need no relative accuracy.
  for (std::vector<double>* values : {&t.query, &t.key, &t.value, &t.bias, &t.sinks}) {
    for (double& tol : *values) tol = tol * kSafety + kWeightsFloor;
  }
  if (half_inputs) {
    const auto add_half = [](std::vector<double>& tol, const std::vector<double>& exact) {
      for (size_t n = 0; n < tol.size(); ++n)
        tol[n] += kHalfUlp / 2 * std::abs(exact[n]) + kHalfSubnormalUlp;
    };
    add_half(t.query, g.query);
    add_half(t.key, g.key);
    add_half(t.value, g.value);
  }
  if (bf16) {
    const auto add_bf16 = [&](std::vector<double>& tol, const std::vector<double>& exact) {
      for (size_t n = 0; n < tol.size(); ++n) tol[n] += u_b * std::abs(exact[n]) + 0x1p-133;
    };
    add_bf16(t.query, g.query);
    add_bf16(t.key, g.key);
    add_bf16(t.value, g.value);
  }
  return r;
}

}  // namespace attend::test
