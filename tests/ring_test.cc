// Ring attention (attend/mpi/ring.hpp) under mpirun with 1 to 4 ranks (CTest runs it with each
// count): every rank builds the same whole problem, holds its shard (contiguous of equal or
// unequal lengths, or zigzag), and checks its rows of the ring's output and its gradients
// against the tests' independent float64 listing of the whole problem, within the error
// model; results are bitwise the same from run to run and with or without overlap; ranks
// that disagree get the same attend::Error, none hangs.
#include "attend/mpi/ring.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "dropout.hpp"
#include "error_model.hpp"
#include "independent_gradients.hpp"
#include "sdpa_cases.hpp"

namespace attend::test {
namespace {

using mpi::ShardLayout;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

constexpr int64_t kBatch = 2, kHeads = 3, kHeadDim = 16, kValueDim = 12;

// Runs of global positions [offset, offset + length) a rank holds, in shard order.
using Pieces = std::vector<mpi::ShardPiece>;

enum class Split { kEven, kUnequal, kZigzag };

Pieces pieces_for(Split split, int64_t length, int ranks, int rank) {
  if (split == Split::kZigzag) return mpi::shard_pieces(ShardLayout::kZigzag, length, ranks, rank);
  if (split == Split::kEven)
    return mpi::shard_pieces(ShardLayout::kContiguous, length, ranks, rank);
  // Unequal: rank r's share grows with r (weights 1, 2, ..., N), the last takes the rest.
  const int64_t total_weight = ranks * (ranks + 1) / 2;
  int64_t offset = 0;
  for (int r = 0; r < rank; ++r) offset += length * (r + 1) / total_weight;
  const int64_t share = rank == ranks - 1 ? length - offset : length * (rank + 1) / total_weight;
  return {mpi::ShardPiece{offset, share}};
}

int64_t total_length(const Pieces& pieces) {
  int64_t n = 0;
  for (const auto& p : pieces) n += p.length;
  return n;
}

// The rows of dimension `dim` of `whole` at `pieces`, concatenated: a contiguous tensor.
Tensor gather_rows(const TensorView& whole, int dim, const Pieces& pieces) {
  Shape shape = whole.shape;
  shape[dim] = total_length(pieces);
  Tensor out(whole.dtype, shape);
  int64_t at = 0;
  for (const auto& p : pieces) {
    TensorView from = whole, to = out.view();
    from.data = static_cast<char*>(from.data) +
                p.offset * from.strides[dim] * static_cast<int64_t>(dtype_size(from.dtype));
    from.shape[dim] = p.length;
    to.data = static_cast<char*>(to.data) +
              at * to.strides[dim] * static_cast<int64_t>(dtype_size(to.dtype));
    to.shape[dim] = p.length;
    convert(from, to);
    at += p.length;
  }
  return out;
}

// The whole problem, the same on every rank (seeded).
struct Whole {
  int64_t query_len, key_len;
  Tensor query, key, value, grad_output, mask, bias, sinks, segments_query, segments_key;
  AttentionOptions options;
};

struct Features {
  bool mask = false, bias = false, documents = false, sinks = false;
  std::function<void(AttentionOptions&)> configure = [](AttentionOptions&) {};
};

Whole make_whole(int64_t query_len, int64_t key_len, const Features& f) {
  Whole w{query_len,
          key_len,
          random_tensor(Shape({kBatch, kHeads, query_len, kHeadDim}), 21),
          random_tensor(Shape({kBatch, kHeads, key_len, kHeadDim}), 22),
          random_tensor(Shape({kBatch, kHeads, key_len, kValueDim}), 23),
          random_tensor(Shape({kBatch, kHeads, query_len, kValueDim}), 24),
          {},
          {},
          {},
          {},
          {},
          {}};
  f.configure(w.options);
  const int64_t shift =
      w.options.causal_alignment == CausalAlignment::kBottomRight ? key_len - query_len : 0;
  if (f.mask) {  // random, each query's own position kept
    w.mask = Tensor(DType::kBool, Shape({query_len, key_len}));
    const std::vector<float> draws = uniform_values(query_len * key_len, 25);
    for (int64_t n = 0; n < query_len * key_len; ++n) {
      w.mask.data_as<bool>()[n] =
          n % key_len == n / key_len + shift || draws[static_cast<size_t>(n)] > 0;
    }
    w.options.mask = w.mask.view();
  }
  if (f.bias) {
    w.bias = random_tensor(Shape({kHeads, query_len, key_len}), 26, 0.5);
    w.options.bias = w.bias.view();
  }
  if (f.documents) {
    w.segments_query = Tensor(DType::kInt32, Shape({query_len}));
    w.segments_key = Tensor(DType::kInt32, Shape({key_len}));
    for (int64_t j = 0; j < key_len; ++j)
      w.segments_key.data_as<int32_t>()[j] = static_cast<int32_t>(j / 13);
    for (int64_t i = 0; i < query_len; ++i) {
      w.segments_query.data_as<int32_t>()[i] = static_cast<int32_t>((i + shift) / 13);
    }
    w.options.segment_ids_query = w.segments_query.view();
    w.options.segment_ids_key = w.segments_key.view();
  }
  if (f.sinks) {
    w.sinks = random_tensor(Shape({kHeads}), 27, 2.0);
    w.options.sinks = w.sinks.view();
  }
  return w;
}

// This rank's shard of the whole problem.
struct Shard {
  Pieces queries, keys;
  Tensor query, key, value, grad_output, mask, bias, segments_query, segments_key;
  AttentionOptions options;
};

Shard make_shard(const Whole& w, Split split) {
  Shard s;
  s.queries = pieces_for(split, w.query_len, world_size(), world_rank());
  s.keys = pieces_for(split, w.key_len, world_size(), world_rank());
  s.query = gather_rows(w.query.view(), 2, s.queries);
  s.key = gather_rows(w.key.view(), 2, s.keys);
  s.value = gather_rows(w.value.view(), 2, s.keys);
  s.grad_output = gather_rows(w.grad_output.view(), 2, s.queries);
  s.options = w.options;
  if (w.options.mask) {
    s.mask = gather_rows(w.mask.view(), 0, s.queries);
    s.options.mask = s.mask.view();
  }
  if (w.options.bias) {
    s.bias = gather_rows(w.bias.view(), 1, s.queries);
    s.options.bias = s.bias.view();
  }
  if (w.options.segment_ids_query) {
    s.segments_query = gather_rows(w.segments_query.view(), 0, s.queries);
    s.segments_key = gather_rows(w.segments_key.view(), 0, s.keys);
    s.options.segment_ids_query = s.segments_query.view();
    s.options.segment_ids_key = s.segments_key.view();
  }
  return s;
}

ReferenceProblem exact_problem(const Whole& w) {
  ReferenceProblem p = reference_problem(w.query.view(), w.key.view(), w.value.view(), w.options);
  if (w.options.dropout > 0) {
    const uint32_t threshold = detail::dropout_threshold(w.options.dropout);
    for (int64_t b = 0; b < p.batch(); ++b) {
      for (int64_t i = 0; i < w.query_len; ++i) {
        for (int64_t j = 0; j < w.key_len; ++j) {
          p.dropout_factor.push_back(detail::dropout_keep(w.options.seed, threshold, b, i, j)
                                         ? 1.0 / (1.0 - w.options.dropout)
                                         : 0.0);
        }
      }
    }
  }
  return p;
}

// The worst of this rank's rows of a (batch·heads, L, width) result against the whole one.
void expect_rows(const char* what, const Tensor& got, const std::vector<double>& expected,
                 const Pieces& pieces, int64_t length, int64_t width,
                 const std::function<double(int64_t whole_index)>& tolerance) {
  const int64_t local_len = total_length(pieces);
  double worst = 0;
  std::string where;
  for (int64_t bh = 0; bh < kBatch * kHeads; ++bh) {
    int64_t local = 0;
    for (const auto& p : pieces) {
      for (int64_t i = 0; i < p.length; ++i, ++local) {
        for (int64_t e = 0; e < width; ++e) {
          const int64_t whole_index = (bh * length + p.offset + i) * width + e;
          const double g = got.data_as<float>()[(bh * local_len + local) * width + e];
          const double x = expected[static_cast<size_t>(whole_index)];
          const double excess = std::abs(g - x) / tolerance(whole_index);
          if (!(excess <= worst)) {
            worst = excess;
            where = "(bh " + std::to_string(bh) + ", position " + std::to_string(p.offset + i) +
                    ", " + std::to_string(e) + "): got " + std::to_string(g) + ", expected " +
                    std::to_string(x) + ", tolerance " + std::to_string(tolerance(whole_index));
          }
        }
      }
    }
  }
  EXPECT_LE(worst, 1.0) << what << " on rank " << world_rank() << " at " << where;
}

struct Case {
  const char* name;
  int64_t query_len, key_len;
  Features features;
};

std::vector<Case> cases() {
  return {
      {"plain", 48, 48, {}},
      {"causal",
       48,
       48,
       {false, false, false, false, [](AttentionOptions& o) { o.causal = true; }}},
      {"causal_window_alibi_prefix",
       48,
       48,
       {false, false, false, false,
        [](AttentionOptions& o) {
          o.causal = true;
          o.window = SlidingWindow{10, 0};
          o.alibi = true;
          o.prefix = 5;
        }}},
      {"documents_mask_sinks",
       48,
       48,
       {true, false, true, true, [](AttentionOptions& o) { o.causal = true; }}},
      {"bias_softcap",
       48,
       48,
       {false, true, false, false,
        [](AttentionOptions& o) {
          o.softcap = 2.5;
          o.window = SlidingWindow{7, 7};
        }}},
      {"dropout",
       48,
       48,
       {false, false, false, false,
        [](AttentionOptions& o) {
          o.causal = true;
          o.dropout = 0.25;
          o.seed = 99;
        }}},
      {"cross_bottom_right",
       40,
       56,
       {true, false, false, false, [](AttentionOptions& o) { o.causal = true; }}},
  };
}

std::vector<Split> splits_for(const Case& c) {
  std::vector<Split> s = {Split::kEven, Split::kUnequal};
  const int64_t n = 2 * world_size();
  if (c.query_len % n == 0 && c.key_len % n == 0) s.push_back(Split::kZigzag);
  return s;
}

const char* split_name(Split s) {
  return s == Split::kEven ? "even" : s == Split::kUnequal ? "unequal" : "zigzag";
}

mpi::ContextParallelOptions parallel_for(Split split) {
  mpi::ContextParallelOptions p;
  p.layout = split == Split::kZigzag ? ShardLayout::kZigzag : ShardLayout::kContiguous;
  return p;
}

TEST(Ring, ForwardAndBackwardEqualTheWholeProblem) {
  for (const Case& c : cases()) {
    const Whole w = make_whole(c.query_len, c.key_len, c.features);
    const ReferenceProblem exact = exact_problem(w);
    const ReferenceResult expected = independent_attention(exact);
    const Tolerances tolerances =
        sdpa_tolerances(exact, {Accumulation::kFloat32, w.options.dropout, false});
    ASSERT_TRUE(tolerances.meaningful());
    const GradientCheck gradients =
        independent_gradients(exact, values_of(w.grad_output.view()), false);
    for (Split split : splits_for(c)) {
      SCOPED_TRACE(std::string(c.name) + " " + split_name(split) + " with " +
                   std::to_string(world_size()) + " ranks");
      const Shard s = make_shard(w, split);
      const mpi::ContextParallelOptions parallel = parallel_for(split);
      const mpi::ShardResult r = mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(),
                                                     s.value.view(), s.options, parallel);
      expect_rows("output", r.output, expected.output, s.queries, c.query_len, kValueDim,
                  [&](int64_t n) { return tolerances.output[static_cast<size_t>(n / kValueDim)]; });
      const AttentionGradients g = mpi::ring_attention_backward(
          MPI_COMM_WORLD, s.grad_output.view(), s.query.view(), s.key.view(), s.value.view(),
          r.output.view(), r.logsumexp.view(), s.options, parallel);
      const auto tolerance_of = [](const std::vector<double>& t) {
        return [&t](int64_t n) { return t[static_cast<size_t>(n)]; };
      };
      expect_rows("dQ", g.query, gradients.exact.query, s.queries, c.query_len, kHeadDim,
                  tolerance_of(gradients.tolerance.query));
      expect_rows("dK", g.key, gradients.exact.key, s.keys, c.key_len, kHeadDim,
                  tolerance_of(gradients.tolerance.key));
      expect_rows("dV", g.value, gradients.exact.value, s.keys, c.key_len, kValueDim,
                  tolerance_of(gradients.tolerance.value));
      if (w.options.bias) {  // (H, Lq_r, Lk): this rank's query rows of the whole gradient
        ASSERT_EQ(g.bias.shape(), s.bias.shape());
        double worst = 0;
        int64_t local = 0;
        for (const auto& p : s.queries) {
          for (int64_t i = 0; i < p.length; ++i, ++local) {
            for (int64_t h = 0; h < kHeads; ++h) {
              for (int64_t j = 0; j < c.key_len; ++j) {
                const auto whole =
                    static_cast<size_t>((h * c.query_len + p.offset + i) * c.key_len + j);
                const double got =
                    g.bias.data_as<float>()[(h * total_length(s.queries) + local) * c.key_len + j];
                worst = std::max(worst, std::abs(got - gradients.exact.bias[whole]) /
                                            gradients.tolerance.bias[whole]);
              }
            }
          }
        }
        EXPECT_LE(worst, 1.0) << "dBias on rank " << world_rank();
      }
      if (w.options.sinks) {  // each rank's part, summed over the ranks
        std::vector<double> part(static_cast<size_t>(kHeads)), sum(static_cast<size_t>(kHeads));
        for (int64_t h = 0; h < kHeads; ++h)
          part[static_cast<size_t>(h)] = g.sinks.data_as<float>()[h];
        MPI_Allreduce(part.data(), sum.data(), kHeads, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        for (int64_t h = 0; h < kHeads; ++h) {
          double exact_sum = 0, tolerance = 0;
          for (int64_t b = 0; b < kBatch; ++b) {
            exact_sum += gradients.exact.sinks[static_cast<size_t>(b * kHeads + h)];
            tolerance += gradients.tolerance.sinks[static_cast<size_t>(b * kHeads + h)];
          }
          EXPECT_NEAR(sum[static_cast<size_t>(h)], exact_sum, tolerance + 1e-5) << "dSink " << h;
        }
      }
    }
  }
}

// Rows that see no key anywhere: the listing's uniform weights over every key (with dropout),
// or zeros; gradients likewise.
TEST(Ring, FullyExcludedRows) {
  for (FullyMaskedRows rows : {FullyMaskedRows::kUniform, FullyMaskedRows::kZero}) {
    Features f;
    f.configure = [rows](AttentionOptions& o) {
      o.fully_masked_rows = rows;
      o.dropout = 0.2;
      o.seed = 5;
    };
    Whole w = make_whole(48, 48, f);
    w.mask = Tensor(DType::kBool, Shape({48, 48}));
    for (int64_t n = 0; n < 48 * 48; ++n) {  // rows 3, 17 and 40 see nothing
      const int64_t i = n / 48;
      w.mask.data_as<bool>()[n] = !(i == 3 || i == 17 || i == 40) && (n * 7) % 5 != 0;
    }
    w.options.mask = w.mask.view();
    const ReferenceProblem exact = exact_problem(w);
    const ReferenceResult expected = independent_attention(exact);
    const Tolerances tolerances = sdpa_tolerances(exact, {Accumulation::kFloat32, 0.2, false});
    const GradientCheck gradients =
        independent_gradients(exact, values_of(w.grad_output.view()), false);
    const Shard s = make_shard(w, Split::kUnequal);
    const mpi::ShardResult r = mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(),
                                                   s.value.view(), s.options);
    SCOPED_TRACE(rows == FullyMaskedRows::kUniform ? "uniform" : "zero");
    expect_rows("output", r.output, expected.output, s.queries, 48, kValueDim,
                [&](int64_t n) { return tolerances.output[static_cast<size_t>(n / kValueDim)]; });
    const AttentionGradients g = mpi::ring_attention_backward(
        MPI_COMM_WORLD, s.grad_output.view(), s.query.view(), s.key.view(), s.value.view(),
        r.output.view(), r.logsumexp.view(), s.options);
    expect_rows("dV", g.value, gradients.exact.value, s.keys, 48, kValueDim,
                [&](int64_t n) { return gradients.tolerance.value[static_cast<size_t>(n)]; });
    expect_rows("dQ", g.query, gradients.exact.query, s.queries, 48, kHeadDim,
                [&](int64_t n) { return gradients.tolerance.query[static_cast<size_t>(n)]; });
  }
}

Tensor as_dtype(const Tensor& t, DType dtype) {
  Tensor out(dtype, t.shape());
  convert(t.view(), out.view());
  return out;
}

// Half-precision shards: widened on entry, results in the inputs' dtype. float16 within the
// error model (its rounding of the inputs and of the output included); bfloat16 within its
// rounding of the float32 ring's result.
TEST(Ring, HalfPrecisionShards) {
  Features f;
  f.configure = [](AttentionOptions& o) { o.causal = true; };
  Whole w = make_whole(48, 48, f);
  for (Tensor* t : {&w.query, &w.key, &w.value, &w.grad_output}) *t = as_dtype(*t, DType::kFloat16);
  const ReferenceProblem exact = exact_problem(w);
  const ReferenceResult expected = independent_attention(exact);
  const Tolerances tolerances = sdpa_tolerances(exact, {Accumulation::kFloat32, 0.0, true});
  const GradientCheck gradients =
      independent_gradients(exact, values_of(w.grad_output.view()), true);
  const Shard s = make_shard(w, Split::kZigzag);
  const mpi::ContextParallelOptions parallel = parallel_for(Split::kZigzag);
  const mpi::ShardResult r = mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(),
                                                 s.value.view(), s.options, parallel);
  ASSERT_EQ(r.output.dtype(), DType::kFloat16);
  const Tensor output = as_dtype(r.output, DType::kFloat32);
  expect_rows("output", output, expected.output, s.queries, 48, kValueDim,
              [&](int64_t n) { return tolerances.output[static_cast<size_t>(n / kValueDim)]; });
  const AttentionGradients g = mpi::ring_attention_backward(
      MPI_COMM_WORLD, s.grad_output.view(), s.query.view(), s.key.view(), s.value.view(),
      r.output.view(), r.logsumexp.view(), s.options, parallel);
  ASSERT_EQ(g.key.dtype(), DType::kFloat16);
  expect_rows("dK", as_dtype(g.key, DType::kFloat32), gradients.exact.key, s.keys, 48, kHeadDim,
              [&](int64_t n) { return gradients.tolerance.key[static_cast<size_t>(n)]; });

  // bfloat16: the float32 ring on the same (rounded) inputs, then one bfloat16 rounding.
  Shard b = make_shard(w, Split::kUnequal);
  for (Tensor* t : {&b.query, &b.key, &b.value}) *t = as_dtype(*t, DType::kBFloat16);
  const mpi::ShardResult half =
      mpi::ring_attention(MPI_COMM_WORLD, b.query.view(), b.key.view(), b.value.view(), b.options);
  const mpi::ShardResult full =
      mpi::ring_attention(MPI_COMM_WORLD, as_dtype(b.query, DType::kFloat32).view(),
                          as_dtype(b.key, DType::kFloat32).view(),
                          as_dtype(b.value, DType::kFloat32).view(), b.options);
  ASSERT_EQ(half.output.dtype(), DType::kBFloat16);
  const Tensor widened = as_dtype(half.output, DType::kFloat32);
  for (int64_t n = 0; n < widened.numel(); ++n) {
    const float x = full.output.data_as<float>()[n];
    ASSERT_NEAR(widened.data_as<float>()[n], x, std::abs(x) / 256 + 1e-30) << n;
  }
}

// User rules see global indices: the ring equals the library's reference on the whole problem.
TEST(Ring, UserRules) {
  const auto score_mod = [](auto score, int32_t, int32_t h, int32_t q, int32_t kv) {
    return score + 0.05f * static_cast<float>(h + 1) * static_cast<float>(kv - q);
  };
  const auto mask_mod = [](int32_t, int32_t, int32_t q, int32_t kv) {
    return kv <= q && (q / 9 == kv / 9 || kv < 4);
  };
  Whole w = make_whole(48, 48, {});
  w.options.user_rules = make_score_rules(score_mod, mask_mod);
  AttentionOptions whole = w.options;
  whole.backend = Backend::kReference;
  const AttentionResult expected =
      scaled_dot_product_attention(w.query.view(), w.key.view(), w.value.view(), whole);
  const Tolerances tolerances =
      sdpa_tolerances(reference_problem(w.query.view(), w.key.view(), w.value.view(), {}),
                      {Accumulation::kFloat32, 0.0, false});
  const std::vector<double> values = values_of(expected.output.view());
  for (Split split : {Split::kUnequal, Split::kZigzag}) {
    SCOPED_TRACE(split_name(split));
    const Shard s = make_shard(w, split);
    const mpi::ShardResult r = mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(),
                                                   s.value.view(), s.options, parallel_for(split));
    expect_rows("output", r.output, values, s.queries, 48, kValueDim,
                [&](int64_t n) { return tolerances.output[static_cast<size_t>(n / kValueDim)]; });
  }
}

// The same bits from run to run, and with or without overlap (the merge order is fixed).
TEST(Ring, BitwiseReproducible) {
  Features f;
  f.configure = [](AttentionOptions& o) {
    o.causal = true;
    o.dropout = 0.1;
    o.seed = 1;
  };
  const Whole w = make_whole(48, 48, f);
  const Shard s = make_shard(w, Split::kZigzag);
  mpi::ContextParallelOptions parallel = parallel_for(Split::kZigzag);
  mpi::RingStatistics stats;
  parallel.statistics = &stats;
  const mpi::ShardResult a = mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(),
                                                 s.value.view(), s.options, parallel);
  EXPECT_EQ(stats.steps, world_size());
  // Zigzag: 4 blocks a step, those above the diagonal skipped.
  EXPECT_EQ(stats.blocks_computed + stats.blocks_skipped, 4 * world_size());
  parallel.overlap = false;
  const mpi::ShardResult b = mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(),
                                                 s.value.view(), s.options, parallel);
  EXPECT_EQ(0, std::memcmp(a.output.data(), b.output.data(), a.output.nbytes()));
  EXPECT_EQ(0, std::memcmp(a.logsumexp.data(), b.logsumexp.data(), a.logsumexp.nbytes()));
  AttentionOptions threads = s.options;  // nor on the threads per rank
  threads.num_threads = 3;
  const mpi::ShardResult c = mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(),
                                                 s.value.view(), threads, parallel);
  EXPECT_EQ(0, std::memcmp(a.output.data(), c.output.data(), a.output.nbytes()));
  const AttentionGradients ga = mpi::ring_attention_backward(
      MPI_COMM_WORLD, s.grad_output.view(), s.query.view(), s.key.view(), s.value.view(),
      a.output.view(), a.logsumexp.view(), s.options, parallel);
  const AttentionGradients gb = mpi::ring_attention_backward(
      MPI_COMM_WORLD, s.grad_output.view(), s.query.view(), s.key.view(), s.value.view(),
      a.output.view(), a.logsumexp.view(), s.options, parallel_for(Split::kZigzag));
  EXPECT_EQ(0, std::memcmp(ga.key.data(), gb.key.data(), ga.key.nbytes()));
  EXPECT_EQ(0, std::memcmp(ga.query.data(), gb.query.data(), ga.query.nbytes()));
}

// Every rank throws the same attend::Error, naming the rank at fault; none waits forever.
void expect_collective_error(const std::function<void()>& call, const std::string& part) {
  std::string message;
  try {
    call();
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find(part), std::string::npos)
      << "rank " << world_rank() << ": '" << message << "' lacks '" << part << "'";
}

// Head parallelism: the same results as one process (H = 3 heads: 1 to 3 ranks; 4 ranks are
// refused on every rank).
TEST(Ulysses, ForwardAndBackwardEqualTheWholeProblem) {
  Features f;
  f.sinks = true;
  f.configure = [](AttentionOptions& o) {
    o.causal = true;
    o.window = SlidingWindow{20, 0};
    o.alibi = true;
    o.softcap = 4.0;
  };
  const Whole w = make_whole(48, 48, f);
  const ReferenceProblem exact = exact_problem(w);
  const ReferenceResult expected = independent_attention(exact);
  const Tolerances tolerances = sdpa_tolerances(exact, {Accumulation::kFloat32, 0.0, false});
  const GradientCheck gradients =
      independent_gradients(exact, values_of(w.grad_output.view()), false);
  for (Split split : {Split::kUnequal, Split::kZigzag}) {
    SCOPED_TRACE(split_name(split));
    const Shard s = make_shard(w, split);
    const mpi::ContextParallelOptions parallel = parallel_for(split);
    const auto forward = [&] {
      return mpi::ulysses_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(), s.value.view(),
                                    s.options, parallel);
    };
    if (world_size() > kHeads) {
      expect_collective_error([&] { (void)forward(); }, "at least as many heads as ranks");
      continue;
    }
    const mpi::ShardResult r = forward();
    expect_rows("output", r.output, expected.output, s.queries, 48, kValueDim,
                [&](int64_t n) { return tolerances.output[static_cast<size_t>(n / kValueDim)]; });
    // The same log-sum-exp as the ring's (both are the whole problem's).
    const mpi::ShardResult ring = mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(),
                                                      s.value.view(), s.options, parallel);
    for (int64_t n = 0; n < r.logsumexp.numel(); ++n) {
      ASSERT_NEAR(r.logsumexp.data_as<float>()[n], ring.logsumexp.data_as<float>()[n], 1e-4) << n;
    }
    const AttentionGradients g = mpi::ulysses_attention_backward(
        MPI_COMM_WORLD, s.grad_output.view(), s.query.view(), s.key.view(), s.value.view(),
        r.output.view(), r.logsumexp.view(), s.options, parallel);
    const auto tolerance_of = [](const std::vector<double>& t) {
      return [&t](int64_t n) { return t[static_cast<size_t>(n)]; };
    };
    expect_rows("dQ", g.query, gradients.exact.query, s.queries, 48, kHeadDim,
                tolerance_of(gradients.tolerance.query));
    expect_rows("dK", g.key, gradients.exact.key, s.keys, 48, kHeadDim,
                tolerance_of(gradients.tolerance.key));
    expect_rows("dV", g.value, gradients.exact.value, s.keys, 48, kValueDim,
                tolerance_of(gradients.tolerance.value));
  }
  // What it refuses, on every rank.
  AttentionOptions o = w.options;
  o.dropout = 0.1;
  const Shard s = make_shard(w, Split::kEven);
  expect_collective_error(
      [&] {
        (void)mpi::ulysses_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(), s.value.view(),
                                     o);
      },
      world_size() > kHeads ? "heads" : "dropout");
}

TEST(Ring, DisagreementIsAnErrorOnEveryRank) {
  const Whole w = make_whole(48, 48, {});
  const Shard s = make_shard(w, Split::kEven);
  const int last = world_size() - 1;
  if (world_size() > 1) {
    AttentionOptions o = s.options;  // the last rank alone asks for causal
    o.causal = world_rank() == last;
    expect_collective_error(
        [&] {
          (void)mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(), s.value.view(),
                                    o);
        },
        "rank " + std::to_string(last) + " disagrees with rank 0 on causal");
    // Score rules of each kind of option (attend::for_each_score_rule): a number, the window.
    o = s.options;
    if (world_rank() == last) o.softcap = 30.0;
    expect_collective_error(
        [&] {
          (void)mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(), s.value.view(),
                                    o);
        },
        "rank " + std::to_string(last) + " disagrees with rank 0 on softcap");
    o = s.options;
    if (world_rank() == last) o.window = SlidingWindow{4, kUnboundedWindow};
    expect_collective_error(
        [&] {
          (void)mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(), s.value.view(),
                                    o);
        },
        "rank " + std::to_string(last) + " disagrees with rank 0 on the window's left side");
    // The last rank's keys have another head dimension.
    const Tensor other = random_tensor(Shape({kBatch, kHeads, s.key.shape()[2], 8}), 3);
    const TensorView key = world_rank() == last ? other.view() : s.key.view();
    expect_collective_error(
        [&] {
          (void)mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), key, s.value.view(), s.options);
        },
        "rank " + std::to_string(last) + ": ");
  }
  // A rank's own bad argument (weights asked for) fails every rank.
  AttentionOptions o = s.options;
  o.need_weights = world_rank() == last;
  expect_collective_error(
      [&] {
        (void)mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(), s.value.view(), o);
      },
      "need_weights");
  // Zigzag needs two equal chunks per rank.
  const Shard unequal = make_shard(w, Split::kUnequal);
  mpi::ContextParallelOptions zigzag;
  zigzag.layout = ShardLayout::kZigzag;
  if (world_size() > 1) {
    expect_collective_error(
        [&] {
          (void)mpi::ring_attention(MPI_COMM_WORLD, unequal.query.view(), unequal.key.view(),
                                    unequal.value.view(), unequal.options, zigzag);
        },
        "zigzag");
  }
  EXPECT_THROW((void)mpi::shard_pieces(ShardLayout::kZigzag, 50, 4, 0), Error);
  // The backward checks its saved outputs collectively too.
  const mpi::ShardResult r =
      mpi::ring_attention(MPI_COMM_WORLD, s.query.view(), s.key.view(), s.value.view(), s.options);
  const Tensor short_lse(DType::kFloat32, Shape({kBatch, kHeads, 1}));
  const TensorView lse = world_rank() == last ? short_lse.view() : r.logsumexp.view();
  expect_collective_error(
      [&] {
        (void)mpi::ring_attention_backward(MPI_COMM_WORLD, s.grad_output.view(), s.query.view(),
                                           s.key.view(), s.value.view(), r.output.view(), lse,
                                           s.options);
      },
      "logsumexp");
}

}  // namespace
}  // namespace attend::test

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int failed = RUN_ALL_TESTS();
  MPI_Finalize();
  return failed;
}
