// runtime.cpp: version, compiled and supported SIMD targets, the dispatch cap.
#include "attend/runtime.hpp"

#include <hwy/targets.h>
#include <omp.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <mutex>

#include "attend/error.hpp"
#include "quote.hpp"
#include "runtime_internal.hpp"

namespace attend {
namespace {

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// Compiled targets (HWY_TARGETS of the library's kernels), best first: on x86 a lower bit is a
// better target.
std::vector<int64_t> compiled_target_bits() {
  std::vector<int64_t> bits;
  for (int64_t targets = HWY_TARGETS; targets != 0; targets &= targets - 1) {
    bits.push_back(targets & ~(targets - 1));
  }
  return bits;
}

void apply_cap(const std::string& name) {
  if (name.empty()) {
    hwy::DisableTargets(0);
    return;
  }
  const std::string wanted = upper(name);
  int64_t disabled = 0;
  for (int64_t bit : compiled_target_bits()) {
    if (wanted == hwy::TargetName(bit)) {
      hwy::DisableTargets(disabled);
      return;
    }
    disabled |= bit;
  }
  std::string known;
  for (const auto& n : compiled_simd_targets()) known += (known.empty() ? "" : ", ") + n;
  throw Error("SIMD target " + detail::quote_for_message(name) +
              " is not compiled in (compiled: " + known + ")");
}

}  // namespace

const char* version() { return ATTEND_VERSION; }

std::vector<std::string> compiled_simd_targets() {
  std::vector<std::string> names;
  for (int64_t bit : compiled_target_bits()) names.emplace_back(hwy::TargetName(bit));
  return names;
}

std::vector<std::string> supported_simd_targets() {
  detail::apply_simd_cap_from_environment();
  std::vector<std::string> names;
  const int64_t supported = hwy::SupportedTargets();
  // Highway 1.0.3's SupportedTargets() leaves the dispatch choice initialized to the
  // uncapped targets: re-apply the cap, or every later HWY_DYNAMIC_DISPATCH ignores it.
  hwy::GetChosenTarget().Update(supported);
  for (int64_t bit : compiled_target_bits()) {
    if (supported & bit) names.emplace_back(hwy::TargetName(bit));
  }
  return names;
}

std::string active_simd_target() {
  const auto names = supported_simd_targets();
  return names.empty() ? std::string("none") : names.front();
}

void set_max_simd_target(const std::string& name) {
  detail::apply_simd_cap_from_environment();  // so that a later call cannot undo this one
  apply_cap(name);
}

int default_num_threads() { return std::max(1, omp_get_max_threads()); }

namespace detail {
void apply_simd_cap_from_environment() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (const char* cap = std::getenv("ATTEND_MAX_SIMD"); cap != nullptr && *cap != '\0') {
      apply_cap(cap);
    }
  });
}
}  // namespace detail

}  // namespace attend
