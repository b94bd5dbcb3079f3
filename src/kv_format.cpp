// kv_format.cpp: quantization into the scaled K/V formats (kv_format.hpp).
#include "kv_format.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace attend::detail {

void quantize_kv_rows(DType d, const float* x, int64_t rows, int64_t dim, void* out,
                      float* scales) {
  const float max_code = kv_max_code(d);
  auto* codes = static_cast<uint8_t*>(out);
  for (int64_t r = 0; r < rows; ++r, x += dim, codes += dim) {
    float largest = 0;
    bool finite = true;
    for (int64_t e = 0; e < dim; ++e) {
      largest = std::max(largest, std::abs(x[e]));
      finite = finite && std::isfinite(x[e]);
    }
    // A row holding NaN or infinity keeps no codes and a NaN scale: every element reads
    // back as NaN, as its scores would be in float32.
    const float scale = finite ? largest / max_code : std::numeric_limits<float>::quiet_NaN();
    scales[r] = scale;
    for (int64_t e = 0; e < dim; ++e) {
      const float scaled = scale == 0 || !finite ? 0.0f : x[e] / scale;
      switch (d) {
        case DType::kInt8:
          codes[e] = static_cast<uint8_t>(
              static_cast<int8_t>(std::clamp(std::nearbyint(scaled), -127.0f, 127.0f)));
          break;
        case DType::kFloat8E4M3:
          codes[e] = e4m3_from_f32(scaled);
          break;
        default:
          codes[e] = e5m2_from_f32(scaled);
          break;
      }
    }
  }
}

}  // namespace attend::detail
