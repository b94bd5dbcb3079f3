// suite_common.cc: see suite_common.hpp.
#include "suite_common.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include "attend/error.hpp"
#include "bench/fma_peak.hpp"

namespace attend::bench {
namespace {

std::map<int, double>& peaks_by_threads() {
  static std::map<int, double> peaks;
  return peaks;
}

}  // namespace

int take_threads_flag(int* argc, char** argv) {
  constexpr const char* kPrefix = "--threads=";
  const size_t prefix_length = std::strlen(kPrefix);
  int threads = 2;
  int kept = 1;
  for (int i = 1; i < *argc; ++i) {
    if (std::strncmp(argv[i], kPrefix, prefix_length) != 0) {
      argv[kept++] = argv[i];
      continue;
    }
    const char* text = argv[i] + prefix_length;
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    if (*text == '\0' || *end != '\0' || value < 1 || value > (1 << 16)) {
      throw Error(std::string("--threads: '") + text + "' is not an integer in [1, 65536]");
    }
    threads = static_cast<int>(value);
  }
  *argc = kept;
  return threads;
}

void measure_suite_peaks(int threads) {
  for (int count : {1, threads}) {
    if (peaks_by_threads().count(count) > 0) continue;
    const FmaPeak peak = measure_fma_peak(count, 0.2);
    peaks_by_threads()[count] = peak.gflops;
    std::fprintf(stderr, "FMA peak: %.0f GFLOP/s (%s, %d thread%s)\n", peak.gflops,
                 peak.target.c_str(), count, count == 1 ? "" : "s");
    char value[64];
    std::snprintf(value, sizeof(value), "%.1f GFLOP/s (%s)", peak.gflops, peak.target.c_str());
    benchmark::AddCustomContext("fma_peak_threads_" + std::to_string(count), value);
  }
}

double suite_peak_gflops(int threads) {
  const auto found = peaks_by_threads().find(threads);
  if (found == peaks_by_threads().end()) {
    throw Error("no FMA peak measured for " + std::to_string(threads) + " threads");
  }
  return found->second;
}

void set_attention_counters(benchmark::State& state, const AttentionShape& shape, int threads,
                            bool report_bandwidth, double flops) {
  using benchmark::Counter;
  const double gigaflops = (flops > 0 ? flops : shape.flops()) / 1e9;
  state.counters["GFLOPS"] = Counter(gigaflops, Counter::kIsIterationInvariantRate);
  state.counters["pct_peak"] =
      Counter(100.0 * gigaflops / suite_peak_gflops(threads), Counter::kIsIterationInvariantRate);
  if (report_bandwidth) {
    state.counters["GBps"] =
        Counter(shape.key_value_bytes() / 1e9, Counter::kIsIterationInvariantRate);
  }
}

AttentionShape sweep_shape(int64_t length, int64_t head_dim, bool causal) {
  return {1, 8, length, length, head_dim, causal};
}

std::vector<int64_t> sweep_lengths() {
  std::vector<int64_t> lengths;
  for (int64_t length = 128; length <= 16384; length *= 2) lengths.push_back(length);
  return lengths;
}

std::vector<int64_t> sweep_head_dims() { return {32, 64, 80, 96, 128, 256}; }

std::string describe_sweep_point(const AttentionShape& shape) {
  return "L:" + std::to_string(shape.query_len) + "/E:" + std::to_string(shape.head_dim) +
         "/causal:" + (shape.causal ? "1" : "0");
}

void for_each_sweep_point(
    int64_t max_length,
    const std::function<void(const std::string& label, const AttentionShape& shape)>& visit) {
  for (bool causal : {false, true}) {
    for (int64_t length : sweep_lengths()) {
      if (length > max_length) continue;
      const AttentionShape shape = sweep_shape(length, kSweepFixedHeadDim, causal);
      visit("sweep_L/" + describe_sweep_point(shape), shape);
    }
  }
  for (bool causal : {false, true}) {
    for (int64_t head_dim : sweep_head_dims()) {
      const AttentionShape shape = sweep_shape(kSweepFixedLength, head_dim, causal);
      visit("sweep_E/" + describe_sweep_point(shape), shape);
    }
  }
}

int run_suite(int argc, char** argv, void (*register_all)(int threads)) {
  try {
    const int threads = take_threads_flag(&argc, argv);
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
    measure_suite_peaks(threads);
    register_all(threads);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}

}  // namespace attend::bench
