// query_tiles-inl.h: the query-tile kernel (TileAttention): a tile of up to 4 vectors of
// queries along the lanes against key tiles of 128, the online-softmax recurrence per lane
// (see fused_sdpa.cc), register blocks for Q·Kᵀ and P·V, key tiles the score rules exclude
// never visited. Compiled once per Highway target (include after packing-inl.h and the
// products files of isa/).
#if defined(ATTEND_KERNELS_QUERY_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_QUERY_TILES_INL_H_
#undef ATTEND_KERNELS_QUERY_TILES_INL_H_
#else
#define ATTEND_KERNELS_QUERY_TILES_INL_H_
#endif

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "dropout.hpp"
#include "kernels/isa/bf16_pairs.hpp"
#include "kv_format.hpp"
#include "score_rule_layer.hpp"
#include "sdpa_params.hpp"
#include "shape_policy.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Key tile: 128 keys. The score tile (128 × Tq floats, 32 KiB at Tq = 64) stays in L1 while
// it is exponentiated and multiplied by V (BENCHMARKS.md: tile sizes).
constexpr int64_t kKeyTile = 128;
// At most 4 query vectors per tile (shape_policy.hpp: TileVectors).
constexpr int kMaxQueryVectors = static_cast<int>(kMaxTileVectors);
// Register blocks: the query vectors of a tile (QV, up to 4) × kScoreKeys keys of score
// accumulators, and the same query vectors × kValueColumns value columns of output
// accumulators, kAccumulators in all. 32-register targets: 24 (4×6: 4 + 6 loads per 24
// FMAs; 2×12 for tiles of 2 vectors; BENCHMARKS.md: tile sizes).
// 16-register targets: 8, leaving room for the operands.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kAccumulators = 24;
#else
constexpr int kAccumulators = 8;
#endif

// bfloat16 products (Products: a struct of isa/, e.g. Avx512Bf16): the query tile's
// operands as bfloat16 pairs (isa/bf16_pairs.hpp). A lane is one query, so
//   S:   A = K's pairs along E (rows: keys),            B = the tile's Q pairs [E/2][Tq];
//   P·V: A = V's pairs across keys, transposed (rows: value columns), B = P's pairs [Tk/2][Tq].
// Odd E or an odd key count pad the last pair with a zero. The probabilities P are rounded
// to bfloat16 (nearest even) for the product; the softmax's sum l keeps them in float32, so
// the output carries a relative error of at most 2^-9 per weight on top of the inputs'
// rounding (tests/error_model.hpp).

// K and V as stored (SdpaParams::kv_format) into bfloat16 pairs (Bf16Operands::Pack), a
// vector of kLanes elements at a time: each format widened to float32 by the row groups' load
// (kv_loads-inl.h: LoadKV, times its unit kKvUnit), then to bfloat16 (nearest even,
// bf16_from_f32). int8 codes (at most 127 in magnitude: 7 bits), fp8 codes (E4M3 and E5M2: 3
// and 2 mantissa bits, exponents within bfloat16's) and bfloat16 are exact in bfloat16, so for
// them the rounding is the identity; float16 and float32 round (2^-9 relative).
template <DType K>
HWY_INLINE VF WidenStored(DF d, const void* src) {
  const VF x = LoadKV<K>(d, static_cast<KvPtr<K>>(src));
  if constexpr (kKvUnit<K> != 1.0f) return hn::Mul(x, hn::Set(d, kKvUnit<K>));
  return x;
}

// The bfloat16 of each lane of x in the high half of its 32-bit lane, the low half zero:
// bf16_from_f32's rounding (nearest even; NaN stays a quiet NaN), skipped for the formats
// bfloat16 holds exactly (EXACT).
template <bool EXACT>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> Bf16High(DF d, VF x) {
  const hn::RebindToUnsigned<DF> du;
  const auto bits = hn::BitCast(du, x);
  const auto high = hn::Set(du, 0xFFFF0000u);
  if constexpr (EXACT) return hn::And(bits, high);
  const auto rounded =
      hn::Add(bits, hn::Add(hn::Set(du, 0x7FFFu), hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u))));
  const auto nan = hn::RebindMask(du, hn::IsNaN(x));
  (void)d;
  return hn::And(hn::IfThenElse(nan, hn::Or(bits, hn::Set(du, 0x00400000u)), rounded), high);
}

// One thread's bfloat16 operands of its current query tile and K/V span (allocated at the
// first use by a call that computes in bfloat16; null otherwise).
struct Bf16Operands {
  hwy::AlignedFreeUniquePtr<uint32_t[]> query_pairs;  // [E/2][Tq]
  hwy::AlignedFreeUniquePtr<uint32_t[]> prob_pairs;   // [Tk/2][Tq]
  hwy::AlignedFreeUniquePtr<uint32_t[]> packed;       // key [count][E/2], then value [count/2][Ev]
  // The span's per-key scales of the scaled formats (int8, fp8; else null), [count] each.
  hwy::AlignedFreeUniquePtr<float[]> scales;          // key's [Lk], then value's [Lk]
  hwy::AlignedFreeUniquePtr<int64_t[]> slots;         // [Lk]: the span's storage rows (SpanSlots)
  int64_t packed_words = 0;
  const void* key_from = nullptr;  // the span packed last: operands and first key
  const void* value_from = nullptr;
  int64_t begin = -1, count = 0;
  const uint32_t* key = nullptr;    // packed K of the span: row j − begin
  const uint32_t* value = nullptr;  // packed V of the span: pair row (j − begin) / 2
  const float* key_scale = nullptr;    // scale of key j at [j − begin], or null
  const float* value_scale = nullptr;  // the same for V

  bool Allocate(const SdpaParams& p, int64_t tq, int64_t key_tile) {
    if (!p.half_products()) return true;
    query_pairs = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(PairsOf(p.head_dim) * tq));
    prob_pairs = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(PairsOf(key_tile) * tq));
    packed_words = PackedWords(p, p.key_len);
    packed = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(packed_words));
    if (p.key_scales != nullptr) {
      scales = hwy::AllocateAligned<float>(static_cast<size_t>(2 * std::max<int64_t>(p.key_len, 1)));
      if (!scales) return false;
    }
    if (p.bf16_kv_products) {
      slots = hwy::AllocateAligned<int64_t>(static_cast<size_t>(std::max<int64_t>(p.key_len, 1)));
      if (!slots) return false;
    }
    return query_pairs && prob_pairs && packed;
  }

  // Words of a packed span of `count` keys (at most PackedWords(p, Lk), the size allocated:
  // Lk·(E + Ev)·2 bytes per thread, which the boundary bounds by kMaxPackedBf16Bytes).
  static int64_t PackedWords(const SdpaParams& p, int64_t count) {
    return count * PairsOf(p.head_dim) + PairsOf(count) * p.value_dim;
  }

  // K and V of keys [begin, begin + count) of the tile's batch index, packed (once per
  // thread and span; the tiles of one batch index reuse it): half-precision operands of the
  // products (tile.key_half: bfloat16, or float16 for float16 products) copied as they are;
  // K and V as stored (bf16_kv_products: any kv_format, or float32) widened to bfloat16
  // (WidenStored, Bf16High), key j read from storage row p.key_slot(j) (the block table's
  // row map, a block at a time: SpanSlots), with their scales. The grouped-query tiles read a span once, and still copy K:
  // the copy streams K in order, where the score blocks' 12 rows 512 B apart would each wait
  // on memory (BENCHMARKS.md, "Speculative verification as compute tiles").
  void Pack(const SdpaParams& p, const Tile& tile, int64_t span_begin, int64_t span_count) {
    const void* key_rows = tile.key_half;
    const void* value_rows = tile.value_half;
    if (key_rows == nullptr) {
      key_rows = tile.key_stored != nullptr ? tile.key_stored : tile.key;
      value_rows = tile.value_stored != nullptr ? tile.value_stored : tile.value;
    }
    if (key_from == key_rows && value_from == value_rows && begin == span_begin &&
        count == span_count) {
      return;
    }
    const int64_t e2 = PairsOf(p.head_dim);
    uint32_t* k = packed.get();
    uint32_t* v = k + span_count * e2;
    if (tile.key_half != nullptr) {
      const int64_t ks = tile.key_stride, vs = tile.value_stride;
      for (int64_t j = 0; j < span_count; ++j) {
        HalfPairsAlongRow(tile.key_half + p.key_slot(span_begin + j) * ks, p.head_dim, k + j * e2, 1);
      }
      for (int64_t j = 0; j < span_count; j += 2) {
        const uint16_t* v0 = tile.value_half + p.key_slot(span_begin + j) * vs;
        const uint16_t* v1 =
            j + 1 < span_count ? tile.value_half + p.key_slot(span_begin + j + 1) * vs : nullptr;
        HalfPairsAcrossRows(v0, v1, p.value_dim, v + (j / 2) * p.value_dim);
      }
      key_scale = value_scale = nullptr;
    } else {
      switch (p.stored_kv() ? p.kv_format : DType::kFloat32) {
        case DType::kFloat16:
          PackStored<DType::kFloat16>(p, tile, span_begin, span_count, k, v);
          break;
        case DType::kBFloat16:
          PackStored<DType::kBFloat16>(p, tile, span_begin, span_count, k, v);
          break;
        case DType::kInt8:
          PackStored<DType::kInt8>(p, tile, span_begin, span_count, k, v);
          break;
        case DType::kFloat8E4M3:
          PackStored<DType::kFloat8E4M3>(p, tile, span_begin, span_count, k, v);
          break;
        case DType::kFloat8E5M2:
          PackStored<DType::kFloat8E5M2>(p, tile, span_begin, span_count, k, v);
          break;
        default:
          PackStored<DType::kFloat32>(p, tile, span_begin, span_count, k, v);
          break;
      }
    }
    key_from = key_rows;
    value_from = value_rows;
    begin = span_begin;
    count = span_count;
    key = k;
    value = v;
  }

 private:
  // Pack's K and V as stored in format F: K row j as bfloat16 pairs along E (the row's
  // bfloat16 elements in order, an odd E padded with a zero), V rows j and j + 1 as pairs
  // across them ((V[j][c], V[j + 1][c]); an odd count's last row paired with zeros); the
  // scales of the span's keys into `scales`.
  template <DType F>
  void PackStored(const SdpaParams& p, const Tile& tile, int64_t span_begin, int64_t span_count,
                  uint32_t* HWY_RESTRICT k, uint32_t* HWY_RESTRICT v) {
    constexpr bool kExact = F != DType::kFloat32 && F != DType::kFloat16;
    const DF d;
    const hn::RebindToUnsigned<DF> du;
    const hn::RebindToSigned<DF> di;
    const hn::Rebind<uint16_t, DF> du16;
    const auto element = static_cast<int64_t>(dtype_size(F));
    const auto* key_base = static_cast<const char*>(tile.key_stored ? tile.key_stored
                                                                    : static_cast<const void*>(tile.key));
    const auto* value_base = static_cast<const char*>(
        tile.value_stored ? tile.value_stored : static_cast<const void*>(tile.value));
    const int64_t key_row_bytes = tile.key_stride * element;
    const int64_t value_row_bytes = tile.value_stride * element;
    const int64_t e = p.head_dim, ev = p.value_dim, e2 = PairsOf(e);
    const auto bf16_at = [&](const char* row, int64_t i) -> uint32_t {
      return bf16_from_f32(widen_kv(F, row, i));
    };
    float* key_scales = scales.get();
    float* value_scales = key_scales ? key_scales + p.key_len : nullptr;
    int64_t* slot_of = slots.get();  // slot_of[j]: key span_begin + j's storage row
    SpanSlots(p, span_begin, span_count, slot_of);
    // Rows kPackAhead keys on are prefetched: a block table's runs of rows (and the other
    // heads' rows between a head's) are too short for the hardware prefetchers, and the copy
    // would otherwise wait on memory at each row.
    constexpr int64_t kPackAhead = 16;
    const auto prefetch = [](const char* row, int64_t bytes) {
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 0, 0);
    };
    for (int64_t j = 0; j < span_count; ++j) {
      const int64_t slot = slot_of[j];
      const char* row = key_base + slot * key_row_bytes;
      if (j + kPackAhead < span_count) {
        prefetch(key_base + slot_of[j + kPackAhead] * key_row_bytes, e * element);
      }
      auto* out = reinterpret_cast<uint16_t*>(k + j * e2);
      int64_t i = 0;
      for (; i + kLanes <= e; i += kLanes) {
        const auto high = Bf16High<kExact>(d, WidenStored<F>(d, row + i * element));
        hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, hn::ShiftRight<16>(high))), du16, out + i);
      }
      for (; i < e; ++i) out[i] = static_cast<uint16_t>(bf16_at(row, i));
      if (e % 2) out[e] = 0;
      if (key_scales) key_scales[j] = tile.key_scales[slot * p.key_scale_strides.row];
    }
    for (int64_t j = 0; j < span_count; j += 2) {
      const int64_t slot0 = slot_of[j];
      const bool pair = j + 1 < span_count;
      const int64_t slot1 = pair ? slot_of[j + 1] : slot0;
      const char* row0 = value_base + slot0 * value_row_bytes;
      const char* row1 = value_base + slot1 * value_row_bytes;
      for (int64_t a = j + kPackAhead; a < std::min(j + kPackAhead + 2, span_count); ++a) {
        prefetch(value_base + slot_of[a] * value_row_bytes, ev * element);
      }
      uint32_t* out = v + (j / 2) * ev;
      int64_t c = 0;
      for (; c + kLanes <= ev; c += kLanes) {
        const auto lo = hn::ShiftRight<16>(Bf16High<kExact>(d, WidenStored<F>(d, row0 + c * element)));
        const auto hi = pair ? Bf16High<kExact>(d, WidenStored<F>(d, row1 + c * element)) : hn::Zero(du);
        hn::StoreU(hn::Or(lo, hi), du, out + c);
      }
      for (; c < ev; ++c) out[c] = bf16_at(row0, c) | (pair ? bf16_at(row1, c) << 16 : 0u);
      if (value_scales) {
        value_scales[j] = tile.value_scales[slot0 * p.value_scale_strides.row];
        if (pair) value_scales[j + 1] = tile.value_scales[slot1 * p.value_scale_strides.row];
      }
    }
    key_scale = key_scales;
    value_scale = value_scales;
  }
};

// query_pairs[e2][r] = (Q_r[2·e2], Q_r[2·e2 + 1]) for rows r < rows (the rest zero), Q_r
// the query row row_of(r) points at: bfloat16 as it is, float32 rounded to bfloat16 (nearest
// even, bf16_from_f32); unscaled: the scale is applied to the float32 scores.
template <class RowOf>
inline void LoadQueryPairs(const SdpaParams& p, const RowOf& row_of, int64_t rows, int64_t tq,
                           uint32_t* HWY_RESTRICT query_pairs) {
  const int64_t e2 = PairsOf(p.head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    const auto* q = row_of(r);
    if constexpr (std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(q)>>, float>) {
      for (int64_t i = 0; i < e2; ++i) {
        const int64_t e = 2 * i;
        query_pairs[i * tq + r] = PairOfFloats(q[e], e + 1 < p.head_dim ? q[e + 1] : 0.0f);
      }
    } else {
      HalfPairsAlongRow(q, p.head_dim, query_pairs + r, tq);
    }
  }
  for (int64_t i = 0; i < e2; ++i)
    std::fill(query_pairs + i * tq + rows, query_pairs + (i + 1) * tq, 0u);
}

// Whether a products struct takes its operands in the AMX tiles' layout (amx::TileOperands,
// ws.amx: K rows and Vᵀ zero-padded to whole tiles) rather than Bf16Operands (ws.bf16).
template <class Products>
constexpr bool kTakesTileOperands = requires { Products::kTileOperands; };

// Per-thread scratch, allocated once per call and thread (never in the tile loops).
struct Workspace {
  hwy::AlignedFreeUniquePtr<float[]> query_t;    // [E][Tq]   scaled, transposed queries
  hwy::AlignedFreeUniquePtr<float[]> score_t;    // [Tk][Tq]  scores, then probabilities
  hwy::AlignedFreeUniquePtr<float[]> out_t;      // [Ev][Tq]  unnormalized output
  hwy::AlignedFreeUniquePtr<float[]> row_max;    // [Tq]      running max m (log2 domain)
  hwy::AlignedFreeUniquePtr<float[]> row_sum;    // [Tq]      running sum l
  hwy::AlignedFreeUniquePtr<float[]> alpha;      // [Tq]      rescale factor of this key tile
  hwy::AlignedFreeUniquePtr<float[]> score_max;  // [Tq]      max of this key tile's scores
  hwy::AlignedFreeUniquePtr<float[]> point;      // [Tq]      reference point m' (ExpValueBlock)
  hwy::AlignedFreeUniquePtr<uint8_t[]> visible;  // [Tq]      some key not excluded so far
  hwy::AlignedFreeUniquePtr<float[]> tile_max;   // [Lk/Tk][Tq] reference point per key tile
  hwy::AlignedFreeUniquePtr<int64_t[]> visited;  // [Lk/Tk]    first key of each visited tile
  RowRules row_rules;                            // the tile's rows' visible keys and documents
  KeepTile keep;                                 // [Tk][Tq]  pairwise rules' verdicts
  PackedOperands packed;                         // see PackKeysAndValues
  Bf16Operands bf16;                             // bfloat16 products only: see Bf16Operands
#if ATTEND_AMX_BF16
  amx::TileOperands amx;                         // the same on AMX tiles (p.amx_tiles)
#endif

  explicit Workspace(const SdpaParams& p) {
    const int64_t tq = kMaxQueryVectors * kLanes;
    query_t = hwy::AllocateAligned<float>(static_cast<size_t>(p.head_dim * tq));
    score_t = hwy::AllocateAligned<float>(static_cast<size_t>(kKeyTile * tq));
    // Rows up to a multiple of 16 for the AMX tiles (the rows past Ev stay zero).
    const int64_t out_rows = (std::max<int64_t>(p.value_dim, 1) + 15) / 16 * 16;
    out_t = hwy::AllocateAligned<float>(static_cast<size_t>(out_rows * tq));
    if (out_t) std::fill_n(out_t.get(), out_rows * tq, 0.0f);
    row_max = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    row_sum = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    alpha = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    score_max = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    point = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    visible = hwy::AllocateAligned<uint8_t>(static_cast<size_t>(tq));
    const int64_t key_tiles = (p.key_len + kKeyTile - 1) / kKeyTile;
    tile_max = hwy::AllocateAligned<float>(static_cast<size_t>((p.weights ? key_tiles : 1) * tq));
    visited = hwy::AllocateAligned<int64_t>(static_cast<size_t>(p.weights ? key_tiles : 1));
    row_rules.Allocate(tq);
    if (has_pairwise_rules(p)) keep.Allocate(kKeyTile, tq);
#if ATTEND_AMX_BF16
    if (p.bf16_products() && p.amx_tiles) {
      operands_ok = amx.Allocate(p.head_dim, p.value_dim, p.key_len, tq, kKeyTile);
      return;
    }
#endif
    operands_ok = bf16.Allocate(p, tq, kKeyTile);
    if (p.half_kv() && !p.half_products()) {  // see PackedOperands
      packed.buffer = hwy::AllocateAligned<float>(
          static_cast<size_t>(std::max<int64_t>(p.key_len * (p.head_dim + p.value_dim), 1)));
      operands_ok = operands_ok && packed.buffer;
    }
  }
  bool operands_ok = true;
  bool ok() const {
    return query_t && score_t && out_t && row_max && row_sum && alpha && score_max && point &&
           visible &&
           tile_max &&
           visited && row_rules.ok() && keep.ok() && operands_ok;
  }
};

// score_t[j][q] = Σ_e query_t[e][q]·K[k0 + j][e] for KEYS keys starting at key_row:
// a KEYS × QV register block of accumulators, K entries broadcast from memory.
// With score_max (not null; [QV·lanes]): score_max[q] = max(score_max[q], max_j score_t[j][q])
// as well, from the accumulators (the max and add ports are idle beside the FMAs).
template <int QV, int KEYS>
HWY_INLINE void ScoreBlock(const float* HWY_RESTRICT query_t, const float* key_row,
                           int64_t key_stride, int64_t head_dim, float* HWY_RESTRICT score_t,
                           float* HWY_RESTRICT score_max) {
  const DF d;
  constexpr int64_t tq = QV * kLanes;
  VF acc[KEYS][QV];
  for (int c = 0; c < KEYS; ++c) {
    for (int r = 0; r < QV; ++r) acc[c][r] = hn::Zero(d);
  }
  for (int64_t e = 0; e < head_dim; ++e) {
    VF q[QV];
    for (int r = 0; r < QV; ++r) q[r] = hn::Load(d, query_t + e * tq + r * kLanes);
    for (int c = 0; c < KEYS; ++c) {
      const VF k = hn::Set(d, key_row[c * key_stride + e]);
      for (int r = 0; r < QV; ++r) acc[c][r] = hn::MulAdd(q[r], k, acc[c][r]);
    }
  }
  for (int c = 0; c < KEYS; ++c) {
    for (int r = 0; r < QV; ++r) hn::Store(acc[c][r], d, score_t + c * tq + r * kLanes);
  }
  if (score_max == nullptr) return;
  for (int r = 0; r < QV; ++r) {
    VF m = hn::Load(d, score_max + r * kLanes);
    for (int c = 0; c < KEYS; ++c) m = hn::Max(m, acc[c][r]);
    hn::Store(m, d, score_max + r * kLanes);
  }
}

// out_t[ev][q] = alpha[q]·out_t[ev][q] + Σ_j score_t[j][q]·V[j][ev] for COLS value columns
// and RQ query vectors (starting at vector r0): an RQ × COLS register block.
// With row_sum (not null; [QV·lanes], RQ = QV): row_sum[q] = alpha[q]·row_sum[q] + Σ_j
// score_t[j][q] as well, summed as SoftmaxStepOf sums (even and odd keys apart, then their
// sum): on the add ports, idle beside the FMAs.
template <int QV, int RQ, int COLS>
HWY_INLINE void ValueBlock(const float* HWY_RESTRICT score_t, const float* value_column,
                           int64_t value_stride, int64_t keys, const float* HWY_RESTRICT alpha,
                           int r0, float* HWY_RESTRICT out_t_column,
                           float* HWY_RESTRICT row_sum = nullptr) {
  const DF d;
  constexpr int64_t tq = QV * kLanes;
  VF acc[RQ][COLS];
  for (int r = 0; r < RQ; ++r) {
    const VF a = hn::Load(d, alpha + (r0 + r) * kLanes);
    for (int c = 0; c < COLS; ++c) {
      acc[r][c] = hn::Mul(a, hn::Load(d, out_t_column + c * tq + (r0 + r) * kLanes));
    }
  }
  const auto key_step = [&](int64_t j, VF* sums) HWY_ATTR {
    VF prob[RQ];
    for (int r = 0; r < RQ; ++r) prob[r] = hn::Load(d, score_t + j * tq + (r0 + r) * kLanes);
    const float* v = value_column + j * value_stride;
    for (int c = 0; c < COLS; ++c) {
      const VF vb = hn::Set(d, v[c]);
      for (int r = 0; r < RQ; ++r) acc[r][c] = hn::MulAdd(prob[r], vb, acc[r][c]);
    }
    if (sums != nullptr) {
      for (int r = 0; r < RQ; ++r) sums[r] = hn::Add(sums[r], prob[r]);
    }
  };
  if (row_sum == nullptr) {
    for (int64_t j = 0; j < keys; ++j) key_step(j, nullptr);
  } else {
    static_assert(RQ == QV, "the sums take whole tiles");
    VF sum0[RQ], sum1[RQ];
    for (int r = 0; r < RQ; ++r) sum0[r] = sum1[r] = hn::Zero(d);
    int64_t j = 0;
    for (; j + 2 <= keys; j += 2) {
      key_step(j, sum0);
      key_step(j + 1, sum1);
    }
    if (j < keys) key_step(j, sum0);
    for (int r = 0; r < RQ; ++r) {
      float* l = row_sum + r * kLanes;
      const VF a = hn::Load(d, alpha + r * kLanes);
      hn::Store(hn::MulAdd(a, hn::Load(d, l), hn::Add(sum0[r], sum1[r])), d, l);
    }
  }
  for (int r = 0; r < RQ; ++r) {
    for (int c = 0; c < COLS; ++c) {
      hn::Store(acc[r][c], d, out_t_column + c * tq + (r0 + r) * kLanes);
    }
  }
}

// The first P·V block with the softmax's exponentials folded in: for each key j,
// p[j][q] = 2^(score_t[j][q] − point[q]) (point: the rows' reference points m', [QV·lanes])
// is computed and stored back into score_t (where the other blocks and the sums read it),
// and out_t[ev][q] = alpha[q]·out_t[ev][q] + Σ_j p[j][q]·V[j][ev] for COLS value columns.
// Software-pipelined by kExpLead keys: key j's products read the probabilities of key j
// from score_t while the exponentials of key j + kExpLead run beside them, so the FMAs never
// wait out an exponential's dependency chain (load, subtract, vreduceps, five FMAs,
// vscalefps: about 40 cycles). The same operations on the same values as SoftmaxStepOf's
// loop (the subtract rounds as the FMA s·1 − m' there) followed by ValueBlock: same bits.
template <int QV, int COLS>
HWY_INLINE void ExpValueBlock(float* HWY_RESTRICT score_t, const float* value_column,
                              int64_t value_stride, int64_t keys, const float* HWY_RESTRICT alpha,
                              const float* HWY_RESTRICT point, float* HWY_RESTRICT out_t_column) {
  const DF d;
  constexpr int64_t tq = QV * kLanes;
  constexpr int64_t kExpLead = 2;
  VF acc[QV][COLS];
  for (int r = 0; r < QV; ++r) {
    const VF a = hn::Load(d, alpha + r * kLanes);
    for (int c = 0; c < COLS; ++c) {
      acc[r][c] = hn::Mul(a, hn::Load(d, out_t_column + c * tq + r * kLanes));
    }
  }
  const auto exps = [&](int64_t j) HWY_ATTR {
    for (int r = 0; r < QV; ++r) {
      float* s = score_t + j * tq + r * kLanes;
      hn::Store(Exp2(d, hn::Sub(hn::Load(d, s), hn::Load(d, point + r * kLanes))), d, s);
    }
  };
  const auto products = [&](int64_t j) HWY_ATTR {
    // The probabilities are read back from score_t: kept in registers from exps instead,
    // kExpLead keys of them would spill (512-bit stores issue one per two cycles). The
    // compiler is not told that this address is the one exps stored to.
    const float* p = score_t + j * tq;
#if defined(__GNUC__)
    asm("" : "+r"(p));
#endif
    VF prob[QV];
    for (int r = 0; r < QV; ++r) prob[r] = hn::Load(d, p + r * kLanes);
    const float* v = value_column + j * value_stride;
    for (int c = 0; c < COLS; ++c) {
      const VF vb = hn::Set(d, v[c]);
      for (int r = 0; r < QV; ++r) acc[r][c] = hn::MulAdd(prob[r], vb, acc[r][c]);
    }
  };
  for (int64_t j = 0; j < std::min(kExpLead, keys); ++j) exps(j);
  int64_t j = 0;
  for (; j + kExpLead < keys; ++j) {
    exps(j + kExpLead);
    products(j);
  }
  for (; j < keys; ++j) products(j);
  for (int r = 0; r < QV; ++r) {
    for (int c = 0; c < COLS; ++c) {
      hn::Store(acc[r][c], d, out_t_column + c * tq + r * kLanes);
    }
  }
}

// Products: void for float32 products, else the bfloat16 products struct (isa/, e.g.
// Avx512Bf16, AmxBf16) that runs the two products from the bfloat16 operands of the tile and
// of ws.bf16 or ws.amx (packed by the caller; AmxBf16 inside an amx::TileScope).
template <int QV, class Products = void>
class TileAttention {
 public:
  static constexpr bool kPairs = !std::is_void_v<Products>;
  static constexpr int64_t kTq = QV * kLanes;
  // kAccumulators per register block whatever the tile height; at one query vector, 8
  // keys or columns (as many as FMA latency × ports): more would need a load per FMA.
  static constexpr int kScoreKeys = QV == 1 ? std::min(8, kAccumulators) : kAccumulators / QV;
  static constexpr int kValueColumns = kScoreKeys;
  // Tiles of 4 vectors on 32-register targets: a 4 × 4 P·V block (kSumColumns value columns)
  // also sums the probabilities (ValueBlock's row_sum), unless dropout zeroes some first (l is
  // taken before dropout); where the score blocks found the max (no weights, Ev >= 8), a 4 × 4
  // ExpValueBlock before it computes them. Ev = 32: then 4 blocks of 6; Ev = 64: 8 of 6, 2 of 4.
  static constexpr bool kSumsInValues = !kPairs && QV == 4 && kAccumulators == 24;
  static constexpr int kSumColumns = 4;

  TileAttention(const SdpaParams& p, Workspace& ws) : p_(p), ws_(ws) {}

  // The tile's rows over the keys of `span` (whole key tiles: span.begin is a multiple of
  // kKeyTile). Key tiles that no row of the tile sees (by position, document or mask) are
  // never loaded: the block sparsity of the score rules.
  void Run(const Tile& tile, KeySpan span) {
    // A grouped-query tile (tile.group > 1: packed rows of G heads, TileRowOf) leaves its
    // rows to the merge (span.partial), which writes each to its head's output.
    HWY_DASSERT(tile.group == 1 || span.partial != nullptr);
    LoadQueries(tile);
    const int64_t head = head_of(p_, tile.batch);
    if (may_exclude(p_)) {
      ws_.row_rules.Load(p_, tile.batch, tile.first_query, tile.rows, kTq, tile.group);
    }
    // Keys past key_end are excluded by position for every row of the tile: skipped.
    const int64_t span_end = span.begin + span.count;
    const VisibleKeys last_row = visible_keys(p_, TileRowOf(tile, tile.rows - 1).query);
    const int64_t key_end = std::clamp<int64_t>(last_row.reach(), 0, span_end);
    if (!kPairs && tile.group > 1 && !p_.half_kv()) prefetch_end_ = key_end;
    // The sink joins the first chunk's denominator as a key of score sink_h with no value.
    const bool sink = p_.sinks != nullptr && span.begin == 0;
    std::fill_n(ws_.row_max.get(), kTq,
                sink ? p_.sinks[head] * kLog2e : -std::numeric_limits<float>::infinity());
    if (sink && tile.group > 1) {  // each packed row its own head's sink
      for (int64_t r = 0; r < tile.rows; ++r) {
        ws_.row_max[r] = p_.sinks[head_of(p_, TileRowOf(tile, r).batch)] * kLog2e;
      }
    }
    std::fill_n(ws_.row_sum.get(), kTq, sink ? 1.0f : 0.0f);
    std::fill_n(ws_.visible.get(), kTq, uint8_t{0});
    std::fill_n(ws_.out_t.get(), p_.value_dim * kTq, 0.0f);
    const float keep_scale = 1.0f / (1.0f - p_.dropout);
    // Whether AccumulateValues updates the sums l (else SoftmaxStep does).
    const bool sums_in_values = kSumsInValues && p_.dropout == 0 && p_.value_dim >= kSumColumns;
    // Whether, on key tiles whose max ComputeScores found, AccumulateValues' summing block
    // also computes the probabilities (ExpValueBlock; not when the weights are written
    // before the product).
    const bool exps_in_values =
        sums_in_values && tile.weights == nullptr && p_.value_dim >= 2 * kSumColumns;

    // One pass: online softmax with output accumulation. With weights, each key tile's
    // probabilities 2^(s − m_t) are written as they are and rescaled once the final m and
    // l are known, while the tile's rows are still in cache.
    // Keys before the first row's first visible key (a sliding window's far past; first
    // never decreases with the row) are skipped too: the key tiles start there, rounded down
    // to 16 keys (whole vectors and dropout words), not at a multiple of the key tile.
    int64_t key_begin = span.begin;
    if (p_.window_left >= 0 && p_.prefix == 0) {
      key_begin = std::clamp<int64_t>(visible_keys(p_, TileRowOf(tile, 0).query).first / 16 * 16,
                                      span.begin, std::max(span.begin, key_end));
      if (tile.weights) ZeroWeights(tile, span.begin, key_begin);
    }
    int64_t visited = 0;
    for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeyTile) {
      const int64_t keys = std::min(kKeyTile, key_end - k0);
      const TileVerdict verdict = ws_.row_rules.Classify(p_, tile.batch, k0, keys);
      if (verdict == TileVerdict::kEmpty ||
          (has_pairwise_rules(p_) &&
           !ws_.keep.Fill(p_, tile.batch, tile.mask, tile.first_query, tile.rows, k0, keys, kTq))) {
        if (tile.weights) ZeroWeights(tile, k0, k0 + keys);
        continue;
      }
      const bool max_known = ComputeScores(tile, k0, keys, verdict);
      const bool exps = !(exps_in_values && max_known);
      SoftmaxStep(keys, max_known, !sums_in_values, exps,
                  tile.weights ? ws_.tile_max.get() + visited * kTq : nullptr);
      if (p_.dropout > 0) ApplyDropout(tile, k0, keys);
      if (tile.weights) {
        ws_.visited[visited] = k0;
        WriteWeights(tile, k0, keys);
      }
      ++visited;
      AccumulateValues(tile, k0, keys, ws_.alpha.get(), sums_in_values, !exps);
    }
    if (span.partial) {  // a chunk of a key split (never with weights): for the merge
      const PartialRows& partial = *span.partial;
      FinishOutput(tile.rows, partial.out, partial.out_stride, keep_scale, false);
      std::copy_n(ws_.row_max.get(), tile.rows, partial.max);
      std::copy_n(ws_.row_sum.get(), tile.rows, partial.sum);
      std::copy_n(ws_.visible.get(), tile.rows, partial.visible);
      return;
    }
    if (tile.weights) {
      ZeroWeights(tile, std::max<int64_t>(key_end, 0), p_.key_len);
      RescaleWeights(tile, visited, keep_scale);
    }
    FinishOutput(tile.rows, tile.output + tile.first_query * p_.output_strides.row,
                 p_.output_strides.row, keep_scale, true);
    const bool fix_rows = fixes_fully_excluded_rows(p_);
    if (tile.logsumexp) {
      for (int64_t r = 0; r < tile.rows; ++r) {
        tile.logsumexp[(tile.first_query + r) * p_.logsumexp_strides.row] =
            fix_rows && !ws_.visible[r] ? FullyExcludedLogSumExp(p_)
                                        : LogSumExp(ws_.row_max[r], ws_.row_sum[r]);
      }
    }
    if (fix_rows) FixFullyExcludedRows(tile);
  }

 private:
  // query_t[e][r] = Q[q0 + r][e]·scale·log2(e); rows past the tile's end are zero.
  // With score modifications (softcap, ALiBi, a user rule) the scores stay in natural units
  // until ModifyScores has run, which then applies log2(e).
  void LoadQueries(const Tile& tile) {
    const float factor = has_score_mods(p_) ? p_.scale : p_.scale * kLog2e;
    if constexpr (kPairs) {
      score_factor_ = factor;
      if (tile.query_half == nullptr) {  // float32 queries (SdpaParams::bf16_kv_products)
        const auto row_of = [&](int64_t r) { return QueryRowOf(p_, tile, r); };
        LoadQueryPairs(p_, row_of, tile.rows, kTq, QueryPairs());
        return;
      }
      const auto row_of = [&](int64_t r) { return QueryRowOf(p_, tile, tile.query_half, r); };
      LoadQueryPairs(p_, row_of, tile.rows, kTq, QueryPairs());
      return;
    }
    if (tile.query_widened != nullptr) {
      if (p_.half_dtype == DType::kFloat16) return LoadHalfQueries<hwy::float16_t>(tile, factor);
      return LoadHalfQueries<hwy::bfloat16_t>(tile, factor);
    }
    float* query_t = ws_.query_t.get();
#if ATTEND_BLOCK_SHUFFLES
    if (p_.head_dim % kLanes == 0) {
      const DF d;
      const VF factor_v = hn::Set(d, factor);
      for (int64_t r0 = 0; r0 < kTq; r0 += kLanes) {
        for (int64_t e0 = 0; e0 < p_.head_dim; e0 += kLanes) {
          VF v[kLanes];
          for (int64_t i = 0; i < kLanes; ++i) {
            v[i] = r0 + i < tile.rows
                       ? hn::Mul(hn::LoadU(d, QueryRowOf(p_, tile, r0 + i) + e0), factor_v)
                       : hn::Zero(d);
          }
          TransposeSquare(v);
          for (int64_t i = 0; i < kLanes; ++i) hn::Store(v[i], d, query_t + (e0 + i) * kTq + r0);
        }
      }
      return;
    }
#endif
    for (int64_t r = 0; r < tile.rows; ++r) {
      const float* q = QueryRowOf(p_, tile, r);
      for (int64_t e = 0; e < p_.head_dim; ++e) query_t[e * kTq + r] = q[e] * factor;
    }
    if (tile.rows < kTq) {
      for (int64_t e = 0; e < p_.head_dim; ++e) {
        std::fill(query_t + e * kTq + tile.rows, query_t + (e + 1) * kTq, 0.0f);
      }
    }
  }

  // The same from half-precision queries (Tile::query_widened, Half: hwy::float16_t or
  // bfloat16_t as p_.half_dtype says), each widened exactly as it is loaded, so query_t holds
  // the bits a float32 copy of the queries would give.
  template <class Half>
  void LoadHalfQueries(const Tile& tile, float factor) {
    const auto row_of = [&](int64_t r) { return QueryRowOf(p_, tile, tile.query_widened, r); };
    float* query_t = ws_.query_t.get();
#if ATTEND_BLOCK_SHUFFLES
    if (p_.head_dim % kLanes == 0) {
      const DF d;
      const hn::Rebind<Half, DF> dh;
      const VF factor_v = hn::Set(d, factor);
      for (int64_t r0 = 0; r0 < kTq; r0 += kLanes) {
        for (int64_t e0 = 0; e0 < p_.head_dim; e0 += kLanes) {
          VF v[kLanes];
          for (int64_t i = 0; i < kLanes; ++i) {
            v[i] = r0 + i < tile.rows
                       ? hn::Mul(hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const Half*>(
                                                                    row_of(r0 + i) + e0))),
                                 factor_v)
                       : hn::Zero(d);
          }
          TransposeSquare(v);
          for (int64_t i = 0; i < kLanes; ++i) hn::Store(v[i], d, query_t + (e0 + i) * kTq + r0);
        }
      }
      return;
    }
#endif
    for (int64_t r = 0; r < tile.rows; ++r) {
      const uint16_t* q = row_of(r);
      for (int64_t e = 0; e < p_.head_dim; ++e) {
        query_t[e * kTq + r] = HalfToFloat(p_.half_dtype, q[e]) * factor;
      }
    }
    if (tile.rows < kTq) {
      for (int64_t e = 0; e < p_.head_dim; ++e) {
        std::fill(query_t + e * kTq + tile.rows, query_t + (e + 1) * kTq, 0.0f);
      }
    }
  }

  // score_t[j][r] for keys [k0, k0 + keys): Q·Kᵀ, then the modifications and the exclusions of
  // score_rule_layer.hpp (log2 domain from here on). Returns whether ws_.score_max holds each
  // row's max over the key tile (float32 products whose scores no rule changes afterwards:
  // found from the accumulators, no pass over score_t).
  bool ComputeScores(const Tile& tile, int64_t k0, int64_t keys, TileVerdict verdict) {
    if constexpr (!kPairs) {
      if (!has_score_mods(p_) && tile.bias == nullptr && verdict == TileVerdict::kFull) {
        std::fill_n(ws_.score_max.get(), kTq, -std::numeric_limits<float>::infinity());
        ComputeScoresF32(tile, k0, keys, ws_.score_max.get());
        if (may_exclude(p_)) {  // kFull: no score excluded, the rows only marked visible
          ApplyExclusions(p_, tile.batch, ws_.row_rules, ws_.keep, k0, keys, kTq, verdict,
                          ws_.score_t.get(), ws_.visible.get(), tile.rows);
        }
        return true;
      }
    }
    if constexpr (kPairs) {
      // Plain scores (no modification, bias or exclusion writes to them): the scale is
      // folded into the exponent's argument instead (SoftmaxStep), one multiply per score less.
      fold_scale_ = p_.bf16_products() && !has_score_mods(p_) && tile.bias == nullptr &&
                    !may_exclude(p_) && score_factor_ > 0.0f && std::isfinite(score_factor_);
      ComputeScoresPairs(k0, keys);
    } else {
      ComputeScoresF32(tile, k0, keys, nullptr);
    }
    if (has_score_mods(p_)) {
      ModifyScores(p_, tile.batch, tile.bias, tile.first_query, tile.rows, k0, keys, kTq,
                   ws_.score_t.get(), nullptr, nullptr, tile.group);
    } else if (tile.bias != nullptr) {
      AddBias(p_, tile.bias, tile.first_query, tile.rows, k0, keys, kTq, kLog2e, ws_.score_t.get());
    }
    if (may_exclude(p_)) {
      ApplyExclusions(p_, tile.batch, ws_.row_rules, ws_.keep, k0, keys, kTq, verdict,
                      ws_.score_t.get(), ws_.visible.get(), tile.rows);
    }
    return false;
  }

  // score_t[j][r] = Q·Kᵀ (scaled) for keys [k0, k0 + keys), float32 products; with score_max
  // (not null, [Tq]) its rows' maxima over these keys as well (ScoreBlock).
  void ComputeScoresF32(const Tile& tile, int64_t k0, int64_t keys, float* score_max) {
    const float* key = tile.key + k0 * tile.key_stride;
    const int64_t key_stride = tile.key_stride;
    float* score_t = ws_.score_t.get();
    int64_t j = 0;
    for (; j + kScoreKeys <= keys; j += kScoreKeys) {
      if (prefetch_end_ > 0) PrefetchRows(tile, k0 + j, kScoreKeys);
      ScoreBlock<QV, kScoreKeys>(ws_.query_t.get(), key + j * key_stride, key_stride, p_.head_dim,
                                 score_t + j * kTq, score_max);
    }
    const auto block = [&](auto keys_tag) {
      if (prefetch_end_ > 0) PrefetchRows(tile, k0 + j, decltype(keys_tag)::value);
      ScoreBlock<QV, decltype(keys_tag)::value>(ws_.query_t.get(), key + j * key_stride, key_stride,
                                                p_.head_dim, score_t + j * kTq, score_max);
    };
    if constexpr (kScoreKeys > 4) {
      for (; j + 4 <= keys; j += 4) block(std::integral_constant<int, 4>{});
    }
    // The last 2 or 3 keys (128 = 21·6 + 2 at QV = 4) in one block: a key at a time, QV
    // chains would wait out the FMA latency at every step (4 where 8 keep both FMA ports busy).
    if constexpr (3 * QV <= kAccumulators) {
      if (keys - j == 3) return block(std::integral_constant<int, 3>{});
    }
    if constexpr (2 * QV <= kAccumulators) {
      if (keys - j == 2) return block(std::integral_constant<int, 2>{});
    }
    for (; j < keys; ++j) block(std::integral_constant<int, 1>{});
  }

  // Prefetches into L2 the K and V rows of keys [j, j + count) + kKeyTile (the next key tile's,
  // below prefetch_end_) while key tile j's products run: 128 KiB of K and V a tile at
  // E = Ev = 128, which L1 would not hold beside the current tile's (locality 2: L2).
  void PrefetchRows(const Tile& tile, int64_t j, int64_t count) {
    const int64_t key_bytes = p_.head_dim * static_cast<int64_t>(sizeof(float));
    const int64_t value_bytes = p_.value_dim * static_cast<int64_t>(sizeof(float));
    for (int64_t c = j + kKeyTile; c < std::min(j + count + kKeyTile, prefetch_end_); ++c) {
      const char* k = reinterpret_cast<const char*>(tile.key + c * tile.key_stride);
      const char* v = reinterpret_cast<const char*>(tile.value + c * tile.value_stride);
      for (int64_t o = 0; o < key_bytes; o += 64) __builtin_prefetch(k + o, 0, 2);
      for (int64_t o = 0; o < value_bytes; o += 64) __builtin_prefetch(v + o, 0, 2);
    }
  }

  // The same with bfloat16 products: K from the span packed in ws_.bf16 (ws_.amx), the scale
  // applied to the float32 products.
  void ComputeScoresPairs(int64_t k0, int64_t keys) {
    const int64_t pairs = PairsOf(p_.head_dim);
    Products::Product(keys, QV, pairs, KeyPairs(k0), PairsB{QueryPairs(), kTq},
                      PairsC{ws_.score_t.get(), kTq, PairStart::kZero, nullptr,
                             fold_scale_ ? 1.0f : score_factor_});
    if constexpr (!kTakesTileOperands<Products>) {
      // The scaled formats: score_j = scale_j·(q·code_j), the codes exact in the pairs and
      // the key's scale applied to the float32 product (one rounding more per score).
      if (const float* key_scale = ws_.bf16.key_scale) {
        const DF d;
        float* score_t = ws_.score_t.get();
        for (int64_t j = 0; j < keys; ++j) {
          const VF s = hn::Set(d, key_scale[k0 - ws_.bf16.begin + j]);
          for (int r = 0; r < QV; ++r) {
            float* row = score_t + j * kTq + r * kLanes;
            hn::Store(hn::Mul(hn::Load(d, row), s), d, row);
          }
        }
      }
    }
  }

  // The bfloat16 operands: Q's pairs of the tile, P's pairs of the key tile, and K's and V's
  // pairs from key k0 on, in ws_.amx for products that take the tiles' layout, else ws_.bf16.
  uint32_t* QueryPairs() {
#if ATTEND_AMX_BF16
    if constexpr (kTakesTileOperands<Products>) return ws_.amx.query_pairs.get();
#endif
    return ws_.bf16.query_pairs.get();
  }
  uint32_t* ProbPairs() {
#if ATTEND_AMX_BF16
    if constexpr (kTakesTileOperands<Products>) return ws_.amx.prob_pairs.get();
#endif
    return ws_.bf16.prob_pairs.get();
  }
  // K: rows of pairs (one key a row).
  PairsA KeyPairs(int64_t k0) const {
#if ATTEND_AMX_BF16
    if constexpr (kTakesTileOperands<Products>) {
      const amx::TileOperands& op = ws_.amx;
      return {reinterpret_cast<const uint32_t*>(op.key.get() + (k0 - op.begin) * op.depth),
              op.depth / 2, 1};
    }
#endif
    const int64_t pairs = PairsOf(p_.head_dim);
    return {ws_.bf16.key + (k0 - ws_.bf16.begin) * pairs, pairs, 1};
  }
  // V: one value column a row, pairs of keys along it (Vᵀ) in the tiles' layout (k0 − begin
  // is a multiple of 16, so the pairs stay whole); else pairs across keys, transposed.
  PairsA ValuePairs(int64_t k0) const {
#if ATTEND_AMX_BF16
    if constexpr (kTakesTileOperands<Products>) {
      const amx::TileOperands& op = ws_.amx;
      return {reinterpret_cast<const uint32_t*>(op.value_t.get() + (k0 - op.begin)),
              op.value_stride / 2, 1};
    }
#endif
    return {ws_.bf16.value + (k0 - ws_.bf16.begin) / 2 * p_.value_dim, 1, p_.value_dim};
  }

  // Online-softmax step over `keys` rows of score_t: new max, alpha = 2^(m − m'),
  // probabilities 2^(s − m') in place, and with `sums` l' = α·l + Σ p (else AccumulateValues
  // updates l). max_known: ws_.score_max holds the rows' maxima over these keys already
  // (ComputeScores). Without `exps` (no sums) only m', alpha and the reference point (into
  // ws_.point) are found: AccumulateValues computes the probabilities (ExpValueBlock).
  // Stores the reference point m' (0 for rows still at -inf) in tile_max when not null.
  void SoftmaxStep(int64_t keys, bool max_known, bool sums, bool exps, float* tile_max_out) {
    if constexpr (kPairs) {
      if (fold_scale_) return SoftmaxStepOf<true, true>(keys, false, true, tile_max_out);
    }
    if (!sums) return SoftmaxStepOf<false, false>(keys, max_known, exps, tile_max_out);
    SoftmaxStepOf<false, true>(keys, max_known, true, tile_max_out);
  }
  // FOLDED: score_t holds the unscaled products t, s = t·scale (scale > 0, score_factor_):
  // max_j s_j = (max_j t_j)·scale exactly (rounding is monotonic), and the exponent's
  // argument s − m' = t·scale − m' is one FMA (rounded once instead of twice).
  // Without FOLDED the argument s − m' is an FMA s·1 − m' where the target has FMAs (the same
  // rounding as a subtract): on AMD Zen 5 the add ports also run vreduceps and vscalefps (two
  // slots each), the FMA ports only the polynomial. Without SUMS the loop has no sum chains:
  // there its speed is set by how many exponentials' dependency chains the scheduler holds
  // at once, so each operation less per score vector lets more of them overlap.
  template <bool FOLDED, bool SUMS>
  void SoftmaxStepOf(int64_t keys, bool max_known, bool exps, float* tile_max_out) {
    const DF d;
    float* score_t = ws_.score_t.get();
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    const VF factor = hn::Set(d, FOLDED ? score_factor_ : 1.0f);
    const auto argument = [&](VF t, VF m) {
      if constexpr (FOLDED || HWY_NATIVE_FMA) {
        return hn::MulSub(t, factor, m);
      } else {
        return hn::Sub(t, m);
      }
    };
    for (int r = 0; r < QV; ++r) {
      float* column = score_t + r * kLanes;
      VF tile_max = neg_inf;
      if (max_known) {
        tile_max = hn::Load(d, ws_.score_max.get() + r * kLanes);
      } else {
        // Four independent max chains: one chain would wait out the latency of every max.
        VF max0 = neg_inf, max1 = neg_inf, max2 = neg_inf, max3 = neg_inf;
        int64_t j = 0;
        for (; j + 4 <= keys; j += 4) {
          max0 = hn::Max(max0, hn::Load(d, column + j * kTq));
          max1 = hn::Max(max1, hn::Load(d, column + (j + 1) * kTq));
          max2 = hn::Max(max2, hn::Load(d, column + (j + 2) * kTq));
          max3 = hn::Max(max3, hn::Load(d, column + (j + 3) * kTq));
        }
        for (; j < keys; ++j) max0 = hn::Max(max0, hn::Load(d, column + j * kTq));
        tile_max = hn::Max(hn::Max(max0, max1), hn::Max(max2, max3));
      }
      if constexpr (FOLDED) tile_max = hn::Mul(tile_max, factor);
      const VF old_max = hn::Load(d, ws_.row_max.get() + r * kLanes);
      const VF new_max = hn::Max(old_max, tile_max);
      // A row whose scores are all -inf so far keeps m' = -inf; use 0 as the reference
      // point so that 2^(-inf - m') is 0, not NaN.
      const VF safe_max = hn::IfThenZeroElse(hn::Eq(new_max, neg_inf), new_max);
      const VF alpha = Exp2(d, hn::Sub(old_max, safe_max));
      VF sum0 = hn::Zero(d), sum1 = hn::Zero(d);
      int64_t j = 0;
      if constexpr (!SUMS) {
        if (!exps) hn::Store(safe_max, d, ws_.point.get() + r * kLanes);
        for (; exps && j < keys; ++j) {
          hn::Store(Exp2(d, argument(hn::Load(d, column + j * kTq), safe_max)), d,
                    column + j * kTq);
        }
      } else {
        for (; j + 2 <= keys; j += 2) {
          const VF prob0 = Exp2(d, argument(hn::Load(d, column + j * kTq), safe_max));
          const VF prob1 = Exp2(d, argument(hn::Load(d, column + (j + 1) * kTq), safe_max));
          hn::Store(prob0, d, column + j * kTq);
          hn::Store(prob1, d, column + (j + 1) * kTq);
          sum0 = hn::Add(sum0, prob0);
          sum1 = hn::Add(sum1, prob1);
        }
        if (j < keys) {
          const VF prob = Exp2(d, argument(hn::Load(d, column + j * kTq), safe_max));
          hn::Store(prob, d, column + j * kTq);
          sum0 = hn::Add(sum0, prob);
        }
        const VF sum = hn::Add(sum0, sum1);
        const VF old_sum = hn::Load(d, ws_.row_sum.get() + r * kLanes);
        hn::Store(hn::MulAdd(alpha, old_sum, sum), d, ws_.row_sum.get() + r * kLanes);
      }
      hn::Store(new_max, d, ws_.row_max.get() + r * kLanes);
      hn::Store(alpha, d, ws_.alpha.get() + r * kLanes);
      if (tile_max_out) hn::Store(safe_max, d, tile_max_out + r * kLanes);
    }
  }

  // weights[q0 + r][key tile t] ·= 2^(m_t − m)·keep_scale / l: from the probabilities
  // relative to each tile's reference point m_t to the final normalized weights.
  void RescaleWeights(const Tile& tile, int64_t key_tiles, float keep_scale) {
    // key_tiles: the visited tiles, the first key of tile t at ws_.visited[t].
    const DF d;
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    float* factors = ws_.tile_max.get();  // becomes [t][r] rescale factors in place
    for (int r = 0; r < QV; ++r) {
      const VF row_max = hn::Load(d, ws_.row_max.get() + r * kLanes);
      const VF safe_max = hn::IfThenZeroElse(hn::Eq(row_max, neg_inf), row_max);
      const VF scale = hn::Div(hn::Set(d, keep_scale), hn::Load(d, ws_.row_sum.get() + r * kLanes));
      for (int64_t t = 0; t < key_tiles; ++t) {
        float* f = factors + t * kTq + r * kLanes;
        hn::Store(hn::Mul(Exp2(d, hn::Sub(hn::Load(d, f), safe_max)), scale), d, f);
      }
    }
    for (int64_t r = 0; r < tile.rows; ++r) {
      float* w = tile.weights + (tile.first_query + r) * p_.weights_strides.row;
      for (int64_t t = 0; t < key_tiles; ++t) {
        const VF factor = hn::Set(d, factors[t * kTq + r]);
        const int64_t end = std::min(p_.key_len, ws_.visited[t] + kKeyTile);
        int64_t j = ws_.visited[t];
        for (; j + kLanes <= end; j += kLanes) {
          hn::StoreU(hn::Mul(hn::LoadU(d, w + j), factor), d, w + j);
        }
        for (; j < end; ++j) w[j] *= factors[t * kTq + r];
      }
    }
  }

  // Zeroes dropped probabilities (1/(1 − p) is applied at the end). The draw for
  // (batch, query, key) is the same Philox word the reference uses.
  void ApplyDropout(const Tile& tile, int64_t k0, int64_t keys) {
    const uint32_t threshold = dropout_threshold(p_.dropout);
    float* score_t = ws_.score_t.get();
    for (int64_t r = 0; r < tile.rows; ++r) {
      for_each_dropped(p_.seed, threshold, tile.batch, global_query(p_, tile.first_query + r),
                       global_key(p_, k0), keys,
                       [score_t, r](int64_t j) { score_t[j * kTq + r] = 0.0f; });
    }
  }

  // weights[q0 + r][k0 + j] = score_t[j][r].
  void WriteWeights(const Tile& tile, int64_t k0, int64_t keys) {
    const float* score_t = ws_.score_t.get();
    int64_t j_end = 0;  // keys [0, j_end) written by whole transposed blocks
#if ATTEND_BLOCK_SHUFFLES
    const DF d;
    j_end = keys - keys % kLanes;
    for (int64_t r0 = 0; r0 < tile.rows; r0 += kLanes) {
      const int64_t rows = std::min<int64_t>(kLanes, tile.rows - r0);
      for (int64_t j0 = 0; j0 < j_end; j0 += kLanes) {
        VF v[kLanes];
        for (int64_t i = 0; i < kLanes; ++i) v[i] = hn::Load(d, score_t + (j0 + i) * kTq + r0);
        TransposeSquare(v);
        for (int64_t i = 0; i < rows; ++i) {
          float* w = tile.weights + (tile.first_query + r0 + i) * p_.weights_strides.row;
          hn::StoreU(v[i], d, w + k0 + j0);
        }
      }
    }
#endif
    for (int64_t r = 0; r < tile.rows; ++r) {
      float* w = tile.weights + (tile.first_query + r) * p_.weights_strides.row;
      for (int64_t j = j_end; j < keys; ++j) w[k0 + j] = score_t[j * kTq + r];
    }
  }

  // weights[q0 + r][begin, end) = 0: keys of tiles that no row sees.
  void ZeroWeights(const Tile& tile, int64_t begin, int64_t end) {
    if (begin >= end) return;
    for (int64_t r = 0; r < tile.rows; ++r) {
      float* w = tile.weights + (tile.first_query + r) * p_.weights_strides.row;
      std::fill(w + begin, w + end, 0.0f);
    }
  }

  // out_t = alpha·out_t + P·V for keys [k0, k0 + keys); with `sums` (kSumsInValues, at least
  // kSumColumns value columns) the sums l' = alpha·l + Σ p as well; with `exps` (and sums)
  // score_t holds the scores, and the summing block computes the probabilities P from them
  // and ws_.point first (ExpValueBlock).
  void AccumulateValues(const Tile& tile, int64_t k0, int64_t keys, const float* alpha,
                        bool sums, bool exps) {
    if constexpr (kPairs) {
      AccumulateValuesPairs(k0, keys, alpha);
      return;
    }
    const float* value = tile.value + k0 * tile.value_stride;
    const int64_t value_stride = tile.value_stride;
    const float* score_t = ws_.score_t.get();
    float* out_t = ws_.out_t.get();
    // All QV query vectors at once × kValueColumns columns, then narrower blocks for the tail.
    int64_t c = 0;
    if constexpr (kSumsInValues) {
      if (sums && exps) {  // value_dim >= 2·kSumColumns
        ExpValueBlock<QV, kSumColumns>(ws_.score_t.get(), value, value_stride, keys, alpha,
                                       ws_.point.get(), out_t);
        c = kSumColumns;
      }
      if (sums) {
        ValueBlock<QV, QV, kSumColumns>(score_t, value + c, value_stride, keys, alpha, 0,
                                        out_t + c * kTq, ws_.row_sum.get());
        c += kSumColumns;
      }
    }
    // 6 columns at a time, but 8 left as two blocks of 4 (not 6 and 2).
    for (; c + kValueColumns <= p_.value_dim && !(kValueColumns == 6 && p_.value_dim - c == 8);
         c += kValueColumns) {
      ValueBlock<QV, QV, kValueColumns>(score_t, value + c, value_stride, keys, alpha, 0,
                                        out_t + c * kTq);
    }
    if constexpr (kValueColumns > 4) {
      for (; c + 4 <= p_.value_dim; c += 4) {
        ValueBlock<QV, QV, 4>(score_t, value + c, value_stride, keys, alpha, 0, out_t + c * kTq);
      }
    }
    for (; c + 2 <= p_.value_dim; c += 2) {
      ValueBlock<QV, QV, 2>(score_t, value + c, value_stride, keys, alpha, 0, out_t + c * kTq);
    }
    for (; c < p_.value_dim; ++c) {
      ValueBlock<QV, QV, 1>(score_t, value + c, value_stride, keys, alpha, 0, out_t + c * kTq);
    }
  }

  // The same with bfloat16 products: the probabilities rounded to pairs, V from ws_.bf16.
  void AccumulateValuesPairs(int64_t k0, int64_t keys, const float* alpha) {
    float* score_t = ws_.score_t.get();
    uint32_t* prob_pairs = ProbPairs();
    if constexpr (!kTakesTileOperands<Products>) {
      // The scaled formats: P_j·V_j = (P_j·scale_j)·code_j, the value's scale folded into the
      // probability before it is rounded to bfloat16 (the sums l have taken P_j already; the
      // product P_j·scale_j adds one float32 rounding to the 2^-9 of the bfloat16 one), the
      // codes exact in the pairs.
      if (const float* value_scale = ws_.bf16.value_scale) {
        const DF d;
        for (int64_t j = 0; j < keys; ++j) {
          const VF s = hn::Set(d, value_scale[k0 - ws_.bf16.begin + j]);
          for (int r = 0; r < QV; ++r) {
            float* row = score_t + j * kTq + r * kLanes;
            hn::Store(hn::Mul(hn::Load(d, row), s), d, row);
          }
        }
      }
    }
    for (int64_t j = 0; j < keys; j += 2) {
      Products::PairsAcrossRows(score_t + j * kTq, j + 1 < keys ? score_t + (j + 1) * kTq : nullptr,
                                kTq, prob_pairs + j / 2 * kTq);
    }
    if constexpr (kTakesTileOperands<Products>) {
      // Zero pairs up to a whole tile step: the keys there (zero or the span's later keys)
      // get no weight.
      const int64_t padded = (PairsOf(keys) + Products::kPairMultiple - 1) /
                             Products::kPairMultiple * Products::kPairMultiple;
      std::fill(prob_pairs + PairsOf(keys) * kTq, prob_pairs + padded * kTq, 0u);
    }
    Products::Product(p_.value_dim, QV, PairsOf(keys), ValuePairs(k0), PairsB{prob_pairs, kTq},
                      PairsC{ws_.out_t.get(), kTq, PairStart::kScaleColumns, alpha});
  }

  // out[r][ev] = out_t[ev][r]·keep_scale (/ l_r when `divide`) for rows r < rows, row r at
  // out + r·out_stride.
  void FinishOutput(int64_t rows, float* out, int64_t out_stride, float keep_scale, bool divide) {
    const float* out_t = ws_.out_t.get();
#if ATTEND_BLOCK_SHUFFLES
    if (p_.value_dim % kLanes == 0) {
      const DF d;
      for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
        const int64_t block_rows = std::min<int64_t>(kLanes, rows - r0);
        const VF factor = divide
                              ? hn::Div(hn::Set(d, keep_scale), hn::Load(d, ws_.row_sum.get() + r0))
                              : hn::Set(d, keep_scale);
        for (int64_t c0 = 0; c0 < p_.value_dim; c0 += kLanes) {
          VF v[kLanes];
          for (int64_t i = 0; i < kLanes; ++i) {
            v[i] = hn::Mul(hn::Load(d, out_t + (c0 + i) * kTq + r0), factor);
          }
          TransposeSquare(v);
          for (int64_t i = 0; i < block_rows; ++i)
            hn::StoreU(v[i], d, out + (r0 + i) * out_stride + c0);
        }
      }
      return;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const float factor = divide ? keep_scale / ws_.row_sum[r] : keep_scale;
      float* o = out + r * out_stride;
      for (int64_t c = 0; c < p_.value_dim; ++c) o[c] = out_t[c * kTq + r] * factor;
    }
  }

  void FixFullyExcludedRows(const Tile& tile) {
    for (int64_t r = 0; r < tile.rows; ++r) {
      if (!ws_.visible[r]) WriteFullyExcludedRow(p_, tile, tile.first_query + r);
    }
  }

  const SdpaParams& p_;
  Workspace& ws_;
  // Float32 grouped-query tiles (tile.group > 1) read each K/V row of their span once, from
  // memory (one tile per K/V head and span): ComputeScoresF32 prefetches ahead (PrefetchRows)
  // up to this key, the end of the keys Run visits; 0 (no prefetches) for the other tiles,
  // whose K/V the tiles of a batch index share from cache.
  int64_t prefetch_end_ = 0;
  float score_factor_ = 1.0f;  // bfloat16 products: scale (·log2 e) applied to the scores
  bool fold_scale_ = false;    // bfloat16 products: score_factor_ applied in SoftmaxStep
};

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_QUERY_TILES_INL_H_
