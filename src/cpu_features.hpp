// cpu_features.hpp: the reduced-precision instructions of this CPU (read once from cpuid and
// the OS's enabled register state) and whether attend's dispatch may use them now. What a
// call computes with them is the boundary's choice (wants_bf16_products, boundary/operands.hpp).
#pragma once

namespace attend {
struct PrecisionSupport;  // attend/runtime.hpp (an API header: the kernels include this one)
}  // namespace attend

namespace attend::detail {

// What the CPU and the OS offer (cpuid leaf 7, XCR0), read once; all false off x86.
const PrecisionSupport& cpu_precision_support();

// bfloat16 products (vdpbf16ps) can run now: the CPU has AVX512_BF16 with its register
// state enabled and attend's SIMD target (after any cap) is an AVX-512 one.
bool native_bf16_products();
// Why not, for messages: "this CPU has no AVX512_BF16", "the SIMD cap (AVX2) rules out
// AVX-512", or "" when they can.
const char* why_no_bf16_products();

// float16 products (vfmadd231ph, isa/avx512_fp16-inl.h) can run now: the CPU has
// AVX512_FP16 with its register state enabled and attend's SIMD target is an AVX-512 one.
bool native_f16_products();
// Why not: "this CPU has no AVX512_FP16", the SIMD cap, or "" when they can.
const char* why_no_f16_products();

// The bfloat16 products run on AMX tiles (isa/amx_bf16.hpp) now: native_bf16_products() (the
// softmax and the packing between the products are AVX-512 code), the CPU has AMX-TILE and
// AMX-BF16 with their register state in XCR0, Linux granted this process the tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once, at the first call), and AMX is not switched
// off (ATTEND_AMX=0, set_amx_enabled(false)).
bool amx_bf16_products();
// Why not, for messages: e.g. "this CPU has no AMX-BF16"; "" when they can.
const char* why_no_amx_bf16();
// attend::set_amx_enabled and its reading.
void set_amx_switch(bool on);
bool amx_switched_on();

// The CPU's maker (cpuid leaf 0's vendor string), read once: the precision policy
// (boundary/operands.hpp) reads what the maker's cores are known to do with vdpbf16ps.
enum class CpuVendor { kOther, kIntel, kAmd };
CpuVendor cpu_vendor();

// Whether the dispatched SIMD target widens float16 to float32 exactly, infinities and NaNs
// included (x86 with F16C: AVX2 and above); Highway's software widening does not.
bool exact_f16_widening();

}  // namespace attend::detail
