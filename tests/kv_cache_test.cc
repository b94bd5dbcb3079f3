// The paged KV cache (attend/kv_cache.hpp): attention over blocks equals the dense call on
// the same keys (ragged, tests/varlen_test.cc checks that against the reference) across block
// sizes, shuffled and consecutive block tables, lengths 0 and 1 and not multiples of the
// block size, grouped-query heads, score rules, float16/bfloat16 storage; the cache's
// append, free list, eviction and refusals; several threads on one cache.
#include "attend/kv_cache.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attend/error.hpp"
#include "attend/rope.hpp"
#include "attend/runtime.hpp"
#include "attend/varlen.hpp"
#include "serving_support.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

constexpr int64_t kHeads = 4, kKvHeads = 2, kDim = 16, kValueDim = 8;

int64_t sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// A batch over raw blocks: the logical keys of each sequence (packed), written into blocks
// listed by seeded tables (shuffled, or consecutive), and the queries.
struct PagedBatch {
  std::vector<int64_t> lens, q_lens;
  int64_t block_size = 0;
  Tensor keys, values;              // packed logical (total_k, Hkv, D)
  Tensor key_blocks, value_blocks;  // (N, bs, Hkv, D)
  Tensor tables, seq_lens, query, cu_q, cu_k;
};

PagedBatch make_batch(std::vector<int64_t> lens, std::vector<int64_t> q_lens, int64_t block_size,
                      bool shuffled, uint32_t seed, DType dtype = DType::kFloat32) {
  PagedBatch b;
  b.lens = std::move(lens);
  b.q_lens = std::move(q_lens);
  b.block_size = block_size;
  const auto batch = static_cast<int64_t>(b.lens.size());
  b.keys = random_tensor(Shape({sum(b.lens), kKvHeads, kDim}), seed, 1.0, dtype);
  b.values = random_tensor(Shape({sum(b.lens), kKvHeads, kValueDim}), seed + 1, 1.0, dtype);
  b.query = random_tensor(Shape({sum(b.q_lens), kHeads, kDim}), seed + 2, 1.0, dtype);
  int64_t blocks = 0, widest = 1;
  for (int64_t len : b.lens) {
    blocks += (len + block_size - 1) / block_size;
    widest = std::max(widest, (len + block_size - 1) / block_size);
  }
  const int64_t num_blocks = blocks + 3;  // a few never used
  std::vector<int32_t> order(static_cast<size_t>(num_blocks));
  std::iota(order.begin(), order.end(), 0);
  if (shuffled) std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  b.key_blocks = Tensor::zeros(dtype, Shape({num_blocks, block_size, kKvHeads, kDim}));
  b.value_blocks = Tensor::zeros(dtype, Shape({num_blocks, block_size, kKvHeads, kValueDim}));
  b.tables = Tensor(DType::kInt32, Shape({batch, widest}));
  std::fill_n(b.tables.data_as<int32_t>(), b.tables.numel(), 77777);  // unused entries: junk
  b.seq_lens = Tensor(DType::kInt32, Shape({batch}));
  const size_t element = dtype_size(dtype);
  size_t next = 0;
  int64_t token = 0;
  for (int64_t s = 0; s < batch; ++s) {
    b.seq_lens.data_as<int32_t>()[s] = static_cast<int32_t>(b.lens[static_cast<size_t>(s)]);
    for (int64_t t = 0; t < b.lens[static_cast<size_t>(s)]; ++t, ++token) {
      if (t % block_size == 0)
        b.tables.data_as<int32_t>()[s * widest + t / block_size] = order[next++];
      const int64_t block = b.tables.data_as<int32_t>()[s * widest + t / block_size];
      const int64_t row = block * block_size + t % block_size;
      std::memcpy(b.key_blocks.data_as<char>() + row * kKvHeads * kDim * element,
                  b.keys.data_as<char>() + token * kKvHeads * kDim * element,
                  kKvHeads * kDim * element);
      std::memcpy(b.value_blocks.data_as<char>() + row * kKvHeads * kValueDim * element,
                  b.values.data_as<char>() + token * kKvHeads * kValueDim * element,
                  kKvHeads * kValueDim * element);
    }
  }
  b.cu_q = offsets(b.q_lens);
  b.cu_k = offsets(b.lens);
  return b;
}

Tensor paged(const PagedBatch& b, const AttentionOptions& options) {
  Tensor out(b.query.dtype(), Shape({sum(b.q_lens), kHeads, kValueDim}));
  paged_attention_into(b.query.view(), b.cu_q.view(), b.key_blocks.view(), b.value_blocks.view(),
                       b.tables.view(), b.seq_lens.view(), out.view(), options);
  return out;
}

Tensor dense(const PagedBatch& b, const AttentionOptions& options) {
  return varlen_attention(b.query.view(), b.keys.view(), b.values.view(), b.cu_q.view(),
                          b.cu_k.view(), options);
}

AttentionOptions rules() {
  AttentionOptions o;
  o.causal = true;
  o.window = SlidingWindow{9, 0};
  o.alibi = true;
  o.softcap = 20.0;
  return o;
}

// Within float32 rounding of the dense result (another kernel or another order of sums).
void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  for (int64_t n = 0; n < got.numel(); ++n) {
    const float g = got.data_as<float>()[n], w = want.data_as<float>()[n];
    ASSERT_NEAR(g, w, 2e-6 + 1e-5 * std::abs(w)) << what << " element " << n;
  }
}

TEST(PagedAttention, EqualsTheDenseListingAcrossBlockSizesAndTables) {
  // Lengths 0, 1, exact multiples and not; a prefill chunk, decodes, a whole prompt.
  const std::vector<int64_t> lens = {0, 1, 16, 37, 5, 64, 100};
  const std::vector<int64_t> q_lens = {0, 1, 1, 12, 5, 1, 30};
  AttentionOptions causal;
  causal.causal = true;
  // Top-left causal with more queries than keys in a sequence: rows that see no key.
  AttentionOptions top_left = causal;
  top_left.causal_alignment = CausalAlignment::kTopLeft;
  AttentionOptions top_left_zero = top_left;
  top_left_zero.fully_masked_rows = FullyMaskedRows::kZero;
  AttentionOptions prefix = rules();
  prefix.prefix = 1;
  const Tensor sinks = random_tensor(Shape({kHeads}), 11);
  AttentionOptions with_sinks = rules();
  with_sinks.sinks = sinks.view();
  const std::vector<std::pair<const char*, AttentionOptions>> variants = {
      {"none", {}},         {"causal", causal},     {"rules", rules()},
      {"prefix", prefix},   {"top-left", top_left}, {"top-left zero", top_left_zero},
      {"sinks", with_sinks}};
  for (const int64_t block_size : {1, 3, 16, 64}) {
    for (const bool shuffled : {false, true}) {
      const PagedBatch b = make_batch(lens, q_lens, block_size, shuffled, 7);
      for (const auto& [name, options] : variants) {
        const std::string what = std::string(name) + ", block size " + std::to_string(block_size) +
                                 (shuffled ? ", shuffled" : ", in order");
        // Up to 16 queries: the blocks read in place by the row groups (the dense call may
        // run query tiles: float32 rounding apart); the 30-query chunk: gathered, the dense
        // call itself.
        expect_close(paged(b, options), dense(b, options), what);
      }
    }
  }
}

// With at most 2 queries per sequence the dense call runs the row groups too, on every SIMD
// target with 4 lanes or more: reading the blocks in place through the table changes no bit
// (for sequences of more than kShortKeys keys: the dense call runs shorter ones in the
// short-key kernel, within float32 rounding of the row groups).
// On SCALAR (one lane) the dense call never runs row groups (a query tile is never half
// empty), so there the two agree to float32 rounding only.
bool DenseRunsRowGroups(const std::string& target) { return target != "SCALAR"; }

TEST(PagedAttention, InPlaceEqualsTheDenseRowGroupsBitwise) {
  for (const std::string& target : supported_simd_targets()) {
    ScopedSimdCap cap(target);
    for (const bool shuffled : {false, true}) {
      const PagedBatch b = make_batch({0, 1, 16, 37, 300}, {0, 1, 2, 1, 2}, 5, shuffled, 17);
      for (const AttentionOptions& options : {AttentionOptions{}, rules()}) {
        if (DenseRunsRowGroups(target)) {
          EXPECT_TRUE(same_bits_past_short_keys(paged(b, options), dense(b, options), b.lens,
                                                b.q_lens))
              << target << shuffled;
        } else {
          expect_close(paged(b, options), dense(b, options), target);
        }
      }
    }
  }
}

TEST(PagedAttention, InPlaceGivesTheLogSumExp) {
  const PagedBatch b = make_batch({50, 9}, {4, 1}, 4, true, 13);
  AttentionOptions options = rules();
  Tensor out(DType::kFloat32, Shape({5, kHeads, kValueDim})),
      lse(DType::kFloat32, Shape({5, kHeads}));
  const TensorView lse_view = lse.view();
  paged_attention_into(b.query.view(), b.cu_q.view(), b.key_blocks.view(), b.value_blocks.view(),
                       b.tables.view(), b.seq_lens.view(), out.view(), options, &lse_view);
  Tensor want_out(DType::kFloat32, out.shape()), want_lse(DType::kFloat32, lse.shape());
  const TensorView want_lse_view = want_lse.view();
  varlen_attention_into(b.query.view(), b.keys.view(), b.values.view(), b.cu_q.view(),
                        b.cu_k.view(), want_out.view(), options, &want_lse_view);
  expect_close(out, want_out, "output");
  expect_close(lse, want_lse, "logsumexp");
}

TEST(PagedAttention, HalfPrecisionStorage) {
  for (const std::string& target : supported_simd_targets()) {
    ScopedSimdCap cap(target);
    for (const DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      // At most 2 queries per sequence, as in InPlaceEqualsTheDenseRowGroupsBitwise.
      // Query of the cache's dtype: blocks read in place or gathered, as the dense call.
      const PagedBatch b = make_batch({20, 7}, {2, 1}, 4, true, 3, dtype);
      AttentionOptions causal;
      causal.causal = true;
      EXPECT_TRUE(same_bits(paged(b, causal), dense(b, causal))) << target << dtype_name(dtype);
      // A float32 query against a half cache: the keys converted to float32.
      Tensor query32(DType::kFloat32, b.query.shape());
      convert(b.query.view(), query32.view());
      Tensor out(DType::kFloat32, Shape({3, kHeads, kValueDim}));
      paged_attention_into(query32.view(), b.cu_q.view(), b.key_blocks.view(),
                           b.value_blocks.view(), b.tables.view(), b.seq_lens.view(), out.view(),
                           causal);
      Tensor k32(DType::kFloat32, b.keys.shape()), v32(DType::kFloat32, b.values.shape());
      convert(b.keys.view(), k32.view());
      convert(b.values.view(), v32.view());
      const Tensor expected = varlen_attention(query32.view(), k32.view(), v32.view(),
                                               b.cu_q.view(), b.cu_k.view(), causal);
      if (DenseRunsRowGroups(target)) {
        EXPECT_TRUE(same_bits_past_short_keys(out, expected, b.lens, b.q_lens))
            << target << dtype_name(dtype);
      } else {
        expect_close(out, expected, target + dtype_name(dtype));
      }
    }
  }
}

TEST(PagedAttention, ProductsInAnotherPrecisionGatherTheKeys) {
  // bfloat16 products copy the operands: shuffled blocks are gathered instead of merged,
  // giving the dense call's bits.
  if (bf16_compute_path().rfind("bfloat16", 0) != 0) GTEST_SKIP() << bf16_compute_path();
  const PagedBatch b = make_batch({70, 33}, {40, 20}, 8, true, 21);
  AttentionOptions options;
  options.causal = true;
  options.compute = ComputePrecision::kBFloat16;
  EXPECT_TRUE(same_bits(paged(b, options), dense(b, options)));
}

TEST(PagedAttention, KeyMassSumsEachCachedKeysWeights) {
  const PagedBatch b = make_batch({0, 1, 37, 20}, {0, 1, 5, 20}, 4, true, 31);
  AttentionOptions options = rules();
  const int64_t width = b.tables.shape()[1] * 4;
  Tensor out(DType::kFloat32, Shape({26, kHeads, kValueDim}));
  Tensor mass(DType::kFloat32, Shape({4, width}));
  std::fill_n(mass.data_as<float>(), mass.numel(), -1.0f);  // every entry must be written
  const TensorView mass_view = mass.view();
  paged_attention_into(b.query.view(), b.cu_q.view(), b.key_blocks.view(), b.value_blocks.view(),
                       b.tables.view(), b.seq_lens.view(), out.view(), options, nullptr,
                       &mass_view);
  expect_close(out, dense(b, options), "output beside key_mass");
  int64_t q0 = 0, k0 = 0;
  for (size_t s = 0; s < b.lens.size(); ++s) {
    const int64_t lq = b.q_lens[s], lk = b.lens[s];
    std::vector<double> want(static_cast<size_t>(width), 0.0);
    if (lq > 0) {
      // The dense call on the sequence's own keys, weights summed over heads and queries.
      const auto rows = [](const Tensor& t, int64_t begin, int64_t length) {
        const Shape& sh = t.shape();
        return Tensor::copy_of(TensorView(
            const_cast<float*>(t.data_as<float>()) + begin * sh[1] * sh[2], DType::kFloat32,
            Shape({sh[1], length, sh[2]}), Shape({sh[2], sh[1] * sh[2], 1})));
      };
      const Tensor q = rows(b.query, q0, lq), k = rows(b.keys, k0, lk), v = rows(b.values, k0, lk);
      AttentionOptions weights = options;
      weights.need_weights = true;
      weights.backend = Backend::kReference;
      const AttentionResult r = scaled_dot_product_attention(q.view(), k.view(), v.view(), weights);
      for (int64_t n = 0; n < r.weights.numel(); ++n) {
        want[static_cast<size_t>(n % lk)] += r.weights.data_as<float>()[n];
      }
    }
    for (int64_t t = 0; t < width; ++t) {
      ASSERT_NEAR(mass.data_as<float>()[static_cast<int64_t>(s) * width + t],
                  want[static_cast<size_t>(t)], 1e-5)
          << "sequence " << s << " token " << t;
    }
    q0 += lq;
    k0 += lk;
  }
}

TEST(PagedAttention, RefusesBadBlockTablesBeforeReading) {
  PagedBatch b = make_batch({10, 6}, {2, 1}, 4, true, 5);
  Tensor out = Tensor::zeros(DType::kFloat32, Shape({3, kHeads, kValueDim}));
  const auto call = [&] {
    return error_of([&] {
      paged_attention_into(b.query.view(), b.cu_q.view(), b.key_blocks.view(),
                           b.value_blocks.view(), b.tables.view(), b.seq_lens.view(), out.view());
    });
  };
  int32_t* table = b.tables.data_as<int32_t>();
  const int64_t widest = b.tables.shape()[1];
  const int32_t saved = table[1];
  table[1] = 1000;
  EXPECT_NE(call().find("sequence 0: block table entry 1 is 1000, outside [0, 8)"),
            std::string::npos)
      << call();
  table[1] = -5;
  EXPECT_NE(call().find("entry 1 is -5"), std::string::npos) << call();
  table[1] = -1;  // evicted after a listed block
  EXPECT_NE(call().find("only leading entries may be evicted"), std::string::npos) << call();
  table[1] = table[widest];  // the block of sequence 1's first entry
  EXPECT_NE(call().find("listed twice"), std::string::npos) << call();
  table[1] = saved;
  b.seq_lens.data_as<int32_t>()[1] = 13;  // 4 blocks, the table has 3
  EXPECT_NE(call().find("sequence 1: length 13 needs 4 blocks of 4 but the block table has 3"),
            std::string::npos)
      << call();
  b.seq_lens.data_as<int32_t>()[1] = -1;
  EXPECT_NE(call().find("negative"), std::string::npos) << call();
  b.seq_lens.data_as<int32_t>()[1] = 0;
  EXPECT_NE(call().find("sequence 1 has 1 queries but no cached keys"), std::string::npos)
      << call();
  b.seq_lens.data_as<int32_t>()[1] = 6;
  for (int64_t n = 0; n < out.numel(); ++n) ASSERT_EQ(out.data_as<float>()[n], 0.0f);
  EXPECT_NO_THROW(call());
  EXPECT_EQ(call(), "<no attend::Error>");
}

// The cache's own bookkeeping: prefill prompts of different lengths, decode a few steps in a
// batch, each step equal to the dense call on everything appended so far.
TEST(PagedKvCache, PrefillThenDecodeEqualsDense) {
  KvCacheConfig config;
  config.num_blocks = 40;
  config.block_size = 8;
  config.kv_heads = kKvHeads;
  config.head_dim = kDim;
  config.value_dim = kValueDim;
  PagedKvCache cache(config);
  const std::vector<int64_t> prompts = {13, 1, 30};
  std::vector<int64_t> ids;
  std::vector<std::vector<float>> keys(3), values(3);  // each sequence's appended K and V
  for (size_t s = 0; s < prompts.size(); ++s) ids.push_back(cache.add_sequence());
  AttentionOptions causal;
  causal.causal = true;
  for (int step = 0; step < 5; ++step) {
    const std::vector<int64_t> news = step == 0 ? prompts : std::vector<int64_t>{1, 1, 1};
    const Tensor k = random_tensor(Shape({sum(news), kKvHeads, kDim}), 100 + step);
    const Tensor v = random_tensor(Shape({sum(news), kKvHeads, kValueDim}), 200 + step);
    const Tensor cu = offsets(news);
    cache.append(ids, k.view(), v.view(), cu.view());
    int64_t token = 0;
    for (size_t s = 0; s < ids.size(); ++s) {
      for (int64_t t = 0; t < news[s]; ++t, ++token) {
        keys[s].insert(keys[s].end(), k.data_as<float>() + token * kKvHeads * kDim,
                       k.data_as<float>() + (token + 1) * kKvHeads * kDim);
        values[s].insert(values[s].end(), v.data_as<float>() + token * kKvHeads * kValueDim,
                         v.data_as<float>() + (token + 1) * kKvHeads * kValueDim);
      }
      EXPECT_EQ(cache.length(ids[s]), static_cast<int64_t>(keys[s].size()) / (kKvHeads * kDim));
    }
    const Tensor q = random_tensor(Shape({sum(news), kHeads, kDim}), 300 + step);
    Tensor out(DType::kFloat32, Shape({sum(news), kHeads, kValueDim}));
    cache.attend(ids, q.view(), cu.view(), out.view(), causal);
    // Dense: every sequence's keys packed.
    std::vector<int64_t> lens;
    std::vector<float> all_k, all_v;
    for (size_t s = 0; s < ids.size(); ++s) {
      lens.push_back(static_cast<int64_t>(keys[s].size()) / (kKvHeads * kDim));
      all_k.insert(all_k.end(), keys[s].begin(), keys[s].end());
      all_v.insert(all_v.end(), values[s].begin(), values[s].end());
    }
    const TensorView dk(all_k.data(), Shape({sum(lens), kKvHeads, kDim}));
    const TensorView dv(all_v.data(), Shape({sum(lens), kKvHeads, kValueDim}));
    const Tensor cu_k = offsets(lens);
    const Tensor expected = varlen_attention(q.view(), dk, dv, cu.view(), cu_k.view(), causal);
    // Appends interleave the sequences' blocks: read in place (row groups) where the dense
    // call may run query tiles.
    expect_close(out, expected, "step " + std::to_string(step));
  }
  // 14 + 2 + 31... tokens: blocks per sequence ceil(len / 8).
  const int64_t used = (17 + 7) / 8 + (5 + 7) / 8 + (34 + 7) / 8;
  EXPECT_EQ(cache.free_blocks(), 40 - used);
  cache.remove_sequence(ids[1]);
  EXPECT_EQ(cache.free_blocks(), 40 - used + 1);
}

// int8 cache: per token and head, scale = max|x| / 127 and q = round(x / scale); attention
// equals the dense call on those dequantized values (to float32 rounding), and the float one
// within the quantization's error.
TEST(PagedKvCache, Int8CacheWithinItsErrorModel) {
  KvCacheConfig config;
  config.num_blocks = 30;
  config.block_size = 4;
  config.kv_heads = kKvHeads;
  config.head_dim = kDim;
  config.value_dim = kValueDim;
  config.dtype = DType::kInt8;
  PagedKvCache cache(config);
  const int64_t a = cache.add_sequence(), b = cache.add_sequence();
  const Tensor k = random_tensor(Shape({29, kKvHeads, kDim}), 1, 3.0);
  const Tensor v = random_tensor(Shape({29, kKvHeads, kValueDim}), 2, 3.0);
  const Tensor cu = offsets({19, 10});
  cache.append({a, b}, k.view(), v.view(), cu.view());
  // The test's own dequantization, token by token in append order.
  const auto quantized = [&](const Tensor& x, int64_t dim) {
    Tensor y(DType::kFloat32, x.shape());
    for (int64_t r = 0; r < x.numel() / dim; ++r) {
      const float* row = x.data_as<float>() + r * dim;
      float largest = 0;
      for (int64_t e = 0; e < dim; ++e) largest = std::max(largest, std::abs(row[e]));
      const float scale = largest / 127.0f;
      for (int64_t e = 0; e < dim; ++e) {
        const float q = scale == 0 ? 0.0f : std::nearbyint(row[e] / scale);
        y.data_as<float>()[r * dim + e] = scale * q;
        EXPECT_LE(std::abs(scale * q - row[e]), scale / 2 * (1 + 1e-6) + 1e-7);  // error model
      }
    }
    return y;
  };
  const Tensor kq = quantized(k, kDim), vq = quantized(v, kValueDim);
  AttentionOptions causal;
  causal.causal = true;
  const Tensor q = random_tensor(Shape({5, kHeads, kDim}), 3);
  const Tensor cu_q = offsets({4, 1});
  Tensor out(DType::kFloat32, Shape({5, kHeads, kValueDim}));
  cache.attend({a, b}, q.view(), cu_q.view(), out.view(), causal);
  const Tensor on_quantized =
      varlen_attention(q.view(), kq.view(), vq.view(), cu_q.view(), cu.view(), causal);
  // The scales fold into scores and probabilities (not into the widened codes): float32
  // rounding apart.
  expect_close(out, on_quantized, "int8 cache against its dequantized values");
  const Tensor on_floats =
      varlen_attention(q.view(), k.view(), v.view(), cu_q.view(), cu.view(), causal);
  for (int64_t n = 0; n < out.numel(); ++n) {
    // |Δv| ≤ 3/254 per value, |Δs| ≤ scale·Σ|q_e|·3/254 per score: a few percent at most.
    EXPECT_NEAR(out.data_as<float>()[n], on_floats.data_as<float>()[n], 0.1) << n;
  }
  EXPECT_EQ(cache.key_scales().shape, Shape({30, 4, kKvHeads}));
  EXPECT_EQ(cache.bytes(), uint64_t{30 * 4 * kKvHeads * (kDim + kValueDim + 8)});
  // The raw call refuses int8 blocks without their scales.
  Tensor tables(DType::kInt32, Shape({1, 1})), lens(DType::kInt32, Shape({1}));
  tables.data_as<int32_t>()[0] = 0;
  lens.data_as<int32_t>()[0] = 1;
  const Tensor one = offsets({1});
  EXPECT_NE(error_of([&] {
              paged_attention_into(q.view(), one.view(), cache.key_blocks(), cache.value_blocks(),
                                   tables.view(), lens.view(), out.view());
            }).find("needs key_scales"),
            std::string::npos);
}

TEST(PagedKvCache, AppendRotatesKeysAtTheirPositions) {
  KvCacheConfig config;
  config.num_blocks = 10;
  config.block_size = 4;
  config.kv_heads = kKvHeads;
  config.head_dim = kDim;
  config.value_dim = kValueDim;
  PagedKvCache fused(config), separate(config);
  const int64_t a = fused.add_sequence(), b = fused.add_sequence();
  (void)separate.add_sequence(), (void)separate.add_sequence();
  RopeOptions rope;
  rope.convention = RopeConvention::kInterleaved;
  for (int step = 0; step < 3; ++step) {
    const std::vector<int64_t> news =
        step == 0 ? std::vector<int64_t>{5, 2} : std::vector<int64_t>{1, 1};
    const Tensor k = random_tensor(Shape({sum(news), kKvHeads, kDim}), 10 + step);
    const Tensor v = random_tensor(Shape({sum(news), kKvHeads, kValueDim}), 20 + step);
    const Tensor cu = offsets(news);
    // The same rotation by hand: positions continue each sequence.
    Tensor positions(DType::kInt32, Shape({sum(news)}));
    int64_t token = 0;
    for (size_t s = 0; s < news.size(); ++s) {
      for (int64_t t = 0; t < news[s]; ++t) {
        positions.data_as<int32_t>()[token++] =
            static_cast<int32_t>(fused.length(s == 0 ? a : b) + t);
      }
    }
    Tensor rotated = k.clone();
    apply_rope_at(rotated.view(), positions.view(), rope);
    const Tensor before = k.clone();
    fused.append({a, b}, k.view(), v.view(), cu.view(), &rope);
    separate.append({a, b}, rotated.view(), v.view(), cu.view());
    EXPECT_TRUE(same_bits(k, before)) << "the caller's keys changed";
  }
  EXPECT_EQ(std::memcmp(fused.key_blocks().data, separate.key_blocks().data,
                        static_cast<size_t>(fused.key_blocks().numel()) * sizeof(float)),
            0);
}

// Two beams forked from one prompt share its blocks; each append copies a shared partly
// filled block first; attention over each beam equals the dense call on its own tokens.
TEST(PagedKvCache, ForkSharesBlocksAndCopiesOnWrite) {
  KvCacheConfig config;
  config.num_blocks = 12;
  config.block_size = 4;
  config.kv_heads = kKvHeads;
  config.head_dim = kDim;
  config.value_dim = kValueDim;
  PagedKvCache cache(config);
  const int64_t parent = cache.add_sequence();
  const Tensor prompt_k = random_tensor(Shape({10, kKvHeads, kDim}), 1);
  const Tensor prompt_v = random_tensor(Shape({10, kKvHeads, kValueDim}), 2);
  const Tensor cu10 = offsets({10});
  cache.append({parent}, prompt_k.view(), prompt_v.view(), cu10.view());
  EXPECT_EQ(cache.free_blocks(), 12 - 3);
  const int64_t child = cache.fork(parent);
  EXPECT_EQ(cache.free_blocks(), 12 - 3);  // shared
  EXPECT_EQ(cache.block_table(child), cache.block_table(parent));
  EXPECT_EQ(cache.length(child), 10);
  // Each beam appends its own token: the parent copies the shared third block, then the
  // child is its only owner and writes into it.
  std::vector<std::vector<float>> keys(2), values(2);
  for (int beam = 0; beam < 2; ++beam) {
    keys[beam].assign(prompt_k.data_as<float>(), prompt_k.data_as<float>() + prompt_k.numel());
    values[beam].assign(prompt_v.data_as<float>(), prompt_v.data_as<float>() + prompt_v.numel());
  }
  AttentionOptions causal;
  causal.causal = true;
  for (int step = 0; step < 4; ++step) {
    const Tensor k = random_tensor(Shape({2, kKvHeads, kDim}), 10 + step);
    const Tensor v = random_tensor(Shape({2, kKvHeads, kValueDim}), 20 + step);
    const Tensor cu = offsets({1, 1});
    cache.append({parent, child}, k.view(), v.view(), cu.view());
    for (int beam = 0; beam < 2; ++beam) {
      keys[beam].insert(keys[beam].end(), k.data_as<float>() + beam * kKvHeads * kDim,
                        k.data_as<float>() + (beam + 1) * kKvHeads * kDim);
      values[beam].insert(values[beam].end(), v.data_as<float>() + beam * kKvHeads * kValueDim,
                          v.data_as<float>() + (beam + 1) * kKvHeads * kValueDim);
    }
    // Both beams in one batch: their shared blocks are listed twice, which the cache allows.
    const Tensor q = random_tensor(Shape({2, kHeads, kDim}), 30 + step);
    Tensor out(DType::kFloat32, Shape({2, kHeads, kValueDim}));
    cache.attend({parent, child}, q.view(), cu.view(), out.view(), causal);
    std::vector<float> all_k = keys[0], all_v = values[0];
    all_k.insert(all_k.end(), keys[1].begin(), keys[1].end());
    all_v.insert(all_v.end(), values[1].begin(), values[1].end());
    const int64_t length = 11 + step;
    const Tensor cu_k = offsets({length, length});
    const Tensor expected =
        varlen_attention(q.view(), TensorView(all_k.data(), Shape({2 * length, kKvHeads, kDim})),
                         TensorView(all_v.data(), Shape({2 * length, kKvHeads, kValueDim})),
                         cu.view(), cu_k.view(), causal);
    expect_close(out, expected, "step " + std::to_string(step));
  }
  // 10 shared tokens in 2 full blocks + the copied third; 14 tokens: 4 blocks per beam, the
  // first 2 shared.
  EXPECT_EQ(cache.free_blocks(), 12 - 2 - 2 * 2);
  const std::vector<int32_t> a = cache.block_table(parent), b = cache.block_table(child);
  EXPECT_EQ(a[0], b[0]);
  EXPECT_EQ(a[1], b[1]);
  EXPECT_NE(a[2], b[2]);
  cache.remove_sequence(parent);  // the shared blocks stay for the child
  EXPECT_EQ(cache.free_blocks(), 12 - 2 - 2);
  cache.remove_sequence(child);
  EXPECT_EQ(cache.free_blocks(), 12);
}

TEST(PagedKvCache, FullCacheIsRefusedBeforeWriting) {
  KvCacheConfig config;
  config.num_blocks = 3;
  config.block_size = 4;
  config.kv_heads = 1;
  config.head_dim = 8;
  PagedKvCache cache(config);
  const int64_t a = cache.add_sequence(), b = cache.add_sequence();
  const Tensor k = random_tensor(Shape({13, 1, 8}), 1);
  const Tensor cu = offsets({9, 4});  // 3 + 1 blocks: one too many
  const std::string message = error_of([&] {
    cache.append({a, b}, k.view(), k.view(), cu.view());
  });
  EXPECT_NE(message.find("the cache is full: the new tokens need 4 blocks, 3 are free"),
            std::string::npos)
      << message;
  EXPECT_EQ(cache.free_blocks(), 3);
  EXPECT_EQ(cache.length(a), 0);
  EXPECT_TRUE(cache.block_table(a).empty());
  EXPECT_NE(error_of([&] {
              cache.append({a, a}, k.view(), k.view(), cu.view());
            }).find("twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cache.length(99); }).find("no sequence 99"), std::string::npos);
  KvCacheConfig bad = config;
  bad.num_blocks = 0;
  EXPECT_NE(error_of([&] { PagedKvCache{bad}; }).find("num_blocks"), std::string::npos);
}

TEST(PagedKvCache, SlidingWindowEvictionFreesBlocksAndKeepsTheResult) {
  KvCacheConfig config;
  config.num_blocks = 20;
  config.block_size = 4;
  config.kv_heads = kKvHeads;
  config.head_dim = kDim;
  config.value_dim = kValueDim;
  PagedKvCache cache(config);
  const int64_t id = cache.add_sequence();
  const Tensor k = random_tensor(Shape({30, kKvHeads, kDim}), 1);
  const Tensor v = random_tensor(Shape({30, kKvHeads, kValueDim}), 2);
  const Tensor cu30 = offsets({30});
  cache.append({id}, k.view(), v.view(), cu30.view());
  EXPECT_EQ(cache.free_blocks(), 20 - 8);
  // A window of 10 keys: the next query (position 30) sees keys 20..30; a query at 29
  // (the last cached token) sees 19..29. Evicting for window 11 frees blocks of tokens < 19.
  cache.evict_outside_window(id, 11);
  const std::vector<int32_t> table = cache.block_table(id);
  EXPECT_EQ(table[0], -1);
  EXPECT_EQ(table[3], -1);  // tokens 12..15
  EXPECT_GE(table[4], 0);   // tokens 16..19: 19 still visible
  EXPECT_EQ(cache.free_blocks(), 20 - 8 + 4);
  AttentionOptions window;
  window.causal = true;
  window.window = SlidingWindow{10, 0};
  const Tensor q = random_tensor(Shape({1, kHeads, kDim}), 3);
  const Tensor cu1 = offsets({1});
  Tensor out(DType::kFloat32, Shape({1, kHeads, kValueDim}));
  cache.attend({id}, q.view(), cu1.view(), out.view(), window);
  const Tensor expected =
      varlen_attention(q.view(), k.view(), v.view(), cu1.view(), cu30.view(), window);
  for (int64_t n = 0; n < out.numel(); ++n) {
    EXPECT_NEAR(out.data_as<float>()[n], expected.data_as<float>()[n], 1e-6) << n;
  }
  AttentionOptions top_left = window;
  top_left.causal_alignment = CausalAlignment::kTopLeft;
  EXPECT_NE(error_of([&] {
              cache.attend({id}, q.view(), cu1.view(), out.view(), top_left);
            }).find("evicted blocks"),
            std::string::npos);
}

TEST(PagedKvCache, ThreadsAppendAndAttendDifferentSequences) {
  KvCacheConfig config;
  config.num_blocks = 200;
  config.block_size = 4;
  config.kv_heads = kKvHeads;
  config.head_dim = kDim;
  config.value_dim = kValueDim;
  constexpr int kThreads = 4, kSteps = 20;
  // Each thread decodes its own sequence; the outputs must not depend on the interleaving
  // beyond rounding.
  const auto run = [&](PagedKvCache& cache, int t, std::vector<float>& log) {
    const int64_t id = cache.add_sequence();
    AttentionOptions options;
    options.causal = true;
    options.num_threads = 1;
    for (int step = 0; step < kSteps; ++step) {
      const auto seed = static_cast<uint32_t>(1000 * t + step);
      const Tensor k = random_tensor(Shape({2, kKvHeads, kDim}), seed);
      const Tensor v = random_tensor(Shape({2, kKvHeads, kValueDim}), seed + 1);
      const Tensor q = random_tensor(Shape({2, kHeads, kDim}), seed + 2);
      const Tensor cu = offsets({2});
      cache.append({id}, k.view(), v.view(), cu.view());
      Tensor out(DType::kFloat32, Shape({2, kHeads, kValueDim}));
      cache.attend({id}, q.view(), cu.view(), out.view(), options);
      log.insert(log.end(), out.data_as<float>(), out.data_as<float>() + out.numel());
    }
  };
  std::vector<std::vector<float>> serial(kThreads), parallel(kThreads);
  {
    PagedKvCache cache(config);
    for (int t = 0; t < kThreads; ++t) run(cache, t, serial[t]);
  }
  PagedKvCache cache(config);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back([&, t] { run(cache, t, parallel[t]); });
  for (std::thread& thread : threads) thread.join();
  // The interleaving decides which blocks each sequence gets (in place or merged runs):
  // equal within rounding.
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(serial[t].size(), parallel[t].size());
    for (size_t n = 0; n < serial[t].size(); ++n) {
      ASSERT_NEAR(serial[t][n], parallel[t][n], 2e-6 + 1e-5 * std::abs(serial[t][n]))
          << "thread " << t << " element " << n;
    }
  }
  EXPECT_EQ(cache.free_blocks(), 200 - kThreads * (2 * kSteps / 4));
}

}  // namespace
}  // namespace attend::test
