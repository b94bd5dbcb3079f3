// bf16_products-inl.h: the query tiles' two matrix products on AVX512_BF16 (vdpbf16ps): the
// operand layouts they need and their register blocks. Compiled once per Highway target
// (include after packing-inl.h); only the AVX-512 targets have the instructions
// (ATTEND_BF16_PRODUCTS), and the boundary chooses bfloat16 products only where the CPU
// reports them (cpu_features.hpp), so the other targets' entries are never reached.
//
// vdpbf16ps: acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1] for the 16 float32 lanes i, each
// product of two bfloat16 exact in float32. A lane is one query (the tiles' layout), so
//   S:   a = the query's pair (Q[q][2e], Q[q][2e+1]),  b = K's pair (K[j][2e], K[j][2e+1])
//        broadcast: K rows are pairs along E already;
//   P·V: a = the query's pair (P[q][2j], P[q][2j+1]),  b = V's pair (V[2j][c], V[2j+1][c])
//        broadcast: V is packed once per call and thread into pairs of adjacent keys.
// Odd E or an odd key count pad the last pair with a zero. The probabilities P are rounded
// to bfloat16 (nearest even) for the product; the softmax's sum l keeps them in float32, so
// the output carries a relative error of at most 2^-9 per weight on top of the inputs'
// rounding (tests/error_model.hpp).
#if defined(ATTEND_KERNELS_BF16_PRODUCTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_BF16_PRODUCTS_INL_H_
#undef ATTEND_KERNELS_BF16_PRODUCTS_INL_H_
#else
#define ATTEND_KERNELS_BF16_PRODUCTS_INL_H_
#endif

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "sdpa_params.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#undef ATTEND_BF16_PRODUCTS
#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
#define ATTEND_BF16_PRODUCTS 1
#else
#define ATTEND_BF16_PRODUCTS 0
#endif

// Pairs of bfloat16 per row: E rounded up to even, halved.
inline int64_t PairsOf(int64_t n) { return (n + 1) / 2; }

// One thread's bfloat16 operands of its current query tile and K/V span (allocated at the
// first use by a call that computes in bfloat16; null otherwise).
struct Bf16Operands {
  hwy::AlignedFreeUniquePtr<uint32_t[]> query_pairs;  // [E/2][Tq]
  hwy::AlignedFreeUniquePtr<uint32_t[]> prob_pairs;   // [Tk/2][Tq]
  hwy::AlignedFreeUniquePtr<uint32_t[]> packed;       // key [count][E/2], then value [count/2][Ev]
  int64_t packed_words = 0;
  const uint16_t* key_from = nullptr;  // the span packed last: operands and first key
  const uint16_t* value_from = nullptr;
  int64_t begin = -1, count = 0;
  const uint32_t* key = nullptr;    // packed K of the span: row j − begin
  const uint32_t* value = nullptr;  // packed V of the span: pair row (j − begin) / 2

  bool Allocate(const SdpaParams& p, int64_t tq, int64_t key_tile) {
    if (!p.bf16_products()) return true;
    query_pairs = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(PairsOf(p.head_dim) * tq));
    prob_pairs = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(PairsOf(key_tile) * tq));
    packed_words = PackedWords(p, p.key_len);
    packed = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(packed_words));
    return query_pairs && prob_pairs && packed;
  }

  // Words of a packed span of `count` keys (at most PackedWords(p, Lk), the size allocated:
  // Lk·(E + Ev)·2 bytes per thread, which the boundary bounds by kMaxPackedBf16Bytes).
  static int64_t PackedWords(const SdpaParams& p, int64_t count) {
    return count * PairsOf(p.head_dim) + PairsOf(count) * p.value_dim;
  }

  // K and V of keys [begin, begin + count) of the tile's batch index, packed (once per
  // thread and span; the tiles of one batch index reuse it).
  void Pack(const SdpaParams& p, const uint16_t* key_rows, int64_t key_stride,
            const uint16_t* value_rows, int64_t value_stride, int64_t span_begin,
            int64_t span_count) {
    if (key_from == key_rows && value_from == value_rows && begin == span_begin &&
        count == span_count) {
      return;
    }
    const int64_t e2 = PairsOf(p.head_dim), ev = p.value_dim;
    uint32_t* k = packed.get();
    uint32_t* v = k + span_count * e2;
    for (int64_t j = 0; j < span_count; ++j) {
      const uint16_t* row = key_rows + (span_begin + j) * key_stride;
      uint32_t* out = k + j * e2;
      out[e2 - 1] = 0;  // odd E: the last pair's second half
      std::memcpy(out, row, static_cast<size_t>(p.head_dim) * sizeof(uint16_t));
    }
    for (int64_t j = 0; j < span_count; j += 2) {
      const uint16_t* v0 = value_rows + (span_begin + j) * value_stride;
      const uint16_t* v1 = j + 1 < span_count ? v0 + value_stride : nullptr;
      uint32_t* out = v + (j / 2) * ev;
      if (v1) {
        for (int64_t c = 0; c < ev; ++c) out[c] = uint32_t{v0[c]} | (uint32_t{v1[c]} << 16);
      } else {
        for (int64_t c = 0; c < ev; ++c) out[c] = uint32_t{v0[c]};
      }
    }
    key_from = key_rows;
    value_from = value_rows;
    begin = span_begin;
    count = span_count;
    key = k;
    value = v;
  }
};

// query_pairs[e2][r] = (Q[q0 + r][2·e2], Q[q0 + r][2·e2 + 1]) for rows r < rows (the rest
// zero), unscaled: the scale is applied to the float32 scores.
inline void LoadQueryPairs(const SdpaParams& p, const uint16_t* query_rows, int64_t q0,
                           int64_t rows, int64_t tq, uint32_t* HWY_RESTRICT query_pairs) {
  const int64_t e2 = PairsOf(p.head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* q = query_rows + (q0 + r) * p.query_strides.row;
    for (int64_t i = 0; i < p.head_dim / 2; ++i) {
      uint32_t pair;
      std::memcpy(&pair, q + 2 * i, sizeof(pair));
      query_pairs[i * tq + r] = pair;
    }
    if (p.head_dim % 2) query_pairs[(e2 - 1) * tq + r] = q[p.head_dim - 1];
  }
  for (int64_t i = 0; i < e2; ++i)
    std::fill(query_pairs + i * tq + rows, query_pairs + (i + 1) * tq, 0u);
}

#if ATTEND_BF16_PRODUCTS
#define ATTEND_BF16_ATTR __attribute__((noinline, target("avx512bf16")))
// The register blocks' loops over keys, columns and query vectors are unrolled before GCC
// decides where arrays live: otherwise it keeps the accumulator arrays on the stack and
// copies them in and out around every block (measured: a quarter of the time at E = 32).

// score_t[c][q] = factor·Σ_e2 dot(query_pairs[e2][q], key[c][e2]) for KEYS keys: a
// KEYS × QV register block (as ScoreBlock, two multiply-adds per lane and instruction).
template <int QV, int KEYS>
ATTEND_BF16_ATTR void ScoreBlockBf16(const uint32_t* HWY_RESTRICT query_pairs, const uint32_t* key,
                                     int64_t pairs, float factor, float* HWY_RESTRICT score_t) {
  constexpr int64_t tq = QV * 16;
  __m512 acc[KEYS][QV];
  _Pragma("GCC unroll 16") for (int c = 0; c < KEYS; ++c) {
    _Pragma("GCC unroll 16") for (int r = 0; r < QV; ++r) acc[c][r] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh q[QV];
    _Pragma("GCC unroll 16") for (int r = 0; r < QV; ++r) {
      q[r] = reinterpret_cast<__m512bh>(_mm512_load_si512(query_pairs + i * tq + r * 16));
    }
    _Pragma("GCC unroll 16") for (int c = 0; c < KEYS; ++c) {
      const auto k =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(key[c * pairs + i])));
      _Pragma("GCC unroll 16") for (int r = 0; r < QV; ++r) acc[c][r] =
          _mm512_dpbf16_ps(acc[c][r], q[r], k);
    }
  }
  const __m512 f = _mm512_set1_ps(factor);
  _Pragma("GCC unroll 16") for (int c = 0; c < KEYS; ++c) {
    _Pragma("GCC unroll 16") for (int r = 0; r < QV; ++r)
        _mm512_store_ps(score_t + c * tq + r * 16, _mm512_mul_ps(acc[c][r], f));
  }
}

// prob_pairs[j2][q] = (P[2·j2][q], P[2·j2 + 1][q]) rounded to bfloat16 (nearest even), from
// the probabilities score_t[j][q] of `keys` keys; an odd last key pairs with zero.
template <int QV>
ATTEND_BF16_ATTR void ProbabilityPairs(const float* HWY_RESTRICT score_t, int64_t keys,
                                       uint32_t* HWY_RESTRICT prob_pairs) {
  constexpr int64_t tq = QV * 16;
  // Lane i of the result takes element i (first key) and 16 + i (second key).
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t j = 0; j < keys; j += 2) {
    for (int r = 0; r < QV; ++r) {
      const __m512 first = _mm512_load_ps(score_t + j * tq + r * 16);
      const __m512 second =
          j + 1 < keys ? _mm512_load_ps(score_t + (j + 1) * tq + r * 16) : _mm512_setzero_ps();
      const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first));
      _mm512_store_si512(prob_pairs + (j / 2) * tq + r * 16,
                         _mm512_permutexvar_epi16(interleave, halves));
    }
  }
}

// out_t[c][q] = alpha[q]·out_t[c][q] + Σ_j2 dot(prob_pairs[j2][q], value[j2][c]) for COLS
// value columns and RQ query vectors from r0 (as ValueBlock).
template <int QV, int RQ, int COLS>
ATTEND_BF16_ATTR void ValueBlockBf16(const uint32_t* HWY_RESTRICT prob_pairs,
                                     const uint32_t* value_column, int64_t value_stride,
                                     int64_t pairs, const float* HWY_RESTRICT alpha, int r0,
                                     float* HWY_RESTRICT out_t_column) {
  constexpr int64_t tq = QV * 16;
  __m512 acc[RQ][COLS];
  _Pragma("GCC unroll 16") for (int r = 0; r < RQ; ++r) {
    const __m512 a = _mm512_load_ps(alpha + (r0 + r) * 16);
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) {
      acc[r][c] = _mm512_mul_ps(a, _mm512_load_ps(out_t_column + c * tq + (r0 + r) * 16));
    }
  }
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh prob[RQ];
    _Pragma("GCC unroll 16") for (int r = 0; r < RQ; ++r) {
      prob[r] = reinterpret_cast<__m512bh>(_mm512_load_si512(prob_pairs + i * tq + (r0 + r) * 16));
    }
    const uint32_t* v = value_column + i * value_stride;
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) {
      const auto vb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(v[c])));
      _Pragma("GCC unroll 16") for (int r = 0; r < RQ; ++r) acc[r][c] =
          _mm512_dpbf16_ps(acc[r][c], prob[r], vb);
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < RQ; ++r) {
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c)
        _mm512_store_ps(out_t_column + c * tq + (r0 + r) * 16, acc[r][c]);
  }
}
#endif  // ATTEND_BF16_PRODUCTS

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_BF16_PRODUCTS_INL_H_
