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
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fused_sdpa.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attend/error.hpp"
#include "attend/sdpa.hpp"
#include "dropout.hpp"
#include "kernels/fused_sdpa.hpp"
#include "runtime_internal.hpp"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
constexpr int64_t kLanes = static_cast<int64_t>(hn::MaxLanes(DF()));

// Key tile: 128 keys. The score tile (128 × Tq floats, 32 KiB at Tq = 64) stays in L1 while
// it is exponentiated and multiplied by V; measured 64–256 within 2% on Zen 5.
constexpr int64_t kKeyTile = 128;
// At most 4 query vectors per tile (64 queries on AVX-512): enough rows to amortize each
// K and V broadcast over 4 FMAs.
constexpr int kMaxQueryVectors = 4;
// Register blocks. 32-register targets: 4 query vectors × 6 keys = 24 score accumulators,
// 2 query vectors × 8 value columns = 16 output accumulators. 16-register targets: 4×2 and
// 2×4, leaving room for the operands.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kScoreKeys = 6;
constexpr int kValueColumns = 8;
#else
constexpr int kScoreKeys = 2;
constexpr int kValueColumns = 4;
#endif
constexpr float kLog2e = 1.4426950408889634f;

// 2^x for x <= 0 (and NaN, which propagates). x = n + f with n = round(x), |f| <= 1/2;
// 2^f by its degree-7 Taylor polynomial in f·ln2 (relative error < 1e-8 before rounding),
// 2^n by building the exponent bits. Below -126 the result is flushed to 0 (the weights
// there are < 1e-38 of the largest one).
HWY_INLINE VF Exp2(DF d, VF x) {
  const hn::RebindToSigned<DF> di;
  const auto n = hn::NearestInt(x);
  const VF f = hn::Sub(x, hn::ConvertTo(d, n));
  constexpr float c1 = 0.6931471805599453f, c2 = 0.2402265069591007f,
                  c3 = 0.0555041086648216f, c4 = 0.0096181291076285f,
                  c5 = 0.0013333558146428f, c6 = 0.0001540353039338f,
                  c7 = 0.0000152527338040f;
  VF poly = hn::Set(d, c7);
  poly = hn::MulAdd(poly, f, hn::Set(d, c6));
  poly = hn::MulAdd(poly, f, hn::Set(d, c5));
  poly = hn::MulAdd(poly, f, hn::Set(d, c4));
  poly = hn::MulAdd(poly, f, hn::Set(d, c3));
  poly = hn::MulAdd(poly, f, hn::Set(d, c2));
  poly = hn::MulAdd(poly, f, hn::Set(d, c1));
  poly = hn::MulAdd(poly, f, hn::Set(d, 1.0f));
  const auto exponent_bits = hn::ShiftLeft<23>(hn::Add(n, hn::Set(di, 127)));
  const VF result = hn::Mul(poly, hn::BitCast(d, exponent_bits));
  return hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, -126.0f)), result);
}

// Per-thread scratch, allocated once per call and thread (never in the tile loops).
struct Workspace {
  hwy::AlignedFreeUniquePtr<float[]> query_t;   // [E][Tq]   scaled, transposed queries
  hwy::AlignedFreeUniquePtr<float[]> score_t;   // [Tk][Tq]  scores, then probabilities
  hwy::AlignedFreeUniquePtr<float[]> out_t;     // [Ev][Tq]  unnormalized output
  hwy::AlignedFreeUniquePtr<float[]> row_max;   // [Tq]      running max m (log2 domain)
  hwy::AlignedFreeUniquePtr<float[]> row_sum;   // [Tq]      running sum l
  hwy::AlignedFreeUniquePtr<float[]> alpha;     // [Tq]      rescale factor of this key tile
  hwy::AlignedFreeUniquePtr<uint8_t[]> visible; // [Tq]      some key not excluded so far

  explicit Workspace(const SdpaParams& p) {
    const int64_t tq = kMaxQueryVectors * kLanes;
    query_t = hwy::AllocateAligned<float>(static_cast<size_t>(p.head_dim * tq));
    score_t = hwy::AllocateAligned<float>(static_cast<size_t>(kKeyTile * tq));
    out_t = hwy::AllocateAligned<float>(static_cast<size_t>(std::max<int64_t>(p.value_dim, 1) * tq));
    row_max = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    row_sum = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    alpha = hwy::AllocateAligned<float>(static_cast<size_t>(tq));
    visible = hwy::AllocateAligned<uint8_t>(static_cast<size_t>(tq));
  }
  bool ok() const {
    return query_t && score_t && out_t && row_max && row_sum && alpha && visible;
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
  float* output;
  float* weights;
  const uint8_t* mask;
  const float* bias;
};

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

template <int QV>
class TileAttention {
 public:
  static constexpr int64_t kTq = QV * kLanes;

  TileAttention(const SdpaParams& p, Workspace& ws) : p_(p), ws_(ws) {}

  void Run(const Tile& tile) {
    LoadQueries(tile);
    // Keys past key_end are excluded by causality for every row of the tile: skipped.
    int64_t key_end = p_.key_len;
    if (p_.causal) {
      key_end = std::clamp<int64_t>(p_.causal_last_key(tile.first_query + tile.rows - 1) + 1, 0,
                                    p_.key_len);
    }
    std::fill_n(ws_.row_max.get(), kTq, -std::numeric_limits<float>::infinity());
    std::fill_n(ws_.row_sum.get(), kTq, 0.0f);
    std::fill_n(ws_.visible.get(), kTq, uint8_t{0});
    std::fill_n(ws_.out_t.get(), p_.value_dim * kTq, 0.0f);
    const float keep_scale = 1.0f / (1.0f - p_.dropout);

    if (tile.weights == nullptr) {
      // One pass: online softmax with output accumulation.
      for (int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
        const int64_t keys = std::min(kKeyTile, key_end - k0);
        ComputeScores(tile, k0, keys);
        SoftmaxStep(keys);
        if (p_.dropout > 0) ApplyDropout(tile, k0, keys, 1.0f);
        AccumulateValues(tile, k0, keys, ws_.alpha.get());
      }
      FinishOutput(tile, keep_scale);
    } else {
      // Two passes: the final max and sum first, then normalized weights and output.
      for (int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
        const int64_t keys = std::min(kKeyTile, key_end - k0);
        ComputeScores(tile, k0, keys);
        SoftmaxStep(keys);
      }
      std::fill_n(ws_.alpha.get(), kTq, 1.0f);
      for (int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
        const int64_t keys = std::min(kKeyTile, key_end - k0);
        ComputeScores(tile, k0, keys);
        NormalizedProbabilities(keys);
        if (p_.dropout > 0) ApplyDropout(tile, k0, keys, keep_scale);
        WriteWeights(tile, k0, keys, key_end);
        AccumulateValues(tile, k0, keys, ws_.alpha.get());
      }
      if (key_end == 0) WriteWeights(tile, 0, 0, 0);
      FinishOutput(tile, 1.0f);
    }
    if (p_.mask != nullptr || p_.causal) FixFullyExcludedRows(tile);
  }

 private:
  // query_t[e][r] = Q[q0 + r][e]·scale·log2(e); rows past the tile's end are zero.
  void LoadQueries(const Tile& tile) {
    const float factor = p_.scale * kLog2e;
    float* query_t = ws_.query_t.get();
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

  // score_t[j][r] for keys [k0, k0 + keys): Q·Kᵀ, then bias, then exclusions.
  void ComputeScores(const Tile& tile, int64_t k0, int64_t keys) {
    const float* key = tile.key + k0 * p_.key_strides.row;
    const int64_t key_stride = p_.key_strides.row;
    float* score_t = ws_.score_t.get();
    int64_t j = 0;
    for (; j + kScoreKeys <= keys; j += kScoreKeys) {
      ScoreBlock<QV, kScoreKeys>(ws_.query_t.get(), key + j * key_stride, key_stride,
                                 p_.head_dim, score_t + j * kTq);
    }
    for (; j < keys; ++j) {
      ScoreBlock<QV, 1>(ws_.query_t.get(), key + j * key_stride, key_stride, p_.head_dim,
                        score_t + j * kTq);
    }
    if (tile.bias != nullptr) AddBias(tile, k0, keys);
    ApplyExclusions(tile, k0, keys);
  }

  void AddBias(const Tile& tile, int64_t k0, int64_t keys) {
    float* score_t = ws_.score_t.get();
    for (int64_t r = 0; r < tile.rows; ++r) {
      const float* bias = tile.bias + (tile.first_query + r) * p_.bias_strides.row +
                          k0 * p_.bias_strides.column;
      for (int64_t j = 0; j < keys; ++j) {
        score_t[j * kTq + r] += bias[j * p_.bias_strides.column] * kLog2e;
      }
    }
  }

  // Scores of excluded (query, key) pairs become -1e9 (in the log2 domain), as the listing's
  // masked_fill; `visible` records which rows still have a key.
  void ApplyExclusions(const Tile& tile, int64_t k0, int64_t keys) {
    const int64_t q0 = tile.first_query;
    const bool tile_crosses_diagonal = p_.causal && k0 + keys - 1 > p_.causal_last_key(q0);
    if (tile.mask == nullptr && !tile_crosses_diagonal) {
      std::fill_n(ws_.visible.get(), tile.rows, uint8_t{1});
      return;
    }
    constexpr float kExcluded = kExcludedScore * kLog2e;
    float* score_t = ws_.score_t.get();
    for (int64_t r = 0; r < tile.rows; ++r) {
      const int64_t last_key = p_.causal ? p_.causal_last_key(q0 + r) : p_.key_len;
      const uint8_t* mask =
          tile.mask ? tile.mask + (q0 + r) * p_.mask_strides.row + k0 * p_.mask_strides.column
                    : nullptr;
      uint8_t any = 0;
      for (int64_t j = 0; j < keys; ++j) {
        const bool excluded =
            k0 + j > last_key || (mask != nullptr && mask[j * p_.mask_strides.column] == 0);
        if (excluded) score_t[j * kTq + r] = kExcluded;
        any |= static_cast<uint8_t>(!excluded);
      }
      ws_.visible[r] |= any;
    }
  }

  // Online-softmax step over `keys` rows of score_t: new max, alpha = 2^(m − m'),
  // probabilities 2^(s − m') in place, l' = α·l + Σ p.
  void SoftmaxStep(int64_t keys) {
    const DF d;
    float* score_t = ws_.score_t.get();
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    for (int r = 0; r < QV; ++r) {
      float* column = score_t + r * kLanes;
      VF tile_max = neg_inf;
      for (int64_t j = 0; j < keys; ++j) tile_max = hn::Max(tile_max, hn::Load(d, column + j * kTq));
      const VF old_max = hn::Load(d, ws_.row_max.get() + r * kLanes);
      const VF new_max = hn::Max(old_max, tile_max);
      // A row whose scores are all -inf so far keeps m' = -inf; use 0 as the reference
      // point so that 2^(-inf - m') is 0, not NaN.
      const VF safe_max = hn::IfThenZeroElse(hn::Eq(new_max, neg_inf), new_max);
      const VF alpha = Exp2(d, hn::Sub(old_max, safe_max));
      VF sum = hn::Zero(d);
      for (int64_t j = 0; j < keys; ++j) {
        const VF prob = Exp2(d, hn::Sub(hn::Load(d, column + j * kTq), safe_max));
        hn::Store(prob, d, column + j * kTq);
        sum = hn::Add(sum, prob);
      }
      const VF old_sum = hn::Load(d, ws_.row_sum.get() + r * kLanes);
      hn::Store(hn::MulAdd(alpha, old_sum, sum), d, ws_.row_sum.get() + r * kLanes);
      hn::Store(new_max, d, ws_.row_max.get() + r * kLanes);
      hn::Store(alpha, d, ws_.alpha.get() + r * kLanes);
    }
  }

  // Second pass of the weights path: p = 2^(s − m) / l with the final m and l.
  void NormalizedProbabilities(int64_t keys) {
    const DF d;
    float* score_t = ws_.score_t.get();
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    for (int r = 0; r < QV; ++r) {
      float* column = score_t + r * kLanes;
      const VF row_max = hn::Load(d, ws_.row_max.get() + r * kLanes);
      const VF safe_max = hn::IfThenZeroElse(hn::Eq(row_max, neg_inf), row_max);
      const VF inv_sum = hn::Div(hn::Set(d, 1.0f), hn::Load(d, ws_.row_sum.get() + r * kLanes));
      for (int64_t j = 0; j < keys; ++j) {
        const VF prob = Exp2(d, hn::Sub(hn::Load(d, column + j * kTq), safe_max));
        hn::Store(hn::Mul(prob, inv_sum), d, column + j * kTq);
      }
    }
  }

  // Zeroes dropped probabilities and multiplies kept ones by keep_scale. The draw for
  // (batch, query, key) is the same Philox word the reference uses.
  void ApplyDropout(const Tile& tile, int64_t k0, int64_t keys, float keep_scale) {
    const uint32_t threshold = dropout_threshold(p_.dropout);
    float* score_t = ws_.score_t.get();
    for (int64_t r = 0; r < tile.rows; ++r) {
      const int64_t query = tile.first_query + r;
      for (int64_t j = 0; j < keys; j += 4) {  // k0 is a multiple of 4: groups align
        const PhiloxWords draws = dropout_draws(p_.seed, tile.batch, query, (k0 + j) / 4);
        for (int64_t w = 0; w < 4 && j + w < keys; ++w) {
          float& prob = score_t[(j + w) * kTq + r];
          prob = draws.word[w] >= threshold ? prob * keep_scale : 0.0f;
        }
      }
    }
  }

  // weights[q0 + r][k0 + j] = score_t[j][r]; past key_end (skipped causal keys) zeros.
  void WriteWeights(const Tile& tile, int64_t k0, int64_t keys, int64_t key_end) {
    const float* score_t = ws_.score_t.get();
    const bool last_tile = k0 + keys >= key_end;
    for (int64_t r = 0; r < tile.rows; ++r) {
      float* w = tile.weights + (tile.first_query + r) * p_.weights_strides.row;
      for (int64_t j = 0; j < keys; ++j) w[k0 + j] = score_t[j * kTq + r];
      if (last_tile) std::fill(w + key_end, w + p_.key_len, 0.0f);
    }
  }

  void AccumulateValues(const Tile& tile, int64_t k0, int64_t keys, const float* alpha) {
    const float* value = tile.value + k0 * p_.value_strides.row;
    const int64_t value_stride = p_.value_strides.row;
    const float* score_t = ws_.score_t.get();
    float* out_t = ws_.out_t.get();
    for (int r0 = 0; r0 < QV; r0 += 2) {
      int64_t c = 0;
      if (r0 + 2 <= QV) {
        for (; c + kValueColumns <= p_.value_dim; c += kValueColumns) {
          ValueBlock<QV, 2, kValueColumns>(score_t, value + c, value_stride, keys, alpha, r0,
                                           out_t + c * kTq);
        }
        for (; c < p_.value_dim; ++c) {
          ValueBlock<QV, 2, 1>(score_t, value + c, value_stride, keys, alpha, r0,
                               out_t + c * kTq);
        }
      } else {
        for (; c + kValueColumns <= p_.value_dim; c += kValueColumns) {
          ValueBlock<QV, 1, kValueColumns>(score_t, value + c, value_stride, keys, alpha, r0,
                                           out_t + c * kTq);
        }
        for (; c < p_.value_dim; ++c) {
          ValueBlock<QV, 1, 1>(score_t, value + c, value_stride, keys, alpha, r0,
                               out_t + c * kTq);
        }
      }
    }
  }

  // output[q0 + r][ev] = out_t[ev][r]·factor / l_r (factor / 1 when already normalized).
  void FinishOutput(const Tile& tile, float keep_scale) {
    const bool normalized = tile.weights != nullptr;
    const float* out_t = ws_.out_t.get();
    for (int64_t r = 0; r < tile.rows; ++r) {
      const float factor = normalized ? 1.0f : keep_scale / ws_.row_sum[r];
      float* o = tile.output + (tile.first_query + r) * p_.output_strides.row;
      for (int64_t c = 0; c < p_.value_dim; ++c) o[c] = out_t[c * kTq + r] * factor;
    }
  }

  // Rows that saw no key at all: zeros with zero_fully_masked_rows, else what the listing
  // computes when every score is -1e9: uniform weights 1/Lk over all keys (then dropout).
  void FixFullyExcludedRows(const Tile& tile) {
    const uint32_t threshold = dropout_threshold(p_.dropout);
    const double keep_scale = 1.0 / (1.0 - static_cast<double>(p_.dropout));
    for (int64_t r = 0; r < tile.rows; ++r) {
      if (ws_.visible[r]) continue;
      const int64_t query = tile.first_query + r;
      float* o = tile.output + query * p_.output_strides.row;
      float* w = tile.weights ? tile.weights + query * p_.weights_strides.row : nullptr;
      if (p_.zero_fully_masked_rows) {
        std::fill_n(o, p_.value_dim, 0.0f);
        if (w) std::fill_n(w, p_.key_len, 0.0f);
        continue;
      }
      std::fill_n(o, p_.value_dim, 0.0f);
      const float uniform = 1.0f / static_cast<float>(p_.key_len);
      for (int64_t j = 0; j < p_.key_len; ++j) {
        float weight = uniform;
        if (p_.dropout > 0) {
          weight = dropout_keep(p_.seed, threshold, tile.batch, query, j)
                       ? static_cast<float>(uniform * keep_scale)
                       : 0.0f;
        }
        if (w) w[j] = weight;
        const float* v = tile.value + j * p_.value_strides.row;
        for (int64_t c = 0; c < p_.value_dim; ++c) o[c] += weight * v[c];
      }
    }
  }

  const SdpaParams& p_;
  Workspace& ws_;
};

template <int QV>
void RunAllTiles(const SdpaParams& p) {
  constexpr int64_t tq = QV * kLanes;
  const int64_t tiles_per_batch = (p.query_len + tq - 1) / tq;
  const int64_t items = p.batch * tiles_per_batch;
  bool allocation_failed = false;
#pragma omp parallel num_threads(p.num_threads)
  {
    Workspace ws(p);
    if (!ws.ok()) {
#pragma omp atomic write
      allocation_failed = true;
    }
    TileAttention<QV> attention(p, ws);
    // Each item is computed by one thread with the same instruction sequence whatever the
    // thread count, so results are bitwise independent of it.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      if (!ws.ok()) continue;
      const int64_t b = item / tiles_per_batch;
      const int64_t q0 = (item % tiles_per_batch) * tq;
      Tile tile;
      tile.batch = b;
      tile.first_query = q0;
      tile.rows = std::min(tq, p.query_len - q0);
      tile.query = p.query + p.batch_offset(p.query_strides, b);
      tile.key = p.key + p.batch_offset(p.key_strides, b);
      tile.value = p.value + p.batch_offset(p.value_strides, b);
      tile.output = p.output + p.batch_offset(p.output_strides, b);
      tile.weights = p.weights ? p.weights + p.batch_offset(p.weights_strides, b) : nullptr;
      tile.mask = p.mask ? p.mask + p.batch_offset(p.mask_strides, b) : nullptr;
      tile.bias = p.bias ? p.bias + p.batch_offset(p.bias_strides, b) : nullptr;
      attention.Run(tile);
    }
  }
  if (allocation_failed) throw Error("fused attention: out of memory for per-thread tiles");
}

// Query vectors per tile: as many as the queries fill, up to 4.
void FusedSdpa(const SdpaParams& p) {
  const int64_t vectors = (p.query_len + kLanes - 1) / kLanes;
  if (vectors >= 4) return RunAllTiles<4>(p);
  if (vectors == 3) return RunAllTiles<3>(p);
  if (vectors == 2) return RunAllTiles<2>(p);
  return RunAllTiles<1>(p);
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attend::detail {

HWY_EXPORT(FusedSdpa);

const char* fused_sdpa_rejects(const SdpaParams&) { return nullptr; }

void fused_sdpa(const SdpaParams& params) {
  apply_simd_cap_from_environment();
  HWY_DYNAMIC_DISPATCH(FusedSdpa)(params);
}

}  // namespace attend::detail
#endif  // HWY_ONCE
