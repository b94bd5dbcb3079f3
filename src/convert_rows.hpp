// convert_rows.hpp: contiguous rows between float16 and float32 on the CPU's conversion
// instructions where it has them (convert_rows.cc), for attend::convert.
#pragma once

#include <cstdint>

namespace attend::detail {

void f16_to_f32_row(const uint16_t* from, float* to, int64_t n);
void f32_to_f16_row(const float* from, uint16_t* to, int64_t n);

}  // namespace attend::detail
