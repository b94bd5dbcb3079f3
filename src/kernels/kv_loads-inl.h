// kv_loads-inl.h: K and V as stored (kv_format.hpp), a vector at a time, widened to float32
// in registers: the one load every kernel that reads a cache format uses (the row groups'
// LoadKV, the bfloat16 pack of the grouped-query tiles). Compiled once per Highway target
// (include after kernel_common-inl.h).
#if defined(ATTEND_KERNELS_KV_LOADS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_KV_LOADS_INL_H_
#undef ATTEND_KERNELS_KV_LOADS_INL_H_
#else
#define ATTEND_KERNELS_KV_LOADS_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>
#include <type_traits>

#include "kv_format.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The row groups read K and V as stored (SdpaParams::kv_format; kv_format.hpp): float32, or
// float16, bfloat16, int8, float8_e4m3, float8_e5m2 widened to float32 as they are loaded
// (decoding: the bytes a step reads shrink, the arithmetic stays float32 on the widened
// values). The scaled formats' scales are applied to the scores (key) and the
// probabilities (value), never to the loaded vectors.
template <DType K>
using KvPtr = std::conditional_t<
    K == DType::kFloat32, const float*,
    std::conditional_t<K == DType::kInt8, const int8_t*,
                       std::conditional_t<K == DType::kFloat16 || K == DType::kBFloat16,
                                          const uint16_t*, const uint8_t*>>>;

#undef ATTEND_F16C_FP8  // per target
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#define ATTEND_F16C_FP8 1  // fp8 widened through float16 bits (F16C)
#else
#define ATTEND_F16C_FP8 0
#endif

// The unit LoadKV and KvAt count K and V in: 1, except float8_e4m3 widened through float16
// bits (below), whose one shift gives value / 2^8. The 2^8 joins the scales applied to
// scores and probabilities (ApplyRowScalesAt), which float8 always has: powers of two, so
// scale_j · (q · (code_j / 2^8)) · 2^8 are the bits of scale_j · (q · code_j) (no product of
// a code, at least 2^-9, and a float32 query comes near float32's subnormals).
template <DType K>
constexpr float kKvUnit = K == DType::kFloat8E4M3 && ATTEND_F16C_FP8 ? 256.0f : 1.0f;

// One vector of K or V from `p` (unaligned), widened to float32 and divided by kKvUnit<K>:
// widen_kv (kv_format.hpp) lane by lane.
template <DType K>
HWY_INLINE VF LoadKV(DF d, KvPtr<K> p) {
  if constexpr (K == DType::kFloat32) {
    return hn::LoadU(d, p);
  } else if constexpr (K == DType::kFloat16 || K == DType::kBFloat16) {
    using Half = std::conditional_t<K == DType::kBFloat16, hwy::bfloat16_t, hwy::float16_t>;
    const hn::Rebind<Half, DF> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const Half*>(p)));
  } else if constexpr (K == DType::kInt8) {
    const hn::Rebind<int8_t, DF> d8;
    const hn::RebindToSigned<DF> di;
    return hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, p)));
  } else {
#if ATTEND_F16C_FP8
    // fp8 as float16 bits (F16C widens float16 exactly, subnormals included). E5M2 is a
    // float16's top byte. E4M3 sign-extended to 16 bits and shifted left by 7 has its
    // exponent and mantissa in float16's places and its sign in bits 15 and 14; clearing bit
    // 14 leaves a float16 worth value / 2^8 (float16's bias 15 against 7): kKvUnit.
    const hn::Rebind<int8_t, DF> d8;
    const hn::Rebind<int16_t, DF> d16;
    const hn::Rebind<hwy::float16_t, DF> dh;
    const auto code = hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p)));
    if constexpr (K == DType::kFloat8E5M2) {
      return hn::PromoteTo(d, hn::BitCast(dh, hn::ShiftLeft<8>(code)));
    } else {
      const auto bits = hn::And(hn::ShiftLeft<7>(code), hn::Set(d16, int16_t{-16512}));  // 0xBF80
      return hn::PromoteTo(d, hn::BitCast(dh, bits));
    }
#else
    // fp8 (float8.hpp): sign · significand · 2^(max(e, 1) − bias − mantissa bits), built from
    // integers (exact whatever the denormal flags: every value is a float32 normal).
    constexpr int kMantissa = K == DType::kFloat8E4M3 ? 3 : 2;
    constexpr int kBias = K == DType::kFloat8E4M3 ? 7 : 15;
    const hn::Rebind<uint8_t, DF> d8;
    const hn::RebindToSigned<DF> di;
    const auto code = hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<DF>(), hn::LoadU(d8, p)));
    const auto magnitude = hn::And(code, hn::Set(di, 0x7F));
    const auto e = hn::ShiftRight<kMantissa>(magnitude);
    const auto m = hn::And(magnitude, hn::Set(di, (1 << kMantissa) - 1));
    const auto normal = hn::Gt(e, hn::Zero(di));
    const auto significand = hn::IfThenElse(normal, hn::Or(m, hn::Set(di, 1 << kMantissa)), m);
    const auto exponent = hn::Max(e, hn::Set(di, 1));
    const auto power =
        hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(exponent, hn::Set(di, 127 - kBias - kMantissa))));
    const VF value = hn::Mul(hn::ConvertTo(d, significand), power);
    const auto sign = hn::BitCast(d, hn::ShiftLeft<24>(hn::And(code, hn::Set(di, 0x80))));
    return hn::Or(value, sign);
#endif
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_KV_LOADS_INL_H_
