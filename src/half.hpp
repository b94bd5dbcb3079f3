// half.hpp: IEEE binary16 and bfloat16 <-> float32, round to nearest even, NaN kept.
#pragma once

#include <cstdint>
#include <cstring>

namespace attend::detail {

inline float f32_from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint32_t bits_from_f32(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

inline float f32_from_f16(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return f32_from_bits(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {
    // Zero or subnormal: mantissa · 2^-24.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return f32_from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t f16_from_f32(float f) {
  const uint32_t bits = bits_from_f32(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: round abs · 2^24 to an integer, ties to even.
    const float scaled = f32_from_bits(abs) * 16777216.0f;
    float rounded = static_cast<float>(static_cast<int32_t>(scaled));
    const float fraction = scaled - rounded;
    if (fraction > 0.5f || (fraction == 0.5f && (static_cast<int32_t>(rounded) & 1))) rounded += 1;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rounded));
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t rebased = abs - (uint32_t{112} << 23);
  const uint32_t rounded = rebased + 0xFFFu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

inline float f32_from_bf16(uint16_t h) { return f32_from_bits(uint32_t{h} << 16); }

inline uint16_t bf16_from_f32(float f) {
  const uint32_t bits = bits_from_f32(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace attend::detail
