// Prepared calls (attend/plan.hpp): bitwise the unprepared result on every path (row groups,
// tiles, key split, grouped-query, score rules, strided layouts, the float16 fallback, a
// growing key length), the refusals of run() before any output is touched, several threads
// on one plan.
#include "attend/plan.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "serving_support.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

struct Problem {
  Tensor q, k, v;
};

Problem make_problem(const Shape& q, const Shape& k, const Shape& v, uint32_t seed,
                     DType dtype = DType::kFloat32) {
  return {random_tensor(q, seed, 1.0, dtype), random_tensor(k, seed + 1, 1.0, dtype),
          random_tensor(v, seed + 2, 1.0, dtype)};
}

Shape output_shape(const Problem& p) {
  Shape s = p.q.shape();
  s[s.rank() - 1] = p.v.shape().back(0);
  return s;
}

// The plan's output and the unprepared call's, for one problem.
void expect_plan_matches(const Problem& in, const AttentionOptions& options,
                         const std::string& what) {
  SCOPED_TRACE(what);
  Tensor planned(in.q.dtype(), output_shape(in)), direct(in.q.dtype(), output_shape(in));
  AttentionOptions with_lse = options;
  with_lse.need_logsumexp = true;
  const Shape& o = planned.shape();
  Tensor planned_lse(DType::kFloat32, Shape::from(o.data(), o.rank() - 1));
  Tensor direct_lse(DType::kFloat32, planned_lse.shape());
  const AttentionPlan plan(in.q.view(), in.k.view(), in.v.view(), planned.view(), with_lse);
  EXPECT_EQ(plan.prepared(), in.q.dtype() == DType::kFloat32);
  const TensorView lse_view = planned_lse.view();
  plan.run(in.q.view(), in.k.view(), in.v.view(), planned.view(), &lse_view);
  AttentionOutputViews outputs{direct.view(), std::nullopt, direct_lse.view()};
  scaled_dot_product_attention_into(in.q.view(), in.k.view(), in.v.view(), outputs, with_lse);
  EXPECT_TRUE(same_bits(planned, direct));
  EXPECT_TRUE(same_bits(planned_lse, direct_lse));
}

TEST(AttentionPlan, BitwiseTheUnpreparedCall) {
  expect_plan_matches(make_problem({1, 8, 4, 32}, {1, 8, 4, 32}, {1, 8, 4, 32}, 1), {}, "phrase");
  expect_plan_matches(make_problem({1, 8, 1, 64}, {1, 8, 64, 64}, {1, 8, 64, 64}, 2), {},
                      "decode over 64 keys");
  AttentionOptions causal;
  causal.causal = true;
  expect_plan_matches(make_problem({2, 4, 100, 32}, {2, 4, 130, 32}, {2, 4, 130, 24}, 3), causal,
                      "tiles, causal");
  expect_plan_matches(make_problem({32, 1, 64}, {8, 5000, 64}, {8, 5000, 64}, 4), {},
                      "grouped-query decode with a key split");
  AttentionOptions rules;
  rules.causal = true;
  rules.window = SlidingWindow{20, 0};
  rules.alibi = true;
  rules.softcap = 30.0;
  const Tensor sinks = random_tensor(Shape({4}), 9);
  rules.sinks = sinks.view();
  expect_plan_matches(make_problem({4, 7, 16}, {2, 50, 16}, {2, 50, 16}, 5), rules,
                      "score rules, grouped-query");
  AttentionOptions masked;
  const Tensor bias = random_tensor(Shape({5, 33}), 10);
  Tensor mask(DType::kBool, Shape({5, 33}));
  for (int64_t n = 0; n < mask.numel(); ++n) mask.data_as<uint8_t>()[n] = n % 3 != 0;
  masked.mask = mask.view();
  masked.bias = bias.view();
  masked.dropout = 0.25;
  masked.seed = 77;
  expect_plan_matches(make_problem({3, 5, 8}, {3, 33, 8}, {3, 33, 8}, 6), masked,
                      "mask, bias, dropout");
  expect_plan_matches(make_problem({2, 5, 8}, {2, 9, 8}, {2, 9, 8}, 7, DType::kFloat16), {},
                      "float16: the unprepared call");
}

TEST(AttentionPlan, ProductsInAnotherPrecisionRunUnprepared) {
  // bfloat16 products round copies of the float32 operands: a plan cannot keep those copies,
  // so it runs the unprepared call (the same bits), with the next call's data.
  if (bf16_compute_path().rfind("bfloat16", 0) != 0) GTEST_SKIP() << bf16_compute_path();
  AttentionOptions options;
  options.compute = ComputePrecision::kBFloat16;
  const Problem first = make_problem({2, 40, 32}, {2, 50, 32}, {2, 50, 32}, 1);
  const Problem second = make_problem({2, 40, 32}, {2, 50, 32}, {2, 50, 32}, 2);
  Tensor planned(DType::kFloat32, output_shape(first)),
      direct(DType::kFloat32, output_shape(first));
  const AttentionPlan plan(first.q.view(), first.k.view(), first.v.view(), planned.view(), options);
  EXPECT_FALSE(plan.prepared());
  plan.run(second.q.view(), second.k.view(), second.v.view(), planned.view());
  scaled_dot_product_attention_into(second.q.view(), second.k.view(), second.v.view(),
                                    direct.view(), nullptr, options);
  EXPECT_TRUE(same_bits(planned, direct));
}

TEST(AttentionPlan, StridedOutputAsPlanned) {
  // (B, L, H, D) storage viewed as (B, H, L, D), as a multi-head module writes it.
  const Problem in = make_problem({2, 4, 3, 16}, {2, 4, 9, 16}, {2, 4, 9, 16}, 11);
  Tensor storage(DType::kFloat32, Shape({2, 3, 4, 16}));
  const TensorView out(storage.data(), DType::kFloat32, Shape({2, 4, 3, 16}),
                       Shape({192, 16, 64, 1}));
  const AttentionPlan plan(in.q.view(), in.k.view(), in.v.view(), out);
  plan.run(in.q.view(), in.k.view(), in.v.view(), out);
  Tensor direct_storage(DType::kFloat32, storage.shape());
  const TensorView direct(direct_storage.data(), DType::kFloat32, out.shape, out.strides);
  scaled_dot_product_attention_into(in.q.view(), in.k.view(), in.v.view(), direct, nullptr);
  EXPECT_TRUE(same_bits(storage, direct_storage));
}

TEST(AttentionPlan, GrowingKeyLengthFollowsTheCausalDiagonal) {
  // A decode loop over a cache of capacity 70: one query, Lk = 1, 2, ..., 70.
  const Tensor q = random_tensor(Shape({4, 1, 32}), 1);
  const Tensor k = random_tensor(Shape({2, 70, 32}), 2);
  const Tensor v = random_tensor(Shape({2, 70, 32}), 3);
  AttentionOptions options;
  options.causal = true;
  Tensor out(DType::kFloat32, Shape({4, 1, 32})), direct(DType::kFloat32, Shape({4, 1, 32}));
  const auto prefix = [](const Tensor& t, int64_t lk) {
    return TensorView(const_cast<void*>(t.data()), DType::kFloat32, Shape({2, lk, 32}),
                      Shape({70 * 32, 32, 1}));
  };
  const AttentionPlan plan(q.view(), prefix(k, 1), prefix(v, 1), out.view(), options, true);
  for (int64_t lk = 1; lk <= 70; ++lk) {
    plan.run(q.view(), prefix(k, lk), prefix(v, lk), out.view());
    scaled_dot_product_attention_into(q.view(), prefix(k, lk), prefix(v, lk), direct.view(),
                                      nullptr, options);
    ASSERT_TRUE(same_bits(out, direct)) << "Lk " << lk;
  }
  // Contiguous key of another length (other strides) as well.
  const Tensor k9 = random_tensor(Shape({2, 9, 32}), 4), v9 = random_tensor(Shape({2, 9, 32}), 5);
  plan.run(q.view(), k9.view(), v9.view(), out.view());
  scaled_dot_product_attention_into(q.view(), k9.view(), v9.view(), direct.view(), nullptr,
                                    options);
  EXPECT_TRUE(same_bits(out, direct));
}

TEST(AttentionPlan, RefusesWhatItWasNotMadeFor) {
  const Problem in = make_problem({2, 5, 8}, {2, 9, 8}, {2, 9, 8}, 1);
  Tensor out = Tensor::zeros(DType::kFloat32, Shape({2, 5, 8}));
  const AttentionPlan plan(in.q.view(), in.k.view(), in.v.view(), out.view());
  const auto untouched = [&] {
    for (int64_t n = 0; n < out.numel(); ++n) {
      if (out.data_as<float>()[n] != 0.0f) return false;
    }
    return true;
  };
  const Problem longer = make_problem({2, 5, 8}, {2, 10, 8}, {2, 10, 8}, 2);
  std::string message =
      error_of([&] { plan.run(in.q.view(), longer.k.view(), in.v.view(), out.view()); });
  EXPECT_NE(message.find("key (2, 10, 8) float32"), std::string::npos) << message;
  EXPECT_NE(message.find("is not the planned (2, 9, 8)"), std::string::npos) << message;
  TensorView strided = in.q.view();
  strided.strides = Shape({40, 16, 1});
  message = error_of([&] { plan.run(strided, in.k.view(), in.v.view(), out.view()); });
  EXPECT_NE(message.find("query"), std::string::npos) << message;
  const Tensor half = random_tensor(Shape({2, 5, 8}), 3, 1.0, DType::kFloat16);
  message = error_of([&] { plan.run(half.view(), in.k.view(), in.v.view(), out.view()); });
  EXPECT_NE(message.find("float16"), std::string::npos) << message;
  TensorView null_query = in.q.view();
  null_query.data = nullptr;
  message = error_of([&] { plan.run(null_query, in.k.view(), in.v.view(), out.view()); });
  EXPECT_NE(message.find("null"), std::string::npos) << message;
  // The output over the query's memory.
  const TensorView aliased(const_cast<void*>(in.q.data()), DType::kFloat32, Shape({2, 5, 8}));
  message = error_of([&] { plan.run(in.q.view(), in.k.view(), in.v.view(), aliased); });
  EXPECT_NE(message.find("overlaps"), std::string::npos) << message;
  Tensor lse(DType::kFloat32, Shape({2, 5}));
  const TensorView lse_view = lse.view();
  message =
      error_of([&] { plan.run(in.q.view(), in.k.view(), in.v.view(), out.view(), &lse_view); });
  EXPECT_NE(message.find("need_logsumexp"), std::string::npos) << message;
  EXPECT_TRUE(untouched());

  // What a plan cannot be made for.
  AttentionOptions weights;
  weights.need_weights = true;
  message =
      error_of([&] { AttentionPlan(in.q.view(), in.k.view(), in.v.view(), out.view(), weights); });
  EXPECT_NE(message.find("need_weights"), std::string::npos) << message;
  AttentionOptions masked;
  const Tensor mask = Tensor::zeros(DType::kBool, Shape({5, 9}));
  masked.mask = mask.view();
  message = error_of(
      [&] { AttentionPlan(in.q.view(), in.k.view(), in.v.view(), out.view(), masked, true); });
  EXPECT_NE(message.find("variable_key_length"), std::string::npos) << message;
  message = error_of([&] { AttentionPlan(in.q.view(), longer.k.view(), in.v.view(), out.view()); });
  EXPECT_NE(message.find("Lk"), std::string::npos) << message;

  // Variable Lk: key and value must agree, and Lk >= 1.
  const AttentionPlan growing(in.q.view(), in.k.view(), in.v.view(), out.view(), {}, true);
  message = error_of([&] { growing.run(in.q.view(), longer.k.view(), in.v.view(), out.view()); });
  EXPECT_NE(message.find("in Lk"), std::string::npos) << message;
  const Tensor empty_k(DType::kFloat32, Shape({2, 0, 8}));
  message = error_of([&] { growing.run(in.q.view(), empty_k.view(), empty_k.view(), out.view()); });
  EXPECT_NE(message.find("Lk is 0"), std::string::npos) << message;
  EXPECT_TRUE(untouched());
}

TEST(AttentionPlan, SeveralThreadsRunOnePlan) {
  const Problem shape = make_problem({8, 1, 64}, {8, 300, 64}, {8, 300, 64}, 1);
  Tensor out0(DType::kFloat32, Shape({8, 1, 64}));
  AttentionOptions options;
  options.num_threads = 1;
  const AttentionPlan plan(shape.q.view(), shape.k.view(), shape.v.view(), out0.view(), options);
  constexpr int kThreads = 4;
  std::vector<Problem> problems;
  std::vector<Tensor> outs, expected;
  for (int t = 0; t < kThreads; ++t) {
    problems.push_back(make_problem({8, 1, 64}, {8, 300, 64}, {8, 300, 64}, 10 * t + 3));
    outs.emplace_back(DType::kFloat32, Shape({8, 1, 64}));
    expected.emplace_back(DType::kFloat32, Shape({8, 1, 64}));
    scaled_dot_product_attention_into(problems[t].q.view(), problems[t].k.view(),
                                      problems[t].v.view(), expected[t].view(), nullptr, options);
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int repeat = 0; repeat < 50; ++repeat) {
        plan.run(problems[t].q.view(), problems[t].k.view(), problems[t].v.view(), outs[t].view());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(same_bits(outs[t], expected[t])) << t;
}

}  // namespace
}  // namespace attend::test
