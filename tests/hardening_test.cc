// hardening_test: the library's behaviour at its limits. Sizes that overflow, allocations
// that cannot succeed, outputs that alias inputs and the weights-size limit must all end in
// attend::Error (never a crash, never a wrapped size); NaN and Inf propagate exactly as the
// listing says, row by row, on every SIMD target; denormal inputs give correct results.
//
// Under AddressSanitizer run with ASAN_OPTIONS=allocator_may_return_null=1 (as
// scripts/ci-sanitizers.sh does): an impossible allocation must return null, as malloc does,
// for the library to turn it into an Error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/npy.hpp"
#include "attend/runtime.hpp"
#include "attend/safetensors.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "attend/tensor.hpp"
#include "test_support.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define ATTEND_TEST_HAS_MXCSR 1
#endif

namespace attend {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInfinity = std::numeric_limits<float>::infinity();

// Runs `call`, expects an attend::Error whose message contains `fragment`.
template <typename Call>
void expect_error_containing(Call call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "expected attend::Error containing '" << fragment << "', nothing thrown";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << fragment;
  }
}

// ---------------------------------------------------------------------------------------
// Sizes

TEST(Hardening, HugeShapesOverflowIntoErrorsNotWrappedSizes) {
  float storage[4] = {};
  // 2^80 elements: the view can be described, but any use must refuse it.
  const TensorView huge(storage, Shape({int64_t{1} << 40, int64_t{1} << 40}));
  expect_error_containing([&] { (void)huge.numel(); }, "overflows");
  expect_error_containing([&] { (void)scaled_dot_product_attention(huge, huge, huge); },
                          "overflows");
  // An empty view whose strides would overflow is still a valid, empty view.
  const TensorView empty(storage, Shape({0, int64_t{1} << 62, 4}));
  EXPECT_EQ(empty.numel(), 0);
  // Scores (batch · Lq · Lk = 2^20 · 2^22 · 2^22) that overflow, from broadcast (zero-stride)
  // inputs of 2^42 elements each.
  const TensorView broadcast(storage, DType::kFloat32,
                             Shape({int64_t{1} << 20, int64_t{1} << 22, 1}), Shape({0, 0, 1}));
  expect_error_containing(
      [&] { (void)scaled_dot_product_attention(broadcast, broadcast, broadcast); }, "overflows");
}

TEST(Hardening, TensorOf2To62ElementsIsAnErrorNotAnAbort) {
  const Shape shape({int64_t{1} << 62});
  // float32: the byte count overflows before anything is allocated.
  expect_error_containing([&] { Tensor t(DType::kFloat32, shape); }, "overflows");
  // uint8: 4 EiB, a byte count that fits but an allocation that fails.
  expect_error_containing([&] { Tensor t(DType::kUInt8, shape); }, "cannot allocate");
  expect_error_containing([&] { (void)Tensor::zeros(DType::kUInt8, shape); }, "cannot allocate");
  expect_error_containing([&] { Tensor t(DType::kFloat32, Shape({3, -1})); }, "negative");
}

TEST(Hardening, StridesBeyondTheAddressSpaceAreRefused) {
  float storage[8] = {};
  const TensorView normal(storage, Shape({2, 4}));
  // Element (1, 0) would sit 2^61 elements (2^63 bytes) away: not addressable.
  const TensorView far(storage, DType::kFloat32, Shape({2, 4}), Shape({int64_t{1} << 61, 1}));
  expect_error_containing([&] { (void)scaled_dot_product_attention(far, normal, normal); },
                          "query");
  expect_error_containing([&] { (void)scaled_dot_product_attention(normal, normal, far); },
                          "value");
  float output[8] = {};
  const TensorView far_output(output, DType::kFloat32, Shape({2, 4}),
                              Shape({std::numeric_limits<int64_t>::max() / 2, 1}));
  expect_error_containing(
      [&] { scaled_dot_product_attention_into(normal, normal, normal, far_output, nullptr); },
      "output");
  // The last element's offset is exactly INT64_MAX elements: one past it is not representable.
  const TensorView last(storage, DType::kUInt8, Shape({2}),
                        Shape({std::numeric_limits<int64_t>::max()}));
  const TensorView bytes(storage, DType::kFloat32, Shape({1, 2, 4}), Shape({0, 4, 1}));
  AttentionOptions masked;
  masked.mask = last;
  expect_error_containing([&] { (void)scaled_dot_product_attention(bytes, bytes, bytes, masked); },
                          "mask");
}

TEST(Hardening, RankLimits) {
  expect_error_containing([] { Shape({1, 1, 1, 1, 1, 1, 1, 1, 1}); }, "rank 9");
  float storage[4] = {1, 2, 3, 4};
  const TensorView rank7(storage, Shape({1, 1, 1, 1, 1, 2, 2}));
  expect_error_containing([&] { (void)scaled_dot_product_attention(rank7, rank7, rank7); },
                          "batch dimensions");
}

// A version 1.0 .npy image with the given header dict and `data_bytes` zero bytes of data.
std::string npy_image(const std::string& dict, size_t data_bytes) {
  std::string header = dict;
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string image("\x93NUMPY\x01\x00", 8);
  image += static_cast<char>(header.size() & 0xFF);
  image += static_cast<char>(header.size() >> 8);
  return image + header + std::string(data_bytes, '\0');
}

TEST(Hardening, ReadersCheckSizesAgainstTheInputBeforeAllocating) {
  const std::string good =
      npy_image("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 24);
  EXPECT_EQ(parse_npy(good.data(), good.size(), "good").numel(), 6);
  // 2^40 float32 elements declared, 24 bytes present: refused without a 4 TiB allocation.
  const std::string big =
      npy_image("{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }", 24);
  expect_error_containing([&] { (void)parse_npy(big.data(), big.size(), "big.npy"); },
                          "big.npy: truncated data");
  const std::string overflow =
      npy_image("{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387904, 4), }", 0);
  expect_error_containing(
      [&] { (void)parse_npy(overflow.data(), overflow.size(), "overflow.npy"); }, "overflows");
  const std::string rank9 =
      npy_image("{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }", 4);
  expect_error_containing([&] { (void)parse_npy(rank9.data(), rank9.size(), "rank9.npy"); },
                          "rank9.npy");

  // safetensors: a shape whose byte count overflows, and one that does not fit the data.
  const auto safetensors_image = [](const std::string& json, size_t data_bytes) {
    std::string image(8, '\0');
    for (int i = 0; i < 8; ++i) image[i] = static_cast<char>((json.size() >> (8 * i)) & 0xFF);
    return image + json + std::string(data_bytes, '\0');
  };
  const std::string st_overflow = safetensors_image(
      R"({"t": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 16]}})", 16);
  expect_error_containing(
      [&] { (void)parse_safetensors(st_overflow.data(), st_overflow.size(), "o.safetensors"); },
      "overflows");
  const std::string st_outside = safetensors_image(
      R"({"t": {"dtype": "F32", "shape": [1099511627776], "data_offsets": [0, 4398046511104]}})",
      16);
  expect_error_containing(
      [&] { (void)parse_safetensors(st_outside.data(), st_outside.size(), "x.safetensors"); },
      "outside the data section");
}

// ---------------------------------------------------------------------------------------
// Weights limit

// Weights over the default limit through zero strides (4 TiB of them): tests/sdpa_contract_test.cc.
TEST(Hardening, WeightsLimitIsExactAndDoesNotWrap) {
  float one = 1.0f;
  AttentionOptions options;
  options.need_weights = true;
  // 2^31 · (2^31 + 1) weights: 4 × that many bytes wraps a 64-bit count to 8 GiB, under the
  // limit; the limit must be checked without wrapping.
  const TensorView queries(&one, DType::kFloat32, Shape({int64_t{1} << 31, 1}), Shape({0, 1}));
  const TensorView keys(&one, DType::kFloat32, Shape({(int64_t{1} << 31) + 1, 1}), Shape({0, 1}));
  expect_error_containing([&] { (void)scaled_dot_product_attention(queries, keys, keys, options); },
                          "max_weights_bytes");

  // The limit is exact: (1, 8, 8) weights take 256 bytes.
  const std::vector<float> values = test::uniform_values(8 * 4, 1);
  const TensorView small(values.data(), Shape({1, 8, 4}));
  options.max_weights_bytes = 255;
  expect_error_containing([&] { (void)scaled_dot_product_attention(small, small, small, options); },
                          "max_weights_bytes");
  options.max_weights_bytes = 256;
  EXPECT_EQ(scaled_dot_product_attention(small, small, small, options).weights.numel(), 64);
  // Without weights the limit does not apply.
  options.need_weights = false;
  options.max_weights_bytes = 0;
  EXPECT_NO_THROW((void)scaled_dot_product_attention(small, small, small, options));
}

// ---------------------------------------------------------------------------------------
// Aliasing

TEST(Hardening, OutputsOverlappingInputsAreRejectedAndLeftUntouched) {
  // One buffer holding Q (2, 4, 8) | K (2, 4, 8) | V (2, 4, 8) | mask (4, 4) as floats' room.
  constexpr int64_t kPart = 2 * 4 * 8;
  std::vector<float> buffer = test::uniform_values(4 * kPart, 2);
  float* q = buffer.data();
  float* k = q + kPart;
  float* v = k + kPart;
  const TensorView query(q, Shape({2, 4, 8})), key(k, Shape({2, 4, 8})), value(v, Shape({2, 4, 8}));
  const std::vector<float> before = buffer;
  const auto expect_rejected = [&](const TensorView& output, const TensorView* weights,
                                   const AttentionOptions& options, const std::string& fragment) {
    expect_error_containing(
        [&] { scaled_dot_product_attention_into(query, key, value, output, weights, options); },
        fragment);
    EXPECT_EQ(std::memcmp(buffer.data(), before.data(), buffer.size() * sizeof(float)), 0)
        << "an output was written before the overlap (" << fragment << ") was detected";
  };
  const AttentionOptions plain;
  expect_rejected(TensorView(q, Shape({2, 4, 8})), nullptr, plain, "overlaps the memory of query");
  // Starting half-way into the key, running into the value.
  expect_rejected(TensorView(k + 40, Shape({2, 4, 8})), nullptr, plain,
                  "overlaps the memory of key");
  // Only the first element of the output is inside the value (its last element).
  expect_rejected(TensorView(v + kPart - 1, Shape({2, 4, 8})), nullptr, plain,
                  "overlaps the memory of value");

  std::vector<float> results(4 * kPart, 0.0f);
  const TensorView output(results.data(), Shape({2, 4, 8}));
  const TensorView weights_on_output(results.data() + 8, Shape({2, 4, 4}));
  expect_rejected(output, &weights_on_output, plain, "weights overlaps the memory of output");
  const TensorView weights_on_key(k, Shape({2, 4, 4}));
  expect_rejected(output, &weights_on_key, plain, "weights overlaps the memory of key");

  std::vector<uint8_t> mask_bytes(2 * 4 * 8 * sizeof(float), 1);
  AttentionOptions masked;
  masked.mask = TensorView(mask_bytes.data(), DType::kUInt8, Shape({4, 4}));
  const TensorView output_on_mask(reinterpret_cast<float*>(mask_bytes.data()), Shape({2, 4, 8}));
  expect_error_containing(
      [&] {
        scaled_dot_product_attention_into(query, key, value, output_on_mask, nullptr, masked);
      },
      "overlaps the memory of mask");
  AttentionOptions biased;
  biased.bias = TensorView(results.data() + 2 * kPart, Shape({4, 4}));
  const TensorView output_on_bias(results.data() + 2 * kPart - 1, Shape({2, 4, 8}));
  expect_rejected(output_on_bias, nullptr, biased, "overlaps the memory of bias");

  // A zero stride would write several results to one element.
  const TensorView collapsed(results.data(), DType::kFloat32, Shape({2, 4, 8}), Shape({0, 8, 1}));
  expect_rejected(collapsed, nullptr, plain, "zero stride");

  // Adjacent but disjoint is fine: output right after V in the same buffer.
  std::vector<float> shared = test::uniform_values(4 * kPart, 3);
  const TensorView q2(shared.data(), Shape({2, 4, 8}));
  const TensorView after(shared.data() + kPart, Shape({2, 4, 8}));
  EXPECT_NO_THROW(scaled_dot_product_attention_into(q2, q2, q2, after, nullptr));
}

// ---------------------------------------------------------------------------------------
// NaN, Inf and denormals on every SIMD target

// (2, L, E) query, (2, S, E) key, (2, S, Ev) value with values in [-1, 1].
struct Problem {
  int64_t query_len, key_len;
  static constexpr int64_t kBatch = 2, kHeadDim = 16, kValueDim = 8;
  std::vector<float> query, key, value;
  Problem(int64_t query_len, int64_t key_len, uint32_t seed)
      : query_len(query_len),
        key_len(key_len),
        query(test::uniform_values(kBatch * query_len * kHeadDim, seed)),
        key(test::uniform_values(kBatch * key_len * kHeadDim, seed + 1)),
        value(test::uniform_values(kBatch * key_len * kValueDim, seed + 2)) {}
  AttentionResult run(const AttentionOptions& options) const {
    return scaled_dot_product_attention(
        TensorView(query.data(), Shape({kBatch, query_len, kHeadDim})),
        TensorView(key.data(), Shape({kBatch, key_len, kHeadDim})),
        TensorView(value.data(), Shape({kBatch, key_len, kValueDim})), options);
  }
};

bool bitwise_equal(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// Checks the rows (flattened (batch, query) index) of `got` (rows, columns) against
// `clean`: rows in `nan_rows` must be all NaN, every other row bitwise equal to `clean`.
void expect_rows(const Tensor& got, const Tensor& clean, const std::vector<int64_t>& nan_rows,
                 const std::string& what) {
  ASSERT_EQ(got.shape(), clean.shape()) << what;
  const int64_t columns = got.shape().back(0), rows = got.numel() / columns;
  const float* g = got.data_as<float>();
  const float* c = clean.data_as<float>();
  for (int64_t row = 0; row < rows; ++row) {
    const bool expect_nan = std::find(nan_rows.begin(), nan_rows.end(), row) != nan_rows.end();
    for (int64_t column = 0; column < columns; ++column) {
      const float value = g[row * columns + column];
      if (expect_nan) {
        ASSERT_TRUE(std::isnan(value)) << what << ": row " << row << " column " << column << " is "
                                       << value << ", expected NaN";
      } else {
        ASSERT_TRUE(bitwise_equal(value, c[row * columns + column]))
            << what << ": row " << row << " column " << column << " is " << value << ", expected "
            << c[row * columns + column] << " (as without the NaN/Inf)";
      }
    }
  }
}

// Every target the CPU supports, then the reference backend (target "reference").
std::vector<std::string> targets_and_reference() {
  std::vector<std::string> targets = supported_simd_targets();
  targets.push_back("reference");
  return targets;
}

// The dispatch cap for `target`: that target, or none for the reference (it has no SIMD).
std::string cap_for(const std::string& target) {
  return target == "reference" ? active_simd_target() : target;
}

AttentionOptions options_for(const std::string& target) {
  AttentionOptions options;
  options.need_weights = true;
  options.backend = target == "reference" ? Backend::kReference : Backend::kFused;
  return options;
}

// The backward pass: gradients must not overlap each other, an input, dO, O or the
// log-sum-exp, and a refused call writes nothing.
TEST(Hardening, BackwardGradientsOverlappingAreRejectedAndLeftUntouched) {
  constexpr int64_t kPart = 2 * 4 * 8;  // Q, K, V, dO, O: (2, 4, 8) each
  std::vector<float> inputs = test::uniform_values(6 * kPart, 3);  // ..., log-sum-exp at 5·kPart
  float* q = inputs.data();
  const TensorView query(q, Shape({2, 4, 8})), key(q + kPart, Shape({2, 4, 8})),
      value(q + 2 * kPart, Shape({2, 4, 8})), grad_output(q + 3 * kPart, Shape({2, 4, 8})),
      output(q + 4 * kPart, Shape({2, 4, 8})), lse(q + 5 * kPart, Shape({2, 4}));
  std::vector<float> results(3 * kPart, 0.0f);
  const TensorView dq(results.data(), Shape({2, 4, 8})),
      dk(results.data() + kPart, Shape({2, 4, 8})),
      dv(results.data() + 2 * kPart, Shape({2, 4, 8}));
  const std::vector<float> inputs_before = inputs, results_before = results;
  const auto expect_rejected = [&](const AttentionGradientViews& views,
                                   const std::string& fragment) {
    expect_error_containing(
        [&] {
          scaled_dot_product_attention_backward_into(grad_output, query, key, value, output, lse,
                                                     views);
        },
        fragment);
    EXPECT_EQ(inputs, inputs_before) << fragment;
    EXPECT_EQ(results, results_before) << fragment;
  };
  expect_rejected({dq, dq, dv, {}, {}}, "grad_query overlaps the memory of grad_key");
  expect_rejected({dq, dk, TensorView(q + 3 * kPart, Shape({2, 4, 8})), {}, {}},
                  "grad_value overlaps the memory of grad_output");
  expect_rejected({dq, TensorView(q + 4 * kPart + 8, Shape({2, 4, 8})), dv, {}, {}},
                  "grad_key overlaps the memory of output");
  expect_rejected({key, dk, dv, {}, {}}, "grad_query overlaps the memory of key");
  expect_rejected({dq, dk, dv, dq, {}}, "grad_bias was given but the options have no bias");
  // Logical shapes far beyond memory through zero strides: the gradients (2^45 floats each)
  // cannot be allocated, which is an error, not a crash.
  const TensorView wide_q(q, DType::kFloat32, Shape({int64_t{1} << 40, 4, 8}), Shape({0, 8, 1}));
  const TensorView wide_lse(q, DType::kFloat32, Shape({int64_t{1} << 40, 4}), Shape({0, 1}));
  expect_error_containing(
      [&] {
        (void)scaled_dot_product_attention_backward(wide_q, wide_q, wide_q, wide_q, wide_q,
                                                    wide_lse);
      },
      "");
}

TEST(Hardening, NaNOrInfInAQueryRowPoisonsOnlyThatRow) {
  // 3 queries take the row kernel, 37 the query-tile kernel (several tiles on every target).
  for (int64_t query_len : {3, 37}) {
    for (const std::string& target : targets_and_reference()) {
      test::ScopedSimdCap cap(cap_for(target));
      const AttentionOptions options = options_for(target);
      const Problem clean(query_len, 29, 10);
      const AttentionResult expected = clean.run(options);
      const int64_t row = Problem::kBatch * query_len - 2;  // batch 1, query L - 2
      for (float poison : {kNaN, kInfinity, -kInfinity}) {
        Problem poisoned = clean;
        poisoned.query[static_cast<size_t>(row * Problem::kHeadDim + 5)] = poison;
        // NaN: every score of the row is NaN. ±Inf: the row's scores are +Inf and -Inf (the
        // keys' element 5 takes both signs), so softmax computes Inf - Inf = NaN.
        const AttentionResult got = poisoned.run(options);
        const std::string what =
            target + ", L = " + std::to_string(query_len) + ", query " + std::to_string(poison);
        expect_rows(got.output, expected.output, {row}, what + ", output");
        expect_rows(got.weights, expected.weights, {row}, what + ", weights");
      }
    }
  }
}

TEST(Hardening, ExcludedNaNKeysHaveNoEffect) {
  for (int64_t query_len : {3, 37}) {
    for (const std::string& target : targets_and_reference()) {
      test::ScopedSimdCap cap(cap_for(target));
      const std::string what = target + ", L = " + std::to_string(query_len);
      const int64_t key_len = 29, excluded_key = 11;
      // The mask excludes key 11 for every query: masked_fill replaces its (NaN) score.
      std::vector<uint8_t> mask(static_cast<size_t>(query_len * key_len), 1);
      for (int64_t i = 0; i < query_len; ++i)
        mask[static_cast<size_t>(i * key_len + excluded_key)] = 0;
      AttentionOptions options = options_for(target);
      options.mask = TensorView(mask.data(), DType::kUInt8, Shape({query_len, key_len}));
      const Problem clean(query_len, key_len, 20);
      const AttentionResult expected = clean.run(options);
      Problem poisoned = clean;
      for (int64_t b = 0; b < Problem::kBatch; ++b) {
        for (int64_t e = 0; e < Problem::kHeadDim; ++e) {
          poisoned.key[static_cast<size_t>((b * key_len + excluded_key) * Problem::kHeadDim + e)] =
              kNaN;
        }
      }
      const AttentionResult got = poisoned.run(options);
      expect_rows(got.output, expected.output, {}, what + ", masked NaN key, output");
      expect_rows(got.weights, expected.weights, {}, what + ", masked NaN key, weights");

      // Causal, Lq = Lk: a NaN in the last key is seen by the last query of each batch only.
      AttentionOptions causal = options_for(target);
      causal.causal = true;
      const Problem square(query_len, query_len, 30);
      const AttentionResult causal_expected = square.run(causal);
      Problem causal_poisoned = square;
      for (int64_t b = 0; b < Problem::kBatch; ++b) {
        causal_poisoned.key[static_cast<size_t>(((b + 1) * query_len - 1) * Problem::kHeadDim)] =
            kNaN;
      }
      const AttentionResult causal_got = causal_poisoned.run(causal);
      const std::vector<int64_t> last_rows = {query_len - 1, 2 * query_len - 1};
      expect_rows(causal_got.output, causal_expected.output, last_rows, what + ", causal output");
      expect_rows(causal_got.weights, causal_expected.weights, last_rows,
                  what + ", causal weights");
    }
  }
}

TEST(Hardening, DenormalInputsGiveCorrectResults) {
  constexpr float kDenormal = 1e-40f;  // below FLT_MIN (1.18e-38)
  ASSERT_LT(kDenormal, std::numeric_limits<float>::min());
  ASSERT_GT(kDenormal, 0.0f);
  for (int64_t query_len : {3, 37}) {
    Problem problem(query_len, 29, 40);
    // Every other key and value element denormal, the rest in [-1, 1]; some queries
    // entirely denormal (their scores all flush to 0: uniform weights).
    for (size_t i = 0; i < problem.key.size(); i += 2) problem.key[i] = kDenormal;
    for (size_t i = 1; i < problem.value.size(); i += 2) problem.value[i] = -kDenormal;
    for (int64_t e = 0; e < Problem::kHeadDim; ++e)
      problem.query[static_cast<size_t>(e)] = kDenormal;
    AttentionOptions reference_options = options_for("reference");
    const AttentionResult expected = problem.run(reference_options);
    for (const std::string& target : supported_simd_targets()) {
      test::ScopedSimdCap cap(target);
#ifdef ATTEND_TEST_HAS_MXCSR
      const unsigned control_before = _mm_getcsr();
#endif
      AttentionOptions options = options_for(target);
      options.num_threads = 1;  // runs on this thread: its MXCSR must be restored after
      const AttentionResult got = problem.run(options);
#ifdef ATTEND_TEST_HAS_MXCSR
      EXPECT_EQ(_mm_getcsr() & 0x8040u, control_before & 0x8040u)
          << target << ": flush-to-zero / denormals-are-zero leaked out of the call";
#endif
      // |values| ≤ 1 and scores of size ≤ E / sqrt(E) = 4: float32 rounding stays far below
      // 1e-5; a denormal flushed to zero changes a result by at most 1e-40 per term.
      const float* g = got.output.data_as<float>();
      const float* e = expected.output.data_as<float>();
      for (int64_t i = 0; i < got.output.numel(); ++i) {
        ASSERT_TRUE(std::isfinite(g[i])) << target << ": output " << i << " is " << g[i];
        ASSERT_NEAR(g[i], e[i], 1e-5) << target << ", L = " << query_len << ": output " << i;
      }
      const float* gw = got.weights.data_as<float>();
      const float* ew = expected.weights.data_as<float>();
      for (int64_t i = 0; i < got.weights.numel(); ++i) {
        ASSERT_NEAR(gw[i], ew[i], 1e-6) << target << ", L = " << query_len << ": weight " << i;
      }
      // The all-denormal query (batch 0, query 0) has uniform weights 1/29.
      for (int64_t j = 0; j < 29; ++j) ASSERT_NEAR(gw[j], 1.0 / 29, 1e-6) << target;
    }
  }
}

}  // namespace
}  // namespace attend
