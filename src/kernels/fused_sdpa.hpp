// fused_sdpa.hpp: the fused tiled online-softmax forward (Highway, one source for every SIMD
// target, dispatched at run time), as two kernel-list entries: row groups for a few queries
// per head, query tiles for the rest. Either may split its keys into chunks (the key split).
#pragma once

#include <cstdint>

#include "sdpa_params.hpp"

namespace attend::detail {

// Row groups (lanes along E): null when a query tile would be at most half full on the
// dispatched SIMD target (2·Lq <= lanes), else the reason. Where G query heads share a K/V
// head and G·Lq rows fill more than half a tile, the entry runs them as grouped-query tiles
// (shape_policy.hpp: PacksGroupedQueries), decided per call.
const char* fused_sdpa_rows_rejects(const SdpaParams& params);
void fused_sdpa_rows(const SdpaParams& params);
// The row groups of `count` problems (the sequences of a paged decoding batch: the same
// options, dimensions, threads and kind of K/V, their own lengths, operands, block tables
// and positions; each accepted by fused_sdpa_rows_rejects) as one work list over all threads
// (key_split-inl.h: RunBatchItems): each problem's results bitwise those of
// fused_sdpa_rows on it alone, whatever the thread count and the rest of the batch.
void fused_sdpa_rows_batch(const SdpaParams* problems, int64_t count);

// Query tiles (queries along the lanes): every problem, and the only kernel for bfloat16
// products (SdpaParams::bf16).
const char* fused_sdpa_tiles_rejects(const SdpaParams& params);
void fused_sdpa_tiles(const SdpaParams& params);

// Float32 lanes of the dispatched SIMD target.
int64_t fused_lanes();

// How the rows or tiles kernel will run `params` on the dispatched target.
struct FusedPlan {
  bool rows;       // row groups, else query tiles
  int64_t items;   // work items (row groups or query tiles)
  int64_t chunks;  // key chunks per item: 1, or the key split's count
  bool grouped;    // rows: grouped-query tiles (shape_policy.hpp: PacksGroupedQueries)
};
FusedPlan fused_sdpa_plan(const SdpaParams& params, bool rows);

}  // namespace attend::detail
