// amx_bf16.cc: see amx_bf16.hpp. The tile numbers of the intrinsics are immediates, so the
// block shapes are template arguments: tiles 0-3 hold C, 4-5 A, 6-7 B.
#include "kernels/isa/amx_bf16.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace attend::detail::amx {
namespace {

#define ATTEND_AMX_ATTR __attribute__((target("amx-tile,amx-bf16")))

// The 64-byte tile configuration (Intel SDM vol. 1, 3.3 "palette 1"): bytes 16-31 hold the
// bytes per row of tiles 0-7 (two bytes each), bytes 48-55 their rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

const TileConfig& config() {
  static const TileConfig c = [] {
    TileConfig t;
    for (int i = 0; i < 8; ++i) {
      t.bytes_per_row[i] = 64;
      t.rows[i] = static_cast<uint8_t>(kTileRows);
    }
    return t;
  }();
  return c;
}

// One block of MB × NB C tiles (MB, NB in {1, 2}) at c: rows 16·MB, columns 16·NB.
template <int MB, int NB>
ATTEND_AMX_ATTR void Block(int64_t depth, const uint16_t* a, int64_t lda, const uint32_t* b,
                           int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  const int64_t a_bytes = lda * 2, b_bytes = ldb * 4, c_bytes = ldc * 4;
  float* c01 = c + 16;
  float* c10 = c + 16 * ldc;
  float* c11 = c10 + 16;
  if (accumulate) {
    _tile_loadd(0, c, c_bytes);
    if constexpr (NB == 2) _tile_loadd(1, c01, c_bytes);
    if constexpr (MB == 2) _tile_loadd(2, c10, c_bytes);
    if constexpr (MB == 2 && NB == 2) _tile_loadd(3, c11, c_bytes);
  } else {
    _tile_zero(0);
    if constexpr (NB == 2) _tile_zero(1);
    if constexpr (MB == 2) _tile_zero(2);
    if constexpr (MB == 2 && NB == 2) _tile_zero(3);
  }
  for (int64_t k = 0; k < depth; k += kTileDepth) {
    const uint16_t* a0 = a + k;
    const uint32_t* b0 = b + (k / 2) * ldb;
    _tile_loadd(4, a0, a_bytes);
    _tile_loadd(6, b0, b_bytes);
    if constexpr (MB == 2) _tile_loadd(5, a0 + 16 * lda, a_bytes);
    if constexpr (NB == 2) _tile_loadd(7, b0 + 16, b_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MB == 2 && NB == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_bytes);
  if constexpr (NB == 2) _tile_stored(1, c01, c_bytes);
  if constexpr (MB == 2) _tile_stored(2, c10, c_bytes);
  if constexpr (MB == 2 && NB == 2) _tile_stored(3, c11, c_bytes);
}

template <int MB>
void BlockRow(int64_t cols, int64_t depth, const uint16_t* a, int64_t lda, const uint32_t* b,
              int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  int64_t n = 0;
  for (; n + 32 <= cols; n += 32) Block<MB, 2>(depth, a, lda, b + n, ldb, c + n, ldc, accumulate);
  if (n < cols) Block<MB, 1>(depth, a, lda, b + n, ldb, c + n, ldc, accumulate);
}

// (Constructors do not take target attributes in GCC 12: plain functions do.)
ATTEND_AMX_ATTR void LoadConfig() { _tile_loadconfig(&config()); }
ATTEND_AMX_ATTR void Release() { _tile_release(); }

}  // namespace

TileScope::TileScope() { LoadConfig(); }

TileScope::~TileScope() { Release(); }

void GemmBf16(int64_t rows, int64_t cols, int64_t depth, const uint16_t* a, int64_t lda,
              const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  int64_t m = 0;
  for (; m + 32 <= rows; m += 32) {
    BlockRow<2>(cols, depth, a + m * lda, lda, b, ldb, c + m * ldc, ldc, accumulate);
  }
  if (m < rows) BlockRow<1>(cols, depth, a + m * lda, lda, b, ldb, c + m * ldc, ldc, accumulate);
}

ATTEND_AMX_ATTR double RunPeakChains(int64_t rounds, float* checksum) {
  alignas(64) uint16_t a[kTileRows * kTileDepth];
  alignas(64) float c[4][kTileRows * kTileRows];
  std::fill_n(a, kTileRows * kTileDepth, uint16_t{0x3380});  // 2^-24: sums stay small
  const TileScope tiles;
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, a, 64);
  _tile_loadd(7, a, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t r = 0; r < rounds; ++r) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  *checksum = c[0][0] + c[1][17] + c[2][100] + c[3][255];
  return 4.0 * 2.0 * static_cast<double>(rounds) * kTileRows * kTileRows * kTileDepth;
}

bool TileOperands::Allocate(int64_t head_dim, int64_t value_dim, int64_t key_len, int64_t tq,
                            int64_t key_tile) {
  depth = RoundUp(head_dim, kTileDepth);
  value_rows = RoundUp(value_dim, kTileRows);
  value_stride = RoundUp(key_len, kTileDepth) + kTileDepth;
  const auto zeroed = [](auto& ptr, int64_t n) {
    using T = std::remove_reference_t<decltype(ptr[0])>;
    ptr = hwy::AllocateAligned<T>(static_cast<size_t>(n));
    if (ptr) std::fill_n(ptr.get(), n, T{0});
    return ptr != nullptr;
  };
  return zeroed(query_pairs, depth / 2 * tq) &&
         zeroed(prob_pairs, RoundUp(key_tile, kTileDepth) / 2 * tq) &&
         zeroed(key, (key_len + kTileDepth) * depth) && zeroed(value_t, value_rows * value_stride);
}

void TileOperands::Pack(const uint16_t* key_rows, int64_t key_stride, const uint16_t* value_rows,
                        int64_t value_stride_in, int64_t head_dim, int64_t value_dim,
                        int64_t span_begin, int64_t span_count) {
  if (key_from == key_rows && value_from == value_rows && begin == span_begin &&
      count == span_count) {
    return;
  }
  // K rows as they are (the padding past E stays zero from Allocate); then zero rows past
  // the span, which the last block of 16 keys may read.
  for (int64_t j = 0; j < span_count; ++j) {
    std::memcpy(key.get() + j * depth, key_rows + (span_begin + j) * key_stride,
                static_cast<size_t>(head_dim) * sizeof(uint16_t));
  }
  std::fill_n(key.get() + span_count * depth, kTileDepth * depth, uint16_t{0});
  // Vᵀ: a block of 32 keys at a time, so that the writes stay in few lines.
  for (int64_t j0 = 0; j0 < span_count; j0 += kTileDepth) {
    const int64_t j1 = std::min(span_count, j0 + kTileDepth);
    for (int64_t c = 0; c < value_dim; ++c) {
      uint16_t* out = value_t.get() + c * value_stride;
      for (int64_t j = j0; j < j1; ++j) out[j] = value_rows[(span_begin + j) * value_stride_in + c];
    }
  }
  for (int64_t c = 0; c < value_dim; ++c) {
    std::fill_n(value_t.get() + c * value_stride + span_count, kTileDepth, uint16_t{0});
  }
  key_from = key_rows;
  value_from = value_rows;
  begin = span_begin;
  count = span_count;
}

}  // namespace attend::detail::amx
#endif  // __x86_64__
