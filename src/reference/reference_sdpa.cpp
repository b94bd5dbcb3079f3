#include "reference/reference_sdpa.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "attend/score_rules.hpp"
#include "dropout.hpp"
#include "kv_format.hpp"
#include "score_rule_layer.hpp"

namespace attend::detail {
namespace {

// The K or V rows of batch index b as the reference reads them: element e of storage row
// `slot` (SdpaParams::key_slot) as float32, the stored format widened and scaled.
struct KvRows {
  const float* f32 = nullptr;
  const void* stored = nullptr;
  DType format = DType::kFloat32;
  int64_t stride = 0;
  const float* scales = nullptr;
  int64_t scale_stride = 0;

  float at(int64_t slot, int64_t e) const {
    if (f32) return f32[slot * stride + e];
    const float x = widen_kv(format, stored, slot * stride + e);
    return scales ? x * scales[slot * scale_stride] : x;
  }
};

KvRows kv_rows(const SdpaParams& p, int64_t b, bool value) {
  const float* f32 = value ? p.value : p.key;
  const OperandStrides& strides = value ? p.value_strides : p.key_strides;
  KvRows rows;
  rows.stride = strides.row;
  if (f32) {
    rows.f32 = f32 + p.batch_offset(strides, b);
    return rows;
  }
  rows.format = p.kv_format;
  rows.stored = static_cast<const char*>(value ? p.value_stored : p.key_stored) +
                p.batch_offset(strides, b) * static_cast<int64_t>(dtype_size(p.kv_format));
  const float* scales = value ? p.value_scales : p.key_scales;
  const OperandStrides& scale_strides = value ? p.value_scale_strides : p.key_scale_strides;
  if (scales) {
    rows.scales = scales + p.batch_offset(scale_strides, b);
    rows.scale_stride = scale_strides.row;
  }
  return rows;
}

}  // namespace

ReferenceRow reference_row_weights(const SdpaParams& p, int64_t b, int64_t i, double* weights,
                                   char* excluded) {
  const float* q = p.query + p.batch_offset(p.query_strides, b) + i * p.query_strides.row;
  const KvRows k = kv_rows(p, b, false);
  // 1. scores = Q·Kᵀ · scale, the modifications (softcap, bias, ALiBi, user rule), then
  // masked_fill(excluded, -1e9): the steps of score_rule_layer.hpp.
  ReferenceRow row;
  for (int64_t j = 0; j < p.key_len; ++j) {
    const int64_t slot = p.key_slot(j);
    double dot = 0;
    for (int64_t e = 0; e < p.head_dim; ++e) dot += double{q[e]} * double{k.at(slot, e)};
    const double s = modified_score(p, b, i, j, dot * double{p.scale});
    const bool out = !is_visible(p, b, i, j);
    if (excluded) excluded[j] = out;
    row.any_visible |= !out;
    weights[j] = out ? double{kExcludedScore} : s;
  }
  // 2. weights = softmax(scores), the sink (a logit with no value) in the denominator; the
  // zero option empties fully excluded rows.
  const double sink = sink_of(p, b);
  const bool zero_row = !row.any_visible && p.zero_fully_masked_rows;
  row.max_score = sink;
  for (int64_t j = 0; j < p.key_len; ++j) row.max_score = std::max(row.max_score, weights[j]);
  row.sum = std::exp(sink - row.max_score);
  for (int64_t j = 0; j < p.key_len; ++j) {
    weights[j] = std::exp(weights[j] - row.max_score);
    row.sum += weights[j];
  }
  for (int64_t j = 0; j < p.key_len; ++j) weights[j] = zero_row ? 0.0 : weights[j] / row.sum;
  return row;
}

void reference_sdpa(const SdpaParams& params) {
  const SdpaParams& p = params;
  const int64_t rows = p.batch * p.query_len;
  const uint32_t threshold = dropout_threshold(p.dropout);
  const double keep_scale = 1.0 / (1.0 - static_cast<double>(p.dropout));

#pragma omp parallel num_threads(p.num_threads)
  {
    std::vector<double> scores(static_cast<size_t>(p.key_len));
    std::vector<double> output_row(static_cast<size_t>(p.value_dim));
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t b = row / p.query_len, i = row % p.query_len;
      const KvRows v = kv_rows(p, b, true);

      // 1.–2. scores, masked_fill(excluded, -1e9), weights = softmax(scores).
      const ReferenceRow softmax = reference_row_weights(p, b, i, scores.data(), nullptr);
      if (p.logsumexp) {
        const bool zero_row = !softmax.any_visible && p.zero_fully_masked_rows && !p.sinks;
        p.logsumexp[p.batch_offset(p.logsumexp_strides, b) + i * p.logsumexp_strides.row] =
            zero_row ? -INFINITY : static_cast<float>(softmax.max_score + std::log(softmax.sum));
      }

      // 3. dropout on the weights.
      if (p.dropout > 0) {
        for (int64_t j = 0; j < p.key_len; ++j) {
          auto& w = scores[static_cast<size_t>(j)];
          w = dropout_keep(p.seed, threshold, b, global_query(p, i), global_key(p, j))
                  ? w * keep_scale
                  : 0.0;
        }
      }

      // 4. output = weights · V.
      std::fill(output_row.begin(), output_row.end(), 0.0);
      for (int64_t j = 0; j < p.key_len; ++j) {
        const double w = scores[static_cast<size_t>(j)];
        const int64_t slot = p.key_slot(j);
        for (int64_t e = 0; e < p.value_dim; ++e) {
          output_row[static_cast<size_t>(e)] += w * v.at(slot, e);
        }
      }
      float* o = p.output + p.batch_offset(p.output_strides, b) + i * p.output_strides.row;
      for (int64_t e = 0; e < p.value_dim; ++e)
        o[e] = static_cast<float>(output_row[static_cast<size_t>(e)]);
      if (p.weights) {
        float* w = p.weights + p.batch_offset(p.weights_strides, b) + i * p.weights_strides.row;
        for (int64_t j = 0; j < p.key_len; ++j)
          w[j] = static_cast<float>(scores[static_cast<size_t>(j)]);
      }
    }
  }
}

}  // namespace attend::detail
