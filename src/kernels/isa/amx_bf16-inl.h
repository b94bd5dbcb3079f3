// amx_bf16-inl.h: bfloat16 products on AMX tiles (AMX-BF16), the products struct AmxBf16 of
// the interface of avx512_bf16-inl.h (include after it): the same PairsAlongRow,
// PairsAcrossRows and Product, with the tile kernels of amx_bf16.hpp (not per target:
// function-level target attributes) and the scalings around them on AVX-512. Compiled once
// per Highway target; only the AVX-512 targets of x86-64 define it (ATTEND_AMX_BF16), and
// the boundary chooses it only where amx_bf16_products() (cpu_features.hpp) allows.
//
// What Product asks of its callers beyond Avx512Bf16's (the tiles load whole blocks):
//   - A as rows of pairs (col == 1);
//   - zeros in A, B and C past the operands up to whole blocks: rows of A and C up to a
//     multiple of kRowMultiple (C's extra rows are written), pairs of A and B up to a
//     multiple of kPairMultiple (AmxBf16::kTileOperands: the query tiles pack for it,
//     amx::TileOperands);
//   - a thread inside an amx::TileScope.
// The arithmetic is vdpbf16ps's (amx_bf16.hpp), so the error model is the same.
#if defined(ATTEND_KERNELS_ISA_AMX_BF16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_ISA_AMX_BF16_INL_H_
#undef ATTEND_KERNELS_ISA_AMX_BF16_INL_H_
#else
#define ATTEND_KERNELS_ISA_AMX_BF16_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>

#include "kernels/isa/amx_bf16.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#undef ATTEND_AMX_BF16
#if ATTEND_AVX512_BF16 && HWY_ARCH_X86_64
#define ATTEND_AMX_BF16 1
#else
#define ATTEND_AMX_BF16 0
#endif

#if ATTEND_AMX_BF16
struct AmxBf16 {
  static constexpr bool kTileOperands = true;
  static constexpr int64_t kRowMultiple = amx::kTileRows;
  static constexpr int64_t kPairMultiple = amx::kTileDepth / 2;

  static void PairsAlongRow(const float* src, int64_t n, uint32_t* dst) {
    Avx512Bf16::PairsAlongRow(src, n, dst);
  }
  static void PairsAcrossRows(const float* first, const float* second, int64_t n,
                              uint32_t* dst) {
    Avx512Bf16::PairsAcrossRows(first, second, n, dst);
  }

  // C = start + A·B over rows × vectors·16, `pairs` deep (see above for the padding).
  static void Product(int64_t rows, int64_t vectors, int64_t pairs, PairsA a, PairsB b, PairsC c) {
    HWY_DASSERT(a.col == 1);
    const int64_t cols = vectors * 16;
    if (c.start == PairStart::kScaleColumns) ScaleRows(rows, cols, c, c.column_scale, 1.0f);
    amx::GemmBf16(amx::RoundUp(rows, kRowMultiple), cols, amx::RoundUp(pairs, kPairMultiple) * 2,
                  reinterpret_cast<const uint16_t*>(a.data), a.row * 2, b.data, b.row, c.data,
                  c.row, c.start != PairStart::kZero);
    if (c.scale != 1.0f) ScaleRows(rows, cols, c, nullptr, c.scale);
  }

 private:
  // C[m][n] ·= column_scale[n] (or `scale` when null) for m < rows, n < cols.
  static void ScaleRows(int64_t rows, int64_t cols, const PairsC& c, const float* column_scale,
                        float scale) {
    const hn::ScalableTag<float> d;
    const auto same = hn::Set(d, scale);
    for (int64_t n = 0; n < cols; n += hn::Lanes(d)) {
      const auto s = column_scale ? hn::Load(d, column_scale + n) : same;
      for (int64_t m = 0; m < rows; ++m) {
        float* x = c.data + m * c.row + n;
        hn::Store(hn::Mul(hn::Load(d, x), s), d, x);
      }
    }
  }
};
#endif  // ATTEND_AMX_BF16

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_ISA_AMX_BF16_INL_H_
