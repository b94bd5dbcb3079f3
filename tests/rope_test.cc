// Rotary position embeddings (attend/rope.hpp) against a float64 implementation of the
// formula written here, both conventions, offsets, partial rotary dimensions, strided and
// float16 views, explicit positions; the refusals.
#include "attend/rope.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "serving_support.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

// The formula in float64 for one row x[0..D) at `position`: pair k of the R rotated
// dimensions turns by position·base^(−2k/R).
std::vector<double> rotated(const std::vector<double>& x, int64_t position, double base, int64_t r,
                            bool interleaved) {
  std::vector<double> y = x;
  for (int64_t k = 0; k < r / 2; ++k) {
    const double angle = static_cast<double>(position) /
                         std::pow(base, static_cast<double>(2 * k) / static_cast<double>(r));
    const size_t a = static_cast<size_t>(interleaved ? 2 * k : k);
    const size_t b = static_cast<size_t>(interleaved ? 2 * k + 1 : k + r / 2);
    y[a] = x[a] * std::cos(angle) - x[b] * std::sin(angle);
    y[b] = x[b] * std::cos(angle) + x[a] * std::sin(angle);
  }
  return y;
}

// x (B, H, L, D) contiguous float32 rotated at positions offset + l: within one rounding
// (float32) of the float64 formula.
void expect_formula(const Tensor& before, const Tensor& after, int64_t offset, double base,
                    int64_t r, bool interleaved, double ulps = 1.0) {
  const Shape& s = before.shape();
  const int64_t length = s.back(1), d = s.back(0), rows = before.numel() / d;
  for (int64_t row = 0; row < rows; ++row) {
    std::vector<double> x(static_cast<size_t>(d));
    for (int64_t e = 0; e < d; ++e)
      x[static_cast<size_t>(e)] = before.data_as<float>()[row * d + e];
    const std::vector<double> y = rotated(x, offset + row % length, base, r, interleaved);
    for (int64_t e = 0; e < d; ++e) {
      const double got = after.data_as<float>()[row * d + e], want = y[static_cast<size_t>(e)];
      ASSERT_LE(std::abs(got - want), ulps * 0x1p-24 * std::abs(want) + 1e-30)
          << "row " << row << " e " << e << (interleaved ? " interleaved" : " half-split");
    }
  }
}

TEST(Rope, MatchesTheFormulaInBothConventions) {
  for (const bool interleaved : {false, true}) {
    for (const int64_t rotary : {int64_t{0}, int64_t{16}}) {
      const Tensor before = random_tensor(Shape({2, 3, 9, 32}), 1, 2.0);
      Tensor x = before.clone();
      RopeOptions options;
      options.convention = interleaved ? RopeConvention::kInterleaved : RopeConvention::kHalfSplit;
      options.base = 500000.0;  // Llama 3's
      options.rotary_dim = rotary;
      apply_rope(x.view(), 1000, options);
      expect_formula(before, x, 1000, 500000.0, rotary == 0 ? 32 : rotary, interleaved);
    }
  }
}

TEST(Rope, PositionZeroIsTheIdentityAndConventionsArePermutations) {
  const Tensor before = random_tensor(Shape({4, 1, 8}), 2);
  Tensor x = before.clone();
  apply_rope(x.view(), 0);
  EXPECT_TRUE(same_bits(x, before));
  // Interleaved on x equals half-split on x with its pairs regrouped: (x0 x1 x2 x3 ...) →
  // (x0 x2 x4 ... | x1 x3 x5 ...).
  const Tensor at5 = random_tensor(Shape({3, 8}), 3);
  Tensor inter = at5.clone(), half(DType::kFloat32, Shape({3, 8}));
  for (int64_t t = 0; t < 3; ++t) {
    for (int64_t k = 0; k < 4; ++k) {
      half.data_as<float>()[t * 8 + k] = at5.data_as<float>()[t * 8 + 2 * k];
      half.data_as<float>()[t * 8 + 4 + k] = at5.data_as<float>()[t * 8 + 2 * k + 1];
    }
  }
  RopeOptions interleaved;
  interleaved.convention = RopeConvention::kInterleaved;
  apply_rope(inter.view(), 5, interleaved);
  apply_rope(half.view(), 5);
  for (int64_t t = 0; t < 3; ++t) {
    for (int64_t k = 0; k < 4; ++k) {
      EXPECT_EQ(inter.data_as<float>()[t * 8 + 2 * k], half.data_as<float>()[t * 8 + k]);
      EXPECT_EQ(inter.data_as<float>()[t * 8 + 2 * k + 1], half.data_as<float>()[t * 8 + 4 + k]);
    }
  }
}

TEST(Rope, StridedHalfAndExplicitPositions) {
  // (B, L, H, D) storage rotated through its (B, H, L, D) view equals the contiguous case.
  const Tensor blhd = random_tensor(Shape({2, 5, 3, 16}), 4);
  Tensor strided = blhd.clone();
  const TensorView view(strided.data(), DType::kFloat32, Shape({2, 3, 5, 16}),
                        Shape({240, 16, 48, 1}));
  apply_rope(view, 7);
  Tensor bhld(DType::kFloat32, Shape({2, 3, 5, 16}));
  convert(TensorView(const_cast<void*>(blhd.data()), DType::kFloat32, Shape({2, 3, 5, 16}),
                     Shape({240, 16, 48, 1})),
          bhld.view());
  const Tensor before = bhld.clone();
  apply_rope(bhld.view(), 7);
  expect_formula(before, bhld, 7, 10000.0, 16, false);
  EXPECT_TRUE(same_bits(Tensor::copy_of(view), bhld));

  // float16: the float32 result rounded to float16.
  const Tensor half = random_tensor(Shape({1, 4, 8}), 5, 1.0, DType::kFloat16);
  Tensor as_float(DType::kFloat32, half.shape());
  convert(half.view(), as_float.view());
  Tensor x16 = half.clone();
  apply_rope(x16.view(), 3);
  apply_rope(as_float.view(), 3);
  Tensor rounded(DType::kFloat16, half.shape());
  convert(as_float.view(), rounded.view());
  EXPECT_TRUE(same_bits(x16, rounded));

  // Packed tokens (total, H, D) with explicit positions: as the dense call per token.
  const Tensor packed = random_tensor(Shape({4, 2, 8}), 6);
  Tensor positions(DType::kInt64, Shape({4}));
  const int64_t at[] = {0, 9, 3, 100};
  for (int64_t t = 0; t < 4; ++t) positions.data_as<int64_t>()[t] = at[t];
  Tensor y = packed.clone();
  apply_rope_at(y.view(), positions.view());
  for (int64_t t = 0; t < 4; ++t) {
    Tensor one(DType::kFloat32, Shape({2, 1, 8}));
    std::memcpy(one.data(), packed.data_as<float>() + t * 16, 16 * sizeof(float));
    apply_rope(one.view(), at[t]);
    EXPECT_EQ(std::memcmp(one.data(), y.data_as<float>() + t * 16, 16 * sizeof(float)), 0) << t;
  }
}

TEST(Rope, RefusesBadArguments) {
  Tensor x = random_tensor(Shape({2, 4, 6}), 1);
  RopeOptions odd;
  odd.rotary_dim = 3;
  EXPECT_NE(error_of([&] { apply_rope(x.view(), 0, odd); }).find("rotary_dim 3"),
            std::string::npos);
  RopeOptions base;
  base.base = 0;
  EXPECT_NE(error_of([&] { apply_rope(x.view(), 0, base); }).find("base"), std::string::npos);
  EXPECT_NE(error_of([&] { apply_rope(x.view(), -1); }).find("position_offset"), std::string::npos);
  Tensor odd_d = random_tensor(Shape({2, 5}), 1);
  EXPECT_NE(error_of([&] { apply_rope(odd_d.view(), 0); }).find("even"), std::string::npos);
  Tensor positions(DType::kInt32, Shape({3}));
  EXPECT_NE(
      error_of([&] { apply_rope_at(x.view(), positions.view()); }).find("one position per token"),
      std::string::npos);
  Tensor negative(DType::kInt32, Shape({2}));
  negative.data_as<int32_t>()[0] = 0;
  negative.data_as<int32_t>()[1] = -4;
  EXPECT_NE(error_of([&] { apply_rope_at(x.view(), negative.view()); }).find("positions[1] is -4"),
            std::string::npos);
  const TensorView broadcast(x.data(), DType::kFloat32, Shape({2, 4, 6}), Shape({0, 6, 1}));
  EXPECT_NE(error_of([&] { apply_rope(broadcast, 0); }).find("zero stride"), std::string::npos);
}

}  // namespace
}  // namespace attend::test
