// reference_sdpa_backward.hpp: the gradient of the listing, literally, in float64. The test
// oracle of the fused backward and the benchmarks' baseline.
#pragma once

#include "sdpa_params.hpp"

namespace attend::detail {

// Per batch index (one per thread) and query row i, recomputing the forward in float64:
//   P_i = softmax(s_i) with s as in reference_sdpa;  P̃_ij = P_ij·Z_ij/(1 − p)
//   dP_ij = (dO_i·V_j)·Z_ij/(1 − p);  D_i = Σ_j P_ij·dP_ij
//   dS_ij = P_ij·(dP_ij − D_i), 0 where excluded
//   dQ_i = scale·Σ_j dS_ij·K_j;  dK_j += scale·dS_ij·Q_i;  dV_j += P̃_ij·dO_i
// Writes dQ, dK, dV and, when requested, dS.
void reference_sdpa_backward(const SdpaBackwardParams& params);

}  // namespace attend::detail
