#include "attend/tensor.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "half.hpp"
#include "test_support.hpp"

namespace attend {
namespace {

TEST(Shape, StrAndNumel) {
  EXPECT_EQ(Shape({2, 5, 64}).str(), "(2, 5, 64)");
  EXPECT_EQ(Shape({7}).str(), "(7,)");
  EXPECT_EQ(Shape({2, 5, 64}).numel(), 640);
  EXPECT_EQ(Shape{}.numel(), 1);
  EXPECT_THROW((void)Shape({int64_t{1} << 40, int64_t{1} << 40}).numel(), Error);
  EXPECT_THROW((void)Shape({3, -1}).numel(), Error);
}

// One rank rule for every way a Shape is built: at most kMaxRank dimensions, the same message.
TEST(Shape, RankAboveTheMaximumIsAnErrorEitherWay) {
  const std::vector<int64_t> dims(Shape::kMaxRank + 1, 2);
  EXPECT_EQ(Shape::from(dims.data(), Shape::kMaxRank).rank(), Shape::kMaxRank);
  for (int way = 0; way < 2; ++way) {
    try {
      if (way == 0) {
        (void)Shape::from(dims.data(), Shape::kMaxRank + 1);
      } else {
        Shape shape = Shape::from(dims.data(), Shape::kMaxRank);
        shape.push_back(2);
      }
      ADD_FAILURE() << "rank " << Shape::kMaxRank + 1 << " accepted (way " << way << ")";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "shape: rank 9 exceeds the maximum of 8");
    }
  }
}

TEST(Tensor, AllocationOverflowIsAnError) {
  EXPECT_THROW(Tensor(DType::kFloat32, Shape({int64_t{1} << 62})), Error);
}

TEST(Tensor, ConvertHonoursStrides) {
  // A (2, 3) float32 tensor read transposed as (3, 2) and converted to float16 and back.
  Tensor t(DType::kFloat32, Shape({2, 3}));
  for (int i = 0; i < 6; ++i) t.data_as<float>()[i] = static_cast<float>(i) + 0.5f;
  TensorView transposed(t.data(), DType::kFloat32, Shape({3, 2}), Shape({1, 3}));
  Tensor half = Tensor(DType::kFloat16, Shape({3, 2}));
  convert(transposed, half.view());
  Tensor back = Tensor(DType::kFloat32, Shape({3, 2}));
  convert(half.view(), back.view());
  EXPECT_EQ(back.data_as<float>()[0], 0.5f);
  EXPECT_EQ(back.data_as<float>()[1], 3.5f);
  EXPECT_EQ(back.data_as<float>()[5], 5.5f);
}

// A copy to the same dtype keeps every bit, signaling NaNs (which a trip through float32
// would quiet) and their payloads included (the soak found copy_of quieting them).
TEST(Tensor, SameDtypeCopyIsBitwise) {
  const uint16_t bits[] = {0x7c01, 0xfc01, 0x7f81, 0xff81, 0x7e00, 0x0001, 0x8000, 0x3c00};
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    Tensor t(dtype, Shape({2, 8}));
    for (int r = 0; r < 2; ++r) std::memcpy(t.data_as<uint16_t>() + 8 * r, bits, sizeof bits);
    const Tensor copy = Tensor::copy_of(t.view());
    EXPECT_EQ(std::memcmp(copy.data(), t.data(), t.nbytes()), 0) << dtype_name(dtype);
  }
  Tensor f(DType::kFloat32, Shape({2}));
  const uint32_t signaling = 0x7f800001;
  std::memcpy(f.data(), &signaling, 4);
  std::memcpy(f.data_as<uint32_t>() + 1, &signaling, 4);
  EXPECT_EQ(std::memcmp(Tensor::copy_of(f.view()).data(), f.data(), 8), 0);
}

TEST(Half, RoundTripsAndRoundsToNearestEven) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float f = detail::f32_from_f16(bits);
    if (f != f) continue;  // NaN payloads are not preserved bit for bit
    ASSERT_EQ(detail::f16_from_f32(f), bits) << "half bits " << h;
  }
  EXPECT_EQ(detail::f16_from_f32(1.0f + 1.0f / 2048), 0x3C00);  // tie rounds to even
  EXPECT_EQ(detail::f16_from_f32(65520.0f), 0x7C00);            // rounds to infinity
  EXPECT_EQ(detail::bf16_from_f32(1.0f), 0x3F80);
  EXPECT_EQ(detail::f32_from_bf16(0x3F80), 1.0f);
}

}  // namespace
}  // namespace attend

namespace attend {
namespace {

// convert's row fast path (convert_rows.cc on the CPU's conversion instructions, per SIMD
// target) agrees with the scalar definitions of half.hpp on every float16 value, and on
// float32 values around every float16 rounding boundary; NaNs stay NaNs.
TEST(ConvertRows, MatchesTheScalarDefinitionsOnEveryTarget) {
  std::vector<uint16_t> halves(65536);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i);
  std::vector<float> floats;
  for (uint16_t h : halves) {
    const float f = detail::f32_from_f16(h);
    floats.push_back(f);
    floats.push_back(std::nextafter(f, INFINITY));
    floats.push_back(std::nextafter(f, -INFINITY));
    // The midpoint to the next float16 value: a tie, rounded to even.
    const float next = detail::f32_from_f16(static_cast<uint16_t>(h + 1));
    if (std::isfinite(f) && std::isfinite(next)) floats.push_back(0.5f * (f + next));
  }
  for (const std::string& target : supported_simd_targets()) {
    test::ScopedSimdCap cap(target);
    SCOPED_TRACE(target);
    Tensor widened(DType::kFloat32, Shape{static_cast<int64_t>(halves.size())});
    convert(TensorView(halves.data(), DType::kFloat16, Shape{static_cast<int64_t>(halves.size())}),
            widened.view());
    for (size_t i = 0; i < halves.size(); ++i) {
      const float expected = detail::f32_from_f16(halves[i]);
      const float got = widened.data_as<float>()[i];
      if (std::isnan(expected)) {
        ASSERT_TRUE(std::isnan(got)) << i;
      } else {
        ASSERT_EQ(detail::bits_from_f32(got), detail::bits_from_f32(expected)) << i;
      }
    }
    const auto n = static_cast<int64_t>(floats.size());
    std::vector<uint16_t> narrowed(floats.size());
    convert(TensorView(floats.data(), Shape{n}),
            TensorView(narrowed.data(), DType::kFloat16, Shape{n}));
    for (size_t i = 0; i < floats.size(); ++i) {
      const uint16_t expected = detail::f16_from_f32(floats[i]);
      if (std::isnan(floats[i])) {
        ASSERT_TRUE(std::isnan(detail::f32_from_f16(narrowed[i]))) << i;
      } else {
        ASSERT_EQ(narrowed[i], expected) << floats[i];
      }
    }
  }
}

}  // namespace
}  // namespace attend
