// reference_sdpa.hpp: the listing, literally. The test oracle and the benchmarks' baseline.
#pragma once

#include "sdpa_params.hpp"

namespace attend::detail {

// For each batch index and query row i, in float64:
//   s_j = (q_i · k_j) · scale + bias_ij            materialized for all Lk keys
//   s_j = -1e9 where mask_ij == 0 or (causal and j > i + Lk - Lq)
//   w   = softmax(s)                                (max-subtracted)
//   w_j = keep_j ? w_j / (1 - p) : 0                dropout, Philox draw per (b, i, j)
//   o   = Σ_j w_j v_j
// Rows with every key excluded give uniform weights, or zeros with zero_fully_masked_rows.
void reference_sdpa(const SdpaParams& params);

}  // namespace attend::detail
