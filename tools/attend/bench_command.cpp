// bench_command.cpp: `attend bench [--json] [--threads T] [--case NAME]... [--repetitions R]
// [--min-time S]`.
//
// Measures the FMA peak first (src/bench/fma_peak.hpp), then runs each case of the table
// (src/bench/cases.hpp): one warm-up call, R repetitions each repeating the call for at least
// S seconds, the median time per call. FLOPs come from attend::attention_flops only. The
// memory-bound cases (decoding, Lq = 1) are also compared with the read bandwidth probe
// (src/bench/read_bandwidth.hpp), measured just before and just after each of them. Throughput targets are shares of
// the peak or the bandwidth measured in the same run, so a case is judged against this
// machine, not the one the targets were first set on. Progress goes to stderr; the table
// (or one JSON object per case and line, with --json) to stdout.
#include "bench_command.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "bench/cases.hpp"
#include "bench/fma_peak.hpp"
#include "bench/measure.hpp"
#include "bench/read_bandwidth.hpp"
#include "quote.hpp"
#ifdef ATTEND_HAVE_MPI
#include "ring_bench.hpp"
#endif

namespace attend::cli {
namespace {

using bench::BenchCase;
using bench::TargetKind;

constexpr uint64_t kMaxRepetitions = 1000;
constexpr double kMaxMinTime = 3600;

struct BenchArguments {
  bool json = false;
  bool ring = false;  // attend bench --ring (ring_bench.hpp)
  std::string ring_shape = "1,8,16384,64";
  std::string ring_causal = "both";
  bool ring_no_baseline = false;
  std::string threads_text;
  std::vector<std::string> case_names;
  std::string repetitions_text = "5";
  std::string min_time_text = "0.2";
};

struct BenchSettings {
  bool json = false;
  int threads = 1;
  int repetitions = 5;
  double min_seconds = 0.2;
  std::vector<const BenchCase*> cases;
};

// What one case measured.
struct CaseResult {
  const BenchCase* bench_case = nullptr;
  int threads = 1;
  bench::RepeatedTiming timing;
  double gflops = 0;
  double peak_gflops = 0;
  double pct_peak = 0;
  double gbps = 0;           // decode: K/V bytes read per second
  double read_gbps = 0;      // decode: the read bandwidth probe at the case's thread count,
                             // the mean of read_gbps_before and read_gbps_after
  double read_gbps_before = 0;  // decode: the probe just before the case's timing
  double read_gbps_after = 0;   // decode: the probe just after it
  double pct_read = 0;          // decode: 100 · gbps / read_gbps
  double weights_ratio = 0;  // unet-weights: time / (time without weights + write time)
  double baseline_us = 0;    // unet-weights: the same problem without weights
  double write_us = 0;       // unet-weights: memset of the weights' bytes
  // unet, unet-bwd: process peak RSS after the case (inputs and everything before included)
  int64_t peak_rss_bytes = 0;
  double target_measure = 0;  // the figure the target is about
  std::string kernel;         // attend::attention_kernel of the case's attention
  // Reduced-precision cases: the baseline case's median time in this run and the speedup
  // over it (baseline time / this time); the peak is the bfloat16 one where the case's
  // products ran as bfloat16 (bf16_peak; the AMX one where they ran on AMX tiles, amx_peak),
  // else the FMA peak.
  double baseline_seconds = 0;
  double speedup = 0;
  bool bf16_peak = false;
  bool amx_peak = false;
  bench::CaseTarget target;  // the case's, or the fallback's where the CPU lacks the instruction
};

BenchSettings parse_settings(const BenchArguments& arguments, const CLI::App& command) {
  BenchSettings settings;
  settings.json = arguments.json;
  settings.threads = threads_from(command, arguments.threads_text, default_num_threads());
  settings.repetitions = static_cast<int>(
      parse_integer("--repetitions", arguments.repetitions_text, 1, kMaxRepetitions));
  settings.min_seconds = parse_number("--min-time", arguments.min_time_text);
  if (!(settings.min_seconds >= 0 && settings.min_seconds <= kMaxMinTime)) {
    throw Error("--min-time must be in [0, 3600] seconds, got " +
                detail::quote_for_message(arguments.min_time_text));
  }
  // Every name is checked before anything is measured.
  if (arguments.case_names.empty()) {
    for (const BenchCase& c : bench::bench_cases()) settings.cases.push_back(&c);
  }
  for (const std::string& name : arguments.case_names) {
    const BenchCase* found = bench::find_bench_case(name);
    if (found == nullptr) {
      throw Error("unknown case " + detail::quote_for_message(name) +
                  " (known: " + bench::known_case_names() + ")");
    }
    settings.cases.push_back(found);
  }
  return settings;
}

// A probe's result per thread count, measured on first use (printed to stderr then) and
// kept for the rest of the run.
template <class Result>
class ProbeTable {
 public:
  using Measure = Result (*)(int threads);
  using Describe = std::string (*)(const Result&, int threads);
  ProbeTable(Measure measure, Describe describe) : measure_(measure), describe_(describe) {}

  const Result& at(int threads) {
    auto found = results_.find(threads);
    if (found != results_.end()) return found->second;
    return measure(threads);
  }
  // Measures again (the footer then shows the latest figure).
  const Result& measure(int threads) {
    const Result result = measure_(threads);
    std::fprintf(stderr, "%s\n", describe_(result, threads).c_str());
    return results_.insert_or_assign(threads, result).first->second;
  }
  // "FMA peak: ..." lines for the table's footer, in thread-count order.
  std::vector<std::string> lines() const {
    std::vector<std::string> out;
    for (const auto& [threads, result] : results_) out.push_back(describe_(result, threads));
    return out;
  }

 private:
  Measure measure_;
  Describe describe_;
  std::map<int, Result> results_;
};

std::string plural_threads(int threads) {
  return std::to_string(threads) + (threads == 1 ? " thread" : " threads");
}

// The probes measured once per run and shared by the cases: the FMA peak (every case) and,
// on first use, the read bandwidth (just before the first memory-bound case: its buffer is
// freed before any later case, and the peak RSS of cases run before it does not include it).
struct Probes {
  ProbeTable<bench::FmaPeak> peaks{
      [](int threads) { return bench::measure_fma_peak(threads); },
      [](const bench::FmaPeak& peak, int threads) {
        char text[96];
        std::snprintf(text, sizeof(text), "FMA peak: %.0f GFLOP/s (%s, %s)", peak.gflops,
                      peak.target.c_str(), plural_threads(threads).c_str());
        return std::string(text);
      }};
  ProbeTable<bench::FmaPeak> bf16_peaks{
      [](int threads) { return bench::measure_bf16_peak(threads); },
      [](const bench::FmaPeak& peak, int threads) {
        char text[96];
        std::snprintf(text, sizeof(text), "bfloat16 dot-product peak: %.0f GFLOP/s (%s, %s)",
                      peak.gflops, peak.target.c_str(), plural_threads(threads).c_str());
        return std::string(text);
      }};
  ProbeTable<bench::FmaPeak> amx_peaks{
      [](int threads) { return bench::measure_amx_peak(threads); },
      [](const bench::FmaPeak& peak, int threads) {
        char text[96];
        std::snprintf(text, sizeof(text), "AMX-BF16 tile peak: %.0f GFLOP/s (%s)", peak.gflops,
                      plural_threads(threads).c_str());
        return std::string(text);
      }};
  ProbeTable<bench::ReadBandwidth> read_bandwidths{
      [](int threads) { return bench::measure_read_bandwidth(threads); },
      [](const bench::ReadBandwidth& bandwidth, int threads) {
        char text[96];
        std::snprintf(text, sizeof(text), "Read bandwidth: %.1f GB/s (%s)", bandwidth.gbps,
                      plural_threads(threads).c_str());
        return std::string(text);
      }};
};

// Median seconds per call of one problem on `threads` threads; `kernel`, when not null, gets
// the path the call takes.
bench::RepeatedTiming time_problem(const bench::AttentionShape& shape, bool need_weights,
                                   int threads, const BenchSettings& settings,
                                   std::string* kernel = nullptr) {
  bench::CaseTensors tensors = bench::make_case_tensors(shape, need_weights);
  if (kernel) {
    AttentionOptions options = tensors.options();
    options.need_weights = need_weights;
    options.num_threads = threads;
    *kernel =
        attention_kernel(tensors.query.view(), tensors.key_view(), tensors.value_view(), options);
  }
  return bench::time_repeated(
      [&] { bench::run_attention(tensors, shape, threads, Backend::kAuto); }, settings.repetitions,
      settings.min_seconds);
}

// Identifies a timed problem, so that a case can reuse another one's time.
std::string problem_key(const bench::AttentionShape& s, bool need_weights, int threads) {
  char key[160];
  std::snprintf(key, sizeof(key), "%lld,%lld,%lld,%lld,%lld,%d,%d,%d,%s,%d",
                static_cast<long long>(s.batch), static_cast<long long>(s.heads),
                static_cast<long long>(s.query_len), static_cast<long long>(s.key_len),
                static_cast<long long>(s.head_dim), s.causal ? 1 : 0, need_weights ? 1 : 0, threads,
                dtype_name(s.dtype), static_cast<int>(s.compute));
  return key;
}

// Median seconds per call of case `c` on `threads` threads (kernel: as time_problem).
bench::RepeatedTiming time_case(const BenchCase& c, int threads, const BenchSettings& settings,
                                std::string* kernel = nullptr) {
  // AMX switched off for the case (restored after it, also when it throws).
  struct AmxSwitch {
    bool previous = amx_enabled();
    explicit AmxSwitch(bool off) {
      if (off) set_amx_enabled(false);
    }
    ~AmxSwitch() { set_amx_enabled(previous); }
  } amx_switch(c.amx_off);
  if (c.workload == bench::Workload::kAttention) {
    return time_problem(c.shape, c.need_weights, threads, settings, kernel);
  }
  return bench::time_repeated(bench::make_module_workload(c, threads), settings.repetitions,
                              settings.min_seconds);
}

CaseResult run_case(const BenchCase& c, const BenchSettings& settings, Probes& probes,
                    std::map<std::string, double>& seconds_by_problem) {
  CaseResult result;
  result.bench_case = &c;
  result.target = c.target;
  result.threads = c.single_thread ? 1 : settings.threads;
  const bool memory_bound = c.memory_bound();
  // The probe on both sides of the timing: the bandwidth a VM gets from its host drifts
  // (on a quiet Zen 5 VM, 30 to 70 GB/s from one minute to the next), so a probe taken once
  // per run can be far from what the case met.
  if (memory_bound) {
    result.read_gbps_before = probes.read_bandwidths.measure(result.threads).gbps;
  }
  result.timing = time_case(c, result.threads, settings, &result.kernel);
  if (memory_bound) {
    result.read_gbps_after = probes.read_bandwidths.measure(result.threads).gbps;
    result.read_gbps = (result.read_gbps_before + result.read_gbps_after) / 2;
  }
  // bfloat16 products ran: the attention's kernel says so; the backward and the modules
  // take them as the precision policy says (module_bf16_peaks).
  const bench::Bf16Peaks module = bench::module_bf16_peaks(c);
  result.bf16_peak = result.kernel.find("bfloat16 products") != std::string::npos || module.bf16;
  result.amx_peak = result.kernel.find("AMX tiles") != std::string::npos || module.amx;
  result.peak_gflops = result.amx_peak    ? probes.amx_peaks.at(result.threads).gflops
                       : result.bf16_peak ? probes.bf16_peaks.at(result.threads).gflops
                                          : probes.peaks.at(result.threads).gflops;
  const double seconds = result.timing.median_seconds;
  seconds_by_problem[c.name + "@" + std::to_string(result.threads)] = seconds;
  if (c.workload == bench::Workload::kAttention && !c.amx_off) {
    seconds_by_problem[problem_key(c.shape, c.need_weights, result.threads)] = seconds;
  }
  if (!c.baseline.empty()) {
    // The float32 case in this run: reused when it ran before, else timed now.
    const auto measured =
        seconds_by_problem.find(c.baseline + "@" + std::to_string(result.threads));
    if (measured != seconds_by_problem.end()) {
      result.baseline_seconds = measured->second;
    } else {
      std::fprintf(stderr, "      %s (the baseline) ...\n", c.baseline.c_str());
      result.baseline_seconds =
          time_case(*bench::find_bench_case(c.baseline), result.threads, settings).median_seconds;
    }
    result.speedup = result.baseline_seconds / seconds;
    // Without the instruction (float32 products), no slower than float32 is the target.
    const bool f16_products = result.kernel.find("float16 products") != std::string::npos;
    if (c.target.kind == TargetKind::kMinSpeedup && !result.bf16_peak && !f16_products) {
      result.target = {TargetKind::kMinSpeedup, 0.9};
    } else if (c.target.kind == TargetKind::kMinSpeedup && result.amx_peak && c.amx_speedup > 0) {
      result.target = {TargetKind::kMinSpeedup, c.amx_speedup};
    }
  }
  result.gflops = c.flops() / seconds / 1e9;
  result.pct_peak = 100.0 * result.gflops / result.peak_gflops;
  result.gbps = c.key_value_bytes() / seconds / 1e9;
  if (memory_bound) result.pct_read = 100.0 * result.gbps / result.read_gbps;
  if (c.need_weights) {
    // The same problem without weights (reused when that case already ran), plus the time
    // to stream the weights' bytes to memory: what returning the weights costs at the least.
    const auto measured = seconds_by_problem.find(problem_key(c.shape, false, result.threads));
    double baseline_seconds = 0;
    if (measured != seconds_by_problem.end()) {
      baseline_seconds = measured->second;
    } else {
      std::fprintf(stderr, "      %s without weights ...\n", c.name.c_str());
      baseline_seconds = time_problem(c.shape, false, result.threads, settings).median_seconds;
    }
    const double write_seconds =
        bench::measure_write_seconds(static_cast<int64_t>(c.shape.weights_bytes()), result.threads);
    result.baseline_us = baseline_seconds * 1e6;
    result.write_us = write_seconds * 1e6;
    result.weights_ratio = seconds / (baseline_seconds + write_seconds);
  }
  if (c.name == "unet" || c.name == "unet-bwd") result.peak_rss_bytes = bench::peak_rss_bytes();
  switch (result.target.kind) {
    case TargetKind::kMaxMicroseconds:
      result.target_measure = seconds * 1e6;
      break;
    case TargetKind::kMinPercentOfPeak:
      result.target_measure = result.pct_peak;
      break;
    case TargetKind::kMinPercentOfRead:
      result.target_measure = result.pct_read;
      break;
    case TargetKind::kMaxWeightsRatio:
      result.target_measure = result.weights_ratio;
      break;
    case TargetKind::kMinSpeedup:
      result.target_measure = result.speedup;
      break;
    case TargetKind::kNone:
      break;
  }
  return result;
}

nlohmann::json to_json(const CaseResult& r, const std::string& simd_target,
                       const BenchSettings& settings) {
  const BenchCase& c = *r.bench_case;
  nlohmann::json line = {
      {"case", c.name},
      {"B", c.shape.batch},
      {"H", c.shape.heads},
      {"Lq", c.shape.query_len},
      {"Lk", c.shape.key_len},
      {"E", c.shape.head_dim},
      {"causal", c.shape.causal},
      {"need_weights", c.need_weights},
      {"threads", r.threads},
      {"repetitions", settings.repetitions},
      {"calls_per_repetition", r.timing.calls_per_repetition},
      {"median_us", r.timing.median_seconds * 1e6},
      {"best_us", r.timing.best_seconds * 1e6},
      {"median_cpu_us", r.timing.median_cpu_seconds * 1e6},
      {"flops", c.flops()},
      {"gflops", r.gflops},
      {"peak_gflops", r.peak_gflops},
      {"pct_peak", r.pct_peak},
      {"simd_target", simd_target},
      {"target", bench::describe_target(r.target)},
      {"target_met", bench::target_met(r.target, r.target_measure)},
      {"dtype", dtype_name(c.shape.dtype)},
      {"peak_kind", r.amx_peak ? "AMX-BF16 tiles" : r.bf16_peak ? "bfloat16 dot product" : "FMA"},
  };
  if (!c.baseline.empty()) {
    line["baseline"] = c.baseline;
    line["baseline_us"] = r.baseline_seconds * 1e6;
    line["speedup"] = r.speedup;
  }
  if (c.memory_bound()) {
    line["gbps"] = r.gbps;
    line["read_gbps"] = r.read_gbps;
    line["read_gbps_before"] = r.read_gbps_before;
    line["read_gbps_after"] = r.read_gbps_after;
    line["pct_read"] = r.pct_read;
  }
  if (c.need_weights) {
    line["weights_ratio"] = r.weights_ratio;
    line["baseline_us"] = r.baseline_us;
    line["write_us"] = r.write_us;
  }
  if (r.peak_rss_bytes > 0) line["peak_rss_bytes"] = r.peak_rss_bytes;
  if (!r.kernel.empty()) line["kernel"] = r.kernel;
  if (c.shape.has_rules() || c.shape.rules.as_mask) {
    line["visited_fraction"] = c.shape.visited_fraction();
  }
  return line;
}

std::string format_time(double seconds) {
  char text[32];
  if (seconds < 1e-3) {
    std::snprintf(text, sizeof(text), "%.2f us", seconds * 1e6);
  } else if (seconds < 1) {
    std::snprintf(text, sizeof(text), "%.2f ms", seconds * 1e3);
  } else {
    std::snprintf(text, sizeof(text), "%.3f s", seconds);
  }
  return text;
}

void print_table(const std::vector<CaseResult>& results, const Probes& probes) {
  std::printf("%-13s %2s %3s %5s %5s %4s %-6s %3s %11s %8s %6s  %-24s %-16s %s\n", "case", "B", "H",
              "Lq", "Lk", "E", "causal", "thr", "median", "GFLOP/s", "%peak", "also", "target",
              "result");
  for (const CaseResult& r : results) {
    const BenchCase& c = *r.bench_case;
    char also[64] = "";
    if (c.memory_bound() && !c.baseline.empty()) {
      std::snprintf(also, sizeof(also), "%.1f GB/s (%.0f%%), %.2fx %s", r.gbps, r.pct_read,
                    r.speedup, c.baseline.c_str());
    } else if (c.memory_bound()) {
      std::snprintf(also, sizeof(also), "%.1f GB/s (%.0f%% of read)", r.gbps, r.pct_read);
    } else if (!c.baseline.empty()) {
      std::snprintf(also, sizeof(also), "%.2fx %s%s", r.speedup, c.baseline.c_str(),
                    r.amx_peak ? ", AMX peak" : r.bf16_peak ? ", bf16 peak" : "");
    } else if (c.need_weights) {
      std::snprintf(also, sizeof(also), "%.2fx (unet+write)", r.weights_ratio);
    } else if (c.shape.rules.window_left >= 0 || c.shape.rules.documents > 0) {
      std::snprintf(also, sizeof(also), "visits %.1f%% of tiles",
                    100.0 * c.shape.visited_fraction());
    } else if (r.peak_rss_bytes > 0) {
      std::snprintf(also, sizeof(also), "peak RSS %.0f MiB",
                    static_cast<double>(r.peak_rss_bytes) / (1 << 20));
    }
    const bool met = bench::target_met(r.target, r.target_measure);
    std::printf("%-13s %2lld %3lld %5lld %5lld %4lld %-6s %3d %11s %8.1f %6.1f  %-24s %-16s %s\n",
                c.name.c_str(), static_cast<long long>(c.shape.batch),
                static_cast<long long>(c.shape.heads), static_cast<long long>(c.shape.query_len),
                static_cast<long long>(c.shape.key_len), static_cast<long long>(c.shape.head_dim),
                c.shape.causal ? "yes" : "no", r.threads,
                format_time(r.timing.median_seconds).c_str(), r.gflops, r.pct_peak, also,
                bench::describe_target(r.target).c_str(),
                r.target.kind == TargetKind::kNone ? "-" : (met ? "met" : "MISSED"));
  }
  for (const std::string& line : probes.peaks.lines()) std::printf("%s\n", line.c_str());
  for (const std::string& line : probes.bf16_peaks.lines()) std::printf("%s\n", line.c_str());
  for (const std::string& line : probes.amx_peaks.lines()) std::printf("%s\n", line.c_str());
  for (const std::string& line : probes.read_bandwidths.lines()) {
    std::printf("%s\n", line.c_str());
  }
  std::printf(
      "FLOPs: attend::attention_flops (4*B*H*Lq*Lk*E), or 4*B*H*E per visible score with "
      "causal, windows and documents (exact for any Lq, Lk), 2.5x that for the *-bwd cases; %%peak: of the FMA "
      "peak at the case's thread count; %% of read: of the read bandwidth at that count (both "
      "measured in this run, as are the targets' shares). unet peak RSS includes the inputs. "
      "Reduced precision (*-bf16, *-fp16): Nx BASE is the float32 case's time in this run over "
      "this one's; %%peak of the bfloat16 dot-product peak where the products ran in bfloat16 "
      "(bf16 peak), else of the FMA peak; without the instruction the target is 0.9x.\n");
}

// --ring: context parallelism under mpirun (ring_bench.cpp).
void run_ring(const BenchArguments& arguments, const CLI::App& command) {
#ifdef ATTEND_HAVE_MPI
  RingBenchSettings s;
  const size_t commas = static_cast<size_t>(
      std::count(arguments.ring_shape.begin(), arguments.ring_shape.end(), ','));
  if (commas != 3) throw Error("--ring-shape must be B,H,L,E, got " + arguments.ring_shape);
  int64_t* dims[] = {&s.batch, &s.heads, &s.length, &s.head_dim};
  size_t at = 0;
  for (int64_t* dim : dims) {
    const size_t comma = arguments.ring_shape.find(',', at);
    *dim = static_cast<int64_t>(parse_integer(
        "--ring-shape", arguments.ring_shape.substr(at, comma - at), 1, int64_t{1} << 31));
    at = comma + 1;
  }
  s.threads = threads_from(command, arguments.threads_text, 1);
  if (command.count("--repetitions") > 0) {
    s.repetitions = static_cast<int>(
        parse_integer("--repetitions", arguments.repetitions_text, 1, kMaxRepetitions));
  }
  s.causal = arguments.ring_causal != "no";
  s.non_causal = arguments.ring_causal != "yes";
  s.baseline = !arguments.ring_no_baseline;
  s.json = arguments.json;
  run_ring_bench(s);
#else
  (void)arguments;
  (void)command;
  throw Error("--ring: this attend was built without MPI (install libopenmpi-dev and rebuild)");
#endif
}

void run_bench(const BenchArguments& arguments, const CLI::App& command) {
  const BenchSettings settings = parse_settings(arguments, command);
  const std::string simd_target = active_simd_target();
  if (!settings.json) {
    std::printf(
        "attend bench: %zu case(s), %d thread(s), SIMD target %s, median of %d "
        "repetition(s) of >= %g s\n",
        settings.cases.size(), settings.threads, simd_target.c_str(), settings.repetitions,
        settings.min_seconds);
    std::fflush(stdout);
  }
  Probes probes;
  (void)probes.peaks.at(settings.threads);  // printed first, before any case
  std::vector<CaseResult> results;
  std::map<std::string, double> seconds_by_problem;
  const size_t count = settings.cases.size();
  for (size_t i = 0; i < count; ++i) {
    const BenchCase& c = *settings.cases[i];
    std::fprintf(stderr, "[%zu/%zu] %s ...\n", i + 1, count, c.name.c_str());
    results.push_back(run_case(c, settings, probes, seconds_by_problem));
    if (settings.json) {
      std::cout << to_json(results.back(), simd_target, settings).dump() << '\n' << std::flush;
    }
  }
  if (!settings.json && !results.empty()) print_table(results, probes);
}

}  // namespace

Command add_bench_command(CLI::App& app) {
  auto arguments = std::make_shared<BenchArguments>();
  CLI::App* command = app.add_subcommand(
      "bench", "Time the named attention cases (median of repetitions) against their targets");
  command->add_flag("--json", arguments->json, "one JSON object per case and line on stdout");
  add_threads_option(*command, arguments->threads_text,
                     "all; --ring: 1 per rank; the single-thread cases keep 1");
  command
      ->add_option("--case", arguments->case_names,
                   "case(s) to run (default: all): " + bench::known_case_names())
      ->type_name("NAME[,NAME...]")
      ->delimiter(',');
  command
      ->add_option("--repetitions", arguments->repetitions_text,
                   "timed repetitions per case, the median is reported (default 5)")
      ->type_name("INT");
  command
      ->add_option("--min-time", arguments->min_time_text,
                   "seconds each repetition lasts at least (default 0.2)")
      ->type_name("FLOAT");
  command->add_flag("--ring", arguments->ring,
                    "context parallelism under mpirun: 1 rank against N ranks (ring, Ulysses)");
  command
      ->add_option("--ring-shape", arguments->ring_shape,
                   "--ring's whole problem B,H,L,E (default 1,8,16384,64)")
      ->type_name("INT,INT,INT,INT");
  command->add_option("--ring-causal", arguments->ring_causal, "--ring: both (default), yes or no")
      ->type_name("CHOICE")
      ->check(CLI::IsMember({"both", "yes", "no"}));
  command->add_flag("--ring-no-baseline", arguments->ring_no_baseline,
                    "--ring: skip the 1-rank baseline");
  return {command, [arguments, command] {
            if (arguments->ring) {
              run_ring(*arguments, *command);
            } else {
              run_bench(*arguments, *command);
            }
          }};
}

}  // namespace attend::cli
