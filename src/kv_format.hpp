// kv_format.hpp: the storage formats of K and V that the decode kernels read in place (one
// table, after gemma.cpp's CompressTraits and ggml's type table):
//   float32, float16, bfloat16: x = widen(stored);
//   int8, float8_e4m3, float8_e5m2 (quantized caches): x ≈ scale · widen(code), one float32
//   scale per (token, K/V head) over the head's E elements, scale = max_e |x_e| / max_code,
//   code = round(x / scale) (int8: to nearest, in [-127, 127]; fp8: to nearest even).
// The error of one quantized element: int8 |x − x̂| <= scale / 2 = max|x| / 254; fp8 a
// relative 2^-(mantissa bits + 1) (E4M3 2^-4, E5M2 2^-3) of |x|, at least half the
// smallest subnormal step times the scale.
#pragma once

#include <cstdint>

#include "attend/tensor.hpp"
#include "float8.hpp"
#include "half.hpp"

namespace attend::detail {

// Whether `dtype` is a K/V storage format, and whether it needs scales.
constexpr bool is_kv_format(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16 ||
         d == DType::kInt8 || d == DType::kFloat8E4M3 || d == DType::kFloat8E5M2;
}
constexpr bool is_scaled_kv_format(DType d) {
  return d == DType::kInt8 || d == DType::kFloat8E4M3 || d == DType::kFloat8E5M2;
}

// The largest code magnitude of a scaled format (what max|x| maps to).
inline float kv_max_code(DType d) {
  switch (d) {
    case DType::kInt8:
      return 127.0f;
    case DType::kFloat8E4M3:
      return kE4M3.max_finite;
    case DType::kFloat8E5M2:
      return kE5M2.max_finite;
    default:
      return 1.0f;
  }
}

// Relative rounding of one stored element against its row's max|x| (int8) or its own |x|
// (the float formats), for error models: float32 0, float16 2^-11, bfloat16 2^-8, int8
// 1/254 of max|x|, E4M3 2^-4, E5M2 2^-3.
inline double kv_unit_roundoff(DType d) {
  switch (d) {
    case DType::kFloat16:
      return 0x1p-11;
    case DType::kBFloat16:
      return 0x1p-8;
    case DType::kInt8:
      return 1.0 / 254.0;
    case DType::kFloat8E4M3:
      return 0x1p-4;
    case DType::kFloat8E5M2:
      return 0x1p-3;
    default:
      return 0.0;
  }
}

// Element i of stored row `p` widened to float32, exactly, without its scale.
inline float widen_kv(DType d, const void* p, int64_t i) {
  switch (d) {
    case DType::kFloat16:
      return f32_from_f16(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16:
      return f32_from_bf16(static_cast<const uint16_t*>(p)[i]);
    case DType::kInt8:
      return static_cast<float>(static_cast<const int8_t*>(p)[i]);
    case DType::kFloat8E4M3:
      return f32_from_e4m3(static_cast<const uint8_t*>(p)[i]);
    case DType::kFloat8E5M2:
      return f32_from_e5m2(static_cast<const uint8_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// Quantizes `rows` rows of `dim` float32 values into a scaled format: codes into `out`
// (rows × dim), one scale per row into `scales`. A zero row gets scale 0 and codes 0; a row
// holding NaN or infinity a NaN scale (it reads back as NaN).
void quantize_kv_rows(DType d, const float* x, int64_t rows, int64_t dim, void* out, float* scales);

}  // namespace attend::detail
