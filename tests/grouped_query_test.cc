// Grouped-query attention through the public API: the explicit option and what it checks,
// the refusals, equality with the dense problem (K/V heads repeated by hand), the gradients
// summed over each group, thread-count independence. The grid cases with kv_heads= (tests/
// data/sdpa_cases.txt, sdpa_backward_cases.txt) check every kernel against the reference.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "cpu_features.hpp"
#include "serving_support.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

// (B, Hkv, L, D) → (B, Hkv·group, L, D), K/V head h / group for head h.
Tensor repeat_heads(const Tensor& t, int64_t group) {
  const Shape& s = t.shape();
  Tensor dense(DType::kFloat32, Shape({s[0], s[1] * group, s[2], s[3]}));
  const int64_t head = s[2] * s[3];
  for (int64_t b = 0; b < s[0]; ++b) {
    for (int64_t h = 0; h < s[1] * group; ++h) {
      std::memcpy(dense.data_as<float>() + (b * s[1] * group + h) * head,
                  t.data_as<float>() + (b * s[1] + h / group) * head,
                  static_cast<size_t>(head) * sizeof(float));
    }
  }
  return dense;
}

TEST(GroupedQuery, EqualsTheDenseProblemBitwise) {
  // The kernels see the same float32 operands in the same order whether K/V are shared by
  // a group or repeated: the results agree bit for bit (decode rows, phrase rows, tiles).
  // Not where the group's G·Lq rows run as one grouped-query tile (shape_policy.hpp:
  // PacksGroupedQueries; Lq 3 × G 4 on AVX2 and AVX-512), which the case grid checks against
  // the reference instead: the lengths here stay in the row groups and the plain tiles.
  for (int64_t lq : {1, 40}) {
    const Tensor q = random_tensor(Shape({2, 8, lq, 32}), 1);
    const Tensor k = random_tensor(Shape({2, 2, 77, 32}), 2);
    const Tensor v = random_tensor(Shape({2, 2, 77, 24}), 3);
    AttentionOptions options;
    options.causal = true;
    options.need_logsumexp = true;
    const AttentionResult grouped =
        scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
    const Tensor dk = repeat_heads(k, 4), dv = repeat_heads(v, 4);
    const AttentionResult dense =
        scaled_dot_product_attention(q.view(), dk.view(), dv.view(), options);
    EXPECT_TRUE(same_bits(grouped.output, dense.output)) << "Lq " << lq;
    EXPECT_TRUE(same_bits(grouped.logsumexp, dense.logsumexp)) << "Lq " << lq;

    // Backward: dK of a K/V head is the sum over its group of the dense dK.
    const Tensor g = random_tensor(grouped.output.shape(), 4);
    const AttentionGradients gg = scaled_dot_product_attention_backward(
        g.view(), q.view(), k.view(), v.view(), grouped.output.view(), grouped.logsumexp.view(),
        options);
    const AttentionGradients dg =
        scaled_dot_product_attention_backward(g.view(), q.view(), dk.view(), dv.view(),
                                              dense.output.view(), dense.logsumexp.view(), options);
    EXPECT_TRUE(same_bits(gg.query, dg.query)) << "Lq " << lq;
    const int64_t head = 77 * 32;
    for (int64_t n = 0; n < gg.key.numel(); ++n) {
      const int64_t b = n / (2 * head), h = n / head % 2, within = n % head;
      double sum = 0;
      for (int64_t r = 0; r < 4; ++r) {
        sum += dg.key.data_as<float>()[(b * 8 + h * 4 + r) * head + within];
      }
      ASSERT_EQ(gg.key.data_as<float>()[n], static_cast<float>(sum)) << "dK at " << n;
    }
  }
}

TEST(GroupedQuery, ExplicitOptionChecksTheShapes) {
  const Tensor q = random_tensor(Shape({8, 5, 16}), 1);
  const Tensor k = random_tensor(Shape({2, 9, 16}), 2);
  const Tensor v = random_tensor(Shape({2, 9, 16}), 3);
  AttentionOptions options;
  options.num_kv_heads = 2;
  EXPECT_NO_THROW(scaled_dot_product_attention(q.view(), k.view(), v.view(), options));
  options.num_kv_heads = 4;
  const std::string mismatch =
      error_of([&] { scaled_dot_product_attention(q.view(), k.view(), v.view(), options); });
  EXPECT_NE(mismatch.find("num_kv_heads 4 does not match"), std::string::npos) << mismatch;
  options.num_kv_heads = -1;
  EXPECT_NE(error_of([&] {
              scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
            }).find("num_kv_heads must be >= 0"),
            std::string::npos);
}

TEST(GroupedQuery, RefusesHeadsThatDoNotDivide) {
  const Tensor q = random_tensor(Shape({6, 5, 16}), 1);
  const Tensor k = random_tensor(Shape({4, 9, 16}), 2);
  const Tensor v = random_tensor(Shape({4, 9, 16}), 3);
  const std::string message =
      error_of([&] { scaled_dot_product_attention(q.view(), k.view(), v.view()); });
  EXPECT_NE(message.find("key/value heads (4) to divide the query heads (6)"), std::string::npos)
      << message;
  const Tensor v3 = random_tensor(Shape({3, 9, 16}), 3);
  const Tensor k3 = random_tensor(Shape({3, 9, 16}), 3);
  const std::string kv =
      error_of([&] { scaled_dot_product_attention(q.view(), k3.view(), v.view()); });
  EXPECT_NE(kv.find("differs between key and value"), std::string::npos) << kv;
  // Four batch dimensions leave no room to split the heads.
  const Tensor q4 = random_tensor(Shape({2, 1, 1, 4, 3, 8}), 1);
  const Tensor k4 = random_tensor(Shape({2, 1, 1, 2, 3, 8}), 2);
  const std::string rank =
      error_of([&] { scaled_dot_product_attention(q4.view(), k4.view(), k4.view()); });
  EXPECT_NE(rank.find("at most 3 batch dimensions"), std::string::npos) << rank;
  // A leading 1 of four batch dimensions is fine.
  const Tensor q41 = random_tensor(Shape({1, 2, 1, 4, 3, 8}), 1);
  const Tensor k41 = random_tensor(Shape({1, 2, 1, 2, 3, 8}), 2);
  EXPECT_NO_THROW(scaled_dot_product_attention(q41.view(), k41.view(), k41.view()));
}

// The grouped-query tiles (G·Lq rows of a K/V head as one query tile): chosen where the
// shape policy says, bitwise the same at any thread count, with and without the key split,
// with the rules that read the query position and the head.
// 32 packed rows per K/V head (16 query heads on 2 K/V heads, 4 queries each), causal with
// ALiBi and sinks, over one span (Lk 300) and over a key split (Lk 5000): where `expect_tiles`,
// the kernel named `kernel_prefix` runs, and any thread count gives the same bits.
void ExpectGroupedTilesBitwiseAtAnyThreadCount(DType dtype, ComputePrecision compute,
                                               const std::string& kernel_prefix,
                                               bool expect_tiles) {
  for (const int64_t lk : {300, 5000}) {
    const Tensor q = random_tensor(Shape({2, 16, 4, 64}), 1, 1.0, dtype);
    const Tensor k = random_tensor(Shape({2, 2, lk, 64}), 2, 1.0, dtype);
    const Tensor v = random_tensor(Shape({2, 2, lk, 64}), 3, 1.0, dtype);
    const Tensor slopes = random_tensor(Shape({16}), 4);
    const Tensor sinks = random_tensor(Shape({16}), 5);
    AttentionOptions options;
    options.causal = true;
    options.need_logsumexp = true;
    options.alibi_slopes = slopes.view();
    options.sinks = sinks.view();
    options.compute = compute;
    options.num_threads = 1;
    const std::string kernel = attention_kernel(q.view(), k.view(), v.view(), options);
    if (expect_tiles) {
      EXPECT_EQ(kernel.rfind(kernel_prefix, 0), 0u) << kernel;
      EXPECT_EQ(kernel.find("key split") != std::string::npos, lk == 5000) << kernel;
    }
    const AttentionResult one = scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
    for (int threads : {2, 3}) {
      options.num_threads = threads;
      const AttentionResult many =
          scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
      EXPECT_TRUE(same_bits(one.output, many.output)) << threads << " threads, Lk " << lk;
      EXPECT_TRUE(same_bits(one.logsumexp, many.logsumexp)) << threads << " threads, Lk " << lk;
    }
  }
}

// float32: a grouped-query tile wherever the row groups run (AVX2 and up).
TEST(GroupedQuery, GroupedTilesBitwiseIdenticalAtAnyThreadCount) {
  ExpectGroupedTilesBitwiseAtAnyThreadCount(DType::kFloat32, ComputePrecision::kAuto,
                                            "fused grouped-query tiles",
                                            active_simd_target().rfind("AVX", 0) == 0);
}

// bfloat16 products in the grouped-query tiles (decode-verify4-bf16's path), bfloat16 Q, K and
// V with the precision asked for. Their error model (FlashAttention's bfloat16 rule) is checked
// against the reference over the grid's kv_heads cases (tests/bf16_test.cc).
TEST(GroupedQuery, GroupedTilesWithBf16ProductsBitwiseIdenticalAtAnyThreadCount) {
  if (!detail::native_bf16_products()) GTEST_SKIP() << "no bfloat16 products on this target";
  ExpectGroupedTilesBitwiseAtAnyThreadCount(DType::kBFloat16, ComputePrecision::kBFloat16,
                                            "fused grouped-query tiles (bfloat16 products)", true);
}

TEST(GroupedQuery, BitwiseIdenticalAtAnyThreadCount) {
  const Tensor q = random_tensor(Shape({32, 1, 64}), 1);
  const Tensor k = random_tensor(Shape({8, 3000, 64}), 2);
  const Tensor v = random_tensor(Shape({8, 3000, 64}), 3);
  AttentionOptions options;
  options.num_threads = 1;
  const AttentionResult one = scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
  for (int threads : {2, 3, 5}) {
    options.num_threads = threads;
    const AttentionResult many =
        scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
    EXPECT_TRUE(same_bits(one.output, many.output)) << threads << " threads";
  }
}

}  // namespace
}  // namespace attend::test
