// info_command.cpp: `attend info` prints the version, the SIMD targets compiled in, those
// this CPU supports, the one the kernels dispatch to, the default thread count, and the
// reduced-precision instructions of this CPU with the products bfloat16 and float16 inputs get.
#include "info_command.hpp"

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "attend/runtime.hpp"

namespace attend::cli {
namespace {

std::string join(const std::vector<std::string>& names) {
  std::string joined;
  for (const std::string& name : names) joined += (joined.empty() ? "" : ", ") + name;
  return joined.empty() ? "none" : joined;
}

void run_info() {
  // Gather everything first: a bad ATTEND_MAX_SIMD throws before anything is printed.
  const std::vector<std::string> compiled = compiled_simd_targets();
  const std::vector<std::string> supported = supported_simd_targets();
  const std::string active = active_simd_target();
  const int threads = default_num_threads();
  const char* cap = std::getenv("ATTEND_MAX_SIMD");

  std::cout << "attend " << version() << '\n'
            << "SIMD targets compiled:  " << join(compiled) << '\n'
            << "SIMD targets supported: " << join(supported) << '\n'
            << "SIMD target active:     " << active;
  if (cap != nullptr && *cap != '\0') std::cout << " (capped by ATTEND_MAX_SIMD=" << cap << ")";
  std::cout << '\n' << "default threads:        " << threads << '\n';
  const PrecisionSupport cpu = precision_support();
  const auto yes = [](bool present) { return present ? "yes" : "no"; };
  std::cout << "reduced precision:      AVX512_BF16 " << yes(cpu.avx512_bf16) << ", AVX512_FP16 "
            << yes(cpu.avx512_fp16) << ", AMX tiles " << yes(cpu.amx_tile) << " (AMX-BF16 "
            << yes(cpu.amx_bf16) << ", AMX-FP16 " << yes(cpu.amx_fp16) << ")\n"
            << "bfloat16 inputs:        " << bf16_compute_path() << '\n'
            << "float16 inputs:         " << fp16_compute_path() << '\n';
}

}  // namespace

Command add_info_command(CLI::App& app) {
  CLI::App* info = app.add_subcommand(
      "info",
      "Print the version, SIMD targets (compiled, supported, active), thread count and the "
      "reduced-precision paths");
  return {info, [] { run_info(); }};
}

}  // namespace attend::cli
