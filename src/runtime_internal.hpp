// runtime_internal.hpp: library-internal hooks of runtime.cpp.
#pragma once

namespace attend::detail {

// Applies the ATTEND_MAX_SIMD environment variable once, before the first dispatch.
// Throws attend::Error when it names a target that is not compiled in.
void apply_simd_cap_from_environment();

}  // namespace attend::detail
