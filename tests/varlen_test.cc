// Ragged batches (attend/varlen.hpp): equal to dense calls on each sequence (bitwise on the
// same views, within the fused kernel's tolerance of the float64 reference on contiguous
// copies), every score rule within a sequence, grouped-query heads, empty and one-token
// sequences, the backward, thread-count independence, and the refusals of bad offsets.
#include "attend/varlen.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "serving_support.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

struct Ragged {
  std::vector<int64_t> q_lens, k_lens;
  int64_t heads = 4, kv_heads = 2, dim = 16, value_dim = 12;
  Tensor q, k, v, cu_q, cu_k;
};

Ragged make_ragged(std::vector<int64_t> q_lens, std::vector<int64_t> k_lens, uint32_t seed) {
  Ragged r;
  r.q_lens = std::move(q_lens);
  r.k_lens = std::move(k_lens);
  int64_t total_q = 0, total_k = 0;
  for (int64_t l : r.q_lens) total_q += l;
  for (int64_t l : r.k_lens) total_k += l;
  r.q = random_tensor(Shape({total_q, r.heads, r.dim}), seed);
  r.k = random_tensor(Shape({total_k, r.kv_heads, r.dim}), seed + 1);
  r.v = random_tensor(Shape({total_k, r.kv_heads, r.value_dim}), seed + 2);
  r.cu_q = offsets(r.q_lens);
  r.cu_k = offsets(r.k_lens);
  return r;
}

// Rows [begin, begin + length) of a packed (total, heads, dim) tensor as (heads, length, dim).
TensorView rows(const Tensor& t, int64_t begin, int64_t length) {
  const Shape& s = t.shape();
  return TensorView(const_cast<float*>(t.data_as<float>()) + begin * s[1] * s[2], DType::kFloat32,
                    Shape({s[1], length, s[2]}), Shape({s[2], s[1] * s[2], 1}));
}

AttentionOptions rules() {
  AttentionOptions o;
  o.causal = true;
  o.window = SlidingWindow{6, 0};
  o.alibi = true;
  o.softcap = 15.0;
  return o;
}

TEST(Varlen, EqualsDenseCallsOnEachSequence) {
  // Lengths 0 and 1, keys longer and shorter than the queries, one long sequence.
  const Ragged r = make_ragged({3, 0, 1, 17, 5, 1, 40}, {7, 4, 1, 17, 2, 30, 90}, 1);
  const Tensor sinks = random_tensor(Shape({4}), 9);
  std::vector<AttentionOptions> variants(4);
  variants[1].causal = true;
  variants[2] = rules();
  variants[2].sinks = sinks.view();
  variants[3].causal = true;
  variants[3].causal_alignment = CausalAlignment::kTopLeft;
  for (size_t n = 0; n < variants.size(); ++n) {
    SCOPED_TRACE("variant " + std::to_string(n));
    const AttentionOptions& options = variants[n];
    Tensor lse(DType::kFloat32, Shape({r.q.shape()[0], r.heads}));
    Tensor out(DType::kFloat32, Shape({r.q.shape()[0], r.heads, r.value_dim}));
    const TensorView lse_view = lse.view();
    varlen_attention_into(r.q.view(), r.k.view(), r.v.view(), r.cu_q.view(), r.cu_k.view(),
                          out.view(), options, &lse_view);
    int64_t q0 = 0, k0 = 0;
    for (size_t s = 0; s < r.q_lens.size(); ++s) {
      const int64_t lq = r.q_lens[s], lk = r.k_lens[s];
      if (lq > 0) {
        // The same views through the dense call: bitwise.
        Tensor dense(DType::kFloat32, Shape({r.heads, lq, r.value_dim}));
        scaled_dot_product_attention_into(rows(r.q, q0, lq), rows(r.k, k0, lk), rows(r.v, k0, lk),
                                          dense.view(), nullptr, options);
        const Tensor got = Tensor::copy_of(rows(out, q0, lq));
        EXPECT_TRUE(same_bits(got, dense)) << "sequence " << s;
        // The float64 reference on contiguous copies of the sequence.
        const Tensor q = Tensor::copy_of(rows(r.q, q0, lq)), k = Tensor::copy_of(rows(r.k, k0, lk)),
                     v = Tensor::copy_of(rows(r.v, k0, lk));
        AttentionOptions reference = options;
        reference.backend = Backend::kReference;
        reference.need_logsumexp = true;
        const AttentionResult expected =
            scaled_dot_product_attention(q.view(), k.view(), v.view(), reference);
        for (int64_t i = 0; i < got.numel(); ++i) {
          ASSERT_NEAR(got.data_as<float>()[i], expected.output.data_as<float>()[i], 2e-5)
              << "sequence " << s << " element " << i;
        }
        for (int64_t h = 0; h < r.heads; ++h) {
          for (int64_t i = 0; i < lq; ++i) {
            ASSERT_NEAR(lse.data_as<float>()[(q0 + i) * r.heads + h],
                        expected.logsumexp.data_as<float>()[h * lq + i], 2e-5)
                << "sequence " << s << " head " << h << " query " << i;
          }
        }
      }
      q0 += lq;
      k0 += lk;
    }
  }
}

TEST(Varlen, BitwiseIdenticalAtAnyThreadCount) {
  std::vector<int64_t> lengths;
  for (int64_t s = 0; s < 16; ++s) lengths.push_back(1 + (s * 37) % 200);
  const Ragged r = make_ragged(lengths, lengths, 3);
  AttentionOptions options;
  options.causal = true;
  options.num_threads = 1;
  const Tensor one =
      varlen_attention(r.q.view(), r.k.view(), r.v.view(), r.cu_q.view(), r.cu_k.view(), options);
  for (int threads : {2, 3, 7}) {
    options.num_threads = threads;
    const Tensor many =
        varlen_attention(r.q.view(), r.k.view(), r.v.view(), r.cu_q.view(), r.cu_k.view(), options);
    EXPECT_TRUE(same_bits(one, many)) << threads << " threads";
  }
}

TEST(Varlen, BackwardEqualsDenseGradientsOnEachSequence) {
  const Ragged r = make_ragged({3, 0, 1, 17, 6}, {7, 5, 1, 17, 30}, 5);
  for (const AttentionOptions& options : {AttentionOptions{}, rules()}) {
    const int64_t total_q = r.q.shape()[0];
    Tensor out(DType::kFloat32, Shape({total_q, r.heads, r.value_dim}));
    Tensor lse(DType::kFloat32, Shape({total_q, r.heads}));
    const TensorView lse_view = lse.view();
    varlen_attention_into(r.q.view(), r.k.view(), r.v.view(), r.cu_q.view(), r.cu_k.view(),
                          out.view(), options, &lse_view);
    const Tensor g = random_tensor(out.shape(), 7);
    Tensor dq(DType::kFloat32, r.q.shape()), dk(DType::kFloat32, r.k.shape()),
        dv(DType::kFloat32, r.v.shape());
    for (Tensor* t : {&dk, &dv}) {  // the empty sequence's keys must be written (zeros)
      for (int64_t n = 0; n < t->numel(); ++n) t->data_as<float>()[n] = NAN;
    }
    AttentionOptions threads = options;
    threads.num_threads = 3;
    varlen_attention_backward_into(g.view(), r.q.view(), r.k.view(), r.v.view(), out.view(),
                                   lse.view(), r.cu_q.view(), r.cu_k.view(), dq.view(), dk.view(),
                                   dv.view(), threads);
    int64_t q0 = 0, k0 = 0;
    for (size_t s = 0; s < r.q_lens.size(); ++s) {
      const int64_t lq = r.q_lens[s], lk = r.k_lens[s];
      const Tensor gotk = Tensor::copy_of(rows(dk, k0, lk));
      const Tensor gotv = Tensor::copy_of(rows(dv, k0, lk));
      if (lq == 0) {
        for (const Tensor* t : {&gotk, &gotv}) {
          for (int64_t n = 0; n < t->numel(); ++n) ASSERT_EQ(t->data_as<float>()[n], 0.0f);
        }
      } else {
        const Tensor q = Tensor::copy_of(rows(r.q, q0, lq)), k = Tensor::copy_of(rows(r.k, k0, lk)),
                     v = Tensor::copy_of(rows(r.v, k0, lk)), gs = Tensor::copy_of(rows(g, q0, lq));
        AttentionOptions reference = options;
        reference.backend = Backend::kReference;
        reference.need_logsumexp = true;
        const AttentionResult f =
            scaled_dot_product_attention(q.view(), k.view(), v.view(), reference);
        const AttentionGradients e =
            scaled_dot_product_attention_backward(gs.view(), q.view(), k.view(), v.view(),
                                                  f.output.view(), f.logsumexp.view(), reference);
        const Tensor gotq = Tensor::copy_of(rows(dq, q0, lq));
        for (auto [got, want] :
             {std::pair{&gotq, &e.query}, std::pair{&gotk, &e.key}, std::pair{&gotv, &e.value}}) {
          for (int64_t n = 0; n < got->numel(); ++n) {
            ASSERT_NEAR(got->data_as<float>()[n], want->data_as<float>()[n], 5e-5)
                << "sequence " << s << " element " << n;
          }
        }
      }
      q0 += lq;
      k0 += lk;
    }
  }
}

TEST(Varlen, RefusesBadOffsetsBeforeWriting) {
  const Ragged r = make_ragged({3, 2}, {4, 5}, 1);
  Tensor out = Tensor::zeros(DType::kFloat32, Shape({5, 4, 12}));
  const auto call = [&](const Tensor& cu_q, const Tensor& cu_k, const AttentionOptions& o = {}) {
    return error_of([&] {
      varlen_attention_into(r.q.view(), r.k.view(), r.v.view(), cu_q.view(), cu_k.view(),
                            out.view(), o);
    });
  };
  const auto cu = [](std::vector<int32_t> values) {
    Tensor t(DType::kInt32, Shape({static_cast<int64_t>(values.size())}));
    for (size_t n = 0; n < values.size(); ++n) t.data_as<int32_t>()[n] = values[n];
    return t;
  };
  EXPECT_NE(call(cu({1, 3, 5}), r.cu_k).find("cu_seqlens_q[0] is 1, should be 0"),
            std::string::npos);
  EXPECT_NE(call(cu({0, 4, 3}), r.cu_k).find("not non-decreasing"), std::string::npos);
  EXPECT_NE(call(r.cu_q, cu({0, 4, 8})).find("cu_seqlens_k[B] is 8 but the packed tensor holds 9"),
            std::string::npos);
  EXPECT_NE(call(r.cu_q, cu({0, 9})).find("cu_seqlens_q has 3 offsets and cu_seqlens_k 2"),
            std::string::npos);
  EXPECT_NE(call(r.cu_q, cu({0, 0, 9})).find("sequence 0 has 3 queries but no keys"),
            std::string::npos);
  Tensor wide(DType::kInt64, Shape({3}));
  EXPECT_NE(call(wide, r.cu_k).find("should be int32"), std::string::npos);
  AttentionOptions dropout;
  dropout.dropout = 0.1;
  EXPECT_NE(call(r.cu_q, r.cu_k, dropout).find("dropout"), std::string::npos);
  AttentionOptions prefix;
  prefix.causal = true;
  prefix.prefix = 5;  // beyond sequence 0's 4 keys
  EXPECT_NE(call(r.cu_q, r.cu_k, prefix).find("sequence 0: prefix"), std::string::npos)
      << call(r.cu_q, r.cu_k, prefix);
  const Tensor odd_heads = random_tensor(Shape({9, 3, 16}), 2);
  EXPECT_NE(error_of([&] {
              varlen_attention_into(r.q.view(), odd_heads.view(), odd_heads.view(), r.cu_q.view(),
                                    r.cu_k.view(), out.view());
            }).find("divide"),
            std::string::npos);
  for (int64_t n = 0; n < out.numel(); ++n) ASSERT_EQ(out.data_as<float>()[n], 0.0f);
}

}  // namespace
}  // namespace attend::test
