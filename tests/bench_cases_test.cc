// bench_cases_test.cc: the benchmark case table, the measuring helpers' contracts and the
// shape of `attend bench --json` output. No assertion here depends on a timing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "bench/cases.hpp"
#include "bench/fma_peak.hpp"
#include "bench/measure.hpp"
#include "bench/read_bandwidth.hpp"
#include "cli_main.hpp"
#include "test_support.hpp"

namespace attend::bench {
namespace {

TEST(BenchCases, NamedCasesHaveTheirShapesAndTargets) {
  struct Expected {
    const char* name;
    int64_t batch, heads, query_len, key_len, head_dim;
    bool causal, need_weights, single_thread;
  };
  const Expected expected[] = {
      {"phrase", 1, 8, 4, 4, 32, false, false, true},
      {"unet", 1, 4, 4096, 4096, 32, false, false, false},
      {"s3", 1, 8, 1024, 1024, 64, false, false, false},
      {"s4", 1, 16, 2048, 2048, 128, false, false, false},
      {"s4-causal", 1, 16, 2048, 2048, 128, true, false, false},
      {"decode", 1, 32, 1, 8192, 128, false, false, false},
      {"unet-weights", 1, 4, 4096, 4096, 32, false, true, false},
  };
  for (const Expected& e : expected) {
    SCOPED_TRACE(e.name);
    const BenchCase* c = find_bench_case(e.name);
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->name, e.name);
    EXPECT_EQ(c->shape.batch, e.batch);
    EXPECT_EQ(c->shape.heads, e.heads);
    EXPECT_EQ(c->shape.query_len, e.query_len);
    EXPECT_EQ(c->shape.key_len, e.key_len);
    EXPECT_EQ(c->shape.head_dim, e.head_dim);
    EXPECT_EQ(c->shape.causal, e.causal);
    EXPECT_EQ(c->need_weights, e.need_weights);
    EXPECT_EQ(c->single_thread, e.single_thread);
    EXPECT_NE(c->target.kind, TargetKind::kNone);
  }
}

// Throughput targets are shares of the FMA peak, or of the read bandwidth for decoding, which
// `attend bench` measures only for the memory-bound cases.
TEST(BenchCases, ThroughputTargetsAreSharesOfWhatTheRunMeasures) {
  const struct {
    const char* name;
    TargetKind kind;
    double percent;
  } expected[] = {
      {"unet", TargetKind::kMinPercentOfPeak, 81},
      {"s3", TargetKind::kMinPercentOfPeak, 83},
      {"s4", TargetKind::kMinPercentOfPeak, 89},
      {"s4-causal", TargetKind::kMinPercentOfPeak, 81},
      {"s4-bwd", TargetKind::kMinPercentOfPeak, 50},
      {"s4-causal-bwd", TargetKind::kMinPercentOfPeak, 50},
      {"decode", TargetKind::kMinPercentOfRead, 90},
      {"decode-paged", TargetKind::kMinPercentOfRead, 85},
      {"decode-paged-64", TargetKind::kMinPercentOfRead, 85},
      {"decode-gqa", TargetKind::kMinPercentOfRead, 85},
      {"decode-int8", TargetKind::kMinPercentOfRead, 75},
      {"decode-fp8", TargetKind::kMinPercentOfRead, 75},
      {"decode-batch", TargetKind::kMinPercentOfRead, 85},
  };
  for (const auto& e : expected) {
    const BenchCase* c = find_bench_case(e.name);
    ASSERT_NE(c, nullptr) << e.name;
    EXPECT_EQ(c->target.kind, e.kind) << e.name;
    EXPECT_EQ(c->target.value, e.percent) << e.name;
  }
  for (const BenchCase& c : bench_cases()) {
    if (c.target.kind == TargetKind::kMinPercentOfRead) {
      EXPECT_TRUE(c.memory_bound()) << c.name;
    }
  }
}

TEST(BenchCases, ModuleCasesAndUnknownNames) {
  const BenchCase* phrase = find_bench_case("phrase-mha");
  ASSERT_NE(phrase, nullptr);
  EXPECT_EQ(phrase->workload, Workload::kMultiHeadLayer);
  EXPECT_TRUE(phrase->single_thread);
  const BenchCase* block = find_bench_case("unet-block");
  ASSERT_NE(block, nullptr);
  EXPECT_EQ(block->workload, Workload::kSpatialBlock);
  EXPECT_EQ(block->shape.heads * block->shape.head_dim, 128);  // (1, 128, 64, 64), 4 heads
  EXPECT_EQ(find_bench_case("nope"), nullptr);
  EXPECT_EQ(find_bench_case(""), nullptr);
  EXPECT_EQ(find_bench_case("S3"), nullptr);  // names are case-sensitive
  EXPECT_EQ(find_bench_case("s4 "), nullptr);
}

TEST(BenchCases, KnownNamesListEveryCaseOnceInTableOrder) {
  std::string expected;
  std::set<std::string> seen;
  for (const BenchCase& c : bench_cases()) {
    EXPECT_TRUE(seen.insert(c.name).second) << "duplicate case " << c.name;
    expected += (expected.empty() ? "" : ", ") + c.name;
  }
  EXPECT_EQ(known_case_names(), expected);
  EXPECT_EQ(known_case_names().rfind("phrase, unet, s3, s4, s4-causal, decode, unet-weights", 0),
            0u);
}

TEST(BenchCases, FlopsAndBytesByHand) {
  // unet: 4·(B·H)·Lq·Lk·E = 4·4·4096·4096·32.
  EXPECT_DOUBLE_EQ(find_bench_case("unet")->shape.flops(), 8589934592.0);
  // s4-causal: 4·16·128 per visible score, 2048·2049/2 of them per head.
  EXPECT_DOUBLE_EQ(find_bench_case("s4-causal")->shape.flops(), 4.0 * 16 * 128 * 2048 * 2049 / 2);
  // decode-verify4: 4 causal queries, bottom-right aligned, see 8189..8192 of the 8192 keys:
  // 4·32·128·(4·8192 − 6), nearly the full 4·32·4·8192·128, not half of it.
  EXPECT_DOUBLE_EQ(find_bench_case("decode-verify4")->shape.flops(),
                   4.0 * 32 * 128 * (4 * 8192 - 6));
  EXPECT_DOUBLE_EQ(find_bench_case("decode-verify1")->shape.flops(), 4.0 * 32 * 128 * 8192);
  // decode reads K and V: 2·32·8192·128·4 bytes.
  EXPECT_DOUBLE_EQ(find_bench_case("decode")->shape.key_value_bytes(), 268435456.0);
  // Grouped-query: each of the 8 K/V heads once. Quantized caches: codes and scales as stored,
  // 8192 tokens × 32 heads × (2 × 128 one-byte codes + 2 float32 scales).
  EXPECT_DOUBLE_EQ(find_bench_case("decode-gqa")->key_value_bytes(), 67108864.0);
  EXPECT_DOUBLE_EQ(find_bench_case("decode-int8")->key_value_bytes(), 69206016.0);
  EXPECT_DOUBLE_EQ(find_bench_case("decode-paged")->key_value_bytes(), 268435456.0);
  const BenchCase* batch = find_bench_case("decode-batch");
  EXPECT_EQ(batch->paged_lengths().size(), 32u);
  for (int64_t l : batch->paged_lengths()) EXPECT_TRUE(l >= 100 && l <= 8192) << l;
  EXPECT_EQ(batch->paged_lengths(), batch->paged_lengths());  // seeded
  // decode-mqa: one K/V head for the 32 query heads: 2·8192·128·4 bytes.
  const BenchCase* mqa = find_bench_case("decode-mqa");
  ASSERT_NE(mqa, nullptr);
  EXPECT_TRUE(mqa->shape.shared_kv);
  EXPECT_DOUBLE_EQ(mqa->shape.key_value_bytes(), 8388608.0);
  // Backward cases: 2.5 × the forward's FLOPs, same shapes as their forward cases.
  for (const char* name : {"unet", "s4", "s4-causal"}) {
    const BenchCase* forward = find_bench_case(name);
    const BenchCase* backward = find_bench_case(std::string(name) + "-bwd");
    ASSERT_NE(backward, nullptr) << name;
    EXPECT_EQ(backward->workload, Workload::kAttentionBackward);
    EXPECT_EQ(backward->shape.causal, forward->shape.causal);
    EXPECT_DOUBLE_EQ(backward->flops(), 2.5 * forward->shape.flops()) << name;
    EXPECT_DOUBLE_EQ(forward->flops(), forward->shape.flops());
  }
  EXPECT_EQ(find_bench_case("s4-bwd")->target.kind, TargetKind::kMinPercentOfPeak);
  // unet-weights writes 4·4096·4096 floats.
  EXPECT_DOUBLE_EQ(find_bench_case("unet-weights")->shape.weights_bytes(), 268435456.0);
}

TEST(BenchCases, TargetsCompareInTheRightDirection) {
  const CaseTarget latency{TargetKind::kMaxMicroseconds, 0.5};
  EXPECT_TRUE(target_met(latency, 0.4));
  EXPECT_FALSE(target_met(latency, 0.6));
  const CaseTarget throughput{TargetKind::kMinPercentOfPeak, 81};
  EXPECT_TRUE(target_met(throughput, 81.5));
  EXPECT_FALSE(target_met(throughput, 80.9));
  const CaseTarget ratio{TargetKind::kMaxWeightsRatio, 1.5};
  EXPECT_FALSE(target_met(ratio, 1.6));
  EXPECT_EQ(describe_target(latency), "<= 0.5 us");
  EXPECT_EQ(describe_target(throughput), ">= 81% of peak");
  EXPECT_EQ(describe_target({TargetKind::kMinPercentOfRead, 71}), ">= 71% of read");
  EXPECT_EQ(describe_target(ratio), "<= 1.5x");
}

TEST(BenchCases, CaseTensorsRunThroughTheApi) {
  const AttentionShape shape{1, 2, 3, 5, 4, true};
  CaseTensors tensors = make_case_tensors(shape, /*need_weights=*/true);
  EXPECT_EQ(tensors.query.shape(), Shape({1, 2, 3, 4}));
  EXPECT_EQ(tensors.key.shape(), Shape({1, 2, 5, 4}));
  EXPECT_EQ(tensors.weights.shape(), Shape({1, 2, 3, 5}));
  for (float v : {tensors.query.data_as<float>()[0], tensors.value.data_as<float>()[39]}) {
    EXPECT_GE(v, -1.0f);
    EXPECT_LT(v, 1.0f);
  }
  run_attention(tensors, shape, 1, Backend::kAuto);
  // Every weights row sums to 1, and the first query (causal, Lk − Lq = 2) sees 3 keys.
  const float* w = tensors.weights.data_as<float>();
  for (int row = 0; row < 6; ++row) {
    float sum = 0;
    for (int j = 0; j < 5; ++j) sum += w[row * 5 + j];
    EXPECT_NEAR(sum, 1.0f, 1e-5f) << "row " << row;
  }
  EXPECT_EQ(w[3], 0.0f);
  EXPECT_EQ(w[4], 0.0f);
  EXPECT_GT(w[2], 0.0f);
}

TEST(BenchCases, SharedKeyValueTensorsAreOneHeadSeenByEveryHead) {
  AttentionShape shape{2, 3, 1, 7, 16, false, true};
  CaseTensors shared = make_case_tensors(shape, /*need_weights=*/false);
  EXPECT_EQ(shared.key.shape(), Shape({2, 1, 7, 16}));
  EXPECT_EQ(shared.key_view().shape, Shape({2, 3, 7, 16}));
  EXPECT_EQ(shared.key_view().strides, Shape({112, 0, 16, 1}));
  run_attention(shared, shape, 1, Backend::kAuto);
  // The same problem with K and V copied into every head gives the same output, bitwise.
  shape.shared_kv = false;
  CaseTensors copied = make_case_tensors(shape, false);
  for (Tensor* t : {&copied.key, &copied.value}) {
    const Tensor& one = t == &copied.key ? shared.key : shared.value;
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t h = 0; h < 3; ++h) {
        std::copy_n(one.data_as<float>() + b * 112, 112, t->data_as<float>() + (b * 3 + h) * 112);
      }
    }
  }
  run_attention(copied, shape, 1, Backend::kAuto);
  for (int64_t i = 0; i < 2 * 3 * 16; ++i) {
    ASSERT_EQ(shared.output.data_as<float>()[i], copied.output.data_as<float>()[i]) << i;
  }
}

TEST(BenchMeasure, TimeRepeatedCallsWarmUpThenOncePerRepetitionAtMinTimeZero) {
  int calls = 0;
  const RepeatedTiming timing = time_repeated([&] { ++calls; }, 3, 0.0);
  EXPECT_EQ(calls, 4);
  EXPECT_EQ(timing.calls_per_repetition, 1);
  EXPECT_LE(timing.best_seconds, timing.median_seconds);
  EXPECT_THROW(time_repeated([] {}, 0, 0.1), Error);
  EXPECT_THROW(time_repeated([] {}, 1, -1.0), Error);
}

TEST(BenchMeasure, FmaPeakReportsTheDispatchedTarget) {
  const FmaPeak peak = measure_fma_peak(1, 0.005);
  EXPECT_GT(peak.gflops, 0.0);
  EXPECT_EQ(peak.threads, 1);
  EXPECT_EQ(peak.target, active_simd_target());
  EXPECT_GE(peak.lanes, 1);
  EXPECT_THROW(measure_fma_peak(0), Error);
  EXPECT_THROW(measure_fma_peak(1, 0.0), Error);
  // Capped, the probe's code (which names its own target) runs on the capped target: attend's
  // dispatch follows its cap.
  const std::string lowest = supported_simd_targets().back();
  test::ScopedSimdCap cap(lowest);
  EXPECT_EQ(measure_fma_peak(1, 0.005).target, lowest);
}

TEST(BenchMeasure, WriteProbeAndPeakRss) {
  EXPECT_GT(measure_write_seconds(1 << 20, 1, 0.005), 0.0);
  EXPECT_THROW(measure_write_seconds(0, 1), Error);
  EXPECT_GT(peak_rss_bytes(), 0);
}

TEST(BenchMeasure, ReadBandwidthReportsThreadsAndTarget) {
  // 1 MiB + 3 floats: the parts of 3 threads, and a tail shorter than one vector.
  const int64_t bytes = (int64_t{1} << 20) + 12;
  const ReadBandwidth bandwidth = measure_read_bandwidth(3, bytes, 0.002);
  EXPECT_GT(bandwidth.gbps, 0.0);
  EXPECT_TRUE(std::isfinite(bandwidth.gbps));
  EXPECT_EQ(bandwidth.threads, 3);
  EXPECT_EQ(bandwidth.bytes, bytes);
  EXPECT_EQ(bandwidth.target, active_simd_target());
  EXPECT_EQ(measure_read_bandwidth(1, 4096, 0.001).threads, 1);
  EXPECT_GT(measure_read_bandwidth(8, 4096, 0.001).gbps, 0.0);  // more threads than parts
}

TEST(BenchMeasure, ReadBandwidthRefusesBadArgumentsNamingThem) {
  const auto message_of = [](int threads, int64_t bytes, double min_seconds) -> std::string {
    try {
      (void)measure_read_bandwidth(threads, bytes, min_seconds);
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_NE(message_of(0, 4096, 0.001).find("num_threads"), std::string::npos)
      << message_of(0, 4096, 0.001);
  EXPECT_NE(message_of(-2, 4096, 0.001).find("num_threads"), std::string::npos);
  EXPECT_NE(message_of(1, 0, 0.001).find("bytes"), std::string::npos) << message_of(1, 0, 0.001);
  EXPECT_NE(message_of(1, -4096, 0.001).find("bytes"), std::string::npos);
  EXPECT_NE(message_of(1, 4096, 0.0).find("min_seconds"), std::string::npos)
      << message_of(1, 4096, 0.0);
  EXPECT_NE(message_of(1, 4096, -1.0).find("min_seconds"), std::string::npos);
  EXPECT_NE(message_of(1, 4096, std::nan("")).find("min_seconds"), std::string::npos);
}

int run_cli(std::vector<std::string> arguments, std::string* out, std::string* err) {
  arguments.insert(arguments.begin(), "attend");
  std::vector<char*> argv;
  for (std::string& a : arguments) argv.push_back(a.data());
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const int status = attend_cli_main(static_cast<int>(argv.size()), argv.data());
  *out = testing::internal::GetCapturedStdout();
  *err = testing::internal::GetCapturedStderr();
  return status;
}

// `out` must hold exactly one non-empty line: parsed into *record (the text into *line).
void parse_only_line(const std::string& out, nlohmann::json* record, std::string* line) {
  std::istringstream lines(out);
  std::vector<std::string> nonempty;
  for (std::string text; std::getline(lines, text);) {
    if (!text.empty()) nonempty.push_back(text);
  }
  ASSERT_EQ(nonempty.size(), 1u) << out;
  *line = nonempty[0];
  *record = nlohmann::json::parse(*line);
}

TEST(BenchCommand, JsonLineHasTheRequiredKeys) {
  std::string out, err;
  ASSERT_EQ(
      run_cli({"bench", "--case", "phrase", "--json", "--min-time", "0.01", "--repetitions", "1"},
              &out, &err),
      0)
      << err;
  nlohmann::json record;
  std::string line;
  ASSERT_NO_FATAL_FAILURE(parse_only_line(out, &record, &line));
  for (const char* key : {"case", "B", "H", "Lq", "Lk", "E", "causal", "threads", "median_us",
                          "gflops", "peak_gflops", "pct_peak", "simd_target"}) {
    EXPECT_TRUE(record.contains(key)) << "missing " << key << " in " << line;
  }
  EXPECT_EQ(record["case"], "phrase");
  EXPECT_EQ(record["H"], 8);
  EXPECT_EQ(record["Lq"], 4);
  EXPECT_EQ(record["E"], 32);
  EXPECT_EQ(record["threads"], 1);
  EXPECT_GT(record["median_us"].get<double>(), 0.0);
  EXPECT_NE(err.find("FMA peak:"), std::string::npos) << err;
  EXPECT_NE(err.find("[1/1] phrase"), std::string::npos) << err;
  // Only the memory-bound case (decode) measures the read bandwidth and reports against it.
  EXPECT_FALSE(record.contains("read_gbps")) << line;
  EXPECT_EQ(err.find("Read bandwidth"), std::string::npos) << err;
}

// decode (256 MiB of K and V) with the default read probe (512 MiB): about 2 s in all.
TEST(BenchCommand, DecodeJsonLineHasTheReadBandwidthKeys) {
  std::string out, err;
  ASSERT_EQ(run_cli({"bench", "--case", "decode", "--json", "--threads", "2", "--min-time", "0.001",
                     "--repetitions", "1"},
                    &out, &err),
            0)
      << err;
  nlohmann::json record;
  std::string line;
  ASSERT_NO_FATAL_FAILURE(parse_only_line(out, &record, &line));
  EXPECT_EQ(record["case"], "decode");
  EXPECT_EQ(record["threads"], 2);
  for (const char* key : {"gbps", "read_gbps", "read_gbps_before", "read_gbps_after", "pct_read"}) {
    ASSERT_TRUE(record.contains(key)) << "missing " << key << " in " << line;
    EXPECT_GT(record[key].get<double>(), 0.0) << key;
  }
  // The denominator is the mean of the probes taken just before and just after the timing.
  EXPECT_NEAR(record["read_gbps"].get<double>(),
              (record["read_gbps_before"].get<double>() + record["read_gbps_after"].get<double>()) / 2,
              1e-9);
  EXPECT_NEAR(record["pct_read"].get<double>(),
              100.0 * record["gbps"].get<double>() / record["read_gbps"].get<double>(), 1e-9);
  // The target is judged on the share of the read bandwidth measured in this run.
  EXPECT_EQ(record["target"], ">= 90% of read");
  EXPECT_EQ(record["target_met"].get<bool>(), record["pct_read"].get<double>() >= 90) << line;
  const size_t probe_line = err.find("Read bandwidth:");
  ASSERT_NE(probe_line, std::string::npos) << err;
  const std::string probe_text = err.substr(probe_line, err.find('\n', probe_line) - probe_line);
  EXPECT_NE(probe_text.find(" GB/s (2 threads)"), std::string::npos) << probe_text;
}

TEST(BenchCommand, UnknownCaseIsAnErrorNamingTheKnownOnes) {
  std::string out, err;
  EXPECT_EQ(run_cli({"bench", "--case", "nope"}, &out, &err), 2);
  EXPECT_EQ(err.rfind("error: unknown case 'nope' (known: phrase, unet,", 0), 0u) << err;
  EXPECT_EQ(out, "");
}

TEST(BenchCommand, ModuleCaseRunsTheWholeLayer) {
  std::string out, err;
  EXPECT_EQ(run_cli({"bench", "--case", "phrase-mha", "--json", "--min-time", "0.001",
                     "--repetitions", "1"},
                    &out, &err),
            0)
      << err;
  EXPECT_NE(out.find("\"case\":\"phrase-mha\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"median_us\""), std::string::npos) << out;
}

TEST(BenchCommand, BadNumbersAreRefused) {
  std::string out, err;
  EXPECT_EQ(run_cli({"bench", "--repetitions", "0"}, &out, &err), 2);
  EXPECT_NE(err.find("--repetitions"), std::string::npos) << err;
  EXPECT_EQ(run_cli({"bench", "--min-time", "-1"}, &out, &err), 2);
  EXPECT_NE(err.find("--min-time"), std::string::npos) << err;
  EXPECT_EQ(run_cli({"bench", "--threads", "x"}, &out, &err), 2);
  EXPECT_NE(err.find("--threads"), std::string::npos) << err;
}

}  // namespace
}  // namespace attend::bench
