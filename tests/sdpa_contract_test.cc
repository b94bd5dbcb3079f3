// The API contract of scaled_dot_product_attention, through the public API only: every bad
// argument gives attend::Error with a message naming it; the documented semantics (default
// scale, causal alignment, strided outputs, empty problems, NaN propagation, thread-count
// independence) hold for the reference backend and for kAuto. Expected values come from
// tests/independent_reference.hpp, never from the library.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"
#include "error_model.hpp"
#include "independent_reference.hpp"
#include "sdpa_cases.hpp"

namespace attend::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInfinity = std::numeric_limits<double>::infinity();

struct Inputs {
  Tensor query, key, value;
};

// Random float32 query (batch..., Lq, E), key (batch..., Lk, E), value (batch..., Lk, Ev).
Inputs random_inputs(const Shape& query_shape, const Shape& key_shape, const Shape& value_shape,
                     uint32_t seed = 1) {
  return {random_tensor(query_shape, seed), random_tensor(key_shape, seed + 1),
          random_tensor(value_shape, seed + 2)};
}

AttentionResult attend(const Inputs& in, const AttentionOptions& options = {}) {
  return scaled_dot_product_attention(in.query.view(), in.key.view(), in.value.view(), options);
}

// The attend::Error message of `call`, or a marker when it throws none.
std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "<no attend::Error>";
}

void expect_error(const std::function<void()>& call, std::initializer_list<const char*> phrases) {
  const std::string message = error_of(call);
  for (const char* phrase : phrases) {
    EXPECT_NE(message.find(phrase), std::string::npos)
        << "message \"" << message << "\" lacks \"" << phrase << "\"";
  }
}

// Worst difference of a result from the independent listing, with the float64 error model
// for the reference backend and the float32 one for kAuto.
void expect_matches_listing(const AttentionResult& got, const ReferenceProblem& problem,
                            Accumulation accumulation, const char* label) {
  const ReferenceResult exact = independent_attention(problem);
  ErrorModelOptions model;
  model.accumulation = accumulation;
  const Tolerances tol = sdpa_tolerances(problem, model);
  const Worst output =
      worst_element(values_of(got.output.view()), exact.output, problem.value_dim,
                    [&](int64_t row, double) { return tol.output[static_cast<size_t>(row)]; });
  EXPECT_TRUE(output.ok()) << label << ": " << describe_worst(output, "output", "e", problem);
  if (!got.weights.empty()) {
    const Worst weights =
        worst_element(values_of(got.weights.view()), exact.weights, problem.key_len,
                      [&](int64_t row, double e) { return tol.weight(row, e); });
    EXPECT_TRUE(weights.ok()) << label << ": " << describe_worst(weights, "weights", "j", problem);
  }
}

// ---------------------------------------------------------------------------------------
// Bad arguments.

TEST(SdpaContract, RankOutsideTwoToSixIsRefused) {
  const Inputs rank1 = random_inputs(Shape({5}), Shape({5}), Shape({5}));
  expect_error([&] { attend(rank1); }, {"query (5,)", "0 to 4 batch dimensions"});
  const Shape rank7({1, 1, 1, 1, 1, 2, 3});
  const Inputs seven = random_inputs(rank7, rank7, rank7);
  expect_error([&] { attend(seven); }, {"query (1, 1, 1, 1, 1, 2, 3)", "0 to 4 batch dimensions"});
}

TEST(SdpaContract, MismatchedShapesAreRefused) {
  const Inputs head_dims = random_inputs(Shape({2, 5, 8}), Shape({2, 7, 4}), Shape({2, 7, 4}));
  expect_error([&] { attend(head_dims); }, {"key (2, 7, 4)", "query (2, 5, 8)", "(E)"});
  const Inputs key_lens = random_inputs(Shape({2, 5, 8}), Shape({2, 7, 8}), Shape({2, 6, 8}));
  expect_error([&] { attend(key_lens); }, {"value (2, 6, 8)", "key (2, 7, 8)", "(Lk)"});
  const Inputs batches = random_inputs(Shape({2, 5, 8}), Shape({3, 7, 8}), Shape({3, 7, 8}));
  expect_error([&] { attend(batches); }, {"batch dimension 0", "query (2, 5, 8)", "key (3, 7, 8)"});
}

TEST(SdpaContract, IntegerQueryIsRefused) {
  const Inputs in = random_inputs(Shape({5, 8}), Shape({7, 8}), Shape({7, 8}));
  std::vector<int32_t> integers(40, 1);
  const TensorView int_query(integers.data(), DType::kInt32, Shape({5, 8}));
  expect_error([&] { scaled_dot_product_attention(int_query, in.key.view(), in.value.view()); },
               {"query", "int32", "not supported"});
}

TEST(SdpaContract, FloatMaskIsRefusedPointingToBias) {
  const Inputs in = random_inputs(Shape({5, 8}), Shape({7, 8}), Shape({7, 8}));
  Tensor float_mask = Tensor::zeros(DType::kFloat32, Shape({5, 7}));
  AttentionOptions options;
  options.mask = float_mask.view();
  expect_error([&] { attend(in, options); }, {"mask", "float32", "bias"});
}

TEST(SdpaContract, MaskAndBiasMustBroadcast) {
  const Inputs in = random_inputs(Shape({2, 5, 8}), Shape({2, 7, 8}), Shape({2, 7, 8}));
  Tensor mask = Tensor::zeros(DType::kBool, Shape({3, 7}));
  AttentionOptions options;
  options.mask = mask.view();
  expect_error([&] { attend(in, options); }, {"mask (3, 7)", "(2, 5, 7)"});

  Tensor bias = Tensor::zeros(DType::kFloat32, Shape({5, 6}));
  options = {};
  options.bias = bias.view();
  expect_error([&] { attend(in, options); }, {"bias (5, 6)", "(2, 5, 7)"});

  Tensor too_many = Tensor::zeros(DType::kBool, Shape({1, 2, 5, 7}));
  options = {};
  options.mask = too_many.view();
  expect_error([&] { attend(in, options); }, {"mask (1, 2, 5, 7)", "more dimensions"});
}

TEST(SdpaContract, OptionsOutOfRangeAreRefused) {
  const Inputs in = random_inputs(Shape({5, 8}), Shape({7, 8}), Shape({7, 8}));
  for (double scale : {kNaN, kInfinity, -kInfinity}) {
    AttentionOptions options;
    options.scale = scale;
    expect_error([&] { attend(in, options); }, {"scale must be finite"});
  }
  for (double dropout : {-0.1, 1.0, kNaN}) {
    AttentionOptions options;
    options.dropout = dropout;
    expect_error([&] { attend(in, options); }, {"dropout must be in [0, 1)"});
  }
  AttentionOptions options;
  options.num_threads = -1;
  expect_error([&] { attend(in, options); }, {"num_threads", "-1"});
}

TEST(SdpaContract, EmptyKeysOrHeadDimensionAreRefused) {
  const Inputs no_keys = random_inputs(Shape({2, 5, 8}), Shape({2, 0, 8}), Shape({2, 0, 8}));
  expect_error([&] { attend(no_keys); }, {"key (2, 0, 8)", "Lk is 0"});
  const Inputs no_dim = random_inputs(Shape({2, 5, 0}), Shape({2, 7, 0}), Shape({2, 7, 8}));
  expect_error([&] { attend(no_dim); }, {"query (2, 5, 0)", "E is 0"});
}

TEST(SdpaContract, IntoRefusesWrongOutputsAndWritesNothing) {
  const Inputs in = random_inputs(Shape({2, 5, 8}), Shape({2, 7, 8}), Shape({2, 7, 6}));
  const auto into = [&](const TensorView& output, const TensorView* weights,
                        const AttentionOptions& options = {}) {
    scaled_dot_product_attention_into(in.query.view(), in.key.view(), in.value.view(), output,
                                      weights, options);
  };
  Tensor wrong_shape = Tensor::zeros(DType::kFloat32, Shape({2, 5, 8}));
  expect_error([&] { into(wrong_shape.view(), nullptr); }, {"output (2, 5, 8)", "(2, 5, 6)"});
  Tensor wrong_dtype = Tensor::zeros(DType::kFloat16, Shape({2, 5, 6}));
  expect_error([&] { into(wrong_dtype.view(), nullptr); }, {"output", "float16", "float32"});

  Tensor output = Tensor::zeros(DType::kFloat32, Shape({2, 5, 6}));
  Tensor weights_wrong = Tensor::zeros(DType::kFloat32, Shape({2, 7, 5}));
  const TensorView weights_wrong_view = weights_wrong.view();
  expect_error([&] { into(output.view(), &weights_wrong_view); },
               {"weights (2, 7, 5)", "(2, 5, 7)"});

  // The output placed over the query's own memory.
  Tensor self = random_tensor(Shape({2, 5, 6}), 9);
  const TensorView self_view = self.view();
  expect_error(
      [&] {
        scaled_dot_product_attention_into(self_view, random_tensor(Shape({2, 7, 6}), 3).view(),
                                          random_tensor(Shape({2, 7, 6}), 4).view(), self_view,
                                          nullptr);
      },
      {"output overlaps the memory of query"});

  // A valid output is left untouched when an option is refused.
  std::vector<float> sentinel(60, 777.0f);
  const TensorView sentinel_view(sentinel.data(), Shape({2, 5, 6}));
  AttentionOptions bad;
  bad.dropout = 1.0;
  expect_error([&] { into(sentinel_view, nullptr, bad); }, {"dropout"});
  for (float s : sentinel) ASSERT_EQ(s, 777.0f);
}

TEST(SdpaContract, WeightsOverTheByteLimitAreRefusedBeforeAllocating) {
  const Inputs in = random_inputs(Shape({1, 64, 4}), Shape({1, 64, 4}), Shape({1, 64, 4}));
  AttentionOptions options;
  options.need_weights = true;
  options.max_weights_bytes = 1000;
  expect_error([&] { attend(in, options); },
               {"weights (1, 64, 64)", "16384 bytes", "max_weights_bytes"});

  // Lq = Lk = 2^20 through zero strides: 4 TiB of weights over the default 16 GiB limit. An
  // attempt to allocate would fail with a different message (or exhaust the machine).
  const int64_t length = int64_t{1} << 20;
  float one = 1.0f;
  const TensorView broadcast(&one, DType::kFloat32, Shape({length, 1}), Shape({0, 0}));
  options = {};
  options.need_weights = true;
  expect_error([&] { scaled_dot_product_attention(broadcast, broadcast, broadcast, options); },
               {"weights (1048576, 1048576)", "max_weights_bytes"});
}

// ---------------------------------------------------------------------------------------
// Semantics.

TEST(SdpaContract, DefaultScaleIsOneOverSqrtE) {
  const Inputs in =
      random_inputs(Shape({2, 3, 9, 16}), Shape({2, 3, 17, 16}), Shape({2, 3, 17, 5}));
  for (const BackendCase& b : kBackends) {
    AttentionOptions options;
    options.backend = b.backend;
    options.need_weights = true;
    const AttentionResult got = attend(in, options);
    ReferenceProblem problem =
        reference_problem(in.query.view(), in.key.view(), in.value.view(), {});
    problem.scale = 0.25;  // 1 / sqrt(16), written out
    expect_matches_listing(got, problem, b.accumulation, b.name);

    // The comparison can tell scales apart: 1/E instead is far outside the tolerance.
    problem.scale = 1.0 / 16;
    const ReferenceResult wrong = independent_attention(problem);
    const Tolerances tol = sdpa_tolerances(problem, {b.accumulation, 0.0, false});
    const Worst worst = worst_element(values_of(got.weights.view()), wrong.weights, 17,
                                      [&](int64_t row, double e) { return tol.weight(row, e); });
    EXPECT_GT(worst.excess, 100.0) << b.name;
  }
}

// Query i sees key j iff j <= i + (Lk − Lq); a row that sees no key is uniform.
TEST(SdpaContract, CausalAlignsToTheEndForShortAndLongQueries) {
  struct Lengths {
    int64_t query_len, key_len;
  };
  for (const Lengths lengths : {Lengths{3, 7}, Lengths{7, 3}, Lengths{5, 5}}) {
    const int64_t Lq = lengths.query_len, Lk = lengths.key_len;
    const Inputs in = random_inputs(Shape({2, Lq, 8}), Shape({2, Lk, 8}), Shape({2, Lk, 4}), 5);
    for (const BackendCase& b : kBackends) {
      SCOPED_TRACE(std::string(b.name) + " Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk));
      AttentionOptions options;
      options.backend = b.backend;
      options.causal = true;
      options.need_weights = true;
      const AttentionResult got = attend(in, options);
      const float* w = got.weights.data_as<float>();
      for (int64_t batch = 0; batch < 2; ++batch) {
        for (int64_t i = 0; i < Lq; ++i) {
          const int64_t last_visible = i + Lk - Lq;  // may be negative: nothing visible
          for (int64_t j = 0; j < Lk; ++j) {
            const float weight = w[(batch * Lq + i) * Lk + j];
            if (last_visible < 0) {
              EXPECT_NEAR(weight, 1.0 / static_cast<double>(Lk), 1e-7) << "i=" << i << " j=" << j;
            } else if (j > last_visible) {
              EXPECT_EQ(weight, 0.0f) << "i=" << i << " j=" << j;
            } else {
              EXPECT_GT(weight, 0.0f) << "i=" << i << " j=" << j;
            }
          }
          if (last_visible == 0) {
            EXPECT_EQ(w[(batch * Lq + i) * Lk], 1.0f) << "one visible key, i=" << i;
          }
        }
      }
      AttentionOptions causal_only;
      causal_only.causal = true;
      expect_matches_listing(
          got, reference_problem(in.query.view(), in.key.view(), in.value.view(), causal_only),
          b.accumulation, b.name);
    }
  }
}

// Output and weights written into (B, L, H, D)-layout and row-padded buffers; nothing
// outside the views is touched; values bitwise equal to the contiguous call.
TEST(SdpaContract, IntoWritesStridedOutputs) {
  const int64_t B = 2, H = 3, Lq = 9, Lk = 17, E = 8, Ev = 5, pad = 2;
  const Inputs in =
      random_inputs(Shape({B, H, Lq, E}), Shape({B, H, Lk, E}), Shape({B, H, Lk, Ev}), 7);
  for (const BackendCase& b : kBackends) {
    SCOPED_TRACE(b.name);
    AttentionOptions options;
    options.backend = b.backend;
    options.need_weights = true;
    const AttentionResult contiguous = attend(in, options);

    const int64_t row = Ev + pad;  // output buffer (B, Lq, H, Ev + pad)
    std::vector<float> output_buffer(static_cast<size_t>(B * Lq * H * row), 777.0f);
    const TensorView output(output_buffer.data(), DType::kFloat32, Shape({B, H, Lq, Ev}),
                            Shape({Lq * H * row, row, H * row, 1}));
    std::vector<float> weights_buffer(static_cast<size_t>(B * H * Lq * (Lk + pad)), 777.0f);
    const TensorView weights(weights_buffer.data(), DType::kFloat32, Shape({B, H, Lq, Lk}),
                             Shape({H * Lq * (Lk + pad), Lq * (Lk + pad), Lk + pad, 1}));
    scaled_dot_product_attention_into(in.query.view(), in.key.view(), in.value.view(), output,
                                      &weights, options);

    const std::vector<double> expected_output = values_of(contiguous.output.view());
    const std::vector<double> got_output = values_of(output);
    ASSERT_EQ(got_output.size(), expected_output.size());
    for (size_t n = 0; n < got_output.size(); ++n)
      ASSERT_EQ(got_output[n], expected_output[n]) << n;
    const std::vector<double> expected_weights = values_of(contiguous.weights.view());
    const std::vector<double> got_weights = values_of(weights);
    for (size_t n = 0; n < got_weights.size(); ++n)
      ASSERT_EQ(got_weights[n], expected_weights[n]) << n;
    for (size_t n = 0; n < output_buffer.size(); ++n) {
      if (static_cast<int64_t>(n) % row >= Ev) {
        ASSERT_EQ(output_buffer[n], 777.0f) << "output padding " << n;
      }
    }
    for (size_t n = 0; n < weights_buffer.size(); ++n) {
      if (static_cast<int64_t>(n) % (Lk + pad) >= Lk) {
        ASSERT_EQ(weights_buffer[n], 777.0f) << "weights padding " << n;
      }
    }
  }
}

TEST(SdpaContract, EmptyBatchOrQueriesGiveEmptyResults) {
  for (const BackendCase& b : kBackends) {
    AttentionOptions options;
    options.backend = b.backend;
    options.need_weights = true;
    const Inputs no_batch = random_inputs(Shape({0, 5, 8}), Shape({0, 7, 8}), Shape({0, 7, 6}));
    AttentionResult result = attend(no_batch, options);
    EXPECT_EQ(result.output.shape(), Shape({0, 5, 6}));
    EXPECT_EQ(result.weights.shape(), Shape({0, 5, 7}));
    const Inputs no_queries = random_inputs(Shape({2, 0, 8}), Shape({2, 7, 8}), Shape({2, 7, 6}));
    result = attend(no_queries, options);
    EXPECT_EQ(result.output.shape(), Shape({2, 0, 6}));
    EXPECT_EQ(result.weights.shape(), Shape({2, 0, 7}));
  }
}

// In the listing a NaN key makes NaN scores for every query; masked_fill(mask == 0, -1e9)
// replaces them where that key is masked, and softmax spreads a remaining NaN over the whole
// row (PyTorch: softmax of a row holding NaN is NaN everywhere). So: rows that see the key
// are NaN in every weight and output element, rows that mask it are exact, other batches
// are untouched.
TEST(SdpaContract, NanKeyPropagatesOnlyToRowsThatSeeIt) {
  const int64_t Lq = 6, Lk = 9, E = 8, Ev = 4, nan_key = 4;
  Inputs in = random_inputs(Shape({2, Lq, E}), Shape({2, Lk, E}), Shape({2, Lk, Ev}), 11);
  in.key.data_as<float>()[nan_key * E + 3] = NAN;  // batch 0, key 4
  Tensor mask(DType::kBool, Shape({Lq, Lk}));
  for (int64_t i = 0; i < Lq; ++i) {
    for (int64_t j = 0; j < Lk; ++j)
      mask.data_as<uint8_t>()[i * Lk + j] = (i % 2 == 0 && j == nan_key) ? 0 : 1;
  }
  for (const BackendCase& b : kBackends) {
    SCOPED_TRACE(b.name);
    AttentionOptions options;
    options.backend = b.backend;
    options.mask = mask.view();
    options.need_weights = true;
    const AttentionResult got = attend(in, options);
    const float* o = got.output.data_as<float>();
    const float* w = got.weights.data_as<float>();
    for (int64_t batch = 0; batch < 2; ++batch) {
      for (int64_t i = 0; i < Lq; ++i) {
        const bool sees_nan = batch == 0 && i % 2 == 1;
        for (int64_t e = 0; e < Ev; ++e) {
          EXPECT_EQ(std::isnan(o[(batch * Lq + i) * Ev + e]), sees_nan)
              << "b=" << batch << " i=" << i;
        }
        for (int64_t j = 0; j < Lk; ++j) {
          EXPECT_EQ(std::isnan(w[(batch * Lq + i) * Lk + j]), sees_nan)
              << "b=" << batch << " i=" << i;
        }
      }
    }
    AttentionOptions masked;
    masked.mask = mask.view();
    expect_matches_listing(
        got, reference_problem(in.query.view(), in.key.view(), in.value.view(), masked),
        b.accumulation, b.name);
  }
}

// mask == 0 excludes, any other value keeps, whatever its width: 256 or -256 in an int32
// mask must not be truncated to a zero byte.
TEST(SdpaContract, EveryNonzeroIntegerMaskValueKeeps) {
  const int64_t Lq = 4, Lk = 6;
  const Inputs in = random_inputs(Shape({Lq, 8}), Shape({Lk, 8}), Shape({Lk, 3}), 13);
  const int32_t values[] = {256, 0, -256, 65536, 512, 1};
  Tensor mask(DType::kInt32, Shape({Lk}));
  for (int64_t j = 0; j < Lk; ++j) mask.data_as<int32_t>()[j] = values[j];
  for (const BackendCase& b : kBackends) {
    AttentionOptions options;
    options.backend = b.backend;
    options.mask = mask.view();
    options.need_weights = true;
    const AttentionResult got = attend(in, options);
    for (int64_t i = 0; i < Lq; ++i) {
      for (int64_t j = 0; j < Lk; ++j) {
        const float weight = got.weights.data_as<float>()[i * Lk + j];
        if (values[j] == 0) {
          EXPECT_EQ(weight, 0.0f) << b.name << " key " << j;
        } else {
          EXPECT_GT(weight, 0.0f) << b.name << " key " << j << " with mask value " << values[j];
        }
      }
    }
    AttentionOptions masked;
    masked.mask = mask.view();
    expect_matches_listing(
        got, reference_problem(in.query.view(), in.key.view(), in.value.view(), masked),
        b.accumulation, b.name);
  }
}

TEST(SdpaContract, ResultsDoNotDependOnTheThreadCount) {
  const Inputs in =
      random_inputs(Shape({2, 3, 65, 32}), Shape({2, 3, 129, 32}), Shape({2, 3, 129, 24}), 17);
  Tensor bias = random_tensor(Shape({65, 129}), 19);
  for (const BackendCase& b : kBackends) {
    AttentionOptions options;
    options.backend = b.backend;
    options.causal = true;
    options.bias = bias.view();
    options.need_weights = true;
    options.num_threads = 1;
    const AttentionResult one = attend(in, options);
    for (int threads : {2, 3}) {
      options.num_threads = threads;
      const AttentionResult many = attend(in, options);
      EXPECT_EQ(std::memcmp(one.output.data(), many.output.data(), one.output.nbytes()), 0)
          << b.name << ": output differs between 1 and " << threads << " threads";
      EXPECT_EQ(std::memcmp(one.weights.data(), many.weights.data(), one.weights.nbytes()), 0)
          << b.name << ": weights differ between 1 and " << threads << " threads";
    }
  }
}

// Few queries over many keys run as key chunks merged afterwards (the fused kernel's key
// split): the chunks follow from the shape, so the bits do not depend on the thread count.
TEST(SdpaContract, KeySplitResultsDoNotDependOnTheThreadCount) {
  Tensor mask(DType::kBool, Shape({3000}));
  for (int64_t j = 0; j < 3000; ++j) mask.data_as<uint8_t>()[j] = j % 7 != 3;
  // One query per head (row groups), then 100 (query tiles).
  for (int64_t queries : {1, 100}) {
    const Inputs in =
        random_inputs(Shape({3, queries, 64}), Shape({3, 3000, 64}), Shape({3, 3000, 40}), 23);
    AttentionOptions options;
    options.mask = mask.view();
    options.causal = queries > 1;
    options.dropout = 0.2f;
    options.seed = 77;
    options.need_logsumexp = true;
    options.num_threads = 1;
    const AttentionResult one = attend(in, options);
    for (int threads : {2, 3, 5}) {
      options.num_threads = threads;
      const AttentionResult many = attend(in, options);
      EXPECT_EQ(std::memcmp(one.output.data(), many.output.data(), one.output.nbytes()), 0)
          << "Lq " << queries << ": output differs between 1 and " << threads << " threads";
      EXPECT_EQ(std::memcmp(one.logsumexp.data(), many.logsumexp.data(), one.logsumexp.nbytes()), 0)
          << "Lq " << queries << ": log-sum-exp differs between 1 and " << threads << " threads";
    }
  }
}

}  // namespace
}  // namespace attend::test
