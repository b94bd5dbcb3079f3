// avx512_fp16-inl.h: float16 products on AVX512_FP16 (vfmadd231ph), the products struct
// Avx512Fp16 of the interface of avx512_bf16-inl.h (include after it): the same
// PairsAlongRow, PairsAcrossRows and Product over the same operand layout, with float16 in
// place of bfloat16 in each half of a pair (bf16_pairs.hpp's layout: low half the even
// element). Compiled once per Highway target; only the AVX-512 targets of x86-64 define it
// (ATTEND_AVX512_FP16, where the compiler builds it: f16_build.hpp), and the boundary
// chooses it only where native_f16_products() (cpu_features.hpp) allows and the operands'
// range fits (F16ChainsFit, f16_chains.hpp).
//
// Arithmetic. AVX512_FP16 has no float16 dot product into float32 (AMX-FP16 and AVX10.2's
// vdpphps do; this struct is for the CPUs before them), so the products accumulate in
// float16 for a while and then widen:
//   - a register of 32 float16 lanes holds, for 16 columns n, two partial sums: the even
//     lane Σ a[m][2k]·b[2k][n], the odd lane Σ a[m][2k+1]·b[2k+1][n] over the pairs k of one
//     chain of kChainPairs pairs (vfmadd231ph: one rounding to float16 per product);
//   - at the end of a chain the odd lane is added to the even one in float16 (one more
//     rounding), widened to float32 exactly (vcvtph2ps) and added to C in float32.
// So every C element is start, then one float32 addition per chain of kChainPairs pairs in
// order of k, then the scale: the same sequence whatever the register blocking or thread.
//
// Error model (u16 = 2^-11, float16's unit roundoff; γ16_n = n·u16 / (1 − n·u16)): a chain
// sum of n = kChainPairs products per lane plus the odd-into-even addition is a float16
// recursive sum of n + 1 roundings, so its error is at most γ16_{n+1}·Σ|a·b| over its
// 2·kChainPairs products, plus (n + 1)·2^-25 absolute where results fall below float16's
// normal range (subnormals are kept: AVX512_FP16 ignores MXCSR's FTZ/DAZ). The float32
// additions of the widened chains add float32's γ_{chains}. For a product of depth D:
//   |C − C_exact| <= γ16_{kChainPairs+1}·Σ_k |a_k·b_k| + ⌈D / (2·kChainPairs)⌉·(kChainPairs
//                    + 1)·2^-25 + γ_{⌈D / (2·kChainPairs)⌉ + 1}·Σ_k |a_k·b_k|.
// Range: a chain sum must stay finite in float16 (|x| <= 65504): 2·kChainPairs·max|a|·max|b|
// below it (F16ChainsFit; the boundary checks Q, K and V, the probabilities are <= 1).
// tests/f16_test.cc derives its tolerances from this (tests/f16_error_model.hpp).
#if defined(ATTEND_KERNELS_ISA_AVX512_FP16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_ISA_AVX512_FP16_INL_H_
#undef ATTEND_KERNELS_ISA_AVX512_FP16_INL_H_
#else
#define ATTEND_KERNELS_ISA_AVX512_FP16_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>

#include "half.hpp"
#include "kernels/isa/bf16_pairs.hpp"
#include "kernels/isa/f16_build.hpp"
#include "kernels/isa/f16_chains.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {

#undef ATTEND_AVX512_FP16
#if ATTEND_AVX512_BF16 && HWY_ARCH_X86_64 && ATTEND_F16_PRODUCTS_BUILT
#define ATTEND_AVX512_FP16 1
#else
#define ATTEND_AVX512_FP16 0
#endif

#if ATTEND_AVX512_FP16
#define ATTEND_AVX512_FP16_FN __attribute__((noinline, target("avx512fp16")))

// Register blocks as Avx512Bf16's: 24 float16 accumulators, C's float32 sums in memory (L1)
// between chains.
struct Avx512Fp16 : Avx512Blocking {
  static constexpr int64_t kChainPairs = kF16ChainPairs;

  // dst[i] = (src[2i], src[2i + 1]) rounded to float16 (nearest even) for i < ⌈n/2⌉ (an odd
  // n's last pair (src[n − 1], 0)).
  static ATTEND_AVX512_FP16_FN void PairsAlongRow(const float* src, int64_t n, uint32_t* dst) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i halves = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), kNearest);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i / 2), halves);
    }
    for (; i < n; i += 2) {
      dst[i / 2] = PairOf(f16_from_f32(src[i]), i + 1 < n ? f16_from_f32(src[i + 1]) : 0);
    }
  }

  // dst[c] = (first[c], second[c]) rounded to float16 for c < n (a multiple of 16); second
  // null: zeros.
  static ATTEND_AVX512_FP16_FN void PairsAcrossRows(const float* first, const float* second,
                                                    int64_t n, uint32_t* dst) {
    for (int64_t c = 0; c < n; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(_mm512_loadu_ps(first + c), kNearest));
      const __m512i hi =
          second ? _mm512_slli_epi32(
                       _mm512_cvtepu16_epi32(_mm512_cvtps_ph(_mm512_loadu_ps(second + c), kNearest)),
                       16)
                 : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + c, _mm512_or_si512(lo, hi));
    }
  }

  // C = start + A·B over rows × vectors·16 (PairsA, PairsB, PairsC), `pairs` deep.
  static void Product(int64_t rows, int64_t vectors, int64_t pairs, PairsA a, PairsB b, PairsC c) {
    RegisterBlocks<Avx512Fp16>::Product(rows, vectors, pairs, a, b, c);
  }

  // One register block: ROWS rows × VECS vectors of C, chains of kChainPairs pairs in float16
  // registers, each widened into C. A(m, k) = a[m·a_stride + k], or a[k·a_stride + m] when
  // TRANSPOSED. (Unrolled before GCC places the arrays, as Avx512Bf16::Block.)
  template <int ROWS, int VECS, bool TRANSPOSED>
  static ATTEND_AVX512_FP16_FN void Block(int64_t pairs, const uint32_t* a, int64_t a_stride,
                                          const uint32_t* HWY_RESTRICT b, int64_t b_row,
                                          float* HWY_RESTRICT c, int64_t c_row, PairStart start,
                                          const float* HWY_RESTRICT column_scale, float scale) {
    int64_t k0 = 0;
    do {  // once at least, so that pairs == 0 still writes start (and the scale)
      const int64_t k1 = pairs - k0 < kChainPairs ? pairs : k0 + kChainPairs;
      __m512h acc[ROWS][VECS];
      _Pragma("GCC unroll 24") for (int m = 0; m < ROWS; ++m) {
        _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) acc[m][v] = _mm512_setzero_ph();
      }
      for (int64_t k = k0; k < k1; ++k) {
        __m512h bv[VECS];
        _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) {
          bv[v] = _mm512_castsi512_ph(_mm512_load_si512(b + k * b_row + v * 16));
        }
        _Pragma("GCC unroll 24") for (int m = 0; m < ROWS; ++m) {
          const uint32_t pair = TRANSPOSED ? a[k * a_stride + m] : a[m * a_stride + k];
          const __m512h av =
              _mm512_castsi512_ph(_mm512_set1_epi32(static_cast<int32_t>(pair)));
          _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) {
            acc[m][v] = _mm512_fmadd_ph(av, bv[v], acc[m][v]);
          }
        }
      }
      const bool first = k0 == 0, last = k1 == pairs;
      const __m512 factor = _mm512_set1_ps(scale);
      _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) {
        const __m512 columns = first && start == PairStart::kScaleColumns
                                   ? _mm512_load_ps(column_scale + v * 16)
                                   : _mm512_setzero_ps();
        _Pragma("GCC unroll 24") for (int m = 0; m < ROWS; ++m) {
          float* cp = c + m * c_row + v * 16;
          __m512 sum = Widen(acc[m][v]);
          if (!first || start == PairStart::kAccumulate) {
            sum = _mm512_add_ps(_mm512_load_ps(cp), sum);
          } else if (start == PairStart::kScaleColumns) {
            sum = _mm512_fmadd_ps(columns, _mm512_load_ps(cp), sum);
          }
          if (last && scale != 1.0f) sum = _mm512_mul_ps(sum, factor);
          _mm512_store_ps(cp, sum);
        }
      }
      k0 = k1;
    } while (k0 < pairs);
  }

 private:
  static constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

  // The 16 chain sums of a register: even lane + odd lane in float16, widened to float32.
  static HWY_INLINE __attribute__((target("avx512fp16"))) __m512 Widen(__m512h pairs) {
    const __m512h odd = _mm512_castsi512_ph(_mm512_srli_epi32(_mm512_castph_si512(pairs), 16));
    const __m512h sum = _mm512_add_ph(pairs, odd);  // low halves: even + odd
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_castph_si512(sum)));
  }
};
#undef ATTEND_AVX512_FP16_FN
#endif  // ATTEND_AVX512_FP16

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_ISA_AVX512_FP16_INL_H_
