// gemm_test: the Highway projection GEMM against a float64 naive product, on every SIMD
// target this machine supports, and bitwise independence from the thread count; its public
// entry attend::linear_into (attend/linear.hpp): the same bits, its checks of bad input.
#include "kernels/gemm.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/linear.hpp"
#include "attend/runtime.hpp"
#include "cpu_features.hpp"
#include "half.hpp"
#include "test_support.hpp"

namespace attend::detail {
namespace {

struct Problem {
  int64_t rows, columns, depth;
  bool bias;
};

// Deterministic values in [-1, 1).
std::vector<float> pseudo_random(size_t count, uint64_t seed) {
  std::vector<float> values(count);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& v : values) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<float>(static_cast<double>(state >> 40) / double(1 << 23) - 1.0);
  }
  return values;
}

// Runs linear() on `problem` with padded row strides (to test strides) and compares with a
// float64 naive product. Error model: |got - exact| <= (K + 2)·u·(|bias| + Σ|a||b|), u = 2^-24.
// With `bf16`, the input goes in as bfloat16 (LinearParams::input_bf16) and the exact product
// is taken of the rounded input and, where bfloat16 products run, the rounded weight.
// With `amx`, on AMX tiles (LinearParams::amx_tiles). Returns the output.
std::vector<float> check_against_naive(const Problem& problem, int num_threads,
                                       const std::string& target, bool bf16 = false,
                                       bool amx = false) {
  const int64_t M = problem.rows, N = problem.columns, K = problem.depth;
  const int64_t input_stride = K + 3, weight_stride = K + 1, output_stride = N + 5;
  auto input = pseudo_random(static_cast<size_t>(M * input_stride), 1);
  const auto weight = pseudo_random(static_cast<size_t>(N * weight_stride), 2);
  std::vector<uint16_t> input_bf16(input.size());
  auto exact_weight = weight;
  if (bf16) {
    for (size_t i = 0; i < input.size(); ++i) {
      input_bf16[i] = bf16_from_f32(input[i]);
      input[i] = f32_from_bf16(input_bf16[i]);
    }
    if (M > 8 && native_bf16_products()) {
      for (float& w : exact_weight) w = f32_from_bf16(bf16_from_f32(w));
    }
  }
  const auto bias = pseudo_random(static_cast<size_t>(N), 3);
  const float sentinel = 12345.0f;
  std::vector<float> output(static_cast<size_t>(M * output_stride), sentinel);

  LinearParams p;
  p.rows = M;
  p.columns = N;
  p.depth = K;
  p.input = input.data();
  p.input_row_stride = input_stride;
  p.weight = weight.data();
  p.weight_row_stride = weight_stride;
  p.bias = problem.bias ? bias.data() : nullptr;
  p.output = output.data();
  p.output_row_stride = output_stride;
  p.num_threads = num_threads;
  if (bf16) {
    p.input = nullptr;
    p.input_bf16 = input_bf16.data();
    p.bf16_products = true;  // the GEMM's bfloat16 products wherever the CPU has them
    p.amx_tiles = amx;
  }
  linear(p);

  const double unit_roundoff = std::ldexp(1.0, -24);
  double worst_ratio = 0;
  std::string worst;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < output_stride; ++j) {
      const float got = output[static_cast<size_t>(i * output_stride + j)];
      if (j >= N) {  // padding between rows must be untouched
        EXPECT_EQ(got, sentinel) << "wrote past column " << N << " in row " << i;
        if (got != sentinel) return output;
        continue;
      }
      double exact = problem.bias ? bias[static_cast<size_t>(j)] : 0.0;
      double magnitude = std::abs(exact);
      for (int64_t k = 0; k < K; ++k) {
        const double product = double{input[static_cast<size_t>(i * input_stride + k)]} *
                               double{exact_weight[static_cast<size_t>(j * weight_stride + k)]};
        exact += product;
        magnitude += std::abs(product);
      }
      const double tolerance = static_cast<double>(K + 2) * unit_roundoff * magnitude;
      const double ratio = std::abs(got - exact) / std::max(tolerance, 1e-30);
      if (ratio > worst_ratio) {
        worst_ratio = ratio;
        std::ostringstream message;
        message << "(" << i << ", " << j << ") got " << got << " expected " << exact
                << " tolerance " << tolerance;
        worst = message.str();
      }
    }
  }
  EXPECT_LE(worst_ratio, 1.0) << "target " << target << ", M=" << M << " N=" << N << " K=" << K
                              << ", worst element " << worst;
  return output;
}

const Problem kProblems[] = {
    {1, 1, 1, true},    {5, 7, 3, true},       {6, 32, 16, false},  {13, 33, 17, true},
    {97, 65, 40, true}, {100, 48, 129, false}, {7, 200, 1, true},   {3, 5, 0, true},
    {0, 5, 4, true},    {200, 96, 64, true},   {4, 768, 256, true}, {8, 13, 35, false},
};

class GemmEveryTarget : public ::testing::TestWithParam<std::string> {};

TEST_P(GemmEveryTarget, MatchesFloat64Product) {
  test::ScopedSimdCap cap(GetParam());
  ASSERT_EQ(active_simd_target(), GetParam());
  for (const Problem& problem : kProblems) check_against_naive(problem, 2, GetParam());
}

// bfloat16 inputs: vdpbf16ps products where the CPU (and the target) has them, float32
// products of the widened input elsewhere; the same error model either way.
TEST_P(GemmEveryTarget, Bf16InputMatchesFloat64Product) {
  test::ScopedSimdCap cap(GetParam());
  std::printf("target %s: %s\n", GetParam().c_str(),
              native_bf16_products() ? "bfloat16 products" : "float32 products (widened)");
  for (const Problem& problem : kProblems) check_against_naive(problem, 2, GetParam(), true);
}

// bfloat16 inputs on AMX tiles (the projections' path on CPUs with AMX-BF16): the same error
// model, the same bits at any thread count, and not the bits of AVX512_BF16 (tdpbf16ps adds
// a pair's halves in the other order), so the tiles did run.
TEST(GemmAmx, Bf16InputMatchesFloat64Product) {
  if (!amx_bf16_products()) GTEST_SKIP() << "skipped: " << why_no_amx_bf16();
  for (const Problem& problem : kProblems) check_against_naive(problem, 2, "AMX", true, true);
  const Problem large{301, 131, 77, true};
  const std::vector<float> one = check_against_naive(large, 1, "AMX", true, true);
  for (int threads : {2, 3, 7}) {
    EXPECT_EQ(check_against_naive(large, threads, "AMX", true, true), one) << threads;
  }
  EXPECT_NE(check_against_naive(large, 2, "AVX512_BF16", true, false), one);
}

// A bfloat16 output (LinearParams::output_bf16) holds the float32 output rounded as convert
// rounds, bit for bit, on every path: float32 or bfloat16 input, few rows, a depth over one
// pass (600 > 256), partial panels, and denormal, tie, infinite and NaN results (row 0's input
// is zero, so its outputs are the bias itself). The padding between rows stays untouched.
TEST_P(GemmEveryTarget, Bf16OutputIsTheFloat32OutputRounded) {
  test::ScopedSimdCap cap(GetParam());
  const Problem problems[] = {{5, 7, 3, true},    {13, 33, 17, true}, {97, 65, 40, true},
                              {100, 48, 129, true}, {40, 70, 600, true}, {9, 32, 1, true},
                              {64, 96, 0, true},  {4, 768, 256, true}};
  for (const Problem& problem : problems) {
    for (const bool bf16_input : {false, true}) {
      const int64_t M = problem.rows, N = problem.columns, K = problem.depth;
      const int64_t output_stride = N + 3;
      auto input = pseudo_random(static_cast<size_t>(M * K), 7);
      for (int64_t k = 0; k < K; ++k) input[static_cast<size_t>(k)] = 0.0f;
      std::vector<uint16_t> input_bf16(input.size());
      for (size_t i = 0; i < input.size(); ++i) input_bf16[i] = bf16_from_f32(input[i]);
      const auto weight = pseudo_random(static_cast<size_t>(N * K), 8);
      auto bias = pseudo_random(static_cast<size_t>(N), 9);
      const uint32_t special[] = {0x00012345u, 0x80000001u, 0x3F808000u, 0x3F818000u,
                                  0x7F800000u, 0xFF800000u, 0x7FC00001u, 0x7F7FFFFFu};
      for (size_t i = 0; i < std::size(special) && i < bias.size(); ++i) {
        bias[i] = f32_from_bits(special[i]);
      }
      LinearParams p;
      p.rows = M;
      p.columns = N;
      p.depth = K;
      p.input = bf16_input ? nullptr : input.data();
      p.input_bf16 = bf16_input ? input_bf16.data() : nullptr;
      p.bf16_products = bf16_input;
      p.input_row_stride = K;
      p.weight = weight.data();
      p.weight_row_stride = K;
      p.bias = bias.data();
      p.num_threads = 3;
      std::vector<float> output(static_cast<size_t>(M * output_stride));
      p.output = output.data();
      p.output_row_stride = output_stride;
      linear(p);
      const uint16_t sentinel = 0xABCD;
      std::vector<uint16_t> rounded(static_cast<size_t>(M * output_stride), sentinel);
      p.output = nullptr;
      p.output_bf16 = rounded.data();
      linear(p);
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < output_stride; ++j) {
          const size_t at = static_cast<size_t>(i * output_stride + j);
          const uint16_t expected = j < N ? bf16_from_f32(output[at]) : sentinel;
          ASSERT_EQ(rounded[at], expected)
              << "target " << GetParam() << ", M=" << M << " N=" << N << " K=" << K
              << (bf16_input ? ", bfloat16 input" : "") << ", element (" << i << ", " << j << ")";
        }
      }
    }
  }
}

// 301 x 131 x 300 is about 11.8 M multiply-adds: worth 3 threads (work_size.hpp), and two
// depth passes (kDepthBlock 256).
TEST_P(GemmEveryTarget, ResultDoesNotDependOnThreadCount) {
  test::ScopedSimdCap cap(GetParam());
  const int64_t M = 301, N = 131, K = 300;
  const auto input = pseudo_random(static_cast<size_t>(M * K), 4);
  const auto weight = pseudo_random(static_cast<size_t>(N * K), 5);
  const auto bias = pseudo_random(static_cast<size_t>(N), 6);
  std::vector<float> first;
  for (int threads : {1, 2, 3, 7}) {
    std::vector<float> output(static_cast<size_t>(M * N));
    LinearParams p{
        M, N,       K,      input.data(), K, weight.data(), K, bias.data(), output.data(),
        N, threads, nullptr};
    linear(p);
    if (first.empty()) {
      first = output;
      continue;
    }
    for (size_t i = 0; i < output.size(); ++i) {
      ASSERT_EQ(output[i], first[i]) << "element " << i << " with " << threads << " threads";
    }
  }
}

// linear_into over strided views (rows of wider buffers) gives the bits of linear() on the
// same operands, with and without a bias, at any thread count, and leaves the padding alone.
TEST(LinearInto, IsTheGemmOnStridedViews) {
  for (const Problem& problem : kProblems) {
    const int64_t M = problem.rows, N = problem.columns, K = problem.depth;
    const int64_t input_stride = K + 3, weight_stride = K + 1, output_stride = N + 5;
    const auto input = pseudo_random(static_cast<size_t>(M * input_stride), 11);
    const auto weight = pseudo_random(static_cast<size_t>(N * weight_stride), 12);
    const auto bias = pseudo_random(static_cast<size_t>(N), 13);
    std::vector<float> expected(static_cast<size_t>(M * output_stride), 7.0f);
    LinearParams p{M,
                   N,
                   K,
                   input.data(),
                   input_stride,
                   weight.data(),
                   weight_stride,
                   problem.bias ? bias.data() : nullptr,
                   expected.data(),
                   output_stride,
                   1,
                   nullptr};
    linear(p);
    const TensorView input_view(const_cast<float*>(input.data()), DType::kFloat32,
                                Shape({M, K}), Shape({input_stride, 1}));
    const TensorView weight_view(const_cast<float*>(weight.data()), DType::kFloat32,
                                 Shape({N, K}), Shape({weight_stride, 1}));
    const TensorView bias_view(bias.data(), Shape({N}));
    for (int threads : {1, 2, 3, 0}) {
      std::vector<float> got(expected.size(), 7.0f);
      linear_into(input_view, weight_view, problem.bias ? &bias_view : nullptr,
                  TensorView(got.data(), DType::kFloat32, Shape({M, N}),
                             Shape({output_stride, 1})),
                  threads);
      ASSERT_EQ(got, expected) << "M=" << M << " N=" << N << " K=" << K << ", " << threads
                               << " threads";
    }
  }
}

// Bad input: a clear attend::Error naming the problem, and the output untouched.
TEST(LinearInto, RejectsBadInput) {
  std::vector<float> x(6 * 4, 1.0f), w(3 * 4, 1.0f), b(3, 1.0f), y(6 * 3, -1.0f);
  const TensorView input(x.data(), Shape({6, 4})), weight(w.data(), Shape({3, 4}));
  const TensorView bias(b.data(), Shape({3})), output(y.data(), Shape({6, 3}));
  const auto expect_error = [&](const auto& call, const std::string& words) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one with: " << words;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    for (const float v : y) ASSERT_EQ(v, -1.0f) << "the output was written: " << words;
  };
  std::vector<uint16_t> halves(6 * 4);
  expect_error([&] {
    linear_into(TensorView(halves.data(), DType::kBFloat16, Shape({6, 4})), weight, &bias,
                output);
  }, "input must be float32");
  expect_error([&] { linear_into(TensorView(x.data(), Shape({24})), weight, &bias, output); },
               "input must have 2 dimensions");
  expect_error([&] { linear_into(TensorView(x.data(), Shape({8, 3})), weight, &bias, output); },
               "in_features");
  expect_error([&] { linear_into(input, weight, &output, output); }, "bias must have 1 dimension");
  expect_error([&] {
    const TensorView two(b.data(), Shape({2}));
    linear_into(input, weight, &two, output);
  }, "bias (2,) must have 3 elements");
  expect_error([&] { linear_into(input, weight, &bias, TensorView(y.data(), Shape({3, 6}))); },
               "output (3, 6) must be (6, 3)");
  expect_error([&] {
    linear_into(TensorView(x.data(), DType::kFloat32, Shape({6, 2}), Shape({4, 2})),
                TensorView(w.data(), DType::kFloat32, Shape({3, 2}), Shape({4, 2})), &bias,
                output);
  }, "input must have a unit last stride");
  expect_error([&] {
    linear_into(input, weight, &bias,
                TensorView(y.data(), DType::kFloat32, Shape({6, 3}), Shape({2, 1})));
  }, "output rows overlap");
  expect_error([&] {
    linear_into(TensorView(y.data(), Shape({6, 3})),
                TensorView(w.data(), Shape({3, 3})), nullptr, output);
  }, "output overlaps input");
  expect_error([&] { linear_into(input, weight, &bias, output, -1); }, "num_threads");
  expect_error([&] { linear_into(TensorView(nullptr, DType::kFloat32, Shape({6, 4})), weight,
                                 &bias, output); }, "null");
}

INSTANTIATE_TEST_SUITE_P(SupportedTargets, GemmEveryTarget,
                         ::testing::ValuesIn(supported_simd_targets()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace attend::detail
