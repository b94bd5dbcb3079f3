// float16 products (ComputePrecision::kFloat16, AVX512_FP16: src/kernels/isa/avx512_fp16-inl.h)
// where the host has them; skipped with the reason elsewhere (the refusals run everywhere).
//
// Error model (FlashAttention's rule, as tests/bf16_test.cc, plus what float16 accumulation
// adds): the fused result's largest error against the exact listing (the float64 reference
// on the case's own inputs) must be at most
//   2 · naive + 2 · F · max|v| · keep,
// naive = f16(reference(f16(Q), f16(K), f16(V))): input and output rounding only;
// F = f16_product_terms (f16_error_model.hpp): the weights rounded to float16 before P·V, and
//     the float16 chains of Q·Kᵀ and of P·V (kF16ChainPairs products per lane, then float32),
//     bounded from the chains' length and the operands' norms.
// Weights: 2 · naive + 2 · (relative score term).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "cpu_features.hpp"
#include "f16_error_model.hpp"
#include "kernels/isa/f16_chains.hpp"
#include "reduced_precision_support.hpp"
#include "sdpa_cases.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

constexpr const char* kPathName = "(float16 products)";

// The allowed error of `fused` against `exact` (see the file comment) for problem `problem`
// with its float16-rounded listing `naive`; the share of it used, over the output and weights.
double share_of_allowed(const Result& fused, const Result& exact, const Result& naive,
                        const ReferenceProblem& problem, double keep) {
  const F16ProductTerms terms = f16_product_terms(problem);
  const double allowed = 2 * max_error(naive.output, exact.output) +
                         2 * terms.output * max_abs(problem.value) * keep;
  double share = max_error(fused.output, exact.output) / allowed;
  if (!exact.weights.empty()) {
    const double allowed_weights = 2 * max_error(naive.weights, exact.weights) + 2 * terms.weights;
    share = std::max(share, max_error(fused.weights, exact.weights) / allowed_weights);
  }
  return share;
}

class F16Products : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!detail::native_f16_products()) {
      GTEST_SKIP() << "skipped: " << detail::why_no_f16_products();
    }
  }
};

TEST_F(F16Products, EveryCaseOfTheGridWithinTheErrorModel) {
  int native = 0, cases = 0;
  double worst_share = 0;
  for (const SdpaCase& spec : load_sdpa_cases(ATTEND_TEST_DATA_DIR "/sdpa_cases.txt")) {
    if (spec.ill_conditioned) continue;
    SCOPED_TRACE("case " + spec.name + " (sdpa_cases.txt:" + std::to_string(spec.line) + ")");
    const CaseInputs in = make_case_inputs(spec);
    const GridRuns runs = run_grid_case(in, DType::kFloat16, ComputePrecision::kFloat16);
    const Result& fused = runs.fused;
    ++cases;
    native += fused.kernel.find(kPathName) != std::string::npos;

    const double share =
        share_of_allowed(fused, runs.exact, runs.naive, in.problem, 1.0 / (1.0 - spec.dropout));
    worst_share = std::max(worst_share, share);
    EXPECT_LE(share, 1.0) << fused.kernel;
  }
  std::printf("%s: float16 products on %d of %d cases (the others: decoding shapes, float32 "
              "products on the rounded inputs); the largest error was %.3f of the allowed\n",
              fp16_compute_path().c_str(), native, cases, worst_share);
  EXPECT_GT(native, cases / 2);
}

// Inputs whose Q·Kᵀ chains are exact in float16 (multiples of 1/4 in [-1, 1]: products in
// steps of 1/16, at most 2·kF16ChainPairs = 128 of them per chain, so every partial sum is a
// multiple of 1/16 below 128 in magnitude, which float16 holds exactly), so the scores carry
// no error and the allowed error is the weights' rounding and P·V's chains only: a score
// scale or a packing off by anything shows (scale 1 spreads the scores over ±16).
struct ExactShape {
  int64_t batch, query_len, key_len, head_dim, value_dim;
};
constexpr ExactShape kExactShapes[] = {
    {2, 100, 300, 64, 48},   // a partial query tile, key tiles and a partial one
    {1, 40, 129, 33, 17},    // odd E (a zero half pads the last pair), odd Ev and Lk
    {1, 64, 1000, 128, 128}, // E over two chains, many key tiles
};

Tensor quarters(const Shape& shape, uint32_t seed) {
  Tensor t = random_tensor(shape, seed, 1.0);
  for (int64_t i = 0; i < t.view().numel(); ++i) {
    float& x = t.data_as<float>()[i];
    x = std::round(x * 4.0f) / 4.0f;
  }
  return copy_as(t.view(), DType::kFloat16);
}

TEST_F(F16Products, ExactScoresLeaveOnlyTheWeightsRounding) {
  for (const ExactShape& s : kExactShapes) {
    SCOPED_TRACE("shape " + std::to_string(s.query_len) + "x" + std::to_string(s.key_len) +
                 ", E " + std::to_string(s.head_dim));
    const Tensor q = quarters({s.batch, s.query_len, s.head_dim}, 11);
    const Tensor k = quarters({s.batch, s.key_len, s.head_dim}, 12);
    const Tensor v = random_tensor({s.batch, s.key_len, s.value_dim}, 13, 1.0, DType::kFloat16);
    AttentionOptions options;
    options.scale = 1.0;
    options.causal = s.key_len > 500;
    options.need_weights = true;
    AttentionOptions exact_options = options;
    exact_options.backend = Backend::kReference;
    const Result exact = run(q.view(), k.view(), v.view(), exact_options);
    options.compute = ComputePrecision::kFloat16;
    const Result fused = run(q.view(), k.view(), v.view(), options);
    ASSERT_NE(fused.kernel.find(kPathName), std::string::npos) << fused.kernel;

    // The naive listing on these (float16) inputs is the exact one, rounded to float16.
    const std::vector<double> values = values_of(v.view());
    const double max_v = max_abs(values);
    const int64_t per_chain = 2 * detail::kF16ChainPairs;
    const double value_chains = f16_product_error(s.key_len, max_v) / max_v;
    const double allowed = 2 * (kHalfUnitRoundoff * max_v) +  // the output's rounding, doubled
                           2 * (kHalfUnitRoundoff + s.key_len * kHalfSubnormalRounding +
                                value_chains) * max_v;
    const double error = max_error(fused.output, exact.output);
    EXPECT_LE(error, allowed) << fused.kernel;
    // The scores are exact, so the weights only carry float32's rounding (the float32 model).
    const Tolerances t = sdpa_tolerances(reference_problem(q.view(), k.view(), v.view(), options),
                                         ErrorModelOptions{});
    double weights_share = 0;
    for (size_t i = 0; i < exact.weights.size(); ++i) {
      const int64_t row = static_cast<int64_t>(i) / s.key_len;
      weights_share = std::max(weights_share, std::abs(fused.weights[i] - exact.weights[i]) /
                                                  t.weight(row, exact.weights[i]));
    }
    EXPECT_LE(weights_share, 1.0);
    std::printf("E %lld, Lk %lld: output error %.3g of %.3g allowed (chains of %lld products)\n",
                static_cast<long long>(s.head_dim), static_cast<long long>(s.key_len), error,
                allowed, static_cast<long long>(per_chain));
  }
}

TEST_F(F16Products, ResultsDoNotDependOnTheThreadCount) {
  const Tensor q = random_tensor({2, 3, 200, 128}, 1, 1.0, DType::kFloat16);
  const Tensor k = random_tensor({2, 3, 700, 128}, 2, 1.0, DType::kFloat16);
  const Tensor v = random_tensor({2, 3, 700, 48}, 3, 1.0, DType::kFloat16);
  AttentionOptions options;
  options.causal = true;
  options.compute = ComputePrecision::kFloat16;
  options.num_threads = 1;
  const Tensor one = scaled_dot_product_attention(q.view(), k.view(), v.view(), options).output;
  options.num_threads = 2;
  const Tensor two = scaled_dot_product_attention(q.view(), k.view(), v.view(), options).output;
  ASSERT_EQ(std::memcmp(one.data(), two.data(), one.nbytes()), 0);
  EXPECT_NE(attention_kernel(q.view(), k.view(), v.view(), options).find(kPathName),
            std::string::npos);
}

// Operands whose float16 chains could overflow (2·kF16ChainPairs·max|q|·max|k| > 65504) are
// computed in float32 products on the float16 inputs: finite, within float32's error.
TEST_F(F16Products, OperandsThatCouldOverflowTakeFloat32Products) {
  const Tensor q = random_tensor({1, 64, 64}, 4, 100.0, DType::kFloat16);
  const Tensor k = random_tensor({1, 200, 64}, 5, 100.0, DType::kFloat16);
  const Tensor v = random_tensor({1, 200, 32}, 6, 1.0, DType::kFloat16);
  ASSERT_FALSE(detail::F16ChainsFit(max_abs(values_of(q.view())), max_abs(values_of(k.view()))));
  AttentionOptions options;
  options.scale = 1e-4;  // scores of order 1: a well-conditioned softmax
  options.compute = ComputePrecision::kFloat16;
  const Result fused = run(q.view(), k.view(), v.view(), options);
  EXPECT_EQ(fused.kernel.find(kPathName), std::string::npos) << fused.kernel;
  AttentionOptions exact_options = options;
  exact_options.compute = ComputePrecision::kAuto;
  exact_options.backend = Backend::kReference;
  const Result exact = run(q.view(), k.view(), v.view(), exact_options);
  // float32 products on the same float16 inputs, float16 output: its rounding, and float32's.
  EXPECT_LE(max_error(fused.output, exact.output), 2 * kHalfUnitRoundoff);
}

TEST(F16Refusals, NamedWhereTheyCannotRun) {
  const Tensor q = random_tensor({1, 32, 16}, 1);
  AttentionOptions options;
  options.compute = ComputePrecision::kFloat16;
  if (!detail::native_f16_products()) {
    std::printf("float16 products: %s\n", detail::why_no_f16_products());
    expect_error([&] { scaled_dot_product_attention(q.view(), q.view(), q.view(), options); },
                 "compute precision float16");
    return;
  }
  options.backend = Backend::kReference;
  expect_error([&] { scaled_dot_product_attention(q.view(), q.view(), q.view(), options); },
               "runs on the fused backend");
  // Capped below AVX-512, the instructions are not used: a clear error, no illegal instruction.
  options.backend = Backend::kAuto;
  ScopedSimdCap cap("AVX2");
  expect_error([&] { scaled_dot_product_attention(q.view(), q.view(), q.view(), options); },
               "capped below AVX-512");
}

}  // namespace
}  // namespace attend::test
