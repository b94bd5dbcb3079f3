// fused_sdpa_backward.cc: the tiled attention backward (FlashAttention-2's, Dao 2023, made
// deterministic) in one Highway source compiled for every SIMD target.
//
// Reads  Q (..., Lq, E), K (..., Lk, E), V (..., Lk, Ev), mask, bias, dO and O (..., Lq, Ev),
//        the forward's log-sum-exp (..., Lq): see sdpa_params.hpp.
// Writes dQ, dK, dV and, on request, dS (..., Lq, Lk) for the bias gradient.
//
// Work item = (batch index b, key chunk c). Each item owns the keys of its chunk: for every
// key tile (kKeyTile keys) it loops over the query tiles, recomputing per (key tile, query
// tile) in the transposed layout of the forward (queries along the lanes):
//   Sᵀ[j][q]  = Σ_e K[j][e]·Q̂ᵀ[e][q]          Q̂ = Q·scale·log2 e  (+ bias·log2 e, exclusions)
//   Pᵀ        = 2^(Sᵀ − lse₂[q])                 lse₂ = lse·log2 e (+inf for dead rows: P = 0)
//   dP̃ᵀ[j][q] = Σ_c V[j][c]·dOᵀ[c][q]
//   P̃ᵀ = Pᵀ·Z/(1−p);  dSᵀ = Pᵀ·(dP̃ᵀ·Z/(1−p) − D[q]),  D = rowsum(dO ⊙ O)
//   dV[j] += Σ_q P̃ᵀ[j][q]·dO[q];  dK[j] += Σ_q dSᵀ[j][q]·Q[q];  dQ[q] += Σ_j dSᵀ[j][q]·K[j]
// dK and dV of a key tile stay in the workspace until its last query tile; dQ of the item
// accumulates in a per-item (Lq × E) buffer. The number of chunks depends on the shape only
// (never on the thread count), and the chunks' dQ parts are summed in chunk order after the
// parallel loop: results are bitwise identical at any thread count, with no atomics.
// Extra memory: per thread O(Lq·(E + Ev)), plus (chunks − 1)·batch·Lq·E for the dQ parts.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fused_sdpa_backward.cc"
#include "kernels/fused_sdpa_backward.hpp"

#include <hwy/aligned_allocator.h>
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attend/error.hpp"
#include "dropout.hpp"
#include "half.hpp"
#include "score_rule_layer.hpp"
#include "shape_policy.hpp"
#include "simd_dispatch.hpp"

// Exp2, kLog2e, DenormalsAreZero and ParallelItems, once per target.
#include "kernels/kernel_common-inl.h"
// The score rules a vector at a time, once per target.
#include "kernels/score_rules-inl.h"
// bfloat16 products (AVX512_BF16),
#include "kernels/isa/avx512_bf16-inl.h"
// and on AMX tiles (SdpaParams::amx_tiles).
#include "kernels/isa/amx_bf16-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Query tile: up to 4 vectors (64 queries on AVX-512), as many as the queries fill, as the
// forward. Key tile: 64 keys, so that the dK and dV accumulators (64 × E floats each, 32 KiB
// at E = 128) stay in L1/L2 while every query tile passes.
constexpr int64_t kMaxQueryVectors = kMaxTileVectors;  // shape_policy.hpp: TileVectors
constexpr int64_t kKeyTile = 64;
// Register blocks of the products: up to kAccumulators vector accumulators, ROWS rows of
// broadcast A × VECS vectors of B with ROWS·VECS = kAccumulators (6 × 4, 12 × 2, 24 × 1 on
// AVX-512): narrow products (E = 32 is 2 vectors) keep as many FMAs per load as wide ones.
// Remainder rows go in blocks of kTailRows, then one narrower block.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kAccumulators = 24;
constexpr int kVectors = 4;
constexpr int kTailRows = 6;
#else
constexpr int kAccumulators = 6;
constexpr int kVectors = 2;
constexpr int kTailRows = 3;
#endif

int64_t RoundUp(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// c[m][n] (+)= Σ_k a(m, k)·b[k][n] for ROWS rows m and VECS vectors of n: a(m, k) =
// a[m·a_row + k·a_col] broadcast, b rows contiguous (b_row apart), c rows c_row apart.
template <int ROWS, int VECS>
HWY_INLINE void Block(int64_t depth, const float* a, int64_t a_row, int64_t a_col,
                      const float* HWY_RESTRICT b, int64_t b_row, float* HWY_RESTRICT c,
                      int64_t c_row, bool accumulate) {
  const DF d;
  VF acc[ROWS][VECS];
  for (int m = 0; m < ROWS; ++m) {
    for (int v = 0; v < VECS; ++v) {
      acc[m][v] = accumulate ? hn::Load(d, c + m * c_row + v * kLanes) : hn::Zero(d);
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    VF bv[VECS];
    for (int v = 0; v < VECS; ++v) bv[v] = hn::Load(d, b + k * b_row + v * kLanes);
    for (int m = 0; m < ROWS; ++m) {
      const VF av = hn::Set(d, a[m * a_row + k * a_col]);
      for (int v = 0; v < VECS; ++v) acc[m][v] = hn::MulAdd(av, bv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    for (int v = 0; v < VECS; ++v) hn::Store(acc[m][v], d, c + m * c_row + v * kLanes);
  }
}

// bfloat16 products (SdpaParams::bf16_backward): the products structs of isa/ (AVX-512
// targets with AVX512_BF16), their A the rows of pairs a(m, k) = a[m·a_row + k·a_col] and
// their B the rows of pairs (b[2k][n], b[2k + 1][n]); Products packs the pairs for both.
// On AMX tiles (SdpaParams::amx_tiles) A is always rows of pairs (a_col = 1), and the
// operands are zero up to whole tiles: see BackwardWorkspace.
#undef ATTEND_BACKWARD_BF16
#if ATTEND_AVX512_BF16
#define ATTEND_BACKWARD_BF16 1
using Products = Avx512Bf16;
#else
#define ATTEND_BACKWARD_BF16 0
#endif

// The product over `rows` × `vectors` (c[m][0, vectors·lanes)), in register blocks.
template <int VECS>
HWY_INLINE void ProductColumns(int64_t rows, int64_t depth, const float* a, int64_t a_row,
                               int64_t a_col, const float* b, int64_t b_row, float* c,
                               int64_t c_row, bool accumulate) {
  constexpr int kBlockRows = kAccumulators / VECS;
  int64_t m = 0;
  for (; m + kBlockRows <= rows; m += kBlockRows) {
    Block<kBlockRows, VECS>(depth, a + m * a_row, a_row, a_col, b, b_row, c + m * c_row, c_row,
                            accumulate);
  }
  for (; m + kTailRows <= rows; m += kTailRows) {
    Block<kTailRows, VECS>(depth, a + m * a_row, a_row, a_col, b, b_row, c + m * c_row, c_row,
                           accumulate);
  }
  // The last rows - m < kTailRows rows in one narrower block (64 = 10·6 + 4 on AVX-512).
  const float* a_tail = a + m * a_row;
  float* c_tail = c + m * c_row;
  switch (rows - m) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    case 5:
      return Block<5, VECS>(depth, a_tail, a_row, a_col, b, b_row, c_tail, c_row, accumulate);
    case 4:
      return Block<4, VECS>(depth, a_tail, a_row, a_col, b, b_row, c_tail, c_row, accumulate);
    case 3:
      return Block<3, VECS>(depth, a_tail, a_row, a_col, b, b_row, c_tail, c_row, accumulate);
#endif
    case 2:
      return Block<2, VECS>(depth, a_tail, a_row, a_col, b, b_row, c_tail, c_row, accumulate);
    case 1:
      return Block<1, VECS>(depth, a_tail, a_row, a_col, b, b_row, c_tail, c_row, accumulate);
    default:
      return;
  }
}

// c[m][n] (+)= Σ_k a(m, k)·b[k][n] over rows × vectors of n; with A = uint32_t, `depth`
// counts pairs of k (bfloat16 products: Products::Product, or AmxBf16::Product with `amx`).
template <class A>
void Product(int64_t rows, int64_t vectors, int64_t depth, const A* a, int64_t a_row, int64_t a_col,
             const A* b, int64_t b_row, float* c, int64_t c_row, bool accumulate,
             bool amx = false) {
  if constexpr (std::is_same_v<A, uint32_t>) {
#if ATTEND_BACKWARD_BF16
    const PairsC out{c, c_row, accumulate ? PairStart::kAccumulate : PairStart::kZero};
#if ATTEND_AMX_BF16
    if (amx) {
      return AmxBf16::Product(rows, vectors, depth, PairsA{a, a_row, a_col}, PairsB{b, b_row}, out);
    }
#endif
    HWY_ASSERT(!amx);
    Products::Product(rows, vectors, depth, PairsA{a, a_row, a_col}, PairsB{b, b_row}, out);
#else
    (void)amx;
    HWY_ABORT("bfloat16 products on a target without AVX512_BF16");
#endif
  } else {
    (void)amx;
    int64_t v = 0;
    for (; v + kVectors <= vectors; v += kVectors) {
      ProductColumns<kVectors>(rows, depth, a, a_row, a_col, b + v * kLanes, b_row, c + v * kLanes,
                               c_row, accumulate);
    }
    if (kVectors > 2 && v + 2 <= vectors) {
      ProductColumns<2>(rows, depth, a, a_row, a_col, b + v * kLanes, b_row, c + v * kLanes, c_row,
                        accumulate);
      v += 2;
    }
    if (v < vectors) {
      ProductColumns<1>(rows, depth, a, a_row, a_col, b + v * kLanes, b_row, c + v * kLanes, c_row,
                        accumulate);
    }
  }
}

// Per-thread scratch, allocated once per call and thread. Rows are padded to whole vectors
// (E_pad, Ev_pad) and queries to whole tiles (Lq_pad), with zeros.
struct BackwardWorkspace {
  int64_t tq;  // queries per tile: 1 to 4 whole vectors
  int64_t lq_pad, e_pad, ev_pad;
  // Per query tile t, contiguous: [t][E][Tq] Q·scale·log2 e and [t][Ev][Tq] dO, transposed
  // (a tile's rows Tq apart: rows Lq_pad apart would all fall in one L1 set).
  hwy::AlignedFreeUniquePtr<float[]> query_t;
  hwy::AlignedFreeUniquePtr<float[]> dout_t;
  hwy::AlignedFreeUniquePtr<float[]> query;   // [Lq_pad][E_pad]  Q
  hwy::AlignedFreeUniquePtr<float[]> dout;    // [Lq_pad][Ev_pad] dO
  hwy::AlignedFreeUniquePtr<float[]> lse2;    // [Lq_pad]         lse·log2 e, +inf if dead
  hwy::AlignedFreeUniquePtr<float[]> delta;   // [Lq_pad]         D = rowsum(dO ⊙ O)
  hwy::AlignedFreeUniquePtr<float[]> dq;      // [Lq_pad][E_pad]  Σ_j dS·K of this item
  hwy::AlignedFreeUniquePtr<float[]> key;     // [Tk][E_pad]      K of the key tile
  hwy::AlignedFreeUniquePtr<float[]> dk;      // [Tk][E_pad]
  hwy::AlignedFreeUniquePtr<float[]> dv;      // [Tk][Ev_pad]
  hwy::AlignedFreeUniquePtr<float[]> prob_t;  // [Tk][Tq]  Sᵀ, then Pᵀ, then P̃ᵀ
  hwy::AlignedFreeUniquePtr<float[]> grad_t;  // [Tk][Tq]  dP̃ᵀ, then dSᵀ
  hwy::AlignedFreeUniquePtr<float[]> keep;    // [Tk][Tq]  Z/(1 − p), with dropout
  // With score modifications: the scores after step 2 and before the user rule, for their
  // derivatives ([Tk][Tq] each).
  hwy::AlignedFreeUniquePtr<float[]> after_shaping, before_user;
  RowRules row_rules;  // the query tile's rows' visible keys and documents
  hwy::AlignedFreeUniquePtr<uint8_t[]> row_keep;  // [Lk] a user mask's verdicts on one row
  KeepTile pair_keep;                             // [Tk][Tq] the mask's and user mask's verdicts
  uint8_t visible[kMaxQueryVectors * 16];         // ApplyExclusions' record, unused here
  // Rows with every key excluded (kUniform): [dead_count] of [Lq] (no std::vector: nothing
  // in an OpenMP region may throw).
  hwy::AlignedFreeUniquePtr<int64_t[]> dead_rows;
  int64_t dead_count = 0;
  // bfloat16 products only (SdpaParams::bf16_backward; E2 = ⌈E/2⌉, Ev2 = ⌈Ev/2⌉): 32-bit
  // pairs of bfloat16, each product's operands in the layout Products::Product reads. On AMX
  // tiles (amx) every depth of pairs is read in whole tiles of 16 pairs, so the strides below
  // round up to 16 pairs and everything past the operands is zero (allocated zeroed, never
  // written): E2' = e2s, Ev2' = ev2s, Tq/2' = tile_pairs, E_pad/2' = key_row, Ev_pad/2' =
  // value_row; and dQ is computed transposed (dQᵀ += Kᵀ·dSᵀ, so that A is rows of pairs).
  bool amx = false;
  int64_t e2s = 0, ev2s = 0, tile_pairs = 0, key_row = 0, value_row = 0;
  hwy::AlignedFreeUniquePtr<uint32_t[]> query_pairs_t;  // [t][E2'][Tq]   Q along E (unscaled)
  hwy::AlignedFreeUniquePtr<uint32_t[]> dout_pairs_t;   // [t][Ev2'][Tq]  dO along Ev
  hwy::AlignedFreeUniquePtr<uint32_t[]> query_pairs;    // [Lq_pad/2 + 16][E_pad]  Q along queries
  hwy::AlignedFreeUniquePtr<uint32_t[]> dout_pairs;     // [Lq_pad/2 + 16][Ev_pad] dO along queries
  hwy::AlignedFreeUniquePtr<uint32_t[]> key_rows;       // [Tk][E_pad/2']   K along E
  hwy::AlignedFreeUniquePtr<uint32_t[]> value_rows;     // [Tk][Ev_pad/2']  V along Ev
  hwy::AlignedFreeUniquePtr<uint32_t[]> key_pairs;      // [Tk/2][E_pad]   K along keys
  hwy::AlignedFreeUniquePtr<uint32_t[]> key_pairs_t;    // [E_pad][Tk/2]   the same, AMX only
  hwy::AlignedFreeUniquePtr<uint32_t[]> prob_pairs;     // [Tk][Tq/2']  P̃ᵀ along queries
  hwy::AlignedFreeUniquePtr<uint32_t[]> grad_pairs;     // [Tk][Tq/2']  dSᵀ along queries
  hwy::AlignedFreeUniquePtr<uint32_t[]> grad_pairs_t;   // [Tk/2][Tq]  dSᵀ along keys
  bool bf16_ok = true;

  explicit BackwardWorkspace(const SdpaParams& p)
      : tq(TileVectors(p.query_len, kLanes) * kLanes),
        lq_pad(RoundUp(std::max<int64_t>(p.query_len, 1), tq)),
        e_pad(RoundUp(p.head_dim, kLanes)),
        ev_pad(RoundUp(p.value_dim, kLanes)) {
    const auto n = [](int64_t count) { return static_cast<size_t>(count); };
    query_t = hwy::AllocateAligned<float>(n(p.head_dim * lq_pad));
    dout_t = hwy::AllocateAligned<float>(n(p.value_dim * lq_pad));
    query = hwy::AllocateAligned<float>(n(lq_pad * e_pad));
    dout = hwy::AllocateAligned<float>(n(lq_pad * ev_pad));
    lse2 = hwy::AllocateAligned<float>(n(lq_pad));
    delta = hwy::AllocateAligned<float>(n(lq_pad));
    dq = hwy::AllocateAligned<float>(n(lq_pad * e_pad));
    key = hwy::AllocateAligned<float>(n(kKeyTile * e_pad));
    dk = hwy::AllocateAligned<float>(n(kKeyTile * e_pad));
    dv = hwy::AllocateAligned<float>(n(kKeyTile * ev_pad));
    prob_t = hwy::AllocateAligned<float>(n(kKeyTile * tq));
    grad_t = hwy::AllocateAligned<float>(n(kKeyTile * tq));
    keep = hwy::AllocateAligned<float>(n(p.dropout > 0 ? kKeyTile * tq : 1));
    dead_rows = hwy::AllocateAligned<int64_t>(n(std::max<int64_t>(p.query_len, 1)));
    after_shaping = hwy::AllocateAligned<float>(n(has_score_shaping(p) ? kKeyTile * tq : 1));
    before_user = hwy::AllocateAligned<float>(n(has_user_modification(p) ? kKeyTile * tq : 1));
    row_rules.Allocate(tq);
    if (has_pairwise_rules(p)) pair_keep.Allocate(kKeyTile, tq);
    row_keep = hwy::AllocateAligned<uint8_t>(n(p.user_rules ? p.key_len : 1));
    if (p.bf16_backward) {
      amx = p.amx_tiles;
      const int64_t whole = amx ? 16 : 1;  // pairs per tile row (AMX), else none
      e2s = RoundUp((p.head_dim + 1) / 2, whole);
      ev2s = RoundUp((p.value_dim + 1) / 2, whole);
      tile_pairs = RoundUp(tq / 2, whole);
      key_row = RoundUp(e_pad / 2, whole);
      value_row = RoundUp(ev_pad / 2, whole);
      const int64_t extra_rows = amx ? 16 : 0;  // read past the last query tile's pairs
      const auto u32 = [&](int64_t count) {
        auto buffer = hwy::AllocateAligned<uint32_t>(n(count));
        if (buffer && amx) std::fill_n(buffer.get(), count, 0u);
        return buffer;
      };
      query_pairs_t = u32(lq_pad * e2s);
      dout_pairs_t = u32(lq_pad * ev2s);
      query_pairs = u32((lq_pad / 2 + extra_rows) * e_pad);
      dout_pairs = u32((lq_pad / 2 + extra_rows) * ev_pad);
      key_rows = u32(kKeyTile * key_row);
      value_rows = u32(kKeyTile * value_row);
      key_pairs = u32(kKeyTile / 2 * e_pad);
      key_pairs_t = u32(amx ? e_pad * kKeyTile / 2 : 1);
      prob_pairs = u32(kKeyTile * tile_pairs);
      grad_pairs = u32(kKeyTile * tile_pairs);
      grad_pairs_t = u32(kKeyTile / 2 * tq);
      bf16_ok = query_pairs_t && dout_pairs_t && query_pairs && dout_pairs && key_rows &&
                value_rows && key_pairs && key_pairs_t && prob_pairs && grad_pairs && grad_pairs_t;
    }
  }
  bool ok() const {
    return query_t && dout_t && query && dout && lse2 && delta && dq && key && dk && dv && prob_t &&
           grad_t && keep && dead_rows && after_shaping && before_user && row_rules.ok() &&
           row_keep && pair_keep.ok() && bf16_ok;
  }
};

// Key chunks per batch index: enough work items to keep 8 threads busy when the batch is
// small. A function of the shape only, so the summation order of dQ never depends on the
// thread count.
int64_t KeyChunks(const SdpaParams& p) {
  const int64_t key_tiles = (p.key_len + kKeyTile - 1) / kKeyTile;
  return std::clamp<int64_t>((8 + p.batch - 1) / p.batch, 1, key_tiles);
}

class BackwardItem {
 public:
  BackwardItem(const SdpaBackwardParams& bp, BackwardWorkspace& ws)
      : bp_(bp), p_(bp.forward), ws_(ws) {}

  // Keys [key_begin, key_end) of batch index b: writes their dK and dV, and their part of
  // dQ, Σ_j dS·K without the scale, to dq_out (row stride dq_row).
  void Run(int64_t b, int64_t key_begin, int64_t key_end, float* dq_out, int64_t dq_row) {
    b_ = b;
    query_ = p_.query + p_.batch_offset(p_.query_strides, b);
    key_ = p_.key + p_.batch_offset(p_.key_strides, b);
    value_ = p_.value + p_.batch_offset(p_.value_strides, b);
    mask_ = p_.mask ? p_.mask + p_.batch_offset(p_.mask_strides, b) : nullptr;
    bias_ = p_.bias ? p_.bias + p_.batch_offset(p_.bias_strides, b) : nullptr;
    grad_scores_ =
        bp_.grad_scores ? bp_.grad_scores + p_.batch_offset(bp_.grad_scores_strides, b) : nullptr;
    LoadQueryRows();
    std::fill_n(ws_.dq.get(), ws_.lq_pad * ws_.e_pad, 0.0f);
    for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeyTile) {
      KeyTile(k0, std::min(kKeyTile, key_end - k0));
    }
    for (int64_t i = 0; i < p_.query_len; ++i) {
      float* to = dq_out + i * dq_row;
      if (ws_.amx) {  // dQᵀ per query tile: [t][E_pad][Tq]
        const int64_t tile_start = i / ws_.tq * ws_.tq;
        const float* from = ws_.dq.get() + tile_start * ws_.e_pad + (i - tile_start);
        for (int64_t e = 0; e < p_.head_dim; ++e) to[e] = from[e * ws_.tq];
        continue;
      }
      const float* from = ws_.dq.get() + i * ws_.e_pad;
      for (int64_t e = 0; e < p_.head_dim; ++e) to[e] = from[e];
    }
  }

 private:
  // Q̂ᵀ, Qᵀ padded, dOᵀ, dO padded, lse₂, D and the dead rows of batch index b_.
  void LoadQueryRows() {
    const int64_t lq = p_.query_len, lq_pad = ws_.lq_pad, e_pad = ws_.e_pad, ev_pad = ws_.ev_pad;
    // Natural units when the scores are modified (ModifyScores applies log2 e); bfloat16
    // products scale the float32 scores instead (ScoreFactor).
    const float factor = p_.bf16_backward ? 1.0f : ScoreFactor();
    const float* dout = bp_.grad_output + p_.batch_offset(bp_.grad_output_strides, b_);
    const float* out = p_.output + p_.batch_offset(p_.output_strides, b_);
    const float* lse = bp_.logsumexp + p_.batch_offset(bp_.logsumexp_strides, b_);
    std::fill_n(ws_.query.get(), lq_pad * e_pad, 0.0f);
    std::fill_n(ws_.dout.get(), lq_pad * ev_pad, 0.0f);
    std::fill_n(ws_.query_t.get(), p_.head_dim * lq_pad, 0.0f);
    std::fill_n(ws_.dout_t.get(), p_.value_dim * lq_pad, 0.0f);
    std::fill_n(ws_.lse2.get(), lq_pad, std::numeric_limits<float>::infinity());
    std::fill_n(ws_.delta.get(), lq_pad, 0.0f);
    ws_.dead_count = 0;
    for (int64_t i = 0; i < lq; ++i) {
      const float* q = query_ + i * p_.query_strides.row;
      const float* g = dout + i * bp_.grad_output_strides.row;
      const float* o = out + i * p_.output_strides.row;
      float* q_row = ws_.query.get() + i * e_pad;
      float* g_row = ws_.dout.get() + i * ev_pad;
      // Lane i % Tq of tile i / Tq: tile t starts at t·Tq·E (Q̂ᵀ) and t·Tq·Ev (dOᵀ).
      const int64_t tile_start = i / ws_.tq * ws_.tq, lane = i - tile_start;
      float* query_t = ws_.query_t.get() + tile_start * p_.head_dim + lane;
      float* dout_t = ws_.dout_t.get() + tile_start * p_.value_dim + lane;
      for (int64_t e = 0; e < p_.head_dim; ++e) {
        q_row[e] = q[e];
        query_t[e * ws_.tq] = q[e] * factor;
      }
      float delta = 0;
      for (int64_t c = 0; c < p_.value_dim; ++c) {
        g_row[c] = g[c];
        dout_t[c * ws_.tq] = g[c];
        delta += g[c] * o[c];
      }
      ws_.delta[i] = delta;
      if (RowHasVisibleKey(i)) {
        ws_.lse2[i] = lse[i * bp_.logsumexp_strides.row] * kLog2e;
      } else if (!p_.zero_fully_masked_rows && p_.sinks == nullptr) {
        ws_.dead_rows[ws_.dead_count++] = i;  // P = 1/Lk, no gradient to S: dV only
      }
    }
    if (p_.bf16_backward) PackQueryPairs();
  }

  // Q̂ = Q·factor: scale·log2 e, or the scale alone when the scores are modified.
  float ScoreFactor() const { return has_score_mods(p_) ? p_.scale : p_.scale * kLog2e; }

  // The item's Q and dO as bfloat16 pairs: along E and Ev per query tile (from the
  // transposed Qᵀ and dOᵀ), and along the queries (from the padded rows).
  void PackQueryPairs() {
#if ATTEND_BACKWARD_BF16
    const int64_t tq = ws_.tq, e = p_.head_dim, ev = p_.value_dim;
    const int64_t e2 = (e + 1) / 2, ev2 = (ev + 1) / 2;
    for (int64_t t0 = 0; t0 < ws_.lq_pad; t0 += tq) {
      const float* q_t = ws_.query_t.get() + t0 * e;
      const float* g_t = ws_.dout_t.get() + t0 * ev;
      for (int64_t i = 0; i < e2; ++i) {
        Products::PairsAcrossRows(q_t + 2 * i * tq,
                                  2 * i + 1 < e ? q_t + (2 * i + 1) * tq : nullptr, tq,
                                  ws_.query_pairs_t.get() + t0 * ws_.e2s + i * tq);
      }
      for (int64_t i = 0; i < ev2; ++i) {
        Products::PairsAcrossRows(g_t + 2 * i * tq,
                                  2 * i + 1 < ev ? g_t + (2 * i + 1) * tq : nullptr, tq,
                                  ws_.dout_pairs_t.get() + t0 * ws_.ev2s + i * tq);
      }
    }
    for (int64_t i = 0; i < ws_.lq_pad; i += 2) {
      Products::PairsAcrossRows(ws_.query.get() + i * ws_.e_pad,
                                ws_.query.get() + (i + 1) * ws_.e_pad, ws_.e_pad,
                                ws_.query_pairs.get() + i / 2 * ws_.e_pad);
      Products::PairsAcrossRows(ws_.dout.get() + i * ws_.ev_pad,
                                ws_.dout.get() + (i + 1) * ws_.ev_pad, ws_.ev_pad,
                                ws_.dout_pairs.get() + i / 2 * ws_.ev_pad);
    }
#endif
  }

  // The key tile's K and V as bfloat16 pairs: K and V along E and Ev, K along the keys.
  void PackKeyPairs(int64_t k0, int64_t keys) {
#if ATTEND_BACKWARD_BF16
    const int64_t e_pad = ws_.e_pad;
    for (int64_t j = 0; j < keys; ++j) {
      Products::PairsAlongRow(ws_.key.get() + j * e_pad, e_pad,
                              ws_.key_rows.get() + j * ws_.key_row);
      Products::PairsAlongRow(value_ + (k0 + j) * p_.value_strides.row, p_.value_dim,
                              ws_.value_rows.get() + j * ws_.value_row);
    }
    for (int64_t j = 0; j < keys; j += 2) {
      Products::PairsAcrossRows(ws_.key.get() + j * e_pad,
                                j + 1 < keys ? ws_.key.get() + (j + 1) * e_pad : nullptr, e_pad,
                                ws_.key_pairs.get() + j / 2 * e_pad);
    }
    if (ws_.amx) {  // Kᵀ as rows of pairs along the keys (dQᵀ's A), zero past the tile's keys
      const int64_t key_pairs = (keys + 1) / 2;
      for (int64_t e = 0; e < e_pad; ++e) {
        uint32_t* row = ws_.key_pairs_t.get() + e * (kKeyTile / 2);
        for (int64_t i = 0; i < key_pairs; ++i) row[i] = ws_.key_pairs[i * e_pad + e];
        std::fill(row + key_pairs, row + kKeyTile / 2, 0u);
      }
    }
#else
    (void)k0, (void)keys;
#endif
  }

  bool RowHasVisibleKey(int64_t i) const {
    return row_has_visible_key(p_, b_, i, ws_.row_keep.get());
  }

  void KeyTile(int64_t k0, int64_t keys) {
    const int64_t e_pad = ws_.e_pad, ev_pad = ws_.ev_pad;
    for (int64_t j = 0; j < keys; ++j) {
      const float* k = key_ + (k0 + j) * p_.key_strides.row;
      float* row = ws_.key.get() + j * e_pad;
      std::copy_n(k, p_.head_dim, row);
      std::fill(row + p_.head_dim, row + e_pad, 0.0f);
    }
    std::fill_n(ws_.dk.get(), kKeyTile * e_pad, 0.0f);
    std::fill_n(ws_.dv.get(), kKeyTile * ev_pad, 0.0f);
    if (p_.bf16_backward) PackKeyPairs(k0, keys);
    // Query tiles that see at least one key of this tile (causality: from the first query
    // whose last key reaches k0); the rules skip the others (RowRules::Classify).
    int64_t q_begin = 0;
    if (p_.causal && p_.prefix == 0) q_begin = std::max<int64_t>(0, k0 - p_.diagonal_offset);
    q_begin = q_begin / ws_.tq * ws_.tq;
    for (int64_t q0 = q_begin; q0 < p_.query_len; q0 += ws_.tq) {
      // A window's first visible key never decreases with the query: once past this key
      // tile, so are all later query tiles (unless a prefix keeps the first keys visible).
      if (p_.window_left >= 0 && k0 >= p_.prefix && visible_keys(p_, q0).first >= k0 + keys) {
        break;
      }
      QueryTile(k0, keys, q0);
    }
    if (ws_.dead_count > 0) DeadRowsValues(k0, keys);

    float* dk = bp_.grad_key + p_.batch_offset(bp_.grad_key_strides, b_);
    float* dv = bp_.grad_value + p_.batch_offset(bp_.grad_value_strides, b_);
    for (int64_t j = 0; j < keys; ++j) {
      float* dk_row = dk + (k0 + j) * bp_.grad_key_strides.row;
      float* dv_row = dv + (k0 + j) * bp_.grad_value_strides.row;
      for (int64_t e = 0; e < p_.head_dim; ++e) dk_row[e] = ws_.dk[j * e_pad + e] * p_.scale;
      for (int64_t c = 0; c < p_.value_dim; ++c) dv_row[c] = ws_.dv[j * ev_pad + c];
    }
  }

  void QueryTile(int64_t k0, int64_t keys, int64_t q0) {
    const int64_t e_pad = ws_.e_pad, ev_pad = ws_.ev_pad;
    const int64_t tq = ws_.tq;
    const int64_t query_rows = std::min(tq, p_.query_len - q0);
    TileVerdict verdict = TileVerdict::kFull;
    if (may_exclude(p_)) {
      ws_.row_rules.Load(p_, b_, q0, query_rows, tq);
      verdict = ws_.row_rules.Classify(p_, b_, k0, keys);
      if (verdict == TileVerdict::kEmpty) return;
      if (has_pairwise_rules(p_) &&
          !ws_.pair_keep.Fill(p_, b_, mask_, q0, query_rows, k0, keys, tq)) {
        return;
      }
    }
    float* prob_t = ws_.prob_t.get();
    float* grad_t = ws_.grad_t.get();
    // Sᵀ = K·Q̂ᵀ and dP̃ᵀ = V·dOᵀ: (keys × Tq), E and Ev deep.
    if (p_.bf16_backward) {
      const int64_t e2 = (p_.head_dim + 1) / 2, ev2 = (p_.value_dim + 1) / 2;
      Product(keys, tq / kLanes, e2, ws_.key_rows.get(), ws_.key_row, 1,
              ws_.query_pairs_t.get() + q0 * ws_.e2s, tq, prob_t, tq, false, ws_.amx);
      Product(keys, tq / kLanes, ev2, ws_.value_rows.get(), ws_.value_row, 1,
              ws_.dout_pairs_t.get() + q0 * ws_.ev2s, tq, grad_t, tq, false, ws_.amx);
      ScaleScores(keys);
    } else {
      Product(keys, tq / kLanes, p_.head_dim, ws_.key.get(), e_pad, 1,
              ws_.query_t.get() + q0 * p_.head_dim, tq, prob_t, tq, false);
      Product(keys, tq / kLanes, p_.value_dim, value_ + k0 * p_.value_strides.row,
              p_.value_strides.row, 1, ws_.dout_t.get() + q0 * p_.value_dim, tq, grad_t, tq, false);
    }
    AdjustScores(k0, keys, q0, verdict);
    if (p_.dropout > 0) DropoutFactors(k0, keys, q0);
    SoftmaxGradient(keys, q0);
    ModificationGradients(k0, keys, q0);
    // dV += P̃ᵀ·dO, dK += dSᵀ·Q (Tq deep), dQ += dS·K (keys deep).
    const int64_t rows = std::min(tq, p_.query_len - q0);
    if (p_.bf16_backward) {
      // P̃ and dS rounded to bfloat16 (pairs along the queries for dV and dK, along the keys
      // for dQ); padded queries have P = dS = 0 and dO = Q = 0.
      PackTilePairs(keys);
      const int64_t row_pairs = (rows + 1) / 2, key_pairs = (keys + 1) / 2;
      Product(keys, ev_pad / kLanes, row_pairs, ws_.prob_pairs.get(), ws_.tile_pairs, 1,
              ws_.dout_pairs.get() + q0 / 2 * ev_pad, ev_pad, ws_.dv.get(), ev_pad, true, ws_.amx);
      Product(keys, e_pad / kLanes, row_pairs, ws_.grad_pairs.get(), ws_.tile_pairs, 1,
              ws_.query_pairs.get() + q0 / 2 * e_pad, e_pad, ws_.dk.get(), e_pad, true, ws_.amx);
      if (ws_.amx) {  // dQᵀ (E_pad × Tq) += Kᵀ·dSᵀ, keys deep
        Product(e_pad, tq / kLanes, key_pairs, ws_.key_pairs_t.get(), kKeyTile / 2, 1,
                ws_.grad_pairs_t.get(), tq, ws_.dq.get() + q0 * e_pad, tq, true, true);
        return;
      }
      Product(rows, e_pad / kLanes, key_pairs, ws_.grad_pairs_t.get(), 1, tq, ws_.key_pairs.get(),
              e_pad, ws_.dq.get() + q0 * e_pad, e_pad, true);
      return;
    }
    Product(keys, ev_pad / kLanes, rows, prob_t, tq, 1, ws_.dout.get() + q0 * ev_pad, ev_pad,
            ws_.dv.get(), ev_pad, true);
    Product(keys, e_pad / kLanes, rows, grad_t, tq, 1, ws_.query.get() + q0 * e_pad, e_pad,
            ws_.dk.get(), e_pad, true);
    Product(rows, e_pad / kLanes, keys, grad_t, 1, tq, ws_.key.get(), e_pad,
            ws_.dq.get() + q0 * e_pad, e_pad, true);
  }

  // Sᵀ ·= ScoreFactor() (the bfloat16 products' Q is unscaled).
  void ScaleScores(int64_t keys) {
    const DF d;
    const VF factor = hn::Set(d, ScoreFactor());
    float* s = ws_.prob_t.get();
    for (int64_t i = 0; i < keys * ws_.tq; i += kLanes) {
      hn::Store(hn::Mul(hn::Load(d, s + i), factor), d, s + i);
    }
  }

  // P̃ᵀ and dSᵀ of the tile as bfloat16 pairs (see BackwardWorkspace).
  void PackTilePairs(int64_t keys) {
#if ATTEND_BACKWARD_BF16
    const int64_t tq = ws_.tq;
    const float* prob_t = ws_.prob_t.get();
    const float* grad_t = ws_.grad_t.get();
    for (int64_t j = 0; j < keys; ++j) {
      Products::PairsAlongRow(prob_t + j * tq, tq, ws_.prob_pairs.get() + j * ws_.tile_pairs);
      Products::PairsAlongRow(grad_t + j * tq, tq, ws_.grad_pairs.get() + j * ws_.tile_pairs);
    }
    for (int64_t j = 0; j < keys; j += 2) {
      Products::PairsAcrossRows(grad_t + j * tq, j + 1 < keys ? grad_t + (j + 1) * tq : nullptr, tq,
                                ws_.grad_pairs_t.get() + j / 2 * tq);
    }
    if (ws_.amx) {  // the pairs past a short key tile, which dQᵀ's tiles read: zero
      const int64_t from = (keys + 1) / 2 * tq;
      std::fill(ws_.grad_pairs_t.get() + from, ws_.grad_pairs_t.get() + kKeyTile / 2 * tq, 0u);
    }
#else
    (void)keys;
#endif
  }

  // The score rules (score_rule_layer.hpp, as the forward applies them), excluded pairs -inf
  // (P = 0, as the forward's exp(-1e9 − lse)).
  void AdjustScores(int64_t k0, int64_t keys, int64_t q0, TileVerdict verdict) {
    const int64_t tq = ws_.tq;
    float* s = ws_.prob_t.get();
    const int64_t rows = std::min(tq, p_.query_len - q0);
    if (has_score_mods(p_)) {
      ModifyScores(p_, b_, bias_, q0, rows, k0, keys, tq, s,
                   has_score_shaping(p_) ? ws_.after_shaping.get() : nullptr,
                   has_user_modification(p_) ? ws_.before_user.get() : nullptr);
    } else if (bias_) {
      AddBias(p_, bias_, q0, rows, k0, keys, tq, kLog2e, s);
    }
    if (may_exclude(p_)) {
      ApplyExclusions(p_, b_, ws_.row_rules, ws_.pair_keep, k0, keys, tq, verdict, s, ws_.visible,
                      rows, -std::numeric_limits<float>::infinity());
    }
  }

  // dS back through the modifications: × the user rule's derivative (then dS is the bias's
  // gradient, written when asked for), × step 2's derivative (ShapeGradients).
  void ModificationGradients(int64_t k0, int64_t keys, int64_t q0) {
    const int64_t tq = ws_.tq;
    float* grad_t = ws_.grad_t.get();
    const int64_t rows = std::min(tq, p_.query_len - q0);
    if (has_user_modification(p_)) {
      const UserScoreRules& u = *p_.user_rules;
      u.modify_gradient(u.score_mod, rule_tile(p_, b_, q0, k0, rows, keys, 1, tq),
                        ws_.before_user.get(), grad_t);
    }
    if (grad_scores_) WriteGradScores(k0, keys, q0);
    if (has_score_shaping(p_)) ShapeGradients(p_, ws_.after_shaping.get(), keys, tq, grad_t);
  }

  // keep[j][r] = Z/(1 − p) from the forward's Philox draws of (b, q0 + r, k0 + j).
  void DropoutFactors(int64_t k0, int64_t keys, int64_t q0) {
    const int64_t tq = ws_.tq;
    const uint32_t threshold = dropout_threshold(p_.dropout);
    const float keep_scale = 1.0f / (1.0f - p_.dropout);
    float* keep = ws_.keep.get();
    const int64_t rows = std::min(tq, p_.query_len - q0);
    for (int64_t r = 0; r < tq; ++r) {
      for (int64_t j = 0; j < keys; ++j) keep[j * tq + r] = r < rows ? keep_scale : 0.0f;
      if (r >= rows) continue;
      for_each_dropped(p_.seed, threshold, b_, global_query(p_, q0 + r), global_key(p_, k0), keys,
                       [keep, tq, r](int64_t j) { keep[j * tq + r] = 0.0f; });
    }
  }

  // Pᵀ = 2^(Sᵀ − lse₂); dSᵀ = Pᵀ·(dP̃ᵀ·keep − D); P̃ᵀ = Pᵀ·keep (in place of Sᵀ).
  void SoftmaxGradient(int64_t keys, int64_t q0) {
    const DF d;
    const int64_t tq = ws_.tq;
    float* prob_t = ws_.prob_t.get();
    float* grad_t = ws_.grad_t.get();
    const float* keep = ws_.keep.get();
    for (int64_t r = 0; r < tq; r += kLanes) {
      const VF lse2 = hn::Load(d, ws_.lse2.get() + q0 + r);
      const VF delta = hn::Load(d, ws_.delta.get() + q0 + r);
      for (int64_t j = 0; j < keys; ++j) {
        float* s = prob_t + j * tq + r;
        float* g = grad_t + j * tq + r;
        const VF prob = Exp2(d, hn::Sub(hn::Load(d, s), lse2));
        if (p_.dropout > 0) {
          const VF k = hn::Load(d, keep + j * tq + r);
          hn::Store(hn::Mul(prob, hn::Sub(hn::Mul(hn::Load(d, g), k), delta)), d, g);
          hn::Store(hn::Mul(prob, k), d, s);
        } else {
          hn::Store(hn::Mul(prob, hn::Sub(hn::Load(d, g), delta)), d, g);
          hn::Store(prob, d, s);
        }
      }
    }
  }

  void WriteGradScores(int64_t k0, int64_t keys, int64_t q0) {
    const int64_t rows = std::min(ws_.tq, p_.query_len - q0);
    for (int64_t r = 0; r < rows; ++r) {
      float* ds = grad_scores_ + (q0 + r) * bp_.grad_scores_strides.row + k0;
      for (int64_t j = 0; j < keys; ++j) ds[j] = ws_.grad_t[j * ws_.tq + r];
    }
  }

  // Rows with every key excluded have uniform weights 1/Lk (then dropout) over all keys,
  // and no gradient to their scores: dV[j] += (1/Lk)·Z·keep·dO[i].
  void DeadRowsValues(int64_t k0, int64_t keys) {
    const uint32_t threshold = dropout_threshold(p_.dropout);
    const float uniform = 1.0f / static_cast<float>(p_.key_len);
    const float kept = static_cast<float>(uniform / (1.0 - static_cast<double>(p_.dropout)));
    for (int64_t d = 0; d < ws_.dead_count; ++d) {
      const int64_t i = ws_.dead_rows[d];
      const float* g = ws_.dout.get() + i * ws_.ev_pad;
      for (int64_t j = 0; j < keys; ++j) {
        float w = uniform;
        if (p_.dropout > 0)
          w = dropout_keep(p_.seed, threshold, b_, global_query(p_, i), global_key(p_, k0 + j))
                  ? kept
                  : 0.0f;
        float* dv = ws_.dv.get() + j * ws_.ev_pad;
        for (int64_t c = 0; c < p_.value_dim; ++c) dv[c] += w * g[c];
      }
    }
  }

  const SdpaBackwardParams& bp_;
  const SdpaParams& p_;
  BackwardWorkspace& ws_;
  int64_t b_ = 0;
  const float *query_ = nullptr, *key_ = nullptr, *value_ = nullptr, *bias_ = nullptr;
  const uint8_t* mask_ = nullptr;
  float* grad_scores_ = nullptr;
};

void FusedSdpaBackward(const SdpaBackwardParams& bp) {
  const SdpaParams& p = bp.forward;
  const int64_t chunks = KeyChunks(p);
  const int64_t key_tiles = (p.key_len + kKeyTile - 1) / kKeyTile;
  const int64_t tiles_per_chunk = (key_tiles + chunks - 1) / chunks;
  const int64_t items = p.batch * chunks;
  // Chunk c > 0 of batch b writes its dQ part to parts[(b·(chunks − 1) + c − 1)·Lq·E];
  // chunk 0 writes into dQ, and the parts are added in chunk order afterwards.
  hwy::AlignedFreeUniquePtr<float[]> parts;
  const int64_t part_size = p.query_len * p.head_dim;
  if (chunks > 1) {
    parts = hwy::AllocateAligned<float>(static_cast<size_t>(p.batch * (chunks - 1) * part_size));
    if (!parts) throw Error("fused attention backward: out of memory for the dQ parts");
  }
  const double multiply_adds = 2.5 * static_cast<double>(p.batch) *
                               static_cast<double>(p.query_len) * static_cast<double>(p.key_len) *
                               static_cast<double>(p.head_dim + p.value_dim);
  ParallelItems<BackwardWorkspace>(
      p, multiply_adds, items, [&](BackwardWorkspace& ws, int64_t item) {
        const int64_t b = item / chunks, c = item % chunks;
        const int64_t key_begin = std::min(p.key_len, c * tiles_per_chunk * kKeyTile);
        const int64_t key_end = std::min(p.key_len, (c + 1) * tiles_per_chunk * kKeyTile);
        float* dq = bp.grad_query + p.batch_offset(bp.grad_query_strides, b);
        int64_t dq_row = bp.grad_query_strides.row;
        if (c > 0) {
          dq = parts.get() + (b * (chunks - 1) + c - 1) * part_size;
          dq_row = p.head_dim;
        }
        if (p.amx_tiles) {
#if ATTEND_AMX_BF16
          const amx::TileScope tiles;
          BackwardItem(bp, ws).Run(b, key_begin, key_end, dq, dq_row);
          return;
#else
          HWY_ABORT("AMX tiles on a target without AVX512_BF16");
#endif
        }
        BackwardItem(bp, ws).Run(b, key_begin, key_end, dq, dq_row);
      });
  // dQ = scale·(part 0 + part 1 + ...), in chunk order.
  for (int64_t b = 0; b < p.batch; ++b) {
    float* dq = bp.grad_query + p.batch_offset(bp.grad_query_strides, b);
    for (int64_t i = 0; i < p.query_len; ++i) {
      float* row = dq + i * bp.grad_query_strides.row;
      for (int64_t c = 1; c < chunks; ++c) {
        const float* part = parts.get() + (b * (chunks - 1) + c - 1) * part_size + i * p.head_dim;
        for (int64_t e = 0; e < p.head_dim; ++e) row[e] += part[e];
      }
      for (int64_t e = 0; e < p.head_dim; ++e) row[e] *= p.scale;
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attend::detail {

HWY_EXPORT(FusedSdpaBackward);

const char* fused_sdpa_backward_rejects(const SdpaBackwardParams&) { return nullptr; }

void fused_sdpa_backward(const SdpaBackwardParams& params) {
  ATTEND_DISPATCH(FusedSdpaBackward)(params);
}

}  // namespace attend::detail
#endif  // HWY_ONCE
