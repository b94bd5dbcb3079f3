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
// Work items, one thread each: query tiles (above) or, with a few queries per head, row
// groups (RowGroupAttention, lanes along E). Calls with few work items split their keys into
// chunks merged by the same recurrence (PlanKeySplit); query tiles over K/V rows interleaved
// with other heads' read a per-thread contiguous copy (PackKeysAndValues).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fused_sdpa.cc"
#include "kernels/fused_sdpa.hpp"

#include <hwy/aligned_allocator.h>
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attend/error.hpp"
#include "attend/sdpa.hpp"
#include "dropout.hpp"
#include "score_rule_layer.hpp"
#include "simd_dispatch.hpp"

// Exp2, kLog2e, DenormalsAreZero and ParallelItems, once per target.
#include "kernels/kernel_common-inl.h"
// The score rules a vector at a time (softcap, ALiBi, exclusions), once per target.
#include "kernels/score_rules-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Key tile: 128 keys. The score tile (128 × Tq floats, 32 KiB at Tq = 64) stays in L1 while
// it is exponentiated and multiplied by V; measured 64–256 within 2% on Zen 5.
constexpr int64_t kKeyTile = 128;
// At most 4 query vectors per tile (64 queries on AVX-512): enough rows to amortize each
// K and V broadcast over 4 FMAs.
constexpr int kMaxQueryVectors = 4;
// Register blocks: the query vectors of a tile (QV, up to 4) × kScoreKeys keys of score
// accumulators, and the same query vectors × kValueColumns value columns of output
// accumulators, kAccumulators in all. 32-register targets: 24 (4×6: 4 + 6 loads per 24
// FMAs; 2×12 for tiles of 2 vectors: 0–17 % faster than 2×6 at Lq = 32, E = 64 in two
// noisy comparisons).
// 16-register targets: 8, leaving room for the operands.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kAccumulators = 24;
#else
constexpr int kAccumulators = 8;
#endif

// Natural log-sum-exp of a row from its log2-domain maximum m and its sum l = Σ 2^(s − m).
inline float LogSumExp(float max_log2, float sum) {
  return static_cast<float>(static_cast<double>(max_log2) * 0.6931471805599453 +
                            std::log(static_cast<double>(sum)));
}
// A row whose every key is excluded: the listing's scores are all -1e9, so
// log Σ exp = -1e9 + log Lk; -inf when such rows are zeroed.
inline float FullyExcludedLogSumExp(const SdpaParams& p) {
  return p.zero_fully_masked_rows
             ? -std::numeric_limits<float>::infinity()
             : static_cast<float>(-1e9 + std::log(static_cast<double>(p.key_len)));
}

// Per-thread scratch, allocated once per call and thread (never in the tile loops).
struct Workspace {
  hwy::AlignedFreeUniquePtr<float[]> query_t;    // [E][Tq]   scaled, transposed queries
  hwy::AlignedFreeUniquePtr<float[]> score_t;    // [Tk][Tq]  scores, then probabilities
  hwy::AlignedFreeUniquePtr<float[]> out_t;      // [Ev][Tq]  unnormalized output
  hwy::AlignedFreeUniquePtr<float[]> row_max;    // [Tq]      running max m (log2 domain)
  hwy::AlignedFreeUniquePtr<float[]> row_sum;    // [Tq]      running sum l
  hwy::AlignedFreeUniquePtr<float[]> alpha;      // [Tq]      rescale factor of this key tile
  hwy::AlignedFreeUniquePtr<uint8_t[]> visible;  // [Tq]      some key not excluded so far
  hwy::AlignedFreeUniquePtr<float[]> tile_max;   // [Lk/Tk][Tq] reference point per key tile
  hwy::AlignedFreeUniquePtr<int64_t[]> visited;  // [Lk/Tk]    first key of each visited tile
  RowRules row_rules;                            // the tile's rows' visible keys and documents
  KeepTile keep;                                 // [Tk][Tq]  pairwise rules' verdicts
  // See PackKeysAndValues: K [Lk][E] and V [Lk][Ev] of one batch index, contiguous
  // (allocated at the first use; null if that failed), and the operands copied.
  hwy::AlignedFreeUniquePtr<float[]> packed;
  const float* packed_key_from = nullptr;
  const float* packed_value_from = nullptr;

  explicit Workspace(const SdpaParams& p) {
    const int64_t tq = kMaxQueryVectors * kLanes;
    query_t = hwy::AllocateAligned<float>(static_cast<size_t>(p.head_dim * tq));
    score_t = hwy::AllocateAligned<float>(static_cast<size_t>(kKeyTile * tq));
    out_t =
        hwy::AllocateAligned<float>(static_cast<size_t>(std::max<int64_t>(p.value_dim, 1) * tq));
    row_max = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    row_sum = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    alpha = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    visible = hwy::AllocateAligned<uint8_t>(static_cast<size_t>(tq));
    const int64_t key_tiles = (p.key_len + kKeyTile - 1) / kKeyTile;
    tile_max = hwy::AllocateAligned<float>(static_cast<size_t>((p.weights ? key_tiles : 1) * tq));
    visited = hwy::AllocateAligned<int64_t>(static_cast<size_t>(p.weights ? key_tiles : 1));
    row_rules.Allocate(tq);
    if (has_pairwise_rules(p)) keep.Allocate(kKeyTile, tq);
  }
  bool ok() const {
    return query_t && score_t && out_t && row_max && row_sum && alpha && visible && tile_max &&
           visited && row_rules.ok() && keep.ok();
  }
};

// One (batch, query tile) work item: the operands' base pointers and the tile's extent.
struct Tile {
  int64_t batch;
  int64_t first_query;  // q0
  int64_t rows;         // queries in this tile, <= Tq
  const float* query;   // batch base pointers
  const float* key;
  const float* value;
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
    if (p.dropout > 0) weight = dropout_keep(p.seed, threshold, tile.batch, query, j) ? kept : 0.0f;
    if (w) w[j] = weight;
    const float* v = tile.value + j * tile.value_stride;
    for (int64_t c = 0; c < p.value_dim; ++c) o[c] += weight * v[c];
  }
}

// Query tiles read all of K and V once per tile. When the rows of K or V are not adjacent
// (heads interleaved, as in (N, L, H, D) views or the (N, L, 3, H, D) projections of a
// multi-head layer), a batch index's keys are spread over H (or 3H) times the memory, and
// every pass over them misses in L2 and the TLB: at unet's shape (L 4096, E 32) rows 384
// floats apart made the kernel 1.2–1.4× slower than contiguous ones. Each thread then first
// copies the K and V of the batch index it works on into a contiguous buffer of
// Lk·(E + Ev) floats (at most kMaxPackedFloats), which its tiles of that batch index read:
// one copy per thread and batch index against one pass per query tile. Only with several
// query tiles per batch index, and not for the chunks of a key split (few tiles).
constexpr int64_t kMaxPackedFloats = int64_t{8} << 20;  // 32 MiB per thread

bool ShouldPackKeysAndValues(const SdpaParams& p) {
  const bool interleaved = p.key_strides.row != p.head_dim || p.value_strides.row != p.value_dim;
  return interleaved && p.query_len > kMaxQueryVectors * kLanes &&
         p.key_len * (p.head_dim + p.value_dim) <= kMaxPackedFloats;
}

// Points `tile` at a contiguous copy of its K and V in ws.packed (made when the thread's
// last copy was of other operands); leaves it reading the operands if the buffer cannot be
// allocated.
void PackKeysAndValues(const SdpaParams& p, Workspace& ws, Tile& tile) {
  const int64_t E = p.head_dim, Ev = p.value_dim;
  if (!ws.packed) {
    ws.packed = hwy::AllocateAligned<float>(static_cast<size_t>(p.key_len * (E + Ev)));
    if (!ws.packed) return;
  }
  float* key = ws.packed.get();
  float* value = key + p.key_len * E;
  if (ws.packed_key_from != tile.key || ws.packed_value_from != tile.value) {
    for (int64_t j = 0; j < p.key_len; ++j) {
      std::copy_n(tile.key + j * tile.key_stride, E, key + j * E);
      std::copy_n(tile.value + j * tile.value_stride, Ev, value + j * Ev);
    }
    ws.packed_key_from = tile.key;
    ws.packed_value_from = tile.value;
  }
  tile.key = key;
  tile.value = value;
  tile.key_stride = E;
  tile.value_stride = Ev;
}

// score_t[j][q] = Σ_e query_t[e][q]·K[k0 + j][e] for KEYS keys starting at key_row:
// a KEYS × QV register block of accumulators, K entries broadcast from memory.
template <int QV, int KEYS>
HWY_INLINE void ScoreBlock(const float* HWY_RESTRICT query_t, const float* key_row,
                           int64_t key_stride, int64_t head_dim, float* HWY_RESTRICT score_t) {
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
}

// out_t[ev][q] = alpha[q]·out_t[ev][q] + Σ_j score_t[j][q]·V[j][ev] for COLS value columns
// and RQ query vectors (starting at vector r0): an RQ × COLS register block.
template <int QV, int RQ, int COLS>
HWY_INLINE void ValueBlock(const float* HWY_RESTRICT score_t, const float* value_column,
                           int64_t value_stride, int64_t keys, const float* HWY_RESTRICT alpha,
                           int r0, float* HWY_RESTRICT out_t_column) {
  const DF d;
  constexpr int64_t tq = QV * kLanes;
  VF acc[RQ][COLS];
  for (int r = 0; r < RQ; ++r) {
    const VF a = hn::Load(d, alpha + (r0 + r) * kLanes);
    for (int c = 0; c < COLS; ++c) {
      acc[r][c] = hn::Mul(a, hn::Load(d, out_t_column + c * tq + (r0 + r) * kLanes));
    }
  }
  for (int64_t j = 0; j < keys; ++j) {
    VF prob[RQ];
    for (int r = 0; r < RQ; ++r) prob[r] = hn::Load(d, score_t + j * tq + (r0 + r) * kLanes);
    const float* v = value_column + j * value_stride;
    for (int c = 0; c < COLS; ++c) {
      const VF vb = hn::Set(d, v[c]);
      for (int r = 0; r < RQ; ++r) acc[r][c] = hn::MulAdd(prob[r], vb, acc[r][c]);
    }
  }
  for (int r = 0; r < RQ; ++r) {
    for (int c = 0; c < COLS; ++c) {
      hn::Store(acc[r][c], d, out_t_column + c * tq + (r0 + r) * kLanes);
    }
  }
}

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

template <int QV>
class TileAttention {
 public:
  static constexpr int64_t kTq = QV * kLanes;
  // kAccumulators per register block whatever the tile height; at one query vector, 8
  // keys or columns (as many as FMA latency × ports): more would need a load per FMA.
  static constexpr int kScoreKeys = QV == 1 ? std::min(8, kAccumulators) : kAccumulators / QV;
  static constexpr int kValueColumns = kScoreKeys;

  TileAttention(const SdpaParams& p, Workspace& ws) : p_(p), ws_(ws) {}

  // The tile's rows over the keys of `span` (whole key tiles: span.begin is a multiple of
  // kKeyTile). Key tiles that no row of the tile sees (by position, document or mask) are
  // never loaded: the block sparsity of the score rules.
  void Run(const Tile& tile, KeySpan span) {
    LoadQueries(tile);
    const int64_t head = head_of(p_, tile.batch);
    if (may_exclude(p_)) ws_.row_rules.Load(p_, tile.batch, tile.first_query, tile.rows, kTq);
    // Keys past key_end are excluded by position for every row of the tile: skipped.
    const int64_t span_end = span.begin + span.count;
    const VisibleKeys last_row = visible_keys(p_, tile.first_query + tile.rows - 1);
    const int64_t key_end = std::clamp<int64_t>(last_row.reach(), 0, span_end);
    // The sink joins the first chunk's denominator as a key of score sink_h with no value.
    const bool sink = p_.sinks != nullptr && span.begin == 0;
    std::fill_n(ws_.row_max.get(), kTq,
                sink ? p_.sinks[head] * kLog2e : -std::numeric_limits<float>::infinity());
    std::fill_n(ws_.row_sum.get(), kTq, sink ? 1.0f : 0.0f);
    std::fill_n(ws_.visible.get(), kTq, uint8_t{0});
    std::fill_n(ws_.out_t.get(), p_.value_dim * kTq, 0.0f);
    const float keep_scale = 1.0f / (1.0f - p_.dropout);

    // One pass: online softmax with output accumulation. With weights, each key tile's
    // probabilities 2^(s − m_t) are written as they are and rescaled once the final m and
    // l are known, while the tile's rows are still in cache.
    int64_t visited = 0;
    for (int64_t k0 = span.begin; k0 < key_end; k0 += kKeyTile) {
      const int64_t keys = std::min(kKeyTile, key_end - k0);
      const TileVerdict verdict = ws_.row_rules.Classify(p_, tile.batch, k0, keys);
      if (verdict == TileVerdict::kEmpty ||
          (has_pairwise_rules(p_) &&
           !ws_.keep.Fill(p_, tile.batch, tile.mask, tile.first_query, tile.rows, k0, keys, kTq))) {
        if (tile.weights) ZeroWeights(tile, k0, k0 + keys);
        continue;
      }
      ComputeScores(tile, k0, keys, verdict);
      SoftmaxStep(keys, tile.weights ? ws_.tile_max.get() + visited * kTq : nullptr);
      if (p_.dropout > 0) ApplyDropout(tile, k0, keys);
      if (tile.weights) {
        ws_.visited[visited] = k0;
        WriteWeights(tile, k0, keys);
      }
      ++visited;
      AccumulateValues(tile, k0, keys, ws_.alpha.get());
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
    const bool fix_rows = FixesFullyExcludedRows(p_);
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
    float* query_t = ws_.query_t.get();
#if ATTEND_BLOCK_SHUFFLES
    if (p_.head_dim % kLanes == 0) {
      const DF d;
      const VF factor_v = hn::Set(d, factor);
      for (int64_t r0 = 0; r0 < kTq; r0 += kLanes) {
        for (int64_t e0 = 0; e0 < p_.head_dim; e0 += kLanes) {
          VF v[kLanes];
          for (int64_t i = 0; i < kLanes; ++i) {
            const float* q = tile.query + (tile.first_query + r0 + i) * p_.query_strides.row;
            v[i] = r0 + i < tile.rows ? hn::Mul(hn::LoadU(d, q + e0), factor_v) : hn::Zero(d);
          }
          TransposeSquare(v);
          for (int64_t i = 0; i < kLanes; ++i) hn::Store(v[i], d, query_t + (e0 + i) * kTq + r0);
        }
      }
      return;
    }
#endif
    for (int64_t r = 0; r < tile.rows; ++r) {
      const float* q = tile.query + (tile.first_query + r) * p_.query_strides.row;
      for (int64_t e = 0; e < p_.head_dim; ++e) query_t[e * kTq + r] = q[e] * factor;
    }
    if (tile.rows < kTq) {
      for (int64_t e = 0; e < p_.head_dim; ++e) {
        std::fill(query_t + e * kTq + tile.rows, query_t + (e + 1) * kTq, 0.0f);
      }
    }
  }

  // score_t[j][r] for keys [k0, k0 + keys): Q·Kᵀ, then the modifications and the exclusions of
  // score_rule_layer.hpp (log2 domain from here on).
  void ComputeScores(const Tile& tile, int64_t k0, int64_t keys, TileVerdict verdict) {
    const float* key = tile.key + k0 * tile.key_stride;
    const int64_t key_stride = tile.key_stride;
    float* score_t = ws_.score_t.get();
    int64_t j = 0;
    for (; j + kScoreKeys <= keys; j += kScoreKeys) {
      ScoreBlock<QV, kScoreKeys>(ws_.query_t.get(), key + j * key_stride, key_stride, p_.head_dim,
                                 score_t + j * kTq);
    }
    if constexpr (kScoreKeys > 4) {
      for (; j + 4 <= keys; j += 4) {
        ScoreBlock<QV, 4>(ws_.query_t.get(), key + j * key_stride, key_stride, p_.head_dim,
                          score_t + j * kTq);
      }
    }
    for (; j < keys; ++j) {
      ScoreBlock<QV, 1>(ws_.query_t.get(), key + j * key_stride, key_stride, p_.head_dim,
                        score_t + j * kTq);
    }
    if (has_score_mods(p_)) {
      ModifyScores(p_, tile.batch, tile.bias, tile.first_query, tile.rows, k0, keys, kTq, score_t);
    } else if (tile.bias != nullptr) {
      AddBias(p_, tile.bias, tile.first_query, tile.rows, k0, keys, kTq, kLog2e, score_t);
    }
    if (may_exclude(p_)) {
      ApplyExclusions(p_, tile.batch, ws_.row_rules, ws_.keep, k0, keys, kTq, verdict, score_t,
                      ws_.visible.get(), tile.rows);
    }
  }

  // Online-softmax step over `keys` rows of score_t: new max, alpha = 2^(m − m'),
  // probabilities 2^(s − m') in place, l' = α·l + Σ p.
  // Stores the reference point m' (0 for rows still at -inf) in tile_max when not null.
  void SoftmaxStep(int64_t keys, float* tile_max_out) {
    const DF d;
    float* score_t = ws_.score_t.get();
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    for (int r = 0; r < QV; ++r) {
      float* column = score_t + r * kLanes;
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
      const VF tile_max = hn::Max(hn::Max(max0, max1), hn::Max(max2, max3));
      const VF old_max = hn::Load(d, ws_.row_max.get() + r * kLanes);
      const VF new_max = hn::Max(old_max, tile_max);
      // A row whose scores are all -inf so far keeps m' = -inf; use 0 as the reference
      // point so that 2^(-inf - m') is 0, not NaN.
      const VF safe_max = hn::IfThenZeroElse(hn::Eq(new_max, neg_inf), new_max);
      const VF alpha = Exp2(d, hn::Sub(old_max, safe_max));
      VF sum0 = hn::Zero(d), sum1 = hn::Zero(d);
      for (j = 0; j + 2 <= keys; j += 2) {
        const VF prob0 = Exp2(d, hn::Sub(hn::Load(d, column + j * kTq), safe_max));
        const VF prob1 = Exp2(d, hn::Sub(hn::Load(d, column + (j + 1) * kTq), safe_max));
        hn::Store(prob0, d, column + j * kTq);
        hn::Store(prob1, d, column + (j + 1) * kTq);
        sum0 = hn::Add(sum0, prob0);
        sum1 = hn::Add(sum1, prob1);
      }
      if (j < keys) {
        const VF prob = Exp2(d, hn::Sub(hn::Load(d, column + j * kTq), safe_max));
        hn::Store(prob, d, column + j * kTq);
        sum0 = hn::Add(sum0, prob);
      }
      const VF sum = hn::Add(sum0, sum1);
      const VF old_sum = hn::Load(d, ws_.row_sum.get() + r * kLanes);
      hn::Store(hn::MulAdd(alpha, old_sum, sum), d, ws_.row_sum.get() + r * kLanes);
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
      const int64_t query = tile.first_query + r;
      for (int64_t j = 0; j < keys; j += 4) {  // k0 is a multiple of 4: groups align
        const PhiloxWords draws = dropout_draws(p_.seed, tile.batch, query, (k0 + j) / 4);
        for (int64_t w = 0; w < 4 && j + w < keys; ++w) {
          float& prob = score_t[(j + w) * kTq + r];
          if (draws.word[w] < threshold) prob = 0.0f;
        }
      }
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

  void AccumulateValues(const Tile& tile, int64_t k0, int64_t keys, const float* alpha) {
    const float* value = tile.value + k0 * tile.value_stride;
    const int64_t value_stride = tile.value_stride;
    const float* score_t = ws_.score_t.get();
    float* out_t = ws_.out_t.get();
    // All QV query vectors at once × kValueColumns columns, then narrower blocks for the tail.
    int64_t c = 0;
    for (; c + kValueColumns <= p_.value_dim; c += kValueColumns) {
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
};

// ---------------------------------------------------------------------------------------
// Few queries (decoding, short phrases): a query tile would leave most lanes empty, so the
// lanes run along E and Ev instead. A work item is a group of up to kRowGroup consecutive
// query rows of one batch index; each phase runs over the group's rows, whose independent
// dependency chains (horizontal sums, max, exp, divisions) then overlap, and the rows share
// each load of K and V. With one query per batch index (decoding) a group holds the rows of
// kRowGroup consecutive batch indices instead, each reading its own K and V: separate
// memory streams, where one stream per core leaves memory parallelism unused.
//
// Per row i:  s_j = (q_i·k_j)·scale·log2 e (+ bias), excluded → -1e9·log2 e, for the
// visible keys j < key_end_i;  m = max_j s_j;  p_j = 2^(s_j − m);  l = Σ p_j;
// output = Σ_j p_j·keep_j·v_j / l / (1 − p). The group's score rows all run to the largest
// key_end of the group (rounded up to whole vectors); lanes past a row's own key_end hold
// -inf, so their probabilities are exactly 0.

// Rows per group: their score accumulators (4 per row) and the shared K vectors must fit
// in the register file (32 registers on AVX-512, 16 below).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kRowGroup = 4;
#else
constexpr int kRowGroup = 2;
#endif

// Row buffers live in the workspace object itself up to these sizes (short phrases: no
// allocation per call), on the heap beyond.
constexpr int64_t kInlineKeys = 256;
constexpr int64_t kInlineValueDim = 256;

struct RowWorkspace {
  float* scores;  // [kRowGroup][score_stride]: Lk rounded up to lanes
  float* out;     // [kRowGroup][out_stride]:   Ev rounded up to lanes
  int64_t score_stride;
  int64_t out_stride;
  // The operands of the batch index tile_batch[r] (-1: none yet), row r's when a group
  // spans batch indices (one query per batch index: decoding), tiles[0] otherwise.
  Tile tiles[kRowGroup] = {};
  int64_t tile_batch[kRowGroup];

  explicit RowWorkspace(const SdpaParams& p) {
    std::fill_n(tile_batch, kRowGroup, int64_t{-1});
    const auto lanes = static_cast<size_t>(kLanes);
    score_stride = static_cast<int64_t>(hwy::RoundUpTo(static_cast<size_t>(p.key_len), lanes));
    out_stride = static_cast<int64_t>(
        hwy::RoundUpTo(static_cast<size_t>(std::max<int64_t>(p.value_dim, 1)), lanes));
    if (score_stride <= kInlineKeys) {
      scores = inline_scores_;
    } else {
      heap_scores_ = hwy::AllocateAligned<float>(static_cast<size_t>(kRowGroup * score_stride));
      scores = heap_scores_.get();
    }
    needs_keep = p.user_rules != nullptr && p.user_rules->mask != nullptr;
    if (needs_keep) {
      keep_storage = hwy::AllocateAligned<uint8_t>(static_cast<size_t>(p.key_len));
      keep = keep_storage.get();
    }
    if (out_stride <= kInlineValueDim) {
      out = inline_out_;
    } else {
      heap_out_ = hwy::AllocateAligned<float>(static_cast<size_t>(kRowGroup * out_stride));
      out = heap_out_.get();
    }
  }
  // Lk bytes for a user mask rule's verdicts on one row (null without one).
  unsigned char* keep = nullptr;
  hwy::AlignedFreeUniquePtr<uint8_t[]> keep_storage;
  RowWorkspace(const RowWorkspace&) = delete;
  RowWorkspace& operator=(const RowWorkspace&) = delete;
  bool ok() const {
    return scores != nullptr && out != nullptr && (keep != nullptr || !needs_keep);
  }
  bool needs_keep = false;

 private:
  alignas(64) float inline_scores_[kRowGroup * kInlineKeys];
  alignas(64) float inline_out_[kRowGroup * kInlineValueDim];
  hwy::AlignedFreeUniquePtr<float[]> heap_scores_;
  hwy::AlignedFreeUniquePtr<float[]> heap_out_;
};

// Σ_e a[e]·b[e] for four rows b0..b3 at once (lanes along e, scalar tail).
HWY_INLINE void Dot4(const float* HWY_RESTRICT a, const float* b0, const float* b1, const float* b2,
                     const float* b3, int64_t n, float* HWY_RESTRICT out) {
  const DF d;
  VF acc0 = hn::Zero(d), acc1 = hn::Zero(d), acc2 = hn::Zero(d), acc3 = hn::Zero(d);
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) {
    const VF av = hn::LoadU(d, a + e);
    acc0 = hn::MulAdd(av, hn::LoadU(d, b0 + e), acc0);
    acc1 = hn::MulAdd(av, hn::LoadU(d, b1 + e), acc1);
    acc2 = hn::MulAdd(av, hn::LoadU(d, b2 + e), acc2);
    acc3 = hn::MulAdd(av, hn::LoadU(d, b3 + e), acc3);
  }
  float s0 = hn::GetLane(hn::SumOfLanes(d, acc0)), s1 = hn::GetLane(hn::SumOfLanes(d, acc1));
  float s2 = hn::GetLane(hn::SumOfLanes(d, acc2)), s3 = hn::GetLane(hn::SumOfLanes(d, acc3));
  for (; e < n; ++e) {
    s0 += a[e] * b0[e];
    s1 += a[e] * b1[e];
    s2 += a[e] * b2[e];
    s3 += a[e] * b3[e];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

#if ATTEND_QUAD_SUMS
// Scores of keys [0, key_end) for G rows, four keys at a time (E a multiple of kLanes):
// scores[r][j] = q_r·k_r,j, stored as whole vectors; lanes past key_end are left unset in
// the last vector (the caller pads them). kShared: the rows share one K (key[0]), each of
// whose vectors is then loaded once for the G rows; else each row reads its own K (rows of
// different heads: G streams from memory, where one would leave the core's memory
// parallelism unused).
template <int G, bool kShared>
HWY_INLINE void QuadScores(const float* const* query, const float* const* key, int64_t key_stride,
                           int64_t head_dim, int64_t key_end, float* scores, int64_t score_stride) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const auto lanes = hn::Iota(di, 0);
  VF pending[G];
  for (int r = 0; r < G; ++r) pending[r] = hn::Zero(d);
  int64_t j = 0;
  for (; j + 4 <= key_end; j += 4) {
    VF acc[G][4];
    for (int r = 0; r < G; ++r) {
      for (int c = 0; c < 4; ++c) acc[r][c] = hn::Zero(d);
    }
    for (int64_t e = 0; e < head_dim; e += kLanes) {
      VF k[4];
      if constexpr (kShared) {
        for (int c = 0; c < 4; ++c) k[c] = hn::LoadU(d, key[0] + (j + c) * key_stride + e);
      }
      for (int r = 0; r < G; ++r) {
        if constexpr (!kShared) {
          for (int c = 0; c < 4; ++c) k[c] = hn::LoadU(d, key[r] + (j + c) * key_stride + e);
        }
        const VF q = hn::LoadU(d, query[r] + e);
        for (int c = 0; c < 4; ++c) acc[r][c] = hn::MulAdd(q, k[c], acc[r][c]);
      }
    }
    const int64_t first_lane = j % kLanes;
    const auto in_quad = hn::RebindMask(
        d, hn::And(hn::Gt(lanes, hn::Set(di, static_cast<int32_t>(first_lane - 1))),
                   hn::Lt(lanes, hn::Set(di, static_cast<int32_t>(first_lane + 4)))));
    for (int r = 0; r < G; ++r) {
      const VF quad = QuadSums(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      pending[r] = hn::IfThenElse(in_quad, quad, pending[r]);
      if (first_lane + 4 == kLanes) {
        hn::Store(pending[r], d, scores + r * score_stride + j + 4 - kLanes);
      }
    }
  }
  // The last 1–3 keys: dot products put into their lanes one by one.
  for (; j < key_end; ++j) {
    const int64_t lane = j % kLanes;
    const auto at_lane = hn::RebindMask(d, hn::Eq(lanes, hn::Set(di, static_cast<int32_t>(lane))));
    for (int r = 0; r < G; ++r) {
      VF acc = hn::Zero(d);
      for (int64_t e = 0; e < head_dim; e += kLanes) {
        acc =
            hn::MulAdd(hn::LoadU(d, query[r] + e), hn::LoadU(d, key[r] + j * key_stride + e), acc);
      }
      pending[r] = hn::IfThenElse(at_lane, hn::SumOfLanes(d, acc), pending[r]);
      if (lane == kLanes - 1) hn::Store(pending[r], d, scores + r * score_stride + j + 1 - kLanes);
    }
  }
  if (key_end % kLanes != 0) {
    for (int r = 0; r < G; ++r) {
      hn::Store(pending[r], d, scores + r * score_stride + key_end - key_end % kLanes);
    }
  }
}
#endif  // ATTEND_QUAD_SUMS

// Scores of keys [0, key_end) for one row with any E: Dot4 and a scalar tail, each score
// put into its lane of a register vector that is stored whole (a vector load of bytes
// written by scalar stores would stall store-to-load forwarding).
HWY_INLINE void RowScores(const float* query, const float* key, int64_t key_stride,
                          int64_t head_dim, int64_t key_end, float* scores) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const auto lanes = hn::Iota(di, 0);
  VF pending = hn::Zero(d);
  const auto put = [&](int64_t k, float score) {
    const int64_t lane = k % kLanes;
    pending =
        hn::IfThenElse(hn::RebindMask(d, hn::Eq(lanes, hn::Set(di, static_cast<int32_t>(lane)))),
                       hn::Set(d, score), pending);
    if (lane == kLanes - 1) hn::Store(pending, d, scores + k - lane);
  };
  int64_t j = 0;
  for (; j + 4 <= key_end; j += 4) {
    float dots[4];
    Dot4(query, key + j * key_stride, key + (j + 1) * key_stride, key + (j + 2) * key_stride,
         key + (j + 3) * key_stride, head_dim, dots);
    for (int k = 0; k < 4; ++k) put(j + k, dots[k]);
  }
  for (; j < key_end; ++j) {
    float s = 0;
    for (int64_t e = 0; e < head_dim; ++e) s += query[e] * key[j * key_stride + e];
    put(j, s);
  }
  if (key_end % kLanes != 0) hn::Store(pending, d, scores + key_end - key_end % kLanes);
}

// out_r[c] (+)= Σ_j prob_r[j]·V_r[j][c] for G rows and the vector columns c < columns (a
// multiple of kLanes), starting from zero when `first`; when `last`, stores
// out_r·factor_r into dest_r instead of out_r. kShared: the rows share one V (value[0]),
// each of whose vectors is loaded once for the G rows; else each row reads its own.
template <int G, bool kShared>
HWY_INLINE void AccumulateRows(const float* const* prob, const float* const* value,
                               int64_t value_stride, int64_t keys, int64_t columns, bool first,
                               bool last, const float* factor, float* const* out,
                               float* const* dest) {
  const DF d;
  int64_t c = 0;
  for (; c + 2 * kLanes <= columns; c += 2 * kLanes) {
    VF acc0[G], acc1[G];
    for (int r = 0; r < G; ++r) {
      acc0[r] = first ? hn::Zero(d) : hn::Load(d, out[r] + c);
      acc1[r] = first ? hn::Zero(d) : hn::Load(d, out[r] + c + kLanes);
    }
    for (int64_t j = 0; j < keys; ++j) {
      VF v0, v1;
      if constexpr (kShared) {
        const float* v = value[0] + j * value_stride + c;
        v0 = hn::LoadU(d, v), v1 = hn::LoadU(d, v + kLanes);
      }
      for (int r = 0; r < G; ++r) {
        if constexpr (!kShared) {
          const float* v = value[r] + j * value_stride + c;
          v0 = hn::LoadU(d, v), v1 = hn::LoadU(d, v + kLanes);
        }
        const VF pj = hn::Set(d, prob[r][j]);
        acc0[r] = hn::MulAdd(pj, v0, acc0[r]);
        acc1[r] = hn::MulAdd(pj, v1, acc1[r]);
      }
    }
    for (int r = 0; r < G; ++r) {
      if (last) {
        const VF f = hn::Set(d, factor[r]);
        hn::StoreU(hn::Mul(acc0[r], f), d, dest[r] + c);
        hn::StoreU(hn::Mul(acc1[r], f), d, dest[r] + c + kLanes);
      } else {
        hn::Store(acc0[r], d, out[r] + c);
        hn::Store(acc1[r], d, out[r] + c + kLanes);
      }
    }
  }
  for (; c < columns; c += kLanes) {
    VF acc[G];
    for (int r = 0; r < G; ++r) acc[r] = first ? hn::Zero(d) : hn::Load(d, out[r] + c);
    for (int64_t j = 0; j < keys; ++j) {
      for (int r = 0; r < G; ++r) {
        const VF v = hn::LoadU(d, value[kShared ? 0 : r] + j * value_stride + c);
        acc[r] = hn::MulAdd(hn::Set(d, prob[r][j]), v, acc[r]);
      }
    }
    for (int r = 0; r < G; ++r) {
      if (last) {
        hn::StoreU(hn::Mul(acc[r], hn::Set(d, factor[r])), d, dest[r] + c);
      } else {
        hn::Store(acc[r], d, out[r] + c);
      }
    }
  }
}

template <int G>
class RowGroupAttention {
 public:
  RowGroupAttention(const SdpaParams& p, RowWorkspace& ws) : p_(p), ws_(ws) {}

  // Row r of the group: query row queries[r] of the batch index whose operands tiles[r]
  // points at, over the keys of `span`. shared: the rows share K and V (one batch index,
  // or K and V broadcast over the batch dimensions that differ).
  void Run(const Tile* const* tiles, const int64_t* queries, bool shared, KeySpan span) {
    const DF d;
    int64_t group_key_end = 0;  // from here on, key indices count from span.begin
    for (int r = 0; r < G; ++r) {
      tile_[r] = tiles[r];
      row_[r] = queries[r];
      visible_keys_[r] = visible_keys(p_, row_[r]);
      key_end_[r] = std::clamp<int64_t>(visible_keys_[r].end() - span.begin, 0, span.count);
      group_key_end = std::max(group_key_end, key_end_[r]);
      scores_[r] = ws_.scores + r * ws_.score_stride;
      query_[r] = tile_[r]->query + row_[r] * p_.query_strides.row;
      key_[r] = tile_[r]->key + span.begin * p_.key_strides.row;
      value_[r] = tile_[r]->value + span.begin * p_.value_strides.row;
    }
    const int64_t padded_end = static_cast<int64_t>(
        hwy::RoundUpTo(static_cast<size_t>(group_key_end), static_cast<size_t>(kLanes)));

    // 1. Dot products of the keys before the group's last visible key.
    ComputeDots(group_key_end, shared);

    // 2. The score rules (score_rule_layer.hpp); lanes past each row's key_end become -inf
    // after scaling (the scale may be negative), so 2^(-inf) = 0 leaves sums and outputs
    // alone. Without modifications or pairwise rules, positions are judged a vector at a
    // time: keys before the window (and past the prefix) get -inf as well.
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    const bool plain = !has_score_mods(p_) && p_.bias == nullptr && !has_pairwise_rules(p_);
    const hn::RebindToSigned<DF> di;
    VF max_v[G];
    for (int r = 0; r < G; ++r) {
      const Tile& tile = *tile_[r];
      float* scores = scores_[r];
      max_v[r] = neg_inf;
      if (plain) {
        const VisibleKeys& keys = visible_keys_[r];
        const VF factor_v = hn::Set(d, p_.scale * kLog2e);
        // Lane l of vector j holds key span.begin + j + l: visible iff before key_end and
        // (in the prefix or from the window's first key on).
        const auto prefix_end = hn::Set(di, static_cast<int32_t>(std::clamp<int64_t>(
                                                keys.prefix_end - span.begin, -1, span.count)));
        const auto first = hn::Set(di, static_cast<int32_t>(std::clamp<int64_t>(
                                           keys.first - span.begin, -1, span.count + 1)));
        const auto end = hn::Set(di, static_cast<int32_t>(key_end_[r]));
        for (int64_t j = 0; j < padded_end; j += kLanes) {
          const auto lane = hn::Iota(di, static_cast<int32_t>(j));
          const auto visible = hn::And(
              hn::Lt(lane, end), hn::Or(hn::Lt(lane, prefix_end), hn::Not(hn::Lt(lane, first))));
          const VF s = hn::IfThenElse(hn::RebindMask(d, visible),
                                      hn::Mul(hn::Load(d, scores + j), factor_v), neg_inf);
          hn::Store(s, d, scores + j);
          max_v[r] = hn::Max(max_v[r], s);
        }
        const int64_t begin = span.begin, last = begin + key_end_[r] - 1;
        visible_[r] = std::min(keys.prefix_end, last + 1) > begin ||
                      std::max(keys.first, begin) <= std::min(keys.last, last);
      } else {
        std::fill(scores + key_end_[r], scores + padded_end,
                  -std::numeric_limits<float>::infinity());
        visible_[r] = apply_score_rules_to_row(p_, tile.batch, row_[r], span.begin, key_end_[r],
                                               scores, ws_.keep);
        for (int64_t j = 0; j < padded_end; j += kLanes) {
          max_v[r] = hn::Max(max_v[r], hn::Load(d, scores + j));
        }
      }
    }

    // 3. Probabilities 2^(s − m) and their sums (m = 0 when every score is -inf).
    // The head's sink (first chunk only) joins the maximum here and the sum below.
    VF sum_v[G], m_v[G];
    float sink_[G];
    for (int r = 0; r < G; ++r) {
      sink_[r] = p_.sinks && span.begin == 0 ? p_.sinks[head_of(p_, tile_[r]->batch)] * kLog2e
                                             : -std::numeric_limits<float>::infinity();
      row_max_[r] = std::max(hn::GetLane(hn::MaxOfLanes(d, max_v[r])), sink_[r]);
      m_v[r] = hn::Set(d, std::isinf(row_max_[r]) && row_max_[r] < 0 ? 0.0f : row_max_[r]);
      sum_v[r] = hn::Zero(d);
    }
    for (int64_t j = 0; j < padded_end; j += kLanes) {
      for (int r = 0; r < G; ++r) {
        const VF prob = Exp2(d, hn::Sub(hn::Load(d, scores_[r] + j), m_v[r]));
        hn::Store(prob, d, scores_[r] + j);
        sum_v[r] = hn::Add(sum_v[r], prob);
      }
    }

    // 4. Normalize (into the weights when requested), dropout. A chunk of a key split leaves
    // the normalization to the merge (and never has weights: see PlanKeySplit).
    const float keep_scale = 1.0f / (1.0f - p_.dropout);
    for (int r = 0; r < G; ++r) {
      const Tile& tile = *tile_[r];
      sum_[r] = hn::GetLane(hn::SumOfLanes(d, sum_v[r]));
      if (p_.sinks && span.begin == 0) sum_[r] += std::exp2(sink_[r] - row_max_[r]);
      out_factor_[r] = span.partial ? keep_scale : keep_scale / sum_[r];
      float* scores = scores_[r];
      if (tile.weights) {
        const float inv_sum = 1.0f / sum_[r];
        for (int64_t j = 0; j < key_end_[r]; ++j) scores[j] *= inv_sum * keep_scale;
        out_factor_[r] = 1.0f;
      }
      if (p_.dropout > 0) {
        const uint32_t threshold = dropout_threshold(p_.dropout);
        for (int64_t j = 0; j < key_end_[r]; j += 4) {
          // span.begin is a multiple of 4: whole words of the row's draws.
          const PhiloxWords draws =
              dropout_draws(p_.seed, tile.batch, row_[r], (span.begin + j) / 4);
          for (int64_t w = 0; w < 4 && j + w < key_end_[r]; ++w) {
            if (draws.word[w] < threshold) scores[j + w] = 0.0f;
          }
        }
      }
      if (tile.weights) {
        float* w = tile.weights + row_[r] * p_.weights_strides.row;
        std::copy_n(scores, key_end_[r], w);
        std::fill(w + key_end_[r], w + p_.key_len, 0.0f);
      }
      out_[r] = ws_.out + r * ws_.out_stride;
      dest_[r] = span.partial ? span.partial->out + r * span.partial->out_stride
                              : tile.output + row_[r] * p_.output_strides.row;
    }

    // 5. Output = P·V·factor, the vector columns in chunks of 256 keys (a chunk of V, up to
    // 256 KiB at Ev = 256, is read from memory once and from cache for the remaining column
    // blocks), the last few columns one at a time.
    constexpr int64_t kKeyChunk = 256;
    const int64_t vector_columns = p_.value_dim - p_.value_dim % kLanes;
    for (int64_t k0 = 0; k0 < group_key_end; k0 += kKeyChunk) {
      const float* prob[G];
      const float* value[G];
      for (int r = 0; r < G; ++r) {
        prob[r] = scores_[r] + k0;
        value[r] = value_[r] + k0 * p_.value_strides.row;
      }
      const int64_t keys = std::min(kKeyChunk, group_key_end - k0);
      const bool first = k0 == 0, last = k0 + kKeyChunk >= group_key_end;
      if (shared) {
        AccumulateRows<G, true>(prob, value, p_.value_strides.row, keys, vector_columns, first,
                                last, out_factor_, out_, dest_);
      } else {
        AccumulateRows<G, false>(prob, value, p_.value_strides.row, keys, vector_columns, first,
                                 last, out_factor_, out_, dest_);
      }
    }
    for (int r = 0; r < G; ++r) {
      for (int64_t c = vector_columns; c < p_.value_dim; ++c) {
        float acc = 0;
        for (int64_t j = 0; j < key_end_[r]; ++j) {
          acc += scores_[r][j] * value_[r][j * p_.value_strides.row + c];
        }
        dest_[r][c] = acc * out_factor_[r];
      }
      // No key at all: AccumulateRows never ran; the exclusion fix below writes the row.
      if (group_key_end == 0) std::fill_n(dest_[r], p_.value_dim, 0.0f);
    }

    // 6. Log-sum-exp, rows with every key excluded; or what the merge of a split needs.
    if (span.partial) {
      for (int r = 0; r < G; ++r) {
        span.partial->max[r] = row_max_[r];
        span.partial->sum[r] = sum_[r];
        span.partial->visible[r] = visible_[r];
      }
      return;
    }
    for (int r = 0; r < G; ++r) {
      const Tile& tile = *tile_[r];
      const bool excluded_row = !visible_[r] && FixesFullyExcludedRows(p_);
      if (tile.logsumexp) {
        tile.logsumexp[row_[r] * p_.logsumexp_strides.row] =
            excluded_row ? FullyExcludedLogSumExp(p_) : LogSumExp(row_max_[r], sum_[r]);
      }
      if (excluded_row) WriteFullyExcludedRow(p_, tile, row_[r]);
    }
  }

 private:
  void ComputeDots(int64_t key_end, bool shared) {
#if ATTEND_QUAD_SUMS
    if (p_.head_dim % kLanes == 0) {
      if (shared) {
        QuadScores<G, true>(query_, key_, p_.key_strides.row, p_.head_dim, key_end, ws_.scores,
                            ws_.score_stride);
      } else {
        QuadScores<G, false>(query_, key_, p_.key_strides.row, p_.head_dim, key_end, ws_.scores,
                             ws_.score_stride);
      }
      return;
    }
#endif
    (void)shared;  // RowScores reads each row's own K
    for (int r = 0; r < G; ++r) {
      RowScores(query_[r], key_[r], p_.key_strides.row, p_.head_dim, key_end, scores_[r]);
    }
  }

  const SdpaParams& p_;
  RowWorkspace& ws_;
  const Tile* tile_[G];  // operands of each row's batch index
  int64_t row_[G];       // each row's query index
  VisibleKeys visible_keys_[G];
  int64_t key_end_[G];
  bool visible_[G];
  float row_max_[G];
  float sum_[G];
  float out_factor_[G];
  float* scores_[G];
  const float* query_[G];
  const float* key_[G];
  const float* value_[G];
  float* out_[G];
  float* dest_[G];
};

// Points `tile` at the operands of batch index b (in place: a Tile returned by value and
// then copied would be reloaded as vectors right after its scalar stores, a
// store-forwarding stall).
void SetTileBatch(const SdpaParams& p, int64_t b, Tile& tile) {
  tile.batch = b;
  const SdpaParams::BatchCoordinates at = p.batch_coordinates(b);
  tile.query = p.query + at.offset(p.query_strides);
  tile.key = p.key + at.offset(p.key_strides);
  tile.value = p.value + at.offset(p.value_strides);
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

// Multiply-adds of one forward call: B·Lq·Lk·(E + Ev).
double ForwardMultiplyAdds(const SdpaParams& p) {
  return static_cast<double>(p.batch) * static_cast<double>(p.query_len) *
         static_cast<double>(p.key_len) * static_cast<double>(p.head_dim + p.value_dim);
}

// Work items: groups of up to kRowGroup consecutive rows of one batch index or, with one
// query per batch index (decoding), the rows of up to kRowGroup consecutive batch indices.
template <int G>
void RunRowGroup(const SdpaParams& p, RowWorkspace& ws, int64_t b0, int64_t q0, bool across,
                 KeySpan span) {
  const Tile* tiles[G];
  int64_t queries[G];
  for (int r = 0; r < G; ++r) {
    const int64_t b = across ? b0 + r : b0;
    Tile& tile = ws.tiles[across ? r : 0];
    if (ws.tile_batch[across ? r : 0] != b) {  // reuse the base pointers (finding them divides)
      SetTileBatch(p, b, tile);
      ws.tile_batch[across ? r : 0] = b;
    }
    tiles[r] = &tile;
    queries[r] = across ? 0 : q0 + r;
  }
  // Rows of different batch indices still share K and V when those are broadcast over the
  // batch dimensions that differ (stride 0: multi-query attention).
  bool shared = true;
  for (int r = 1; r < G; ++r) {
    shared = shared && tiles[r]->key == tiles[0]->key && tiles[r]->value == tiles[0]->value;
  }
  RowGroupAttention<G>(p, ws).Run(tiles, queries, shared, span);
}

// The row groups of a call: item → (first batch index, first query, rows).
struct RowGroups {
  bool across;  // one query per batch index: a group spans kRowGroup batch indices
  int64_t per_batch;
  int64_t count;

  explicit RowGroups(const SdpaParams& p)
      : across(p.query_len == 1),
        per_batch(across ? 1 : (p.query_len + kRowGroup - 1) / kRowGroup),
        count(across ? (p.batch + kRowGroup - 1) / kRowGroup : p.batch * per_batch) {}
  int64_t first_batch(int64_t item) const { return across ? item * kRowGroup : item / per_batch; }
  int64_t first_query(int64_t item) const {
    return across ? 0 : (item - first_batch(item) * per_batch) * kRowGroup;
  }
  int64_t rows(const SdpaParams& p, int64_t item) const {
    return std::min<int64_t>(
        kRowGroup, across ? p.batch - first_batch(item) : p.query_len - first_query(item));
  }
  void Run(const SdpaParams& p, RowWorkspace& ws, int64_t item, KeySpan span) const {
    const int64_t b0 = first_batch(item), q0 = first_query(item), n = rows(p, item);
    if constexpr (kRowGroup == 4) {
      if (n == 4) return RunRowGroup<4>(p, ws, b0, q0, across, span);
      if (n == 3) return RunRowGroup<3>(p, ws, b0, q0, across, span);
    }
    if (n == 2) return RunRowGroup<2>(p, ws, b0, q0, across, span);
    RunRowGroup<1>(p, ws, b0, q0, across, span);
  }
};

// Key split (FlashDecoding's split-KV): with fewer work items than kSplitItems (decoding
// over a long cache with few heads, a few query tiles against many keys), the keys are cut
// into chunks that run as separate work items, so that every core reads its share of K and
// V; the chunks' partial results are then merged by their maxima and sums. The split
// depends on the shape only, never on the thread count, so results are bitwise the same at
// any thread count. Chunks are whole multiples of kSplitGranule keys (whole key tiles, and
// a multiple of 4 as dropout draws 4 keys per word). Not with weights, whose normalization
// needs the whole row in one place.
constexpr int64_t kSplitItems = 16;     // work items wanted: the cores of a large machine
constexpr int64_t kSplitGranule = 256;  // keys: ≥ 16 KiB of K and V per row at E = 8
static_assert(kSplitGranule % kKeyTile == 0 && kSplitGranule % 4 == 0);

struct KeySplit {
  int64_t chunks;
  int64_t chunk_len;
};

KeySplit PlanKeySplit(const SdpaParams& p, int64_t items) {
  const int64_t wanted = std::min((kSplitItems + items - 1) / items, p.key_len / kSplitGranule);
  if (p.weights != nullptr || wanted < 2) return {1, p.key_len};
  const int64_t chunk_len =
      (p.key_len + wanted * kSplitGranule - 1) / (wanted * kSplitGranule) * kSplitGranule;
  return {(p.key_len + chunk_len - 1) / chunk_len, chunk_len};
}

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
  const bool excluded_row = !visible && FixesFullyExcludedRows(p);
  if (tile.logsumexp) {
    tile.logsumexp[query * p.logsumexp_strides.row] =
        excluded_row ? FullyExcludedLogSumExp(p) : LogSumExp(max, sum);
  }
  if (excluded_row) WriteFullyExcludedRow(p, tile, query);
}

// Runs the `count` work items of a call (row groups or query tiles of up to `rows` rows)
// over all keys or, when PlanKeySplit splits them, over each key chunk, then merges each
// row's chunks. run(ws, item, span) computes one item over one span; locate(item, r, batch,
// query) names row r of an item, false past its last row.
template <class Workspace_, class RunItem, class Locate>
void RunItems(const SdpaParams& p, int64_t count, int64_t rows, const RunItem& run,
              const Locate& locate) {
  const KeySplit split = PlanKeySplit(p, count);
  if (split.chunks == 1) {
    ParallelItems<Workspace_>(p, ForwardMultiplyAdds(p), count, [&](Workspace_& ws, int64_t item) {
      run(ws, item, KeySpan{0, p.key_len, nullptr});
    });
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
  ParallelItems<Workspace_>(p, ForwardMultiplyAdds(p), items, [&](Workspace_& ws, int64_t i) {
    const int64_t begin = (i % split.chunks) * split.chunk_len;
    run(ws, i / split.chunks,
        KeySpan{begin, std::min(split.chunk_len, p.key_len - begin),
                &partials[static_cast<size_t>(i)]});
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

void RunAllRows(const SdpaParams& p) {
  const RowGroups groups(p);
  RunItems<RowWorkspace>(
      p, groups.count, kRowGroup,
      [&](RowWorkspace& ws, int64_t item, KeySpan span) { groups.Run(p, ws, item, span); },
      [&](int64_t item, int64_t r, int64_t& batch, int64_t& query) {
        if (r >= groups.rows(p, item)) return false;
        batch = groups.first_batch(item) + (groups.across ? r : 0);
        query = groups.across ? 0 : groups.first_query(item) + r;
        return true;
      });
}

template <int QV>
void RunAllTiles(const SdpaParams& p) {
  constexpr int64_t tq = QV * kLanes;
  const int64_t tiles_per_batch = (p.query_len + tq - 1) / tq;
  const bool pack = ShouldPackKeysAndValues(p);
  RunItems<Workspace>(
      p, p.batch * tiles_per_batch, tq,
      [&](Workspace& ws, int64_t item, KeySpan span) {
        const int64_t q0 = (item % tiles_per_batch) * tq;
        Tile tile = MakeTile(p, item / tiles_per_batch, q0, std::min(tq, p.query_len - q0));
        if (pack && span.partial == nullptr) PackKeysAndValues(p, ws, tile);
        TileAttention<QV>(p, ws).Run(tile, span);
      },
      [&](int64_t item, int64_t r, int64_t& batch, int64_t& query) {
        batch = item / tiles_per_batch;
        query = (item % tiles_per_batch) * tq + r;
        return query < p.query_len;
      });
}

// Row groups while a query tile would be at most half full (see fused_sdpa_rows_rejects);
// else query tiles of as many vectors as the queries fill, up to 4.
bool RowsFit(const SdpaParams& p) { return 2 * p.query_len <= kLanes; }

void FusedSdpaRows(const SdpaParams& p) { RunAllRows(p); }

void FusedSdpaTiles(const SdpaParams& p) {
  const int64_t vectors = (p.query_len + kLanes - 1) / kLanes;
  if (vectors >= 4) return RunAllTiles<4>(p);
  if (vectors == 3) return RunAllTiles<3>(p);
  if (vectors == 2) return RunAllTiles<2>(p);
  return RunAllTiles<1>(p);
}

int64_t FusedLanes() { return kLanes; }

// What FusedSdpaRows or FusedSdpaTiles will do with `p`: the work items and key chunks.
FusedPlan PlanFused(const SdpaParams& p, bool rows) {
  int64_t items;
  if (rows) {
    items = RowGroups(p).count;
  } else {
    const int64_t tq = std::min<int64_t>((p.query_len + kLanes - 1) / kLanes, 4) * kLanes;
    items = p.batch * ((p.query_len + tq - 1) / tq);
  }
  return {rows, items, PlanKeySplit(p, items).chunks};
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attend::detail {

HWY_EXPORT(FusedSdpaRows);
HWY_EXPORT(FusedSdpaTiles);
HWY_EXPORT(FusedLanes);
HWY_EXPORT(PlanFused);

const char* fused_sdpa_rows_rejects(const SdpaParams& params) {
  const int64_t lanes = ATTEND_DISPATCH(FusedLanes)();
  if (2 * params.query_len <= lanes) return nullptr;
  return "more queries than half the SIMD lanes (a query tile fills better)";
}

void fused_sdpa_rows(const SdpaParams& params) { ATTEND_DISPATCH(FusedSdpaRows)(params); }

const char* fused_sdpa_tiles_rejects(const SdpaParams&) { return nullptr; }

void fused_sdpa_tiles(const SdpaParams& params) { ATTEND_DISPATCH(FusedSdpaTiles)(params); }

FusedPlan fused_sdpa_plan(const SdpaParams& params, bool rows) {
  return ATTEND_DISPATCH(PlanFused)(params, rows);
}

}  // namespace attend::detail
#endif  // HWY_ONCE
