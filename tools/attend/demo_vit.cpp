// demo_vit.cpp: scene 3 of `attend demo` (demo_scenes.hpp), a vision transformer front.
#include "demo_scenes.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attend/multihead.hpp"
#include "attend/spatial.hpp"
#include "demo_common.hpp"
#include "svg.hpp"

namespace attend::cli {
using namespace demo;

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

}  // namespace attend::cli
