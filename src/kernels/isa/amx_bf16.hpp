// amx_bf16.hpp: bfloat16 matrix products on AMX tiles (AMX-TILE, AMX-BF16: Intel Sapphire
// Rapids and later), the tile configuration they run under, and the operand layouts.
// Compiled with function-level target attributes, so one binary runs on any x86-64: callers
// reach these only where detail::amx_bf16_products() (cpu_features.hpp) says the CPU, the OS
// and attend's switches allow them. Declared on x86-64 only.
//
// tdpbf16ps (Intel SDM vol. 2, TDPBF16PS): with A a tile of M rows of 2K bfloat16 and B a
// tile of K rows of N bfloat16 pairs ("VNNI pairs"),
//   C[m][n] += Σ_k A[m][2k]·B[k][n].lo + A[m][2k+1]·B[k][n].hi   (float32 C),
// each product of two bfloat16 exact in float32, the pair's sum rounded to nearest even,
// denormal inputs and outputs flushed to zero, MXCSR ignored: the arithmetic of vdpbf16ps,
// which the AVX512_BF16 path runs, so both paths share one error model (tests/bf16_test.cc).
#pragma once

#include <hwy/aligned_allocator.h>

#include <cstdint>

#if defined(__x86_64__)
namespace attend::detail::amx {

// Every tile is configured as 16 rows of 64 bytes (palette 1): C blocks of 16 × 16 float32,
// A blocks of 16 rows × 32 bfloat16, B blocks of 16 rows × 16 pairs.
constexpr int64_t kTileRows = 16;  // rows of C and A per block; pairs of B per step
constexpr int64_t kTileDepth = 32;  // bfloat16 of an A row per step (2·kTileRows)

// Loads the tile configuration on the calling thread (ldtilecfg) and releases the tiles
// (tilerelease) when it goes out of scope: around one work item, so that nothing else on the
// thread (another library's tiles) runs between configuration and use.
class TileScope {
 public:
  TileScope();
  ~TileScope();
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// C[m][n] (+)= Σ_k A[m][k]·B[k][n] for m < rows, n < cols, k < depth, inside a TileScope:
//   a: bfloat16, row m at a + m·lda (elements);
//   b: bfloat16 pairs (VNNI): B[2i][n] and B[2i+1][n] as the low and high halves of
//      b[i·ldb + n] (words);
//   c: float32, row m at c + m·ldc; added to when `accumulate`, else overwritten.
// rows and cols multiples of kTileRows, depth a multiple of kTileDepth (the callers pad
// with zeros). The blocks: 2 × 2 C tiles at a time (32 rows × 32 columns), each step loading
// two A and two B tiles for four tdpbf16ps.
void GemmBf16(int64_t rows, int64_t cols, int64_t depth, const uint16_t* a, int64_t lda,
              const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate);

// The peak probe (bench/fma_peak.cc): `rounds` × 4 tdpbf16ps on four independent C tiles
// from fixed A and B tiles, inside a TileScope of its own. Returns the FLOPs (2 per
// multiply-add, 16·16·32 multiply-adds per instruction); *checksum depends on every tile.
double RunPeakChains(int64_t rounds, float* checksum);

// Rounds n up to a multiple of `to`.
constexpr int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// One thread's operands of the query tiles' two products on tiles (fused_sdpa.cc:
// scores S = K·Qᵀ and out += Vᵀ·P, in the tiles' transposed layout, rows keys or value
// columns, columns the tile's queries):
//   query_pairs [E'/2][Tq]   pairs of Q along E, E' = E rounded up to kTileDepth, rows past
//                            E/2 zero (the B operand of S);
//   prob_pairs  [Tk'/2][Tq]  pairs of P along the keys, Tk' = the key tile rounded up to
//                            kTileDepth (the B operand of out);
//   key         [Lk + 32][E']   K rows of the span, zero past E and past the span's keys
//                               (the A operand of S);
//   value_t     [Ev'][Lk' + 32] Vᵀ of the span, Ev' = Ev rounded up to kTileRows, zero past
//                               the span's keys and past Ev (the A operand of out).
// Packed once per thread and span (the tiles of one batch index reuse it): about
// Lk·(E' + Ev')·2 bytes per thread, which the boundary bounds (FitsAmxTiles,
// shape_policy.hpp).
struct TileOperands {
  hwy::AlignedFreeUniquePtr<uint32_t[]> query_pairs;
  hwy::AlignedFreeUniquePtr<uint32_t[]> prob_pairs;
  hwy::AlignedFreeUniquePtr<uint16_t[]> key;
  hwy::AlignedFreeUniquePtr<uint16_t[]> value_t;
  int64_t depth = 0;         // E'
  int64_t value_rows = 0;    // Ev'
  int64_t value_stride = 0;  // row stride of value_t, in bfloat16
  const uint16_t* key_from = nullptr;  // the span packed last
  const uint16_t* value_from = nullptr;
  int64_t begin = -1, count = 0;

  // Sizes for head_dim E, value_dim Ev, spans of at most key_len keys, tq queries per tile
  // and key tiles of key_tile keys; false when an allocation fails.
  bool Allocate(int64_t head_dim, int64_t value_dim, int64_t key_len, int64_t tq,
                int64_t key_tile);
  // K (row stride key_stride) and V (row stride value_stride_in) of keys
  // [span_begin, span_begin + span_count), head_dim and value_dim wide, packed unless that span
  // is the one packed last.
  void Pack(const uint16_t* key_rows, int64_t key_stride, const uint16_t* value_rows,
            int64_t value_stride_in, int64_t head_dim, int64_t value_dim, int64_t span_begin,
            int64_t span_count);
};

}  // namespace attend::detail::amx
#endif  // __x86_64__
