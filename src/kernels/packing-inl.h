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

// One thread's contiguous float32 copy of a batch index's K [Lk][E] and V [Lk][Ev], and the
// operands it was copied from. Made for two reasons (shape_policy.hpp):
//  - float32 K/V whose rows interleave other heads' (ShouldPackKeysAndValues; allocated at
//    the first use, null if that failed);
//  - half-precision K/V computed in float32 (SdpaParams::half_kv: bfloat16, or float16 where
//    the target widens exactly), widened here once per thread and batch index in place of a
//    float32 copy of the whole operands before the call; the tiles' arithmetic and results
//    are those of float32 operands. Allocated with the workspace (the boundary sends
//    operands beyond kMaxPackedFloats as float32).
struct PackedOperands {
  hwy::AlignedFreeUniquePtr<float[]> buffer;
  const void* key_from = nullptr;
  const void* value_from = nullptr;
};

// to[j][0, n) = from[j·stride + i] widened to float32, for rows j < rows.
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

// Points `tile` at a contiguous float32 copy of its K and V in `packed` (made when the
// thread's last copy was of other operands); leaves float32 operands read in place if the
// buffer cannot be allocated.
void PackKeysAndValues(const SdpaParams& p, PackedOperands& packed, Tile& tile) {
  const int64_t E = p.head_dim, Ev = p.value_dim;
  if (!packed.buffer) {
    packed.buffer = hwy::AllocateAligned<float>(static_cast<size_t>(p.key_len * (E + Ev)));
    if (!packed.buffer) return;
  }
  float* key = packed.buffer.get();
  float* value = key + p.key_len * E;
  const void* key_from = tile.key ? static_cast<const void*>(tile.key) : tile.key_half;
  const void* value_from = tile.value ? static_cast<const void*>(tile.value) : tile.value_half;
  if (packed.key_from != key_from || packed.value_from != value_from) {
    if (tile.key) {
      for (int64_t j = 0; j < p.key_len; ++j) {
        std::copy_n(tile.key + j * tile.key_stride, E, key + j * E);
        std::copy_n(tile.value + j * tile.value_stride, Ev, value + j * Ev);
      }
    } else if (p.half_dtype == DType::kFloat16) {
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
