// bf16_pairs.hpp: the operand layout of every bfloat16 product (avx512_bf16-inl.h and any
// other products file): pairs of bfloat16 in one 32-bit word, low half the even element,
// high half the odd one, as vdpbf16ps and AMX's tdpbf16ps read them. Plain C++, any ISA.
//
//   A (broadcast / tile rows): pairs along the depth k of one row, A(m, k2) = (a[m][2·k2],
//     a[m][2·k2 + 1]);
//   B (vectors / VNNI rows):   pairs across two rows of the depth, B[k2][n] = (b[2·k2][n],
//     b[2·k2 + 1][n]).
// An odd depth pads the last pair with a zero half.
#pragma once

#include <cstdint>
#include <cstring>

#include "half.hpp"

namespace attend::detail {

// Pairs of a depth n: ⌈n/2⌉.
inline int64_t PairsOf(int64_t n) { return (n + 1) / 2; }

// One pair from two bfloat16 bit patterns.
inline uint32_t PairOf(uint16_t lo, uint16_t hi) { return uint32_t{lo} | (uint32_t{hi} << 16); }

// One pair from two float32, each rounded to bfloat16 (nearest even, bf16_from_f32).
inline uint32_t PairOfFloats(float lo, float hi) {
  return PairOf(bf16_from_f32(lo), bf16_from_f32(hi));
}

// dst[i·dst_stride] = (row[2i], row[2i + 1]) for i < ⌈n/2⌉: a bfloat16 row as A pairs (an
// odd n's last pair (row[n − 1], 0)).
inline void HalfPairsAlongRow(const uint16_t* row, int64_t n, uint32_t* dst, int64_t dst_stride) {
  for (int64_t i = 0; i < n / 2; ++i) {
    uint32_t pair;
    std::memcpy(&pair, row + 2 * i, sizeof(pair));
    dst[i * dst_stride] = pair;
  }
  if (n % 2) dst[(n / 2) * dst_stride] = row[n - 1];
}

// dst[c] = (first[c], second[c]) for c < n: two bfloat16 rows as one row of B pairs
// (second null: zeros).
inline void HalfPairsAcrossRows(const uint16_t* first, const uint16_t* second, int64_t n,
                                uint32_t* dst) {
  if (second == nullptr) {
    for (int64_t c = 0; c < n; ++c) dst[c] = first[c];
    return;
  }
  for (int64_t c = 0; c < n; ++c) dst[c] = PairOf(first[c], second[c]);
}

}  // namespace attend::detail
