// The backward pass against an independent hand-derived float64 gradient
// (tests/independent_gradients.hpp), which is itself checked against central finite
// differences of the independent float64 forward, over the case grid of
// tests/data/sdpa_backward_cases.txt: the reference backend, and the default backend on every
// SIMD target this build and this CPU support. Also: the forward's log-sum-exp, dropout
// regenerated from the seed, bitwise independence of the thread count, bad arguments.
#include "attend/sdpa_backward.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "boundary/operands.hpp"
#include "cpu_features.hpp"
#include "dropout.hpp"
#include "error_model.hpp"
#include "independent_gradients.hpp"
#include "independent_reference.hpp"
#include "reduced_precision_support.hpp"
#include "sdpa_cases.hpp"

namespace attend::test {
namespace {

// Finite differences cost (inputs) × (one forward): only for problems below this many
// multiply-adds in total.
constexpr double kFiniteDifferenceWork = 2e6;

struct BackwardCase {
  SdpaCase spec;
  CaseInputs in;
  Tensor grad_output;  // G, the output's shape and dtype
  GradientCheck check;
};

Tensor grad_output_for(const CaseInputs& in, uint32_t seed) {
  const Shape& q = in.query.shape;
  Shape shape = Shape::from(q.data(), q.rank() - 1);
  shape.push_back(in.value.shape.back(0));
  const Tensor values = random_tensor(shape, seed, 1.0);
  Tensor g(in.query.dtype, shape);
  convert(values.view(), g.view());
  return g;
}

BackwardCase prepare(const SdpaCase& spec) {
  BackwardCase c{spec, make_case_inputs(spec), {}, {}};
  ReferenceProblem& p = c.in.problem;
  if (spec.dropout > 0) {
    const uint32_t threshold = detail::dropout_threshold(spec.dropout);
    for (int64_t b = 0; b < p.batch(); ++b) {
      for (int64_t i = 0; i < p.query_len; ++i) {
        for (int64_t j = 0; j < p.key_len; ++j) {
          p.dropout_factor.push_back(detail::dropout_keep(spec.seed, threshold, b, i, j)
                                         ? 1.0 / (1.0 - spec.dropout)
                                         : 0.0);
        }
      }
    }
  }
  c.grad_output = grad_output_for(c.in, 1234);
  c.check =
      independent_gradients(p, values_of(c.grad_output.view()), spec.dtype == DType::kFloat16);
  if (spec.bias == "keys") {  // a float16 bias gets a float16 gradient
    for (size_t n = 0; n < c.check.tolerance.bias.size(); ++n) {
      c.check.tolerance.bias[n] +=
          kHalfUlp / 2 * std::abs(c.check.exact.bias[n]) + kHalfSubnormalUlp;
    }
  }
  return c;
}

const std::vector<BackwardCase>& cases() {
  static const std::vector<BackwardCase> all = [] {
    std::vector<BackwardCase> list;
    for (const SdpaCase& spec : load_sdpa_cases(ATTEND_TEST_DATA_DIR "/sdpa_backward_cases.txt")) {
      list.push_back(prepare(spec));
    }
    return list;
  }();
  return all;
}

struct Outcome {
  AttentionResult forward;
  AttentionGradients gradients;
};

Outcome run(const BackwardCase& c, Backend backend, int threads = 0) {
  AttentionOptions options = c.in.options;
  options.backend = backend;
  options.need_weights = false;
  options.need_logsumexp = true;
  options.num_threads = threads;
  Outcome r;
  r.forward = scaled_dot_product_attention(c.in.query, c.in.key, c.in.value, options);
  r.gradients = scaled_dot_product_attention_backward(c.grad_output.view(), c.in.query, c.in.key,
                                                      c.in.value, r.forward.output.view(),
                                                      r.forward.logsumexp.view(), options);
  return r;
}

// Compares one gradient with the exact one, element by element; the message names the worst.
void expect_close(const std::string& what, const std::vector<double>& got,
                  const std::vector<double>& exact, const std::vector<double>& tolerance) {
  ASSERT_EQ(got.size(), exact.size()) << what;
  double worst = 0;
  size_t worst_at = 0;
  for (size_t n = 0; n < got.size(); ++n) {
    const double diff = std::abs(got[n] - exact[n]);
    const double excess = diff == 0 ? 0.0 : diff / tolerance[n];
    if (!(excess <= worst)) {  // NaN counts as worst
      worst = std::isnan(excess) ? INFINITY : excess;
      worst_at = n;
    }
  }
  EXPECT_LE(worst, 1.0) << what << " worst at flat index " << worst_at << ": got " << got[worst_at]
                        << ", expected " << exact[worst_at] << ", tolerance "
                        << tolerance[worst_at];
}

// Per-batch-index sums (the independent gradient's dSinks) summed over each head.
std::vector<double> per_head(const std::vector<double>& per_batch, int64_t heads) {
  std::vector<double> sums(static_cast<size_t>(heads), 0.0);
  for (size_t b = 0; b < per_batch.size(); ++b)
    sums[b % static_cast<size_t>(heads)] += per_batch[b];
  return sums;
}

// Grouped-query attention: the dense problem's dK or dV (..., H, L, D) (or its tolerance)
// summed over the G query heads of each K/V head, to compare with `got` (..., Hkv, L, D).
std::vector<double> fold_groups(const std::vector<double>& dense, const Tensor& got) {
  if (dense.size() == static_cast<size_t>(got.numel()) || got.shape().rank() < 3) return dense;
  const int64_t head_size = got.shape().back(1) * got.shape().back(0);
  const size_t group = dense.size() / static_cast<size_t>(got.numel());
  std::vector<double> folded(static_cast<size_t>(got.numel()), 0.0);
  for (size_t n = 0; n < dense.size(); ++n) {
    const size_t head = n / static_cast<size_t>(head_size);
    const size_t within = n % static_cast<size_t>(head_size);
    folded[head / group * static_cast<size_t>(head_size) + within] += dense[n];
  }
  return folded;
}

void expect_gradients_close(const std::string& what, const Outcome& r, const GradientCheck& check) {
  expect_close(what + " dQ", values_of(r.gradients.query.view()), check.exact.query,
               check.tolerance.query);
  expect_close(what + " dK", values_of(r.gradients.key.view()),
               fold_groups(check.exact.key, r.gradients.key),
               fold_groups(check.tolerance.key, r.gradients.key));
  expect_close(what + " dV", values_of(r.gradients.value.view()),
               fold_groups(check.exact.value, r.gradients.value),
               fold_groups(check.tolerance.value, r.gradients.value));
  // The problem's bias also holds ALiBi; only a bias of the options has a gradient.
  if (!r.gradients.bias.empty()) {
    expect_close(what + " dBias", values_of(r.gradients.bias.view()), check.exact.bias,
                 check.tolerance.bias);
  }
  if (!check.exact.sinks.empty()) {
    const int64_t heads = r.gradients.sinks.numel();
    expect_close(what + " dSinks", values_of(r.gradients.sinks.view()),
                 per_head(check.exact.sinks, heads), per_head(check.tolerance.sinks, heads));
  }
}

// The tolerance must be able to catch an error of 1% of the gradient's largest element.
void expect_meaningful(const std::string& what, const std::vector<double>& exact,
                       const std::vector<double>& tolerance) {
  double largest = 0, loosest = 0;
  for (size_t n = 0; n < exact.size(); ++n) {
    largest = std::max(largest, std::abs(exact[n]));
    loosest = std::max(loosest, tolerance[n]);
  }
  if (largest > 0) {
    EXPECT_LT(loosest, 1e-2 * largest) << what << ": tolerance not meaningful";
  }
}

// bfloat16 inputs through the bfloat16 backward, on each path the host has (AVX512_BF16,
// and AMX tiles where attend::set_amx_enabled can switch them on: the same rounding points,
// so one error model): every case of the grid against the independent gradient of the
// rounded problem, with the error model's bfloat16 terms (independent_gradients.hpp). O and
// the log-sum-exp come from a float32-product forward, so that the backward's own error is
// what is checked. The default precision gives the policy's path bit for bit.
bool same_bits(const AttentionGradients& a, const AttentionGradients& b) {
  const auto same = [](const Tensor& x, const Tensor& y) {
    return x.nbytes() == y.nbytes() && std::memcmp(x.data(), y.data(), x.nbytes()) == 0;
  };
  return same(a.query, b.query) && same(a.key, b.key) && same(a.value, b.value);
}

using Bf16Backward = Bf16PathTest;  // reduced_precision_support.hpp

INSTANTIATE_TEST_SUITE_P(Bf16Products, Bf16Backward, ::testing::Values(false, true), Bf16PathName);

TEST_P(Bf16Backward, WithinTheirErrorModel) {
  int checked = 0;
  for (const BackwardCase& c : cases()) {
    if (c.spec.ill_conditioned) continue;
    SCOPED_TRACE("case " + c.spec.name);
    const auto bf16 = [](const TensorView& view) {
      Tensor t(DType::kBFloat16, view.shape);
      convert(view, t.view());
      return t;
    };
    const Tensor q = bf16(c.in.query), k = bf16(c.in.key), v = bf16(c.in.value),
                 g = bf16(c.grad_output.view());
    AttentionOptions options = c.in.options;
    options.need_weights = false;
    options.need_logsumexp = true;
    ReferenceProblem p = reference_problem(q.view(), k.view(), v.view(), options);
    p.dropout_factor = c.in.problem.dropout_factor;
    const GradientCheck check = independent_gradients(p, values_of(g.view()), false, true);
    AttentionOptions forward_options = options;
    forward_options.compute = ComputePrecision::kFloat32;
    Outcome r;
    r.forward = scaled_dot_product_attention(q.view(), k.view(), v.view(), forward_options);
    const auto backward = [&](ComputePrecision compute) {
      AttentionOptions o = options;
      o.compute = compute;
      return scaled_dot_product_attention_backward(g.view(), q.view(), k.view(), v.view(),
                                                   r.forward.output.view(),
                                                   r.forward.logsumexp.view(), o);
    };
    r.gradients = backward(ComputePrecision::kBFloat16);
    expect_gradients_close("bfloat16", r, check);
    if (default_takes_this_path(detail::ProductSite::kAttentionBackward)) {
      const AttentionGradients automatic = backward(ComputePrecision::kAuto);
      EXPECT_TRUE(same_bits(automatic, r.gradients));
    }
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

// The bfloat16 backward's gradients are the same bits at any thread count, on each path
// (several key chunks: dQ's parts are summed in chunk order).
TEST_P(Bf16Backward, ResultsDoNotDependOnTheThreadCount) {
  const Tensor q = random_tensor({2, 3, 150, 72}, 1);  // float32, rounded by kBFloat16
  const Tensor k = random_tensor({2, 3, 300, 72}, 2);
  const Tensor v = random_tensor({2, 3, 300, 40}, 3);
  const Tensor g = random_tensor({2, 3, 150, 40}, 4);
  AttentionOptions options;
  options.causal = true;
  options.need_logsumexp = true;
  options.compute = ComputePrecision::kBFloat16;
  const AttentionResult f = scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
  std::vector<AttentionGradients> runs;
  for (int threads : {1, 2, 3}) {
    options.num_threads = threads;
    runs.push_back(scaled_dot_product_attention_backward(
        g.view(), q.view(), k.view(), v.view(), f.output.view(), f.logsumexp.view(), options));
  }
  for (size_t i = 1; i < runs.size(); ++i) EXPECT_TRUE(same_bits(runs[0], runs[i])) << i;
}

// AMX tiles and AVX512_BF16 add the pairs' halves in different orders (tdpbf16ps and
// vdpbf16ps), so where both run, their gradients differ in some last bits: the switch does
// change the path (and each meets the error model above).
TEST(SdpaBackward, AmxTilesAndAvx512Bf16AreBothRun) {
  if (!detail::amx_bf16_products()) GTEST_SKIP() << "skipped: " << detail::why_no_amx_bf16();
  // float32 inputs and gradients (rounded by kBFloat16), so that the last bits show.
  const Tensor q = random_tensor({1, 2, 70, 64}, 5);
  const Tensor k = random_tensor({1, 2, 90, 64}, 6);
  const Tensor g = random_tensor({1, 2, 70, 64}, 7);
  AttentionOptions options;
  options.need_logsumexp = true;
  options.compute = ComputePrecision::kBFloat16;
  const AttentionResult f = scaled_dot_product_attention(q.view(), k.view(), k.view(), options);
  const auto backward = [&](bool amx) {
    const bool previous = amx_enabled();
    set_amx_enabled(amx);
    AttentionGradients r = scaled_dot_product_attention_backward(
        g.view(), q.view(), k.view(), k.view(), f.output.view(), f.logsumexp.view(), options);
    set_amx_enabled(previous);
    return r;
  };
  const AttentionGradients tiles = backward(true), blocks = backward(false);
  EXPECT_NE(values_of(tiles.query.view()), values_of(blocks.query.view()));
  EXPECT_NE(values_of(tiles.key.view()), values_of(blocks.key.view()));
  EXPECT_NE(values_of(tiles.value.view()), values_of(blocks.value.view()));
}

TEST(SdpaBackward, IndependentGradientMatchesFiniteDifferences) {
  int checked = 0;
  for (const BackwardCase& c : cases()) {
    ReferenceProblem p = c.in.problem;
    const double work = static_cast<double>(p.batch()) * static_cast<double>(p.query_len) *
                        static_cast<double>(p.key_len) *
                        static_cast<double>(p.head_dim + p.value_dim);
    const double inputs =
        static_cast<double>(p.query.size() + p.key.size() + p.value.size() + p.bias.size());
    if (work * inputs > kFiniteDifferenceWork) continue;
    ++checked;
    const std::vector<double> g = values_of(c.grad_output.view());
    const auto loss = [&] {
      const ReferenceResult r = independent_attention(p);
      double sum = 0;
      for (size_t n = 0; n < g.size(); ++n) sum += g[n] * r.output[n];
      return sum;
    };
    // Central differences: truncation O(h²) ≈ 1e-10, rounding ≈ 1e-16·|L|/h ≈ 1e-11·|L|.
    const double h = 1e-5;
    const auto check = [&](const char* name, std::vector<double>& x,
                           const std::vector<double>& exact) {
      for (size_t n = 0; n < x.size(); ++n) {
        const double saved = x[n];
        x[n] = saved + h;
        const double plus = loss();
        x[n] = saved - h;
        const double minus = loss();
        x[n] = saved;
        const double fd = (plus - minus) / (2 * h);
        ASSERT_NEAR(fd, exact[n], 1e-7 * (1 + std::abs(exact[n])))
            << c.spec.name << " d" << name << " at flat index " << n;
      }
    };
    check("query", p.query, c.check.exact.query);
    check("key", p.key, c.check.exact.key);
    check("value", p.value, c.check.exact.value);
    if (p.has_bias) check("bias", p.bias, c.check.exact.bias);
    if (!p.sinks.empty()) check("sinks", p.sinks, c.check.exact.sinks);
  }
  EXPECT_GE(checked, 15);
}

TEST(SdpaBackward, ReferenceMatchesIndependentGradient) {
  for (const BackwardCase& c : cases()) {
    SCOPED_TRACE(c.spec.name);
    if (!c.spec.ill_conditioned) {
      expect_meaningful("dQ", c.check.exact.query, c.check.tolerance.query);
      expect_meaningful("dK", c.check.exact.key, c.check.tolerance.key);
      expect_meaningful("dV", c.check.exact.value, c.check.tolerance.value);
    }
    expect_gradients_close(c.spec.name + " reference", run(c, Backend::kReference), c.check);
  }
}

TEST(SdpaBackward, DefaultBackendMatchesOnEveryTarget) {
  for (const std::string& target : supported_simd_targets()) {
    ScopedSimdCap cap(target);
    for (const BackwardCase& c : cases()) {
      expect_gradients_close(c.spec.name + " on " + target, run(c, Backend::kAuto), c.check);
    }
  }
}

TEST(SdpaBackward, LogSumExpMatchesIndependentForward) {
  for (const BackwardCase& c : cases()) {
    const ReferenceProblem& p = c.in.problem;
    for (Backend backend : {Backend::kReference, Backend::kAuto}) {
      const std::vector<double> lse = values_of(run(c, backend).forward.logsumexp.view());
      ASSERT_EQ(lse.size(), static_cast<size_t>(p.batch() * p.query_len));
      for (int64_t b = 0; b < p.batch(); ++b) {
        for (int64_t i = 0; i < p.query_len; ++i) {
          const double got = lse[static_cast<size_t>(b * p.query_len + i)];
          // With a sink, the sink alone: log(exp(sink)).
          const double sink = p.sinks.empty() ? -INFINITY : p.sinks[static_cast<size_t>(b)];
          if (row_fully_excluded(p, b, i) && p.sinks.empty()) {
            const double expected = p.zero_fully_masked_rows
                                        ? -INFINITY
                                        : static_cast<double>(static_cast<float>(
                                              -1e9 + std::log(static_cast<double>(p.key_len))));
            EXPECT_EQ(got, expected) << c.spec.name << " b=" << b << " i=" << i;
            continue;
          }
          double m = sink;
          std::vector<double> s;
          for (int64_t j = 0; j < p.key_len; ++j) {
            if (!is_visible(p, b, i, j)) continue;
            double dot = 0;
            for (int64_t e = 0; e < p.head_dim; ++e) {
              dot += p.query[static_cast<size_t>((b * p.query_len + i) * p.head_dim + e)] *
                     p.key[static_cast<size_t>((b * p.key_len + j) * p.head_dim + e)];
            }
            double raw = dot * p.scale;
            if (p.softcap > 0) raw = p.softcap * std::tanh(raw / p.softcap);
            s.push_back(raw + bias_at(p, b, i, j));
            m = std::max(m, s.back());
          }
          double sum = std::exp(sink - m);
          for (double x : s) sum += std::exp(x - m);
          const double expected = m + std::log(sum);
          EXPECT_NEAR(got, expected, 1e-5 * (1 + std::abs(expected)))
              << c.spec.name << " b=" << b << " i=" << i;
        }
      }
    }
  }
}

TEST(SdpaBackward, BitwiseIdenticalAtAnyThreadCount) {
  for (const BackwardCase& c : cases()) {
    const Outcome one = run(c, Backend::kAuto, 1), two = run(c, Backend::kAuto, 2),
                  three = run(c, Backend::kAuto, 3);
    for (const Outcome* other : {&two, &three}) {
      const auto same = [&](const Tensor& a, const Tensor& b, const char* what) {
        ASSERT_EQ(a.nbytes(), b.nbytes());
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << c.spec.name << " " << what;
      };
      same(one.gradients.query, other->gradients.query, "dQ");
      same(one.gradients.key, other->gradients.key, "dK");
      same(one.gradients.value, other->gradients.value, "dV");
      if (!one.gradients.bias.empty()) same(one.gradients.bias, other->gradients.bias, "dBias");
    }
  }
}

// dV = P̃ᵀ·dO, with P̃ the forward's weights after dropout: the backward regenerated the same
// keep/drop draws from the seed.
TEST(SdpaBackward, DropoutMaskIsTheForwards) {
  CaseInputs in = make_case_inputs(
      parse_sdpa_case("name=drop batch=2x2 lq=33 lk=70 e=16 ev=8 dropout=0.4 seed=42 causal=1"));
  const Tensor g = random_tensor(Shape({2, 2, 33, 8}), 5);
  for (Backend backend : {Backend::kReference, Backend::kAuto}) {
    AttentionOptions options = in.options;
    options.backend = backend;
    options.need_weights = true;
    options.need_logsumexp = true;
    const AttentionResult f = scaled_dot_product_attention(in.query, in.key, in.value, options);
    const AttentionGradients grads = scaled_dot_product_attention_backward(
        g.view(), in.query, in.key, in.value, f.output.view(), f.logsumexp.view(), options);
    const float* w = f.weights.data_as<float>();
    const float* dout = g.data_as<float>();
    const float* dv = grads.value.data_as<float>();
    int dropped = 0;
    for (int64_t b = 0; b < 4; ++b) {
      for (int64_t j = 0; j < 70; ++j) {
        for (int64_t c = 0; c < 8; ++c) {
          double expected = 0, magnitude = 0;
          for (int64_t i = 0; i < 33; ++i) {
            const double wij = w[(b * 33 + i) * 70 + j];
            expected += wij * dout[(b * 33 + i) * 8 + c];
            magnitude += std::abs(wij * dout[(b * 33 + i) * 8 + c]);
            dropped += c == 0 && wij == 0 && j <= i + 37;
          }
          EXPECT_NEAR(dv[(b * 70 + j) * 8 + c], expected, 1e-5 * magnitude + 1e-7)
              << "b=" << b << " j=" << j << " c=" << c;
        }
      }
    }
    EXPECT_GT(dropped, 500);  // p = 0.4 of about 5,000 visible weights
  }
}

TEST(SdpaBackward, RejectsBadArguments) {
  CaseInputs in = make_case_inputs(parse_sdpa_case("name=bad batch=2 lq=4 lk=5 e=3 ev=6"));
  AttentionOptions options = in.options;
  options.need_logsumexp = true;
  const AttentionResult f = scaled_dot_product_attention(in.query, in.key, in.value, options);
  const Tensor g = random_tensor(Shape({2, 4, 6}), 1);
  const auto message = [&](const TensorView& dout, const TensorView& out, const TensorView& lse,
                           const AttentionOptions& o) {
    try {
      scaled_dot_product_attention_backward(dout, in.query, in.key, in.value, out, lse, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const Tensor wrong = random_tensor(Shape({2, 4, 5}), 1);
  EXPECT_NE(message(wrong.view(), f.output.view(), f.logsumexp.view(), options)
                .find("grad_output (2, 4, 5)"),
            std::string::npos);
  EXPECT_NE(message(g.view(), wrong.view(), f.logsumexp.view(), options).find("output (2, 4, 5)"),
            std::string::npos);
  const Tensor lse = random_tensor(Shape({2, 5}), 1);
  EXPECT_NE(message(g.view(), f.output.view(), lse.view(), options).find("logsumexp (2, 5)"),
            std::string::npos);
  AttentionGradients grads;
  grads.query = Tensor(DType::kFloat32, in.query.shape);
  grads.key = Tensor(DType::kFloat32, in.key.shape);
  grads.value = Tensor(DType::kFloat32, in.value.shape);
  const Tensor bias_grad(DType::kFloat32, Shape({4, 5}));
  AttentionGradientViews views{grads.query.view(), grads.key.view(), grads.value.view(),
                               bias_grad.view(), std::nullopt};
  EXPECT_THROW(scaled_dot_product_attention_backward_into(g.view(), in.query, in.key, in.value,
                                                          f.output.view(), f.logsumexp.view(),
                                                          views, options),
               Error);  // a bias gradient without a bias
  views.bias.reset();
  views.key = grads.query.view();  // dK (2, 4, 3) where key is (2, 5, 3)
  EXPECT_THROW(scaled_dot_product_attention_backward_into(g.view(), in.query, in.key, in.value,
                                                          f.output.view(), f.logsumexp.view(),
                                                          views, options),
               Error);
}

}  // namespace
}  // namespace attend::test
