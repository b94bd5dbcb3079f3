// attend_bench.cc: Google Benchmark suite of scaled_dot_product_attention, the fused kernel
// and the reference listing side by side in one run.
//
//   build-*/bench/attend_bench [--threads=N] [--benchmark_filter=REGEX] [benchmark flags]
//
// Names: <backend>/<case>/threads:<n> for the named cases of src/bench/cases.hpp, and
// <backend>/sweep_L|sweep_E/L:<L>/E:<E>/causal:<0|1>/threads:<n> for the sweeps (B 1, H 8,
// Lq = Lk = L). Counters: GFLOPS (attend::attention_flops / real time), pct_peak (of the
// FMA peak measured at start-up at the same thread count), GBps for decode (K and V read).
// The reference (float64, the listing literally) only gets the shapes it finishes in about
// a second; the whole default run stays within a few minutes on 2 cores.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "attend/sdpa.hpp"
#include "bench/cases.hpp"
#include "suite_common.hpp"

namespace attend::bench {
namespace {

// Tuned for 2 cores: enough iterations for a stable median, short enough for the suite.
constexpr double kMinSeconds = 0.2;
// The reference runs shapes up to this many score entries per call (B·H·Lq·Lk): s3's 8 Mi.
constexpr double kReferenceMaxScores = 8.0 * 1024 * 1024;

const char* backend_name(Backend backend) {
  return backend == Backend::kReference ? "reference" : "fused";
}

bool reference_can_run(const AttentionShape& shape) {
  return static_cast<double>(shape.batch * shape.heads) * static_cast<double>(shape.query_len) *
             static_cast<double>(shape.key_len) <=
         kReferenceMaxScores;
}

void register_problem(const std::string& name, const AttentionShape& shape, bool need_weights,
                      int threads, Backend backend, bool report_bandwidth) {
  benchmark::RegisterBenchmark(name.c_str(),
                               [=](benchmark::State& state) {
                                 CaseTensors tensors = make_case_tensors(shape, need_weights);
                                 for (auto _ : state)
                                   run_attention(tensors, shape, threads, backend);
                                 set_attention_counters(state, shape, threads, report_bandwidth);
                               })
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond)
      ->MinTime(kMinSeconds);
}

// Fused, then the reference where it is affordable, for one shape.
void register_side_by_side(const std::string& label, const AttentionShape& shape, bool need_weights,
                           int threads, bool report_bandwidth) {
  for (Backend backend : {Backend::kFused, Backend::kReference}) {
    if (backend == Backend::kReference && !reference_can_run(shape)) continue;
    register_problem(
        std::string(backend_name(backend)) + "/" + label + "/threads:" + std::to_string(threads),
        shape, need_weights, threads, backend, report_bandwidth);
  }
}

void register_all(int threads) {
  // 1. Named cases, at `threads` and on one thread.
  for (const BenchCase& c : bench_cases()) {
    if (c.workload != Workload::kAttention) {  // a whole module: module/<case>/threads:<n>
      const std::vector<int> thread_counts =
          c.single_thread ? std::vector<int>{1} : std::vector<int>{threads, 1};
      for (int n : thread_counts) {
        const std::string name = "module/" + c.name + "/threads:" + std::to_string(n);
        benchmark::RegisterBenchmark(name.c_str(),
                                     [&c, n](benchmark::State& state) {
                                       const auto call = make_module_workload(c, n);
                                       for (auto _ : state) call();
                                       set_attention_counters(state, c.shape, n, false, c.flops());
                                     })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond)
            ->MinTime(kMinSeconds);
      }
      continue;
    }
    const bool report_bandwidth = c.memory_bound();
    if (!c.single_thread) {
      register_side_by_side(c.name, c.shape, c.need_weights, threads, report_bandwidth);
    }
    register_side_by_side(c.name, c.shape, c.need_weights, 1, report_bandwidth);
  }
  // 2. Sweeps over L (E 64) and E (L 1024), causal and not.
  for_each_sweep_point(sweep_lengths().back(),
                       [&](const std::string& label, const AttentionShape& shape) {
                         register_side_by_side(label, shape, false, threads, false);
                       });
}

}  // namespace
}  // namespace attend::bench

int main(int argc, char** argv) {
  return attend::bench::run_suite(argc, argv, attend::bench::register_all);
}
