// test_support.hpp: helpers that the tests (and the fuzz targets) of several units share: a
// temporary directory, whole-file reads and writes, the check that a message is printable,
// seeded random inputs, a scoped cap on the SIMD dispatch. Plain C++, no GoogleTest.
#pragma once

#include <stdlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "attend/runtime.hpp"
#include "attend/tensor.hpp"

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

// `count` deterministic values uniform in [-magnitude, magnitude): std::mt19937 with `seed`,
// 24 bits each, so that every value is exact in float32 for a power-of-two magnitude.
inline std::vector<float> uniform_values(int64_t count, uint32_t seed, double magnitude = 1.0) {
  std::mt19937 random(seed);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) {
    const double unit = static_cast<double>(random() >> 8) / 16777216.0;  // [0, 1)
    v = static_cast<float>((2.0 * unit - 1.0) * magnitude);
  }
  return values;
}

// A contiguous tensor of `dtype` holding uniform_values(numel, seed, magnitude), rounded to
// float16 or bfloat16 when `dtype` is one of them.
inline Tensor random_tensor(const Shape& shape, uint32_t seed, double magnitude = 1.0,
                            DType dtype = DType::kFloat32) {
  const std::vector<float> values = uniform_values(shape.numel(), seed, magnitude);
  Tensor t(DType::kFloat32, shape);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(float));
  if (dtype == DType::kFloat32) return t;
  Tensor converted(dtype, shape);
  convert(t.view(), converted.view());
  return converted;
}

// Caps attend's SIMD dispatch at `target` (set_max_simd_target) while the object lives, then
// restores the cap that was there before: also when a failed assertion leaves the test early.
class ScopedSimdCap {
 public:
  explicit ScopedSimdCap(const std::string& target) : previous_(active_simd_target()) {
    set_max_simd_target(target);
  }
  // Capping at the best target that was allowed allows exactly what was allowed.
  ~ScopedSimdCap() { set_max_simd_target(previous_); }
  ScopedSimdCap(const ScopedSimdCap&) = delete;
  ScopedSimdCap& operator=(const ScopedSimdCap&) = delete;

 private:
  std::string previous_;
};

}  // namespace attend::test
