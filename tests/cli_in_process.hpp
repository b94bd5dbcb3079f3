// cli_in_process.hpp: runs the attend command line in the test process (attend_cli_main) with
// stdout and stderr captured. For tests linked with attend_cli_lib.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cli_main.hpp"
#include "test_support.hpp"  // read_file_bytes, TemporaryDirectory

namespace attend::test {

struct CliRun {
  int exit_status = -1;
  std::string out, err;
};

// `arguments` without the program name, e.g. {"demo", "--out-dir", dir}.
inline CliRun run_cli(std::vector<std::string> arguments) {
  arguments.insert(arguments.begin(), "attend");
  std::vector<char*> argv;
  for (std::string& word : arguments) argv.push_back(word.data());
  argv.push_back(nullptr);
  CliRun result;
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  result.exit_status = attend_cli_main(static_cast<int>(arguments.size()), argv.data());
  result.err = ::testing::internal::GetCapturedStderr();
  result.out = ::testing::internal::GetCapturedStdout();
  return result;
}

}  // namespace attend::test
