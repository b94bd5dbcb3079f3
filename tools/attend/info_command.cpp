// info_command.cpp: `attend info` prints the version, the SIMD targets compiled in, those
// this CPU supports, the one the kernels dispatch to, and the default thread count.
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
}

}  // namespace

Command add_info_command(CLI::App& app) {
  CLI::App* info = app.add_subcommand(
      "info", "Print the version, SIMD targets (compiled, supported, active) and thread count");
  return {info, [] { run_info(); }};
}

}  // namespace attend::cli
