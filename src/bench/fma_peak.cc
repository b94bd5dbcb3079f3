// fma_peak.cc: FMA throughput probe in one Highway source compiled for every target.
//
// One thread: kChains accumulator vectors, each updated acc = acc·m + a once per round.
// The chains are independent, so the core can keep (FMA latency × FMA ports) of them in
// flight; 12 covers 4-cycle latency on 2 ports (Zen 4/5, Intel server cores) with room to
// spare while leaving registers free even on 16-register targets. m < 1 keeps the values
// bounded (they converge to a / (1 − m)) and away from denormals.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/fma_peak.cc"
#include "bench/fma_peak.hpp"

#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "cpu_features.hpp"
#include "kernels/isa/amx_bf16.hpp"
#include "simd_dispatch.hpp"

// Defined once, outside the per-target namespaces: every target returns the same type.
#ifndef ATTEND_BENCH_FMA_PEAK_CHAIN_RESULT
#define ATTEND_BENCH_FMA_PEAK_CHAIN_RESULT
namespace attend::bench {
struct ChainResult {
  float checksum;  // depends on every accumulator, so no chain can be optimized away
  double flops;    // rounds × chains × (2 per FMA, 4 per bfloat16 dot product) × lanes
  int lanes;
  const char* target;
};
}  // namespace attend::bench
#endif

HWY_BEFORE_NAMESPACE();
namespace attend::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int kChains = 12;

// rounds × kChains vector FMAs on the calling thread.
ChainResult RunFmaChains(int64_t rounds) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  const V multiplier = hn::Set(d, 0.999999f);
  const V addend = hn::Set(d, 1e-6f);
  V acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = hn::Set(d, static_cast<float>(c));
  for (int64_t r = 0; r < rounds; ++r) {
    for (int c = 0; c < kChains; ++c) acc[c] = hn::MulAdd(acc[c], multiplier, addend);
  }
  V sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = hn::Add(sum, acc[c]);
  return {hn::GetLane(hn::SumOfLanes(d, sum)),
          2.0 * static_cast<double>(rounds) * kChains * static_cast<double>(hn::Lanes(d)),
          static_cast<int>(hn::Lanes(d)), hwy::TargetName(HWY_TARGET)};
}

// The same with vdpbf16ps (AVX512_BF16: two multiply-adds per float32 lane), on the AVX-512
// targets; elsewhere no work (flops 0). Called only where the CPU has the instruction.
#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
__attribute__((noinline, target("avx512bf16"))) ChainResult RunBf16Chains(int64_t rounds) {
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3F803F80));  // (1, 1)
  const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x33803380));  // 2^-24
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  for (int64_t r = 0; r < rounds; ++r) {
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  return {_mm512_reduce_add_ps(sum), 4.0 * static_cast<double>(rounds) * kChains * 16, 16,
          hwy::TargetName(HWY_TARGET)};
}
#else
ChainResult RunBf16Chains(int64_t) { return {0, 0, 0, hwy::TargetName(HWY_TARGET)}; }
#endif

}  // namespace HWY_NAMESPACE
}  // namespace attend::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attend::bench {

HWY_EXPORT(RunFmaChains);
HWY_EXPORT(RunBf16Chains);

namespace {

enum class Probe { kFma, kBf16, kAmx };

ChainResult run_chains(Probe probe, int64_t rounds) {
  switch (probe) {
    case Probe::kFma:
      return ATTEND_DISPATCH(RunFmaChains)(rounds);
    case Probe::kBf16:
      return ATTEND_DISPATCH(RunBf16Chains)(rounds);
    case Probe::kAmx:
      break;
  }
#if defined(__x86_64__)
  ChainResult result{0, 0, 16, "AMX"};
  result.flops = detail::amx::RunPeakChains(rounds, &result.checksum);
  return result;
#else
  return {0, 0, 0, "none"};
#endif
}

volatile float g_checksum_sink = 0;

struct Trial {
  double gflops = 0;        // Σ over threads of 2·lanes·FMAs / that thread's CPU time
  double wall_seconds = 0;  // of the whole parallel region
  int lanes = 0;
  const char* target = "";
};

double thread_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// Every thread runs `rounds` rounds and divides its FMAs by its own CPU time, so that other
// processes on a shared machine, which take CPU time but not FMA units, do not lower the
// figure; on a quiet machine it equals FMAs / wall time.
Trial run_trial(int num_threads, int64_t rounds, Probe probe) {
  Trial trial;
  float checksum = 0;
  double gflops = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(num_threads) reduction(+ : checksum, gflops)
  {
    const double cpu_start = thread_cpu_seconds();
    const ChainResult result = run_chains(probe, rounds);
    const double cpu_seconds = std::max(thread_cpu_seconds() - cpu_start, 1e-9);
    checksum += result.checksum;
    gflops += result.flops / cpu_seconds / 1e9;
#pragma omp master
    {
      trial.lanes = result.lanes;
      trial.target = result.target;
    }
  }
  trial.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  trial.gflops = gflops;
  g_checksum_sink = checksum;
  return trial;
}

FmaPeak measure_peak(int num_threads, double min_seconds, Probe probe) {
  if (num_threads < 1) {
    throw Error("FMA peak probe: num_threads must be >= 1, got " + std::to_string(num_threads));
  }
  if (!(min_seconds > 0)) {
    throw Error("FMA peak probe: min_seconds must be > 0, got " + std::to_string(min_seconds));
  }
  (void)detail::dispatch_targets();  // a bad ATTEND_MAX_SIMD throws here, not in a thread

  // Calibrate: double the rounds until one trial lasts a quarter of the wanted time.
  int64_t rounds = int64_t{1} << 14;
  Trial trial = run_trial(num_threads, rounds, probe);
  while (trial.wall_seconds < min_seconds / 4 && rounds < (int64_t{1} << 40)) {
    rounds *= 2;
    trial = run_trial(num_threads, rounds, probe);
  }
  rounds = static_cast<int64_t>(static_cast<double>(rounds) * min_seconds /
                                std::max(trial.wall_seconds, 1e-9));
  rounds = std::max<int64_t>(rounds, 1);

  FmaPeak peak;
  peak.threads = num_threads;
  for (int attempt = 0; attempt < 3; ++attempt) {
    trial = run_trial(num_threads, rounds, probe);
    peak.gflops = std::max(peak.gflops, trial.gflops);
    peak.lanes = trial.lanes;
    peak.target = trial.target;
  }
  return peak;
}

}  // namespace

FmaPeak measure_fma_peak(int num_threads, double min_seconds) {
  return measure_peak(num_threads, min_seconds, Probe::kFma);
}

FmaPeak measure_bf16_peak(int num_threads, double min_seconds) {
  if (bf16_compute_path().rfind("bfloat16", 0) != 0) {
    FmaPeak none;
    none.threads = num_threads;
    none.target = "none";
    return none;
  }
  return measure_peak(num_threads, min_seconds, Probe::kBf16);
}

FmaPeak measure_amx_peak(int num_threads, double min_seconds) {
  if (!detail::amx_bf16_products()) {
    FmaPeak none;
    none.threads = num_threads;
    none.target = "none";
    return none;
  }
  return measure_peak(num_threads, min_seconds, Probe::kAmx);
}

}  // namespace attend::bench
#endif  // HWY_ONCE
