// serving_bench: the per-call cost of attention in a decode loop, prepared (AttentionPlan)
// against unprepared (scaled_dot_product_attention_into) in the same run, one thread:
//   phrase    B=1 H=8 Lq=4 Lk=4 E=32  (the `phrase` case of `attend bench`)
//   decode64  B=1 H=8 Lq=1 Lk=64 E=64 (one token over a 64-key cache)
// Per-call overhead = prepared or unprepared time − kernel_only (the chosen kernel on
// prebuilt parameters); the difference between the two is what a plan saves. Reproduce:
//   build/bench/serving_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "attend/plan.hpp"
#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"
#include "kernels/kernel_list.hpp"
#include "sdpa_boundary.hpp"

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

}  // namespace

BENCHMARK_MAIN();
