// key_split-inl.h: the key split (FlashDecoding's split-KV) and its log-sum-exp merge, and
// the loop that runs a call's work items over all keys or over key chunks. Compiled once per
// Highway target (include after query_tiles-inl.h, whose key tile the chunks align to).
#if defined(ATTEND_KERNELS_KEY_SPLIT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_KEY_SPLIT_INL_H_
#undef ATTEND_KERNELS_KEY_SPLIT_INL_H_
#else
#define ATTEND_KERNELS_KEY_SPLIT_INL_H_
#endif

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attend/error.hpp"
#include "sdpa_params.hpp"
#include "shape_policy.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The key split (shape_policy.hpp: PlanKeySplit): chunks of whole key tiles.
static_assert(kSplitGranule % kKeyTile == 0 && kSplitGranule % 4 == 0);

// Row r of a work item from its chunks' partial results: with M = max_c m_c and
// α_c = 2^(m_c − M), output = Σ_c α_c·o_c / Σ_c α_c·l_c (chunks in order: deterministic).
// `tile` holds the operands of the row's batch index.
void MergeRow(const SdpaParams& p, const PartialRows* chunks, int64_t count, int64_t r,
              const Tile& tile, int64_t query) {
  float max = -std::numeric_limits<float>::infinity();
  bool visible = false;
  for (int64_t c = 0; c < count; ++c) {
    max = std::max(max, chunks[c].max[r]);
    visible = visible || chunks[c].visible[r] != 0;
  }
  float* dest = tile.output + query * p.output_strides.row;
  std::fill_n(dest, p.value_dim, 0.0f);
  float sum = 0.0f;
  for (int64_t c = 0; c < count; ++c) {
    if (chunks[c].max[r] == -std::numeric_limits<float>::infinity()) continue;  // no keys
    const float alpha = std::exp2(chunks[c].max[r] - max);
    sum += alpha * chunks[c].sum[r];
    const float* out = chunks[c].out + r * chunks[c].out_stride;
    for (int64_t col = 0; col < p.value_dim; ++col) dest[col] += alpha * out[col];
  }
  const float inv_sum = 1.0f / sum;
  for (int64_t col = 0; col < p.value_dim; ++col) dest[col] *= inv_sum;
  const bool excluded_row = !visible && fixes_fully_excluded_rows(p);
  if (tile.logsumexp) {
    tile.logsumexp[query * p.logsumexp_strides.row] =
        excluded_row ? FullyExcludedLogSumExp(p) : LogSumExp(max, sum);
  }
  if (excluded_row) WriteFullyExcludedRow(p, tile, query);
}

// Runs the `count` work items of a call (row groups or query tiles of up to `rows` rows)
// over all keys or, when PlanKeySplit splits them, over each key chunk, then merges each
// row's chunks. run(ws, item, span) computes one item over one span; locate(item, r, batch,
// query) names row r of an item, false past its last row. `share`: consecutive items that
// read the same K and V (see kShareChunk), run chunk by chunk on one thread. `merged`: the
// items leave every row to the merge, even over all keys in one chunk (grouped-query tiles,
// whose rows belong to several heads: the merge writes each through `locate`).
template <class Workspace_, class RunItem, class Locate>
void RunItems(const SdpaParams& p, int64_t count, int64_t rows, const RunItem& run,
              const Locate& locate, int64_t share = 1, bool merged = false) {
  const KeySplit split = PlanKeySplit(p, count, share);
  if (split.chunks == 1 && !merged) {
    // Built once: a span built per item is stored in two halves and read back as one
    // 16-byte load, a store-forwarding stall per item (tiny calls: 3 % of phrase-plan).
    const KeySpan all_keys{0, p.key_len, nullptr};
    ParallelItems<Workspace_>(p, ForwardMultiplyAdds(p), count,
                              [&](Workspace_& ws, int64_t item) { run(ws, item, all_keys); });
    return;
  }
  // Partial results of every (item, chunk): `rows` rows of out_stride floats, then the
  // rows' maxima, sums and visible flags.
  const int64_t items = count * split.chunks;
  const auto out_stride = static_cast<int64_t>(
      hwy::RoundUpTo(static_cast<size_t>(p.value_dim), static_cast<size_t>(kLanes)));
  const int64_t floats_per_item = rows * (out_stride + 3);
  auto buffer = hwy::AllocateAligned<float>(static_cast<size_t>(items * floats_per_item));
  if (!buffer) throw Error("fused attention: out of memory for the key split's partial results");
  std::vector<PartialRows> partials(static_cast<size_t>(items));
  for (int64_t i = 0; i < items; ++i) {
    float* base = buffer.get() + i * floats_per_item;
    float* stats = base + rows * out_stride;
    partials[static_cast<size_t>(i)] = PartialRows{base, out_stride, stats, stats + rows,
                                                   reinterpret_cast<uint8_t*>(stats + 2 * rows)};
  }
  // Units of work: (group of `share` items, chunk), the group's items in order.
  const int64_t groups = (count + share - 1) / share;
  ParallelItems<Workspace_>(
      p, ForwardMultiplyAdds(p), groups * split.chunks, [&](Workspace_& ws, int64_t unit) {
        const int64_t chunk = unit % split.chunks, first = unit / split.chunks * share;
        const int64_t begin = chunk * split.chunk_len;
        for (int64_t item = first; item < std::min(count, first + share); ++item) {
          run(ws, item,
              KeySpan{begin, std::min(split.chunk_len, p.key_len - begin),
                      &partials[static_cast<size_t>(item * split.chunks + chunk)]});
        }
      });
  Tile tile{};
  tile.batch = -1;
  for (int64_t item = 0; item < count; ++item) {
    int64_t batch = 0, query = 0;
    for (int64_t r = 0; r < rows && locate(item, r, batch, query); ++r) {
      if (tile.batch != batch) SetTileBatch(p, batch, tile);
      MergeRow(p, partials.data() + item * split.chunks, split.chunks, r, tile, query);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_KEY_SPLIT_INL_H_
