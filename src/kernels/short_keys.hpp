// short_keys.hpp: attention over a few keys and a few queries per head (the kernel list's
// first entry; shape_policy.hpp: ShortKeysDeclines says what it takes).
#pragma once

#include "sdpa_params.hpp"

namespace attend::detail {

// Null when the short-key kernel runs `params`, else the reason it declines.
const char* fused_short_keys_rejects(const SdpaParams& params);
void fused_short_keys(const SdpaParams& params);

}  // namespace attend::detail
