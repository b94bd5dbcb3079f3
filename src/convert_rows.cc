// convert_rows.cc: float16 <-> float32 rows with the CPU's conversion instructions (F16C on
// the AVX2 and AVX-512 targets), one Highway source dispatched at run time; the scalar
// definitions of half.hpp elsewhere. Both round to nearest even and keep infinities and
// NaNs (a NaN's payload may differ between the two).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "convert_rows.cc"
#include "convert_rows.hpp"

#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "half.hpp"
#include "simd_dispatch.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Highway's software float16 conversion (targets without F16C) truncates instead of
// rounding: only the x86 targets with F16C use the vector path.
#undef ATTEND_VECTOR_F16
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#define ATTEND_VECTOR_F16 1
#else
#define ATTEND_VECTOR_F16 0
#endif

void F16ToF32(const uint16_t* from, float* to, int64_t n) {
  int64_t i = 0;
#if ATTEND_VECTOR_F16
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const auto lanes = static_cast<int64_t>(hn::Lanes(df));
  const auto* h = reinterpret_cast<const hwy::float16_t*>(from);
  for (; i + lanes <= n; i += lanes)
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, h + i)), df, to + i);
#endif
  for (; i < n; ++i) to[i] = f32_from_f16(from[i]);
}

void F32ToF16(const float* from, uint16_t* to, int64_t n) {
  int64_t i = 0;
#if ATTEND_VECTOR_F16
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const auto lanes = static_cast<int64_t>(hn::Lanes(df));
  auto* h = reinterpret_cast<hwy::float16_t*>(to);
  for (; i + lanes <= n; i += lanes)
    hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, from + i)), dh, h + i);
#endif
  for (; i < n; ++i) to[i] = f16_from_f32(from[i]);
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attend::detail {

HWY_EXPORT(F16ToF32);
HWY_EXPORT(F32ToF16);

void f16_to_f32_row(const uint16_t* from, float* to, int64_t n) {
  ATTEND_DISPATCH(F16ToF32)(from, to, n);
}
void f32_to_f16_row(const float* from, uint16_t* to, int64_t n) {
  ATTEND_DISPATCH(F32ToF16)(from, to, n);
}

}  // namespace attend::detail
#endif  // HWY_ONCE
