// demo_scenes.cpp: the four scenes of `attend demo` (see demo_scenes.hpp).
//
// Every module is the library's own (MultiHeadAttention, SpatialSelfAttention, PatchEmbedding,
// TokenEmbedding, the sinusoidal encoding), initialized from fixed seeds; nothing is trained,
// so the pictures show how attention is computed and masked, not learned meaning.
#include "demo_scenes.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/multihead.hpp"
#include "attend/positional.hpp"
#include "attend/sdpa.hpp"
#include "attend/spatial.hpp"
#include "svg.hpp"

namespace attend::cli {
namespace {

// --- Small helpers ---------------------------------------------------------------------------

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
double hashed_uniform(uint64_t seed, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + index * 0xBF58476D1CE4E5B9ull + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) / 4503599627370496.0 - 1.0;  // 2^52
}

std::string joined(const std::vector<std::string>& words) {
  std::string text;
  for (const std::string& word : words) text += (text.empty() ? "" : ", ") + word;
  return "[" + text + "]";
}

// Entropy −Σ w·ln w of one row of weights, in nats.
double entropy(const float* row, int64_t length) {
  double sum = 0;
  for (int64_t j = 0; j < length; ++j) {
    if (row[j] > 0) sum -= double{row[j]} * std::log(double{row[j]});
  }
  return sum;
}

int64_t argmax(const float* row, int64_t length) {
  return std::max_element(row, row + length) - row;
}

constexpr uint64_t kSeed = 2024;
constexpr int64_t kTextDim = 256, kTextHeads = 8;

// One vocabulary for both languages of the text scenes.
const std::vector<std::string>& vocabulary() {
  static const std::vector<std::string> words = {"<pad>", "<bos>", "How",  "are", "you",
                                                 "?",     "Wie",   "geht", "es",  "dir"};
  return words;
}

// (1, L, dim) = embedding[ids(tokens)] + PE(0..L): the input of the first attention layer.
Tensor embed(const TokenEmbedding& table, const std::vector<std::string>& tokens) {
  const auto& words = vocabulary();
  Tensor ids(DType::kInt64, Shape({1, static_cast<int64_t>(tokens.size())}));
  for (size_t i = 0; i < tokens.size(); ++i) {
    const auto found = std::find(words.begin(), words.end(), tokens[i]);
    if (found == words.end())
      throw Error("demo: token '" + tokens[i] + "' is not in the vocabulary");
    ids.data_as<int64_t>()[i] = found - words.begin();
  }
  Tensor x = table.forward(ids.view());
  const Tensor encoding = sinusoidal_positional_encoding(ids.shape()[1], table.dim());
  add_positional_encoding(x.view(), encoding.view());
  return x;
}

// For each head of weights (1, H, Lq, Lk): each query's most attended key with its weight, and
// the mean entropy of the rows against that of uniform weights over `real_keys` keys.
void print_head_summaries(std::ostream& out, const Tensor& weights,
                          const std::vector<std::string>& queries,
                          const std::vector<std::string>& keys, int64_t real_keys) {
  const int64_t H = weights.shape()[1], Lq = weights.shape()[2], Lk = weights.shape()[3];
  for (int64_t h = 0; h < H; ++h) {
    std::string line = formatted("    head %lld:", static_cast<long long>(h));
    double mean_entropy = 0;
    for (int64_t i = 0; i < Lq; ++i) {
      const float* row = weights.data_as<float>() + (h * Lq + i) * Lk;
      const int64_t best = argmax(row, Lk);
      line += formatted("  %s→%s %.2f", queries[static_cast<size_t>(i)].c_str(),
                        keys[static_cast<size_t>(best)].c_str(), double{row[best]});
      mean_entropy += entropy(row, Lk) / static_cast<double>(Lq);
    }
    out << line
        << formatted("   entropy %.2f nats (uniform %.2f)\n", mean_entropy,
                     std::log(static_cast<double>(real_keys)));
  }
}

std::string milliseconds_text(double ms) {
  return ms < 1.0 ? formatted("%.1f us", ms * 1e3) : formatted("%.2f ms", ms);
}

// --- Pictures ---------------------------------------------------------------------------------

constexpr double kTitleY = 26, kSubtitleY = 46;

void draw_titles(svg::Document& document, const std::string& title, const std::string& subtitle) {
  svg::TextStyle title_style;
  title_style.size = 17;
  title_style.bold = true;
  document.text(16, kTitleY, title, title_style);
  svg::TextStyle subtitle_style;
  subtitle_style.size = 11;
  subtitle_style.fill = "#555555";
  document.text(16, kSubtitleY, subtitle, subtitle_style);
}

size_t longest(const std::vector<std::string>& labels) {
  size_t length = 0;
  for (const std::string& label : labels) length = std::max(length, label.size());
  return length;
}

// Per-head heatmaps of weights (1, H, Lq, Lk), four panels a row, rows labelled with the
// queries and columns with the keys, one colour scale (0 to the largest weight).
std::string per_head_figure(const std::string& title, const std::string& subtitle,
                            const Tensor& weights, const std::vector<std::string>& queries,
                            const std::vector<std::string>& keys) {
  const int64_t H = weights.shape()[1], Lq = weights.shape()[2], Lk = weights.shape()[3];
  constexpr double kCell = 44, kGap = 28, kPanelHeader = 48;
  const int64_t panels_per_row = std::min<int64_t>(H, 4);
  const int64_t panel_rows = (H + panels_per_row - 1) / panels_per_row;
  const double label_width = 10 + 7.5 * static_cast<double>(longest(queries));
  const double panel_width = label_width + kCell * static_cast<double>(Lk) + kGap;
  const double panel_height = kPanelHeader + kCell * static_cast<double>(Lq) + kGap;
  const double top = 64;
  const double width = 16 + panel_width * static_cast<double>(panels_per_row) + 90;
  const double height = top + panel_height * static_cast<double>(panel_rows) + 30;

  double largest = 0;
  for (int64_t e = 0; e < weights.numel(); ++e) {
    largest = std::max(largest, double{weights.data_as<float>()[e]});
  }
  svg::Document document(width, height);
  draw_titles(document, title, subtitle);
  for (int64_t h = 0; h < H; ++h) {
    svg::Heatmap map;
    map.title = formatted("head %lld", static_cast<long long>(h));
    map.rows = Lq;
    map.columns = Lk;
    map.values.assign(weights.data_as<float>() + h * Lq * Lk,
                      weights.data_as<float>() + (h + 1) * Lq * Lk);
    map.value_max = largest;
    map.row_labels = queries;
    map.column_labels = keys;
    map.show_values = true;
    const double x = 16 + label_width + panel_width * static_cast<double>(h % panels_per_row);
    const double y = top + kPanelHeader + panel_height * static_cast<double>(h / panels_per_row);
    svg::draw_heatmap(document, x, y, kCell, map);
  }
  svg::draw_colour_bar(document, width - 70, top + kPanelHeader, 14, 160, 0.0, largest, "weight",
                       2);
  svg::TextStyle note;
  note.size = 10;
  note.fill = "#777777";
  document.text(16, height - 10,
                "Rows: queries; columns: keys; each row sums to 1. Weights are seeded "
                "initializations, not trained.",
                note);
  return document.str();
}

// --- 1. "How are you?" ------------------------------------------------------------------------

}  // namespace

DemoPicture run_phrase_scene(const DemoSettings& settings, std::ostream& out) {
  const std::vector<std::string> tokens = {"How", "are", "you", "?"};
  out << "1. Self-attention over a phrase\n";
  const TokenEmbedding table(static_cast<int64_t>(vocabulary().size()), kTextDim, kSeed);
  const Tensor x = embed(table, tokens);
  out << "   tokens " << joined(tokens) << " -> embeddings + sinusoidal positions "
      << x.shape().str() << "\n";
  const MultiHeadAttention attention(kTextDim, kTextHeads, {}, kSeed + 1);
  MultiHeadForwardOptions options;
  options.need_weights = true;
  options.average_weights_over_heads = false;
  options.num_threads = settings.num_threads;
  // The first call starts the thread pool and touches fresh pages: time the second.
  (void)attention.forward(x.view(), x.view(), x.view(), options);
  const Stopwatch stopwatch;
  const MultiHeadResult result = attention.forward(x.view(), x.view(), x.view(), options);
  const double elapsed = stopwatch.milliseconds();
  out << formatted(
      "   MultiHeadAttention(256, 8 heads of 32): Q, K, V (1, 8, 4, 32) each; "
      "output %s, weights %s in %s (second call)\n",
      result.output.shape().str().c_str(), result.weights.shape().str().c_str(),
      milliseconds_text(elapsed).c_str());
  out << "   per head, each query's most attended key and weight:\n";
  print_head_summaries(out, result.weights, tokens, tokens, static_cast<int64_t>(tokens.size()));
  return {"phrase_self_attention.svg",
          per_head_figure("Self-attention over \"How are you?\"",
                          "MultiHeadAttention(256, 8 heads of 32) on token embeddings + "
                          "sinusoidal positional encoding (4 x 256)",
                          result.weights, tokens, tokens)};
}

// --- 2. The U-Net attention block --------------------------------------------------------------

namespace {

constexpr int64_t kMapChannels = 128, kMapSize = 64, kMapHeads = 4, kMapGroups = 32;
constexpr double kGroupNormEps = 1e-5;

struct Blob {
  double row, column, radius;
  const char* name;
};
constexpr std::array<Blob, 3> kBlobs = {{
    {18, 18, 6, "blob A"},
    {42, 46, 8, "blob B"},
    {48, 14, 5, "blob C"},
}};

// (1, C, 64, 64): three soft blobs, each with its own channel signature (what makes its pixels
// alike), over a background of slow waves whose direction and phase vary by channel.
Tensor synthetic_feature_map() {
  Tensor map(DType::kFloat32, Shape({1, kMapChannels, kMapSize, kMapSize}));
  float* data = map.data_as<float>();
  constexpr double kTwoPi = 6.283185307179586;
  for (int64_t c = 0; c < kMapChannels; ++c) {
    const auto u = static_cast<uint64_t>(c);
    const double frequency_x = 1 + 1.5 * (hashed_uniform(1, u) + 1);
    const double frequency_y = 1 + 1.5 * (hashed_uniform(2, u) + 1);
    const double phase = kTwoPi * hashed_uniform(3, u);
    for (int64_t y = 0; y < kMapSize; ++y) {
      for (int64_t x = 0; x < kMapSize; ++x) {
        double value = 0.5 * std::sin(kTwoPi *
                                          (frequency_x * static_cast<double>(x) +
                                           frequency_y * static_cast<double>(y)) /
                                          kMapSize +
                                      phase);
        for (size_t b = 0; b < kBlobs.size(); ++b) {
          const double dy = static_cast<double>(y) - kBlobs[b].row;
          const double dx = static_cast<double>(x) - kBlobs[b].column;
          const double bump =
              std::exp(-(dx * dx + dy * dy) / (2 * kBlobs[b].radius * kBlobs[b].radius));
          value += 2.0 * hashed_uniform(10 + b, u) * bump;
        }
        data[(c * kMapSize + y) * kMapSize + x] = static_cast<float>(value);
      }
    }
  }
  return map;
}

// The block's first step, repeated here to get its attention input: GroupNorm of x
// (1, C, H, W) with the block's affine parameters, as tokens (1, H·W, C).
Tensor group_norm_tokens(const Tensor& x, const SpatialSelfAttention& block) {
  const int64_t C = x.shape()[1], pixels = x.shape()[2] * x.shape()[3];
  const int64_t group_channels = C / kMapGroups;
  const float* in = x.data_as<float>();
  const float* gamma = block.norm_weight().data_as<const float>();
  const float* beta = block.norm_bias().data_as<const float>();
  Tensor tokens(DType::kFloat32, Shape({1, pixels, C}));
  float* out = tokens.data_as<float>();
  for (int64_t first = 0; first < C; first += group_channels) {
    double sum = 0, sum_squares = 0;
    for (int64_t e = first * pixels; e < (first + group_channels) * pixels; ++e) {
      sum += in[e];
      sum_squares += double{in[e]} * in[e];
    }
    const auto count = static_cast<double>(group_channels * pixels);
    const double mean = sum / count;
    const double inverse_std =
        1.0 / std::sqrt(std::max(0.0, sum_squares / count - mean * mean) + kGroupNormEps);
    for (int64_t c = first; c < first + group_channels; ++c) {
      for (int64_t p = 0; p < pixels; ++p) {
        out[p * C + c] =
            static_cast<float>((in[c * pixels + p] - mean) * inverse_std * gamma[c] + beta[c]);
      }
    }
  }
  return tokens;
}

struct QueryPixel {
  int64_t row, column;
  std::string where;
};

std::string unet_figure(const Tensor& feature_map, const std::vector<QueryPixel>& queries,
                        const Tensor& weights /* (1, Q, H·W), averaged over heads */) {
  constexpr double kCell = 3.5, kGap = 46, kTop = 100;
  const double panel = kCell * kMapSize;
  const auto panels = static_cast<double>(queries.size() + 1);
  svg::Document document(16 + (panel + kGap) * panels + 70, kTop + panel + 70);
  draw_titles(document, "U-Net attention block: where a pixel looks",
              "SpatialSelfAttention(128 channels, 4 heads of 32) on a (1, 128, 64, 64) feature "
              "map: 4096 positions. Weights averaged over heads; ring = query pixel, at (row, "
              "column) from the top left.");

  // Panel 0: the input, channel 0, on its own scale.
  svg::Heatmap input;
  input.title = "input, channel 0";
  input.rows = input.columns = kMapSize;
  input.values.assign(feature_map.data_as<float>(),
                      feature_map.data_as<float>() + kMapSize * kMapSize);
  input.value_min = *std::min_element(input.values.begin(), input.values.end());
  input.value_max = *std::max_element(input.values.begin(), input.values.end());
  input.colour_levels = 32;
  for (const Blob& blob : kBlobs) {
    input.markers.push_back({static_cast<int64_t>(blob.row), static_cast<int64_t>(blob.column)});
  }
  svg::draw_heatmap(document, 16, kTop, kCell, input);
  // Each blob's name and centre, (row, column), on a dark tag beside its ring: right of it, or
  // left where the tag would leave the panel.
  svg::TextStyle tag;
  tag.size = 10;
  tag.bold = true;
  tag.fill = "#ffffff";
  for (const Blob& blob : kBlobs) {
    const std::string text = formatted("%s (%.0f, %.0f)", blob.name, blob.row, blob.column);
    const double width = 6.2 * static_cast<double>(text.size()) + 6;
    const double cx = 16 + kCell * (blob.column + 0.5), cy = kTop + kCell * (blob.row + 0.5);
    const double left = cx + 9 + width <= 16 + panel ? cx + 9 : cx - 9 - width;
    document.rect(left, cy - 8, width, 15, "#222222");
    document.text(left + 3, cy + 3.5, text, tag);
  }
  svg::TextStyle axes;
  axes.size = 10;
  axes.fill = "#555555";
  document.text(16, kTop + panel + 16, "(row, column): row 0-63 down, column 0-63 across", axes);

  const int64_t pixels = kMapSize * kMapSize;
  double largest = 0;
  for (size_t q = 0; q < queries.size(); ++q) {
    svg::Heatmap map;
    map.title = formatted("query (%lld, %lld), %s", static_cast<long long>(queries[q].row),
                          static_cast<long long>(queries[q].column), queries[q].where.c_str());
    map.rows = map.columns = kMapSize;
    const float* row = weights.data_as<float>() + static_cast<int64_t>(q) * pixels;
    map.values.assign(row, row + pixels);
    map.value_max = *std::max_element(map.values.begin(), map.values.end());
    largest = std::max(largest, map.value_max);
    map.colour_levels = 32;
    map.markers = {{queries[q].row, queries[q].column}};
    const double x = 16 + (panel + kGap) * static_cast<double>(q + 1);
    svg::draw_heatmap(document, x, kTop, kCell, map);
    svg::TextStyle note;
    note.size = 10;
    note.fill = "#555555";
    document.text(x, kTop + panel + 16,
                  "0 to " + svg::format_number(map.value_max) + " (uniform " +
                      svg::format_number(1.0 / static_cast<double>(pixels)) + ")",
                  note);
  }
  svg::draw_colour_bar(document, document.width() - 60, kTop, 14, panel, 0, 1,
                       "fraction of panel max", 2);
  svg::TextStyle note;
  note.size = 10;
  note.fill = "#777777";
  document.text(16, document.height() - 12,
                "Each panel is scaled to its own maximum. Weights are seeded initializations, not "
                "trained; structure comes from the input's blobs and waves.",
                note);
  return document.str();
}

}  // namespace

DemoPicture run_unet_scene(const DemoSettings& settings, std::ostream& out) {
  out << "2. The attention block of a denoising U-Net\n";
  const Tensor feature_map = synthetic_feature_map();
  SpatialAttentionOptions block_options;
  block_options.group_norm_groups = kMapGroups;
  block_options.eps = kGroupNormEps;
  const SpatialSelfAttention block(kMapChannels, kMapHeads, block_options, kSeed + 2);
  const int64_t pixels = kMapSize * kMapSize, head_dim = kMapChannels / kMapHeads;
  out << formatted(
      "   feature map %s (synthetic: soft blobs over slow waves) -> %lld positions "
      "of %lld channels, %lld heads of %lld\n",
      feature_map.shape().str().c_str(), static_cast<long long>(pixels),
      static_cast<long long>(kMapChannels), static_cast<long long>(kMapHeads),
      static_cast<long long>(head_dim));
  const Stopwatch stopwatch;
  const Tensor block_output = block.forward(feature_map.view(), settings.num_threads);
  const double elapsed = stopwatch.milliseconds();
  const double flops = attention_flops(kMapHeads, pixels, pixels, head_dim, head_dim, false);
  out << formatted(
      "   SpatialSelfAttention forward (GroupNorm, projections, attention over all "
      "%lld positions per head, residual): %s -> %s in %s (attention alone %.1f "
      "GFLOP)\n",
      static_cast<long long>(pixels), feature_map.shape().str().c_str(),
      block_output.shape().str().c_str(), milliseconds_text(elapsed).c_str(), flops * 1e-9);

  // Weights for a few query pixels only: their rows of the (4, 4096, 4096) weights, computed by
  // the block's own attention module on the block's normalized tokens.
  const std::vector<QueryPixel> queries = {
      {18, 18, "in blob A"}, {42, 46, "in blob B"}, {48, 14, "in blob C"}, {8, 56, "background"}};
  const Tensor tokens = group_norm_tokens(feature_map, block);
  const auto query_count = static_cast<int64_t>(queries.size());
  Tensor query_tokens(DType::kFloat32, Shape({1, query_count, kMapChannels}));
  for (int64_t q = 0; q < query_count; ++q) {
    const QueryPixel& pixel = queries[static_cast<size_t>(q)];
    std::copy_n(tokens.data_as<float>() + (pixel.row * kMapSize + pixel.column) * kMapChannels,
                kMapChannels, query_tokens.data_as<float>() + q * kMapChannels);
  }
  MultiHeadForwardOptions options;
  options.need_weights = true;
  options.average_weights_over_heads = false;
  options.num_threads = settings.num_threads;
  const Stopwatch rows_stopwatch;
  const MultiHeadResult rows =
      block.attention().forward(query_tokens.view(), tokens.view(), tokens.view(), options);
  out << formatted(
      "   weights of %lld query pixels only: %s in %s (not the full (1, 4, 4096, "
      "4096), 256 MiB)\n",
      static_cast<long long>(query_count), rows.weights.shape().str().c_str(),
      milliseconds_text(rows_stopwatch.milliseconds()).c_str());

  // They must reproduce the block's output at those pixels: out(c, p) = x(c, p) + attended(p, c).
  double largest_difference = 0;
  for (int64_t q = 0; q < query_count; ++q) {
    const QueryPixel& pixel = queries[static_cast<size_t>(q)];
    const int64_t p = pixel.row * kMapSize + pixel.column;
    for (int64_t c = 0; c < kMapChannels; ++c) {
      const double expected = double{block_output.data_as<float>()[c * pixels + p]} -
                              feature_map.data_as<float>()[c * pixels + p];
      largest_difference =
          std::max(largest_difference,
                   std::abs(expected - rows.output.data_as<float>()[q * kMapChannels + c]));
    }
  }
  out << formatted(
      "   check: these rows reproduce the block's output at those pixels (largest "
      "difference %.1e)\n",
      largest_difference);

  // Per head: the most attended pixel, its weight and the entropy (uniform: ln 4096 = 8.32).
  Tensor averaged = Tensor::zeros(DType::kFloat32, Shape({1, query_count, pixels}));
  for (int64_t q = 0; q < query_count; ++q) {
    const QueryPixel& pixel = queries[static_cast<size_t>(q)];
    std::string line = formatted("   query (%2lld, %2lld) %-10s", static_cast<long long>(pixel.row),
                                 static_cast<long long>(pixel.column), pixel.where.c_str());
    for (int64_t h = 0; h < kMapHeads; ++h) {
      const float* row = rows.weights.data_as<float>() + (h * query_count + q) * pixels;
      const int64_t best = argmax(row, pixels);
      line += formatted(" | head %lld -> (%2lld, %2lld) %.1e, entropy %.2f",
                        static_cast<long long>(h), static_cast<long long>(best / kMapSize),
                        static_cast<long long>(best % kMapSize), double{row[best]},
                        entropy(row, pixels));
      for (int64_t p = 0; p < pixels; ++p) {
        averaged.data_as<float>()[q * pixels + p] += row[p] / static_cast<float>(kMapHeads);
      }
    }
    out << line << "\n";
  }
  out << formatted("   (uniform weights would be %.1e each, entropy %.2f nats)\n",
                   1.0 / static_cast<double>(pixels), std::log(static_cast<double>(pixels)));
  return {"unet_attention.svg", unet_figure(feature_map, queries, averaged)};
}

// --- 3. A vision transformer ---------------------------------------------------------------------

namespace {

constexpr int64_t kImageSize = 32, kPatch = 8, kVitDim = 64, kVitHeads = 4;
constexpr int64_t kPatchesPerSide = kImageSize / kPatch;

// (1, 3, 32, 32) RGB in [0, 1]: a landscape drawn so that no two 8 × 8 patches look alike
// (a plain sky would make whole rows of patches, and so of weights, the same): a sky gradient
// with a cloud and a sun, a house with a roof, window and door, a tree, a pond, and grass with
// flowers.
Tensor synthetic_image() {
  Tensor image(DType::kFloat32, Shape({1, 3, kImageSize, kImageSize}));
  float* data = image.data_as<float>();
  const int64_t plane = kImageSize * kImageSize;
  for (int64_t y = 0; y < kImageSize; ++y) {
    for (int64_t x = 0; x < kImageSize; ++x) {
      const auto fy = static_cast<double>(y), fx = static_cast<double>(x);
      const double t = fy / kImageSize;
      std::array<double, 3> rgb = {0.25 + 0.5 * t, 0.45 + 0.35 * t, 0.95 - 0.1 * t};  // sky
      if (std::hypot((fy - 5) * 1.8, fx - 9) < 6) rgb = {0.97, 0.97, 0.97};           // cloud
      if (std::hypot(fy - 6, fx - 26) < 4.5) rgb = {1.0, 0.85, 0.2};                  // sun
      if (y >= 20) {  // grass, darker stripes, flowers
        rgb = {0.2, 0.55 + 0.15 * std::sin(fx * 1.3 + fy), 0.18};
        if ((x * 7 + y * 3) % 11 == 0) rgb = {0.95, 0.3, 0.6};
      }
      if (std::hypot((fy - 27) * 1.6, fx - 24) < 6) rgb = {0.1, 0.3, 0.8};  // pond
      if (y >= 11 && y < 14 && x >= 3 + (13 - y) && x < 15 - (13 - y)) {
        rgb = {0.45, 0.12, 0.1};  // roof
      }
      if (y >= 14 && y < 24 && x >= 4 && x < 14) rgb = {0.8, 0.25, 0.15};  // wall
      if (y >= 16 && y < 19 && x >= 5 && x < 8) rgb = {0.7, 0.9, 1.0};     // window
      if (y >= 18 && y < 24 && x >= 10 && x < 13) rgb = {0.35, 0.2, 0.1};  // door
      if (y >= 17 && y < 26 && x >= 18 && x < 20) rgb = {0.4, 0.25, 0.1};  // trunk
      if (std::hypot(fy - 14, fx - 19) < 5) rgb = {0.05, 0.35 + 0.1 * std::sin(fx * fy), 0.1};
      for (int64_t c = 0; c < 3; ++c) {
        data[c * plane + y * kImageSize + x] = static_cast<float>(rgb[static_cast<size_t>(c)]);
      }
    }
  }
  return image;
}

// The pre-norm of a transformer block, LayerNorm without its affine part, over each row of
// x (..., D) in place: (x − mean) / sqrt(variance + 1e-5). Without it the class token (drawn
// N(0, 0.02²), as ViT does) would be so short that its query sees every key alike.
void layer_norm_rows(Tensor& x) {
  const int64_t features = x.shape().back(0), rows = x.numel() / features;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x.data_as<float>() + r * features;
    double sum = 0, sum_squares = 0;
    for (int64_t e = 0; e < features; ++e) {
      sum += row[e];
      sum_squares += double{row[e]} * row[e];
    }
    const double mean = sum / static_cast<double>(features);
    const double variance =
        std::max(0.0, sum_squares / static_cast<double>(features) - mean * mean);
    const double inverse_std = 1.0 / std::sqrt(variance + 1e-5);
    for (int64_t e = 0; e < features; ++e) {
      row[e] = static_cast<float>((row[e] - mean) * inverse_std);
    }
  }
}

std::string rgb_colour(const Tensor& image, int64_t y, int64_t x) {
  const int64_t plane = kImageSize * kImageSize;
  int channel[3];
  for (int64_t c = 0; c < 3; ++c) {
    const double value = image.data_as<float>()[c * plane + y * kImageSize + x];
    channel[c] = static_cast<int>(std::lround(std::clamp(value, 0.0, 1.0) * 255));
  }
  return formatted("#%02x%02x%02x", channel[0], channel[1], channel[2]);
}

// The image with its patch grid, then per head (and averaged) the class token's weights over
// the 4 × 4 patches. class_weights: (H + 1, 16), the last row the mean over heads.
std::string vit_figure(const Tensor& image, const std::vector<std::vector<double>>& class_weights) {
  constexpr double kPixel = 5, kCell = 40, kGap = 40, kTop = 90;
  const double panel = kPixel * kImageSize;
  const auto panels = static_cast<double>(class_weights.size() + 1);
  svg::Document document(16 + (panel + kGap) * panels + 70, kTop + panel + 56);
  draw_titles(document, "Vision transformer: what the class token attends to",
              "(1, 3, 32, 32) image -> 16 patches of 8 x 8 + class token, 64 features -> "
              "MultiHeadAttention(64, 4 heads of 16); weights of the class token over patches");
  svg::TextStyle style;
  style.size = 13;
  style.bold = true;
  style.anchor = svg::Anchor::kMiddle;
  document.text(16 + panel / 2, kTop - 10, "input and patches", style);
  for (int64_t y = 0; y < kImageSize; ++y) {
    for (int64_t x = 0; x < kImageSize; ++x) {
      document.rect(16 + kPixel * static_cast<double>(x), kTop + kPixel * static_cast<double>(y),
                    kPixel + 0.3, kPixel + 0.3, rgb_colour(image, y, x));
    }
  }
  for (int64_t i = 0; i <= kPatchesPerSide; ++i) {
    const double offset = kPixel * kPatch * static_cast<double>(i);
    document.line(16 + offset, kTop, 16 + offset, kTop + panel, "#ffffff", 1);
    document.line(16, kTop + offset, 16 + panel, kTop + offset, "#ffffff", 1);
  }
  // One colour scale for every panel, from the smallest weight to the largest: weights near
  // the uniform 1/17 would all look alike on a scale from 0.
  double smallest = 1, largest = 0;
  for (const auto& weights : class_weights) {
    smallest = std::min(smallest, *std::min_element(weights.begin(), weights.end()));
    largest = std::max(largest, *std::max_element(weights.begin(), weights.end()));
  }
  for (size_t h = 0; h < class_weights.size(); ++h) {
    svg::Heatmap map;
    map.title =
        h + 1 == class_weights.size() ? std::string("mean over heads") : formatted("head %zu", h);
    map.rows = map.columns = kPatchesPerSide;
    map.values = class_weights[h];
    map.value_min = smallest;
    map.value_max = largest;
    map.show_values = true;
    map.value_decimals = 3;  // near 1/17: 0.057 and 0.064 differ, 0.06 and 0.06 would not
    svg::draw_heatmap(document, 16 + (panel + kGap) * static_cast<double>(h + 1), kTop, kCell, map);
  }
  svg::draw_colour_bar(document, document.width() - 60, kTop, 14, panel, smallest, largest,
                       "weight", 2);
  svg::TextStyle note;
  note.size = 10;
  note.fill = "#777777";
  document.text(16, document.height() - 12,
                "Colours run from the smallest weight shown to the largest (uniform: 1/17 = "
                "0.059); the rest of each row goes to the class token itself. Weights are "
                "seeded initializations, not trained.",
                note);
  return document.str();
}

}  // namespace

DemoPicture run_vit_scene(const DemoSettings& settings, std::ostream& out) {
  out << "3. A vision transformer: image patches as tokens\n";
  const Tensor image = synthetic_image();
  PatchEmbeddingOptions patch_options;
  patch_options.image_height = kImageSize;
  patch_options.image_width = kImageSize;
  const PatchEmbedding patches(3, kPatch, kVitDim, patch_options, kSeed + 3);
  Tensor tokens = patches.forward(image.view(), settings.num_threads);
  const int64_t count = tokens.shape()[1];
  out << formatted(
      "   image %s (synthetic: sky, cloud, sun, house, tree, pond, grass) -> %lld patches of %lld "
      "x "
      "%lld + class token -> tokens %s\n",
      image.shape().str().c_str(), static_cast<long long>(kPatchesPerSide * kPatchesPerSide),
      static_cast<long long>(kPatch), static_cast<long long>(kPatch), tokens.shape().str().c_str());
  layer_norm_rows(tokens);
  out << "   pre-norm: LayerNorm of each token (no affine), as a ViT block starts\n";
  const MultiHeadAttention attention(kVitDim, kVitHeads, {}, kSeed + 4);
  MultiHeadForwardOptions options;
  options.need_weights = true;
  options.average_weights_over_heads = false;
  options.num_threads = settings.num_threads;
  const Stopwatch stopwatch;
  const MultiHeadResult result =
      attention.forward(tokens.view(), tokens.view(), tokens.view(), options);
  out << formatted("   MultiHeadAttention(64, 4 heads of 16): output %s, weights %s in %s\n",
                   result.output.shape().str().c_str(), result.weights.shape().str().c_str(),
                   milliseconds_text(stopwatch.milliseconds()).c_str());

  // Row 0 of each head: the class token's weights; keys 1..16 are the patches.
  std::vector<std::vector<double>> class_weights(static_cast<size_t>(kVitHeads + 1));
  std::vector<double>& mean = class_weights.back();
  mean.assign(static_cast<size_t>(count - 1), 0.0);
  for (int64_t h = 0; h < kVitHeads; ++h) {
    const float* row = result.weights.data_as<float>() + h * count * count;
    class_weights[static_cast<size_t>(h)].assign(row + 1, row + count);
    const int64_t best = argmax(row + 1, count - 1);
    for (int64_t p = 0; p + 1 < count; ++p) {
      mean[static_cast<size_t>(p)] += row[p + 1] / static_cast<double>(kVitHeads);
    }
    out << formatted(
        "    head %lld: class token -> patch (%lld, %lld) %.3f, itself %.3f, "
        "entropy %.2f nats (uniform %.2f)\n",
        static_cast<long long>(h), static_cast<long long>(best / kPatchesPerSide),
        static_cast<long long>(best % kPatchesPerSide), double{row[best + 1]}, double{row[0]},
        entropy(row, count), std::log(static_cast<double>(count)));
  }
  out << "   class token's weights over the 4 x 4 patch grid, mean over heads:\n";
  for (int64_t r = 0; r < kPatchesPerSide; ++r) {
    std::string line = "     ";
    for (int64_t c = 0; c < kPatchesPerSide; ++c) {
      line += formatted(" %.3f", mean[static_cast<size_t>(r * kPatchesPerSide + c)]);
    }
    out << line << "\n";
  }
  return {"vit_attention.svg", vit_figure(image, class_weights)};
}

// --- 4. Encoder-decoder ------------------------------------------------------------------------

DemoPicture run_translation_scene(const DemoSettings& settings, std::ostream& out) {
  out << "4. Encoder-decoder: \"Wie geht es dir\" -> \"How are you\"\n";
  // The source is padded to 6 as in a batch of sentences; the mask (nonzero = real token)
  // keeps every query off the padding.
  const std::vector<std::string> source = {"Wie", "geht", "es", "dir", "<pad>", "<pad>"};
  const std::vector<std::string> target = {"<bos>", "How", "are", "you"};
  constexpr int64_t kRealSourceTokens = 4;
  const auto source_length = static_cast<int64_t>(source.size());
  const TokenEmbedding table(static_cast<int64_t>(vocabulary().size()), kTextDim, kSeed);
  Tensor source_mask(DType::kUInt8, Shape({1, source_length}));
  for (int64_t j = 0; j < source_length; ++j) {
    source_mask.data_as<uint8_t>()[j] = j < kRealSourceTokens ? 1 : 0;
  }
  const MultiHeadAttention encoder_self(kTextDim, kTextHeads, {}, kSeed + 5);
  const MultiHeadAttention decoder_self(kTextDim, kTextHeads, {}, kSeed + 6);
  const MultiHeadAttention cross(kTextDim, kTextHeads, {}, kSeed + 7);
  MultiHeadForwardOptions options;
  options.num_threads = settings.num_threads;
  options.need_weights = true;
  options.average_weights_over_heads = false;

  // Each block is one attention sub-layer with its residual (no feed-forward or LayerNorm:
  // they do not change what the attention does).
  const auto add = [](Tensor& sum, const Tensor& term) {
    for (int64_t e = 0; e < sum.numel(); ++e) sum.data_as<float>()[e] += term.data_as<float>()[e];
  };
  const Stopwatch stopwatch;
  Tensor memory = embed(table, source);
  MultiHeadForwardOptions encoder_options = options;
  encoder_options.key_padding_mask = source_mask.view();
  const MultiHeadResult encoded =
      encoder_self.forward(memory.view(), memory.view(), memory.view(), encoder_options);
  add(memory, encoded.output);
  out << formatted(
      "   encoder: %s %s -> self-attention with key padding mask (1, 6) -> memory %s\n",
      joined(source).c_str(), embed(table, source).shape().str().c_str(),
      memory.shape().str().c_str());

  Tensor decoded = embed(table, target);
  MultiHeadForwardOptions decoder_options = options;
  decoder_options.causal = true;
  const MultiHeadResult masked_self =
      decoder_self.forward(decoded.view(), decoded.view(), decoded.view(), decoder_options);
  add(decoded, masked_self.output);
  double above_diagonal = 0;
  const int64_t target_length = static_cast<int64_t>(target.size());
  for (int64_t h = 0; h < kTextHeads; ++h) {
    for (int64_t i = 0; i < target_length; ++i) {
      for (int64_t j = i + 1; j < target_length; ++j) {
        above_diagonal = std::max(
            above_diagonal,
            double{
                masked_self.weights.data_as<float>()[(h * target_length + i) * target_length + j]});
      }
    }
  }
  out << formatted(
      "   decoder: %s %s -> causal self-attention (largest weight on a later "
      "token: %g)\n",
      joined(target).c_str(), decoded.shape().str().c_str(), above_diagonal);

  MultiHeadForwardOptions cross_options = options;
  cross_options.key_padding_mask = source_mask.view();
  const MultiHeadResult crossed =
      cross.forward(decoded.view(), memory.view(), memory.view(), cross_options);
  const double elapsed = stopwatch.milliseconds();
  double on_padding = 0;
  for (int64_t row = 0; row < kTextHeads * target_length; ++row) {
    for (int64_t j = kRealSourceTokens; j < source_length; ++j) {
      on_padding =
          std::max(on_padding, double{crossed.weights.data_as<float>()[row * source_length + j]});
    }
  }
  out << formatted(
      "   cross-attention: queries %s from the decoder, keys and values %s from "
      "the encoder -> output %s, weights %s (largest weight on <pad>: %g)\n",
      decoded.shape().str().c_str(), memory.shape().str().c_str(),
      crossed.output.shape().str().c_str(), crossed.weights.shape().str().c_str(), on_padding);
  out << "   three attention layers in " << milliseconds_text(elapsed) << "\n";
  out << "   per head, the German word each English position attends most:\n";
  print_head_summaries(out, crossed.weights, target, source, kRealSourceTokens);
  return {"cross_attention.svg",
          per_head_figure("Cross-attention: English queries over the German encoder output",
                          "Encoder self-attention over [Wie, geht, es, dir] (padded to 6), "
                          "decoder causal self-attention, then MultiHeadAttention(256, 8) with "
                          "a source key padding mask",
                          crossed.weights, target, source)};
}

}  // namespace attend::cli
