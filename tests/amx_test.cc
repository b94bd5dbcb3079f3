// amx_test: the bfloat16 products on AMX tiles (kernels/isa/amx_bf16.hpp) against a float64
// product, where this CPU and OS run them; skipped with the reason elsewhere. Attention on
// AMX tiles is checked by bf16_test (the grid, for every bfloat16 path the host has).
//
// Error model of GemmBf16: each product of two bfloat16 is exact in float32 and tdpbf16ps
// adds the products one at a time to the float32 accumulator (Intel SDM, TDPBF16PS), so
//   |C − C_exact| <= (depth + 2)·u·(|C0| + Σ_k |A[m][k]·B[k][n]|),  u = 2^-24
// (γ_depth for the sum, one more rounding for the initial C0), with values far from the
// denormals that the instruction flushes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "attend/runtime.hpp"
#include "cpu_features.hpp"
#include "half.hpp"
#include "shape_policy.hpp"

#if defined(__x86_64__)
#include "kernels/isa/amx_bf16.hpp"
#endif

namespace attend::detail {
namespace {

#if defined(__x86_64__)
// Deterministic values in [-1, 1), rounded to bfloat16.
std::vector<uint16_t> pseudo_random_bf16(size_t count, uint64_t seed) {
  std::vector<uint16_t> values(count);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint16_t& v : values) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = bf16_from_f32(static_cast<float>(static_cast<double>(state >> 40) / double(1 << 23) - 1.0));
  }
  return values;
}

struct GemmShape {
  int64_t rows, cols, depth;
};

// rows × cols × depth with padded strides; B built from a plain [depth][cols] matrix and
// packed into pairs here, so a wrong pair order in the kernel shows.
void check_gemm(const GemmShape& s, bool accumulate) {
  const int64_t lda = s.depth + 32, ldb = s.cols + 16, ldc = s.cols + 8;
  const std::vector<uint16_t> a = pseudo_random_bf16(static_cast<size_t>(s.rows * lda), 1);
  const std::vector<uint16_t> b_plain =
      pseudo_random_bf16(static_cast<size_t>(s.depth * s.cols), 2);
  std::vector<uint32_t> b(static_cast<size_t>(s.depth / 2 * ldb), 0xFFFFFFFFu);
  for (int64_t i = 0; i < s.depth / 2; ++i) {
    for (int64_t n = 0; n < s.cols; ++n) {
      b[i * ldb + n] = uint32_t{b_plain[2 * i * s.cols + n]} |
                       (uint32_t{b_plain[(2 * i + 1) * s.cols + n]} << 16);
    }
  }
  std::vector<float> c(static_cast<size_t>(s.rows * ldc));
  const std::vector<uint16_t> c0 = pseudo_random_bf16(c.size(), 3);
  for (size_t i = 0; i < c.size(); ++i) c[i] = f32_from_bf16(c0[i]);
  const std::vector<float> before = c;
  {
    const amx::TileScope tiles;
    amx::GemmBf16(s.rows, s.cols, s.depth, a.data(), lda, b.data(), ldb, c.data(), ldc,
                  accumulate);
  }
  constexpr double u = 1.0 / (1 << 24);
  double worst = 0;  // share of the bound
  for (int64_t m = 0; m < s.rows; ++m) {
    for (int64_t n = 0; n < s.cols; ++n) {
      const double start = accumulate ? before[m * ldc + n] : 0.0;
      double exact = start, size = std::abs(start);
      for (int64_t k = 0; k < s.depth; ++k) {
        const double p = double{f32_from_bf16(a[m * lda + k])} * f32_from_bf16(b_plain[k * s.cols + n]);
        exact += p;
        size += std::abs(p);
      }
      const double bound = (s.depth + 2) * u * size;
      const double error = std::abs(c[m * ldc + n] - exact);
      worst = std::max(worst, error / bound);
      ASSERT_LE(error, bound) << "C[" << m << "][" << n << "] = " << c[m * ldc + n] << ", exact "
                              << exact;
    }
    // The padding of the row stays as it was.
    for (int64_t n = s.cols; n < ldc; ++n) ASSERT_EQ(c[m * ldc + n], before[m * ldc + n]);
  }
  std::printf("%lld x %lld x %lld%s: largest error %.3f of the bound\n",
              static_cast<long long>(s.rows), static_cast<long long>(s.cols),
              static_cast<long long>(s.depth), accumulate ? " (accumulating)" : "", worst);
}
#endif

TEST(AmxBf16, GemmMatchesFloat64Product) {
  if (!amx_bf16_products()) GTEST_SKIP() << "skipped: " << why_no_amx_bf16();
#if defined(__x86_64__)
  // Blocks of 2 × 2, 2 × 1, 1 × 2 and 1 × 1 tiles; one step of depth and several.
  const GemmShape shapes[] = {{16, 16, 32},  {32, 32, 32},  {48, 80, 64},
                              {128, 64, 128}, {16, 48, 160}, {64, 16, 96}};
  for (const GemmShape& s : shapes) {
    for (bool accumulate : {false, true}) check_gemm(s, accumulate);
  }
#endif
}

// Switched off (attend::set_amx_enabled, ATTEND_AMX=0), bfloat16 inputs leave the tiles (to
// AVX512_BF16 on AMD, float32 products on Intel: tests/precision_policy_test.cc) and
// bf16_compute_path says so; switched on again, AMX.
TEST(AmxBf16, SwitchChoosesThePath) {
  if (!amx_bf16_products()) GTEST_SKIP() << "skipped: " << why_no_amx_bf16();
  set_amx_enabled(false);
  EXPECT_FALSE(amx_bf16_products());
  EXPECT_EQ(bf16_compute_path().find("AMX"), std::string::npos) << bf16_compute_path();
  set_amx_enabled(true);
  EXPECT_TRUE(amx_bf16_products());
  EXPECT_NE(bf16_compute_path().find("AMX"), std::string::npos) << bf16_compute_path();
  // Capped below AVX-512, AMX is ruled out with AVX512_BF16.
  set_max_simd_target("AVX2");
  EXPECT_FALSE(amx_bf16_products());
  set_max_simd_target("");
}

// The tiles' layout pads every key to 32 elements of E: the boundary bounds that copy on its
// own, so a tiny E over very many keys leaves the tiles (the policy's choice without AMX)
// rather than taking gigabytes.
TEST(AmxBf16, TileLayoutIsBoundedOnItsOwn) {
  const int64_t many_keys = int64_t{20} << 20;
  EXPECT_TRUE(FitsPackedBf16(many_keys, 1, 1));
  EXPECT_FALSE(FitsAmxTiles(many_keys, 1, 1));
  EXPECT_TRUE(FitsAmxTiles(2048, 128, 128));
}

}  // namespace
}  // namespace attend::detail
