// User rules (attend/score_mod.hpp) in the fused forward and backward: ALiBi written as a
// score_mod and documents written as a mask_mod give bit for bit what the built-in rules give,
// on every SIMD target and every kernel shape (row groups, query tiles, key split); a user
// softcap (through attend::Dual for its gradient) matches the float64 reference; results do
// not depend on the thread count.
#include "attend/score_mod.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "sdpa_cases.hpp"

namespace attend::test {
namespace {

// (2 batch, 4 heads, L, E) inputs; the shapes pick the kernel: Lq <= 8 row groups, one query
// and many keys the key split, else query tiles.
struct Shape4 {
  const char* name;
  int64_t query_len, key_len, head_dim;
};
constexpr Shape4 kShapes[] = {
    {"row groups", 3, 77, 32},
    {"query tiles", 100, 130, 16},
    {"key split", 1, 1100, 64},
    {"tiles with a key split", 64, 1024, 32},
};

struct Inputs {
  Tensor query, key, value, grad_output;
  Inputs(const Shape4& s)
      : query(random_tensor(Shape({2, 4, s.query_len, s.head_dim}), 1)),
        key(random_tensor(Shape({2, 4, s.key_len, s.head_dim}), 2)),
        value(random_tensor(Shape({2, 4, s.key_len, s.head_dim}), 3)),
        grad_output(random_tensor(Shape({2, 4, s.query_len, s.head_dim}), 4)) {}
};

struct Results {
  AttentionResult forward;
  AttentionGradients gradients;
};

Results run(const Inputs& in, AttentionOptions options) {
  options.need_logsumexp = true;
  Results r;
  r.forward =
      scaled_dot_product_attention(in.query.view(), in.key.view(), in.value.view(), options);
  r.gradients = scaled_dot_product_attention_backward(
      in.grad_output.view(), in.query.view(), in.key.view(), in.value.view(),
      r.forward.output.view(), r.forward.logsumexp.view(), options);
  return r;
}

void expect_bitwise(const Tensor& got, const Tensor& expected, const std::string& what) {
  ASSERT_EQ(got.nbytes(), expected.nbytes()) << what;
  if (std::memcmp(got.data(), expected.data(), got.nbytes()) == 0) return;
  const float* g = got.data_as<float>();
  const float* e = expected.data_as<float>();
  for (int64_t n = 0; n < got.numel(); ++n) {
    if (std::memcmp(&g[n], &e[n], sizeof(float)) != 0) {
      ADD_FAILURE() << what << ": element " << n << " is " << g[n] << ", expected " << e[n]
                    << " bit for bit";
      return;
    }
  }
}

void expect_same(const Results& got, const Results& expected, const std::string& what) {
  expect_bitwise(got.forward.output, expected.forward.output, what + " output");
  if (!expected.forward.weights.empty()) {
    expect_bitwise(got.forward.weights, expected.forward.weights, what + " weights");
  }
  expect_bitwise(got.forward.logsumexp, expected.forward.logsumexp, what + " logsumexp");
  expect_bitwise(got.gradients.query, expected.gradients.query, what + " dQ");
  expect_bitwise(got.gradients.key, expected.gradients.key, what + " dK");
  expect_bitwise(got.gradients.value, expected.gradients.value, what + " dV");
}

TEST(UserRules, AlibiAsScoreModIsTheBuiltInBitForBit) {
  const std::vector<float> slopes = default_alibi_slopes(4);
  for (const CausalAlignment alignment :
       {CausalAlignment::kBottomRight, CausalAlignment::kTopLeft}) {
    for (const Shape4& shape : kShapes) {
      const Inputs in(shape);
      const int64_t offset =
          alignment == CausalAlignment::kBottomRight ? shape.key_len - shape.query_len : 0;
      const auto alibi = [&](auto score, int32_t, int32_t h, int32_t q, int32_t kv) {
        return score + slopes[static_cast<size_t>(h)] * static_cast<float>(kv - (q + offset));
      };
      AttentionOptions built_in;
      built_in.causal = true;
      built_in.causal_alignment = alignment;
      built_in.alibi = true;
      built_in.need_weights = shape.key_len < 1000;  // weights disable the key split
      AttentionOptions user = built_in;
      user.alibi = false;
      user.user_rules = make_score_rules(alibi);
      for (const std::string& target : supported_simd_targets()) {
        ScopedSimdCap cap(target);
        expect_same(run(in, user), run(in, built_in), std::string(shape.name) + " on " + target);
      }
    }
  }
}

TEST(UserRules, DocumentsAsMaskModAreTheBuiltInBitForBit) {
  for (const Shape4& shape : kShapes) {
    const Inputs in(shape);
    // Keys in documents of 40 (the last ones shorter); query i is at key position
    // i + Lk − Lq (bottom-right).
    const int64_t offset = shape.key_len - shape.query_len;
    Tensor key_ids(DType::kInt32, Shape({shape.key_len}));
    Tensor query_ids(DType::kInt32, Shape({shape.query_len}));
    for (int64_t j = 0; j < shape.key_len; ++j) key_ids.data_as<int32_t>()[j] = j / 40;
    for (int64_t i = 0; i < shape.query_len; ++i) {
      query_ids.data_as<int32_t>()[i] = static_cast<int32_t>((i + offset) / 40);
    }
    const auto same_document = [&](int32_t, int32_t, int32_t q, int32_t kv) {
      return (q + offset) / 40 == kv / 40;
    };
    AttentionOptions built_in;
    built_in.causal = true;
    built_in.segment_ids_query = query_ids.view();
    built_in.segment_ids_key = key_ids.view();
    built_in.need_weights = shape.key_len < 1000;
    AttentionOptions user = built_in;
    user.segment_ids_query.reset();
    user.segment_ids_key.reset();
    user.user_rules = make_score_rules(kNoScoreMod, same_document);
    for (const std::string& target : supported_simd_targets()) {
      ScopedSimdCap cap(target);
      expect_same(run(in, user), run(in, built_in), std::string(shape.name) + " on " + target);
    }
  }
}

// Largest |a − b| over two float32 tensors.
double max_difference(const Tensor& a, const Tensor& b) {
  double worst = 0;
  for (int64_t n = 0; n < a.numel(); ++n) {
    worst = std::max(worst, std::abs(double{a.data_as<float>()[n]} - b.data_as<float>()[n]));
  }
  return worst;
}

// A softcap written by the user (its gradient through attend::Dual and attend::tanh), a
// window and a mask rule at once: the fused kernels against the float64 reference.
TEST(UserRules, UserSoftcapAndMaskMatchTheReference) {
  const auto softcap = [](auto score, int32_t, int32_t, int32_t, int32_t) {
    return 3.0f * attend::tanh(score / 3.0f);
  };
  const auto checkerboard = [](int32_t b, int32_t h, int32_t q, int32_t kv) {
    return (q + kv + b + h) % 3 != 0;
  };
  for (const Shape4& shape : kShapes) {
    const Inputs in(shape);
    AttentionOptions options;
    options.window = SlidingWindow{200, 5};
    options.user_rules = make_score_rules(softcap, checkerboard);
    AttentionOptions reference = options;
    reference.backend = Backend::kReference;
    const Results expected = run(in, reference);
    for (const std::string& target : supported_simd_targets()) {
      ScopedSimdCap cap(target);
      const Results got = run(in, options);
      // Values in ±1: the outputs are weighted means of them, gradients of the same size;
      // float32 kernels stay within 1e-5 of float64 at these lengths (measured: < 2e-6).
      const std::string where = std::string(shape.name) + " on " + target;
      EXPECT_LT(max_difference(got.forward.output, expected.forward.output), 1e-5) << where;
      EXPECT_LT(max_difference(got.gradients.query, expected.gradients.query), 1e-5) << where;
      EXPECT_LT(max_difference(got.gradients.key, expected.gradients.key), 1e-5) << where;
      EXPECT_LT(max_difference(got.gradients.value, expected.gradients.value), 1e-5) << where;
    }
  }
}

// Every built-in rule and a user rule at once: the bits do not depend on the thread count.
TEST(UserRules, ResultsDoNotDependOnTheThreadCount) {
  const std::vector<float> slopes = default_alibi_slopes(4);
  const auto alibi = [&](auto score, int32_t, int32_t h, int32_t q, int32_t kv) {
    return score + slopes[static_cast<size_t>(h)] * static_cast<float>(kv - q);
  };
  Tensor sinks = random_tensor(Shape({4}), 9);
  for (const Shape4& shape : kShapes) {
    const Inputs in(shape);
    AttentionOptions options;
    options.causal = true;
    options.window = SlidingWindow{300, 0};
    options.softcap = 4.0;
    options.sinks = sinks.view();
    options.dropout = 0.2;
    options.seed = 11;
    options.user_rules = make_score_rules(alibi);
    options.num_threads = 1;
    const Results one = run(in, options);
    for (int threads : {2, 3, 5}) {
      options.num_threads = threads;
      expect_same(run(in, options), one,
                  std::string(shape.name) + " at " + std::to_string(threads) + " threads");
    }
  }
}

}  // namespace
}  // namespace attend::test
