// read_bandwidth.cc: memory read bandwidth probe in one Highway source compiled for every
// target.
//
// One thread reads its part of the buffer, count floats, once: the part is cut into
// kStreams equal slices read side by side (vector i of every slice, then vector i + 1), each
// into its own accumulator, acc[s] += Load(slice s, vector i). kStreams plays the part of
// the FMA peak's 12 chains, for memory: one ascending stream per core leaves the core's
// memory parallelism unused (the hardware prefetcher runs only so far ahead of one stream),
// while several streams keep more cache-line misses in flight. On the development host
// (2 threads, 512 MiB) 1, 2, 4, 8, 16 and 32 streams per thread read about 19, 23, 28, 30,
// 30 and 29 GB/s; on 1 thread 9, 12, 15, 16, 16 and 15. The adds are independent, so add
// latency never holds the loads up (8 accumulators cover 4-cycle latency on 2 ports).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/read_bandwidth.cc"
#include "bench/read_bandwidth.hpp"

#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>

#include "attend/error.hpp"
#include "attend/tensor.hpp"
#include "simd_dispatch.hpp"

// Defined once, outside the per-target namespaces: every target returns the same type.
#ifndef ATTEND_BENCH_READ_BANDWIDTH_SUM_RESULT
#define ATTEND_BENCH_READ_BANDWIDTH_SUM_RESULT
namespace attend::bench {
struct SumResult {
  float sum;  // of every float read, so that no load can be optimized away
  const char* target;
};
}  // namespace attend::bench
#endif

HWY_BEFORE_NAMESPACE();
namespace attend::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int kStreams = 8;

// Σ values[0 .. count): the first kStreams · slice floats as kStreams slices side by side,
// then the rest in order. slice is a multiple of 1024 floats (4 KiB), 0 for small parts.
SumResult SumFloats(const float* HWY_RESTRICT values, int64_t count) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t slice = count / kStreams / 1024 * 1024;
  const float* HWY_RESTRICT starts[kStreams];
  V acc[kStreams];
  for (int s = 0; s < kStreams; ++s) {
    starts[s] = values + s * slice;
    acc[s] = hn::Zero(d);
  }
  for (int64_t i = 0; i < slice; i += lanes) {
    for (int s = 0; s < kStreams; ++s) acc[s] = hn::Add(acc[s], hn::LoadU(d, starts[s] + i));
  }
  int64_t i = kStreams * slice;
  for (; i + lanes <= count; i += lanes) acc[0] = hn::Add(acc[0], hn::LoadU(d, values + i));
  V sum = acc[0];
  for (int s = 1; s < kStreams; ++s) sum = hn::Add(sum, acc[s]);
  float total = hn::GetLane(hn::SumOfLanes(d, sum));
  for (; i < count; ++i) total += values[i];
  return {total, hwy::TargetName(HWY_TARGET)};
}

}  // namespace HWY_NAMESPACE
}  // namespace attend::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attend::bench {

HWY_EXPORT(SumFloats);

namespace {

volatile float g_sum_sink = 0;

// Each thread's part starts on a 4 KiB boundary (1024 floats): no two threads share a page or
// a cache line.
constexpr int64_t kPartGranule = 1024;

struct Part {
  int64_t begin = 0;
  int64_t count = 0;
};

// Thread t's part of `count` floats split over `num_threads` threads.
Part part_of(int64_t count, int num_threads, int t) {
  int64_t chunk = (count + num_threads - 1) / num_threads;
  chunk = (chunk + kPartGranule - 1) / kPartGranule * kPartGranule;
  const int64_t begin = std::min(count, t * chunk);
  return {begin, std::min(count, begin + chunk) - begin};
}

struct Trial {
  double wall_seconds = 0;
  const char* target = "";
};

// `passes` passes over the buffer on every thread, timed from before the parallel region
// until its last thread is done (wall time: see read_bandwidth.hpp). The call goes through
// the dispatch table, which the compiler cannot see through: it cannot merge the passes into
// one (as it may for a pure function called with the same arguments).
Trial run_trial(const float* values, int64_t count, int num_threads, int64_t passes) {
  Trial trial;
  float sum = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(num_threads) reduction(+ : sum)
  {
    const int thread = omp_get_thread_num();
    const Part part = part_of(count, num_threads, thread);
    for (int64_t pass = 0; pass < passes; ++pass) {
      const SumResult result = ATTEND_DISPATCH(SumFloats)(values + part.begin, part.count);
      sum += result.sum;
#pragma omp master
      trial.target = result.target;
    }
  }
  trial.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  g_sum_sink = sum;
  return trial;
}

// The probe's buffer of `count` floats, kept from one call to the next (one per process,
// reallocated only when `count` changes): a bench measures the probe before and after each
// memory-bound case, and faulting in a fresh 512 MiB each time (about 0.3 s, and the kernel's
// page zeroing beside the next case) disturbed the small cases run after it. A new buffer is
// faulted in by the threads that read it (each writes its own part) with floats whose sum
// stays finite: 1, 2, 3, 4, 1, 2, ... Not thread-safe: the bench calls the probe from one
// thread.
float* probe_buffer(int64_t count, int num_threads) {
  static Tensor buffer;
  if (buffer.data() == nullptr || buffer.numel() != count) {
    buffer = Tensor();  // the old buffer freed before the new one is allocated
    buffer = Tensor(DType::kFloat32, Shape{count});
    float* values = buffer.data_as<float>();
#pragma omp parallel num_threads(num_threads)
    {
      const Part part = part_of(count, num_threads, omp_get_thread_num());
      for (int64_t i = part.begin; i < part.begin + part.count; ++i) {
        values[i] = static_cast<float>(1 + (i & 3));
      }
    }
  }
  return buffer.data_as<float>();
}

}  // namespace

ReadBandwidth measure_read_bandwidth(int num_threads, int64_t bytes, double min_seconds) {
  if (num_threads < 1) {
    throw Error("read bandwidth probe: num_threads must be >= 1, got " +
                std::to_string(num_threads));
  }
  if (bytes <= 0) {
    throw Error("read bandwidth probe: bytes must be > 0, got " + std::to_string(bytes));
  }
  if (!(min_seconds > 0)) {
    throw Error("read bandwidth probe: min_seconds must be > 0, got " +
                std::to_string(min_seconds));
  }
  (void)detail::dispatch_targets();  // a bad ATTEND_MAX_SIMD throws here, not in a thread

  const int64_t count = (bytes + int64_t{sizeof(float)} - 1) / int64_t{sizeof(float)};
  float* values = probe_buffer(count, num_threads);
  // Calibrate: one untimed pass, one timed pass, then as many passes as fill min_seconds.
  (void)run_trial(values, count, num_threads, 1);
  const Trial one_pass = run_trial(values, count, num_threads, 1);
  const double wanted_passes = std::ceil(min_seconds / std::max(one_pass.wall_seconds, 1e-9));
  const auto passes = static_cast<int64_t>(std::clamp(wanted_passes, 1.0, 1e12));

  ReadBandwidth best;
  best.threads = num_threads;
  best.bytes = count * int64_t{sizeof(float)};
  best.target = one_pass.target;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const Trial trial = run_trial(values, count, num_threads, passes);
    const double gbps = static_cast<double>(best.bytes) * static_cast<double>(passes) /
                        std::max(trial.wall_seconds, 1e-9) / 1e9;
    best.gbps = std::max(best.gbps, gbps);
  }
  return best;
}

}  // namespace attend::bench
#endif  // HWY_ONCE
