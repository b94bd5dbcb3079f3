// avx512_bf16-inl.h: bfloat16 products on AVX512_BF16 (vdpbf16ps), the one home of the
// instruction for the query tiles, the backward and the projection GEMM. Compiled once per
// Highway target (include after kernel_common-inl.h); only the AVX-512 targets have it
// (ATTEND_AVX512_BF16), and the boundary chooses bfloat16 products only where the CPU
// reports them, so the other targets never reach it.
//
// The interface (isa-interface: /work/notes/isa-interface.md), which another products file
// (AMX tiles, AVX512_FP16) implements with the same names in a struct of its own:
//   PairsAlongRow(src, n, dst)            float32 row → A pairs (bf16_pairs.hpp)
//   PairsAcrossRows(first, second, n, dst) two float32 rows → one row of B pairs
//   Product(rows, vectors, pairs, A, B, C) C (rows × vectors·16) = start + A·B (then ·scale)
//
// vdpbf16ps: acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1] for the 16 float32 lanes i, each
// product of two bfloat16 exact in float32 (so the operand order does not matter), the
// pair's high product added first. Every C element is start, then the pairs k = 0, 1, …
// in order, then the scale: the same sequence whatever the register blocking.
#if defined(ATTEND_KERNELS_ISA_AVX512_BF16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_ISA_AVX512_BF16_INL_H_
#undef ATTEND_KERNELS_ISA_AVX512_BF16_INL_H_
#else
#define ATTEND_KERNELS_ISA_AVX512_BF16_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>

#include "kernels/isa/bf16_pairs.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {

#undef ATTEND_AVX512_BF16
#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
#define ATTEND_AVX512_BF16 1
#else
#define ATTEND_AVX512_BF16 0
#endif

// The operands of Product, ISA-neutral (every products file takes the same).
// A: rows × pairs, A(m, k) = data[m·row + k·col] with col == 1 (rows of pairs, the layout
// of AMX's A tile) or row == 1 (A stored transposed).
struct PairsA {
  const uint32_t* data;
  int64_t row, col;
};
// B: pairs × (vectors·16) pairs across rows (bf16_pairs.hpp), B[k][n] = data[k·row + n];
// 64-byte aligned rows.
struct PairsB {
  const uint32_t* data;
  int64_t row;
};
// C: rows × (vectors·16) float32, C[m][n] = data[m·row + n], 64-byte aligned rows.
//   start kZero: C = A·B;  kAccumulate: C += A·B;  kScaleColumns: C = column_scale[n]·C + A·B;
//   then, where scale != 1, C ·= scale.
enum class PairStart { kZero, kAccumulate, kScaleColumns };
struct PairsC {
  float* data;
  int64_t row;
  PairStart start = PairStart::kZero;
  const float* column_scale = nullptr;  // [vectors·16], kScaleColumns only
  float scale = 1.0f;
};

// The register blocking of a products struct's Product, shared by the AVX-512 ones: vectors
// in blocks of Isa::kMaxVectors then one narrower block; for each, rows in blocks of
// Isa::kBlockRows<VECS>, of Isa::kTailRows, then the rest, each one call of
// Isa::Block<ROWS, VECS, TRANSPOSED>(pairs, A rows, A stride, B, B row, C, C row, start,
// column scale, scale). The blocking never changes the sequence of operations on a C
// element, only which elements one call holds.
template <class Isa>
struct RegisterBlocks {
  static void Product(int64_t rows, int64_t vectors, int64_t pairs, PairsA a, PairsB b, PairsC c) {
    if (a.col == 1) return Columns<false>(rows, vectors, pairs, a, b, c);
    HWY_DASSERT(a.row == 1);
    Columns<true>(rows, vectors, pairs, a, b, c);
  }

 private:
  template <bool TRANSPOSED>
  static void Columns(int64_t rows, int64_t vectors, int64_t pairs, PairsA a, PairsB b, PairsC c) {
    constexpr int kMaxVectors = Isa::kMaxVectors;
    int64_t v = 0;
    for (; v + kMaxVectors <= vectors; v += kMaxVectors) {
      Rows<kMaxVectors, TRANSPOSED>(rows, pairs, a, b, c, v);
    }
    switch (vectors - v) {
      case 3:
        return Rows<3, TRANSPOSED>(rows, pairs, a, b, c, v);
      case 2:
        return Rows<2, TRANSPOSED>(rows, pairs, a, b, c, v);
      case 1:
        return Rows<1, TRANSPOSED>(rows, pairs, a, b, c, v);
      default:
        return;
    }
  }

  // Vectors [v, v + VECS) of all rows.
  template <int VECS, bool TRANSPOSED>
  static void Rows(int64_t rows, int64_t pairs, PairsA a, PairsB b, PairsC c, int64_t v) {
    const auto block = [&](auto rows_tag, int64_t m) {
      constexpr int kRows = decltype(rows_tag)::value;
      const uint32_t* a_rows = a.data + m * (TRANSPOSED ? 1 : a.row);
      const float* scale_columns = c.column_scale ? c.column_scale + v * 16 : nullptr;
      Isa::template Block<kRows, VECS, TRANSPOSED>(
          pairs, a_rows, TRANSPOSED ? a.col : a.row, b.data + v * 16, b.row,
          c.data + m * c.row + v * 16, c.row, c.start, scale_columns, c.scale);
    };
    constexpr int kFull = Isa::template kBlockRows<VECS>;
    constexpr int kTail = Isa::kTailRows;
    int64_t m = 0;
    for (; m + kFull <= rows; m += kFull) block(Rows_<kFull>{}, m);
    for (; m + kTail <= rows; m += kTail) block(Rows_<kTail>{}, m);
    switch (rows - m) {
      case 5:
        return block(Rows_<5>{}, m);
      case 4:
        return block(Rows_<4>{}, m);
      case 3:
        return block(Rows_<3>{}, m);
      case 2:
        return block(Rows_<2>{}, m);
      case 1:
        return block(Rows_<1>{}, m);
      default:
        return;
    }
  }
  template <int N>
  struct Rows_ {
    static constexpr int value = N;
  };
};

// The register blocks of the AVX-512 products structs (RegisterBlocks): up to 24
// accumulators of the 32 registers, ROWS rows of broadcast A × VECS vectors of B (6 × 4,
// 8 × 3, 12 × 2; 8 × 1, as many as FMA latency × ports: more would need a load per product);
// remainders in blocks of kTailRows, then one narrower.
struct Avx512Blocking {
  static constexpr int kMaxVectors = 4;
  static constexpr int kTailRows = 6;
  template <int VECS>
  static constexpr int kBlockRows = VECS == 1 ? 8 : 24 / VECS;
};

#if ATTEND_AVX512_BF16
#define ATTEND_AVX512_BF16_FN __attribute__((noinline, target("avx512bf16")))

struct Avx512Bf16 : Avx512Blocking {

  // dst[i] = (src[2i], src[2i + 1]) rounded to bfloat16 (nearest even) for i < ⌈n/2⌉ (an
  // odd n's last pair (src[n − 1], 0)).
  static ATTEND_AVX512_BF16_FN void PairsAlongRow(const float* src, int64_t n, uint32_t* dst) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m512bh halves =
          _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
      _mm512_storeu_si512(dst + i / 2, reinterpret_cast<__m512i>(halves));
    }
    for (; i < n; i += 2) dst[i / 2] = PairOfFloats(src[i], i + 1 < n ? src[i + 1] : 0.0f);
  }

  // dst[c] = (first[c], second[c]) rounded to bfloat16 for c < n (a multiple of 16); second
  // null: zeros.
  static ATTEND_AVX512_BF16_FN void PairsAcrossRows(const float* first, const float* second,
                                                    int64_t n, uint32_t* dst) {
    // Lane i of the result takes element i (first row) and 16 + i (second row).
    alignas(64) static constexpr uint16_t kInterleave[32] = {
        0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    for (int64_t c = 0; c < n; c += 16) {
      const __m512 a = _mm512_loadu_ps(first + c);
      const __m512 b = second ? _mm512_loadu_ps(second + c) : _mm512_setzero_ps();
      const auto halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
      _mm512_storeu_si512(dst + c, _mm512_permutexvar_epi16(interleave, halves));
    }
  }

  // C = start + A·B over rows × vectors·16 (see PairsA, PairsB, PairsC), `pairs` deep.
  static void Product(int64_t rows, int64_t vectors, int64_t pairs, PairsA a, PairsB b, PairsC c) {
    RegisterBlocks<Avx512Bf16>::Product(rows, vectors, pairs, a, b, c);
  }

  // One register block: ROWS rows × VECS vectors of C. A(m, k) = a[m·a_stride + k], or
  // a[k·a_stride + m] when TRANSPOSED.
  // The loops over rows and vectors are unrolled before GCC decides where arrays live:
  // otherwise it keeps the accumulator arrays on the stack and copies them in and out
  // around every block (BENCHMARKS.md, "Reduced precision", the Zen 4 section).
  template <int ROWS, int VECS, bool TRANSPOSED>
  static ATTEND_AVX512_BF16_FN void Block(int64_t pairs, const uint32_t* a, int64_t a_stride,
                                          const uint32_t* HWY_RESTRICT b, int64_t b_row,
                                          float* HWY_RESTRICT c, int64_t c_row, PairStart start,
                                          const float* HWY_RESTRICT column_scale, float scale) {
    __m512 acc[ROWS][VECS];
    if (start == PairStart::kZero) {
      _Pragma("GCC unroll 24") for (int m = 0; m < ROWS; ++m) {
        _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) acc[m][v] = _mm512_setzero_ps();
      }
    } else if (start == PairStart::kAccumulate) {
      _Pragma("GCC unroll 24") for (int m = 0; m < ROWS; ++m) {
        _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) {
          acc[m][v] = _mm512_load_ps(c + m * c_row + v * 16);
        }
      }
    } else {
      _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) {
        const __m512 factor = _mm512_load_ps(column_scale + v * 16);
        _Pragma("GCC unroll 24") for (int m = 0; m < ROWS; ++m) {
          acc[m][v] = _mm512_mul_ps(factor, _mm512_load_ps(c + m * c_row + v * 16));
        }
      }
    }
    for (int64_t k = 0; k < pairs; ++k) {
      __m512bh bv[VECS];
      _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) {
        bv[v] = reinterpret_cast<__m512bh>(_mm512_load_si512(b + k * b_row + v * 16));
      }
      _Pragma("GCC unroll 24") for (int m = 0; m < ROWS; ++m) {
        const uint32_t pair = TRANSPOSED ? a[k * a_stride + m] : a[m * a_stride + k];
        const auto av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(pair)));
        _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) {
          acc[m][v] = _mm512_dpbf16_ps(acc[m][v], av, bv[v]);
        }
      }
    }
    if (scale != 1.0f) {
      const __m512 f = _mm512_set1_ps(scale);
      _Pragma("GCC unroll 24") for (int m = 0; m < ROWS; ++m) {
        _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) acc[m][v] =
            _mm512_mul_ps(acc[m][v], f);
      }
    }
    _Pragma("GCC unroll 24") for (int m = 0; m < ROWS; ++m) {
      _Pragma("GCC unroll 4") for (int v = 0; v < VECS; ++v) {
        _mm512_store_ps(c + m * c_row + v * 16, acc[m][v]);
      }
    }
  }
};
#undef ATTEND_AVX512_BF16_FN
#endif  // ATTEND_AVX512_BF16

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_ISA_AVX512_BF16_INL_H_
