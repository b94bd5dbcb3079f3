// float8.hpp: the two 8-bit float formats of cached K and V (OCP FP8), encoded and decoded
// exactly, one definition for the cache, the conversions and the reference.
//   E4M3 (PyTorch's float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
//     infinities, 0x7F/0xFF are NaN, largest finite 448, smallest subnormal 2^-9.
//   E5M2 (float8_e5m2): sign, 5 exponent bits (bias 15), 2 mantissa bits, the top byte of an
//     IEEE binary16; largest finite 57344, smallest subnormal 2^-16.
// Encoding rounds to nearest even and saturates to the largest finite value (as a cache
// quantizing scaled rows wants: |x| never exceeds it by more than rounding); NaN stays NaN.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace attend::detail {

struct Float8Layout {
  int exponent_bits;
  int mantissa_bits;
  int bias;
  float max_finite;
};
inline constexpr Float8Layout kE4M3{4, 3, 7, 448.0f};
inline constexpr Float8Layout kE5M2{5, 2, 15, 57344.0f};

// The value of code `c`: sign · 2^(max(e, 1) − bias) · (e > 0) + m / 2^mantissa_bits).
inline float float8_decode(const Float8Layout& f, uint8_t c) {
  const int m_bits = f.mantissa_bits;
  const int e = (c >> m_bits) & ((1 << f.exponent_bits) - 1);
  const int m = c & ((1 << m_bits) - 1);
  const bool negative = (c & 0x80) != 0;
  const int e_max = (1 << f.exponent_bits) - 1;
  if (f.exponent_bits == 5 && e == e_max) {  // E5M2: IEEE infinities and NaNs
    return m == 0 ? (negative ? -INFINITY : INFINITY) : NAN;
  }
  if (f.exponent_bits == 4 && e == e_max && m == (1 << m_bits) - 1) return NAN;  // E4M3 NaN
  const int significand = m + (e > 0 ? (1 << m_bits) : 0);
  const float value = std::ldexp(static_cast<float>(significand), std::max(e, 1) - f.bias - m_bits);
  return negative ? -value : value;
}

// The code nearest to x (ties to even), saturated to ±max_finite.
inline uint8_t float8_encode(const Float8Layout& f, float x) {
  const int m_bits = f.mantissa_bits;
  if (std::isnan(x)) return static_cast<uint8_t>(f.exponent_bits == 4 ? 0x7F : 0x7E);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::min(std::fabs(x), f.max_finite);
  // The exponent of a's binade, at least the subnormals' (1 − bias); the step there is
  // 2^(exponent − mantissa_bits), and a / step rounded to even counts those steps.
  int exponent = a > 0 ? std::ilogb(a) : 1 - f.bias;
  if (exponent < 1 - f.bias) exponent = 1 - f.bias;
  const float steps = std::nearbyint(std::ldexp(a, m_bits - exponent));  // exact: a power of 2
  auto significand = static_cast<int>(steps);
  if (significand == (2 << m_bits)) {  // rounded up into the next binade
    significand >>= 1;
    ++exponent;
  }
  // Subnormal: significand < 2^m_bits with the smallest exponent; biased exponent 0.
  const int biased = significand >= (1 << m_bits) ? exponent + f.bias : 0;
  const int code = (biased << m_bits) | (significand & ((1 << m_bits) - 1));
  return static_cast<uint8_t>(sign | code);
}

inline float f32_from_e4m3(uint8_t c) { return float8_decode(kE4M3, c); }
inline float f32_from_e5m2(uint8_t c) { return float8_decode(kE5M2, c); }
inline uint8_t e4m3_from_f32(float x) { return float8_encode(kE4M3, x); }
inline uint8_t e5m2_from_f32(float x) { return float8_encode(kE5M2, x); }

}  // namespace attend::detail
