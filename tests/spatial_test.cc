// spatial_test: SpatialSelfAttention and PatchEmbedding against naive float64 versions
// written here from their definitions.
#include "attend/spatial.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"

namespace attend {
namespace {

Tensor pseudo_random(const Shape& shape, uint64_t seed) {
  Tensor t(DType::kFloat32, shape);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 3;
  for (int64_t i = 0; i < t.numel(); ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    t.data_as<float>()[i] = static_cast<float>(double(state >> 40) / double(1 << 23) - 1.0);
  }
  return t;
}

// Coarse error model: results are float32 chains at most `depth` long over terms bounded by
// `magnitude`, so |got - exact| <= 4·depth·u·magnitude. Prints the worst element.
void expect_close(const Tensor& got, const std::vector<double>& exact, double depth) {
  ASSERT_EQ(static_cast<size_t>(got.numel()), exact.size());
  double magnitude = 1;
  for (double e : exact) magnitude = std::max(magnitude, std::abs(e));
  const double tolerance = 4 * depth * std::ldexp(1.0, -24) * magnitude;
  double worst = 0;
  size_t worst_index = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double error = std::abs(got.data_as<float>()[i] - exact[i]);
    if (!(error <= worst)) {
      worst = error;
      worst_index = i;
    }
  }
  EXPECT_LE(worst, tolerance) << "worst element " << worst_index << ": got "
                              << got.data_as<float>()[worst_index] << ", expected "
                              << exact[worst_index] << ", tolerance " << tolerance;
}

// x + MHA(GroupNorm(x) as (N, HW, C)) back to (N, C, H, W), all in float64.
std::vector<double> naive_spatial(const SpatialSelfAttention& block, const Tensor& x,
                                  int64_t groups, int64_t heads, double eps) {
  const int64_t N = x.shape()[0], C = x.shape()[1], P = x.shape()[2] * x.shape()[3];
  const float* in = x.data_as<float>();
  std::vector<double> tokens(static_cast<size_t>(N * P * C));
  const int64_t per_group = groups ? C / groups : C;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t g = 0; g < C / per_group; ++g) {
      double mean = 0, variance = 0;
      const double count = double(per_group * P);
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c)
        for (int64_t p = 0; p < P; ++p) mean += in[(n * C + c) * P + p] / count;
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c)
        for (int64_t p = 0; p < P; ++p)
          variance += std::pow(in[(n * C + c) * P + p] - mean, 2) / count;
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c)
        for (int64_t p = 0; p < P; ++p) {
          const double v = in[(n * C + c) * P + p];
          tokens[static_cast<size_t>((n * P + p) * C + c)] =
              groups ? (v - mean) / std::sqrt(variance + eps) *
                               block.norm_weight().data_as<float>()[c] +
                           block.norm_bias().data_as<float>()[c]
                     : v;
        }
    }
  }
  const MultiHeadAttention& m = block.attention();
  const float* w_in = m.in_proj_weight().data_as<const float>();
  const float* b_in = m.in_proj_bias().data_as<const float>();
  const float* w_out = m.out_proj_weight().data_as<const float>();
  const float* b_out = m.out_proj_bias().data_as<const float>();
  const int64_t D = C / heads;
  std::vector<double> qkv(static_cast<size_t>(N * P * 3 * C));
  for (int64_t r = 0; r < N * P; ++r)
    for (int64_t j = 0; j < 3 * C; ++j) {
      double sum = b_in[j];
      for (int64_t k = 0; k < C; ++k)
        sum += tokens[static_cast<size_t>(r * C + k)] * w_in[j * C + k];
      qkv[static_cast<size_t>(r * 3 * C + j)] = sum;
    }
  std::vector<double> heads_out(static_cast<size_t>(N * P * C)), scores(static_cast<size_t>(P));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < P; ++i) {
        double largest = -1e300, total = 0;
        for (int64_t j = 0; j < P; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += qkv[static_cast<size_t>((n * P + i) * 3 * C + h * D + d)] *
                   qkv[static_cast<size_t>((n * P + j) * 3 * C + C + h * D + d)];
          scores[static_cast<size_t>(j)] = dot / std::sqrt(double(D));
          largest = std::max(largest, scores[static_cast<size_t>(j)]);
        }
        for (double& s : scores) total += (s = std::exp(s - largest));
        for (int64_t d = 0; d < D; ++d) {
          double sum = 0;
          for (int64_t j = 0; j < P; ++j)
            sum += scores[static_cast<size_t>(j)] / total *
                   qkv[static_cast<size_t>((n * P + j) * 3 * C + 2 * C + h * D + d)];
          heads_out[static_cast<size_t>((n * P + i) * C + h * D + d)] = sum;
        }
      }
  std::vector<double> out(static_cast<size_t>(N * C * P));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t c = 0; c < C; ++c) {
        double sum = b_out[c];
        for (int64_t k = 0; k < C; ++k)
          sum += heads_out[static_cast<size_t>((n * P + p) * C + k)] * w_out[c * C + k];
        out[static_cast<size_t>((n * C + c) * P + p)] = in[(n * C + c) * P + p] + sum;
      }
  return out;
}

TEST(SpatialSelfAttention, MatchesNaiveGroupNormAttentionResidual) {
  for (int64_t groups : {int64_t{8}, int64_t{0}}) {
    SpatialSelfAttention block(32, 4, {groups, 1e-5}, 3);
    // Non-trivial norm parameters and biases, so that each one is tested.
    if (groups) {
      const Tensor scale = pseudo_random(Shape({32}), 4), shift = pseudo_random(Shape({32}), 5);
      for (int c = 0; c < 32; ++c) {
        block.norm_weight().data_as<float>()[c] = 1.0f + 0.5f * scale.data_as<float>()[c];
        block.norm_bias().data_as<float>()[c] = shift.data_as<float>()[c];
      }
    }
    const Tensor bias = pseudo_random(Shape({3 * 32}), 6);
    for (int i = 0; i < 96; ++i)
      block.attention().in_proj_bias().data_as<float>()[i] = bias.data_as<float>()[i];
    const Tensor x = pseudo_random(Shape({2, 32, 4, 3}), 7);
    const Tensor got = block.forward(x.view());
    EXPECT_EQ(got.shape(), x.shape());
    expect_close(got, naive_spatial(block, x, groups, 4, 1e-5), 32 + 12 + 8 + 32 + 64);
  }
}

// More pixels than one block of the norm's transposition (64), a partial last block, an
// input that is not contiguous (the block copies it first), and the thread count.
TEST(SpatialSelfAttention, LargerImagesStridedInputsAndThreadCounts) {
  SpatialSelfAttention block(32, 4, {8, 1e-5}, 5);
  const Tensor scale = pseudo_random(Shape({32}), 8), shift = pseudo_random(Shape({32}), 9);
  for (int c = 0; c < 32; ++c) {
    block.norm_weight().data_as<float>()[c] = 1.0f + 0.5f * scale.data_as<float>()[c];
    block.norm_bias().data_as<float>()[c] = shift.data_as<float>()[c];
  }
  const Tensor x = pseudo_random(Shape({2, 32, 9, 10}), 10);  // 90 pixels
  const Tensor one = block.forward(x.view(), 1);
  expect_close(one, naive_spatial(block, x, 8, 4, 1e-5), 32 + 90 + 8 + 32 + 64);
  for (int threads : {2, 3}) {
    const Tensor many = block.forward(x.view(), threads);
    EXPECT_EQ(std::memcmp(one.data(), many.data(), one.nbytes()), 0) << threads << " threads";
  }
  // The same image stored (N, H, W, C) and viewed as (N, C, H, W).
  Tensor nhwc(DType::kFloat32, Shape({2, 9, 10, 32}));
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t c = 0; c < 32; ++c)
      for (int64_t p = 0; p < 90; ++p)
        nhwc.data_as<float>()[(n * 90 + p) * 32 + c] = x.data_as<float>()[(n * 32 + c) * 90 + p];
  const TensorView strided(nhwc.data(), DType::kFloat32, x.shape(),
                           Shape({90 * 32, 1, 10 * 32, 32}));
  const Tensor from_strided = block.forward(strided, 2);
  EXPECT_EQ(std::memcmp(one.data(), from_strided.data(), one.nbytes()), 0);
}

// A bfloat16 image runs the block in bfloat16 products and returns bfloat16 (where the CPU
// has them): against the float32 block on the same rounded image, within the multi-head
// test's rounding model (8·2^-9 of the attention's contribution's norm, here bounded by the
// output's) plus the output's own rounding (2^-9 relative).
TEST(SpatialSelfAttention, Bfloat16ImageInBfloat16Products) {
  if (bf16_compute_path().rfind("bfloat16", 0) != 0) {
    GTEST_SKIP() << "skipped: " << bf16_compute_path();
  }
  SpatialSelfAttention block(64, 4, {8, 1e-5}, 5);
  for (auto& [name, view] : block.attention().state_dict()) {  // a bfloat16 checkpoint
    Tensor rounded(DType::kBFloat16, view.shape);
    convert(view, rounded.view());
    convert(rounded.view(), view);
  }
  const Tensor x = pseudo_random(Shape({1, 64, 8, 12}), 11);  // 96 pixels
  Tensor x_bf16(DType::kBFloat16, x.shape()), widened(DType::kFloat32, x.shape());
  convert(x.view(), x_bf16.view());
  convert(x_bf16.view(), widened.view());
  const Tensor got = block.forward(x_bf16.view(), 2);
  ASSERT_EQ(got.dtype(), DType::kBFloat16);
  const Tensor expected = block.forward(widened.view(), 2);
  Tensor got32(DType::kFloat32, x.shape());
  convert(got.view(), got32.view());
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < got32.numel(); ++i) {
    const double e = expected.data_as<float>()[i], g = got32.data_as<float>()[i];
    diff += (g - e) * (g - e);
    norm += e * e;
  }
  EXPECT_LE(std::sqrt(diff / norm), 9.0 / 512);
  EXPECT_GT(diff, 0.0);
}

// A contiguous bfloat16 image is read in place, widened where it is read; any other layout
// through a float32 copy: the same bits either way (bfloat16 products or not).
TEST(SpatialSelfAttention, Bfloat16ImageReadInPlaceGivesTheCopysBits) {
  SpatialSelfAttention block(32, 4, {8, 1e-5}, 5);
  const Tensor x = pseudo_random(Shape({2, 32, 9, 10}), 12);
  Tensor x_bf16(DType::kBFloat16, x.shape());
  convert(x.view(), x_bf16.view());
  // The same bfloat16 image stored (N, H, W, C) and viewed as (N, C, H, W).
  Tensor nhwc(DType::kBFloat16, Shape({2, 9, 10, 32}));
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t c = 0; c < 32; ++c)
      for (int64_t p = 0; p < 90; ++p)
        nhwc.data_as<uint16_t>()[(n * 90 + p) * 32 + c] =
            x_bf16.data_as<uint16_t>()[(n * 32 + c) * 90 + p];
  const TensorView strided(nhwc.data(), DType::kBFloat16, x.shape(),
                           Shape({90 * 32, 1, 10 * 32, 32}));
  const Tensor in_place = block.forward(x_bf16.view(), 2);
  const Tensor copied = block.forward(strided, 2);
  ASSERT_EQ(in_place.dtype(), copied.dtype());
  ASSERT_EQ(in_place.nbytes(), copied.nbytes());
  EXPECT_EQ(std::memcmp(in_place.data(), copied.data(), in_place.nbytes()), 0);
}

TEST(SpatialSelfAttention, RejectsBadShapes) {
  EXPECT_THROW(SpatialSelfAttention(48, 4, {32, 1e-5}), Error);  // 32 does not divide 48
  const SpatialSelfAttention block(32, 4);
  const Tensor three_d = pseudo_random(Shape({2, 32, 9}), 1);
  EXPECT_THROW(block.forward(three_d.view()), Error);
  const Tensor wrong_channels = pseudo_random(Shape({1, 16, 2, 2}), 1);
  EXPECT_THROW(block.forward(wrong_channels.view()), Error);
}

TEST(PatchEmbedding, MatchesNaiveConvolutionWithTokens) {
  const int64_t N = 2, C = 3, H = 8, W = 12, p = 4, D = 10;
  for (bool class_token : {true, false}) {
    const PatchEmbedding embed(C, p, D, {class_token, true, H, W}, 9);
    const Tensor x = pseudo_random(Shape({N, C, H, W}), 2);
    const Tensor got = embed.forward(x.view());
    const int64_t patches = (H / p) * (W / p), first = class_token ? 1 : 0;
    ASSERT_EQ(got.shape(), Shape({N, first + patches, D}));
    const float* w = embed.projection_weight().data_as<const float>();
    const float* b = embed.projection_bias().data_as<const float>();
    const float* pos = embed.position_embeddings().data_as<const float>();
    std::vector<double> exact(static_cast<size_t>(got.numel()));
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t d = 0; d < D; ++d) {
        if (class_token) {
          exact[static_cast<size_t>(n * (1 + patches) * D + d)] =
              double{embed.class_token().data_as<const float>()[d]} + pos[d];
        }
        for (int64_t patch = 0; patch < patches; ++patch) {
          const int64_t py = patch / (W / p), px = patch % (W / p);
          double sum = b[d];
          for (int64_t c = 0; c < C; ++c)
            for (int64_t ky = 0; ky < p; ++ky)
              for (int64_t kx = 0; kx < p; ++kx)
                sum += double{w[((d * C + c) * p + ky) * p + kx]} *
                       x.data_as<float>()[((n * C + c) * H + py * p + ky) * W + px * p + kx];
          const int64_t token = first + patch;
          exact[static_cast<size_t>((n * (first + patches) + token) * D + d)] =
              sum + pos[token * D + d];
        }
      }
    }
    expect_close(got, exact, C * p * p + 4);
  }
}

TEST(PatchEmbedding, RejectsSizesItCannotHandle) {
  EXPECT_THROW(PatchEmbedding(3, 4, 8, {true, true, 0, 0}), Error);  // table needs a size
  const PatchEmbedding embed(3, 4, 8, {true, true, 8, 8});
  const Tensor other_size = pseudo_random(Shape({1, 3, 12, 8}), 1);
  EXPECT_THROW(embed.forward(other_size.view()), Error);
  const PatchEmbedding no_table(3, 4, 8, {false, false});
  const Tensor ragged = pseudo_random(Shape({1, 3, 10, 8}), 1);
  EXPECT_THROW(no_table.forward(ragged.view()), Error);
  const Tensor any_size = pseudo_random(Shape({1, 3, 12, 8}), 1);
  EXPECT_EQ(no_table.forward(any_size.view()).shape(), Shape({1, 6, 8}));
}

}  // namespace
}  // namespace attend
