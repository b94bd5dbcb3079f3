// The decode scheduler (paged_attention.cpp → run_over_stored_keys_batch → the row groups'
// RunBatchItems, key_split-inl.h): a batch of sequences of unequal lengths (0, 1, across
// block edges, long enough for the key split) with 1 to 16 queries each and 1 to 8 query
// heads per K/V head, read in place through shuffled block tables, runs as one work list.
// It equals the float64 listing of the dense problem within the float32 error model, with
// every score rule and the log-sum-exp; its bits do not depend on the thread count nor on how
// the batch is cut into calls, and they are those of the dense call on each sequence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attend/kv_cache.hpp"
#include "attend/runtime.hpp"
#include "attend/varlen.hpp"
#include "error_model.hpp"
#include "serving_support.hpp"
#include "shape_policy.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

constexpr int64_t kKvHeads = 2, kDim = 32, kValueDim = 24;

int64_t total(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// Raw blocks (N, bs, Hkv, D) holding each sequence's logical keys (packed (Σ len, Hkv, D))
// at the blocks of a seeded shuffled table, and the queries (Σ q_len, Hkv·G, D).
struct Batch {
  std::vector<int64_t> lens, q_lens;
  int64_t heads = 0;
  Tensor keys, values, key_blocks, value_blocks, tables, seq_lens, query, cu_q, cu_k;
};

Batch make_batch(const std::vector<int64_t>& lens, const std::vector<int64_t>& q_lens,
                 int64_t block_size, int64_t group, uint32_t seed) {
  Batch b;
  b.lens = lens;
  b.q_lens = q_lens;
  b.heads = kKvHeads * group;
  const auto batch = static_cast<int64_t>(lens.size());
  b.keys = random_tensor(Shape({total(lens), kKvHeads, kDim}), seed, 2.0);
  b.values = random_tensor(Shape({total(lens), kKvHeads, kValueDim}), seed + 1);
  b.query = random_tensor(Shape({total(q_lens), b.heads, kDim}), seed + 2);
  int64_t blocks = 0, widest = 1;
  for (int64_t len : lens) {
    blocks += (len + block_size - 1) / block_size;
    widest = std::max(widest, (len + block_size - 1) / block_size);
  }
  std::vector<int32_t> order(static_cast<size_t>(blocks + 2));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  b.key_blocks = Tensor::zeros(DType::kFloat32, Shape({blocks + 2, block_size, kKvHeads, kDim}));
  b.value_blocks =
      Tensor::zeros(DType::kFloat32, Shape({blocks + 2, block_size, kKvHeads, kValueDim}));
  b.tables = Tensor::zeros(DType::kInt32, Shape({batch, widest}));
  b.seq_lens = Tensor(DType::kInt32, Shape({batch}));
  size_t next = 0;
  int64_t token = 0;
  for (int64_t s = 0; s < batch; ++s) {
    b.seq_lens.data_as<int32_t>()[s] = static_cast<int32_t>(lens[static_cast<size_t>(s)]);
    for (int64_t t = 0; t < lens[static_cast<size_t>(s)]; ++t, ++token) {
      int32_t* entry = b.tables.data_as<int32_t>() + s * widest + t / block_size;
      if (t % block_size == 0) *entry = order[next++];
      const int64_t row = *entry * block_size + t % block_size;
      std::memcpy(b.key_blocks.data_as<float>() + row * kKvHeads * kDim,
                  b.keys.data_as<float>() + token * kKvHeads * kDim, kKvHeads * kDim * 4);
      std::memcpy(b.value_blocks.data_as<float>() + row * kKvHeads * kValueDim,
                  b.values.data_as<float>() + token * kKvHeads * kValueDim,
                  kKvHeads * kValueDim * 4);
    }
  }
  b.cu_q = offsets(q_lens);
  b.cu_k = offsets(lens);
  return b;
}

// Rows [begin, begin + count) of dimension 0 of `t`, as a tensor of their own.
Tensor rows_of(const Tensor& t, int64_t begin, int64_t count) {
  Shape shape = t.shape();
  const int64_t row_bytes = shape[0] > 0 ? static_cast<int64_t>(t.nbytes()) / shape[0] : 0;
  shape[0] = count;
  Tensor part(t.dtype(), shape);
  std::memcpy(part.data(), t.data_as<char>() + begin * row_bytes,
              static_cast<size_t>(count * row_bytes));
  return part;
}

struct Result {
  Tensor output, logsumexp;
};

// The paged call on sequences [first, first + count) of the batch (the blocks shared).
Result paged(const Batch& b, const AttentionOptions& options, size_t first, size_t count) {
  const std::vector<int64_t> q_lens(b.q_lens.begin() + static_cast<std::ptrdiff_t>(first),
                                    b.q_lens.begin() + static_cast<std::ptrdiff_t>(first + count));
  const int64_t q_begin =
      total({b.q_lens.begin(), b.q_lens.begin() + static_cast<std::ptrdiff_t>(first)});
  const Tensor query = rows_of(b.query, q_begin, total(q_lens));
  const Tensor tables = rows_of(b.tables, static_cast<int64_t>(first), static_cast<int64_t>(count));
  const Tensor seq_lens =
      rows_of(b.seq_lens, static_cast<int64_t>(first), static_cast<int64_t>(count));
  const Tensor cu_q = offsets(q_lens);
  Result r{Tensor(DType::kFloat32, Shape({total(q_lens), b.heads, kValueDim})),
           Tensor(DType::kFloat32, Shape({total(q_lens), b.heads}))};
  const TensorView lse = r.logsumexp.view();
  paged_attention_into(query.view(), cu_q.view(), b.key_blocks.view(), b.value_blocks.view(),
                       tables.view(), seq_lens.view(), r.output.view(), options, &lse);
  return r;
}

Result paged(const Batch& b, const AttentionOptions& options) {
  return paged(b, options, 0, b.lens.size());
}

// The dense problem as one ragged call (tests/varlen_test.cc checks it against the listing).
Result dense(const Batch& b, const AttentionOptions& options) {
  Result r{Tensor(DType::kFloat32, Shape({total(b.q_lens), b.heads, kValueDim})),
           Tensor(DType::kFloat32, Shape({total(b.q_lens), b.heads}))};
  const TensorView lse = r.logsumexp.view();
  varlen_attention_into(b.query.view(), b.keys.view(), b.values.view(), b.cu_q.view(),
                        b.cu_k.view(), r.output.view(), options, &lse);
  return r;
}

AttentionOptions causal() {
  AttentionOptions o;
  o.causal = true;
  return o;
}

// A window of 300 keys (its edge crosses blocks and key chunks), sinks, ALiBi, softcap.
AttentionOptions every_rule(const Tensor& sinks) {
  AttentionOptions o = causal();
  o.window = SlidingWindow{300, 0};
  o.sinks = sinks.view();
  o.alibi = true;
  o.softcap = 30.0;
  return o;
}

// Lengths 0 and 1, not multiples of the block sizes, and long enough for the key split
// (PlanKeySplit: 512-key chunks from 1024 keys with a shared K/V head), 1 to 16 queries.
const std::vector<int64_t> kLens = {0, 1, 37, 1100, 2600, 519, 16, 3001};
const std::vector<int64_t> kQueryLens = {0, 1, 4, 16, 1, 9, 2, 3};

// Error model (tests/error_model.hpp's paged_row_tolerance, as paged_decode_test.cc): per
// row, scores of size A = scale·||q||·max||k|| + max|ALiBi| + softcap, each within
// (γ_E + 6u)·A; the output within (2·score error + (Lk + E + 8)·u)·max|v|, four times over;
// the log-sum-exp within the score error plus (Lk + 8)·u.
void expect_within_the_error_model(const Batch& b, const Result& got, const Result& want,
                                   const std::string& what) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  int64_t t = 0, k_begin = 0;
  for (size_t s = 0; s < b.lens.size(); k_begin += b.lens[s], ++s) {
    const int64_t lk = b.lens[s];
    double max_k = 0, max_v = 0;
    for (int64_t j = k_begin * kKvHeads; j < (k_begin + lk) * kKvHeads; ++j) {
      double n2 = 0;
      for (int64_t e = 0; e < kDim; ++e) n2 += std::pow(b.keys.data_as<float>()[j * kDim + e], 2);
      max_k = std::max(max_k, std::sqrt(n2));
      for (int64_t e = 0; e < kValueDim; ++e) {
        max_v = std::max(max_v, std::abs(double{b.values.data_as<float>()[j * kValueDim + e]}));
      }
    }
    for (int64_t i = 0; i < b.q_lens[s]; ++i, ++t) {
      for (int64_t h = 0; h < b.heads; ++h) {
        double q2 = 0;
        for (int64_t e = 0; e < kDim; ++e) {
          q2 += std::pow(b.query.data_as<float>()[(t * b.heads + h) * kDim + e], 2);
        }
        const double a = scale * std::sqrt(q2) * max_k + static_cast<double>(lk) + 30.0;
        const PagedRowTolerance tolerance = paged_row_tolerance(a, lk, kDim);
        const double tol = tolerance.output(max_v);
        for (int64_t c = 0; c < kValueDim; ++c) {
          const int64_t n = (t * b.heads + h) * kValueDim + c;
          ASSERT_NEAR(got.output.data_as<float>()[n], want.output.data_as<float>()[n], tol)
              << what << ", sequence " << s << ", query " << i << ", head " << h << ", column "
              << c;
        }
        const float lse = want.logsumexp.data_as<float>()[t * b.heads + h];
        ASSERT_NEAR(got.logsumexp.data_as<float>()[t * b.heads + h], lse, tolerance.logsumexp(lse))
            << what << ", log-sum-exp of sequence " << s << ", query " << i << ", head " << h;
      }
    }
  }
}

// The stated work sizes (shape_policy.hpp): decode-batch's sequences (8 query heads per K/V
// head, Lq 1: row groups of 4 heads, 2 of them sharing K and V; or Lq 4: 8 items sharing)
// are cut into units of at most 2·kShareChunk keys, kShareChunk from 2·kShareChunk keys on.
TEST(PagedBatch, UnitsAreAtMostTwoShareChunks) {
  for (const auto& [items, share] : {std::pair<int64_t, int64_t>{8, 2}, {32, 8}, {2, 2}}) {
    for (int64_t len = 1; len <= 8192; len += 37) {
      detail::SdpaParams p;
      p.key_len = len;
      const detail::KeySplit split = detail::PlanKeySplit(p, items, share);
      EXPECT_LE(std::min(split.chunk_len, len), 2 * detail::kShareChunk) << len;
      EXPECT_EQ(split.chunks, (len + split.chunk_len - 1) / split.chunk_len) << len;
      if (len >= 2 * detail::kShareChunk) {
        EXPECT_EQ(split.chunk_len, detail::kShareChunk) << len;
      }
    }
  }
}

TEST(PagedBatch, EqualsTheDenseListing) {
  for (const int64_t group : {1, 2, 3, 5, 6, 7, 8}) {
    const Tensor sinks = random_tensor(Shape({kKvHeads * group}), 5);
    for (const int64_t block_size : {16, 5}) {
      const Batch b = make_batch(kLens, kQueryLens, block_size, group,
                                 static_cast<uint32_t>(10 * group + block_size));
      for (const auto& [name, options] :
           {std::pair{"causal", causal()}, std::pair{"every rule", every_rule(sinks)}}) {
        AttentionOptions listing = options;
        listing.backend = Backend::kReference;
        const std::string what = std::string(name) + ", G " + std::to_string(group) +
                                 ", block " + std::to_string(block_size);
        expect_within_the_error_model(b, paged(b, options), dense(b, listing), what);
      }
    }
  }
}

// Decoding only (one query per sequence): the row groups take the G query heads of a K/V
// head as one group (G 5 to 8 here), each sequence's keys through a shuffled block table,
// lengths 0 (no query) and 1, within and across blocks, and long enough for the key split.
TEST(PagedBatch, DecodeGroupsOfFiveToEightHeadsEqualTheDenseListing) {
  const std::vector<int64_t> lens = {0, 1, 5, 16, 17, 33, 1100, 2600};
  const std::vector<int64_t> q_lens = {0, 1, 1, 1, 1, 1, 1, 1};  // no query without keys
  for (const int64_t group : {5, 6, 7, 8}) {
    const Tensor sinks = random_tensor(Shape({kKvHeads * group}), 8);
    for (const int64_t block_size : {16, 5}) {
      const Batch b = make_batch(lens, q_lens, block_size, group,
                                 static_cast<uint32_t>(70 + 10 * group + block_size));
      for (const auto& [name, options] :
           {std::pair{"causal", causal()}, std::pair{"every rule", every_rule(sinks)}}) {
        AttentionOptions listing = options;
        listing.backend = Backend::kReference;
        const std::string what = std::string(name) + ", decode G " + std::to_string(group) +
                                 ", block " + std::to_string(block_size);
        expect_within_the_error_model(b, paged(b, options), dense(b, listing), what);
      }
    }
  }
}

// Each sequence's bits are its dense call's: the batch cuts each sequence's keys exactly as
// the dense call does (PlanKeySplit of the sequence's own shape), on every SIMD target whose
// dense call runs the row groups (4 lanes or more, more than kShortKeys keys; see
// kv_cache_test.cc).
TEST(PagedBatch, EachSequenceHasItsDenseCallsBits) {
  const Tensor sinks = random_tensor(Shape({kKvHeads * 2}), 6);
  // At most 2 queries per sequence and 2 query heads per K/V head: the dense call runs row
  // groups on every target with 4 or more lanes (G·Lq = 4 rows stays below the grouped-query
  // tiles' kMinGroupedRows, shape_policy.hpp), as the paged call does.
  const Batch b = make_batch(kLens, {0, 1, 2, 1, 2, 1, 2, 1}, 16, 2, 41);
  for (const std::string& target : supported_simd_targets()) {
    if (target == "SCALAR") continue;
    ScopedSimdCap cap(target);
    for (const AttentionOptions& options : {causal(), every_rule(sinks)}) {
      const Result got = paged(b, options), want = dense(b, options);
      EXPECT_TRUE(same_bits_past_short_keys(got.output, want.output, b.lens, b.q_lens)) << target;
      EXPECT_TRUE(same_bits_past_short_keys(got.logsumexp, want.logsumexp, b.lens, b.q_lens))
          << target;
    }
  }
}

// The same batch at 1, 2 and 3 threads, and cut into calls of one sequence, of two halves
// and of three uneven parts: the same bits.
TEST(PagedBatch, BitwiseAtAnyThreadCountAndAnyCut) {
  for (const int64_t group : {1, 5, 8}) {
    const Tensor sinks = random_tensor(Shape({kKvHeads * group}), 7);
    const Batch b = make_batch(kLens, kQueryLens, 16, group, static_cast<uint32_t>(50 + group));
    for (AttentionOptions options : {causal(), every_rule(sinks)}) {
      options.num_threads = 1;
      const Result whole = paged(b, options);
      for (const int threads : {2, 3}) {
        options.num_threads = threads;
        const Result r = paged(b, options);
        EXPECT_TRUE(same_bits(r.output, whole.output)) << threads << " threads, G " << group;
        EXPECT_TRUE(same_bits(r.logsumexp, whole.logsumexp)) << threads << " threads";
      }
      options.num_threads = 2;
      for (const std::vector<size_t>& cuts :
           {std::vector<size_t>{0, 1, 2, 3, 4, 5, 6, 7, 8}, std::vector<size_t>{0, 4, 8},
            std::vector<size_t>{0, 3, 4, 8}}) {
        int64_t row = 0;
        for (size_t c = 0; c + 1 < cuts.size(); ++c) {
          const Result part = paged(b, options, cuts[c], cuts[c + 1] - cuts[c]);
          const int64_t rows = part.output.shape()[0];
          EXPECT_TRUE(same_bits(part.output, rows_of(whole.output, row, rows)))
              << "sequences " << cuts[c] << ".." << cuts[c + 1] << ", G " << group;
          EXPECT_TRUE(same_bits(part.logsumexp, rows_of(whole.logsumexp, row, rows)))
              << "sequences " << cuts[c] << ".." << cuts[c + 1];
          row += rows;
        }
      }
    }
  }
}

}  // namespace
}  // namespace attend::test
