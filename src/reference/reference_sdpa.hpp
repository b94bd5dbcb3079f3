// reference_sdpa.hpp: the listing, literally. The test oracle and the benchmarks' baseline.
#pragma once

#include <cmath>
#include <cstdint>

#include "sdpa_params.hpp"

namespace attend::detail {

// For each batch index and query row i, in float64:
//   s_j = (q_i · k_j) · scale, then softcap, bias, ALiBi, user rule   for all Lk keys
//   s_j = -1e9 where excluded (causal, window, documents, mask, user mask)
//   w   = softmax(s), with the head's sink in the denominator        (max-subtracted)
//   w_j = keep_j ? w_j / (1 - p) : 0                dropout, Philox draw per (b, i, j)
//   o   = Σ_j w_j v_j
// Rows with every key excluded give uniform weights, or zeros with zero_fully_masked_rows.
void reference_sdpa(const SdpaParams& params);

// Steps 1–2 for row i of batch index b, in float64: weights[j] (Lk entries) = softmax of the
// listing's scores, and excluded[j] (when not null) whether key j was masked or causally
// excluded. Shared by the forward and backward references.
struct ReferenceRow {
  bool any_visible = false;
  double max_score = -INFINITY;  // of the scores after masked_fill, and the sink
  double sum = 0;                // Σ_j exp(score_j − max_score) + exp(sink − max_score)
};
ReferenceRow reference_row_weights(const SdpaParams& p, int64_t b, int64_t i, double* weights,
                                   char* excluded);

}  // namespace attend::detail
