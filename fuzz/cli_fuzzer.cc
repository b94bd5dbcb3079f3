// cli_fuzzer: the `attend sdpa` command in-process, with fuzzed options and a fuzzed input
// file. attend_cli_main must return 0 or 2, and what it writes to stderr (the error line, which
// quotes options, paths and file bytes) must be printable: no control byte but '\n', nothing
// from 0x7f. A crash, a sanitizer report, a leak, an escaped exception, a hang or a raw byte on
// stderr is a finding.
//
// Input layout: option text, a NUL byte, then the bytes of a .npy file (no NUL: options only,
// and an empty file). The option text is split at whitespace into tokens and run as
//   attend sdpa --query W/f --key W/f --value W/f [tokens] --out W/out.npy
// where W is a private temporary directory and W/f holds the payload. So that a fuzzed
// command cannot touch the rest of the file system or run for long, the harness:
//   - confines paths: the value of every file option (--query ... --grad-bias, in either
//     "--opt value" or "--opt=value" form) loses its '/' characters and is placed in W;
//   - caps --threads at 4 (a huge count would start thousands of OpenMP threads);
//   - drops subcommand names (`bench` measures for seconds);
//   - skips payloads that parse as a tensor of more than 2^20 elements or whose scores
//     (batch · L · L, since the one file is Q, K and V) exceed 2^20: each execution stays in
//     milliseconds. The readers themselves never allocate more than the file holds, so such
//     a payload is large but valid, not a bug;
//   - empties W after every execution.
// stdout of the CLI is discarded and stderr checked, then discarded, unless
// ATTEND_FUZZ_VERBOSE is set.
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "attend/error.hpp"
#include "attend/npy.hpp"
#include "cli_main.hpp"
#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;

constexpr size_t kMaxTokens = 16;
constexpr size_t kMaxTokenLength = 64;
constexpr int64_t kMaxElements = int64_t{1} << 20;
constexpr uint64_t kMaxThreads = 4;

std::string work_directory;       // W, with no trailing '/'
std::ostringstream error_output;  // std::cerr of the CLI
bool verbose = false;

// The CLI refuses a second subcommand; dropped anyway, so that a change there cannot make the
// fuzzer run `bench` (seconds of measuring) or `demo`. Keep in step with cli_main.cpp.
const std::set<std::string> kSubcommands = {"bench", "demo", "info", "mha", "sdpa", "train-demo"};

bool is_file_option(std::string_view name) {
  for (std::string_view option :
       {"--query", "--key", "--value", "--mask", "--bias", "--out", "--out-weights", "--grad-out",
        "--grad-query", "--grad-key", "--grad-value", "--grad-bias"}) {
    if (name == option) return true;
  }
  return false;
}

// "--name...": the CLI reads it as an option, never as the previous option's value.
bool is_long_option(const std::string& token) {
  return token.size() > 2 && token.rfind("--", 0) == 0;
}

// A file option's value, confined to W.
std::string confined_path(std::string_view value) {
  std::string name;
  for (char c : value) {
    if (c != '/') name += c;
  }
  return work_directory + "/" + name;
}

// A --threads value: digits above kMaxThreads become kMaxThreads; anything else is kept so
// that the CLI's own checks see it.
std::string capped_threads(std::string_view value) {
  if (value.empty() || value.find_first_not_of("0123456789") != std::string_view::npos) {
    return std::string(value);
  }
  const size_t first_nonzero = value.find_first_not_of('0');
  if (first_nonzero == std::string_view::npos) return std::string(value);  // "0", "000"
  const std::string_view digits = value.substr(first_nonzero);
  if (digits.size() > 1 || static_cast<uint64_t>(digits[0] - '0') > kMaxThreads) {
    return std::to_string(kMaxThreads);
  }
  return std::string(value);
}

// Rewrites a value that follows (or is attached to) `option`.
std::string rewrite_value(std::string_view option, std::string_view value) {
  if (is_file_option(option)) return confined_path(value);
  if (option == "--threads") return capped_threads(value);
  return std::string(value);
}

std::vector<std::string> option_tokens(std::string_view text) {
  std::vector<std::string> raw;
  size_t position = 0;
  while (position < text.size() && raw.size() < kMaxTokens) {
    const size_t begin = text.find_first_not_of(" \t\n\r", position);
    if (begin == std::string_view::npos) break;
    size_t end = text.find_first_of(" \t\n\r", begin);
    if (end == std::string_view::npos) end = text.size();
    raw.emplace_back(text.substr(begin, std::min(end - begin, kMaxTokenLength)));
    position = end;
  }
  std::vector<std::string> tokens;
  for (size_t i = 0; i < raw.size(); ++i) {
    const std::string& token = raw[i];
    if (kSubcommands.count(token) != 0) continue;
    const size_t equals = token.find('=');
    if (token.rfind("--", 0) == 0 && equals != std::string::npos) {
      const std::string option = token.substr(0, equals);
      tokens.push_back(option + "=" + rewrite_value(option, token.substr(equals + 1)));
    } else if ((is_file_option(token) || token == "--threads") && i + 1 < raw.size() &&
               !is_long_option(raw[i + 1])) {  // "-", "-x" or "--" may be taken as a path
      tokens.push_back(token);
      tokens.push_back(rewrite_value(token, raw[i + 1]));
      ++i;
    } else {
      tokens.push_back(token);
    }
  }
  return tokens;
}

// True when the payload parses as a tensor too big for a quick execution.
bool payload_too_large(const uint8_t* data, size_t size) {
  try {
    const attend::Tensor tensor = attend::parse_npy(data, size, "<payload>");
    const attend::Shape& shape = tensor.shape();
    if (tensor.numel() > kMaxElements) return true;
    if (shape.rank() < 2) return false;
    int64_t scores = shape.back(1);  // batch · Lq · Lk with Lq = Lk
    for (int d = 0; d < shape.rank() - 1; ++d) {
      if (__builtin_mul_overflow(scores, shape[d], &scores) || scores > kMaxElements) {
        return true;
      }
    }
    return false;
  } catch (const attend::Error&) {
    return false;  // the CLI will refuse it too: a quick execution
  }
}

void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, file) != size) std::abort();
  if (std::fclose(file) != 0) std::abort();
}

void empty_work_directory() {
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(work_directory, ignored)) {
    fs::remove_all(entry.path(), ignored);
  }
}

void remove_work_directory() {
  std::error_code ignored;
  fs::remove_all(work_directory, ignored);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::string pattern = (fs::temp_directory_path() / "attend-cli-fuzz-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) std::abort();
  work_directory = pattern;
  std::atexit(remove_work_directory);
  verbose = std::getenv("ATTEND_FUZZ_VERBOSE") != nullptr;
  if (!verbose) std::cout.rdbuf(nullptr);  // writes then only set badbit
  std::cerr.rdbuf(error_output.rdbuf());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* separator = static_cast<const uint8_t*>(std::memchr(data, 0, size));
  const size_t options_size = separator ? static_cast<size_t>(separator - data) : size;
  const uint8_t* payload = separator ? separator + 1 : data + size;
  const size_t payload_size = static_cast<size_t>(data + size - payload);
  if (payload_too_large(payload, payload_size)) return -1;  // keep out of the corpus

  const std::string input_path = work_directory + "/f";
  write_file(input_path, payload, payload_size);
  std::vector<std::string> arguments = {"attend", "sdpa",     "--query", input_path,
                                        "--key",  input_path, "--value", input_path};
  for (std::string& token :
       option_tokens(std::string_view(reinterpret_cast<const char*>(data), options_size))) {
    arguments.push_back(std::move(token));
  }
  arguments.push_back("--out");
  arguments.push_back(work_directory + "/out.npy");

  std::vector<char*> argv;
  for (std::string& argument : arguments) argv.push_back(argument.data());
  argv.push_back(nullptr);
  const int status = attend_cli_main(static_cast<int>(arguments.size()), argv.data());
  if (status != 0 && status != 2) std::abort();
  const std::string errors = error_output.str();
  if (verbose) std::fwrite(errors.data(), 1, errors.size(), stderr);
  if (attend::test::first_unprintable_byte(errors) != std::string_view::npos) std::abort();
  error_output.str("");
  empty_work_directory();
  return 0;
}
