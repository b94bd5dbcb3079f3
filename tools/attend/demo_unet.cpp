// demo_unet.cpp: scene 2 of `attend demo` (demo_scenes.hpp), the U-Net attention block.
#include "demo_scenes.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attend/sdpa.hpp"
#include "attend/spatial.hpp"
#include "demo_common.hpp"
#include "svg.hpp"

namespace attend::cli {
using namespace demo;

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

}  // namespace attend::cli
