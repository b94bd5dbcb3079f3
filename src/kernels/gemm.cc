// gemm.cc: output(M, N) = input(M, K) · weight(N, K)ᵀ + bias(N), the projection of a Linear
// layer, written once with Highway and compiled for every SIMD target.
//
// 1. Pack the weight into column panels of kPanelWidth = 2 vectors: panel p holds
//    weight[p·W + c][k] at packed[p][k][c], zero past column N, so the micro-kernel reads one
//    aligned row of the panel per k.
// 2. For every (panel, block of kRowBlock rows) tile, in parallel, in depth passes of
//    kDepthBlock: a register-blocked micro-kernel keeps kMicroRows x 2 vectors of accumulators,
//    starts them at the bias (first pass) or the partial output, and adds input[i][k] ·
//    panel[k][:] in k order. That sequence is the same whichever thread runs the tile, so
//    results do not depend on the thread count.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/gemm.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target.h must come first.
#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "half.hpp"
#include "kernels/gemm.hpp"
#include "work_size.hpp"

// QuadSums, once per target.
#include "kernels/kernel_common-inl.h"
// bfloat16 products (AVX512_BF16).
#include "kernels/isa/avx512_bf16-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Six rows x two vectors = 12 accumulators, plus two weight vectors and one broadcast: 15
// registers, which fits the 16 of AVX2 and leaves room on AVX-512.
constexpr int64_t kMicroRows = 6;
// Rows per parallel task: 16 micro-tiles, so a task amortizes its scheduling and reuses each
// panel slice across 96 input rows (96 x 256 floats of input = 96 KiB, in L2).
constexpr int64_t kRowBlock = 16 * kMicroRows;
// Depth per pass: a panel slice of 256 x 2 vectors is 32 KiB on AVX-512 and stays in L1d
// while the 16 micro-tiles of a task read it. The passes run in k order, so every output
// element still sees bias, k = 0, 1, ..., K-1.
constexpr int64_t kDepthBlock = 256;

// Tile (rows x 2 vectors) of output = start + input(rows, K) · panel(K, 2 vectors), where start
// is the output itself (accumulate: a later depth block) or else the bias (or zero).
//   input: (rows, K) with row stride input_stride; panel: (K, panel_width) contiguous;
//   bias_panel: (panel_width) or null; output: (rows, valid_columns), row stride output_stride.
template <int kRows>
void MicroKernel(const float* HWY_RESTRICT input, int64_t input_stride,
                 const float* HWY_RESTRICT panel, int64_t depth,
                 const float* HWY_RESTRICT bias_panel, bool accumulate, float* HWY_RESTRICT output,
                 int64_t output_stride, int64_t valid_columns) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d);
  const int64_t panel_width = static_cast<int64_t>(2 * lanes);
  using VF = hn::Vec<decltype(d)>;
  const VF start0 = bias_panel ? hn::Load(d, bias_panel) : hn::Zero(d);
  const VF start1 = bias_panel ? hn::Load(d, bias_panel + lanes) : hn::Zero(d);
  VF acc[kRows][2];  // row r, columns [0, lanes) and [lanes, 2·lanes) of the panel
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = start0;
    acc[r][1] = start1;
  }

  // A partial panel (the last one) goes through a staging buffer, in and out.
  HWY_ALIGN float staging[2 * HWY_MAX_BYTES / sizeof(float)] = {};
  if (accumulate) {
    for (int r = 0; r < kRows; ++r) {
      const float* out = output + r * output_stride;
      if (valid_columns == panel_width) {
        acc[r][0] = hn::LoadU(d, out);
        acc[r][1] = hn::LoadU(d, out + lanes);
      } else {
        std::memcpy(staging, out, static_cast<size_t>(valid_columns) * sizeof(float));
        acc[r][0] = hn::Load(d, staging);
        acc[r][1] = hn::Load(d, staging + lanes);
      }
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    const float* panel_row = panel + k * panel_width;
    const VF weight0 = hn::Load(d, panel_row);
    const VF weight1 = hn::Load(d, panel_row + lanes);
    for (int r = 0; r < kRows; ++r) {
      const VF a = hn::Set(d, input[r * input_stride + k]);
      acc[r][0] = hn::MulAdd(a, weight0, acc[r][0]);
      acc[r][1] = hn::MulAdd(a, weight1, acc[r][1]);
    }
  }

  for (int r = 0; r < kRows; ++r) {
    float* out = output + r * output_stride;
    if (valid_columns == panel_width) {
      hn::StoreU(acc[r][0], d, out);
      hn::StoreU(acc[r][1], d, out + lanes);
    } else {
      hn::Store(acc[r][0], d, staging);
      hn::Store(acc[r][1], d, staging + lanes);
      std::memcpy(out, staging, static_cast<size_t>(valid_columns) * sizeof(float));
    }
  }
}

// One micro-tile of the packed path: rows [row, row + rows) of panel `panel` (columns
// [first_column, first_column + valid_columns)), depth block [k0, k0 + depth).
struct Tile {
  int64_t panel, first_column, valid_columns, row, rows, k0, depth;
};

// Runs micro(tile) for every tile of panels `width` columns wide: (panel, row block) pairs in
// parallel, each whole on one thread, its depth blocks in k order (one pass even when K == 0,
// to write the bias), so every output element sees the same sequence at any thread count.
// depth_block: the depth of one pass (kDepthBlock unless the caller needs each tile whole).
template <class Micro>
void ForEachTile(const LinearParams& p, int threads, int64_t width, const Micro& micro,
                 int64_t depth_block = kDepthBlock) {
  const int64_t panels = (p.columns + width - 1) / width;
  const int64_t row_blocks = (p.rows + kRowBlock - 1) / kRowBlock;
  parallel_for(threads, panels * row_blocks, [&](int64_t task) {
    const int64_t panel = task / row_blocks, block = task % row_blocks;
    Tile t;
    t.panel = panel;
    t.first_column = panel * width;
    t.valid_columns = std::min(width, p.columns - t.first_column);
    const int64_t block_end = std::min(p.rows, (block + 1) * kRowBlock);
    for (t.k0 = 0; t.k0 == 0 || t.k0 < p.depth; t.k0 += depth_block) {
      t.depth = std::min(depth_block, p.depth - t.k0);
      for (t.row = block * kRowBlock; t.row < block_end; t.row += kMicroRows) {
        t.rows = std::min(kMicroRows, block_end - t.row);
        micro(t);
      }
    }
  });
}

// bfloat16 products (AVX-512 targets with AVX512_BF16, isa/avx512_bf16-inl.h): the input
// as rows of bfloat16 pairs (A), each panel of 32 columns as pairs across k (B),
// panel[k2][c] = (weight[c][2·k2], weight[c][2·k2 + 1]); an odd depth's last pair has a zero
// second half in both. A tile goes through an aligned staging copy of its output rows.
// A bfloat16 output (p.output_bf16) takes each tile's whole depth in one pass, so the float32
// sums never leave the staging copy before they are rounded: the same k order, the same bits
// as the float32 output rounded afterwards.
#undef ATTEND_GEMM_BF16
#if ATTEND_AVX512_BF16
#define ATTEND_GEMM_BF16 1
using Products = Avx512Bf16;

// to[i] = bf16_from_f32(from[i]) for i < n (half.hpp's rounding, written on the float bits:
// to nearest even, a NaN kept quiet); vcvtneps2bf16 is not used, as it flushes denormals.
void RoundRowToBf16(const float* HWY_RESTRICT from, uint16_t* HWY_RESTRICT to, int64_t n) {
  const hn::ScalableTag<uint32_t> du;
  const hn::Rebind<uint16_t, decltype(du)> dh;
  const auto lanes = static_cast<int64_t>(hn::Lanes(du));
  const auto magnitude = hn::Set(du, 0x7FFFFFFFu), infinity = hn::Set(du, 0x7F800000u);
  const auto half_ulp = hn::Set(du, 0x7FFFu), one = hn::Set(du, 1u), quiet = hn::Set(du, 0x40u);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto bits = hn::BitCast(du, hn::LoadU(hn::Rebind<float, decltype(du)>(), from + i));
    const auto rounded =
        hn::ShiftRight<16>(hn::Add(hn::Add(bits, half_ulp), hn::And(hn::ShiftRight<16>(bits), one)));
    const auto nan = hn::Gt(hn::And(bits, magnitude), infinity);
    const auto result = hn::IfThenElse(nan, hn::Or(hn::ShiftRight<16>(bits), quiet), rounded);
    // Every result fits in 16 bits, so the saturating demotion of int32 keeps it.
    hn::StoreU(hn::DemoteTo(dh, hn::BitCast(hn::Rebind<int32_t, decltype(du)>(), result)), dh,
               to + i);
  }
  for (; i < n; ++i) to[i] = bf16_from_f32(from[i]);
}

void LinearBf16(const LinearParams& p, int threads) {
  constexpr int64_t kWidth = 32;
  const int64_t panels = (p.columns + kWidth - 1) / kWidth;
  const int64_t pairs = std::max<int64_t>(PairsOf(p.depth), 1);
  auto packed = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(panels * pairs * kWidth));
  auto packed_bias = hwy::AllocateAligned<float>(static_cast<size_t>(panels * kWidth));
  auto input = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(p.rows * pairs));
  if (!packed || !packed_bias || !input) {
    throw Error("linear: cannot allocate " +
                std::to_string((panels * kWidth + p.rows) * pairs * 4) +
                " bytes to pack the operands");
  }
  parallel_for(threads, panels, [&](int64_t panel) {
    uint32_t* out = packed.get() + panel * pairs * kWidth;
    for (int64_t c = 0; c < kWidth; ++c) {
      const int64_t column = panel * kWidth + c;
      packed_bias[static_cast<size_t>(panel * kWidth + c)] =
          (column < p.columns && p.bias) ? p.bias[column] : 0.0f;
      const float* w = column < p.columns ? p.weight + column * p.weight_row_stride : nullptr;
      for (int64_t k2 = 0; k2 < pairs; ++k2) {
        const float lo = w && 2 * k2 < p.depth ? w[2 * k2] : 0.0f;
        const float hi = w && 2 * k2 + 1 < p.depth ? w[2 * k2 + 1] : 0.0f;
        out[k2 * kWidth + c] = PairOfFloats(lo, hi);
      }
    }
  });
  parallel_for(threads, p.rows, [&](int64_t m) {
    uint32_t* row = input.get() + m * pairs;
    HalfPairsAlongRow(p.input_bf16 + m * p.input_row_stride, p.depth, row, 1);
  });
  const bool bf16_output = p.output_bf16 != nullptr;
  ForEachTile(
      p, threads, kWidth,
      [&](const Tile& t) {
        HWY_ALIGN float staging[kMicroRows * kWidth] = {};
        for (int64_t r = 0; r < t.rows; ++r) {
          const float* start = t.k0 > 0 ? p.output + (t.row + r) * p.output_row_stride +
                                              t.first_column
                               : p.bias ? packed_bias.get() + t.panel * kWidth
                                        : nullptr;
          if (start) {
            std::memcpy(staging + r * kWidth, start, static_cast<size_t>(t.valid_columns) * 4);
          }
        }
        const PairsA a{input.get() + t.row * pairs + t.k0 / 2, pairs, 1};
        const PairsB b{packed.get() + t.panel * pairs * kWidth + t.k0 / 2 * kWidth, kWidth};
        Products::Product(t.rows, kWidth / 16, PairsOf(t.depth), a, b,
                          PairsC{staging, kWidth, PairStart::kAccumulate});
        for (int64_t r = 0; r < t.rows; ++r) {
          if (bf16_output) {
            RoundRowToBf16(staging + r * kWidth,
                           p.output_bf16 + (t.row + r) * p.output_row_stride + t.first_column,
                           t.valid_columns);
          } else {
            std::memcpy(p.output + (t.row + r) * p.output_row_stride + t.first_column,
                        staging + r * kWidth, static_cast<size_t>(t.valid_columns) * 4);
          }
        }
      },
      bf16_output ? std::max<int64_t>(p.depth, 1) : kDepthBlock);
}
#else
#define ATTEND_GEMM_BF16 0
#endif

using MicroKernelFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, bool,
                               float*, int64_t, int64_t);
constexpr MicroKernelFn kMicroKernels[kMicroRows + 1] = {
    nullptr,        MicroKernel<1>, MicroKernel<2>, MicroKernel<3>,
    MicroKernel<4>, MicroKernel<5>, MicroKernel<6>};

// Few rows (a phrase, a decoding step): packing the weight would cost more than the product,
// so each output is a dot product of an input row with a weight row, both read in place:
// blocks of 4 weight rows × R input rows (4·R accumulators, lanes along K, then one
// horizontal sum per output, four at a time where QuadSums exists), so each weight vector
// loaded serves R rows.
//   output[m][n] = bias[n] + Σ_k input[m][k]·weight[n][k]
template <int R>
HWY_INLINE void FewRowsBlock(const LinearParams& p, int64_t m0, int64_t n0) {
  const hn::ScalableTag<float> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t count = std::min<int64_t>(4, p.columns - n0);
  const float* w[4];
  for (int64_t c = 0; c < 4; ++c) {
    w[c] = p.weight + std::min(n0 + c, p.columns - 1) * p.weight_row_stride;
  }
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.input + (m0 + r) * p.input_row_stride;
  hn::Vec<decltype(d)> acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) acc[r][c] = hn::Zero(d);
  }
  int64_t k = 0;
  for (; k + lanes <= p.depth; k += lanes) {
    hn::Vec<decltype(d)> wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = hn::LoadU(d, w[c] + k);
    for (int r = 0; r < R; ++r) {
      const auto xv = hn::LoadU(d, x[r] + k);
      for (int c = 0; c < 4; ++c) acc[r][c] = hn::MulAdd(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sums[4];
#if ATTEND_QUAD_SUMS
    // The four sums reduced together (a quarter of the shuffles of four horizontal sums).
    HWY_ALIGN float quad[kLanes];
    hn::Store(QuadSums(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), d, quad);
    for (int c = 0; c < 4; ++c) sums[c] = quad[c];
#else
    for (int c = 0; c < 4; ++c) sums[c] = hn::GetLane(hn::SumOfLanes(d, acc[r][c]));
#endif
    for (int64_t kk = k; kk < p.depth; ++kk) {
      for (int c = 0; c < 4; ++c) sums[c] += x[r][kk] * w[c][kk];
    }
    float* out = p.output + (m0 + r) * p.output_row_stride + n0;
    for (int64_t c = 0; c < count; ++c) out[c] = sums[c] + (p.bias ? p.bias[n0 + c] : 0.0f);
  }
}

void FewRowsLinear(const LinearParams& p, int threads) {
  const int64_t column_groups = (p.columns + 3) / 4;
  parallel_for(threads, column_groups, [&](int64_t group) {
    int64_t m0 = 0;
    for (; m0 + 4 <= p.rows; m0 += 4) FewRowsBlock<4>(p, m0, group * 4);
    for (; m0 < p.rows; ++m0) FewRowsBlock<1>(p, m0, group * 4);
  });
}

// Rows up to which FewRowsLinear beats packing (the packed micro-kernel's 6-row block would
// be mostly empty).
constexpr int64_t kFewRows = 8;

void LinearImpl(const LinearParams& p) {
  if (p.rows == 0 || p.columns == 0) return;
  // Small products are not worth waking threads for (a few microseconds with idle cores,
  // milliseconds on a loaded machine); the result is the same either way. 2^21 multiply-adds
  // take about 10 us on one AVX-512 core.
  const double multiply_adds =
      static_cast<double>(p.rows) * static_cast<double>(p.columns) * static_cast<double>(p.depth);
  const int threads = threads_for_work(p.num_threads, multiply_adds);
  if (p.input_bf16 != nullptr) {  // linear() sends only what LinearBf16 takes
#if ATTEND_GEMM_BF16
    return LinearBf16(p, threads);
#else
    HWY_ABORT("bfloat16 products on a target without AVX512_BF16");
#endif
  }
  if (p.rows <= kFewRows) return FewRowsLinear(p, threads);

  const hn::ScalableTag<float> d;
  const int64_t panel_width = static_cast<int64_t>(2 * hn::Lanes(d));
  const int64_t panels = (p.columns + panel_width - 1) / panel_width;

  // 1. Pack weight (N, K) into panels (panels, K, W) and bias into (panels, W), zero padded.
  const size_t packed_size = static_cast<size_t>(panels * panel_width) *
                             static_cast<size_t>(std::max<int64_t>(p.depth, 1));
  auto packed = hwy::AllocateAligned<float>(packed_size);
  auto packed_bias = hwy::AllocateAligned<float>(static_cast<size_t>(panels * panel_width));
  if (!packed || !packed_bias) {
    throw Error("linear: cannot allocate " + std::to_string(packed_size * sizeof(float)) +
                " bytes to pack the weight");
  }
  parallel_for(threads, panels, [&](int64_t panel) {
    float* out = packed.get() + panel * p.depth * panel_width;
    for (int64_t c = 0; c < panel_width; ++c) {
      const int64_t column = panel * panel_width + c;
      packed_bias[static_cast<size_t>(panel * panel_width + c)] =
          (column < p.columns && p.bias) ? p.bias[column] : 0.0f;
      if (column >= p.columns) {
        for (int64_t k = 0; k < p.depth; ++k) out[k * panel_width + c] = 0.0f;
        continue;
      }
      const float* weight_row = p.weight + column * p.weight_row_stride;
      for (int64_t k = 0; k < p.depth; ++k) out[k * panel_width + c] = weight_row[k];
    }
  });

  // 2. Tiles (panel, row block), each computed whole by one thread.
  ForEachTile(p, threads, panel_width, [&](const Tile& t) {
    kMicroKernels[t.rows](p.input + t.row * p.input_row_stride + t.k0, p.input_row_stride,
                          packed.get() + t.panel * p.depth * panel_width + t.k0 * panel_width,
                          t.depth, p.bias ? packed_bias.get() + t.panel * panel_width : nullptr,
                          t.k0 > 0, p.output + t.row * p.output_row_stride + t.first_column,
                          p.output_row_stride, t.valid_columns);
  });
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "cpu_features.hpp"
#include "kernels/isa/amx_bf16.hpp"
#include "simd_dispatch.hpp"

namespace attend::detail {

HWY_EXPORT(LinearImpl);

namespace {

#if defined(__x86_64__)
// bfloat16 products on AMX tiles (LinearParams::amx_tiles): the input as rows of pairs (A:
// [M'][K2'], K2' the pairs rounded up to whole tiles of 16, M' the rows to 16, zero padded),
// the weight rounded to bfloat16 pairs across k in panels of 32 columns (B: [panel][K2'][32],
// panel[k2][c] = (weight[c][2·k2], weight[c][2·k2 + 1]), zero past N and K), each block of
// 32 rows × one panel started from the bias in an aligned staging block: every output element
// is bias, then the pairs k2 = 0, 1, … in order (tdpbf16ps), whatever the threads.
void LinearAmx(const LinearParams& p) {
  constexpr int64_t kWidth = 32, kRows = 32;
  const int64_t pairs = amx::RoundUp(std::max<int64_t>(PairsOf(p.depth), 1), amx::kTileRows);
  const int64_t panels = (p.columns + kWidth - 1) / kWidth;
  const int64_t row_blocks = (p.rows + kRows - 1) / kRows;
  const int64_t rows_pad = row_blocks * kRows;
  auto packed = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(panels * pairs * kWidth));
  auto input = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(rows_pad * pairs));
  if (!packed || !input) {
    throw Error("linear: cannot allocate " +
                std::to_string((panels * kWidth + rows_pad) * pairs * 4) +
                " bytes to pack the operands");
  }
  const double multiply_adds =
      static_cast<double>(p.rows) * static_cast<double>(p.columns) * static_cast<double>(p.depth);
  const int threads = threads_for_work(p.num_threads, multiply_adds);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t panel = 0; panel < panels; ++panel) {
      uint32_t* out = packed.get() + panel * pairs * kWidth;
      for (int64_t c = 0; c < kWidth; ++c) {
        const int64_t column = panel * kWidth + c;
        const float* w = column < p.columns ? p.weight + column * p.weight_row_stride : nullptr;
        for (int64_t k2 = 0; k2 < pairs; ++k2) {
          const float lo = w && 2 * k2 < p.depth ? w[2 * k2] : 0.0f;
          const float hi = w && 2 * k2 + 1 < p.depth ? w[2 * k2 + 1] : 0.0f;
          out[k2 * kWidth + c] = PairOfFloats(lo, hi);
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t m = 0; m < rows_pad; ++m) {
      uint32_t* row = input.get() + m * pairs;
      std::fill_n(row, pairs, 0u);
      if (m < p.rows) HalfPairsAlongRow(p.input_bf16 + m * p.input_row_stride, p.depth, row, 1);
    }
    const amx::TileScope tiles;
#pragma omp for schedule(static)
    for (int64_t block = 0; block < row_blocks * panels; ++block) {
      const int64_t m0 = block / panels * kRows, panel = block % panels;
      const int64_t n0 = panel * kWidth;
      const int64_t rows = std::min(kRows, p.rows - m0), cols = std::min(kWidth, p.columns - n0);
      alignas(64) float staging[kRows * kWidth];
      for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t c = 0; c < kWidth; ++c) {
          staging[r * kWidth + c] = p.bias && c < cols ? p.bias[n0 + c] : 0.0f;
        }
      }
      amx::GemmBf16(kRows, kWidth, pairs * 2,
                    reinterpret_cast<const uint16_t*>(input.get()) + m0 * pairs * 2, pairs * 2,
                    packed.get() + panel * pairs * kWidth, kWidth, staging, kWidth, true);
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(p.output + (m0 + r) * p.output_row_stride + n0, staging + r * kWidth,
                    static_cast<size_t>(cols) * sizeof(float));
      }
    }
  }
}
#endif

}  // namespace

void linear(const LinearParams& params) {
  // Rows up to which products stay float32 (see LinearParams::input_bf16): kFewRows.
  constexpr int64_t kFewBf16Rows = 8;
  const bool bf16_register_blocks =
      params.input_bf16 != nullptr && params.rows > kFewBf16Rows && params.bf16_products &&
      native_bf16_products() && !(params.amx_tiles && amx_bf16_products());
  if (params.output_bf16 != nullptr && !bf16_register_blocks) {
    // Only the AVX512_BF16 register blocks write bfloat16: elsewhere the float32 result,
    // rounded row by row as convert rounds.
    std::vector<float> result(static_cast<size_t>(params.rows * params.columns));
    LinearParams p = params;
    p.output_bf16 = nullptr;
    p.output = result.data();
    p.output_row_stride = params.columns;
    linear(p);
    for (int64_t m = 0; m < params.rows; ++m) {
      for (int64_t n = 0; n < params.columns; ++n) {
        params.output_bf16[m * params.output_row_stride + n] =
            bf16_from_f32(result[static_cast<size_t>(m * params.columns + n)]);
      }
    }
    return;
  }
#if defined(__x86_64__)
  if (params.input_bf16 != nullptr && params.amx_tiles && params.rows > kFewBf16Rows &&
      amx_bf16_products()) {
    return LinearAmx(params);
  }
#endif
  if (params.input_bf16 != nullptr &&
      (params.rows <= kFewBf16Rows || !params.bf16_products || !native_bf16_products())) {
    // Float32 products: the bfloat16 input widened (exactly).
    std::vector<float> widened(static_cast<size_t>(params.rows * params.depth));
    for (int64_t m = 0; m < params.rows; ++m) {
      for (int64_t k = 0; k < params.depth; ++k) {
        widened[static_cast<size_t>(m * params.depth + k)] =
            f32_from_bf16(params.input_bf16[m * params.input_row_stride + k]);
      }
    }
    LinearParams p = params;
    p.input_bf16 = nullptr;
    p.input = widened.data();
    p.input_row_stride = params.depth;
    return ATTEND_DISPATCH(LinearImpl)(p);
  }
  ATTEND_DISPATCH(LinearImpl)(params);
}

}  // namespace attend::detail
#endif  // HWY_ONCE
