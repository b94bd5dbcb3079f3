// fused_sdpa.hpp: the fused tiled online-softmax kernel (Highway, one source for every
// SIMD target, dispatched at run time).
#pragma once

#include "sdpa_params.hpp"

namespace attend::detail {

// Null when the fused kernel handles `params`, else the reason it does not.
const char* fused_sdpa_rejects(const SdpaParams& params);
void fused_sdpa(const SdpaParams& params);

}  // namespace attend::detail
