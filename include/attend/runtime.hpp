// attend/runtime.hpp: what this build and this machine offer.
#pragma once

#include <string>
#include <vector>

namespace attend {

// "0.1.0"
const char* version();

// SIMD targets compiled into this binary, best first, e.g. {"AVX3", "AVX2", "SSE4", "EMU128"}.
std::vector<std::string> compiled_simd_targets();
// SIMD targets this CPU supports among those compiled, best first, without those above the
// cap (below).
std::vector<std::string> supported_simd_targets();
// The target the kernels dispatch to now: the best supported one, capped by the environment
// variable ATTEND_MAX_SIMD (a target name such as "AVX2" or "EMU128", read at the first call)
// or by set_max_simd_target().
std::string active_simd_target();
// Caps attend's dispatch at the named target (case-insensitive; "" removes the cap). Only
// attend's kernels follow it: other users of Highway in the program keep their own choice.
// Throws attend::Error for a name that is not compiled in. Call it while no other thread is
// inside attend (a call in flight could plan for one target and run on another).
void set_max_simd_target(const std::string& name);

// Threads a call with num_threads == 0 uses.
int default_num_threads();

}  // namespace attend
