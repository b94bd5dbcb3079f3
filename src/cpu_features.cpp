// cpu_features.cpp: cpuid and XCR0 (Intel SDM vol. 2A, CPUID leaf 07H; vol. 1 13.3).
#include "cpu_features.hpp"

#include <hwy/targets.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attend/runtime.hpp"
#include "kernels/isa/f16_build.hpp"
#include "simd_dispatch.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attend::detail {
namespace {

PrecisionSupport detect() {
  PrecisionSupport s;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return s;
  __cpuid(1, a, b, c, d);
  const bool osxsave = (c >> 27) & 1;
  if (!osxsave) return s;
  uint32_t xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const uint64_t xcr0 = (uint64_t{xcr0_hi} << 32) | xcr0_lo;
  // SSE, AVX and the three AVX-512 states (opmask, ZMM0-15 upper halves, ZMM16-31).
  const bool zmm_state = (xcr0 & 0xE6) == 0xE6;
  // AMX: XTILECFG and XTILEDATA (bits 17, 18); Linux grants XTILEDATA to a process only on
  // request (arch_prctl ARCH_REQ_XCOMP_PERM: tile_data_permitted below).
  const bool tile_state = (xcr0 & 0x60000) == 0x60000;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx512f = (b >> 16) & 1;
  s.avx512_fp16 = zmm_state && avx512f && ((d >> 23) & 1);
  s.amx_bf16 = tile_state && ((d >> 22) & 1);
  s.amx_tile = tile_state && ((d >> 24) & 1);
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  s.avx512_bf16 = zmm_state && avx512f && ((a1 >> 5) & 1);
  s.amx_fp16 = tile_state && ((a1 >> 21) & 1);
#endif
  return s;
}

// Linux enables the tile data state (XFEATURE_XTILEDATA, 18) for a process only once it asks
// (arch_prctl ARCH_REQ_XCOMP_PERM, 0x1023; Linux 5.16 and later), for all its threads; a
// tile instruction before that faults. Asked once per process (a static's thread-safe
// initialization); a refusal (an older kernel, a seccomp filter) leaves AMX unused.
bool tile_data_permitted() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

// AMX switched on: ATTEND_AMX ("0" or "off" switches it off), read at the first use, then
// set_amx_enabled.
std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("ATTEND_AMX");
    return env == nullptr || (std::strcmp(env, "0") != 0 && std::strcmp(env, "off") != 0);
  }()};
  return on;
}

}  // namespace

CpuVendor cpu_vendor() {
  static const CpuVendor vendor = [] {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    __cpuid(0, a, b, c, d);
    char name[13] = {};
    std::memcpy(name, &b, 4);  // the vendor string is EBX, EDX, ECX
    std::memcpy(name + 4, &d, 4);
    std::memcpy(name + 8, &c, 4);
    if (std::strcmp(name, "GenuineIntel") == 0) return CpuVendor::kIntel;
    if (std::strcmp(name, "AuthenticAMD") == 0) return CpuVendor::kAmd;
#endif
    return CpuVendor::kOther;
  }();
  return vendor;
}

const PrecisionSupport& cpu_precision_support() {
  static const PrecisionSupport support = detect();
  return support;
}

namespace {

// Why the dispatched SIMD target cannot run AVX-512 products: "" when it can.
const char* why_no_avx512_target() {
#if defined(__x86_64__) || defined(__i386__)
  constexpr int64_t kAvx512 = HWY_AVX3 | HWY_AVX3_DL;
  if ((dispatch_targets() & kAvx512 & HWY_TARGETS) == 0) {
    return "attend's SIMD target is capped below AVX-512 (set_max_simd_target, ATTEND_MAX_SIMD)";
  }
  return "";
#else
  return "not an x86 CPU";
#endif
}

}  // namespace

const char* why_no_bf16_products() {
  if (!cpu_precision_support().avx512_bf16) return "this CPU has no AVX512_BF16";
  return why_no_avx512_target();
}

const char* why_no_f16_products() {
  if (!cpu_precision_support().avx512_fp16) return "this CPU has no AVX512_FP16";
#if !ATTEND_F16_PRODUCTS_BUILT
  return "float16 products are not built by this compiler (x86-64 with GCC 12 or clang 16 and "
         "later)";
#else
  return why_no_avx512_target();
#endif
}

bool native_f16_products() { return why_no_f16_products()[0] == '\0'; }

bool exact_f16_widening() {
#if defined(__x86_64__) || defined(__i386__)
  constexpr int64_t kF16c = HWY_AVX2 | HWY_AVX3 | HWY_AVX3_DL;
  return (dispatch_targets() & kF16c & HWY_TARGETS) != 0;
#else
  return false;
#endif
}

bool native_bf16_products() { return why_no_bf16_products()[0] == '\0'; }

const char* why_no_amx_bf16() {
  const PrecisionSupport& cpu = cpu_precision_support();
  if (!cpu.amx_tile || !cpu.amx_bf16) return "this CPU has no AMX-BF16";
  if (!native_bf16_products()) return why_no_bf16_products();
  if (!amx_switched_on()) {
    return "AMX is switched off (ATTEND_AMX=0, set_amx_enabled)";
  }
  if (!tile_data_permitted()) return "the OS refused this process the AMX tile data";
  return "";
}

bool amx_bf16_products() { return why_no_amx_bf16()[0] == '\0'; }

void set_amx_switch(bool on) { amx_switch().store(on, std::memory_order_relaxed); }

bool amx_switched_on() { return amx_switch().load(std::memory_order_relaxed); }

}  // namespace attend::detail
