// AttentionOptions::block: a problem cut into blocks of queries and keys, each block computed
// by its own call at its global positions (fused and reference backends), gives the whole
// problem's attention once the blocks are merged by their log-sum-exp (forward) and their
// gradients summed (backward): every score rule, the causal alignment and the dropout draw
// see global positions. Checked against the tests' independent float64 listing within the
// error model, blocks cut at odd places (dropout's groups of four keys do not align).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "dropout.hpp"
#include "error_model.hpp"
#include "independent_gradients.hpp"
#include "sdpa_cases.hpp"

namespace attend::test {
namespace {

// (2, 3, L, E) inputs: batch 2, heads 3.
constexpr int64_t kBatch = 2, kHeads = 3, kHeadDim = 16, kValueDim = 12;

// `length` entries of dimension `dim` from `start`.
TensorView narrow(TensorView view, int dim, int64_t start, int64_t length) {
  view.data = static_cast<char*>(view.data) +
              start * view.strides[dim] * static_cast<int64_t>(dtype_size(view.dtype));
  view.shape[dim] = length;
  return view;
}

struct BlockCase {
  const char* name;
  int64_t query_len, key_len;
  std::vector<int64_t> query_cuts, key_cuts;  // block boundaries, from 0 to the length
  std::function<void(AttentionOptions&)> configure;
};

struct Problem {
  Tensor query, key, value, grad_output, mask, sinks, segments_query, segments_key;
  AttentionOptions options;  // the whole problem's
};

Problem make_problem(const BlockCase& c, bool with_mask, bool with_documents, bool with_sinks) {
  Problem p{random_tensor(Shape({kBatch, kHeads, c.query_len, kHeadDim}), 11),
            random_tensor(Shape({kBatch, kHeads, c.key_len, kHeadDim}), 12),
            random_tensor(Shape({kBatch, kHeads, c.key_len, kValueDim}), 13),
            random_tensor(Shape({kBatch, kHeads, c.query_len, kValueDim}), 14),
            {},
            {},
            {},
            {},
            {}};
  c.configure(p.options);
  // Query i sits at position i + shift: no row loses every key.
  const int64_t shift =
      p.options.causal_alignment == CausalAlignment::kBottomRight ? c.key_len - c.query_len : 0;
  if (with_mask) {  // random, the diagonal kept
    p.mask = Tensor(DType::kBool, Shape({c.query_len, c.key_len}));
    const std::vector<float> draws = uniform_values(c.query_len * c.key_len, 15);
    for (int64_t i = 0; i < c.query_len; ++i) {
      for (int64_t j = 0; j < c.key_len; ++j) {
        const int64_t n = i * c.key_len + j;
        p.mask.data_as<bool>()[n] = j == i + shift || draws[static_cast<size_t>(n)] > 0.0f;
      }
    }
    p.options.mask = p.mask.view();
  }
  if (with_documents) {  // documents of unequal lengths; a query in the document of its position
    p.segments_query = Tensor(DType::kInt32, Shape({c.query_len}));
    p.segments_key = Tensor(DType::kInt32, Shape({c.key_len}));
    const auto document = [](int64_t position) { return static_cast<int32_t>(position / 11); };
    for (int64_t j = 0; j < c.key_len; ++j) p.segments_key.data_as<int32_t>()[j] = document(j);
    for (int64_t i = 0; i < c.query_len; ++i) {
      p.segments_query.data_as<int32_t>()[i] = document(i + shift);
    }
    p.options.segment_ids_query = p.segments_query.view();
    p.options.segment_ids_key = p.segments_key.view();
  }
  if (with_sinks) {
    p.sinks = random_tensor(Shape({kHeads}), 16, 2.0);
    p.options.sinks = p.sinks.view();
  }
  return p;
}

// The block (query block a, key block b)'s options: global positions, the block's slices of
// the mask and segment ids, empty rows zero (so that a block where a row sees no key adds
// nothing to the merge) and no sinks (the merge adds each row's sink once).
AttentionOptions block_options(const Problem& p, const BlockCase& c, size_t a, size_t b,
                               Backend backend) {
  const int64_t q0 = c.query_cuts[a], q1 = c.query_cuts[a + 1];
  const int64_t k0 = c.key_cuts[b], k1 = c.key_cuts[b + 1];
  AttentionOptions o = p.options;
  o.block = BlockPositions{q0, k0, c.query_len, c.key_len};
  if (o.mask) o.mask = narrow(narrow(*o.mask, 0, q0, q1 - q0), 1, k0, k1 - k0);
  if (o.segment_ids_query) {
    o.segment_ids_query = narrow(*o.segment_ids_query, 0, q0, q1 - q0);
    o.segment_ids_key = narrow(*o.segment_ids_key, 0, k0, k1 - k0);
  }
  o.sinks.reset();
  o.fully_masked_rows = FullyMaskedRows::kZero;
  o.need_logsumexp = true;
  o.backend = backend;
  return o;
}

struct Merged {
  Tensor output, logsumexp;  // (2, 3, Lq, Ev) and (2, 3, Lq), float32
  std::vector<double> output_values;
};

// Every block's forward, merged: lse = log(Σ_b exp(lse_b) + exp(sink)),
// O = Σ_b exp(lse_b − lse)·O_b.
Merged forward_by_blocks(const Problem& p, const BlockCase& c, Backend backend) {
  const int64_t Lq = c.query_len, rows = kBatch * kHeads;
  std::vector<double> out(static_cast<size_t>(rows * Lq * kValueDim), 0.0);
  std::vector<std::vector<double>> lse_parts(static_cast<size_t>(rows * Lq));
  std::vector<std::vector<const float*>> out_parts(static_cast<size_t>(rows * Lq));
  std::vector<AttentionResult> results;
  results.reserve(c.query_cuts.size() * c.key_cuts.size());
  for (size_t a = 0; a + 1 < c.query_cuts.size(); ++a) {
    const int64_t q0 = c.query_cuts[a], lq = c.query_cuts[a + 1] - q0;
    for (size_t b = 0; b + 1 < c.key_cuts.size(); ++b) {
      const int64_t k0 = c.key_cuts[b], lk = c.key_cuts[b + 1] - k0;
      results.push_back(scaled_dot_product_attention(
          narrow(p.query.view(), 2, q0, lq), narrow(p.key.view(), 2, k0, lk),
          narrow(p.value.view(), 2, k0, lk), block_options(p, c, a, b, backend)));
      const AttentionResult& r = results.back();
      for (int64_t bh = 0; bh < rows; ++bh) {
        for (int64_t i = 0; i < lq; ++i) {
          const auto row = static_cast<size_t>(bh * Lq + q0 + i);
          lse_parts[row].push_back(r.logsumexp.data_as<float>()[bh * lq + i]);
          out_parts[row].push_back(r.output.data_as<float>() + (bh * lq + i) * kValueDim);
        }
      }
    }
  }
  Merged m{Tensor(DType::kFloat32, Shape({kBatch, kHeads, Lq, kValueDim})),
           Tensor(DType::kFloat32, Shape({kBatch, kHeads, Lq})),
           {}};
  for (int64_t bh = 0; bh < rows; ++bh) {
    const double sink = p.options.sinks ? p.sinks.data_as<float>()[bh % kHeads] : -INFINITY;
    for (int64_t i = 0; i < Lq; ++i) {
      const auto row = static_cast<size_t>(bh * Lq + i);
      double top = sink;
      for (double l : lse_parts[row]) top = std::max(top, l);
      double sum = std::exp(sink - top);
      for (double l : lse_parts[row]) sum += std::exp(l - top);
      const double lse = top + std::log(sum);
      m.logsumexp.data_as<float>()[row] = static_cast<float>(lse);
      for (size_t n = 0; n < lse_parts[row].size(); ++n) {
        const double weight = std::exp(lse_parts[row][n] - lse);
        for (int64_t e = 0; e < kValueDim; ++e) {
          out[row * kValueDim + static_cast<size_t>(e)] += weight * out_parts[row][n][e];
        }
      }
    }
  }
  for (size_t n = 0; n < out.size(); ++n) m.output.data_as<float>()[n] = static_cast<float>(out[n]);
  m.output_values = out;
  return m;
}

// Every block's backward from the merged O and lse, summed over blocks: dQ over key blocks,
// dK and dV over query blocks.
Gradients backward_by_blocks(const Problem& p, const BlockCase& c, const Merged& m,
                             Backend backend) {
  const int64_t Lq = c.query_len, Lk = c.key_len, rows = kBatch * kHeads;
  Gradients g;
  g.query.assign(static_cast<size_t>(rows * Lq * kHeadDim), 0.0);
  g.key.assign(static_cast<size_t>(rows * Lk * kHeadDim), 0.0);
  g.value.assign(static_cast<size_t>(rows * Lk * kValueDim), 0.0);
  const auto add = [rows](std::vector<double>& to, const Tensor& from, int64_t length,
                          int64_t first, int64_t count, int64_t dim) {
    for (int64_t bh = 0; bh < rows; ++bh) {
      for (int64_t n = 0; n < count * dim; ++n) {
        to[static_cast<size_t>((bh * length + first) * dim + n)] +=
            from.data_as<float>()[bh * count * dim + n];
      }
    }
  };
  for (size_t a = 0; a + 1 < c.query_cuts.size(); ++a) {
    const int64_t q0 = c.query_cuts[a], lq = c.query_cuts[a + 1] - q0;
    for (size_t b = 0; b + 1 < c.key_cuts.size(); ++b) {
      const int64_t k0 = c.key_cuts[b], lk = c.key_cuts[b + 1] - k0;
      const AttentionGradients r = scaled_dot_product_attention_backward(
          narrow(p.grad_output.view(), 2, q0, lq), narrow(p.query.view(), 2, q0, lq),
          narrow(p.key.view(), 2, k0, lk), narrow(p.value.view(), 2, k0, lk),
          narrow(m.output.view(), 2, q0, lq), narrow(m.logsumexp.view(), 2, q0, lq),
          block_options(p, c, a, b, backend));
      add(g.query, r.query, Lq, q0, lq, kHeadDim);
      add(g.key, r.key, Lk, k0, lk, kHeadDim);
      add(g.value, r.value, Lk, k0, lk, kValueDim);
    }
  }
  return g;
}

void expect_close(const char* what, const std::vector<double>& got,
                  const std::vector<double>& expected, const std::vector<double>& tolerance) {
  ASSERT_EQ(got.size(), expected.size());
  size_t worst = 0;
  double worst_excess = 0.0;
  for (size_t n = 0; n < got.size(); ++n) {
    const double excess = std::abs(got[n] - expected[n]) / tolerance[n];
    if (!(excess <= worst_excess)) {
      worst_excess = excess;
      worst = n;
    }
  }
  EXPECT_LE(worst_excess, 1.0) << what << " element " << worst << ": got " << got[worst]
                               << ", expected " << expected[worst] << ", tolerance "
                               << tolerance[worst];
}

const BlockCase kCases[] = {
    {"plain", 37, 37, {0, 13, 37}, {0, 7, 26, 37}, [](AttentionOptions&) {}},
    {"causal", 37, 37, {0, 13, 37}, {0, 7, 26, 37}, [](AttentionOptions& o) { o.causal = true; }},
    {"causal_bottom_right",
     29,
     45,
     {0, 5, 18, 29},
     {0, 19, 30, 45},
     [](AttentionOptions& o) { o.causal = true; }},
    {"causal_top_left",
     29,
     45,
     {0, 11, 29},
     {0, 9, 22, 45},
     [](AttentionOptions& o) {
       o.causal = true;
       o.causal_alignment = CausalAlignment::kTopLeft;
     }},
    {"window",
     37,
     37,
     {0, 13, 37},
     {0, 7, 26, 37},
     [](AttentionOptions& o) {
       o.window = SlidingWindow{5, 3};
     }},
    {"causal_window_prefix",
     37,
     41,
     {0, 20, 37},
     {0, 6, 17, 41},
     [](AttentionOptions& o) {
       o.causal = true;
       o.window = SlidingWindow{6, 0};
       o.prefix = 9;
     }},
    {"alibi_softcap",
     37,
     37,
     {0, 13, 37},
     {0, 7, 26, 37},
     [](AttentionOptions& o) {
       o.causal = true;
       o.alibi = true;
       o.softcap = 3.0;
     }},
    {"dropout",
     37,
     37,
     {0, 13, 37},
     {0, 7, 26, 37},
     [](AttentionOptions& o) {
       o.causal = true;
       o.dropout = 0.2;
       o.seed = 77;
     }},
};

struct Variant {
  const char* name;
  bool mask, documents, sinks;
};
constexpr Variant kVariants[] = {
    {"", false, false, false},
    {"+mask", true, false, false},
    {"+documents", false, true, false},
    {"+sinks", false, false, true},
};

TEST(BlockPositions, BlocksMergedEqualTheWholeProblem) {
  for (const BlockCase& c : kCases) {
    for (const Variant& v : kVariants) {
      const Problem p = make_problem(c, v.mask, v.documents, v.sinks);
      ReferenceProblem exact =
          reference_problem(p.query.view(), p.key.view(), p.value.view(), p.options);
      if (p.options.dropout > 0) {
        const uint32_t threshold = detail::dropout_threshold(p.options.dropout);
        for (int64_t b = 0; b < exact.batch(); ++b) {
          for (int64_t i = 0; i < c.query_len; ++i) {
            for (int64_t j = 0; j < c.key_len; ++j) {
              exact.dropout_factor.push_back(
                  detail::dropout_keep(p.options.seed, threshold, b, i, j)
                      ? 1.0 / (1.0 - p.options.dropout)
                      : 0.0);
            }
          }
        }
      }
      const ReferenceResult expected = independent_attention(exact);
      const Tolerances tolerances =
          sdpa_tolerances(exact, {Accumulation::kFloat32, p.options.dropout, false});
      ASSERT_TRUE(tolerances.meaningful());
      const GradientCheck gradients =
          independent_gradients(exact, values_of(p.grad_output.view()), false);
      std::vector<double> output_tolerance;
      for (double t : tolerances.output)
        output_tolerance.insert(output_tolerance.end(), kValueDim, t);
      for (Backend backend : {Backend::kFused, Backend::kReference}) {
        SCOPED_TRACE(std::string(c.name) + v.name +
                     (backend == Backend::kFused ? " fused" : " reference"));
        const Merged merged = forward_by_blocks(p, c, backend);
        expect_close("output", merged.output_values, expected.output, output_tolerance);
        const Gradients got = backward_by_blocks(p, c, merged, backend);
        expect_close("dQ", got.query, gradients.exact.query, gradients.tolerance.query);
        expect_close("dK", got.key, gradients.exact.key, gradients.tolerance.key);
        expect_close("dV", got.value, gradients.exact.value, gradients.tolerance.value);
      }
    }
  }
}

// User rules see global indices: an ALiBi-like score_mod and a documents-like mask_mod, both
// functions of (q, kv), give blocks that merge to the whole call's result (the library's
// float64 reference on the whole problem).
TEST(BlockPositions, UserRulesSeeGlobalIndices) {
  const auto score_mod = [](auto score, int32_t, int32_t h, int32_t q, int32_t kv) {
    return score + 0.05f * static_cast<float>(h + 1) * static_cast<float>(kv - q);
  };
  const auto mask_mod = [](int32_t, int32_t, int32_t q, int32_t kv) {
    return kv <= q && (q / 9 == kv / 9 || kv < 4);
  };
  const BlockCase c{"user", 37, 37, {0, 13, 37}, {0, 7, 26, 37}, [](AttentionOptions&) {}};
  Problem p = make_problem(c, false, false, false);
  p.options.user_rules = make_score_rules(score_mod, mask_mod);
  AttentionOptions whole = p.options;
  whole.backend = Backend::kReference;
  const AttentionResult expected =
      scaled_dot_product_attention(p.query.view(), p.key.view(), p.value.view(), whole);
  const Tolerances tolerances =
      sdpa_tolerances(reference_problem(p.query.view(), p.key.view(), p.value.view(), {}),
                      {Accumulation::kFloat32, 0.0, false});
  std::vector<double> output_tolerance;
  for (double t : tolerances.output) output_tolerance.insert(output_tolerance.end(), kValueDim, t);
  for (Backend backend : {Backend::kFused, Backend::kReference}) {
    SCOPED_TRACE(backend == Backend::kFused ? "fused" : "reference");
    const Merged merged = forward_by_blocks(p, c, backend);
    expect_close("output", merged.output_values, values_of(expected.output.view()),
                 output_tolerance);
  }
}

// A block that is the whole problem is the plain call, bit for bit.
TEST(BlockPositions, WholeBlockIsThePlainCall) {
  const BlockCase c{"whole", 29, 45, {0, 29}, {0, 45}, [](AttentionOptions& o) {
                      o.causal = true;
                      o.alibi = true;
                      o.dropout = 0.1;
                      o.seed = 3;
                    }};
  const Problem p = make_problem(c, true, true, false);
  AttentionOptions block = p.options;
  block.block = BlockPositions{0, 0, 29, 45};
  const AttentionResult a =
      scaled_dot_product_attention(p.query.view(), p.key.view(), p.value.view(), p.options);
  const AttentionResult b =
      scaled_dot_product_attention(p.query.view(), p.key.view(), p.value.view(), block);
  EXPECT_EQ(0, std::memcmp(a.output.data(), b.output.data(), a.output.nbytes()));
}

TEST(BlockPositions, OutsideTheWholeProblemIsAnError) {
  const Tensor q = random_tensor(Shape({2, 10, 8}), 1), k = random_tensor(Shape({2, 12, 8}), 2);
  for (BlockPositions bad : {BlockPositions{-1, 0, 20, 20}, BlockPositions{11, 0, 20, 20},
                             BlockPositions{0, 9, 20, 20}, BlockPositions{0, 0, 9, 20}}) {
    AttentionOptions o;
    o.block = bad;
    try {
      (void)scaled_dot_product_attention(q.view(), k.view(), k.view(), o);
      ADD_FAILURE() << "accepted block " << bad.query_offset << ", " << bad.key_offset;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("block"), std::string::npos) << e.what();
    }
  }
  AttentionOptions o;  // the prefix counts in the whole problem's keys
  o.causal = true;
  o.prefix = 15;
  o.block = BlockPositions{0, 0, 10, 20};
  EXPECT_NO_THROW((void)scaled_dot_product_attention(q.view(), k.view(), k.view(), o));
  o.prefix = 21;
  EXPECT_THROW((void)scaled_dot_product_attention(q.view(), k.view(), k.view(), o), Error);
}

}  // namespace
}  // namespace attend::test
