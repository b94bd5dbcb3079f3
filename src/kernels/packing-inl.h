// packing-inl.h: operand layouts of the query tiles: register transposes between the tiles'
// transposed layout (queries along the lanes) and row-major rows, and the per-thread
// contiguous copy of K and V whose rows interleave other heads'. Compiled once per Highway
// target (include after forward_common-inl.h).
#if defined(ATTEND_KERNELS_PACKING_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_PACKING_INL_H_
#undef ATTEND_KERNELS_PACKING_INL_H_
#else
#define ATTEND_KERNELS_PACKING_INL_H_
#endif

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>

#include "sdpa_params.hpp"
#include "shape_policy.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// x86 targets, whose vectors are whole 128-bit blocks (SSSE3/SSE4: 1, AVX2: 2, AVX3: 4).
#undef ATTEND_BLOCK_SHUFFLES
#if HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR
#define ATTEND_BLOCK_SHUFFLES 1
// In place, v[i] = row i of a kLanes × kLanes block of floats becomes v[i] = column i: the
// tiles' transposed layouts (queries along lanes) are converted to and from row-major with
// register shuffles instead of one scalar store per element, whose vector reloads would
// also stall store-to-load forwarding. Rows are taken 4 at a time: two interleave levels
// give, for each column k of a 128-bit block, the 4 rows' entries; whole blocks are then
// gathered across row groups.
HWY_INLINE void TransposeSquare(VF* v) {
  const DF d;
  const hn::Repartition<double, DF> d64;
  VF u[kLanes];
  for (int g = 0; g < kLanes / 4; ++g) {
    const VF* r = v + 4 * g;
    const auto t0 = hn::BitCast(d64, hn::InterleaveLower(d, r[0], r[1]));
    const auto t1 = hn::BitCast(d64, hn::InterleaveUpper(d, r[0], r[1]));
    const auto t2 = hn::BitCast(d64, hn::InterleaveLower(d, r[2], r[3]));
    const auto t3 = hn::BitCast(d64, hn::InterleaveUpper(d, r[2], r[3]));
    // Block b of u[4g + k]: rows 4g .. 4g + 3 of column 4b + k.
    u[4 * g + 0] = hn::BitCast(d, hn::InterleaveLower(d64, t0, t2));
    u[4 * g + 1] = hn::BitCast(d, hn::InterleaveUpper(d64, t0, t2));
    u[4 * g + 2] = hn::BitCast(d, hn::InterleaveLower(d64, t1, t3));
    u[4 * g + 3] = hn::BitCast(d, hn::InterleaveUpper(d64, t1, t3));
  }
  for (int k = 0; k < 4; ++k) {
#if HWY_TARGET <= HWY_AVX3
    // Column 4b + k = block b of u[k], u[4 + k], u[8 + k], u[12 + k].
    const __m512 x0 = _mm512_shuffle_f32x4(u[k].raw, u[4 + k].raw, 0x88);  // blocks 0, 2
    const __m512 x1 = _mm512_shuffle_f32x4(u[k].raw, u[4 + k].raw, 0xDD);  // blocks 1, 3
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + k].raw, u[12 + k].raw, 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + k].raw, u[12 + k].raw, 0xDD);
    v[k] = VF{_mm512_shuffle_f32x4(x0, y0, 0x88)};
    v[4 + k] = VF{_mm512_shuffle_f32x4(x1, y1, 0x88)};
    v[8 + k] = VF{_mm512_shuffle_f32x4(x0, y0, 0xDD)};
    v[12 + k] = VF{_mm512_shuffle_f32x4(x1, y1, 0xDD)};
#elif HWY_TARGET == HWY_AVX2
    v[k] = VF{_mm256_permute2f128_ps(u[k].raw, u[4 + k].raw, 0x20)};      // low blocks
    v[4 + k] = VF{_mm256_permute2f128_ps(u[k].raw, u[4 + k].raw, 0x31)};  // high blocks
#else
    v[k] = u[k];
#endif
  }
}
#else
#define ATTEND_BLOCK_SHUFFLES 0
#endif

// Query tiles read all of K and V once per tile. When the rows of K or V are not adjacent
// (heads interleaved, as in (N, L, H, D) views or the (N, L, 3, H, D) projections of a
// multi-head layer), a batch index's keys are spread over H (or 3H) times the memory, and
// every pass over them misses in L2 and the TLB: at unet's shape (L 4096, E 32) rows 384
// floats apart made the kernel 1.2–1.4× slower than contiguous ones. Each thread then first
// copies the K and V of the batch index it works on into a contiguous buffer of
// Lk·(E + Ev) floats (at most kMaxPackedFloats), which its tiles of that batch index read:
// one copy per thread and batch index against one pass per query tile. Only with several
// query tiles per batch index, and not for the chunks of a key split (few tiles).
// Queries per query tile at most (4 vectors, see query_tiles-inl.h).
constexpr int64_t kMaxTileQueries = 4 * kLanes;

bool ShouldPackKeysAndValues(const SdpaParams& p) {
  const bool interleaved = p.key_strides.row != p.head_dim || p.value_strides.row != p.value_dim;
  return interleaved && p.query_len > kMaxTileQueries &&
         FitsPackedFloats(p.key_len, p.head_dim, p.value_dim);
}

// One thread's contiguous copy of a batch index's K [Lk][E] and V [Lk][Ev] (allocated at the
// first use; null if that failed), and the operands it was copied from.
struct PackedOperands {
  hwy::AlignedFreeUniquePtr<float[]> buffer;
  const float* key_from = nullptr;
  const float* value_from = nullptr;
};

// Points `tile` at a contiguous copy of its K and V in `packed` (made when the thread's last
// copy was of other operands); leaves it reading the operands if the buffer cannot be
// allocated.
void PackKeysAndValues(const SdpaParams& p, PackedOperands& packed, Tile& tile) {
  const int64_t E = p.head_dim, Ev = p.value_dim;
  if (!packed.buffer) {
    packed.buffer = hwy::AllocateAligned<float>(static_cast<size_t>(p.key_len * (E + Ev)));
    if (!packed.buffer) return;
  }
  float* key = packed.buffer.get();
  float* value = key + p.key_len * E;
  if (packed.key_from != tile.key || packed.value_from != tile.value) {
    for (int64_t j = 0; j < p.key_len; ++j) {
      std::copy_n(tile.key + j * tile.key_stride, E, key + j * E);
      std::copy_n(tile.value + j * tile.value_stride, Ev, value + j * Ev);
    }
    packed.key_from = tile.key;
    packed.value_from = tile.value;
  }
  tile.key = key;
  tile.value = value;
  tile.key_stride = E;
  tile.value_stride = Ev;
}

// Half-precision K and V in the query tiles (SdpaParams::half_kv, bfloat16 or float16 inputs
// computed in float32): each thread widens the K [Lk][E] and V [Lk][Ev] of the batch index
// it works on into its contiguous float32 buffer (exactly: the tiles' arithmetic and results
// are those of float32 operands), which its tiles of that batch index read, in place of a
// float32 copy of the whole operands made before the call. The buffer (Lk·(E + Ev) floats, at
// most kMaxPackedFloats: the boundary sends larger ones as float32) is allocated with the
// workspace.
template <class Half>
void WidenRows(DType dtype, const uint16_t* from, int64_t stride, int64_t rows, int64_t n,
               float* to) {
  const DF d;
  const hn::Rebind<Half, DF> dh;
  for (int64_t j = 0; j < rows; ++j) {
    const uint16_t* row = from + j * stride;
    float* out = to + j * n;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const Half*>(row + i))), d,
                 out + i);
    }
    for (; i < n; ++i) out[i] = HalfToFloat(dtype, row[i]);
  }
}

void WidenKeysAndValues(const SdpaParams& p, PackedOperands& packed, Tile& tile) {
  const int64_t E = p.head_dim, Ev = p.value_dim;
  float* key = packed.buffer.get();
  float* value = key + p.key_len * E;
  // key_from and value_from record the half-precision operands, reinterpreted.
  const auto* key_from = reinterpret_cast<const float*>(tile.key_half);
  const auto* value_from = reinterpret_cast<const float*>(tile.value_half);
  if (packed.key_from != key_from || packed.value_from != value_from) {
    if (p.half_dtype == DType::kFloat16) {
      WidenRows<hwy::float16_t>(p.half_dtype, tile.key_half, tile.key_stride, p.key_len, E, key);
      WidenRows<hwy::float16_t>(p.half_dtype, tile.value_half, tile.value_stride, p.key_len, Ev,
                                value);
    } else {
      WidenRows<hwy::bfloat16_t>(p.half_dtype, tile.key_half, tile.key_stride, p.key_len, E, key);
      WidenRows<hwy::bfloat16_t>(p.half_dtype, tile.value_half, tile.value_stride, p.key_len, Ev,
                                 value);
    }
    packed.key_from = key_from;
    packed.value_from = value_from;
  }
  tile.key = key;
  tile.value = value;
  tile.key_stride = E;
  tile.value_stride = Ev;
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_PACKING_INL_H_
