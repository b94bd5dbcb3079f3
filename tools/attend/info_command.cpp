// info_command.cpp: `attend info` prints attend::runtime_report(): the version, the SIMD
// targets compiled in, those this CPU supports, the one the kernels dispatch to, the default
// thread count, and the reduced-precision instructions of this CPU with the products bfloat16
// and float16 inputs get.
#include "info_command.hpp"

#include <iostream>

#include "attend/runtime.hpp"

namespace attend::cli {

Command add_info_command(CLI::App& app) {
  CLI::App* info = app.add_subcommand(
      "info",
      "Print the version, SIMD targets (compiled, supported, active), thread count and the "
      "reduced-precision paths");
  return {info, [] { std::cout << runtime_report(); }};
}

}  // namespace attend::cli
