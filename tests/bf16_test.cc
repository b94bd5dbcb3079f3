// bfloat16 products (ComputePrecision::kBFloat16) over the case grid of
// tests/data/sdpa_cases.txt, on each path the host has: AVX512_BF16 register blocks, and
// AMX-BF16 tiles (attend::set_amx_enabled switches between them) where the CPU and the OS
// have them. Both paths round the same operands (Q, K, V, then P) and add the products in
// float32, so one error model covers both.
//
// Error model (FlashAttention's rule for reduced precision): the fused result's largest error
// against the exact listing (the float64 reference on the case's own inputs) must be at most
// twice the largest error of the same listing computed naively in bfloat16, plus the
// rounding of the weights that the naive listing below leaves out:
//   naive  = bf16(reference(bf16(Q), bf16(K), bf16(V))): input and output rounding only;
//   P term = 2 · 2^-9 · max|v| · keep: the fused kernel rounds each weight to bfloat16
//            (relative 2^-9) before weights·V, moving an output element by at most
//            2^-9 · Σ_j P_j·|v_j| <= 2^-9 · max|v| · keep; doubled as the rest.
// Weights (returned in float32 from the bfloat16 products' scores) get the same rule against
// the naive listing's weights (which are not rounded), with no P term.
// Ill-conditioned cases (scores of size 1e6) are left out, as in the float32 grid.
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
#include "boundary/operands.hpp"
#include "cpu_features.hpp"
#include "reduced_precision_support.hpp"
#include "sdpa_cases.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

constexpr double kBf16HalfUlp = 1.0 / 512.0;  // 2^-9: bfloat16's unit roundoff

double round_bf16(double x) { return round_to(x, DType::kBFloat16); }

Tensor bf16_copy(const TensorView& view) { return copy_as(view, DType::kBFloat16); }

double max_abs(const TensorView& view) { return test::max_abs(values_of(view)); }

// ComputePrecision::kBFloat16 runs (kAuto may still choose float32 products: the precision
// policy, tests/precision_policy_test.cc).
bool bf16_available() { return detail::native_bf16_products(); }

// One bfloat16 path (reduced_precision_support.hpp), and what the kernel's name says for it.
class Bf16Path : public Bf16PathTest {
 protected:
  std::string path_name() const {
    return GetParam() ? "bfloat16 products, AMX tiles" : "bfloat16 products)";
  }
};

INSTANTIATE_TEST_SUITE_P(Bf16Products, Bf16Path, ::testing::Values(false, true), Bf16PathName);

TEST_P(Bf16Path, EveryCaseOfTheGridWithinTwiceTheNaiveError) {
  int native = 0, cases = 0;
  double worst_share = 0;  // of the allowed error, over the cases
  for (const SdpaCase& spec : load_sdpa_cases(ATTEND_TEST_DATA_DIR "/sdpa_cases.txt")) {
    if (spec.ill_conditioned) continue;
    SCOPED_TRACE("case " + spec.name + " (sdpa_cases.txt:" + std::to_string(spec.line) + ")");
    const CaseInputs in = make_case_inputs(spec);
    const GridRuns runs = run_grid_case(in, DType::kBFloat16, ComputePrecision::kBFloat16);
    const Result &exact = runs.exact, &naive = runs.naive, &fused = runs.fused;
    const Tensor qb = bf16_copy(in.query), kb = bf16_copy(in.key), vb = bf16_copy(in.value);
    ++cases;
    if (fused.kernel.find(path_name()) != std::string::npos) {
      ++native;
    } else {
      // Only the decoding kernels keep float32 products on the rounded inputs.
      EXPECT_TRUE(fused.kernel.find("rows") != std::string::npos ||
                  fused.kernel.find("short keys") != std::string::npos ||
                  fused.kernel.find("grouped-query tiles") != std::string::npos)
          << "a query-tile case without bfloat16 products: " << fused.kernel;
    }

    const double keep = 1.0 / (1.0 - spec.dropout);
    const double p_term = 2 * kBf16HalfUlp * max_abs(in.value) * keep;
    const double naive_error = max_error(naive.output, exact.output);
    const double error = max_error(fused.output, exact.output);
    worst_share = std::max(worst_share, error / (2 * naive_error + p_term));
    EXPECT_LE(error, 2 * naive_error + p_term)
        << fused.kernel << ": output error " << error << ", naive bfloat16 " << naive_error;
    if (in.options.need_weights) {
      const double naive_weights = max_error(naive.weights, exact.weights);
      const double weights_error = max_error(fused.weights, exact.weights);
      EXPECT_LE(weights_error, 2 * naive_weights + 1e-30)
          << fused.kernel << ": weights error " << weights_error << ", naive " << naive_weights;
    }

    // bfloat16 inputs with the default precision take the same path where the policy gives
    // it to them, bit for bit, and any thread count gives the same bits.
    if (!default_takes_this_path(detail::ProductSite::kAttention)) continue;
    AttentionOptions automatic = in.options;
    automatic.num_threads = 1;
    const Result from_bf16 = run(qb.view(), kb.view(), vb.view(), automatic);
    EXPECT_EQ(from_bf16.kernel, fused.kernel);
    std::vector<double> fused_rounded = fused.output;
    if (spec.dtype != DType::kFloat32) {
      // The case's own dtype (float16) rounds the output differently from bfloat16.
      continue;
    }
    for (double& x : fused_rounded) x = round_bf16(x);
    for (size_t i = 0; i < fused_rounded.size(); ++i) {
      const double a = fused_rounded[i], b = from_bf16.output[i];
      if (!(a == b || (std::isnan(a) && std::isnan(b)))) {
        ADD_FAILURE() << "bfloat16 inputs differ from rounded float32 inputs at " << i << ": " << b
                      << " vs " << a;
        break;
      }
    }
  }
  std::printf(
      "%s: ran natively on %d of %d cases (the others are decoding shapes: float32 "
      "products on the rounded inputs); the largest output error was %.2f of the allowed\n",
      bf16_compute_path().c_str(), native, cases, worst_share);
  EXPECT_GT(native, cases / 3);  // the grid is mostly prefill shapes
}

TEST_P(Bf16Path, ResultsDoNotDependOnTheThreadCount) {
  const Tensor q = random_tensor({2, 3, 200, 64}, 1, 1.0, DType::kBFloat16);
  const Tensor k = random_tensor({2, 3, 700, 64}, 2, 1.0, DType::kBFloat16);
  const Tensor v = random_tensor({2, 3, 700, 48}, 3, 1.0, DType::kBFloat16);
  AttentionOptions options;
  options.causal = true;
  options.compute = ComputePrecision::kBFloat16;
  options.num_threads = 1;
  const Tensor one = scaled_dot_product_attention(q.view(), k.view(), v.view(), options).output;
  options.num_threads = 2;
  const Tensor two = scaled_dot_product_attention(q.view(), k.view(), v.view(), options).output;
  ASSERT_EQ(std::memcmp(one.data(), two.data(), one.nbytes()), 0);
  EXPECT_NE(attention_kernel(q.view(), k.view(), v.view(), options).find(path_name()),
            std::string::npos);
}

// Half-precision inputs computed in float32 read bfloat16 and float16 K and V as they are
// (the row groups widen them as they load, the query tiles once per thread and batch index):
// bit for bit the float32 path on the widened inputs, on every target, over the grid's
// cases that run in either kernel. Not where the float32 call runs the short-key kernel
// (float32 K and V only: kernels/short_keys.cc), whose results the half-precision call's row
// groups give within float32 rounding (both checked against the listing by the grid).
TEST(HalfKeysValues, GiveTheBitsOfTheWidenedInputs) {
  int half_runs = 0, tile_runs = 0;
  for (const std::string& target : supported_simd_targets()) {
    ScopedSimdCap cap(target);
    for (const SdpaCase& spec : load_sdpa_cases(ATTEND_TEST_DATA_DIR "/sdpa_cases.txt")) {
      const CaseInputs in = make_case_inputs(spec);
      const std::string float32_kernel = attention_kernel(in.query, in.key, in.value, in.options);
      if (float32_kernel.rfind("fused", 0) != 0) continue;
      if (float32_kernel.rfind("fused short keys", 0) == 0) continue;
      for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        SCOPED_TRACE("case " + spec.name + ", " + dtype_name(dtype) + ", target " + target);
        Tensor q(dtype, in.query.shape), k(dtype, in.key.shape), v(dtype, in.value.shape);
        convert(in.query, q.view());
        convert(in.key, k.view());
        convert(in.value, v.view());
        Tensor qw(DType::kFloat32, q.shape()), kw(DType::kFloat32, k.shape()),
            vw(DType::kFloat32, v.shape());
        convert(q.view(), qw.view());
        convert(k.view(), kw.view());
        convert(v.view(), vw.view());
        AttentionOptions options = in.options;
        options.need_logsumexp = true;
        const std::string kernel = attention_kernel(q.view(), k.view(), v.view(), options);
        if (kernel.find("bfloat16 products") != std::string::npos) continue;  // not float32
        half_runs += kernel.find(" K/V)") != std::string::npos;
        tile_runs += kernel.rfind("fused tiles (", 0) == 0;
        const AttentionResult half =
            scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
        const AttentionResult wide =
            scaled_dot_product_attention(qw.view(), kw.view(), vw.view(), options);
        Tensor wide_out(dtype, wide.output.shape());
        convert(wide.output.view(), wide_out.view());
        EXPECT_EQ(std::memcmp(half.output.data(), wide_out.data(), wide_out.nbytes()), 0) << kernel;
        EXPECT_EQ(
            std::memcmp(half.logsumexp.data(), wide.logsumexp.data(), wide.logsumexp.nbytes()), 0)
            << kernel;
        if (options.need_weights) {
          EXPECT_EQ(std::memcmp(half.weights.data(), wide.weights.data(), wide.weights.nbytes()), 0)
              << kernel;
        }
      }
    }
  }
  std::printf("%d runs read half-precision K and V in place, %d of them in query tiles\n",
              half_runs, tile_runs);
  EXPECT_GT(half_runs, 0);
  EXPECT_GT(tile_runs, 0);
}

TEST(Bf16Products, RefusedWhereTheCpuCannotRunThem) {
  const Tensor q = random_tensor({1, 32, 16}, 1);
  AttentionOptions options;  // (float16 products: tests/f16_test.cc)
  options.compute = ComputePrecision::kBFloat16;
  if (!bf16_available()) {  // the CPU lacks AVX512_BF16, or ATTEND_MAX_SIMD caps it away
    expect_error([&] { scaled_dot_product_attention(q.view(), q.view(), q.view(), options); },
                 "needs bfloat16 products");
    return;
  }
  // Capped below AVX-512, the instructions are not used: a clear error, no illegal
  // instruction; bfloat16 inputs with the default precision fall back to float32 products.
  ScopedSimdCap cap("AVX2");
  expect_error([&] { scaled_dot_product_attention(q.view(), q.view(), q.view(), options); },
               "capped below AVX-512");
  const Tensor qb = bf16_copy(q.view());
  EXPECT_EQ(attention_kernel(qb.view(), qb.view(), qb.view()), "fused tiles (bfloat16 K/V)");
}

}  // namespace
}  // namespace attend::test
