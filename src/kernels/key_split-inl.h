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
#include <atomic>
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

// The partial results of `count` (item, chunk) pairs of `rows` rows each, pair i at at(i):
// `rows` rows of out_stride floats, then the rows' maxima, sums and visible flags.
class PartialResults {
 public:
  PartialResults(const SdpaParams& p, int64_t count, int64_t rows) {
    const auto out_stride = static_cast<int64_t>(
        hwy::RoundUpTo(static_cast<size_t>(p.value_dim), static_cast<size_t>(kLanes)));
    const int64_t floats_per_item = rows * (out_stride + 3);
    if (count == 0) return;
    buffer_ = hwy::AllocateAligned<float>(static_cast<size_t>(count * floats_per_item));
    if (!buffer_) {
      throw Error("fused attention: out of memory for the key split's partial results");
    }
    partials_.resize(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      float* base = buffer_.get() + i * floats_per_item;
      float* stats = base + rows * out_stride;
      partials_[static_cast<size_t>(i)] = PartialRows{
          base, out_stride, stats, stats + rows, reinterpret_cast<uint8_t*>(stats + 2 * rows)};
    }
  }
  const PartialRows* at(int64_t i) const { return partials_.data() + i; }

 private:
  hwy::AlignedFreeUniquePtr<float[]> buffer_;
  std::vector<PartialRows> partials_;
};

// Every row of `count` work items from their chunks' partial results (`chunks` per item,
// item-major from `partials`), items and rows in order; locate as in RunItems.
template <class Locate>
void MergeItems(const SdpaParams& p, const PartialRows* partials, int64_t count, int64_t chunks,
                int64_t rows, const Locate& locate) {
  Tile tile{};
  tile.batch = -1;
  for (int64_t item = 0; item < count; ++item) {
    int64_t batch = 0, query = 0;
    for (int64_t r = 0; r < rows && locate(item, r, batch, query); ++r) {
      if (tile.batch != batch) SetTileBatch(p, batch, tile);
      MergeRow(p, partials + item * chunks, chunks, r, tile, query);
    }
  }
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
    // 16-byte load, a store-forwarding stall per item (BENCHMARKS.md, "Per-call cost of a
    // plan").
    const KeySpan all_keys{0, p.key_len, nullptr};
    ParallelItems<Workspace_>(p, ForwardMultiplyAdds(p), count,
                              [&](Workspace_& ws, int64_t item) { run(ws, item, all_keys); });
    return;
  }
  const PartialResults partials(p, count * split.chunks, rows);
  // Units of work: (group of `share` items, chunk), the group's items in order.
  const int64_t groups = (count + share - 1) / share;
  ParallelItems<Workspace_>(
      p, ForwardMultiplyAdds(p), groups * split.chunks, [&](Workspace_& ws, int64_t unit) {
        const int64_t chunk = unit % split.chunks, first = unit / split.chunks * share;
        const int64_t begin = chunk * split.chunk_len;
        for (int64_t item = first; item < std::min(count, first + share); ++item) {
          run(ws, item,
              KeySpan{begin, std::min(split.chunk_len, p.key_len - begin),
                      partials.at(item * split.chunks + chunk)});
        }
      });
  MergeItems(p, partials.at(0), count, split.chunks, rows, locate);
}

// The work items of one problem of a batched call (RunBatchItems): `count` items, `share`
// of them reading the same K and V (as RunItems takes them).
struct ProblemItems {
  int64_t count;
  int64_t share;
};

// Runs the work items of `problems` (one params each: the sequences of a paged decoding
// batch, which differ in their lengths, operands and positions, never in their options or
// dimensions) as one work list on problems[0].num_threads threads, so that a short problem
// does not leave threads idle and a long one is shared by all of them:
//  - each problem is cut exactly as RunItems cuts it alone (PlanKeySplit of its own shape:
//    whole items over all keys, or (share items, key chunk) units writing partial results);
//  - the units of all problems run largest first (keys × items), each on one thread;
//  - each split problem's rows are merged in order (MergeItems) by the thread that ran its
//    last unit.
// So every problem's results are bitwise those of RunItems on it alone, whatever the thread
// count and whatever else the batch holds. `widest`: problems[0] with the largest key_len
// of the batch, which sizes the per-thread workspaces. run(ws, problem, item, span) and
// locate(problem, item, r, batch, query) as RunItems' with the problem's index first.
template <class Workspace_, class RunItem, class Locate>
void RunBatchItems(const SdpaParams& widest, const SdpaParams* problems,
                   const ProblemItems* items, int64_t count, int64_t rows, const RunItem& run,
                   const Locate& locate) {
  struct Unit {
    int64_t problem, first, chunk;
    double keys;  // keys × items of the unit: its share of the batch's reads
  };
  std::vector<KeySplit> splits(static_cast<size_t>(count));
  std::vector<int64_t> first_partial(static_cast<size_t>(count) + 1, 0);
  std::vector<Unit> units;
  double multiply_adds = 0;
  for (int64_t s = 0; s < count; ++s) {
    const SdpaParams& p = problems[s];
    const ProblemItems& it = items[s];
    const KeySplit split = PlanKeySplit(p, it.count, it.share);
    splits[static_cast<size_t>(s)] = split;
    first_partial[static_cast<size_t>(s) + 1] =
        first_partial[static_cast<size_t>(s)] + (split.chunks > 1 ? it.count * split.chunks : 0);
    multiply_adds += ForwardMultiplyAdds(p);
    // Unsplit: one unit per item (over all keys, as RunItems); split: per (group, chunk).
    const int64_t share = split.chunks > 1 ? it.share : 1;
    for (int64_t first = 0; first < it.count; first += share) {
      const double n = static_cast<double>(std::min(share, it.count - first));
      for (int64_t chunk = 0; chunk < split.chunks; ++chunk) {
        const int64_t keys = std::min(split.chunk_len, p.key_len - chunk * split.chunk_len);
        units.push_back({s, first, chunk, n * static_cast<double>(keys)});
      }
    }
  }
  // Largest first (ties in order): the last units to start are the shortest.
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& a, const Unit& b) { return a.keys > b.keys; });
  const PartialResults partials(widest, first_partial.back(), rows);
  // Units of each split problem still to run: the thread that runs a problem's last unit
  // merges its rows (while its partial results are still in that core's cache), the same
  // sums in the same order whichever thread it is.
  std::vector<std::atomic<int64_t>> pending(static_cast<size_t>(count));
  for (const Unit& unit : units) pending[static_cast<size_t>(unit.problem)].fetch_add(1);
  ParallelItems<Workspace_>(
      widest, multiply_adds, static_cast<int64_t>(units.size()),
      [&](Workspace_& ws, int64_t u) {
        const Unit& unit = units[static_cast<size_t>(u)];
        const SdpaParams& p = problems[unit.problem];
        const KeySplit& split = splits[static_cast<size_t>(unit.problem)];
        if (split.chunks == 1) {
          const KeySpan all_keys{0, p.key_len, nullptr};
          run(ws, unit.problem, unit.first, all_keys);
          return;
        }
        const ProblemItems& it = items[unit.problem];
        const int64_t begin = unit.chunk * split.chunk_len;
        const int64_t base = first_partial[static_cast<size_t>(unit.problem)];
        for (int64_t item = unit.first; item < std::min(it.count, unit.first + it.share);
             ++item) {
          run(ws, unit.problem, item,
              KeySpan{begin, std::min(split.chunk_len, p.key_len - begin),
                      partials.at(base + item * split.chunks + unit.chunk)});
        }
        // acq_rel: the other units' partial results are visible to the merging thread.
        if (pending[static_cast<size_t>(unit.problem)].fetch_sub(1, std::memory_order_acq_rel) ==
            1) {
          MergeItems(p, partials.at(base), it.count, split.chunks, rows,
                     [&](int64_t item, int64_t r, int64_t& batch, int64_t& query) {
                       return locate(unit.problem, item, r, batch, query);
                     });
        }
      });
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_KEY_SPLIT_INL_H_
