// kernel_common-inl.h: what the forward and backward attention kernels (and the projection
// GEMM) share, compiled once per Highway target (include it after foreach_target.h, as
// Highway's -inl.h headers): 2^x, kLog2e, four horizontal sums at once, the FTZ/DAZ guard
// and the parallel loop over work items.
#if defined(ATTEND_KERNELS_KERNEL_COMMON_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTEND_KERNELS_KERNEL_COMMON_INL_H_
#undef ATTEND_KERNELS_KERNEL_COMMON_INL_H_
#else
#define ATTEND_KERNELS_KERNEL_COMMON_INL_H_
#endif

#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>

#include "attend/error.hpp"
#include "sdpa_params.hpp"
#include "work_size.hpp"

#if HWY_ARCH_X86
#include <xmmintrin.h>  // MXCSR: flush-to-zero and denormals-are-zero
#endif

HWY_BEFORE_NAMESPACE();
namespace attend::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
constexpr int64_t kLanes = static_cast<int64_t>(hn::MaxLanes(DF()));

constexpr float kLog2e = 1.4426950408889634f;

// x86 targets, whose vectors are whole 128-bit blocks (SSSE3/SSE4: 1, AVX2: 2, AVX3: 4).
#undef ATTEND_QUAD_SUMS
#if HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR
#define ATTEND_QUAD_SUMS 1
// [Σ acc0, Σ acc1, Σ acc2, Σ acc3] in lanes 0..3 of every 128-bit block: the accumulators
// are transposed and added in registers (two interleave levels within blocks, then a sum
// across blocks) instead of four horizontal sums that each end in a scalar. Each result
// lane adds one accumulator's lanes only, in an order independent of the other three.
HWY_INLINE VF QuadSums(VF acc0, VF acc1, VF acc2, VF acc3) {
  const DF d;
  // Per block: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d.
  const VF ab = hn::Add(hn::InterleaveLower(d, acc0, acc1), hn::InterleaveUpper(d, acc0, acc1));
  const VF cd = hn::Add(hn::InterleaveLower(d, acc2, acc3), hn::InterleaveUpper(d, acc2, acc3));
  // Per block: [Σa, Σb, Σc, Σd] of the block's lanes.
  const hn::Repartition<double, DF> d64;
  const auto ab64 = hn::BitCast(d64, ab), cd64 = hn::BitCast(d64, cd);
  VF quad = hn::Add(hn::BitCast(d, hn::InterleaveLower(d64, ab64, cd64)),
                    hn::BitCast(d, hn::InterleaveUpper(d64, ab64, cd64)));
#if HWY_TARGET <= HWY_AVX3
  quad = hn::Add(quad, VF{_mm512_shuffle_f32x4(quad.raw, quad.raw, _MM_SHUFFLE(1, 0, 3, 2))});
  quad = hn::Add(quad, VF{_mm512_shuffle_f32x4(quad.raw, quad.raw, _MM_SHUFFLE(2, 3, 0, 1))});
#elif HWY_TARGET == HWY_AVX2
  quad = hn::Add(quad, VF{_mm256_permute2f128_ps(quad.raw, quad.raw, 1)});
#endif
  return quad;
}
#else
#define ATTEND_QUAD_SUMS 0
#endif

// 2^f for |f| <= 1/2: 1 + f·(c1 + c2·f + ... + c5·f^4), fitted for least relative error on
// Chebyshev nodes (float32 coefficients). Evaluated in float32 its relative error is below
// 1.8e-7 (3 ulps), less than the degree-6 Taylor polynomial's, with one FMA less; 2^0 is
// exactly 1.
// (Any float vector width: the short-key kernel runs 256-bit vectors on AVX-512.)
template <class D>
HWY_INLINE hn::Vec<D> Exp2Fraction(D d, hn::Vec<D> f) {
  hn::Vec<D> poly = hn::Set(d, 1.3268215116113424e-3f);
  poly = hn::MulAdd(poly, f, hn::Set(d, 9.671511128544807e-3f));
  poly = hn::MulAdd(poly, f, hn::Set(d, 5.550721660256386e-2f));
  poly = hn::MulAdd(poly, f, hn::Set(d, 0.24022242426872253f));
  poly = hn::MulAdd(poly, f, hn::Set(d, 0.6931470036506653f));
  return hn::MulAdd(poly, f, hn::Set(d, 1.0f));
}

// 2^x for x <= 0 (NaN propagates): x = n + f with n = round(x), 2^x = 2^f · 2^n. Results
// below 2^-126 are flushed to 0 (such weights are < 1e-38 of the row's largest), which also
// keeps the kernel free of denormal slow paths; -1e9 (excluded) gives exactly 0.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// AVX-512: vreduceps gives f = x − round(x) in one instruction and vscalefps multiplies by
// 2^n with the exponent range handled in hardware: below 2^-126 the kernel threads' FTZ
// flushes the result to 0. No clamp is needed: vreduceps gives f = 0 for ±inf, so -inf
// gives scalef(1, -inf) = 0, and NaN propagates through both.
HWY_INLINE VF Exp2(DF d, VF x) {
  const VF f{_mm512_reduce_ps(x.raw, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  return VF{_mm512_scalef_ps(Exp2Fraction(d, f).raw, hn::Sub(x, f).raw)};
}
#else
// Portable: adding 1.5·2^23 rounds x to an integer n held in the low mantissa bits; with
// 127 added as well, shifting those bits into the exponent field builds 2^n.
HWY_INLINE VF Exp2(DF d, VF x) {
  const hn::RebindToSigned<DF> di;
  const VF magic = hn::Set(d, 12582912.0f + 127.0f);
  const VF clamped = hn::Max(x, hn::Set(d, -127.0f));  // keeps n + 127 >= 0
  const VF shifted = hn::Add(clamped, magic);
  const VF f = hn::Sub(clamped, hn::Sub(shifted, magic));
  const VF two_to_n = hn::BitCast(d, hn::ShiftLeft<23>(hn::BitCast(di, shifted)));
  const VF result = hn::Mul(Exp2Fraction(d, f), two_to_n);
  // NaN compares false and survives: Max above may have replaced it, so restore it.
  return hn::IfThenElse(hn::Eq(x, x), hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, -126.0f)), result),
                        x);
}
#endif

// Sets flush-to-zero and denormals-are-zero for this thread while alive (x86): denormal
// inputs or products would otherwise take microcode assists, over 100 cycles each. Results
// change only below 1.2e-38.
class DenormalsAreZero {
 public:
#if HWY_ARCH_X86
  DenormalsAreZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~DenormalsAreZero() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#else
  // Nothing to set or restore; user-provided, so that a guard is not an unused variable.
  ~DenormalsAreZero() {}
#endif
};

// Runs body(workspace, item) for items [0, items) on up to p.num_threads threads, each with
// its own Workspace_(p) (null buffers when out of memory: ok() false), under FTZ/DAZ; inline
// when one thread suffices for `multiply_adds` (work_size.hpp: the one rule of attend's
// parallel regions). Each item is computed by one thread with the same instruction sequence
// whatever the thread count, so results are bitwise independent of it.
inline int ParallelThreads(const SdpaParams& p, double multiply_adds, int64_t items) {
  return threads_for_work(p.num_threads, multiply_adds, items);
}

template <class Workspace_, class Body>
void ParallelItems(const SdpaParams& p, double multiply_adds, int64_t items, const Body& body) {
  const int threads = ParallelThreads(p, multiply_adds, items);
  if (threads <= 1) {
    DenormalsAreZero denormals_are_zero;
    Workspace_ ws(p);
    if (!ws.ok()) throw Error("fused attention: out of memory for the work buffers");
    for (int64_t item = 0; item < items; ++item) body(ws, item);
    return;
  }
  bool allocation_failed = false;
#pragma omp parallel num_threads(threads)
  {
    DenormalsAreZero denormals_are_zero;
    Workspace_ ws(p);
    if (!ws.ok()) {
#pragma omp atomic write
      allocation_failed = true;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      if (ws.ok()) body(ws, item);
    }
  }
  if (allocation_failed) throw Error("fused attention: out of memory for the work buffers");
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTEND_KERNELS_KERNEL_COMMON_INL_H_
