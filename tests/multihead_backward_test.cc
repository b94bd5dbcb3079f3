// multihead_backward_test: MultiHeadAttention::backward against PyTorch autograd goldens
// (scripts/make_mha_grad_golden.py), central finite differences, thread-count determinism,
// dropout and error messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/multihead.hpp"
#include "attend/runtime.hpp"
#include "attend/safetensors.hpp"
#include "test_support.hpp"

namespace attend {
namespace {

const std::string kDataDir = std::string(ATTEND_TEST_DATA_DIR) + "/mha_grad/";

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, double{std::abs(t.data_as<float>()[i])});
  return m;
}

// got ≈ expected elementwise within `tolerance`; prints the worst element on failure.
void expect_close(const Tensor& got, const Tensor& expected, double tolerance,
                  const std::string& what) {
  ASSERT_FALSE(got.empty()) << what << ": no gradient returned";
  ASSERT_EQ(got.shape(), expected.shape()) << what;
  ASSERT_EQ(got.dtype(), DType::kFloat32) << what;
  ASSERT_EQ(expected.dtype(), DType::kFloat32) << what;
  const float* g = got.data_as<float>();
  const float* e = expected.data_as<float>();
  double worst_error = 0;
  int64_t worst = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double error = std::abs(double{g[i]} - double{e[i]});
    if (!(error <= worst_error)) {  // also catches NaN
      worst_error = std::isnan(error) ? INFINITY : error;
      worst = i;
    }
  }
  EXPECT_LE(worst_error, tolerance)
      << what << ": worst element " << worst << " of shape " << got.shape().str() << ": got "
      << g[worst] << ", expected " << e[worst] << ", tolerance " << tolerance;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

// A float32 0/1 mask from the golden file as uint8 (attend's convention: zero excludes).
Tensor as_uint8_mask(const Tensor& mask) {
  Tensor result(DType::kUInt8, mask.shape());
  for (int64_t i = 0; i < mask.numel(); ++i) {
    result.data_as<uint8_t>()[i] = mask.data_as<float>()[i] != 0.0f ? 1 : 0;
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// Golden gradients from PyTorch autograd (float64, for the float32 inputs and parameters).

struct GoldenCase {
  MultiHeadAttention module{1, 1};
  std::map<std::string, Tensor> tensors;
  Tensor key_padding_mask, attn_mask;
  MultiHeadForwardOptions options;

  TensorView query() const { return tensors.at("query").view(); }
  // A missing key means key = query (the same view); a missing value, value = key.
  TensorView key() const { return tensors.count("key") ? tensors.at("key").view() : query(); }
  TensorView value() const { return tensors.count("value") ? tensors.at("value").view() : key(); }
};

GoldenCase load_case(const std::string& name) {
  GoldenCase c;
  SafetensorsContents contents = load_safetensors(kDataDir + name + ".safetensors");
  const auto& meta = contents.metadata;
  c.tensors = std::move(contents.tensors);
  MultiHeadOptions module_options;
  module_options.kdim = std::stoll(meta.at("kdim"));
  module_options.vdim = std::stoll(meta.at("vdim"));
  module_options.bias = meta.at("bias") == "1";
  c.module = MultiHeadAttention(c.tensors.at("query").shape().back(0),
                                std::stoll(meta.at("num_heads")), module_options, 99);
  c.module.load_state_dict(c.tensors);
  c.options.causal = meta.at("causal") == "1";
  c.options.need_weights = false;
  if (c.tensors.count("key_padding_mask")) {
    c.key_padding_mask = as_uint8_mask(c.tensors.at("key_padding_mask"));
    c.options.key_padding_mask = c.key_padding_mask.view();
  }
  if (c.tensors.count("attn_mask")) {
    c.attn_mask = as_uint8_mask(c.tensors.at("attn_mask"));
    c.options.attn_mask = c.attn_mask.view();
  }
  return c;
}

struct GoldenParam {
  const char* case_name;
  Backend backend;
};

void PrintTo(const GoldenParam& param, std::ostream* os) {
  *os << param.case_name << (param.backend == Backend::kReference ? " (reference)" : " (auto)");
}

class GoldenGradients : public ::testing::TestWithParam<GoldenParam> {};

// Tolerance: the golden is the exact gradient of the float32 data (float64 autograd, rounded
// once); ours is computed in float32. Each element passes through about ten float32 stages
// (in_proj, scores, softmax, weights·V, out_proj and their transposed products), each a sum
// of at most max(E, S, N·L) ≤ 16 terms: first-order rounding γ_16 ≈ 1e-6 of the terms'
// magnitude per stage, ~1e-5 after ten, and on these small random problems the terms are of
// the size of the largest gradient. Hence 1e-5·max|g| per tensor (observed: ≤ 4e-7·max|g|),
// plus 1e-6 absolute for tensors whose gradients are all tiny. A wrong term, sign, scale or
// mask errs by a sizeable fraction of max|g|, which is of order 0.1 to 10 in every case.
constexpr double kRelativeTolerance = 1e-5, kAbsoluteTolerance = 1e-6;

TEST_P(GoldenGradients, MatchesAutograd) {
  const std::string name = GetParam().case_name;
  GoldenCase c = load_case(name);
  c.options.backend = GetParam().backend;
  MultiHeadTape tape;
  const MultiHeadResult result = c.module.forward(c.query(), c.key(), c.value(), c.options, &tape);
  const Tensor& expected_output = c.tensors.at("output");
  expect_close(result.output, expected_output,
               kRelativeTolerance * max_abs(expected_output) + kAbsoluteTolerance,
               name + " output");

  const MultiHeadGradients gradients = c.module.backward(
      c.tensors.at("grad_output").view(), c.query(), c.key(), c.value(), tape, c.options);
  auto check = [&](const Tensor& got, const std::string& golden_name) {
    const Tensor& expected = c.tensors.at(golden_name);
    expect_close(got, expected, kRelativeTolerance * max_abs(expected) + kAbsoluteTolerance,
                 name + " " + golden_name);
  };
  check(gradients.query, "grad.query");
  // One gradient per distinct input: key and value are empty when they were the query's view.
  if (c.tensors.count("grad.key")) {
    check(gradients.key, "grad.key");
  } else {
    EXPECT_TRUE(gradients.key.empty()) << name;
  }
  if (c.tensors.count("grad.value")) {
    check(gradients.value, "grad.value");
  } else {
    EXPECT_TRUE(gradients.value.empty()) << name;
  }
  const auto parameters = c.module.state_dict();
  EXPECT_EQ(gradients.parameters.size(), parameters.size()) << name;
  for (const auto& [parameter, view] : parameters) {
    const auto found = gradients.parameters.find(parameter);
    ASSERT_NE(found, gradients.parameters.end()) << name << ": no gradient for " << parameter;
    check(found->second, "grad." + parameter);
  }
}

std::string golden_name(const ::testing::TestParamInfo<GoldenParam>& info) {
  return std::string(info.param.case_name) +
         (info.param.backend == Backend::kReference ? "_reference" : "_auto");
}

constexpr const char* kGoldenCases[] = {
    "self_packed", "cross",   "cross_shared_memory",    "kdim_vdim",
    "key_padding", "causal",  "causal_cross_kdim",      "attn_mask_per_head",
    "unbatched",   "no_bias", "unbatched_self_no_bias",
};

std::vector<GoldenParam> golden_params() {
  std::vector<GoldenParam> params;
  for (const char* name : kGoldenCases) {
    params.push_back({name, Backend::kAuto});
    params.push_back({name, Backend::kReference});
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenGradients, ::testing::ValuesIn(golden_params()), golden_name);

// ---------------------------------------------------------------------------------------------
// A small random problem owned by the test: module, inputs, masks, grad_output.

struct Problem {
  MultiHeadAttention module{1, 1};
  Tensor query, key, value, key_padding_mask, grad_output;
  bool self_attention = false;
  MultiHeadForwardOptions options;

  TensorView q() const { return query.view(); }
  TensorView k() const { return self_attention ? q() : key.view(); }
  TensorView v() const { return self_attention ? q() : value.view(); }

  MultiHeadGradients run(MultiHeadTape* tape_out = nullptr) const {
    MultiHeadTape tape;
    module.forward(q(), k(), v(), options, &tape);
    MultiHeadGradients g = module.backward(grad_output.view(), q(), k(), v(), tape, options);
    if (tape_out) *tape_out = std::move(tape);
    return g;
  }
};

// Self-attention (packed in_proj) when kdim == vdim == 0 and self_attention, else cross-
// attention; key_padding_mask pads the last `padding` keys of batch item 1.
Problem make_problem(int64_t embed_dim, int64_t heads, int64_t batch, int64_t query_len,
                     int64_t key_len, bool self_attention, int64_t kdim, int64_t vdim,
                     int64_t padding, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p;
  MultiHeadOptions module_options;
  module_options.kdim = kdim;
  module_options.vdim = vdim;
  p.module = MultiHeadAttention(embed_dim, heads, module_options, seed);
  // Nonzero biases and a larger out_proj so that every parameter's gradient matters.
  for (auto& [name, view] : p.module.state_dict()) {
    std::uniform_real_distribution<float> uniform(-0.5f, 0.5f);
    for (int64_t i = 0; i < view.numel(); ++i) view.data_as<float>()[i] = uniform(rng);
  }
  p.self_attention = self_attention;
  p.query = test::random_tensor(Shape({batch, query_len, embed_dim}), rng());
  if (self_attention) key_len = query_len;
  if (!self_attention) {
    p.key = test::random_tensor(Shape({batch, key_len, kdim ? kdim : embed_dim}), rng());
    p.value = test::random_tensor(Shape({batch, key_len, vdim ? vdim : embed_dim}), rng());
  }
  if (padding > 0) {
    p.key_padding_mask = Tensor::zeros(DType::kUInt8, Shape({batch, key_len}));
    for (int64_t n = 0; n < batch; ++n) {
      for (int64_t j = 0; j < key_len; ++j) {
        p.key_padding_mask.data_as<uint8_t>()[n * key_len + j] =
            (n == 1 && j >= key_len - padding) ? 0 : 1;
      }
    }
    p.options.key_padding_mask = p.key_padding_mask.view();
  }
  p.grad_output = test::random_tensor(Shape({batch, query_len, embed_dim}), rng());
  p.options.need_weights = false;
  return p;
}

// ---------------------------------------------------------------------------------------------
// Finite differences: the directional derivative of loss = Σ output ⊙ G along a random
// direction U of one tensor, (loss(x + hU) − loss(x − hU)) / 2h, against Σ grad ⊙ U.

double loss_of(const Problem& p) {
  const MultiHeadResult result = p.module.forward(p.q(), p.k(), p.v(), p.options);
  double loss = 0;
  for (int64_t i = 0; i < result.output.numel(); ++i) {
    loss += double{result.output.data_as<float>()[i]} * double{p.grad_output.data_as<float>()[i]};
  }
  return loss;
}

// Checks the gradient of `target` (a writable float32 view of an input or a parameter).
void check_directional_derivative(const Problem& p, const TensorView& target,
                                  const Tensor& gradient, const std::string& what, uint32_t seed) {
  ASSERT_FALSE(gradient.empty()) << what;
  ASSERT_EQ(gradient.shape(), target.shape) << what;
  std::mt19937 rng(seed);
  const Tensor direction = test::random_tensor(target.shape, rng());
  const Tensor saved = Tensor::copy_of(target);
  float* x = target.data_as<float>();
  const float* u = direction.data_as<float>();
  double analytic = 0, magnitude = 0;
  for (int64_t i = 0; i < gradient.numel(); ++i) {
    analytic += double{gradient.data_as<float>()[i]} * u[i];
    magnitude += std::abs(double{gradient.data_as<float>()[i]} * u[i]);
  }
  // h = 2.5e-3: the truncation error h²/6·f''' shrinks with h² (1e-2 gives 1e-2 on the
  // in_proj weights, 2.5e-3 gives 1e-4), while float32 rounding of the loss (~1e-6 absolute,
  // and of the perturbed inputs) divided by 2h grows as h shrinks: 2.5e-3 balances the two,
  // both near 1e-4.
  const double h = 2.5e-3;
  auto loss_at = [&](double t) {
    for (int64_t i = 0; i < target.numel(); ++i) {
      x[i] = static_cast<float>(saved.data_as<float>()[i] + t * u[i]);
    }
    return loss_of(p);
  };
  const double numeric = (loss_at(h) - loss_at(-h)) / (2 * h);
  std::memcpy(x, saved.data(), saved.nbytes());
  // Tolerance: 0.1% of Σ|g·u| (3.6 to 70 here; a wrong term, sign or scale on a fraction of
  // the elements changes the derivative along a random direction by far more) plus 3e-4 for
  // the noise above (observed: ≤ 1e-4).
  const double tolerance = 1e-3 * magnitude + 3e-4;
  EXPECT_NEAR(numeric, analytic, tolerance)
      << what << ": finite difference " << numeric << ", backward " << analytic
      << " (Σ|g·u| = " << magnitude << ")";
}

void check_all_directional_derivatives(Problem& p) {
  const MultiHeadGradients g = p.run();
  check_directional_derivative(p, p.query.view(), g.query, "query", 1);
  if (!p.self_attention) {
    check_directional_derivative(p, p.key.view(), g.key, "key", 2);
    check_directional_derivative(p, p.value.view(), g.value, "value", 3);
  } else {
    EXPECT_TRUE(g.key.empty());
    EXPECT_TRUE(g.value.empty());
  }
  uint32_t seed = 10;
  for (const auto& [name, view] : p.module.state_dict()) {
    const auto found = g.parameters.find(name);
    ASSERT_NE(found, g.parameters.end()) << name;
    check_directional_derivative(p, view, found->second, name, seed++);
  }
}

TEST(FiniteDifferences, SelfAttentionPackedCausal) {
  Problem p = make_problem(8, 2, 2, 4, 4, true, 0, 0, 0, 21);
  p.options.causal = true;
  check_all_directional_derivatives(p);
}

TEST(FiniteDifferences, CrossAttentionUnpackedPaddingDropout) {
  // kdim and vdim differ from E (separate q/k/v_proj_weight); a padded key; dropout with a
  // fixed seed is a fixed mask, so the loss stays smooth and the derivative checks the
  // backward's regenerated dropout.
  Problem p = make_problem(8, 2, 2, 3, 5, false, 6, 5, 2, 22);
  p.options.dropout = 0.3;
  p.options.seed = 1234;
  check_all_directional_derivatives(p);
}

// Grouped-query attention (num_kv_heads): separate q/k/v projections with fewer K/V rows.
void use_grouped_module(Problem& p, int64_t embed_dim, int64_t heads, int64_t kv_heads,
                        int64_t kdim, int64_t vdim, uint32_t seed) {
  MultiHeadOptions options;
  options.kdim = kdim;
  options.vdim = vdim;
  options.num_kv_heads = kv_heads;
  p.module = MultiHeadAttention(embed_dim, heads, options, seed);
  std::mt19937 rng(seed);
  for (auto& [name, view] : p.module.state_dict()) {
    std::uniform_real_distribution<float> uniform(-0.5f, 0.5f);
    for (int64_t i = 0; i < view.numel(); ++i) view.data_as<float>()[i] = uniform(rng);
  }
}

TEST(FiniteDifferences, GroupedQuerySelfAttentionCausal) {
  Problem p = make_problem(8, 4, 2, 4, 4, true, 0, 0, 0, 23);
  use_grouped_module(p, 8, 4, 2, 0, 0, 23);
  p.options.causal = true;
  EXPECT_EQ(p.module.k_proj_weight().shape, Shape({4, 8}));  // Hkv·D = 2·2
  check_all_directional_derivatives(p);
}

TEST(FiniteDifferences, MultiQueryCrossAttentionPadding) {
  Problem p = make_problem(8, 2, 2, 3, 5, false, 6, 5, 2, 24);
  use_grouped_module(p, 8, 2, 1, 6, 5, 24);
  check_all_directional_derivatives(p);
}

// A module with Hkv K/V heads computes what a dense module computes whose K/V projection
// rows for head h are those of K/V head h / G (and its gradients, summed over each group).
TEST(GroupedQuery, EqualsTheDenseModuleWithRepeatedKeyValueRows) {
  const int64_t E = 16, H = 4, Hkv = 2, D = E / H, G = H / Hkv;
  Problem p = make_problem(E, H, 2, 5, 5, true, 0, 0, 0, 25);
  use_grouped_module(p, E, H, Hkv, 0, 0, 25);
  MultiHeadAttention dense(E, H, MultiHeadOptions{}, 1);
  float* in = dense.in_proj_weight().data_as<float>();
  float* in_bias = dense.in_proj_bias().data_as<float>();
  const float* q = p.module.q_proj_weight().data_as<float>();
  const float* bias = p.module.in_proj_bias().data_as<float>();
  std::memcpy(in, q, sizeof(float) * E * E);
  std::memcpy(in_bias, bias, sizeof(float) * E);
  for (int part = 1; part <= 2; ++part) {
    const float* w =
        (part == 1 ? p.module.k_proj_weight() : p.module.v_proj_weight()).data_as<float>();
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kv = h / G;
      std::memcpy(in + (part * E + h * D) * E, w + kv * D * E, sizeof(float) * D * E);
      std::memcpy(in_bias + part * E + h * D, bias + E + (part - 1) * Hkv * D + kv * D,
                  sizeof(float) * D);
    }
  }
  std::memcpy(dense.out_proj_weight().data, p.module.out_proj_weight().data, sizeof(float) * E * E);
  std::memcpy(dense.out_proj_bias().data, p.module.out_proj_bias().data, sizeof(float) * E);

  MultiHeadTape tape, dense_tape;
  const MultiHeadResult got = p.module.forward(p.q(), p.q(), p.q(), p.options, &tape);
  const MultiHeadResult want = dense.forward(p.q(), p.q(), p.q(), p.options, &dense_tape);
  expect_close(got.output, want.output, 1e-5, "output");
  if (bf16_compute_path().rfind("bfloat16", 0) == 0) {
    // bfloat16 products: the grouped K/V heads' bfloat16 copies are read as the dense ones,
    // but the grouped call's G·Lq = 10 rows per K/V head run as a grouped-query tile in
    // bfloat16 products (shape_policy.hpp, 5.), which round each weight P to bfloat16, where
    // the dense call's row groups keep float32 products on the same rounded K and V. Each
    // attention output element then moves by at most 2^-9·Σ_j P_j·|v_j| <= 2^-9·max|v|
    // (doubled, as the bfloat16 rule of tests/bf16_test.cc), and out_proj's row i by at most
    // Σ_c |W_out[i][c]| times that.
    MultiHeadForwardOptions bf16 = p.options;
    bf16.compute = ComputePrecision::kBFloat16;
    bf16.float32_output = true;
    const MultiHeadResult got16 = p.module.forward(p.q(), p.q(), p.q(), bf16);
    const MultiHeadResult want16 = dense.forward(p.q(), p.q(), p.q(), bf16);
    double max_value = 0;  // of every projection on the tape: bounds max|v|
    for (const Tensor* t : {&tape.query_projection, &tape.key_projection, &tape.value_projection}) {
      for (int64_t i = 0; !t->empty() && i < t->numel(); ++i) {
        max_value = std::max(max_value, std::abs(double{t->data_as<float>()[i]}));
      }
    }
    double out_norm = 0;  // max_i Σ_c |W_out[i][c]|
    const float* w_out = dense.out_proj_weight().data_as<float>();
    for (int64_t i = 0; i < E; ++i) {
      double row = 0;
      for (int64_t c = 0; c < E; ++c) row += std::abs(double{w_out[i * E + c]});
      out_norm = std::max(out_norm, row);
    }
    const double p_rounding = 2 * (1.0 / 512) * (1 + 1.0 / 256) * max_value * out_norm;
    expect_close(got16.output, want16.output, p_rounding + 1e-5, "output, bfloat16 products");
  }
  const MultiHeadGradients g =
      p.module.backward(p.grad_output.view(), p.q(), p.q(), p.q(), tape, p.options);
  const MultiHeadGradients d =
      dense.backward(p.grad_output.view(), p.q(), p.q(), p.q(), dense_tape, p.options);
  expect_close(g.query, d.query, 1e-4, "d query");
  const Tensor& dense_in = d.parameters.at("in_proj_weight");
  for (int part = 1; part <= 2; ++part) {
    const Tensor& grouped = g.parameters.at(part == 1 ? "k_proj_weight" : "v_proj_weight");
    Tensor summed = Tensor::zeros(DType::kFloat32, grouped.shape());
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t n = 0; n < D * E; ++n) {
        summed.data_as<float>()[(h / G) * D * E + n] +=
            dense_in.data_as<float>()[(part * E + h * D) * E + n];
      }
    }
    expect_close(grouped, summed, 1e-4, part == 1 ? "d k_proj_weight" : "d v_proj_weight");
  }
  // The bias gradient of the K/V rows: summed over each group likewise.
  const Tensor& dense_bias = d.parameters.at("in_proj_bias");
  const Tensor& grouped_bias = g.parameters.at("in_proj_bias");
  ASSERT_EQ(grouped_bias.shape(), Shape({E + 2 * Hkv * D}));
  for (int part = 1; part <= 2; ++part) {
    for (int64_t kv = 0; kv < Hkv; ++kv) {
      for (int64_t e = 0; e < D; ++e) {
        double sum = 0;
        for (int64_t r = 0; r < G; ++r) {
          sum += dense_bias.data_as<float>()[part * E + (kv * G + r) * D + e];
        }
        EXPECT_NEAR(grouped_bias.data_as<float>()[E + (part - 1) * Hkv * D + kv * D + e], sum,
                    1e-4);
      }
    }
  }
}

TEST(GroupedQuery, LoadsTheNamesOfDecoderModels) {
  // Llama's attention: q/k/v/o_proj.weight, K and V with 2 of 4 heads, no bias.
  MultiHeadOptions options;
  options.num_kv_heads = 2;
  options.bias = false;
  MultiHeadAttention module(16, 4, options);
  std::map<std::string, Tensor> weights;
  weights["q_proj.weight"] = test::random_tensor(Shape({16, 16}), 1);
  weights["k_proj.weight"] = test::random_tensor(Shape({8, 16}), 2, 1.0, DType::kBFloat16);
  weights["v_proj.weight"] = test::random_tensor(Shape({8, 16}), 3);
  weights["o_proj.weight"] = test::random_tensor(Shape({16, 16}), 4);
  module.load_state_dict(weights);
  const auto same = [](const TensorView& got, const Tensor& want) {
    Tensor as_float(DType::kFloat32, want.shape());
    convert(want.view(), as_float.view());
    return got.shape == want.shape() &&
           std::memcmp(got.data, as_float.data(), as_float.nbytes()) == 0;
  };
  EXPECT_TRUE(same(module.q_proj_weight(), weights["q_proj.weight"]));
  EXPECT_TRUE(same(module.k_proj_weight(), weights["k_proj.weight"]));
  EXPECT_TRUE(same(module.v_proj_weight(), weights["v_proj.weight"]));
  EXPECT_TRUE(same(module.out_proj_weight(), weights["o_proj.weight"]));
  // A packed module with bias stacks them into in_proj_weight and in_proj_bias.
  MultiHeadAttention packed(8, 2);
  std::map<std::string, Tensor> dense;
  for (const char* name : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
    dense[std::string(name) + ".weight"] = test::random_tensor(Shape({8, 8}), 5);
    dense[std::string(name) + ".bias"] = test::random_tensor(Shape({8}), 6);
  }
  packed.load_state_dict(dense);
  EXPECT_EQ(std::memcmp(packed.in_proj_weight().data_as<float>() + 64,
                        dense["k_proj.weight"].data(), 64 * sizeof(float)),
            0);
  EXPECT_EQ(std::memcmp(packed.in_proj_bias().data_as<float>() + 16, dense["v_proj.bias"].data(),
                        8 * sizeof(float)),
            0);
  // A wrong shape is named as usual; a missing part too.
  weights["k_proj.weight"] = test::random_tensor(Shape({16, 16}), 2);
  try {
    module.load_state_dict(weights);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k_proj_weight"), std::string::npos) << e.what();
  }
  weights.erase("v_proj.weight");
  try {
    module.load_state_dict(weights);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing tensor 'v_proj.weight'"), std::string::npos)
        << e.what();
  }
}

TEST(GroupedQuery, RefusesHeadsThatDoNotDivide) {
  MultiHeadOptions options;
  options.num_kv_heads = 3;
  try {
    MultiHeadAttention(16, 4, options);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_kv_heads 3 must be positive and divide num_heads 4"),
              std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Determinism, dropout, layouts.

void expect_all_bitwise_equal(const MultiHeadGradients& a, const MultiHeadGradients& b,
                              const std::string& what) {
  EXPECT_TRUE(bitwise_equal(a.query, b.query)) << what << ": query";
  EXPECT_TRUE(bitwise_equal(a.key, b.key)) << what << ": key";
  EXPECT_TRUE(bitwise_equal(a.value, b.value)) << what << ": value";
  ASSERT_EQ(a.parameters.size(), b.parameters.size()) << what;
  for (const auto& [name, tensor] : a.parameters) {
    EXPECT_TRUE(bitwise_equal(tensor, b.parameters.at(name))) << what << ": " << name;
  }
}

TEST(Determinism, BitwiseEqualAtOneAndTwoThreads) {
  // Large enough that the GEMMs split their work across threads (≥ 2^21 multiply-adds).
  for (const bool self_attention : {true, false}) {
    Problem p = make_problem(128, 4, 2, 128, 96, self_attention, self_attention ? 0 : 64,
                             self_attention ? 0 : 96, 7, 31);
    p.options.causal = self_attention;
    p.options.dropout = 0.1;
    p.options.seed = 9;
    p.options.num_threads = 1;
    const MultiHeadGradients one = p.run();
    p.options.num_threads = 2;
    const MultiHeadGradients two = p.run();
    expect_all_bitwise_equal(one, two, self_attention ? "self-attention" : "cross-attention");
  }
}

TEST(Dropout, ReproducibleFromTheSeedAndDifferentFromNoDropout) {
  Problem p = make_problem(16, 4, 2, 6, 6, true, 0, 0, 0, 41);
  const MultiHeadGradients without = p.run();
  p.options.dropout = 0.4;
  p.options.seed = 77;
  const MultiHeadGradients first = p.run();
  const MultiHeadGradients again = p.run();
  expect_all_bitwise_equal(first, again, "same seed");
  // Dropping 40% of the weights changes the gradients by far more than rounding.
  auto max_difference = [](const Tensor& a, const Tensor& b) {
    double m = 0;
    for (int64_t i = 0; i < a.numel(); ++i) {
      m = std::max(m, double{std::abs(a.data_as<float>()[i] - b.data_as<float>()[i])});
    }
    return m;
  };
  EXPECT_GT(max_difference(first.query, without.query), 1e-2 * max_abs(without.query));
  EXPECT_GT(max_difference(first.parameters.at("in_proj_weight"),
                           without.parameters.at("in_proj_weight")),
            1e-2 * max_abs(without.parameters.at("in_proj_weight")));
  p.options.seed = 78;
  const MultiHeadGradients other_seed = p.run();
  EXPECT_GT(max_difference(first.query, other_seed.query), 1e-2 * max_abs(without.query));
  // out_proj sees the heads only: its bias gradient Σ dY does not depend on dropout at all.
  EXPECT_TRUE(
      bitwise_equal(first.parameters.at("out_proj.bias"), without.parameters.at("out_proj.bias")));
}

TEST(Layout, UnbatchedMatchesBatchOfOne) {
  Problem batched = make_problem(8, 2, 1, 3, 5, false, 6, 0, 0, 51);
  Problem unbatched = make_problem(8, 2, 1, 3, 5, false, 6, 0, 0, 51);
  for (Tensor* t : {&unbatched.query, &unbatched.key, &unbatched.value, &unbatched.grad_output}) {
    Tensor flat(DType::kFloat32, Shape({t->shape()[1], t->shape()[2]}));
    std::memcpy(flat.data(), t->data(), t->nbytes());
    *t = std::move(flat);
  }
  const MultiHeadGradients a = batched.run();
  const MultiHeadGradients b = unbatched.run();
  EXPECT_EQ(b.query.shape(), Shape({3, 8}));
  EXPECT_EQ(b.key.shape(), Shape({5, 6}));
  EXPECT_EQ(b.value.shape(), Shape({5, 8}));
  for (const auto& [name, tensor] : a.parameters) {
    EXPECT_TRUE(bitwise_equal(tensor, b.parameters.at(name))) << name;
  }
  EXPECT_EQ(std::memcmp(a.query.data(), b.query.data(), a.query.nbytes()), 0);
  EXPECT_EQ(std::memcmp(a.key.data(), b.key.data(), a.key.nbytes()), 0);
}

TEST(Layout, TapeForwardGivesTheSameOutputAsThePlainForward) {
  Problem p = make_problem(16, 4, 2, 5, 7, false, 0, 0, 2, 61);
  const MultiHeadResult plain = p.module.forward(p.q(), p.k(), p.v(), p.options);
  MultiHeadTape tape;
  const MultiHeadResult taped = p.module.forward(p.q(), p.k(), p.v(), p.options, &tape);
  EXPECT_TRUE(bitwise_equal(plain.output, taped.output));
  EXPECT_EQ(tape.query_projection.shape(), Shape({2, 5, 4, 4}));
  EXPECT_EQ(tape.key_projection.shape(), Shape({2, 7, 4, 4}));
  EXPECT_EQ(tape.value_projection.shape(), Shape({2, 7, 4, 4}));
  EXPECT_EQ(tape.heads.shape(), Shape({2, 5, 4, 4}));
  EXPECT_EQ(tape.logsumexp.shape(), Shape({2, 4, 5}));
}

TEST(Layout, SharedMemoryGradientIsTheSumOfKeyAndValueRoles) {
  // key and value one view (packed in_proj, one K/V GEMM) against the same data in two
  // separate tensors: the shared gradient is their sum.
  Problem separate = make_problem(8, 2, 2, 3, 5, false, 0, 0, 0, 71);
  std::memcpy(separate.value.data(), separate.key.data(), separate.key.nbytes());
  const MultiHeadGradients parts = separate.run();
  MultiHeadTape tape;
  separate.module.forward(separate.q(), separate.k(), separate.k(), separate.options, &tape);
  const MultiHeadGradients shared =
      separate.module.backward(separate.grad_output.view(), separate.q(), separate.k(),
                               separate.k(), tape, separate.options);
  ASSERT_TRUE(shared.value.empty());
  Tensor sum = parts.key.clone();
  for (int64_t i = 0; i < sum.numel(); ++i) {
    sum.data_as<float>()[i] += parts.value.data_as<float>()[i];
  }
  expect_close(shared.key, sum, 1e-5 * max_abs(sum), "shared key/value gradient");
}

TEST(Layout, Float16InputsGiveTheGradientsOfTheirFloat32Values) {
  Problem p = make_problem(8, 2, 2, 3, 4, false, 0, 0, 0, 81);
  // Round the inputs to float16, keep float32 copies of the rounded values.
  Tensor half_query(DType::kFloat16, p.query.shape());
  convert(p.query.view(), half_query.view());
  convert(half_query.view(), p.query.view());
  const MultiHeadGradients from_float32 = p.run();
  MultiHeadTape tape;
  p.module.forward(half_query.view(), p.k(), p.v(), p.options, &tape);
  const MultiHeadGradients from_float16 =
      p.module.backward(p.grad_output.view(), half_query.view(), p.k(), p.v(), tape, p.options);
  expect_all_bitwise_equal(from_float32, from_float16, "float16 query");
}

// ---------------------------------------------------------------------------------------------
// Errors.

template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no attend::Error)";
}

TEST(Errors, GradOutputOfTheWrongShape) {
  Problem p = make_problem(8, 2, 2, 3, 5, false, 0, 0, 0, 91);
  MultiHeadTape tape;
  p.module.forward(p.q(), p.k(), p.v(), p.options, &tape);
  const Tensor wrong = Tensor::zeros(DType::kFloat32, Shape({2, 4, 8}));
  const std::string message =
      error_message([&] { p.module.backward(wrong.view(), p.q(), p.k(), p.v(), tape, p.options); });
  EXPECT_NE(message.find("grad_output"), std::string::npos) << message;
  EXPECT_NE(message.find("(2, 4, 8)"), std::string::npos) << message;
  EXPECT_NE(message.find("(2, 3, 8)"), std::string::npos) << message;

  const Tensor integer = Tensor::zeros(DType::kInt32, Shape({2, 3, 8}));
  const std::string dtype_message = error_message(
      [&] { p.module.backward(integer.view(), p.q(), p.k(), p.v(), tape, p.options); });
  EXPECT_NE(dtype_message.find("grad_output"), std::string::npos) << dtype_message;
}

TEST(Errors, TapeFromOtherInputsOrEmpty) {
  Problem p = make_problem(8, 2, 2, 3, 5, false, 0, 0, 0, 92);
  const MultiHeadTape empty;
  const std::string empty_message = error_message(
      [&] { p.module.backward(p.grad_output.view(), p.q(), p.k(), p.v(), empty, p.options); });
  EXPECT_NE(empty_message.find("tape"), std::string::npos) << empty_message;

  // A tape of self-attention (one packed QKV projection) for a cross-attention backward.
  MultiHeadTape self_tape;
  p.module.forward(p.q(), p.q(), p.q(), p.options, &self_tape);
  const std::string other_message = error_message(
      [&] { p.module.backward(p.grad_output.view(), p.q(), p.k(), p.v(), self_tape, p.options); });
  EXPECT_NE(other_message.find("tape.query_projection"), std::string::npos) << other_message;
}

TEST(Errors, MaskOfTheWrongShapeIsNamed) {
  Problem p = make_problem(8, 2, 2, 3, 5, false, 0, 0, 2, 93);
  MultiHeadTape tape;
  p.module.forward(p.q(), p.k(), p.v(), p.options, &tape);
  const Tensor wrong_mask = Tensor::zeros(DType::kUInt8, Shape({2, 4}));
  MultiHeadForwardOptions options = p.options;
  options.key_padding_mask = wrong_mask.view();
  const std::string message = error_message(
      [&] { p.module.backward(p.grad_output.view(), p.q(), p.k(), p.v(), tape, options); });
  EXPECT_NE(message.find("key_padding_mask"), std::string::npos) << message;
}

}  // namespace
}  // namespace attend
