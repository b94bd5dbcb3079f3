// serving_bench: the per-call cost of attention in a decode loop, prepared (AttentionPlan)
// against unprepared (scaled_dot_product_attention_into) in the same run, one thread:
//   phrase    B=1 H=8 Lq=4 Lk=4 E=32  (the `phrase` case of `attend bench`)
//   decode64  B=1 H=8 Lq=1 Lk=64 E=64 (one token over a 64-key cache)
// Per-call overhead = prepared or unprepared time − kernel_only (the chosen kernel on
// prebuilt parameters); the difference between the two is what a plan saves. Reproduce:
//   build/bench/serving_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "attend/kv_cache.hpp"
#include "attend/plan.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"
#include "attend/varlen.hpp"
#include "bench/read_bandwidth.hpp"
#include "boundary/operands.hpp"
#include "boundary/validation.hpp"
#include "boundary/views.hpp"
#include "kernels/kernel_list.hpp"

namespace {

using attend::AttentionOptions;
using attend::AttentionPlan;
using attend::DType;
using attend::Shape;
using attend::Tensor;

struct Problem {
  Tensor q, k, v, out;
  Problem(int64_t heads, int64_t lq, int64_t lk, int64_t e)
      : q(DType::kFloat32, Shape({1, heads, lq, e})),
        k(DType::kFloat32, Shape({1, heads, lk, e})),
        v(DType::kFloat32, Shape({1, heads, lk, e})),
        out(DType::kFloat32, Shape({1, heads, lq, e})) {
    for (Tensor* t : {&q, &k, &v}) {
      for (int64_t n = 0; n < t->numel(); ++n) {
        t->data_as<float>()[n] = static_cast<float>((n * 7919 % 1000) / 1000.0 - 0.5);
      }
    }
  }
};

AttentionOptions one_thread() {
  AttentionOptions options;
  options.num_threads = 1;
  return options;
}

void unprepared(benchmark::State& state, int64_t heads, int64_t lq, int64_t lk, int64_t e) {
  const Problem p(heads, lq, lk, e);
  const AttentionOptions options = one_thread();
  for (auto _ : state) {
    attend::scaled_dot_product_attention_into(p.q.view(), p.k.view(), p.v.view(), p.out.view(),
                                              nullptr, options);
    benchmark::ClobberMemory();
  }
}

void planned(benchmark::State& state, int64_t heads, int64_t lq, int64_t lk, int64_t e) {
  const Problem p(heads, lq, lk, e);
  const AttentionPlan plan(p.q.view(), p.k.view(), p.v.view(), p.out.view(), one_thread());
  for (auto _ : state) {
    plan.run(p.q.view(), p.k.view(), p.v.view(), p.out.view());
    benchmark::ClobberMemory();
  }
}

// The floor: the chosen kernel on prebuilt parameters, no checks at all.
void kernel_only(benchmark::State& state, int64_t heads, int64_t lq, int64_t lk, int64_t e) {
  const Problem p(heads, lq, lk, e);
  const AttentionOptions options = one_thread();
  const attend::detail::Problem problem =
      attend::detail::validate_inputs(p.q.view(), p.k.view(), p.v.view(), options);
  attend::detail::KernelInputs inputs;
  attend::detail::SdpaParams params =
      attend::detail::make_params(p.q.view(), p.k.view(), p.v.view(), problem, options, inputs);
  params.output = const_cast<float*>(p.out.data_as<float>());
  params.output_strides = attend::detail::plain_strides(p.out.view());
  const attend::detail::KernelRun kernel =
      attend::detail::chosen_kernel_run(params, options.backend);
  for (auto _ : state) {
    kernel(params);
    benchmark::ClobberMemory();
  }
}

BENCHMARK_CAPTURE(kernel_only, phrase, 8, 4, 4, 32);
BENCHMARK_CAPTURE(kernel_only, decode64, 8, 1, 64, 64);
BENCHMARK_CAPTURE(unprepared, phrase, 8, 4, 4, 32);
BENCHMARK_CAPTURE(planned, phrase, 8, 4, 4, 32);
BENCHMARK_CAPTURE(unprepared, decode64, 8, 1, 64, 64);
BENCHMARK_CAPTURE(planned, decode64, 8, 1, 64, 64);

// ---------------------------------------------------------------------------------------
// Decode over a long cache (1 query × 32 heads × 8192 keys × E 128, all threads): GB/s of
// K and V read once (each K/V head once for grouped-query attention), beside the machine's
// read bandwidth (measured once per process, the `attend bench` probe).
constexpr int64_t kHeads = 32, kKeys = 8192, kDim = 128;

void report_bandwidth(benchmark::State& state, double bytes) {
  static const double probe =
      attend::bench::measure_read_bandwidth(attend::default_num_threads()).gbps;
  state.counters["GB/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["read_probe_GB/s"] = probe;
}

Tensor filled(const Shape& shape, uint32_t seed) {
  Tensor t(DType::kFloat32, shape);
  std::mt19937 random(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (int64_t n = 0; n < t.numel(); ++n) t.data_as<float>()[n] = uniform(random);
  return t;
}

// Contiguous (1, H, 1, E) against (1, Hkv, Lk, E).
void decode_contiguous(benchmark::State& state) {
  const int64_t kv_heads = state.range(0);
  const Tensor q = filled(Shape({1, kHeads, 1, kDim}), 1);
  const Tensor k = filled(Shape({1, kv_heads, kKeys, kDim}), 2);
  const Tensor v = filled(Shape({1, kv_heads, kKeys, kDim}), 3);
  Tensor out(DType::kFloat32, Shape({1, kHeads, 1, kDim}));
  for (auto _ : state) {
    attend::scaled_dot_product_attention_into(q.view(), k.view(), v.view(), out.view(), nullptr);
  }
  report_bandwidth(state, 2.0 * static_cast<double>(kv_heads * kKeys * kDim) * sizeof(float));
}

// The same through paged_attention_into: blocks of state.range(1) tokens, the table in
// order (read in place) or shuffled (gathered).
void decode_paged(benchmark::State& state) {
  const int64_t kv_heads = state.range(0), block_size = state.range(1);
  const bool shuffled = state.range(2) != 0;
  const int64_t blocks = kKeys / block_size;
  const Tensor q = filled(Shape({1, kHeads, kDim}), 1);
  const Tensor k = filled(Shape({blocks, block_size, kv_heads, kDim}), 2);
  const Tensor v = filled(Shape({blocks, block_size, kv_heads, kDim}), 3);
  Tensor table(DType::kInt32, Shape({1, blocks}));
  std::iota(table.data_as<int32_t>(), table.data_as<int32_t>() + blocks, 0);
  if (shuffled) {
    std::shuffle(table.data_as<int32_t>(), table.data_as<int32_t>() + blocks, std::mt19937(5));
  }
  Tensor cu(DType::kInt32, Shape({2})), lens(DType::kInt32, Shape({1}));
  cu.data_as<int32_t>()[0] = 0;
  cu.data_as<int32_t>()[1] = 1;
  lens.data_as<int32_t>()[0] = static_cast<int32_t>(kKeys);
  Tensor out(DType::kFloat32, Shape({1, kHeads, kDim}));
  for (auto _ : state) {
    attend::paged_attention_into(q.view(), cu.view(), k.view(), v.view(), table.view(), lens.view(),
                                 out.view());
  }
  report_bandwidth(state, 2.0 * static_cast<double>(kv_heads * kKeys * kDim) * sizeof(float));
}

BENCHMARK(decode_contiguous)->ArgName("kv_heads")->Arg(32)->Arg(8)->UseRealTime();
BENCHMARK(decode_paged)
    ->ArgNames({"kv_heads", "block", "shuffled"})
    ->Args({32, 16, 0})
    ->Args({32, 16, 1})
    ->Args({32, 64, 1})
    ->Args({8, 16, 1})
    ->UseRealTime();

// ---------------------------------------------------------------------------------------
// A ragged prefill batch: 16 causal sequences of seeded lengths in [64, 4096], 2 heads,
// E 64, all threads: one varlen call, the 16 dense calls one after another (the sum of the
// separate times), and one dense call padded to the longest (top-left causal).
constexpr int64_t kRaggedHeads = 2, kRaggedDim = 64;

std::vector<int64_t> ragged_lengths() {
  std::mt19937 random(16);
  std::vector<int64_t> lengths;
  for (int s = 0; s < 16; ++s)
    lengths.push_back(std::uniform_int_distribution<int64_t>(64, 4096)(random));
  return lengths;
}

void ragged_flops(benchmark::State& state, const std::vector<int64_t>& lengths) {
  double flops = 0;
  for (int64_t l : lengths) {
    flops += attend::attention_flops(kRaggedHeads, l, l, kRaggedDim, kRaggedDim, true);
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void ragged_varlen(benchmark::State& state) {
  const std::vector<int64_t> lengths = ragged_lengths();
  int64_t total = 0;
  for (int64_t l : lengths) total += l;
  const Tensor q = filled(Shape({total, kRaggedHeads, kRaggedDim}), 1);
  const Tensor k = filled(Shape({total, kRaggedHeads, kRaggedDim}), 2);
  const Tensor v = filled(Shape({total, kRaggedHeads, kRaggedDim}), 3);
  Tensor out(DType::kFloat32, q.shape()), cu(DType::kInt32, Shape({17}));
  cu.data_as<int32_t>()[0] = 0;
  for (size_t s = 0; s < lengths.size(); ++s) {
    cu.data_as<int32_t>()[s + 1] = cu.data_as<int32_t>()[s] + static_cast<int32_t>(lengths[s]);
  }
  AttentionOptions options;
  options.causal = true;
  for (auto _ : state) {
    attend::varlen_attention_into(q.view(), k.view(), v.view(), cu.view(), cu.view(), out.view(),
                                  options);
  }
  ragged_flops(state, lengths);
}

void ragged_separate(benchmark::State& state) {
  const std::vector<int64_t> lengths = ragged_lengths();
  std::vector<Tensor> qs, ks, vs, outs;
  for (size_t s = 0; s < lengths.size(); ++s) {
    const Shape shape({kRaggedHeads, lengths[s], kRaggedDim});
    qs.push_back(filled(shape, 1));
    ks.push_back(filled(shape, 2));
    vs.push_back(filled(shape, 3));
    outs.emplace_back(DType::kFloat32, shape);
  }
  AttentionOptions options;
  options.causal = true;
  for (auto _ : state) {
    for (size_t s = 0; s < lengths.size(); ++s) {
      attend::scaled_dot_product_attention_into(qs[s].view(), ks[s].view(), vs[s].view(),
                                                outs[s].view(), nullptr, options);
    }
  }
  ragged_flops(state, lengths);
}

void ragged_padded(benchmark::State& state) {
  const std::vector<int64_t> lengths = ragged_lengths();
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  const Shape shape({16, kRaggedHeads, longest, kRaggedDim});
  const Tensor q = filled(shape, 1), k = filled(shape, 2), v = filled(shape, 3);
  Tensor out(DType::kFloat32, shape);
  AttentionOptions options;
  options.causal = true;
  options.causal_alignment = attend::CausalAlignment::kTopLeft;
  for (auto _ : state) {
    attend::scaled_dot_product_attention_into(q.view(), k.view(), v.view(), out.view(), nullptr,
                                              options);
  }
  ragged_flops(state, lengths);  // the useful FLOPs only
}

BENCHMARK(ragged_varlen)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(ragged_separate)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(ragged_padded)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
