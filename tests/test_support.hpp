// test_support.hpp: helpers that the tests (and the fuzz targets) of several units share: a
// temporary directory, whole-file reads and writes, the check that a message is printable.
// Plain C++, no GoogleTest.
#pragma once

#include <stdlib.h>

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace attend::test {

// A fresh, empty directory under the system's temporary directory, removed with everything in
// it when the object is destroyed.
class TemporaryDirectory {
 public:
  TemporaryDirectory() {
    std::string pattern = (std::filesystem::temp_directory_path() / "attend_test_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TemporaryDirectory() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TemporaryDirectory(const TemporaryDirectory&) = delete;
  TemporaryDirectory& operator=(const TemporaryDirectory&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // The path of `name` inside the directory.
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  // The names of the entries in the directory, sorted.
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(path_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::filesystem::path path_;
};

// The whole file as bytes ("" when it cannot be read).
inline std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Creates or replaces the file at `path` with `bytes`.
inline void write_file_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// The position of the first byte of `message` that may not reach a terminal (below 0x20 except
// '\n', or 0x7f and above: control characters, escape sequences, anything not ASCII), or
// std::string_view::npos when there is none. Every attend::Error message and every line the
// CLI prints must pass (src/quote.hpp).
inline size_t first_unprintable_byte(std::string_view message) {
  for (size_t i = 0; i < message.size(); ++i) {
    const auto byte = static_cast<unsigned char>(message[i]);
    if ((byte < 0x20 && byte != '\n') || byte >= 0x7f) return i;
  }
  return std::string_view::npos;
}

}  // namespace attend::test
