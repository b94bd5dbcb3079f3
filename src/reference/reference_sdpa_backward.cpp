// reference_sdpa_backward.cpp: the exact gradient of the listing, in float64, from the
// inputs alone (the forward's output and log-sum-exp are not used: the oracle recomputes
// everything from the definitions), except for one block of a larger problem
// (AttentionOptions::block), whose softmax spans keys outside the call: there
// P_ij = exp(s_ij − lse_i) and D_i = dO_i·O_i come from the forward's log-sum-exp and output.
// See attend/sdpa_backward.hpp for the formulas.
#include "reference/reference_sdpa_backward.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "dropout.hpp"
#include "reference/reference_sdpa.hpp"
#include "score_rule_layer.hpp"

namespace attend::detail {

void reference_sdpa_backward(const SdpaBackwardParams& params) {
  const SdpaParams& p = params.forward;
  const uint32_t threshold = dropout_threshold(p.dropout);
  const double keep_scale = 1.0 / (1.0 - static_cast<double>(p.dropout));
  const auto lk = static_cast<size_t>(p.key_len);
  const auto e_dim = static_cast<size_t>(p.head_dim), ev_dim = static_cast<size_t>(p.value_dim);

  // dK and dV sum over the queries of one batch index: one batch index per thread.
#pragma omp parallel for schedule(static) num_threads(p.num_threads)
  for (int64_t b = 0; b < p.batch; ++b) {
    const float* q = p.query + p.batch_offset(p.query_strides, b);
    const float* k = p.key + p.batch_offset(p.key_strides, b);
    const float* v = p.value + p.batch_offset(p.value_strides, b);
    const float* grad_out = params.grad_output + p.batch_offset(params.grad_output_strides, b);
    std::vector<double> grad_key(lk * e_dim, 0.0), grad_value(lk * ev_dim, 0.0);
    std::vector<double> weight(lk), kept(lk), grad_kept(lk), grad_score(lk), grad_bias(lk);
    std::vector<char> excluded(lk);
    std::vector<double> grad_query(e_dim);

    for (int64_t i = 0; i < p.query_len; ++i) {
      const float* qi = q + i * p.query_strides.row;
      const float* doi = grad_out + i * params.grad_output_strides.row;
      // Forward: scores, masked_fill, softmax (shared with the forward reference), dropout.
      const ReferenceRow row = reference_row_weights(p, b, i, weight.data(), excluded.data());
      if (p.block && row.any_visible) {  // exp(s − lse_block)·exp(lse_block − lse)
        const double lse = params.logsumexp[p.batch_offset(params.logsumexp_strides, b) +
                                            i * params.logsumexp_strides.row];
        const double rescale = std::exp(row.max_score + std::log(row.sum) - lse);
        for (size_t j = 0; j < lk; ++j) weight[j] *= rescale;
      }
      for (size_t j = 0; j < lk; ++j) {
        const bool keep = p.dropout == 0 || dropout_keep(p.seed, threshold, b, global_query(p, i),
                                                         global_key(p, static_cast<int64_t>(j)));
        kept[j] = keep ? weight[j] * keep_scale : 0.0;
        // dP̃_ij = dO_i · V_j; dP_ij = dP̃_ij · Z_ij / (1 − p).
        const float* vj = v + static_cast<int64_t>(j) * p.value_strides.row;
        double dot = 0;
        for (size_t c = 0; c < ev_dim; ++c) dot += double{doi[c]} * double{vj[c]};
        grad_kept[j] = keep ? dot * keep_scale : 0.0;
        // dV_j += P̃_ij · dO_i.
        for (size_t c = 0; c < ev_dim; ++c) grad_value[j * ev_dim + c] += kept[j] * doi[c];
      }
      // D_i = Σ_j P_ij·dP_ij; dS_ij = P_ij·(dP_ij − D_i), no gradient through masked_fill.
      double row_dot = 0;
      if (p.block) {
        const float* oi = p.output + p.batch_offset(p.output_strides, b) + i * p.output_strides.row;
        for (size_t c = 0; c < ev_dim; ++c) row_dot += double{doi[c]} * double{oi[c]};
      } else {
        for (size_t j = 0; j < lk; ++j) row_dot += weight[j] * grad_kept[j];
      }
      std::fill(grad_query.begin(), grad_query.end(), 0.0);
      for (size_t j = 0; j < lk; ++j) {
        // Back through the modifications (score_rule_layer.hpp): dS of the bias is dS·user',
        // dS of the scaled score dS·user'·(step 2)'.
        ScoreDerivatives derivatives;
        if (!excluded[j] && has_score_derivatives(p)) {
          const float* kj = k + static_cast<int64_t>(j) * p.key_strides.row;
          double dot = 0;
          for (size_t e = 0; e < e_dim; ++e) dot += double{qi[e]} * double{kj[e]};
          derivatives =
              modified_score_derivatives(p, b, i, static_cast<int64_t>(j), dot * double{p.scale});
        }
        grad_bias[j] = excluded[j] ? 0.0 : weight[j] * (grad_kept[j] - row_dot) * derivatives.user;
        grad_score[j] = grad_bias[j] * derivatives.shaping;
        const float* kj = k + static_cast<int64_t>(j) * p.key_strides.row;
        for (size_t e = 0; e < e_dim; ++e) {
          grad_query[e] += grad_score[j] * kj[e];
          grad_key[j * e_dim + e] += grad_score[j] * qi[e];
        }
      }
      float* dq = params.grad_query + p.batch_offset(params.grad_query_strides, b) +
                  i * params.grad_query_strides.row;
      for (size_t e = 0; e < e_dim; ++e) dq[e] = static_cast<float>(grad_query[e] * p.scale);
      if (params.grad_scores) {
        float* ds = params.grad_scores + p.batch_offset(params.grad_scores_strides, b) +
                    i * params.grad_scores_strides.row;
        for (size_t j = 0; j < lk; ++j) ds[j] = static_cast<float>(grad_bias[j]);
      }
    }
    float* dk = params.grad_key + p.batch_offset(params.grad_key_strides, b);
    float* dv = params.grad_value + p.batch_offset(params.grad_value_strides, b);
    for (size_t j = 0; j < lk; ++j) {
      const auto row = static_cast<int64_t>(j);
      for (size_t e = 0; e < e_dim; ++e) {
        dk[row * params.grad_key_strides.row + static_cast<int64_t>(e)] =
            static_cast<float>(grad_key[j * e_dim + e] * p.scale);
      }
      for (size_t c = 0; c < ev_dim; ++c) {
        dv[row * params.grad_value_strides.row + static_cast<int64_t>(c)] =
            static_cast<float>(grad_value[j * ev_dim + c]);
      }
    }
  }
}

}  // namespace attend::detail
