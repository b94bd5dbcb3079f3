// Golden test: the library against the seed's attention listing run in PyTorch (float32).
// The data in tests/data/golden comes from scripts/make_golden.py:
//   /usr/bin/python3 scripts/make_golden.py tests/data/golden
// Each case NAME has NAME_{query,key,value}.npy, optionally NAME_mask.npy and NAME_bias.npy,
// and the listing's NAME_output.npy and NAME_weights.npy.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "attend/npy.hpp"
#include "attend/sdpa.hpp"

namespace attend {
namespace {

const std::string kGoldenDir = std::string(ATTEND_TEST_DATA_DIR) + "/golden/";

Tensor load(const std::string& case_name, const std::string& part) {
  return read_npy(kGoldenDir + case_name + "_" + part + ".npy");
}

float max_abs(const Tensor& t) {
  float largest = 0;
  for (int64_t i = 0; i < t.numel(); ++i)
    largest = std::max(largest, std::fabs(t.data_as<float>()[i]));
  return largest;
}

// Tolerances from a rounding-error model, with u = 2^-24 (float32 unit roundoff):
//   A     = max over (batch, i, j) of scale · Σ_e |q_ie · k_je|  +  max |bias|
//           the size of the terms that make up a score;
//   δ     = 4 · u · (sqrt(E) + 2) · A
//           error of one float32 score: an E-term dot product (rounding errors add up like a
//           random walk, sqrt(E)), the scale and the bias add; 4 is a safety factor;
//   ρ     = 2δ + 4 · u · (sqrt(Lk) + 2)
//           relative error of a weight: scores off by δ move exp(s_j - m) / Σ exp by a factor
//           within e^{±2δ}; then exp, the Lk-term sum and the division. Weights are ≤ 1, so
//           ρ also bounds their absolute error;
//   output: max|v| · (ρ + 4 · u · sqrt(Lk))
//           the weights' error times the largest value, plus the Lk-term sum of weights · V.
// Both sides (PyTorch's float32 and ours) contribute; the factor 4 covers both.
struct Tolerances {
  double weights = 0;
  double output = 0;
};

Tolerances tolerances_for(const Tensor& q, const Tensor& k, const Tensor& v,
                          const std::optional<Tensor>& bias) {
  constexpr double kUnitRoundoff = 1.0 / 16777216.0;
  const int64_t head_dim = q.shape().back(0);
  const int64_t query_len = q.shape().back(1);
  const int64_t key_len = k.shape().back(1);
  const int64_t batch = q.numel() / (query_len * head_dim);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  double largest_term = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < query_len; ++i) {
      for (int64_t j = 0; j < key_len; ++j) {
        double sum = 0;
        for (int64_t e = 0; e < head_dim; ++e) {
          sum += std::fabs(q.data_as<float>()[(b * query_len + i) * head_dim + e] *
                           k.data_as<float>()[(b * key_len + j) * head_dim + e]);
        }
        largest_term = std::max(largest_term, scale * sum);
      }
    }
  }
  if (bias) largest_term += max_abs(*bias);
  const double u = kUnitRoundoff;
  const double score_error = 4 * u * (std::sqrt(static_cast<double>(head_dim)) + 2) * largest_term;
  const double weight_error =
      2 * score_error + 4 * u * (std::sqrt(static_cast<double>(key_len)) + 2);
  return {weight_error,
          max_abs(v) * (weight_error + 4 * u * std::sqrt(static_cast<double>(key_len)))};
}

// Compares element by element; on failure names the worst element.
void expect_close(const char* what, const Tensor& got, const Tensor& expected, double tolerance) {
  ASSERT_EQ(got.shape(), expected.shape()) << what;
  ASSERT_EQ(got.dtype(), DType::kFloat32) << what;
  int64_t worst = -1;
  double worst_error = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double error =
        std::fabs(static_cast<double>(got.data_as<float>()[i]) - expected.data_as<float>()[i]);
    if (!(error <= worst_error) || worst < 0) {
      worst_error = error;
      worst = i;
    }
  }
  if (got.numel() == 0) return;
  EXPECT_LE(worst_error, tolerance)
      << what << ": worst element at flat index " << worst << " of " << got.shape().str()
      << ": got " << got.data_as<float>()[worst] << ", expected "
      << expected.data_as<float>()[worst] << ", |difference| " << worst_error << ", tolerance "
      << tolerance;
}

struct GoldenCase {
  const char* name;
  bool has_mask;
  bool has_bias;
};

const GoldenCase kCases[] = {
    {"phrase", false, false},      {"padding", true, false}, {"causal", true, false},
    {"fully_masked", true, false}, {"bias", true, true},     {"odd_dims", false, false},
};

struct Variant {
  Backend backend;
  bool causal_flag_instead_of_mask;  // the "causal" case: options.causal, no mask file
};

std::string describe(const GoldenCase& golden, const Variant& variant) {
  std::ostringstream s;
  s << golden.name << ", backend "
    << (variant.backend == Backend::kReference ? "reference" : "auto")
    << (variant.causal_flag_instead_of_mask ? ", causal flag" : "");
  return s.str();
}

void check_case(const GoldenCase& golden, const Variant& variant) {
  SCOPED_TRACE(describe(golden, variant));
  const Tensor q = load(golden.name, "query");
  const Tensor k = load(golden.name, "key");
  const Tensor v = load(golden.name, "value");
  const Tensor expected_output = load(golden.name, "output");
  const Tensor expected_weights = load(golden.name, "weights");
  std::optional<Tensor> mask, bias;
  AttentionOptions options;
  options.backend = variant.backend;
  options.need_weights = true;
  if (variant.causal_flag_instead_of_mask) {
    options.causal = true;
  } else if (golden.has_mask) {
    mask = load(golden.name, "mask");
    options.mask = mask->view();
  }
  if (golden.has_bias) {
    bias = load(golden.name, "bias");
    options.bias = bias->view();
  }
  const AttentionResult result =
      scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
  const Tolerances tolerance = tolerances_for(q, k, v, bias);
  expect_close("weights", result.weights, expected_weights, tolerance.weights);
  expect_close("output", result.output, expected_output, tolerance.output);
}

TEST(GoldenPyTorch, ReferenceBackendMatchesTheListing) {
  for (const GoldenCase& golden : kCases) check_case(golden, {Backend::kReference, false});
}

TEST(GoldenPyTorch, AutoBackendMatchesTheListing) {
  for (const GoldenCase& golden : kCases) check_case(golden, {Backend::kAuto, false});
}

TEST(GoldenPyTorch, CausalFlagEqualsTheOffsetTrilMask) {
  // The "causal" case's mask is torch.tril(ones(Lq, Lk), diagonal=Lk - Lq) with Lq < Lk.
  const GoldenCase causal = kCases[2];
  ASSERT_EQ(std::string(causal.name), "causal");
  check_case(causal, {Backend::kReference, true});
  check_case(causal, {Backend::kAuto, true});
}

TEST(GoldenPyTorch, FullyMaskedRowsAreUniformAsInTheListing) {
  // Independent of PyTorch: rows (0, 2) and (1, 3) exclude every key, so the listing's
  // weights are 1/Lk and the output row is the mean of V over the keys.
  const Tensor q = load("fully_masked", "query");
  const Tensor k = load("fully_masked", "key");
  const Tensor v = load("fully_masked", "value");  // (2, 5, 6)
  const Tensor mask = load("fully_masked", "mask");
  ASSERT_EQ(mask.dtype(), DType::kInt64);
  for (Backend backend : {Backend::kReference, Backend::kAuto}) {
    AttentionOptions options;
    options.mask = mask.view();
    options.need_weights = true;
    options.backend = backend;
    const AttentionResult result =
        scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
    for (const auto& [batch, row] : {std::pair{0, 2}, std::pair{1, 3}}) {
      for (int j = 0; j < 5; ++j) {
        EXPECT_EQ(mask.data_as<int64_t>()[(batch * 4 + row) * 5 + j], 0);
        EXPECT_FLOAT_EQ(result.weights.data_as<float>()[(batch * 4 + row) * 5 + j], 0.2f);
      }
      for (int column = 0; column < 6; ++column) {
        float mean = 0;
        for (int j = 0; j < 5; ++j) mean += v.data_as<float>()[(batch * 5 + j) * 6 + column] / 5;
        EXPECT_NEAR(result.output.data_as<float>()[(batch * 4 + row) * 6 + column], mean, 1e-6f)
            << "batch " << batch << " row " << row << " column " << column;
      }
    }
  }
}

}  // namespace
}  // namespace attend
