// demo_common.hpp: what the scenes of `attend demo` share (demo_scenes.hpp; one file per
// scene, demo_*.cpp): text helpers, the seeded vocabulary and embeddings of the text scenes,
// per-head summaries, and the per-head heatmap picture.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "attend/multihead.hpp"
#include "attend/positional.hpp"
#include "attend/tensor.hpp"
#include "svg.hpp"

namespace attend::cli::demo {

template <typename... Args>
std::string formatted(const char* format, Args... args) {
  const int size = std::snprintf(nullptr, 0, format, args...);
  std::string text(static_cast<size_t>(std::max(size, 0)), '\0');
  std::snprintf(text.data(), text.size() + 1, format, args...);
  return text;
}

class Stopwatch {
 public:
  double milliseconds() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
        .count();
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// A deterministic value in [-1, 1) for (seed, index): splitmix64, no global state.
double hashed_uniform(uint64_t seed, uint64_t index);
// "[a, b, c]"
std::string joined(const std::vector<std::string>& words);
// Entropy (nats) of a row of weights, and its largest entry's index.
double entropy(const float* row, int64_t length);
int64_t argmax(const float* row, int64_t length);

inline constexpr uint64_t kSeed = 2024;
inline constexpr int64_t kTextDim = 256, kTextHeads = 8;

// The text scenes' words, and their embeddings (1, L, kTextDim) with sinusoidal positions.
const std::vector<std::string>& vocabulary();
Tensor embed(const TokenEmbedding& table, const std::vector<std::string>& tokens);

// For each head of weights (1, H, Lq, Lk): each query's most attended key with its weight, and
// the mean entropy of the rows against that of uniform weights over `real_keys` keys.
void print_head_summaries(std::ostream& out, const Tensor& weights,
                          const std::vector<std::string>& queries,
                          const std::vector<std::string>& keys, int64_t real_keys);
// "12.3 us" or "4.56 ms".
std::string milliseconds_text(double ms);

// Pictures.
inline constexpr double kTitleY = 26, kSubtitleY = 46;
void draw_titles(svg::Document& document, const std::string& title, const std::string& subtitle);
// The length of the longest label.
size_t longest(const std::vector<std::string>& labels);
// Per-head heatmaps of weights (1, H, Lq, Lk), four panels a row, rows labelled with the
// queries and columns with the keys, one colour scale (0 to the largest weight).
std::string per_head_figure(const std::string& title, const std::string& subtitle,
                            const Tensor& weights, const std::vector<std::string>& queries,
                            const std::vector<std::string>& keys);

}  // namespace attend::cli::demo
