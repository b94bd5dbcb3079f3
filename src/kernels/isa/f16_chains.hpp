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
// 64: one chain per product of the query tiles at E <= 128 and a 128-key tile (measured on
// s4 in float16, one thread: chains of 16, 32 and 64 pairs took about 255, 225 and 210 ms
// per call, float32 products about 325 ms); a simulation of s4's scores (uniform inputs)
// puts the chains' mean error at 4x the inputs' rounding for 64 pairs, 3x for 32.
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
