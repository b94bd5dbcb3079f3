// independent_reference.hpp: the listing once more, in float64, written for the tests only.
//
// It shares no code with the library: contiguous std::vector storage, broadcasting of mask
// and bias by explicit index arithmetic, one query row at a time. It checks the library's
// reference backend (the oracle of the differential harness), so the oracle itself is
// checked. Dropout only as given factors (ReferenceProblem::dropout_factor).
//
//   scores  = Q·Kᵀ · scale (softcapped) + bias  (batch..., Lq, Lk)
//   scores  = masked_fill(mask == 0 or (causal and j > i + Lk - Lq), -1e9)
//   weights = softmax(scores, dim = -1)          uniform rows stay uniform (or zero); a sink
//                                                adds exp(sink) to the denominator
//   output  = weights · V                        (batch..., Lq, Ev)
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace attend::test {

struct ReferenceProblem {
  std::vector<int64_t> batch_shape;  // 0 to 4 leading dimensions
  int64_t query_len = 0;             // Lq
  int64_t key_len = 0;               // Lk
  int64_t head_dim = 0;              // E
  int64_t value_dim = 0;             // Ev
  // Contiguous row-major: query (batch..., Lq, E), key (batch..., Lk, E),
  // value (batch..., Lk, Ev).
  std::vector<double> query, key, value;
  // Optional mask and bias with their own shapes, broadcast to (batch..., Lq, Lk).
  bool has_mask = false;
  std::vector<int64_t> mask_shape;
  std::vector<int64_t> mask;  // zero excludes
  bool has_bias = false;
  std::vector<int64_t> bias_shape;
  std::vector<double> bias;
  bool causal = false;
  double scale = 1.0;
  // Logit soft-capping: score = softcap·tanh(score / softcap) before the bias; 0: none.
  double softcap = 0.0;
  // Attention sinks: one logit per batch index joining each row's softmax denominator, with
  // no value; empty: none.
  std::vector<double> sinks;
  bool zero_fully_masked_rows = false;
  // Dropout: the factor (0 or 1/(1 − p)) of weight (b, i, j) at flat index (b·Lq + i)·Lk + j;
  // empty means no dropout.
  std::vector<double> dropout_factor;

  int64_t batch() const {
    int64_t count = 1;
    for (int64_t d : batch_shape) count *= d;
    return count;
  }
};

struct ReferenceResult {
  std::vector<double> output;   // (batch..., Lq, Ev)
  std::vector<double> weights;  // (batch..., Lq, Lk)
};

// Flat index into a contiguous tensor of `source_shape` read at the scores position
// (batch index b, query i, key j): the source's dimensions align with the scores' last ones,
// and a source dimension of size 1 always reads index 0 (broadcast).
inline int64_t broadcast_flat_index(const std::vector<int64_t>& source_shape,
                                    const std::vector<int64_t>& batch_shape, int64_t b, int64_t i,
                                    int64_t j) {
  // The scores position as a full index (batch..., i, j).
  std::vector<int64_t> position(batch_shape.size() + 2);
  for (size_t d = batch_shape.size(); d-- > 0;) {
    position[d] = b % batch_shape[d];
    b /= batch_shape[d];
  }
  position[batch_shape.size()] = i;
  position[batch_shape.size() + 1] = j;

  const size_t offset = position.size() - source_shape.size();
  int64_t flat = 0;
  for (size_t d = 0; d < source_shape.size(); ++d) {
    const int64_t index = source_shape[d] == 1 ? 0 : position[offset + d];
    flat = flat * source_shape[d] + index;
  }
  return flat;
}

// Whether key j takes part in the softmax of query i of batch b (mask and causality).
inline bool is_visible(const ReferenceProblem& p, int64_t b, int64_t i, int64_t j) {
  if (p.causal && j > i + (p.key_len - p.query_len)) return false;
  if (p.has_mask &&
      p.mask[static_cast<size_t>(broadcast_flat_index(p.mask_shape, p.batch_shape, b, i, j))] ==
          0) {
    return false;
  }
  return true;
}

inline bool row_fully_excluded(const ReferenceProblem& p, int64_t b, int64_t i) {
  for (int64_t j = 0; j < p.key_len; ++j) {
    if (is_visible(p, b, i, j)) return false;
  }
  return true;
}

inline double bias_at(const ReferenceProblem& p, int64_t b, int64_t i, int64_t j) {
  if (!p.has_bias) return 0.0;
  return p.bias[static_cast<size_t>(broadcast_flat_index(p.bias_shape, p.batch_shape, b, i, j))];
}

inline ReferenceResult independent_attention(const ReferenceProblem& p) {
  const int64_t Lq = p.query_len, Lk = p.key_len, E = p.head_dim, Ev = p.value_dim;
  ReferenceResult result;
  result.output.assign(static_cast<size_t>(p.batch() * Lq * Ev), 0.0);
  result.weights.assign(static_cast<size_t>(p.batch() * Lq * Lk), 0.0);
  std::vector<double> scores(static_cast<size_t>(Lk));
  for (int64_t b = 0; b < p.batch(); ++b) {
    for (int64_t i = 0; i < Lq; ++i) {
      // 1. scores of query i against every key, then the -1e9 fill.
      bool any_visible = false;
      for (int64_t j = 0; j < Lk; ++j) {
        double dot = 0.0;
        for (int64_t e = 0; e < E; ++e) {
          dot += p.query[static_cast<size_t>((b * Lq + i) * E + e)] *
                 p.key[static_cast<size_t>((b * Lk + j) * E + e)];
        }
        double score = dot * p.scale;
        if (p.softcap > 0) score = p.softcap * std::tanh(score / p.softcap);
        score += bias_at(p, b, i, j);
        if (is_visible(p, b, i, j)) {
          any_visible = true;
        } else {
          score = -1e9;
        }
        scores[static_cast<size_t>(j)] = score;
      }
      // 2. softmax. A NaN score is skipped by the max and then spreads through the sum to
      // every weight of the row, as in PyTorch.
      // The sink is one more logit in the softmax, with no value.
      const double sink = p.sinks.empty() ? -INFINITY : p.sinks[static_cast<size_t>(b)];
      double max_score = sink;
      for (double s : scores) {
        if (s > max_score) max_score = s;
      }
      double sum = std::exp(sink - max_score);
      for (double s : scores) sum += std::exp(s - max_score);
      double* weights = &result.weights[static_cast<size_t>((b * Lq + i) * Lk)];
      for (int64_t j = 0; j < Lk; ++j) {
        weights[j] = (!any_visible && p.zero_fully_masked_rows)
                         ? 0.0
                         : std::exp(scores[static_cast<size_t>(j)] - max_score) / sum;
        if (!p.dropout_factor.empty()) {
          weights[j] *= p.dropout_factor[static_cast<size_t>((b * Lq + i) * Lk + j)];
        }
      }
      // 3. output row = weights · V.
      double* output = &result.output[static_cast<size_t>((b * Lq + i) * Ev)];
      for (int64_t j = 0; j < Lk; ++j) {
        for (int64_t e = 0; e < Ev; ++e) {
          output[e] += weights[j] * p.value[static_cast<size_t>((b * Lk + j) * Ev + e)];
        }
      }
    }
  }
  return result;
}

}  // namespace attend::test
