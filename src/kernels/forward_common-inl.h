// forward_common-inl.h: what the forward's two kernels (query tiles, row groups) and the key
// split share: a work item's operands (Tile), the keys it runs over (KeySpan) and what a
// chunk of keys leaves for the merge (PartialRows), the log-sum-exp and the listing's
// fully excluded rows. Compiled once per Highway target (include after kernel_common-inl.h).
#if defined(ATTEND_KERNELS_FORWARD_COMMON_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_FORWARD_COMMON_INL_H_
#undef ATTEND_KERNELS_FORWARD_COMMON_INL_H_
#else
#define ATTEND_KERNELS_FORWARD_COMMON_INL_H_
#endif

#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "dropout.hpp"
#include "half.hpp"
#include "kv_format.hpp"
#include "partial_softmax.hpp"
#include "score_rule_layer.hpp"
#include "sdpa_params.hpp"
#include "shape_policy.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// A row's natural log-sum-exp from its log2-domain maximum and sum, and that of a row whose
// every key is excluded (-inf where such rows are zeroed): partial_softmax.hpp's rules.
inline float LogSumExp(float max_log2, float sum) { return logsumexp_of_part(max_log2, sum); }
inline float FullyExcludedLogSumExp(const SdpaParams& p) {
  return p.zero_fully_masked_rows ? -std::numeric_limits<float>::infinity()
                                  : fully_excluded_logsumexp(p.key_len);
}

// A bfloat16 or float16 (`dtype`) value as float32 (exact).
inline float HalfToFloat(DType dtype, uint16_t bits) {
  return dtype == DType::kFloat16 ? f32_from_f16(bits) : f32_from_bf16(bits);
}

// One (batch, query tile) work item: the operands' base pointers and the tile's extent.
// A grouped-query tile (group > 1; shape_policy.hpp: PacksGroupedQueries) holds packed rows
// [first_query, first_query + rows) of the G·Lq rows of the batch indices [batch, batch + G)
// (one K/V head): row r is UnpackRow(first_query + r, group) (TileRowOf), and the pointers
// below are batch index `batch`'s (K and V: the group's).
struct Tile {
  int64_t batch;
  int64_t first_query;  // q0 (a packed row with group > 1)
  int64_t rows;         // queries in this tile, <= Tq
  int64_t group = 1;    // G of a grouped-query tile, else 1
  const float* query;   // batch base pointers (null with bfloat16 products)
  const float* key;
  const float* value;
  const uint16_t* query_half;  // batch base pointers of bfloat16 products' operands, else null
  const uint16_t* query_widened;  // of half queries computed in float32 (query null), else null
  const uint16_t* key_half;
  const uint16_t* value_half;
  const void* key_stored;  // batch base pointers of K and V as stored (SdpaParams::kv_format)
  const void* value_stored;
  const float* key_scales;  // and of their scales (int8, fp8), else null
  const float* value_scales;
  int64_t key_stride;    // rows of key and value: the operands' strides, or E and Ev when
  int64_t value_stride;  // the tile reads a packed copy (see PackKeysAndValues)
  float* output;
  float* weights;
  float* logsumexp;
  const uint8_t* mask;
  const float* bias;
};

// What one chunk of a key split (see PlanKeySplit) leaves for the merge, per row r of its
// work item (a row group or a query tile).
struct PartialRows {
  float* out;  // [rows][out_stride]: Σ_j 2^(s_j − m)·keep_j·v_j / (1 − p) over the chunk
  int64_t out_stride;
  float* max;        // [rows]: m = max_j s_j (log2 domain), -inf when the chunk ran no key
  float* sum;        // [rows]: l = Σ_j 2^(s_j − m)
  uint8_t* visible;  // [rows]: some key neither masked nor hidden
};

// The keys a work item runs over: [begin, begin + count), all of them (count = Lk, no
// partial) or one chunk of a key split, whose unnormalized results go to `partial`.
struct KeySpan {
  int64_t begin;
  int64_t count;
  const PartialRows* partial;
};

// slots[j] = p.key_slot(begin + j) for j < count: the storage rows of a span's keys, a block
// at a time (one division per span).
void SpanSlots(const SdpaParams& p, int64_t begin, int64_t count, int64_t* slots) {
  if (p.block_table == nullptr) {
    for (int64_t j = 0; j < count; ++j) slots[j] = begin + j;
    return;
  }
  const int64_t bs = p.block_size;
  int64_t n = begin / bs, row = begin % bs;
  for (int64_t j = 0; j < count; ++n, row = 0) {
    const int64_t base = int64_t{p.block_table[n]} * p.block_rows;
    const int64_t rows = std::min(bs - row, count - j);
    for (int64_t k = 0; k < rows; ++k) slots[j + k] = base + row + k;
    j += rows;
  }
}

// Element c of value row j (a key index) of the operands `tile` points at, as float32: the
// stored format widened and scaled (kv_format.hpp), through the block table.
float ValueAt(const SdpaParams& p, const Tile& tile, int64_t j, int64_t c) {
  const int64_t slot = p.key_slot(j);
  if (tile.value) return tile.value[slot * tile.value_stride + c];
  const auto element = static_cast<int64_t>(dtype_size(p.kv_format));
  const float x =
      widen_kv(p.kv_format,
               static_cast<const char*>(tile.value_stored) + slot * tile.value_stride * element, c);
  return tile.value_scales ? x * tile.value_scales[slot * p.value_scale_strides.row] : x;
}

// A row that saw no key at all (every key masked or causally hidden): zeros with
// zero_fully_masked_rows, else what the listing computes when every score is -1e9: uniform
// weights 1/Lk over all keys (then dropout), output = their average of V.
void WriteFullyExcludedRow(const SdpaParams& p, const Tile& tile, int64_t query) {
  float* o = tile.output + query * p.output_strides.row;
  float* w = tile.weights ? tile.weights + query * p.weights_strides.row : nullptr;
  std::fill_n(o, p.value_dim, 0.0f);
  if (p.zero_fully_masked_rows) {
    if (w) std::fill_n(w, p.key_len, 0.0f);
    return;
  }
  const uint32_t threshold = dropout_threshold(p.dropout);
  const float uniform = 1.0f / static_cast<float>(p.key_len);
  const float kept = static_cast<float>(uniform / (1.0 - static_cast<double>(p.dropout)));
  for (int64_t j = 0; j < p.key_len; ++j) {
    float weight = uniform;
    if (p.dropout > 0)
      weight = dropout_keep(p.seed, threshold, tile.batch, global_query(p, query), global_key(p, j))
                   ? kept
                   : 0.0f;
    if (w) w[j] = weight;
    if (tile.value && p.block_table == nullptr) {
      const float* v = tile.value + j * tile.value_stride;
      for (int64_t c = 0; c < p.value_dim; ++c) o[c] += weight * v[c];
    } else if (tile.value_half) {
      const uint16_t* v = tile.value_half + j * tile.value_stride;
      for (int64_t c = 0; c < p.value_dim; ++c) o[c] += weight * HalfToFloat(p.half_dtype, v[c]);
    } else {
      for (int64_t c = 0; c < p.value_dim; ++c) o[c] += weight * ValueAt(p, tile, j, c);
    }
  }
}

// Points `tile` at the operands of batch index b (in place: a Tile returned by value and
// then copied would be reloaded as vectors right after its scalar stores, a
// store-forwarding stall).
void SetTileBatch(const SdpaParams& p, int64_t b, Tile& tile) {
  tile.batch = b;
  const SdpaParams::BatchCoordinates at = p.batch_coordinates(b);
  // Each operand float32 or half precision (the other pointer null: see SdpaParams).
  const auto at_batch = [&](const auto* base, const OperandStrides& strides) {
    return base != nullptr ? base + at.offset(strides) : nullptr;
  };
  tile.query = at_batch(p.query, p.query_strides);
  tile.key = at_batch(p.key, p.key_strides);
  tile.value = at_batch(p.value, p.value_strides);
  tile.query_half = at_batch(p.query_half, p.query_strides);
  tile.query_widened = at_batch(p.query_widened, p.query_strides);
  tile.key_half = at_batch(p.key_half, p.key_strides);
  tile.value_half = at_batch(p.value_half, p.value_strides);
  const auto stored_at = [&](const void* base, const OperandStrides& strides) -> const void* {
    if (base == nullptr) return nullptr;
    return static_cast<const char*>(base) +
           at.offset(strides) * static_cast<int64_t>(dtype_size(p.kv_format));
  };
  tile.key_stored = stored_at(p.key_stored, p.key_strides);
  tile.value_stored = stored_at(p.value_stored, p.value_strides);
  tile.key_scales = at_batch(p.key_scales, p.key_scale_strides);
  tile.value_scales = at_batch(p.value_scales, p.value_scale_strides);
  tile.key_stride = p.key_strides.row;
  tile.value_stride = p.value_strides.row;
  tile.output = p.output + at.offset(p.output_strides);
  tile.weights = p.weights ? p.weights + at.offset(p.weights_strides) : nullptr;
  tile.logsumexp = p.logsumexp ? p.logsumexp + at.offset(p.logsumexp_strides) : nullptr;
  tile.mask = p.mask ? p.mask + at.offset(p.mask_strides) : nullptr;
  tile.bias = p.bias ? p.bias + at.offset(p.bias_strides) : nullptr;
}

// The operands of batch b, query tile starting at q0 with `rows` rows.
Tile MakeTile(const SdpaParams& p, int64_t b, int64_t q0, int64_t rows) {
  Tile tile;
  SetTileBatch(p, b, tile);
  tile.first_query = q0;
  tile.rows = rows;
  return tile;
}

// Row r of a tile as the rules see it: its batch index (head_of: the true query head) and
// its query position, through the one map of packed rows (UnpackRow).
struct TileRow {
  int64_t batch;
  int64_t query;
};
inline TileRow TileRowOf(const Tile& tile, int64_t r) {
  if (tile.group == 1) return {tile.batch, tile.first_query + r};
  const PackedRow packed = UnpackRow(tile.first_query + r, tile.group);
  return {tile.batch + packed.member, packed.query};
}

// Query row r of a tile in the queries at `base` (the tile's batch index's base pointer of
// any query operand: float32, bfloat16 pairs' source, widened half): its batch index's row,
// the group's members being consecutive batch indices of the last batch dimension.
template <class T>
inline const T* QueryRowOf(const SdpaParams& p, const Tile& tile, const T* base, int64_t r) {
  const TileRow row = TileRowOf(tile, r);
  return base + (row.batch - tile.batch) * p.query_strides.batch[kMaxBatchRank - 1] +
         row.query * p.query_strides.row;
}
inline const float* QueryRowOf(const SdpaParams& p, const Tile& tile, int64_t r) {
  return QueryRowOf(p, tile, tile.query, r);
}

// Multiply-adds of one forward call: B·Lq·Lk·(E + Ev).
double ForwardMultiplyAdds(const SdpaParams& p) {
  return static_cast<double>(p.batch) * static_cast<double>(p.query_len) *
         static_cast<double>(p.key_len) * static_cast<double>(p.head_dim + p.value_dim);
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_FORWARD_COMMON_INL_H_
