// cpu_features.hpp: the reduced-precision instructions of this CPU (read once from cpuid and
// the OS's enabled register state) and whether attend's dispatch may use them now. What a
// call computes with them is the boundary's choice (wants_bf16_products, sdpa_boundary.hpp).
#pragma once

#include "attend/runtime.hpp"

namespace attend::detail {

// What the CPU and the OS offer (cpuid leaf 7, XCR0), read once; all false off x86.
const PrecisionSupport& cpu_precision_support();

// bfloat16 products (vdpbf16ps) can run now: the CPU has AVX512_BF16 with its register
// state enabled and attend's SIMD target (after any cap) is an AVX-512 one.
bool native_bf16_products();
// Why not, for messages: "this CPU has no AVX512_BF16", "the SIMD cap (AVX2) rules out
// AVX-512", or "" when they can.
const char* why_no_bf16_products();

// Whether the dispatched SIMD target widens float16 to float32 exactly, infinities and NaNs
// included (x86 with F16C: AVX2 and above); Highway's software widening does not.
bool exact_f16_widening();

}  // namespace attend::detail
