// f16_chains.hpp: the one rule of the float16 products' chains (isa/avx512_fp16-inl.h), read
// by the kernel, the boundary (which checks the operands' range) and the tests (which derive
// their tolerances from it). Plain C++, any ISA.
#pragma once

#include <cmath>
#include <cstdint>

namespace attend::detail {

// Pairs of products a float16 register lane accumulates before the chain is widened to
// float32: each lane adds kF16ChainPairs products (one rounding each), then the pair's two
// lanes are added in float16 (one more), so a chain sum carries kF16ChainPairs + 1
// roundings of float16's unit roundoff 2^-11 over its 2·kF16ChainPairs products.
// 64: one chain per product of the query tiles at E <= 128 and a 128-key tile. The chain
// lengths' times on s4 and their errors on s4's scores: BENCHMARKS.md, "Intel Xeon: float16
// products on AVX512_FP16 beside float32, AVX512_BF16 and AMX".
inline constexpr int64_t kF16ChainPairs = 64;
inline constexpr int64_t kF16ChainRoundings = kF16ChainPairs + 1;

// The largest finite float16.
inline constexpr double kF16Max = 65504.0;

// Whether every chain sum of products a·b with |a| <= max_a and |b| <= max_b stays finite in
// float16: |chain| <= 2·kF16ChainPairs·max_a·max_b (each partial sum rounded up by at most
// 2^-11 per rounding: (1 + 2^-11)^(kF16ChainRoundings) < 1.02).
inline bool F16ChainsFit(double max_a, double max_b) {
  const double bound = 2.0 * static_cast<double>(kF16ChainPairs) * max_a * max_b * 1.02;
  return std::isfinite(bound) && bound <= kF16Max;
}

}  // namespace attend::detail
