// fma_peak.hpp: the machine's measured FMA throughput, the denominator of every "% of peak".
#pragma once

#include <string>

namespace attend::bench {

struct FmaPeak {
  double gflops = 0;   // 2·lanes·FMAs per second over all threads, in 10⁹/s
  std::string target;  // the SIMD target the probe dispatched to, e.g. "AVX3"
  int lanes = 0;       // float lanes per vector on that target
  int threads = 0;
};

// Runs independent float MulAdd chains (12 accumulators per thread, more than latency ×
// ports on current x86 cores) on `num_threads` OpenMP threads, through the same Highway
// dispatch as the kernels (so ATTEND_MAX_SIMD caps it too). Each thread's FMAs are divided
// by its own CPU time, so a busy shared machine does not lower the peak. Each trial lasts
// about `min_seconds`; the best of three trials is returned. Throws attend::Error when
// num_threads < 1 or min_seconds is not positive.
FmaPeak measure_fma_peak(int num_threads, double min_seconds = 0.1);

// The same for bfloat16 dot products (vdpbf16ps, 4 FLOPs per float32 lane) where attention
// runs them (attend::bf16_compute_path()); gflops 0 and target "none" elsewhere.
FmaPeak measure_bf16_peak(int num_threads, double min_seconds = 0.1);

// The same for AMX-BF16 tiles (tdpbf16ps on four independent accumulator tiles, 16·16·32
// multiply-adds each) where attention runs them; gflops 0 and target "none" elsewhere.
FmaPeak measure_amx_peak(int num_threads, double min_seconds = 0.1);

}  // namespace attend::bench
