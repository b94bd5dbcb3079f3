// shape_policy.hpp: how the forward's shape picks the operands it reads, the limits of the
// per-thread operand copies. Read by the boundary (sdpa.cpp: choose_operands) and by the
// kernels (packing-inl.h, query_tiles-inl.h), so both sides apply the same numbers.
#pragma once

#include <cstdint>

namespace attend::detail {

// Floats one thread's contiguous float32 copy of a batch index's K [Lk][E] and V [Lk][Ev]
// may take (32 MiB): the query tiles' packed copy of interleaved K/V (ShouldPackKeysAndValues)
// and their widened copy of half-precision K/V (WidenKeysAndValues). Beyond it the tiles read
// the operands in place, and half-precision K/V are converted to float32 before the call.
constexpr int64_t kMaxPackedFloats = int64_t{8} << 20;
inline bool FitsPackedFloats(int64_t key_len, int64_t head_dim, int64_t value_dim) {
  return static_cast<double>(key_len) * static_cast<double>(head_dim + value_dim) <=
         static_cast<double>(kMaxPackedFloats);
}

// Bytes one thread's packed bfloat16 K and V may take (Bf16Operands in the query tiles:
// Lk·⌈E/2⌉ + ⌈Lk/2⌉·Ev pairs of 4 bytes): beyond it, the products are float32.
constexpr double kMaxPackedBf16Bytes = 256.0 * (1 << 20);
inline bool FitsPackedBf16(int64_t key_len, int64_t head_dim, int64_t value_dim) {
  const double pairs = static_cast<double>(key_len) * static_cast<double>((head_dim + 1) / 2) +
                       static_cast<double>((key_len + 1) / 2) * static_cast<double>(value_dim);
  return 4.0 * pairs <= kMaxPackedBf16Bytes;
}

// The same for the AMX tiles' layout (amx::TileOperands: K rows [Lk + 32][E'] and Vᵀ
// [Ev'][Lk' + 32] of bfloat16, E' and Lk' rounded up to 32, Ev' to 16): beyond it, the
// products stay on AVX512_BF16 (tiny E would otherwise pad every key to 32 elements).
inline bool FitsAmxTiles(int64_t key_len, int64_t head_dim, int64_t value_dim) {
  const auto up = [](int64_t n, int64_t to) { return static_cast<double>((n + to - 1) / to * to); };
  const double halves = static_cast<double>(key_len + 32) * up(head_dim, 32) +
                        up(value_dim, 16) * (up(key_len, 32) + 32);
  return 2.0 * halves <= kMaxPackedBf16Bytes;
}

}  // namespace attend::detail
