// fused_sdpa_backward.hpp: the tiled, deterministic attention backward (Highway, one source
// for every SIMD target, dispatched at run time).
#pragma once

#include "sdpa_params.hpp"

namespace attend::detail {

// Null when the fused backward handles `params`, else the reason it does not.
const char* fused_sdpa_backward_rejects(const SdpaBackwardParams& params);
void fused_sdpa_backward(const SdpaBackwardParams& params);

}  // namespace attend::detail
