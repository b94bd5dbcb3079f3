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
// Whether bfloat16 products may run on AMX tiles (Intel Sapphire Rapids and later, where the
// OS grants them) rather than AVX512_BF16: on by default, off with the environment variable
// ATTEND_AMX=0 (read at the first call) or set_amx_enabled(false). The SIMD cap rules AMX
// out too when it rules out AVX-512. Call it while no other thread is inside attend.
void set_amx_enabled(bool enabled);
bool amx_enabled();

// The reduced-precision instructions of this CPU whose register state the OS enables.
struct PrecisionSupport {
  bool avx512_bf16 = false;  // vdpbf16ps: bfloat16 products (AMD Zen 4 and later, Intel
                             // Cooper Lake and Sapphire Rapids and later)
  bool avx512_fp16 = false;  // float16 arithmetic (Intel Sapphire Rapids and later)
  bool amx_tile = false;     // AMX tiles (the OS's XCR0 bits; Linux grants them per process)
  bool amx_bf16 = false;
  bool amx_fp16 = false;
};
PrecisionSupport precision_support();

// The matrix products bfloat16 and float16 inputs get on this CPU now with the default
// ComputePrecision::kAuto (after the SIMD cap and the AMX switch), per site for bfloat16:
// e.g. "bfloat16 products (attention's forward query tiles: AMX-BF16 tiles, backward: ...,
// projections: ...)", or "float32 products (this CPU has no AVX512_BF16)" — or, on a CPU
// whose vdpbf16ps is no faster than float32 FMAs and has no AMX, "float32 products (...)"
// although ComputePrecision::kBFloat16 runs them.
std::string bf16_compute_path();
std::string fp16_compute_path();

// Threads a call with num_threads == 0 uses.
int default_num_threads();

// All of the above as the lines `attend info` prints (and Python's `python3 -m attend info`):
// version, SIMD targets compiled, supported and active (with the ATTEND_MAX_SIMD cap), default
// threads, reduced-precision instructions and the products bfloat16 and float16 inputs get.
std::string runtime_report();

}  // namespace attend
