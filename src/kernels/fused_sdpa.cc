// fused_sdpa.cc: tiled online-softmax attention (FlashAttention's recurrence, Dao et al. 2022)
// in one Highway source compiled for every SIMD target and dispatched at run time.
//
// Reads  query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev), optional mask and bias
//        broadcast to (..., Lq, Lk): see sdpa_params.hpp.
// Writes output (..., Lq, Ev) and, on request, weights (..., Lq, Lk).
//
// Layout: queries run along the SIMD lanes. A query tile of QV vectors (Tq = QV·lanes
// queries) is transposed once into query_t[e][q], pre-multiplied by scale·log2(e) so that
// softmax can use exp2. For each key tile of Tk keys the kernel computes the transposed
// score tile score_t[j][q] = Σ_e query_t[e][q]·K[j][e] with K read in its natural layout
// as broadcasts; the online-softmax max, sum and rescale factor of every query are then
// per-lane vectors with no horizontal reductions, and out_t[ev][q] += Σ_j score_t[j][q]·V[j][ev]
// reads V as broadcasts too. Nothing of size Lq×Lk is materialized unless weights are
// requested, which takes a second pass over the keys with the final max and sum.
//
// Recurrence per query (log2 domain, s = score·log2 e):
//   m' = max(m, max_j s_j);  α = 2^(m − m');  l' = α·l + Σ_j 2^(s_j − m');
//   o' = α·o + Σ_j 2^(s_j − m')·keep_j·v_j;    finally output = o / l / (1 − p).
//
// With a sink the recurrence starts at m = sink·log2 e, l = 1, o = 0 (a key with no value).
// Between Q·Kᵀ and the softmax the scores go through the score rules (score_rule_layer.hpp,
// a vector at a time in score_rules-inl.h); key tiles that no row of a query tile sees are
// never loaded.
//
// Work items, one thread each: query tiles (query_tiles-inl.h) or, with a few queries per
// head, row groups (row_groups-inl.h, lanes along E): two entries of the kernel list
// (kernel_list.cpp). Calls with few work items split their keys into chunks merged by the
// same recurrence (key_split-inl.h); query tiles over K/V rows interleaved with other heads'
// read a per-thread contiguous copy (packing-inl.h).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fused_sdpa.cc"
#include "kernels/fused_sdpa.hpp"

#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attend/error.hpp"

#include "shape_policy.hpp"
#include "simd_dispatch.hpp"

// Each once per target, in this order (each uses what the ones before it define):
// Exp2, kLog2e, DenormalsAreZero and ParallelItems;
#include "kernels/kernel_common-inl.h"
// the score rules a vector at a time (softcap, ALiBi, exclusions, tile verdicts);
#include "kernels/score_rules-inl.h"
// Tile, KeySpan, PartialRows, log-sum-exp, fully excluded rows;
#include "kernels/forward_common-inl.h"
// register transposes and the packed K/V copy;
#include "kernels/packing-inl.h"
// K and V as stored, widened a vector at a time;
#include "kernels/kv_loads-inl.h"
// bfloat16 products (AVX512_BF16): pair packing and register blocks;
#include "kernels/isa/avx512_bf16-inl.h"
// bfloat16 products on AMX tiles: the same interface;
#include "kernels/isa/amx_bf16-inl.h"
// float16 products (AVX512_FP16): the same interface;
#include "kernels/isa/avx512_fp16-inl.h"
// the query-tile kernel;
#include "kernels/query_tiles-inl.h"
// the row-group kernel;
#include "kernels/row_groups-inl.h"
// the key split and its merge, and the loop over work items.
#include "kernels/key_split-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Row r of row group `item` as (batch index, query), false past the group's last row.
HWY_INLINE bool LocateRow(const SdpaParams& p, const RowGroups& groups, int64_t item, int64_t r,
                          int64_t& batch, int64_t& query) {
  if (r >= groups.rows(p, item)) return false;
  batch = groups.first_batch(item) + (groups.across ? r : 0);
  query = groups.across ? 0 : groups.first_query(item) + r;
  return true;
}

void RunAllRows(const SdpaParams& p) {
  const RowGroups groups(p);
  RunItems<RowWorkspace>(
      p, groups.count, groups.size,
      [&](RowWorkspace& ws, int64_t item, KeySpan span) { groups.Run(p, ws, item, span); },
      [&](int64_t item, int64_t r, int64_t& batch, int64_t& query) {
        return LocateRow(p, groups, item, r, batch, query);
      },
      groups.share(p));
}

// A thread's row workspace in a batched call: the problem its cached tile pointers
// (RowWorkspace::tile_batch) belong to, forgotten when the next unit is another problem's.
struct BatchRowWorkspace : RowWorkspace {
  explicit BatchRowWorkspace(const SdpaParams& p) : RowWorkspace(p) {}
  int64_t problem = -1;
};

// The row groups of several problems as one work list (RunBatchItems).
void FusedSdpaRowsBatch(const SdpaParams* problems, int64_t count) {
  std::vector<RowGroups> groups;
  std::vector<ProblemItems> items;
  groups.reserve(static_cast<size_t>(count));
  items.reserve(static_cast<size_t>(count));
  SdpaParams widest = problems[0];
  for (int64_t s = 0; s < count; ++s) {
    groups.emplace_back(problems[s]);
    items.push_back({groups.back().count, groups.back().share(problems[s])});
    widest.key_len = std::max(widest.key_len, problems[s].key_len);
  }
  RunBatchItems<BatchRowWorkspace>(
      widest, problems, items.data(), count, kMaxRowGroup,
      [&](BatchRowWorkspace& ws, int64_t s, int64_t item, KeySpan span) {
        if (ws.problem != s) {
          std::fill_n(ws.tile_batch, kMaxRowGroup, int64_t{-1});
          ws.problem = s;
        }
        groups[static_cast<size_t>(s)].Run(problems[s], ws, item, span);
      },
      [&](int64_t s, int64_t item, int64_t r, int64_t& batch, int64_t& query) {
        return LocateRow(problems[s], groups[static_cast<size_t>(s)], item, r, batch, query);
      });
}

// Products: void (float32 products) or a bfloat16 products struct (isa/).
template <int QV, class Products>
void RunAllTiles(const SdpaParams& p) {
  constexpr int64_t tq = QV * kLanes;
  const int64_t tiles_per_batch = (p.query_len + tq - 1) / tq;
  const bool pack = ShouldPackKeysAndValues(p, kLanes);
  RunItems<Workspace>(
      p, p.batch * tiles_per_batch, tq,
      [&](Workspace& ws, int64_t item, KeySpan span) {
        const int64_t q0 = (item % tiles_per_batch) * tq;
        Tile tile = MakeTile(p, item / tiles_per_batch, q0, std::min(tq, p.query_len - q0));
#if ATTEND_AMX_BF16
        if constexpr (kTakesTileOperands<Products>) {
          ws.amx.Pack(tile.key_half, tile.key_stride, tile.value_half, tile.value_stride,
                      p.head_dim, p.value_dim, span.begin, span.count);
          const amx::TileScope tiles;
          TileAttention<QV, Products>(p, ws).Run(tile, span);
          return;
        }
#endif
        if constexpr (!std::is_void_v<Products>) {
          ws.bf16.Pack(p, tile, span.begin, span.count);
        } else if (p.half_kv() || (pack && span.partial == nullptr)) {
          PackKeysAndValues(p, ws.packed, tile);
        }
        TileAttention<QV, Products>(p, ws).Run(tile, span);
      },
      [&](int64_t item, int64_t r, int64_t& batch, int64_t& query) {
        batch = item / tiles_per_batch;
        query = (item % tiles_per_batch) * tq + r;
        return query < p.query_len;
      });
}

// Grouped-query tiles (shape_policy.hpp: PacksGroupedQueries): the G·Lq rows of each K/V
// head's group of G batch indices as packed rows (UnpackRow), in query tiles of QV vectors;
// K and V read once per tile, which the whole group shares (half-precision K and V: from the
// thread's widened copy of the K/V head, PackKeysAndValues). Every row goes through the merge
// (RunItems' `merged`), which writes it to its own head's output and log-sum-exp.
//   item = group index · tiles_per_group + tile; tile t holds packed rows [t·Tq, t·Tq + Tq).
// Products: void (float32 products) or Avx512Bf16 (bfloat16 Q, K and V; K and V packed as
// pairs once per thread and key span, as the query tiles pack them: Bf16Operands::Pack, which
// also widens K and V as stored, in place or through a block table: bf16_kv_products).
template <int QV, class Products>
void RunGroupedTiles(const SdpaParams& p, int64_t group) {
  constexpr int64_t tq = QV * kLanes;
  const int64_t packed_rows = group * p.query_len;
  const int64_t tiles_per_group = (packed_rows + tq - 1) / tq;
  RunItems<Workspace>(
      p, p.batch / group * tiles_per_group, tq,
      [&](Workspace& ws, int64_t item, KeySpan span) {
        const int64_t r0 = (item % tiles_per_group) * tq;
        Tile tile = MakeTile(p, item / tiles_per_group * group, r0, std::min(tq, packed_rows - r0));
        tile.group = group;
        if constexpr (!std::is_void_v<Products>) {
          ws.bf16.Pack(p, tile, span.begin, span.count);
        } else if (p.half_kv()) {
          PackKeysAndValues(p, ws.packed, tile);  // widened once per thread
        }
        TileAttention<QV, Products>(p, ws).Run(tile, span);
      },
      [&](int64_t item, int64_t r, int64_t& batch, int64_t& query) {
        const int64_t row = (item % tiles_per_group) * tq + r;
        if (row >= packed_rows) return false;
        const PackedRow packed = UnpackRow(row, group);
        batch = item / tiles_per_group * group + packed.member;
        query = packed.query;
        return true;
      },
      1, true);
}

// run(std::integral_constant<int, QV>) for QV = TileVectors(rows) (shape_policy.hpp): the
// query tiles' height for `rows` rows per batch index (or per K/V head's packed rows).
template <class Run>
void WithTileVectors(int64_t rows, const Run& run) {
  const int64_t vectors = TileVectors(rows, kLanes);
  if (vectors == 4) return run(std::integral_constant<int, 4>{});
  if (vectors == 3) return run(std::integral_constant<int, 3>{});
  if (vectors == 2) return run(std::integral_constant<int, 2>{});
  return run(std::integral_constant<int, 1>{});
}

// Grouped-query tiles of TileVectors(G·Lq) vectors.
template <class Products>
void RunGroupedTilesOfHeight(const SdpaParams& p) {
  const int64_t group = SharedKeyValueGroup(p);
  WithTileVectors(group * p.query_len, [&](auto qv) {
    RunGroupedTiles<decltype(qv)::value, Products>(p, group);
  });
}

void FusedSdpaRows(const SdpaParams& p) {
  if (PacksGroupedQueries(p, kLanes)) {
    if (p.bf16_products()) {
#if ATTEND_AVX512_BF16
      return RunGroupedTilesOfHeight<Avx512Bf16>(p);
#else
      HWY_ABORT("bfloat16 products on a target without AVX512_BF16");
#endif
    }
    return RunGroupedTilesOfHeight<void>(p);
  }
  RunAllRows(p);
}

// Query tiles of TileVectors(Lq) vectors (shape_policy.hpp).
template <class Products>
void RunTilesOfHeight(const SdpaParams& p) {
  WithTileVectors(p.query_len, [&](auto qv) { RunAllTiles<decltype(qv)::value, Products>(p); });
}

void FusedSdpaTiles(const SdpaParams& p) {
  if (p.f16_products()) {
#if ATTEND_AVX512_FP16
    return RunTilesOfHeight<Avx512Fp16>(p);
#else
    HWY_ABORT("float16 products on a target without AVX512_FP16");
#endif
  }
  if (p.bf16_products()) {
#if ATTEND_AMX_BF16
    if (p.amx_tiles) return RunTilesOfHeight<AmxBf16>(p);
#endif
#if ATTEND_AVX512_BF16
    return RunTilesOfHeight<Avx512Bf16>(p);
#else
    HWY_ABORT("bfloat16 products on a target without AVX512_BF16");
#endif
  }
  RunTilesOfHeight<void>(p);
}

int64_t FusedLanes() { return kLanes; }

// What FusedSdpaRows or FusedSdpaTiles will do with `p`: the work items and key chunks.
FusedPlan PlanFused(const SdpaParams& p, bool rows) {
  int64_t items, share = 1;
  if (rows && PacksGroupedQueries(p, kLanes)) {
    const int64_t packed_rows = SharedKeyValueGroup(p) * p.query_len;
    const int64_t tq = TileVectors(packed_rows, kLanes) * kLanes;
    items = p.batch / SharedKeyValueGroup(p) * ((packed_rows + tq - 1) / tq);
    return {rows, items, PlanKeySplit(p, items).chunks, true};
  }
  if (rows) {
    const RowGroups groups(p);
    items = groups.count;
    share = groups.share(p);
  } else {
    const int64_t tq = TileVectors(p.query_len, kLanes) * kLanes;
    items = p.batch * ((p.query_len + tq - 1) / tq);
  }
  return {rows, items, PlanKeySplit(p, items, share).chunks, false};
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attend::detail {

HWY_EXPORT(FusedSdpaRows);
HWY_EXPORT(FusedSdpaRowsBatch);
HWY_EXPORT(FusedSdpaTiles);
HWY_EXPORT(FusedLanes);
HWY_EXPORT(PlanFused);

const char* fused_sdpa_rows_rejects(const SdpaParams& params) {
  if (params.half_products() && !PacksGroupedQueries(params, ATTEND_DISPATCH(FusedLanes)())) {
    return "bfloat16 and float16 products run in query tiles";
  }
  // K and V only the row groups read (a block table, a format the tiles do not widen): any Lq.
  if (params.block_table != nullptr || (params.stored_kv() && !params.half_kv())) return nullptr;
  if (RunsInRowGroups(params.query_len, ATTEND_DISPATCH(FusedLanes)())) return nullptr;
  return "more queries than half the SIMD lanes (a query tile fills better)";
}

void fused_sdpa_rows(const SdpaParams& params) { ATTEND_DISPATCH(FusedSdpaRows)(params); }

void fused_sdpa_rows_batch(const SdpaParams* problems, int64_t count) {
  if (count <= 0) return;
  if (problems[0].half_products()) {
    throw Error("fused_sdpa_rows_batch: half-precision products run a problem at a time");
  }
  for (int64_t s = 1; s < count; ++s) {
    const SdpaParams& a = problems[0];
    const SdpaParams& b = problems[s];
    if ((a.block_table == nullptr) != (b.block_table == nullptr) || a.head_dim != b.head_dim ||
        a.value_dim != b.value_dim || a.num_threads != b.num_threads || b.half_products()) {
      throw Error("fused_sdpa_rows_batch: problems differ in more than their sizes and operands");
    }
  }
  ATTEND_DISPATCH(FusedSdpaRowsBatch)(problems, count);
}

const char* fused_sdpa_tiles_rejects(const SdpaParams& params) {
  if (params.stored_kv() && !params.half_kv()) {
    return "K and V in a storage format only the row groups read";
  }
  if (params.block_table != nullptr) return "K and V through a block table (the row groups)";
  return nullptr;
}

void fused_sdpa_tiles(const SdpaParams& params) { ATTEND_DISPATCH(FusedSdpaTiles)(params); }

int64_t fused_lanes() { return ATTEND_DISPATCH(FusedLanes)(); }

FusedPlan fused_sdpa_plan(const SdpaParams& params, bool rows) {
  return ATTEND_DISPATCH(PlanFused)(params, rows);
}

}  // namespace attend::detail
#endif  // HWY_ONCE
