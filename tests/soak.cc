// attend_soak: a long randomized run of the fused kernels against the reference, with faults.
// Not part of CI (scripts/soak.sh builds and runs it; SECURITY.md keeps its record).
//
//   attend_soak [--minutes M] [--seed S] [--paths 1]  random problems for M minutes (20)
//   attend_soak --seed S --index I         problem I of seed S again (what a failure prints)
//
// Problem I of seed S comes from a generator seeded with (S, I) alone, so it is the same on
// every run on the same machine. It is one of:
//
//   attention (7 in 10)  A line of the case-file syntax of tests/data/sdpa_cases.txt with
//                        random shapes (0 to 3 batch dimensions, odd head dimensions, Lq and
//                        Lk from 1 to ~1100), mask, bias, causal and its alignment, fully
//                        masked rows, scale, dropout, the score rules (window, ALiBi, softcap,
//                        sinks, documents, prefix), float32 or float16, contiguous or strided
//                        layouts, weights or not. The fused forward, capped at a random
//                        supported SIMD target on 1 to 8 threads, is compared with the
//                        reference backend through the error model (tests/error_model.hpp);
//                        then run again on another thread count, which must give the same
//                        bits. Without dropout and without a float16 bias (whose gradient's
//                        rounding the independent model leaves to sdpa_backward_test), the
//                        fused backward is compared with the independent float64 gradients
//                        as well (dBias only without ALiBi, which the model folds into it).
//                        Ill-conditioned problems (error bound over 1%) are checked for the
//                        thread-count invariance only.
//   allocation (1 in 10) A fused forward or backward while every allocation of at least a
//                        random size (64 KiB and up) fails (malloc and aligned_alloc of this
//                        program are replaced: allocation_fault.hpp): it must succeed (nothing that
//                        large was needed) or throw attend::Error "out of memory", and a run after
//                        it, without the fault, must succeed.
//   overlap (1 in 10)    An output (forward: output or weights; backward: a gradient) placed
//                        over an input at a random offset: attend::Error "overlaps", and no
//                        byte of the buffer holding them changed.
//   truncated (1 in 10)  A .npy or safetensors file of random tensors written, read back whole
//                        (equal), then cut at a random byte: reading it must throw
//                        attend::Error.
//
// With --paths 1 (scripts/soak.sh sets it), half the problems are instead one of the serving
// and reduced-precision paths, each against the independent float64 listing within the error
// model and on two thread counts that must give the same bits:
//   bf16     A random case line with ComputePrecision::kBFloat16 (bfloat16 products where the
//            CPU has them): error at most twice the naive bfloat16 listing's plus the weights'
//            rounding (tests/bf16_test.cc's rule).
//   gqa      A random case line with kv_heads dividing the heads (grouped-query).
//   ragged   varlen_attention_into over 1 to 5 packed sequences, float32, float16 or
//            bfloat16, grouped-query, causal, window, softcap: each sequence against the
//            listing of its dense call.
//   paged    A PagedKvCache of every format (float32, float16, bfloat16, int8, float8_e4m3,
//            float8_e5m2), a random block
//            size, sequences filled by appends in chunks (some forked), a batch of decodes and
//            prefill chunks through attend(): each against the listing over the cache's own
//            stored (dequantized) keys and values.
//   plan     An AttentionPlan with a variable key length run over a growing cache (the key
//            length rising step by step): bitwise the unprepared call, and the listing.
//
// The report gives the counts of each kind and every mismatch with the command reproducing it.
// Exit status 1 when there was any.
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "allocation_fault.hpp"
#include "arguments.hpp"
#include "attend/error.hpp"
#include "attend/kv_cache.hpp"
#include "attend/npy.hpp"
#include "attend/plan.hpp"
#include "attend/runtime.hpp"
#include "attend/safetensors.hpp"
#include "attend/score_rules.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "attend/varlen.hpp"
#include "cpu_features.hpp"
#include "error_model.hpp"
#include "half.hpp"
#include "independent_gradients.hpp"
#include "sdpa_cases.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

using Random = std::mt19937_64;

int64_t uniform(Random& random, int64_t low, int64_t high) {
  return std::uniform_int_distribution<int64_t>(low, high)(random);
}
bool chance(Random& random, double p) { return std::bernoulli_distribution(p)(random); }
template <class T>
const T& pick(Random& random, const std::vector<T>& items) {
  return items[static_cast<size_t>(uniform(random, 0, static_cast<int64_t>(items.size()) - 1))];
}

// A length: mostly short (the row kernel, single tiles), sometimes a few tiles, now and then
// long (several key tiles; with few queries, the key split).
int64_t random_length(Random& random) {
  const int64_t bucket = uniform(random, 0, 9);
  if (bucket < 4) return uniform(random, 1, 9);
  if (bucket < 8) return uniform(random, 10, 140);
  return uniform(random, 141, 1100);
}

// One case line in the syntax of tests/data/sdpa_cases.txt (parsed by parse_sdpa_case).
// grouped: a heads dimension of 2 to 8 and kv_heads dividing it (grouped-query attention).
std::string random_case_line(Random& random, const std::string& name, bool grouped) {
  std::string line = "name=" + name;
  const auto add = [&line](const std::string& key, const std::string& value) {
    line += " " + key + "=" + value;
  };
  std::vector<int64_t> batch(static_cast<size_t>(uniform(random, grouped ? 1 : 0, 3)));
  for (int64_t& d : batch) d = uniform(random, 1, 3);
  int64_t kv_heads = 0;
  if (grouped) {
    kv_heads = uniform(random, 1, 4);
    batch.back() = kv_heads * uniform(random, 2, 4);
  }
  if (!batch.empty()) {
    std::string dims;
    for (int64_t d : batch) dims += (dims.empty() ? "" : "x") + std::to_string(d);
    add("batch", dims);
  }
  // Few queries and many keys now and then: the key split.
  const int64_t query_len = chance(random, 0.15) ? uniform(random, 1, 4) : random_length(random);
  const int64_t key_len = random_length(random);
  add("lq", std::to_string(query_len));
  add("lk", std::to_string(key_len));
  const std::vector<int64_t> dims = {1, 3, 8, 16, 17, 31, 32, 33, 48, 64, 65, 96, 128, 160};
  const int64_t head_dim = chance(random, 0.7) ? pick(random, dims) : uniform(random, 1, 160);
  add("e", std::to_string(head_dim));
  add("ev", std::to_string(chance(random, 0.7) ? head_dim : pick(random, dims)));
  const std::string mask =
      pick(random, std::vector<std::string>{"none", "none", "bool_full", "int32_lqlk",
                                            "uint8_keypad", "int64_query"});
  add("mask", mask);
  if (mask != "none" && chance(random, 0.2)) add("excluded", "1");
  add("bias", pick(random, std::vector<std::string>{"none", "none", "full", "broadcast", "keys"}));
  if (chance(random, 0.35)) add("causal", "1");
  if (chance(random, 0.3)) add("align", "top");
  if (chance(random, 0.2)) add("rows", "zero");
  if (chance(random, 0.15)) add("scale", std::to_string(uniform(random, 1, 200) / 100.0));
  if (chance(random, 0.1)) add("qk", "4");
  if (chance(random, 0.1)) add("v", "100");
  if (chance(random, 0.5)) add("weights", "0");
  if (!batch.empty()) {
    add("layout",
        pick(random, grouped ? std::vector<std::string>{"contiguous", "blhd"}
                             : std::vector<std::string>{"contiguous", "blhd", "shared_kv"}));
  }
  if (grouped) add("kv_heads", std::to_string(kv_heads));
  if (chance(random, 0.3)) add("dtype", "f16");
  if (chance(random, 0.15)) {
    add("dropout", pick(random, std::vector<std::string>{"0.1", "0.3", "0.5", "0.9"}));
    add("seed", std::to_string(uniform(random, 0, 1000000)));
  }
  // The library refuses what means nothing: a right side of the window other than 0 or
  // unbounded with causal, a prefix without causal or a window.
  const bool causal = line.find(" causal=1") != std::string::npos;
  bool window = false;
  if (chance(random, 0.15)) {
    const auto side = [&] {
      return chance(random, 0.2) ? int64_t{-1} : uniform(random, 0, std::max<int64_t>(key_len, 1));
    };
    const int64_t left = side();
    const int64_t right = causal ? (chance(random, 0.5) ? 0 : -1) : side();
    add("window", std::to_string(left) + "," + std::to_string(right));
    window = true;
  }
  if (chance(random, 0.15)) add("alibi", "1");
  if (chance(random, 0.15)) add("softcap", std::to_string(uniform(random, 2, 50)));
  if (chance(random, 0.15)) add("sinks", "1");
  if (key_len >= 2 && chance(random, 0.1)) add("docs", std::to_string(uniform(random, 2, 4)));
  if ((causal || window) && chance(random, 0.15)) {
    add("prefix", std::to_string(uniform(random, 0, key_len)));
  }
  return line;
}

struct Counts {
  int64_t problems = 0;
  int64_t forward = 0, forward_compared = 0, thread_pairs = 0, backward = 0;
  int64_t allocation = 0, allocation_refused = 0, allocation_ran = 0;
  int64_t overlap = 0, truncated_npy = 0, truncated_safetensors = 0;
  // --paths: problems per kind (paged: per cache format), dense listings compared.
  int64_t bf16 = 0, bf16_native = 0, gqa = 0, ragged = 0, plan = 0, plan_steps = 0;
  int64_t listings = 0, ill_conditioned = 0;
  std::map<std::string, int64_t> paged;
  std::vector<std::string> mismatches;
};

// What one problem found wrong (empty: nothing).
struct Findings {
  std::vector<std::string> items;
  void add(const std::string& what) { items.push_back(what); }
};

std::string join_dims(const Shape& shape) { return shape.str(); }

// --- attention ---------------------------------------------------------------------------

struct Outcome {
  std::vector<double> output, weights;
};

Outcome run_forward(const CaseInputs& in, Backend backend, int threads) {
  AttentionOptions options = in.options;
  options.backend = backend;
  options.num_threads = threads;
  const AttentionResult result = scaled_dot_product_attention(in.query, in.key, in.value, options);
  Outcome outcome;
  outcome.output = values_of(result.output.view());
  if (options.need_weights) outcome.weights = values_of(result.weights.view());
  return outcome;
}

bool bitwise_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

void compare(const char* what, const std::vector<double>& got, const std::vector<double>& exact,
             const std::vector<double>& tolerance, Findings& findings) {
  if (got.size() != exact.size()) {
    findings.add(std::string(what) + ": " + std::to_string(got.size()) + " elements, expected " +
                 std::to_string(exact.size()));
    return;
  }
  double worst = 0;
  size_t at = 0;
  for (size_t n = 0; n < got.size(); ++n) {
    const double diff = std::abs(got[n] - exact[n]);
    const double excess = diff == 0 ? 0.0 : diff / tolerance[n];
    if (!(excess <= worst)) {  // NaN counts as worst
      worst = std::isnan(excess) ? INFINITY : excess;
      at = n;
    }
  }
  if (worst > 1.0) {
    char text[160];
    std::snprintf(text, sizeof(text),
                  " worst at flat index %zu: got %.9g, expected %.9g, tolerance %.3g", at, got[at],
                  exact[at], tolerance[at]);
    findings.add(what + std::string(text));
  }
}

void attention_problem(Random& random, const std::string& name, const std::string& target,
                       Counts& counts, Findings& findings, std::string& description,
                       bool grouped = false) {
  const std::string line = random_case_line(random, name, grouped);
  if (grouped) ++counts.gqa;
  const int threads = static_cast<int>(uniform(random, 1, 8));
  const int other_threads = static_cast<int>(uniform(random, 1, 8));
  description = "case '" + line + "', target " + target + ", threads " + std::to_string(threads) +
                " and " + std::to_string(other_threads);
  const SdpaCase spec = parse_sdpa_case(line);
  const CaseInputs in = make_case_inputs(spec);

  // 1. Forward: fused against the reference backend (float64), error model tolerances.
  const Outcome expected = run_forward(in, Backend::kReference, 1);
  Outcome fused, again;
  {
    ScopedSimdCap cap(target);
    fused = run_forward(in, Backend::kFused, threads);
    again = run_forward(in, Backend::kFused, other_threads);
  }
  ++counts.forward;
  ErrorModelOptions model;
  model.dropout = spec.dropout;
  model.half_output = spec.dtype == DType::kFloat16;
  const Tolerances tolerances = sdpa_tolerances(in.problem, model);
  if (tolerances.meaningful()) {
    ++counts.forward_compared;
    const Worst output = worst_element(fused.output, expected.output, in.problem.value_dim,
                                       [&](int64_t row, double) { return tolerances.output[row]; });
    if (!output.ok()) findings.add(describe_worst(output, "output", "e", in.problem));
    if (spec.need_weights) {
      const Worst weights =
          worst_element(fused.weights, expected.weights, in.problem.key_len,
                        [&](int64_t row, double e) { return tolerances.weight(row, e); });
      if (!weights.ok()) findings.add(describe_worst(weights, "weights", "j", in.problem));
    }
  }
  // 2. The same bits on another thread count.
  ++counts.thread_pairs;
  if (!bitwise_equal(fused.output, again.output) || !bitwise_equal(fused.weights, again.weights)) {
    findings.add("results differ between " + std::to_string(threads) + " and " +
                 std::to_string(other_threads) + " threads");
  }

  // 3. Backward: the fused gradients against the independent float64 ones.
  if (spec.dropout > 0 || spec.bias == "keys" || !tolerances.meaningful()) return;
  ++counts.backward;
  Shape grad_shape = Shape::from(in.query.shape.data(), in.query.rank() - 1);
  grad_shape.push_back(in.value.shape.back(0));
  const Tensor grad_output = random_tensor(grad_shape, 1234, 1.0, spec.dtype);
  const GradientCheck check = independent_gradients(in.problem, values_of(grad_output.view()),
                                                    spec.dtype == DType::kFloat16);
  AttentionOptions options = in.options;
  options.backend = Backend::kFused;
  options.num_threads = threads;
  options.need_weights = false;
  options.need_logsumexp = true;
  AttentionGradients gradients;
  {
    ScopedSimdCap cap(target);
    const AttentionResult forward =
        scaled_dot_product_attention(in.query, in.key, in.value, options);
    gradients = scaled_dot_product_attention_backward(grad_output.view(), in.query, in.key,
                                                      in.value, forward.output.view(),
                                                      forward.logsumexp.view(), options);
  }
  compare("dQ", values_of(gradients.query.view()), check.exact.query, check.tolerance.query,
          findings);
  // Grouped-query: the listing's dK and dV are per query head; a K/V head's is its group's sum.
  const int64_t heads = in.query.shape.back(2), kv_heads = in.key.shape.back(2);
  const auto group_sum = [&](const std::vector<double>& per_head) {
    if (kv_heads == heads) return per_head;
    std::vector<double> sum(per_head.size() / static_cast<size_t>(heads / kv_heads), 0.0);
    const size_t rest = per_head.size() / static_cast<size_t>(heads) /
                        static_cast<size_t>(in.problem.batch() / heads);
    for (size_t n = 0; n < per_head.size(); ++n) {
      const size_t outer = n / rest / static_cast<size_t>(heads);
      const size_t h = n / rest % static_cast<size_t>(heads);
      sum[(outer * static_cast<size_t>(kv_heads) + h / static_cast<size_t>(heads / kv_heads)) *
              rest +
          n % rest] += per_head[n];
    }
    return sum;
  };
  compare("dK", values_of(gradients.key.view()), group_sum(check.exact.key),
          group_sum(check.tolerance.key), findings);
  compare("dV", values_of(gradients.value.view()), group_sum(check.exact.value),
          group_sum(check.tolerance.value), findings);
  // With ALiBi the problem's bias holds the slopes' terms too (dense): only a bias of the
  // options has a gradient, so dBias is compared without ALiBi.
  if (!gradients.bias.empty() && !spec.alibi) {
    compare("dBias", values_of(gradients.bias.view()), check.exact.bias, check.tolerance.bias,
            findings);
  }
  if (!check.exact.sinks.empty()) {  // per batch index: summed over each head
    const int64_t heads = gradients.sinks.numel();
    std::vector<double> exact(static_cast<size_t>(heads)), tolerance(exact.size());
    for (size_t b = 0; b < check.exact.sinks.size(); ++b) {
      exact[b % exact.size()] += check.exact.sinks[b];
      tolerance[b % exact.size()] += check.tolerance.sinks[b];
    }
    compare("dSinks", values_of(gradients.sinks.view()), exact, tolerance, findings);
  }
}

// --- the serving and reduced-precision paths (--paths) ------------------------------------

// `got` (the library's output for query, key, value and options, as float64 in row-major
// order; `dtype` the output's) against the independent float64 listing, within the error
// model; bfloat16 by tests/bf16_test.cc's rule (twice the listing's own rounding to bfloat16,
// plus the weights' rounding). Ill-conditioned problems are only counted.
void against_listing(const std::string& what, const std::vector<double>& got,
                     const TensorView& query, const TensorView& key, const TensorView& value,
                     const AttentionOptions& options, DType dtype, Counts& counts,
                     Findings& findings) {
  const ReferenceProblem problem = reference_problem(query, key, value, options);
  ErrorModelOptions model;
  model.half_output = dtype == DType::kFloat16;
  const Tolerances tolerances = sdpa_tolerances(problem, model);
  if (!tolerances.meaningful()) {
    ++counts.ill_conditioned;
    return;
  }
  ++counts.listings;
  const ReferenceResult exact = independent_attention(problem);
  if (dtype == DType::kBFloat16) {
    double rounding = 0, value_max = 0, error = 0;
    for (size_t n = 0; n < exact.output.size(); ++n) {
      const double x = exact.output[n];
      rounding = std::max(
          rounding,
          std::abs(detail::f32_from_bf16(detail::bf16_from_f32(static_cast<float>(x))) - x));
      error = std::max(error, std::isnan(got[n]) ? INFINITY : std::abs(got[n] - x));
    }
    for (double v : problem.value) value_max = std::max(value_max, std::abs(v));
    const double allowed = 2 * rounding + 2.0 / 512.0 * value_max;
    if (!(error <= allowed)) {
      findings.add(what + ": bfloat16 error " + std::to_string(error) + " above the allowed " +
                   std::to_string(allowed));
    }
    return;
  }
  const Worst worst = worst_element(got, exact.output, problem.value_dim,
                                    [&](int64_t row, double) { return tolerances.output[row]; });
  if (!worst.ok()) findings.add(describe_worst(worst, what.c_str(), "e", problem));
}

void same_bits(const std::vector<double>& a, const std::vector<double>& b, int threads,
               int other_threads, Counts& counts, Findings& findings) {
  ++counts.thread_pairs;
  if (!bitwise_equal(a, b)) {
    findings.add("results differ between " + std::to_string(threads) + " and " +
                 std::to_string(other_threads) + " threads");
  }
}

Tensor rounded_copy(const TensorView& view, DType dtype) {
  Tensor t(dtype, view.shape);
  convert(view, t.view());
  return t;
}

double largest_error(const std::vector<double>& got, const std::vector<double>& exact) {
  double worst = 0;
  for (size_t n = 0; n < got.size(); ++n) {
    const double e = std::abs(got[n] - exact[n]);
    worst = std::isnan(e) ? INFINITY : std::max(worst, e);
  }
  return worst;
}

// bfloat16 products: error <= 2·(naive bfloat16 listing's) + 2·2^-9·max|v|·keep.
void bf16_problem(Random& random, const std::string& name, const std::string& target,
                  Counts& counts, Findings& findings, std::string& description) {
  const std::string line = random_case_line(random, name, false);
  const int threads = static_cast<int>(uniform(random, 1, 8));
  const int other_threads = static_cast<int>(uniform(random, 1, 8));
  description = "bf16 products, case '" + line + "', target " + target + ", threads " +
                std::to_string(threads) + " and " + std::to_string(other_threads);
  const SdpaCase spec = parse_sdpa_case(line);
  const CaseInputs in = make_case_inputs(spec);
  ++counts.bf16;
  if (!sdpa_tolerances(in.problem, ErrorModelOptions{}).meaningful()) {
    ++counts.ill_conditioned;
    return;
  }
  AttentionOptions exact_options = in.options;
  exact_options.backend = Backend::kReference;
  exact_options.need_weights = false;
  const std::vector<double> exact = values_of(
      scaled_dot_product_attention(in.query, in.key, in.value, exact_options).output.view());
  const Tensor qb = rounded_copy(in.query, DType::kBFloat16);
  const Tensor kb = rounded_copy(in.key, DType::kBFloat16);
  const Tensor vb = rounded_copy(in.value, DType::kBFloat16);
  std::vector<double> naive = values_of(
      scaled_dot_product_attention(qb.view(), kb.view(), vb.view(), exact_options).output.view());
  for (double& x : naive)
    x = static_cast<double>(detail::f32_from_bf16(detail::bf16_from_f32(static_cast<float>(x))));
  // bfloat16 products where the (capped) target has them; elsewhere bfloat16 inputs, whose
  // default path computes float32 products on them.
  AttentionOptions options = exact_options;
  options.backend = Backend::kFused;
  std::vector<double> fused, again;
  {
    ScopedSimdCap cap(target);
    const bool native = detail::native_bf16_products();
    if (native) ++counts.bf16_native;
    if (native) options.compute = ComputePrecision::kBFloat16;
    const TensorView q = native ? in.query : qb.view(), k = native ? in.key : kb.view(),
                     v = native ? in.value : vb.view();
    options.num_threads = threads;
    fused = values_of(scaled_dot_product_attention(q, k, v, options).output.view());
    options.num_threads = other_threads;
    again = values_of(scaled_dot_product_attention(q, k, v, options).output.view());
  }
  double value_max = 0;
  for (double v : values_of(in.value)) value_max = std::max(value_max, std::abs(v));
  const double allowed =
      2 * largest_error(naive, exact) + 2.0 / 512.0 * value_max / (1.0 - spec.dropout);
  const double error = largest_error(fused, exact);
  if (!(error <= allowed)) {
    findings.add("bfloat16 products: error " + std::to_string(error) + " above the allowed " +
                 std::to_string(allowed));
  }
  same_bits(fused, again, threads, other_threads, counts, findings);
}

// Packed sequences (attend/varlen.hpp), each against its dense call's listing.
void ragged_problem(Random& random, const std::string& target, Counts& counts, Findings& findings,
                    std::string& description) {
  const int64_t batch = uniform(random, 1, 5), kv_heads = uniform(random, 1, 3);
  const int64_t heads = kv_heads * uniform(random, 1, 3);
  const int64_t E = pick(random, std::vector<int64_t>{8, 16, 32, 48, 64, 80, 128});
  const int64_t Ev = chance(random, 0.7) ? E : uniform(random, 1, 96);
  const DType dtype = pick(random, std::vector<DType>{DType::kFloat32, DType::kFloat32,
                                                      DType::kFloat16, DType::kBFloat16});
  AttentionOptions options;
  options.causal = chance(random, 0.5);
  if (chance(random, 0.2))
    options.window =
        SlidingWindow{uniform(random, 0, 64), options.causal ? 0 : uniform(random, 0, 64)};
  if (chance(random, 0.2)) options.softcap = static_cast<float>(uniform(random, 5, 50));
  std::vector<int32_t> cu_q = {0}, cu_k = {0};
  for (int64_t s = 0; s < batch; ++s) {
    const int64_t lk = chance(random, 0.1) ? 0 : random_length(random) % 300 + 1;
    const int64_t lq =
        lk == 0 ? 0 : (chance(random, 0.5) ? uniform(random, 1, 4) : uniform(random, 1, lk));
    cu_q.push_back(cu_q.back() + static_cast<int32_t>(lq));
    cu_k.push_back(cu_k.back() + static_cast<int32_t>(lk));
  }
  const int threads = static_cast<int>(uniform(random, 1, 8));
  const int other_threads = static_cast<int>(uniform(random, 1, 8));
  description = "ragged: " + std::to_string(batch) + " sequences, H " + std::to_string(heads) +
                ", Hkv " + std::to_string(kv_heads) + ", E " + std::to_string(E) + ", Ev " +
                std::to_string(Ev) + ", " + dtype_name(dtype) + (options.causal ? ", causal" : "") +
                (options.window ? ", window" : "") + (options.softcap ? ", softcap" : "") +
                ", total q " + std::to_string(cu_q.back()) + " k " + std::to_string(cu_k.back()) +
                ", threads " + std::to_string(threads) + " and " + std::to_string(other_threads);
  const auto seed = static_cast<uint32_t>(random());
  const Tensor q = random_tensor(Shape({cu_q.back(), heads, E}), seed, 1.0, dtype);
  const Tensor k = random_tensor(Shape({cu_k.back(), kv_heads, E}), seed + 1, 1.0, dtype);
  const Tensor v = random_tensor(Shape({cu_k.back(), kv_heads, Ev}), seed + 2, 1.0, dtype);
  const TensorView cq(cu_q.data(), DType::kInt32, Shape({batch + 1}));
  const TensorView ck(cu_k.data(), DType::kInt32, Shape({batch + 1}));
  Tensor out(dtype, Shape({cu_q.back(), heads, Ev})), out2(dtype, Shape({cu_q.back(), heads, Ev}));
  {
    ScopedSimdCap cap(target);
    options.num_threads = threads;
    varlen_attention_into(q.view(), k.view(), v.view(), cq, ck, out.view(), options);
    options.num_threads = other_threads;
    varlen_attention_into(q.view(), k.view(), v.view(), cq, ck, out2.view(), options);
  }
  ++counts.ragged;
  same_bits(values_of(out.view()), values_of(out2.view()), threads, other_threads, counts,
            findings);
  // Sequence s as a dense (H, L, D) view of the packing.
  const auto sequence = [](const Tensor& t, int64_t start, int64_t length) {
    TensorView v = t.view();
    v.data = static_cast<char*>(v.data) +
             start * v.strides[0] * static_cast<int64_t>(dtype_size(v.dtype));
    v.shape = Shape({v.shape[1], length, v.shape[2]});
    v.strides = Shape({t.view().strides[1], t.view().strides[0], 1});
    return v;
  };
  for (int64_t s = 0; s < batch; ++s) {
    const int64_t q0 = cu_q[static_cast<size_t>(s)], lq = cu_q[static_cast<size_t>(s) + 1] - q0;
    const int64_t k0 = cu_k[static_cast<size_t>(s)], lk = cu_k[static_cast<size_t>(s) + 1] - k0;
    if (lq == 0) continue;
    against_listing("ragged sequence " + std::to_string(s), values_of(sequence(out, q0, lq)),
                    sequence(q, q0, lq), sequence(k, k0, lk), sequence(v, k0, lk), options, dtype,
                    counts, findings);
  }
}

// Keys or values of sequence `id` as stored by the cache, dequantized: float32 (Hkv, L, D).
Tensor stored_sequence(const PagedKvCache& cache, int64_t id, bool values) {
  const KvCacheConfig& c = cache.config();
  const TensorView blocks = values ? cache.value_blocks() : cache.key_blocks();
  const TensorView scales = values ? cache.value_scales() : cache.key_scales();
  const int64_t length = cache.length(id), D = blocks.shape[3];
  const std::vector<int32_t> table = cache.block_table(id);
  Tensor dense(DType::kFloat32, Shape({c.kv_heads, length, D}));
  for (int64_t t = 0; t < length; ++t) {
    const int64_t block = table[static_cast<size_t>(t / c.block_size)], row = t % c.block_size;
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      float* to = dense.data_as<float>() + (h * length + t) * D;
      const int64_t at =
          block * blocks.strides[0] + row * blocks.strides[1] + h * blocks.strides[2];
      TensorView from = blocks;
      from.data = static_cast<char*>(from.data) + at * static_cast<int64_t>(dtype_size(from.dtype));
      from.shape = Shape({D});
      from.strides = Shape({blocks.strides[3]});
      convert(from, TensorView(to, DType::kFloat32, Shape({D})));
      if (scales.data != nullptr) {  // quantized: x = scale·q
        const float scale =
            scales.data_as<const float>()[block * scales.strides[0] + row * scales.strides[1] +
                                          h * scales.strides[2]];
        for (int64_t e = 0; e < D; ++e) to[e] *= scale;
      }
    }
  }
  return dense;
}

// A paged cache of a random format: sequences appended in chunks (some forked), then one
// batch of decodes and prefill chunks, against the listing over the stored keys and values.
void paged_problem(Random& random, const std::string& target, Counts& counts, Findings& findings,
                   std::string& description) {
  KvCacheConfig config;
  config.dtype =
      pick(random, std::vector<DType>{DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                                      DType::kInt8, DType::kFloat8E4M3, DType::kFloat8E5M2});
  config.block_size = pick(random, std::vector<int64_t>{1, 2, 4, 8, 16, 32});
  config.kv_heads = uniform(random, 1, 3);
  config.head_dim = pick(random, std::vector<int64_t>{8, 16, 32, 64, 128});
  config.value_dim = chance(random, 0.8) ? 0 : uniform(random, 1, 64);
  const int64_t heads = config.kv_heads * uniform(random, 1, 4);
  const int64_t Ev = config.value_dim ? config.value_dim : config.head_dim;
  const int64_t batch = uniform(random, 1, 4);
  std::vector<int64_t> lengths;
  int64_t blocks = 0;
  for (int64_t s = 0; s < batch; ++s) {
    lengths.push_back(uniform(random, 1, 260));
    blocks += (lengths.back() + config.block_size - 1) / config.block_size + 1;
  }
  config.num_blocks = blocks;
  AttentionOptions options;
  options.causal = chance(random, 0.6);
  if (chance(random, 0.2)) options.softcap = static_cast<float>(uniform(random, 5, 50));
  const int threads = static_cast<int>(uniform(random, 1, 8));
  const int other_threads = static_cast<int>(uniform(random, 1, 8));
  description = std::string("paged ") + dtype_name(config.dtype) + ": block size " +
                std::to_string(config.block_size) + ", H " + std::to_string(heads) + ", Hkv " +
                std::to_string(config.kv_heads) + ", E " + std::to_string(config.head_dim) +
                ", Ev " + std::to_string(Ev) + ", " + std::to_string(batch) + " sequences" +
                (options.causal ? ", causal" : "") + (options.softcap ? ", softcap" : "") +
                ", threads " + std::to_string(threads) + " and " + std::to_string(other_threads);
  PagedKvCache cache(config);
  std::vector<int64_t> ids;
  for (int64_t s = 0; s < batch; ++s) {
    // Half the time a fork of the previous sequence's first tokens (shared blocks).
    int64_t id = cache.add_sequence();
    int64_t have = 0;
    if (s > 0 && chance(random, 0.5) &&
        cache.length(ids.back()) <= lengths[static_cast<size_t>(s)]) {
      cache.remove_sequence(id);
      id = cache.fork(ids.back());
      have = cache.length(id);
    }
    while (have < lengths[static_cast<size_t>(s)]) {
      const int64_t chunk =
          std::min(lengths[static_cast<size_t>(s)] - have, uniform(random, 1, 64));
      const auto seed = static_cast<uint32_t>(random());
      const Tensor k = random_tensor(Shape({chunk, config.kv_heads, config.head_dim}), seed);
      const Tensor v = random_tensor(Shape({chunk, config.kv_heads, Ev}), seed + 1);
      std::vector<int32_t> cu = {0, static_cast<int32_t>(chunk)};
      cache.append({id}, k.view(), v.view(), TensorView(cu.data(), DType::kInt32, Shape({2})));
      have += chunk;
    }
    ids.push_back(id);
  }
  std::vector<int32_t> cu_q = {0};
  for (int64_t id : ids) {
    const int64_t lq =
        chance(random, 0.6) ? 1 : uniform(random, 1, std::min<int64_t>(cache.length(id), 48));
    cu_q.push_back(cu_q.back() + static_cast<int32_t>(lq));
  }
  const Tensor q =
      random_tensor(Shape({cu_q.back(), heads, config.head_dim}), static_cast<uint32_t>(random()));
  const TensorView cq(cu_q.data(), DType::kInt32, Shape({batch + 1}));
  Tensor out(DType::kFloat32, Shape({cu_q.back(), heads, Ev})), out2(DType::kFloat32, out.shape());
  {
    ScopedSimdCap cap(target);
    options.num_threads = threads;
    cache.attend(ids, q.view(), cq, out.view(), options);
    options.num_threads = other_threads;
    cache.attend(ids, q.view(), cq, out2.view(), options);
  }
  ++counts.paged[dtype_name(config.dtype)];
  same_bits(values_of(out.view()), values_of(out2.view()), threads, other_threads, counts,
            findings);
  for (int64_t s = 0; s < batch; ++s) {
    const int64_t q0 = cu_q[static_cast<size_t>(s)], lq = cu_q[static_cast<size_t>(s) + 1] - q0;
    const auto rows = [&](const Tensor& t) {  // (H, Lq, D) of sequence s
      TensorView v = t.view();
      v.data = static_cast<float*>(v.data) + q0 * v.strides[0];
      v.shape = Shape({v.shape[1], lq, v.shape[2]});
      v.strides = Shape({t.view().strides[1], t.view().strides[0], 1});
      return v;
    };
    const Tensor k = stored_sequence(cache, ids[static_cast<size_t>(s)], false);
    const Tensor v = stored_sequence(cache, ids[static_cast<size_t>(s)], true);
    against_listing("paged sequence " + std::to_string(s), values_of(rows(out)), rows(q), k.view(),
                    v.view(), options, DType::kFloat32, counts, findings);
  }
}

// A plan over a growing key length: each step bitwise the unprepared call; some steps
// against the listing.
void plan_problem(Random& random, const std::string& target, Counts& counts, Findings& findings,
                  std::string& description) {
  const int64_t batch = uniform(random, 1, 2), heads = uniform(random, 1, 8);
  const int64_t lq = chance(random, 0.7) ? 1 : uniform(random, 2, 16);
  const int64_t E = pick(random, std::vector<int64_t>{16, 32, 64, 128});
  const int64_t start = uniform(random, 1, 64), steps = uniform(random, 2, 40);
  const int64_t stride = uniform(random, 1, 16), capacity = start + steps * stride;
  AttentionOptions options;
  options.causal = chance(random, 0.5);
  if (chance(random, 0.2)) options.softcap = static_cast<float>(uniform(random, 5, 50));
  const int threads = static_cast<int>(uniform(random, 1, 8));
  const int other_threads = static_cast<int>(uniform(random, 1, 8));
  options.num_threads = threads;
  description = "plan: batch " + std::to_string(batch) + ", H " + std::to_string(heads) + ", Lq " +
                std::to_string(lq) + ", E " + std::to_string(E) + ", Lk from " +
                std::to_string(start) + " by " + std::to_string(stride) + " for " +
                std::to_string(steps) + " steps" + (options.causal ? ", causal" : "") +
                ", threads " + std::to_string(threads) + " and " + std::to_string(other_threads);
  const auto seed = static_cast<uint32_t>(random());
  const Tensor q = random_tensor(Shape({batch, heads, lq, E}), seed);
  // The cache: (batch, heads, capacity, E), its first Lk positions a view.
  const Tensor k = random_tensor(Shape({batch, heads, capacity, E}), seed + 1);
  const Tensor v = random_tensor(Shape({batch, heads, capacity, E}), seed + 2);
  const auto first = [](const Tensor& t, int64_t length) {
    TensorView view = t.view();
    view.shape[2] = length;
    return view;
  };
  Tensor out(DType::kFloat32, Shape({batch, heads, lq, E})),
      unprepared(DType::kFloat32, out.shape());
  ScopedSimdCap cap(target);
  const AttentionPlan plan(q.view(), first(k, start), first(v, start), out.view(), options, true);
  ++counts.plan;
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t lk = start + step * stride;
    plan.run(q.view(), first(k, lk), first(v, lk), out.view());
    AttentionOptions other = options;
    other.num_threads = other_threads;
    scaled_dot_product_attention_into(
        q.view(), first(k, lk), first(v, lk),
        AttentionOutputViews{unprepared.view(), std::nullopt, std::nullopt}, other);
    ++counts.plan_steps;
    same_bits(values_of(out.view()), values_of(unprepared.view()), threads, other_threads, counts,
              findings);
    if (step % 8 == 0 || step + 1 == steps) {
      against_listing("plan step " + std::to_string(step), values_of(out.view()), q.view(),
                      first(k, lk), first(v, lk), options, DType::kFloat32, counts, findings);
    }
  }
}

// --- allocation faults -------------------------------------------------------------------

void allocation_problem(Random& random, const std::string& name, const std::string& target,
                        Counts& counts, Findings& findings, std::string& description) {
  // Big enough that its tensors and work buffers pass 64 KiB: (B, 256..2048 keys, E 64).
  const std::string line = name + " batch=" + std::to_string(uniform(random, 1, 4)) +
                           "x2 lq=" + std::to_string(uniform(random, 1, 300)) +
                           " lk=" + std::to_string(uniform(random, 256, 2048)) + " e=64 ev=64" +
                           (chance(random, 0.5) ? " weights=0" : "") +
                           (chance(random, 0.3) ? " causal=1" : "");
  const bool backward = chance(random, 0.4);
  const int threads = static_cast<int>(uniform(random, 1, 4));
  const size_t fail_from = size_t{1} << uniform(random, 16, 26);  // 64 KiB to 64 MiB
  description = "case '" + line + "', " + (backward ? "backward" : "forward") + ", target " +
                target + ", threads " + std::to_string(threads) +
                ", allocations >= " + std::to_string(fail_from) + " bytes fail";
  const CaseInputs in = make_case_inputs(parse_sdpa_case(line));
  const Tensor grad_output = random_tensor(Shape::from(in.query.shape.data(), in.query.rank()), 99);
  AttentionOptions options = in.options;
  options.backend = Backend::kFused;
  options.num_threads = threads;
  options.need_logsumexp = backward;
  ScopedSimdCap cap(target);
  const auto call = [&] {
    const AttentionResult forward =
        scaled_dot_product_attention(in.query, in.key, in.value, options);
    if (backward) {
      (void)scaled_dot_product_attention_backward(grad_output.view(), in.query, in.key, in.value,
                                                  forward.output.view(), forward.logsumexp.view(),
                                                  options);
    }
  };
  ++counts.allocation;
  const int64_t failed_before = g_failed_allocations.load();
  try {
    AllocationFault fault(fail_from);
    call();
    ++counts.allocation_ran;
    if (g_failed_allocations.load() != failed_before) {
      findings.add("an allocation failed and the call still reported success");
    }
  } catch (const Error& e) {
    if (std::string(e.what()).find("out of memory") == std::string::npos) {
      findings.add(std::string("attend::Error without \"out of memory\": ") + e.what());
    } else {
      ++counts.allocation_refused;
    }
  } catch (const std::bad_alloc&) {
    findings.add("std::bad_alloc escaped instead of attend::Error");
  } catch (const std::exception& e) {
    findings.add(std::string("unexpected exception: ") + e.what());
  }
  try {
    call();  // the fault left nothing behind
  } catch (const std::exception& e) {
    findings.add(std::string("the call failed after the fault was lifted: ") + e.what());
  }
}

// --- overlapping outputs -----------------------------------------------------------------

void overlap_problem(Random& random, Counts& counts, Findings& findings, std::string& description) {
  // One buffer: query (B, Lq, E), key (B, Lk, E), value (B, Lk, Ev), a float32 mask-free bias
  // (Lq, Lk), then room; an output view starts inside one of them.
  const int64_t B = uniform(random, 1, 3), Lq = uniform(random, 1, 40), Lk = uniform(random, 1, 40);
  const int64_t E = uniform(random, 1, 40), Ev = uniform(random, 1, 40);
  const int64_t q_at = 0, k_at = q_at + B * Lq * E, v_at = k_at + B * Lk * E;
  const int64_t bias_at = v_at + B * Lk * Ev, end = bias_at + Lq * Lk;
  const int64_t output_size = std::max(B * Lq * Ev, B * Lq * Lk);
  // Room after the inputs for any output or gradient that starts inside them.
  std::vector<float> buffer = uniform_values(end + B * (Lq + Lk) * (E + Ev + Lk), 7);
  float* data = buffer.data();
  const TensorView query(data + q_at, Shape({B, Lq, E})), key(data + k_at, Shape({B, Lk, E}));
  const TensorView value(data + v_at, Shape({B, Lk, Ev})), bias(data + bias_at, Shape({Lq, Lk}));
  const std::string output = pick(random, std::vector<std::string>{"output", "weights", "grad"});
  // The backward has no bias here: its gradients are placed over query, key or value.
  const std::string input =
      pick(random, output == "grad" ? std::vector<std::string>{"query", "key", "value"}
                                    : std::vector<std::string>{"query", "key", "value", "bias"});
  const int64_t start = input == "query"   ? q_at
                        : input == "key"   ? k_at
                        : input == "value" ? v_at
                                           : bias_at;
  const int64_t length = input == "query"   ? B * Lq * E
                         : input == "key"   ? B * Lk * E
                         : input == "value" ? B * Lk * Ev
                                            : Lq * Lk;
  const int64_t at = start + uniform(random, 0, length - 1);
  description = "B " + std::to_string(B) + ", Lq " + std::to_string(Lq) + ", Lk " +
                std::to_string(Lk) + ", E " + std::to_string(E) + ", Ev " + std::to_string(Ev) +
                ": " + output + " placed at element " + std::to_string(at - start) + " of " + input;
  const std::vector<float> before = buffer;
  ++counts.overlap;
  std::string message;
  try {
    if (output == "grad") {
      // The gradients of query, key and value; the one of `input` overlaps it.
      std::vector<float> grads(static_cast<size_t>(B * Lq * E + B * Lk * E + B * Lk * Ev));
      TensorView dq(grads.data(), Shape({B, Lq, E}));
      TensorView dk(grads.data() + B * Lq * E, Shape({B, Lk, E}));
      TensorView dv(grads.data() + B * Lq * E + B * Lk * E, Shape({B, Lk, Ev}));
      TensorView* moved = input == "key" ? &dk : input == "value" ? &dv : &dq;
      moved->data = data + at;
      const std::vector<float> lse(static_cast<size_t>(B * Lq));
      const std::vector<float> out(static_cast<size_t>(B * Lq * Ev));
      const std::vector<float> grad_out(static_cast<size_t>(B * Lq * Ev));
      scaled_dot_product_attention_backward_into(
          TensorView(grad_out.data(), Shape({B, Lq, Ev})), query, key, value,
          TensorView(out.data(), Shape({B, Lq, Ev})), TensorView(lse.data(), Shape({B, Lq})),
          AttentionGradientViews{dq, dk, dv, {}, {}});
    } else {
      std::vector<float> elsewhere(static_cast<size_t>(output_size));
      TensorView out(elsewhere.data(), Shape({B, Lq, Ev}));
      TensorView weights(elsewhere.data(), Shape({B, Lq, Lk}));
      std::vector<float> other(static_cast<size_t>(output_size));
      if (output == "output") {
        out.data = data + at;
        weights.data = other.data();
      } else {
        weights.data = data + at;
      }
      AttentionOptions options;
      options.bias = bias;
      options.need_weights = true;
      scaled_dot_product_attention_into(query, key, value, AttentionOutputViews{out, weights, {}},
                                        options);
    }
  } catch (const Error& e) {
    message = e.what();
  }
  if (message.find("overlaps") == std::string::npos) {
    findings.add("not refused as overlapping" + (message.empty() ? "" : ": " + message));
  }
  if (std::memcmp(before.data(), buffer.data(), before.size() * sizeof(float)) != 0) {
    findings.add("the inputs were written");
  }
}

// --- truncated files ---------------------------------------------------------------------

// A tensor of random bytes (bool: 0 or 1); bfloat16 only for safetensors (.npy has none).
Tensor random_file_tensor(Random& random, uint32_t seed, bool bfloat16) {
  Shape shape;
  const int64_t rank = uniform(random, 0, 4);
  for (int64_t d = 0; d < rank; ++d) shape.push_back(uniform(random, 0, 7));
  std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat16, DType::kInt64, DType::kUInt8,
                               DType::kBool};
  if (bfloat16) dtypes.push_back(DType::kBFloat16);
  const DType dtype = pick(random, dtypes);
  Tensor t(dtype, shape);
  std::mt19937 bytes(seed);
  auto* p = static_cast<uint8_t*>(t.data());
  for (size_t n = 0; n < t.nbytes(); ++n) {
    p[n] =
        dtype == DType::kBool ? static_cast<uint8_t>(bytes() & 1) : static_cast<uint8_t>(bytes());
  }
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

void truncated_problem(Random& random, const TemporaryDirectory& directory, Counts& counts,
                       Findings& findings, std::string& description) {
  const bool npy = chance(random, 0.5);
  const std::string path = directory / (npy ? "t.npy" : "t.safetensors");
  std::vector<Tensor> tensors;
  const int64_t count = npy ? 1 : uniform(random, 1, 3);
  for (int64_t n = 0; n < count; ++n) {
    tensors.push_back(random_file_tensor(random, static_cast<uint32_t>(random()), !npy));
  }
  std::map<std::string, TensorView> named;
  if (npy) {
    write_npy(path, tensors[0].view());
  } else {
    for (size_t n = 0; n < tensors.size(); ++n) named["t" + std::to_string(n)] = tensors[n].view();
    save_safetensors(path, named);
  }
  const std::string bytes = read_file_bytes(path);
  const auto cut = static_cast<size_t>(uniform(random, 0, static_cast<int64_t>(bytes.size()) - 1));
  description = std::string(npy ? ".npy" : "safetensors") + " of " + std::to_string(bytes.size()) +
                " bytes (" + join_dims(tensors[0].shape()) + " " + dtype_name(tensors[0].dtype()) +
                (count > 1 ? ", ..." : "") + ") cut at " + std::to_string(cut);
  // Whole: read back equal.
  if (npy) {
    ++counts.truncated_npy;
    if (!same_bytes(read_npy(path), tensors[0])) findings.add("read back different");
  } else {
    ++counts.truncated_safetensors;
    const SafetensorsContents back = load_safetensors(path);
    for (const auto& [tensor_name, view] : named) {
      const auto found = back.tensors.find(tensor_name);
      if (found == back.tensors.end() || !same_bytes(found->second, Tensor::copy_of(view))) {
        findings.add("read back different: " + tensor_name);
      }
    }
  }
  // Cut: refused.
  write_file_bytes(path, bytes.substr(0, cut));
  try {
    if (npy) {
      (void)read_npy(path);
    } else {
      (void)load_safetensors(path);
    }
    findings.add("a truncated file was read without an error");
  } catch (const Error&) {
  }
}

// --- the run -----------------------------------------------------------------------------

struct Settings {
  bool paths = false;  // half the problems on the serving and reduced-precision paths
  double minutes = 20;
  uint64_t seed = 0;
  int64_t index = -1;  // >= 0: that problem only
};

// Runs problem `index` of `seed`; returns what it found.
Findings run_problem(const Settings& settings, int64_t index, const TemporaryDirectory& directory,
                     Counts& counts, std::string& description) {
  std::seed_seq seeds{static_cast<uint32_t>(settings.seed),
                      static_cast<uint32_t>(settings.seed >> 32), static_cast<uint32_t>(index),
                      static_cast<uint32_t>(index >> 32)};
  Random random(seeds);
  const std::vector<std::string> targets = supported_simd_targets();
  const std::string& target = pick(random, targets);
  const std::string name = "soak-" + std::to_string(settings.seed) + "-" + std::to_string(index);
  Findings findings;
  ++counts.problems;
  try {
    if (settings.paths && chance(random, 0.5)) {
      const int64_t path = uniform(random, 0, 4);
      if (path == 0) {
        bf16_problem(random, name, target, counts, findings, description);
      } else if (path == 1) {
        attention_problem(random, name, target, counts, findings, description, true);
      } else if (path == 2) {
        ragged_problem(random, target, counts, findings, description);
      } else if (path == 3) {
        paged_problem(random, target, counts, findings, description);
      } else {
        plan_problem(random, target, counts, findings, description);
      }
      return findings;
    }
    const int64_t kind = uniform(random, 0, 9);
    if (kind < 7) {
      attention_problem(random, name, target, counts, findings, description);
    } else if (kind == 7) {
      allocation_problem(random, "name=" + name, target, counts, findings, description);
    } else if (kind == 8) {
      overlap_problem(random, counts, findings, description);
    } else {
      truncated_problem(random, directory, counts, findings, description);
    }
  } catch (const std::exception& e) {
    findings.add(std::string("unexpected exception: ") + e.what());
  }
  return findings;
}

std::string paged_counts(const Counts& counts) {
  std::string text;
  for (const auto& [format, n] : counts.paged) {
    text += (text.empty() ? "" : ", ") + std::to_string(n) + " " + format;
  }
  return text.empty() ? "none" : text;
}

int run(const Settings& settings) {
  const TemporaryDirectory directory;
  Counts counts;
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed_minutes = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 60;
  };
  const int64_t first = settings.index >= 0 ? settings.index : 0;
  for (int64_t index = first;; ++index) {
    if (settings.index >= 0 ? index > settings.index : elapsed_minutes() >= settings.minutes) break;
    std::string description;
    const Findings findings = run_problem(settings, index, directory, counts, description);
    for (const std::string& finding : findings.items) {
      counts.mismatches.push_back("problem " + std::to_string(index) + " (" + description +
                                  "): " + finding + "\n    reproduce: attend_soak --seed " +
                                  std::to_string(settings.seed) + " --index " +
                                  std::to_string(index));
      std::printf("MISMATCH %s\n", counts.mismatches.back().c_str());
      std::fflush(stdout);
    }
    if (settings.index >= 0) {
      std::printf("problem %lld: %s\n", static_cast<long long>(index), description.c_str());
    }
  }
  std::printf(
      "attend_soak: %.1f min, seed %llu, targets %zu, %lld problems:\n"
      "  attention: %lld forward (%lld compared with the reference, the rest ill-conditioned: "
      "checked for thread-count invariance only), %lld thread-count pairs, %lld backward\n"
      "  allocation faults: %lld (%lld refused with \"out of memory\", %lld needed nothing that "
      "large)\n"
      "  overlapping outputs: %lld; truncated files: %lld .npy, %lld safetensors\n"
      "  paths: %lld bf16 products (%lld on bfloat16 instructions), %lld grouped-query, %lld "
      "ragged, %lld plans (%lld growing-key steps), paged: %s; %lld listings compared, %lld "
      "ill-conditioned\n"
      "  mismatches: %zu\n",
      elapsed_minutes(), static_cast<unsigned long long>(settings.seed),
      supported_simd_targets().size(), static_cast<long long>(counts.problems),
      static_cast<long long>(counts.forward), static_cast<long long>(counts.forward_compared),
      static_cast<long long>(counts.thread_pairs), static_cast<long long>(counts.backward),
      static_cast<long long>(counts.allocation), static_cast<long long>(counts.allocation_refused),
      static_cast<long long>(counts.allocation_ran), static_cast<long long>(counts.overlap),
      static_cast<long long>(counts.truncated_npy),
      static_cast<long long>(counts.truncated_safetensors), static_cast<long long>(counts.bf16),
      static_cast<long long>(counts.bf16_native), static_cast<long long>(counts.gqa),
      static_cast<long long>(counts.ragged), static_cast<long long>(counts.plan),
      static_cast<long long>(counts.plan_steps), paged_counts(counts).c_str(),
      static_cast<long long>(counts.listings), static_cast<long long>(counts.ill_conditioned),
      counts.mismatches.size());
  return counts.mismatches.empty() ? 0 : 1;
}

}  // namespace
}  // namespace attend::test

int main(int argc, char** argv) {
  attend::test::Settings settings;
  settings.seed =
      static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  CLI::App app("attend_soak: random problems, options and faults for a given time", "attend_soak");
  std::string minutes_text, seed_text, index_text, paths_text;
  app.add_option("--minutes", minutes_text, "how long to run, > 0 (default 20)")
      ->type_name("FLOAT");
  app.add_option("--seed", seed_text, "seed of the problems (default: the clock)")
      ->type_name("INT");
  app.add_option("--index", index_text, "run problem INDEX of --seed only (what a failure prints)")
      ->type_name("INT");
  app.add_option("--paths", paths_text,
                 "1: half the problems on the serving and reduced-precision paths (default 0)")
      ->type_name("0|1");
  return attend::support::run_checked(app, argc, argv, [&] {
    if (app.count("--minutes") > 0) {
      settings.minutes = attend::support::parse_number("--minutes", minutes_text);
      if (!(settings.minutes > 0 && settings.minutes <= 1e6)) {
        throw attend::Error("--minutes must be in (0, 1e6], got " + minutes_text);
      }
    }
    if (app.count("--seed") > 0) {
      settings.seed = attend::support::parse_integer("--seed", seed_text, 0, UINT64_MAX);
    }
    if (app.count("--index") > 0) {
      settings.index =
          static_cast<int64_t>(attend::support::parse_integer("--index", index_text, 0, INT64_MAX));
    }
    if (app.count("--paths") > 0) {
      settings.paths = attend::support::parse_integer("--paths", paths_text, 0, 1) == 1;
    }
    return attend::test::run(settings);
  });
}
