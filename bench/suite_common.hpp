// suite_common.hpp: what the Google Benchmark suites share: the thread count, the FMA peak
// measured once at start-up, the shapes of the sweeps, and the counters every benchmark
// reports (GFLOPS and pct_peak from attend::attention_flops).
#pragma once

#include <benchmark/benchmark.h>

#include <functional>
#include <string>
#include <vector>

#include "bench/cases.hpp"

namespace attend::bench {

// Removes `--threads=N` from argv (default 2) and returns N; throws attend::Error for a
// value that is not an integer >= 1.
int take_threads_flag(int* argc, char** argv);

// Measures the FMA peak at 1 and `threads` threads (printed to stderr and recorded in the
// benchmark context); call once before benchmark::RunSpecifiedBenchmarks.
void measure_suite_peaks(int threads);

// The peak measured by measure_suite_peaks at this thread count, in GFLOP/s.
double suite_peak_gflops(int threads);

// GFLOPS (attention_flops, or `flops` when positive, / real time) and pct_peak (of the FMA
// peak at `threads`) on `state`; GBps of K and V read too when `report_bandwidth`.
void set_attention_counters(benchmark::State& state, const AttentionShape& shape, int threads,
                            bool report_bandwidth, double flops = 0);

// A shape of the L and E sweeps: B = 1, H = 8, Lq = Lk = length, E = head_dim.
AttentionShape sweep_shape(int64_t length, int64_t head_dim, bool causal);
// 128, 256, ..., 16384.
std::vector<int64_t> sweep_lengths();
// 32, 64, 80, 96, 128, 256.
std::vector<int64_t> sweep_head_dims();
// The length of the E sweep and the head dim of the L sweep.
inline constexpr int64_t kSweepFixedLength = 1024;
inline constexpr int64_t kSweepFixedHeadDim = 64;

// "L:1024/E:64/causal:1"
std::string describe_sweep_point(const AttentionShape& shape);

// Calls visit("sweep_L/L:.../E:64/causal:c" or "sweep_E/...", shape) for every point of the
// L sweep up to max_length and of the E sweep, causal and not.
void for_each_sweep_point(
    int64_t max_length,
    const std::function<void(const std::string& label, const AttentionShape& shape)>& visit);

// main() of a suite: --threads=N, Google Benchmark's flags, the FMA peaks, then
// register_all(threads) and the run. Errors: "error: ..." and status 2.
int run_suite(int argc, char** argv, void (*register_all)(int threads));

}  // namespace attend::bench
