// reduced_precision_support.hpp: what the tests of the reduced-precision products
// (bf16_test.cc, f16_test.cc, sdpa_backward_test.cc) share: rounding to a half precision,
// error measures, one call's results with the kernel that ran it, the check of a refusal's
// message, and the fixture that runs a test on each bfloat16 path.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "boundary/operands.hpp"
#include "cpu_features.hpp"
#include "sdpa_cases.hpp"

namespace attend::test {

// A contiguous copy of `view` in `dtype` (rounded to nearest even).
inline Tensor copy_as(const TensorView& view, DType dtype) {
  Tensor t(dtype, view.shape);
  convert(view, t.view());
  return t;
}

// x rounded to `dtype` (bfloat16 or float16) and back.
inline double round_to(double x, DType dtype) {
  Tensor in(DType::kFloat32, {1});
  in.data_as<float>()[0] = static_cast<float>(x);
  return values_of(copy_as(in.view(), dtype).view())[0];
}

// The largest |got − exact| (NaN where both are NaN counts as equal; a lone NaN as infinite).
inline double max_error(const std::vector<double>& got, const std::vector<double>& exact) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(exact[i]) && std::isnan(got[i])) continue;
    const double e = std::abs(got[i] - exact[i]);
    worst = std::isnan(e) ? INFINITY : std::max(worst, e);
  }
  return worst;
}

// The largest finite magnitude.
inline double max_abs(const std::vector<double>& values) {
  double m = 0;
  for (double x : values) {
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  }
  return m;
}

// Runs `call`, which must throw attend::Error with `fragment` in its message.
template <class Call>
void expect_error(const Call& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no attend::Error (expected one naming \"" << fragment << "\")";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

// One call's output (and weights when asked), as doubles, and the kernel that ran it.
struct Result {
  std::vector<double> output, weights;
  std::string kernel;
};
inline Result run(const TensorView& q, const TensorView& k, const TensorView& v,
                  const AttentionOptions& options) {
  Result r;
  r.kernel = attention_kernel(q, k, v, options);
  const AttentionResult result = scaled_dot_product_attention(q, k, v, options);
  r.output = values_of(result.output.view());
  if (options.need_weights) r.weights = values_of(result.weights.view());
  return r;
}

// One case of the grid three ways: `exact`, the reference on the case's inputs; `naive`, the
// reference on the inputs rounded to `half`, its output rounded to `half` too (input and
// output rounding only); `fused`, the fused backend computing at `compute`.
struct GridRuns {
  Result exact, naive, fused;
};
inline GridRuns run_grid_case(const CaseInputs& in, DType half, ComputePrecision compute) {
  GridRuns runs;
  AttentionOptions exact_options = in.options;
  exact_options.backend = Backend::kReference;
  runs.exact = run(in.query, in.key, in.value, exact_options);
  const Tensor q = copy_as(in.query, half), k = copy_as(in.key, half), v = copy_as(in.value, half);
  runs.naive = run(q.view(), k.view(), v.view(), exact_options);
  for (double& x : runs.naive.output) x = round_to(x, half);
  AttentionOptions options = in.options;
  options.backend = Backend::kFused;
  options.compute = compute;
  runs.fused = run(in.query, in.key, in.value, options);
  return runs;
}

// A test on one bfloat16 path: AVX512_BF16 (GetParam() false) or AMX tiles (true), AMX
// switched on or off for the test's duration (attend::set_amx_enabled); skipped with the
// reason where the CPU lacks the path. Instantiate with Bf16PathName.
class Bf16PathTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (!detail::native_bf16_products()) {
      GTEST_SKIP() << "skipped: " << detail::why_no_bf16_products();
    }
    if (GetParam() && !detail::amx_bf16_products()) {
      GTEST_SKIP() << "skipped: " << detail::why_no_amx_bf16();
    }
    previous_ = amx_enabled();
    set_amx_enabled(GetParam());
  }
  void TearDown() override { set_amx_enabled(previous_); }
  // Whether bfloat16 inputs with the default precision take this path at `site` (the
  // precision policy: on Intel without AMX tiles they take float32 products).
  bool default_takes_this_path(detail::ProductSite site) const {
    return detail::bf16_products(DType::kBFloat16, ComputePrecision::kAuto, site) ==
           (GetParam() ? detail::Bf16Products::kAmxTiles : detail::Bf16Products::kAvx512Bf16);
  }

 private:
  bool previous_ = true;
};
inline std::string Bf16PathName(const ::testing::TestParamInfo<bool>& info) {
  return info.param ? "AmxTiles" : "Avx512Bf16";
}

}  // namespace attend::test
