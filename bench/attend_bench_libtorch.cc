// attend_bench_libtorch.cc: the listing's math path in LibTorch (matmul, softmax, matmul),
// on the shapes of attend_bench, for comparison. Built only with -DATTEND_BENCH_LIBTORCH=ON.
//
//   build-*/bench/attend_bench_libtorch [--threads=N] [--benchmark_filter=REGEX]
//
// Names: libtorch/<case>/threads:<n> and libtorch/sweep_L|sweep_E/...; counters as in
// attend_bench (GFLOPS from attend::attention_flops, pct_peak of the same FMA probe). The
// scores (B, H, Lq, Lk) are materialized, so the L sweep stops at 4096.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

#include "bench/cases.hpp"
#include "suite_common.hpp"

namespace attend::bench {
namespace {

constexpr double kMinSeconds = 0.2;
constexpr int64_t kLibTorchMaxLength = 4096;

// The listing: scores = Q·Kᵀ / sqrt(E); masked_fill(mask == 0, -1e9) when causal;
// weights = softmax(scores, -1); output = weights·V. Query (B, H, Lq, E), key and value
// (B, H, Lk, E), output (B, H, Lq, E), weights (B, H, Lq, Lk).
torch::Tensor listing_attention(const torch::Tensor& query, const torch::Tensor& key,
                                const torch::Tensor& value, const torch::Tensor& causal_keep,
                                bool need_weights, torch::Tensor* weights_out) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
  torch::Tensor scores = torch::matmul(query, key.transpose(-2, -1)) * scale;
  if (causal_keep.defined()) scores = scores.masked_fill(causal_keep.logical_not(), -1e9);
  torch::Tensor weights = torch::softmax(scores, -1);
  if (need_weights) *weights_out = weights;
  return torch::matmul(weights, value);
}

void register_problem(const std::string& label, const AttentionShape& shape, bool need_weights,
                      int threads, bool report_bandwidth) {
  const std::string name = "libtorch/" + label + "/threads:" + std::to_string(threads);
  benchmark::RegisterBenchmark(
      name.c_str(),
      [=](benchmark::State& state) {
        torch::NoGradGuard no_grad;
        torch::set_num_threads(threads);
        torch::manual_seed(0);
        const auto options = torch::TensorOptions().dtype(torch::kFloat32);
        const torch::Tensor query =
            torch::rand({shape.batch, shape.heads, shape.query_len, shape.head_dim}, options) * 2 -
            1;
        // shared_kv: one K/V head expanded (stride 0) over the query heads.
        const int64_t kv_heads = shape.shared_kv ? 1 : shape.heads;
        const torch::Tensor key =
            (torch::rand({shape.batch, kv_heads, shape.key_len, shape.head_dim}, options) * 2 - 1)
                .expand({shape.batch, shape.heads, shape.key_len, shape.head_dim});
        const torch::Tensor value =
            (torch::rand({shape.batch, kv_heads, shape.key_len, shape.head_dim}, options) * 2 - 1)
                .expand({shape.batch, shape.heads, shape.key_len, shape.head_dim});
        torch::Tensor causal_keep;  // query i keeps key j when j <= i + Lk - Lq
        if (shape.causal) {
          causal_keep = torch::ones({shape.query_len, shape.key_len}, torch::kBool)
                            .tril(shape.key_len - shape.query_len);
        }
        torch::Tensor weights;
        for (auto _ : state) {
          torch::Tensor output =
              listing_attention(query, key, value, causal_keep, need_weights, &weights);
          benchmark::DoNotOptimize(output.data_ptr());
        }
        set_attention_counters(state, shape, threads, report_bandwidth);
      })
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond)
      ->MinTime(kMinSeconds);
}

void register_all(int threads) {
  for (const BenchCase& c : bench_cases()) {
    if (c.workload != Workload::kAttention) continue;
    const bool report_bandwidth = c.memory_bound();
    if (!c.single_thread)
      register_problem(c.name, c.shape, c.need_weights, threads, report_bandwidth);
    register_problem(c.name, c.shape, c.need_weights, 1, report_bandwidth);
  }
  for_each_sweep_point(kLibTorchMaxLength,
                       [&](const std::string& label, const AttentionShape& shape) {
                         register_problem(label, shape, false, threads, false);
                       });
}

}  // namespace
}  // namespace attend::bench

int main(int argc, char** argv) {
  return attend::bench::run_suite(argc, argv, attend::bench::register_all);
}
