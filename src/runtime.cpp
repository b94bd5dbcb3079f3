// runtime.cpp: version, compiled and supported SIMD targets, attend's dispatch cap.
#include "attend/runtime.hpp"

#include <hwy/targets.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "boundary/operands.hpp"
#include "cpu_features.hpp"
#include "quote.hpp"
#include "simd_dispatch.hpp"

namespace attend {
namespace {

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// Compiled targets (HWY_TARGETS of the library's kernels), best first: a lower bit is a
// better target.
std::vector<int64_t> compiled_target_bits() {
  std::vector<int64_t> bits;
  for (int64_t targets = HWY_TARGETS; targets != 0; targets &= targets - 1) {
    bits.push_back(targets & ~(targets - 1));
  }
  return bits;
}

// The targets above the one called `name` ("" caps nothing). Throws attend::Error for a name
// that is not compiled in.
int64_t targets_above(const std::string& name) {
  if (name.empty()) return 0;
  const std::string wanted = upper(name);
  int64_t above = 0;
  for (int64_t bit : compiled_target_bits()) {
    if (wanted == hwy::TargetName(bit)) return above;
    above |= bit;
  }
  std::string known;
  for (const auto& n : compiled_simd_targets()) known += (known.empty() ? "" : ", ") + n;
  throw Error("SIMD target " + detail::quote_for_message(name) +
              " is not compiled in (compiled: " + known + ")");
}

// What the CPU supports (read once) and attend's current choice among it. Nothing here
// touches Highway's process-wide choice, which other users of Highway in the program keep.
struct DispatchState {
  int64_t supported = 0;
  std::atomic<int64_t> allowed{0};  // supported, without the targets above the cap

  DispatchState() {
    supported = hwy::SupportedTargets();
    // Highway 1.0.3's SupportedTargets() also sets its process-wide choice to every detected
    // target, ignoring hwy::DisableTargets: reset it, so that the next HWY_DYNAMIC_DISPATCH
    // elsewhere in the program chooses again as it would have.
    hwy::GetChosenTarget().DeInit();
    const char* cap = std::getenv("ATTEND_MAX_SIMD");
    allowed = supported & ~targets_above(cap != nullptr ? cap : "");
  }
};

// Built on first use; when ATTEND_MAX_SIMD is bad, the constructor throws and every later
// use throws again.
DispatchState& dispatch_state() {
  static DispatchState state;
  return state;
}

}  // namespace

const char* version() { return ATTEND_VERSION; }

std::vector<std::string> compiled_simd_targets() {
  std::vector<std::string> names;
  for (int64_t bit : compiled_target_bits()) names.emplace_back(hwy::TargetName(bit));
  return names;
}

std::vector<std::string> supported_simd_targets() {
  const int64_t allowed = detail::dispatch_targets();
  std::vector<std::string> names;
  for (int64_t bit : compiled_target_bits()) {
    if (allowed & bit) names.emplace_back(hwy::TargetName(bit));
  }
  return names;
}

std::string active_simd_target() {
  const auto names = supported_simd_targets();
  return names.empty() ? std::string("none") : names.front();
}

void set_max_simd_target(const std::string& name) {
  DispatchState& state = dispatch_state();
  state.allowed = state.supported & ~targets_above(name);
}

void set_amx_enabled(bool enabled) { detail::set_amx_switch(enabled); }

bool amx_enabled() { return detail::amx_switched_on(); }

PrecisionSupport precision_support() { return detail::cpu_precision_support(); }

std::string bf16_compute_path() {
  if (!detail::native_bf16_products()) {
    return std::string("float32 products (") + detail::why_no_bf16_products() + ")";
  }
  // The precision policy's choice for bfloat16 inputs (kAuto) at each site.
  using detail::Bf16Products;
  const auto at = [](detail::ProductSite site) {
    switch (detail::bf16_products(DType::kBFloat16, ComputePrecision::kAuto, site)) {
      case Bf16Products::kAmxTiles:
        return std::string("AMX-BF16 tiles");
      case Bf16Products::kAvx512Bf16:
        return std::string("AVX512_BF16");
      case Bf16Products::kFloat32:
        break;
    }
    return std::string("float32");
  };
  const std::string attention = at(detail::ProductSite::kAttention);
  const std::string backward = at(detail::ProductSite::kAttentionBackward);
  const std::string projections = at(detail::ProductSite::kProjections);
  const char* why_float32 =
      "vdpbf16ps is no faster than float32 FMAs on this CPU (Intel: half their FLOP rate); "
      "ComputePrecision::kBFloat16 runs it";
  if (attention == "float32" && backward == "float32" && projections == "float32") {
    return std::string("float32 products (") + why_float32 + ")";
  }
  std::string path = "bfloat16 products (attention's forward query tiles: " + attention +
                     ", backward: " + backward + ", projections: " + projections;
  return path + ")";
}

std::string fp16_compute_path() {
  if (detail::native_f16_products()) {
    return "float32 products; float16 products (AVX512_FP16, attention's forward query tiles) "
           "with ComputePrecision::kFloat16";
  }
  return std::string("float32 products (") + detail::why_no_f16_products() + ")";
}

int default_num_threads() { return std::max(1, omp_get_max_threads()); }

namespace {
std::string join(const std::vector<std::string>& names) {
  std::string joined;
  for (const std::string& name : names) joined += (joined.empty() ? "" : ", ") + name;
  return joined.empty() ? "none" : joined;
}
}  // namespace

std::string runtime_report() {
  // Gathered first: a bad ATTEND_MAX_SIMD throws before anything is written.
  const std::vector<std::string> compiled = compiled_simd_targets();
  const std::vector<std::string> supported = supported_simd_targets();
  const std::string active = active_simd_target();
  const int threads = default_num_threads();
  const char* cap = std::getenv("ATTEND_MAX_SIMD");
  const PrecisionSupport cpu = precision_support();
  const auto yes = [](bool present) { return present ? std::string("yes") : std::string("no"); };
  std::string report = std::string("attend ") + version() + "\n" +
                       "SIMD targets compiled:  " + join(compiled) + "\n" +
                       "SIMD targets supported: " + join(supported) + "\n" +
                       "SIMD target active:     " + active;
  if (cap != nullptr && *cap != '\0') report += std::string(" (capped by ATTEND_MAX_SIMD=") + cap + ")";
  report += "\ndefault threads:        " + std::to_string(threads) + "\n" +
            "reduced precision:      AVX512_BF16 " + yes(cpu.avx512_bf16) + ", AVX512_FP16 " +
            yes(cpu.avx512_fp16) + ", AMX tiles " + yes(cpu.amx_tile) + " (AMX-BF16 " +
            yes(cpu.amx_bf16) + ", AMX-FP16 " + yes(cpu.amx_fp16) + ")\n" +
            "bfloat16 inputs:        " + bf16_compute_path() + "\n" +
            "float16 inputs:         " + fp16_compute_path() + "\n";
  return report;
}

namespace detail {
int64_t dispatch_targets() { return dispatch_state().allowed.load(std::memory_order_relaxed); }
}  // namespace detail

}  // namespace attend
