// spatial.cpp: SpatialSelfAttention (U-Net attention block) and PatchEmbedding (ViT front).
#include "attend/spatial.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "boundary/operands.hpp"
#include "half.hpp"
#include "kernels/gemm.hpp"
#include "multihead/parameter_init.hpp"

namespace attend {
namespace {

// Validates a 4-D (N, C, H, W) input of `channels` channels.
void check_image(const char* who, const TensorView& x, int64_t channels) {
  if (x.rank() != 4) {
    throw Error(std::string(who) + ": input " + x.shape.str() + " should be (N, C, H, W)");
  }
  if (x.strides.rank() != 4) {
    throw Error(std::string(who) + ": strides " + x.strides.str() + " do not match shape " +
                x.shape.str());
  }
  if (!detail::is_attention_float(x.dtype)) {
    throw Error(std::string(who) + ": dtype " + dtype_name(x.dtype) +
                " is not supported (float32, float16 or bfloat16)");
  }
  if (x.shape[1] != channels) {
    throw Error(std::string(who) + ": input " + x.shape.str() + " has " +
                std::to_string(x.shape[1]) + " channels, expected " + std::to_string(channels));
  }
}

// A contiguous float32 copy of a 4-D (N, C, H, W) input, validated.
Tensor contiguous_image(const char* who, const TensorView& x, int64_t channels) {
  check_image(who, x, channels);
  Tensor image(DType::kFloat32, x.shape);
  convert(x, image.view());
  return image;
}

// The same input's data as contiguous float32: x's own when it already is, else a copy
// kept alive in `copy`.
const float* float32_image(const char* who, const TensorView& x, int64_t channels,
                           std::optional<Tensor>& copy) {
  check_image(who, x, channels);
  if (x.dtype == DType::kFloat32 && x.is_contiguous()) {
    if (x.data == nullptr && x.numel() > 0) {
      throw Error(std::string(who) + ": data pointer is null for shape " + x.shape.str());
    }
    return x.data_as<const float>();
  }
  copy = contiguous_image(who, x, channels);
  return copy->data_as<const float>();
}

// An input element as float32 (exact).
float widened(float x) { return x; }
float widened(uint16_t x) { return detail::f32_from_bf16(x); }

// x as stored in an element of `dst`: float32 as it is, bfloat16 rounded as convert rounds.
float rounded_to(const float*, float x) { return x; }
uint16_t rounded_to(const uint16_t*, float x) { return detail::bf16_from_f32(x); }

}  // namespace

SpatialSelfAttention::SpatialSelfAttention(int64_t channels, int64_t num_heads,
                                           const SpatialAttentionOptions& options, uint64_t seed)
    : channels_(channels), options_(options), attention_(channels, num_heads, {}, seed) {
  const int64_t groups = options.group_norm_groups;
  if (groups < 0 || (groups > 0 && channels % groups != 0)) {
    throw Error("group_norm_groups " + std::to_string(groups) + " does not divide channels " +
                std::to_string(channels) + " (0 disables the norm)");
  }
  if (groups > 0 && !(options.eps > 0)) {
    throw Error("eps must be positive, got " + std::to_string(options.eps));
  }
  if (groups > 0) {
    norm_weight_ = Tensor(DType::kFloat32, Shape({channels}));
    norm_bias_ = Tensor::zeros(DType::kFloat32, Shape({channels}));
    for (int64_t c = 0; c < channels; ++c) norm_weight_.data_as<float>()[c] = 1.0f;
  }
}

Tensor SpatialSelfAttention::forward(const TensorView& x, int num_threads) const {
  check_image("SpatialSelfAttention", x, channels_);
  // The image as `in`: a contiguous bfloat16 one read in place (widened exactly where it is
  // read: widened()), any other through a contiguous float32 copy (float32_image).
  const auto run = [&](const auto* in) -> Tensor {
    const int64_t N = x.shape[0], C = channels_, pixels = x.shape[2] * x.shape[3];
    const int threads = num_threads > 0 ? num_threads : default_num_threads();

    // 1. GroupNorm (statistics in float64), written transposed: tokens (N, H·W, C). Each
    // group's sums are taken by one thread in one order, so the bits do not depend on the
    // thread count.
    const int64_t groups = std::max<int64_t>(options_.group_norm_groups, 1);
    const int64_t group_channels = C / groups;
    const bool normalize = options_.group_norm_groups > 0;
    // Per (n, c): the group's mean and weight_c / std of the group.
    std::vector<double> mean(static_cast<size_t>(N * C), 0.0),
        scale(static_cast<size_t>(N * C), 1.0);
    if (normalize) {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t ng = 0; ng < N * groups; ++ng) {
        const auto* group = in + ng * group_channels * pixels;  // (n, first channel, 0)
        double sum = 0, sum_squares = 0;
        for (int64_t k = 0; k < group_channels * pixels; ++k) {
          const double value = widened(group[k]);
          sum += value;
          sum_squares += value * value;
        }
        const auto count = static_cast<double>(group_channels * pixels);
        const double group_mean = sum / count;
        const double variance = std::max(0.0, sum_squares / count - group_mean * group_mean);
        const double inverse_std = 1.0 / std::sqrt(variance + options_.eps);
        for (int64_t k = 0; k < group_channels; ++k) {
          const int64_t c = (ng % groups) * group_channels + k;  // channel within the image
          mean[static_cast<size_t>(ng * group_channels + k)] = group_mean;
          scale[static_cast<size_t>(ng * group_channels + k)] =
              norm_weight_.data_as<float>()[c] * inverse_std;
        }
      }
    }
    // 2. below takes a bfloat16 input in bfloat16 products where the CPU has them: the tokens
    // are then written rounded to bfloat16 here (bf16_from_f32, as convert rounds), without a
    // float32 copy in between.
    const bool bf16 = detail::wants_bf16_products(x.dtype, ComputePrecision::kAuto);
    Tensor tokens(bf16 ? DType::kBFloat16 : DType::kFloat32, Shape({N, pixels, C}));
    // Blocks of kPixelBlock pixels: the block's C·kPixelBlock floats (32 KiB at C = 128) stay
    // in L1 while they are written transposed, and every channel's pixels are read in order.
    constexpr int64_t kPixelBlock = 64;
    const int64_t blocks = (pixels + kPixelBlock - 1) / kPixelBlock;
    // tokens(n, p, c) = the normalized x(n, c, p), into float32 or bfloat16 (dst).
    const auto write_tokens = [&](auto* dst) {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t nb = 0; nb < N * blocks; ++nb) {
        const int64_t n = nb / blocks, p0 = (nb % blocks) * kPixelBlock;
        const int64_t p1 = std::min(pixels, p0 + kPixelBlock);
        for (int64_t c = 0; c < C; ++c) {
          const double channel_mean = mean[static_cast<size_t>(n * C + c)];
          const double channel_scale = scale[static_cast<size_t>(n * C + c)];
          const double shift = normalize ? norm_bias_.data_as<float>()[c] : 0.0;
          const auto* source = in + (n * C + c) * pixels;
          for (int64_t p = p0; p < p1; ++p) {
            dst[(n * pixels + p) * C + c] = rounded_to(
                dst,
                static_cast<float>((widened(source[p]) - channel_mean) * channel_scale + shift));
          }
        }
      }
    };
    if (bf16) {
      write_tokens(tokens.data_as<uint16_t>());
    } else {
      write_tokens(tokens.data_as<float>());
    }

    // 2. Self-attention over the H·W tokens (bfloat16 tokens: bfloat16 products, the
    // attention's output kept in float32 for the residual).
    MultiHeadForwardOptions attend_options;
    attend_options.need_weights = false;
    attend_options.num_threads = num_threads;
    attend_options.float32_output = bf16;
    const TensorView t = tokens.view();
    const Tensor attended = attention_.forward(t, t, t, attend_options).output;

    // 3. Back to (N, C, H, W) and the residual: out(n, c, p) = x(n, c, p) + attended(n, p, c),
    // in the same pixel blocks; a bfloat16 input gets it rounded to bfloat16 as it is written.
    Tensor out(bf16 ? DType::kBFloat16 : DType::kFloat32, x.shape);
    const float* a = attended.data_as<float>();
    // out(n, c, p) into float32 or bfloat16 (o).
    const auto write_out = [&](auto* o) {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t nb = 0; nb < N * blocks; ++nb) {
        const int64_t n = nb / blocks, p0 = (nb % blocks) * kPixelBlock;
        const int64_t p1 = std::min(pixels, p0 + kPixelBlock);
        for (int64_t c = 0; c < C; ++c) {
          for (int64_t p = p0; p < p1; ++p) {
            o[(n * C + c) * pixels + p] =
                rounded_to(o, widened(in[(n * C + c) * pixels + p]) + a[(n * pixels + p) * C + c]);
          }
        }
      }
    };
    if (bf16) {
      write_out(out.data_as<uint16_t>());
    } else {
      write_out(out.data_as<float>());
    }
    return out;
  };
  if (x.dtype == DType::kBFloat16 && x.is_contiguous() && x.data != nullptr) {
    return run(x.data_as<const uint16_t>());
  }
  std::optional<Tensor> copy;  // only when x is not contiguous float32 already
  return run(float32_image("SpatialSelfAttention", x, channels_, copy));
}

PatchEmbedding::PatchEmbedding(int64_t in_channels, int64_t patch_size, int64_t embed_dim,
                               const PatchEmbeddingOptions& options, uint64_t seed)
    : in_channels_(in_channels), patch_size_(patch_size), embed_dim_(embed_dim), options_(options) {
  for (auto [name, value] :
       {std::pair{"in_channels", in_channels}, std::pair{"patch_size", patch_size},
        std::pair{"embed_dim", embed_dim}}) {
    if (value <= 0)
      throw Error(std::string(name) + " must be positive, got " + std::to_string(value));
  }
  const int64_t fan_in = in_channels * patch_size * patch_size;
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  detail::ParameterRandom random(seed, 20);
  weight_ = Tensor(DType::kFloat32, Shape({embed_dim, in_channels, patch_size, patch_size}));
  bias_ = Tensor(DType::kFloat32, Shape({embed_dim}));
  detail::fill_uniform(weight_, bound, random);
  detail::fill_uniform(bias_, bound, random);
  if (options.class_token) {
    class_token_ = Tensor(DType::kFloat32, Shape({embed_dim}));
    detail::fill_normal(class_token_, 0.02, random);
  }
  if (options.position_embeddings) {
    const int64_t h = options.image_height, w = options.image_width;
    if (h <= 0 || w <= 0 || h % patch_size != 0 || w % patch_size != 0) {
      throw Error(
          "PatchEmbedding: position_embeddings needs image_height and image_width, "
          "positive multiples of patch_size " +
          std::to_string(patch_size) + ", got " + std::to_string(h) + " x " + std::to_string(w));
    }
    const int64_t tokens = (h / patch_size) * (w / patch_size) + (options.class_token ? 1 : 0);
    positions_ = Tensor(DType::kFloat32, Shape({tokens, embed_dim}));
    detail::fill_normal(positions_, 0.02, random);
  }
}

Tensor PatchEmbedding::forward(const TensorView& x, int num_threads) const {
  Tensor image = contiguous_image("PatchEmbedding", x, in_channels_);
  const int64_t N = x.shape[0], C = in_channels_, H = x.shape[2], W = x.shape[3];
  const int64_t p = patch_size_, D = embed_dim_;
  if (H % p != 0 || W % p != 0) {
    throw Error("PatchEmbedding: input " + x.shape.str() + " is not a multiple of patch_size " +
                std::to_string(p));
  }
  if (options_.position_embeddings && (H != options_.image_height || W != options_.image_width)) {
    throw Error("PatchEmbedding: input " + x.shape.str() + " differs from the image size " +
                std::to_string(options_.image_height) + " x " +
                std::to_string(options_.image_width) + " of the position embeddings");
  }
  const int64_t rows = H / p, columns = W / p, patches = rows * columns;
  const int64_t first = options_.class_token ? 1 : 0, tokens = first + patches;
  const int64_t patch_features = C * p * p;

  // 1. Flatten patches: flat(n, patch, (c, ky, kx)) = x(n, c, py·p + ky, px·p + kx), the order
  //    of the (D, C, p, p) weight, so the convolution is flat · weight(D, C·p·p)ᵀ + bias.
  Tensor flat(DType::kFloat32, Shape({N, patches, patch_features}));
  const float* in = image.data_as<float>();
  float* f = flat.data_as<float>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t py = 0; py < rows; ++py) {
      for (int64_t px = 0; px < columns; ++px) {
        for (int64_t c = 0; c < C; ++c) {
          for (int64_t ky = 0; ky < p; ++ky) {
            std::memcpy(f, in + ((n * C + c) * H + py * p + ky) * W + px * p,
                        static_cast<size_t>(p) * sizeof(float));
            f += p;
          }
        }
      }
    }
  }

  // 2. Project each image's patches into rows [first, tokens) of its output.
  Tensor out(DType::kFloat32, Shape({N, tokens, D}));
  const int threads = num_threads > 0 ? num_threads : default_num_threads();
  for (int64_t n = 0; n < N; ++n) {
    detail::LinearParams params;
    params.rows = patches;
    params.columns = D;
    params.depth = patch_features;
    params.input = flat.data_as<float>() + n * patches * patch_features;
    params.input_row_stride = patch_features;
    params.weight = weight_.data_as<float>();
    params.weight_row_stride = patch_features;
    params.bias = bias_.data_as<float>();
    params.output = out.data_as<float>() + (n * tokens + first) * D;
    params.output_row_stride = D;
    params.num_threads = threads;
    detail::linear(params);
  }

  // 3. Class token in row 0, then the position table added to every row.
  float* o = out.data_as<float>();
  for (int64_t n = 0; n < N; ++n) {
    if (options_.class_token) {
      std::memcpy(o + n * tokens * D, class_token_.data(), static_cast<size_t>(D) * sizeof(float));
    }
    if (options_.position_embeddings) {
      const float* table = positions_.data_as<float>();
      for (int64_t e = 0; e < tokens * D; ++e) o[n * tokens * D + e] += table[e];
    }
  }
  return out;
}

}  // namespace attend
