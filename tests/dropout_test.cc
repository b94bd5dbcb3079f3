// Dropout on the attention weights: zero with probability p, else scaled by 1 / (1 − p), the
// draw for weight (batch, query, key) taken from Philox-4x32-10 keyed by the seed
// (src/dropout.hpp), so that any backend, SIMD target and thread count drops the same
// weights.
#include "dropout.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "error_model.hpp"
#include "sdpa_cases.hpp"

namespace attend::test {
namespace {

// query (4, 64, 16), key (4, 256, 16), value (4, 256, 8): 65536 weights.
struct Problem {
  Tensor query = random_tensor(Shape({4, 64, 16}), 21);
  Tensor key = random_tensor(Shape({4, 256, 16}), 22);
  Tensor value = random_tensor(Shape({4, 256, 8}), 23);

  AttentionResult run(const AttentionOptions& options) const {
    return scaled_dot_product_attention(query.view(), key.view(), value.view(), options);
  }
};

AttentionOptions dropout_options(Backend backend, double p, uint64_t seed) {
  AttentionOptions options;
  options.backend = backend;
  options.dropout = p;
  options.seed = seed;
  options.need_weights = true;
  return options;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

int64_t count_zeros(const Tensor& weights) {
  int64_t zeros = 0;
  for (int64_t n = 0; n < weights.numel(); ++n) zeros += weights.data_as<float>()[n] == 0.0f;
  return zeros;
}

// Known-answer vectors of Philox-4x32-10 published with Random123 (kat_vectors): counter,
// key → output. The seed is the key (low word first).
TEST(Philox, MatchesThePublishedKnownAnswers) {
  struct Vector {
    uint32_t counter[4];
    uint64_t seed;
    uint32_t expected[4];
  };
  const Vector vectors[] = {
      {{0, 0, 0, 0}, 0, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       0xffffffffffffffffull,
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       0x299f31d0a4093822ull,
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Vector& v : vectors) {
    const detail::PhiloxWords words =
        detail::philox4x32_10(v.seed, v.counter[0], v.counter[1], v.counter[2], v.counter[3]);
    for (int w = 0; w < 4; ++w) EXPECT_EQ(words.word[w], v.expected[w]) << "word " << w;
  }
}

// The zeroed fraction over 65536 weights is p within 5 binomial standard deviations.
TEST(Dropout, ZeroedFractionIsP) {
  const Problem problem;
  for (const BackendCase& b : kBackends) {
    for (double p : {0.1, 0.5, 0.9}) {
      const AttentionResult result = problem.run(dropout_options(b.backend, p, 2024));
      const double n = static_cast<double>(result.weights.numel());
      const double zeros = static_cast<double>(count_zeros(result.weights));
      const double sigma = std::sqrt(n * p * (1 - p));
      EXPECT_NEAR(zeros, n * p, 5 * sigma) << b.name << " p=" << p;
    }
  }
}

// Every weight is either dropped (0) or the undropped weight times 1 / (1 − p).
TEST(Dropout, KeptWeightsAreTheUndroppedOnesScaled) {
  const Problem problem;
  for (const BackendCase& b : kBackends) {
    const AttentionResult undropped = problem.run(dropout_options(b.backend, 0.0, 0));
    for (double p : {0.1, 0.5, 0.9}) {
      const AttentionResult dropped = problem.run(dropout_options(b.backend, p, 77));
      const ReferenceProblem reference =
          reference_problem(problem.query.view(), problem.key.view(), problem.value.view(), {});
      const Tolerances tol = sdpa_tolerances(reference, {b.accumulation, p, false});
      std::vector<double> got, expected;
      int64_t kept = 0;
      for (int64_t n = 0; n < dropped.weights.numel(); ++n) {
        const double w = dropped.weights.data_as<float>()[n];
        const double w0 = undropped.weights.data_as<float>()[n];
        got.push_back(w);
        expected.push_back(w == 0.0 ? 0.0 : w0 / (1 - p));
        kept += w != 0.0;
      }
      EXPECT_GT(kept, 0) << b.name << " p=" << p;
      const Worst worst = worst_element(got, expected, 256,
                                        [&](int64_t row, double e) { return tol.weight(row, e); });
      EXPECT_TRUE(worst.ok()) << b.name << " p=" << p << ": "
                              << describe_worst(worst, "kept weights", "j", reference);
    }
  }
}

// output = (dropped weights) · V, recomputed in float64 from the returned weights.
TEST(Dropout, OutputIsTheReturnedWeightsTimesValue) {
  const Problem problem;
  const ReferenceProblem reference =
      reference_problem(problem.query.view(), problem.key.view(), problem.value.view(), {});
  const int64_t rows = 4 * 64, Lk = 256, Ev = 8;
  for (const BackendCase& b : kBackends) {
    for (double p : {0.1, 0.5, 0.9}) {
      const AttentionResult result = problem.run(dropout_options(b.backend, p, 5));
      std::vector<double> expected(static_cast<size_t>(rows * Ev), 0.0);
      const float* w = result.weights.data_as<float>();
      const float* v = problem.value.data_as<float>();
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t batch = row / 64;
        for (int64_t j = 0; j < Lk; ++j) {
          for (int64_t e = 0; e < Ev; ++e) {
            expected[static_cast<size_t>(row * Ev + e)] +=
                double{w[row * Lk + j]} * double{v[(batch * Lk + j) * Ev + e]};
          }
        }
      }
      const Tolerances tol = sdpa_tolerances(reference, {b.accumulation, p, false});
      const Worst worst =
          worst_element(values_of(result.output.view()), expected, Ev,
                        [&](int64_t row, double) { return tol.output[static_cast<size_t>(row)]; });
      EXPECT_TRUE(worst.ok()) << b.name << " p=" << p << ": "
                              << describe_worst(worst, "output", "e", reference);
    }
  }
}

TEST(Dropout, SameSeedGivesTheSameBitsAtAnyThreadCountAndCall) {
  const Problem problem;
  for (const BackendCase& b : kBackends) {
    AttentionOptions options = dropout_options(b.backend, 0.3, 99);
    options.num_threads = 1;
    const AttentionResult first = problem.run(options);
    const AttentionResult again = problem.run(options);
    options.num_threads = 2;
    const AttentionResult two_threads = problem.run(options);
    EXPECT_TRUE(same_bits(first.output, again.output)) << b.name;
    EXPECT_TRUE(same_bits(first.weights, again.weights)) << b.name;
    EXPECT_TRUE(same_bits(first.output, two_threads.output)) << b.name;
    EXPECT_TRUE(same_bits(first.weights, two_threads.weights)) << b.name;
  }
}

// Two seeds disagree on about 2p(1 − p) of the keep/drop decisions.
TEST(Dropout, DifferentSeedsGiveDifferentMasks) {
  const Problem problem;
  const double p = 0.5;
  for (const BackendCase& b : kBackends) {
    const AttentionResult one = problem.run(dropout_options(b.backend, p, 1));
    const AttentionResult two = problem.run(dropout_options(b.backend, p, 2));
    int64_t disagreements = 0;
    for (int64_t n = 0; n < one.weights.numel(); ++n) {
      disagreements +=
          (one.weights.data_as<float>()[n] == 0.0f) != (two.weights.data_as<float>()[n] == 0.0f);
    }
    const double n = static_cast<double>(one.weights.numel());
    EXPECT_NEAR(static_cast<double>(disagreements), n * 2 * p * (1 - p),
                5 * std::sqrt(n * 2 * p * (1 - p) * (1 - 2 * p * (1 - p))))
        << b.name;
  }
}

TEST(Dropout, ZeroProbabilityIsNoDropout) {
  const Problem problem;
  for (const BackendCase& b : kBackends) {
    AttentionOptions plain;
    plain.backend = b.backend;
    plain.need_weights = true;
    const AttentionResult without = problem.run(plain);
    const AttentionResult with_zero = problem.run(dropout_options(b.backend, 0.0, 12345));
    EXPECT_TRUE(same_bits(without.output, with_zero.output)) << b.name;
    EXPECT_TRUE(same_bits(without.weights, with_zero.weights)) << b.name;
    EXPECT_EQ(count_zeros(with_zero.weights), 0) << b.name;
  }
}

// Identical inputs in every batch entry and every query row (zero strides): the masks of
// different (batch, query) still differ, and the dropped weights are exactly the ones the
// documented draw (src/dropout.hpp, flat batch index over (2, 3)) names.
TEST(Dropout, DrawIsKeyedByBatchQueryAndKey) {
  const int64_t Lq = 4, Lk = 64, E = 8;
  Tensor query_row = random_tensor(Shape({E}), 31);
  Tensor keys = random_tensor(Shape({Lk, E}), 32);
  Tensor values = random_tensor(Shape({Lk, E}), 33);
  const TensorView query(query_row.data(), DType::kFloat32, Shape({2, 3, Lq, E}),
                         Shape({0, 0, 0, 1}));
  const TensorView key(keys.data(), DType::kFloat32, Shape({2, 3, Lk, E}), Shape({0, 0, E, 1}));
  const TensorView value(values.data(), DType::kFloat32, Shape({2, 3, Lk, E}), Shape({0, 0, E, 1}));
  const double p = 0.5;
  const uint64_t seed = 0x123456789abcdefull;
  const uint32_t threshold = detail::dropout_threshold(p);
  for (const BackendCase& b : kBackends) {
    const AttentionResult result =
        scaled_dot_product_attention(query, key, value, dropout_options(b.backend, p, seed));
    const float* w = result.weights.data_as<float>();
    int64_t mismatches = 0;
    for (int64_t batch = 0; batch < 6; ++batch) {
      for (int64_t i = 0; i < Lq; ++i) {
        for (int64_t j = 0; j < Lk; ++j) {
          const bool kept = w[(batch * Lq + i) * Lk + j] != 0.0f;
          mismatches += kept != detail::dropout_keep(seed, threshold, batch, i, j);
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << b.name;
    // Rows with identical scores: their zero patterns differ between queries and batches.
    const auto pattern = [&](int64_t batch, int64_t i) {
      std::string bits;
      for (int64_t j = 0; j < Lk; ++j) bits += w[(batch * Lq + i) * Lk + j] == 0.0f ? '0' : '1';
      return bits;
    };
    EXPECT_NE(pattern(0, 0), pattern(0, 1)) << b.name;
    EXPECT_NE(pattern(0, 0), pattern(1, 0)) << b.name;
    EXPECT_NE(pattern(1, 0), pattern(5, 0)) << b.name;
  }
}

// The fused kernel drops exactly the weights the reference drops, on every SIMD target.
TEST(Dropout, FusedDropsTheSameWeightsAsTheReferenceOnEveryTarget) {
  const Problem problem;
  for (double p : {0.1, 0.5, 0.9}) {
    const AttentionResult reference = problem.run(dropout_options(Backend::kReference, p, 8));
    for (const std::string& target : supported_simd_targets()) {
      AttentionResult fused;
      try {
        ScopedSimdCap cap(target);
        fused = problem.run(dropout_options(Backend::kFused, p, 8));
      } catch (const Error& error) {
        FAIL() << "target " << target << ": " << error.what();
      }
      int64_t mismatches = 0, first = -1;
      for (int64_t n = 0; n < reference.weights.numel(); ++n) {
        const bool differ = (reference.weights.data_as<float>()[n] == 0.0f) !=
                            (fused.weights.data_as<float>()[n] == 0.0f);
        if (differ && first < 0) first = n;
        mismatches += differ;
      }
      EXPECT_EQ(mismatches, 0) << "target " << target << " p=" << p
                               << ": first differing weight at flat index " << first;
    }
  }
}

}  // namespace
}  // namespace attend::test
