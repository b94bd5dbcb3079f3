// concurrency_test: many std::threads calling scaled_dot_product_attention (forward and
// backward) and MultiHeadAttention::forward at once, with different shapes, masks, dropout seeds
// and backends, on shared read-only inputs and one shared module. Every concurrent result must be
// bitwise equal to the one computed beforehand on a single thread.
//
// Each call runs with num_threads = 1, so that the library's OpenMP does not start a team:
// this test also runs under ThreadSanitizer (scripts/ci-sanitizers.sh), and libgomp is not
// TSan-instrumented, so its internal synchronization would be reported as races. What is
// tested here is the library's own state: dispatch tables, the SIMD cap, the kernel
// workspaces and anything static. Concurrency inside one call (OpenMP) is covered by the
// thread-count independence checks of the other suites.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "attend/error.hpp"
#include "attend/multihead.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "attend/tensor.hpp"
#include "test_support.hpp"

namespace attend {
namespace {

// Threads well above the core count, so that calls really interleave.
constexpr int kThreads = 8;
// Times each thread runs the whole job list (in a rotated order).
constexpr int kRounds = 3;

// A (shape) uint8 mask with about `keep_fraction` of entries nonzero.
Tensor random_mask(const Shape& shape, double keep_fraction, uint32_t seed) {
  std::mt19937 generator(seed);
  std::bernoulli_distribution keep(keep_fraction);
  Tensor mask(DType::kUInt8, shape);
  for (int64_t i = 0; i < mask.numel(); ++i) mask.data_as<uint8_t>()[i] = keep(generator);
  return mask;
}

struct Outputs {
  Tensor output;
  Tensor weights;
  std::vector<Tensor> gradients;  // backward jobs: dQ, dK, dV
};

// One call with fixed inputs; run() may be called from any thread.
struct Job {
  std::string name;
  std::function<Outputs()> run;
};

// An SDPA problem: (batch, heads, Lq, E) query, (batch, heads, Lk, E) key,
// (batch, heads, Lk, Ev) value, optional (Lq, Lk) mask broadcast over batch and heads.
struct SdpaProblem {
  std::string name;
  DType dtype;
  int64_t batch, heads, query_len, key_len, head_dim, value_dim;
  bool causal, masked;
  double dropout;
  uint64_t seed;
  Backend backend;
  FullyMaskedRows fully_masked_rows;
};

const SdpaProblem kSdpaProblems[] = {
    {"f32 fused 1x1x7x9", DType::kFloat32, 1, 1, 7, 9, 16, 16, false, false, 0.0, 0,
     Backend::kFused, FullyMaskedRows::kUniform},
    {"f32 fused causal 2x3x33x33", DType::kFloat32, 2, 3, 33, 33, 32, 24, true, false, 0.0, 0,
     Backend::kFused, FullyMaskedRows::kUniform},
    {"f32 fused mask dropout 2x2x20x47", DType::kFloat32, 2, 2, 20, 47, 8, 8, false, true, 0.3, 11,
     Backend::kFused, FullyMaskedRows::kZero},
    {"f32 fused mask dropout other seed", DType::kFloat32, 2, 2, 20, 47, 8, 8, false, true, 0.3, 12,
     Backend::kFused, FullyMaskedRows::kZero},
    {"f16 auto causal dropout 1x4x64x64", DType::kFloat16, 1, 4, 64, 64, 16, 16, true, false, 0.1,
     5, Backend::kAuto, FullyMaskedRows::kUniform},
    {"bf16 fused 3x1x5x70", DType::kBFloat16, 3, 1, 5, 70, 12, 20, false, true, 0.0, 0,
     Backend::kFused, FullyMaskedRows::kUniform},
    {"f32 reference mask causal 1x2x17x13", DType::kFloat32, 1, 2, 17, 13, 8, 4, true, true, 0.2,
     99, Backend::kReference, FullyMaskedRows::kUniform},
};

// Inputs stay alive (and unmodified) in `storage` for the whole test.
Job make_sdpa_job(const SdpaProblem& problem, std::vector<std::shared_ptr<Tensor>>& storage,
                  uint32_t seed) {
  const auto make = [&](Tensor t) {
    storage.push_back(std::make_shared<Tensor>(std::move(t)));
    return storage.back()->view();
  };
  const int64_t n = problem.batch, h = problem.heads;
  const TensorView query = make(test::random_tensor(
      Shape({n, h, problem.query_len, problem.head_dim}), seed, 2.0, problem.dtype));
  const TensorView key = make(test::random_tensor(Shape({n, h, problem.key_len, problem.head_dim}),
                                                  seed + 1, 2.0, problem.dtype));
  const TensorView value = make(test::random_tensor(
      Shape({n, h, problem.key_len, problem.value_dim}), seed + 2, 2.0, problem.dtype));
  AttentionOptions options;
  if (problem.masked) {
    options.mask = make(random_mask(Shape({problem.query_len, problem.key_len}), 0.6, seed + 3));
  }
  options.causal = problem.causal;
  options.dropout = problem.dropout;
  options.seed = problem.seed;
  options.backend = problem.backend;
  options.fully_masked_rows = problem.fully_masked_rows;
  options.need_weights = true;
  options.num_threads = 1;
  return {"sdpa " + problem.name, [=] {
            AttentionResult result = scaled_dot_product_attention(query, key, value, options);
            return Outputs{std::move(result.output), std::move(result.weights), {}};
          }};
}

// The same problem's forward (with log-sum-exp) and backward from a fixed dO.
Job make_sdpa_backward_job(const SdpaProblem& problem,
                           std::vector<std::shared_ptr<Tensor>>& storage, uint32_t seed) {
  Job forward = make_sdpa_job(problem, storage, seed);
  // make_sdpa_job stored query, key, value (and the mask) last: reuse them.
  const size_t first = storage.size() - (problem.masked ? 4 : 3);
  const TensorView query = storage[first]->view(), key = storage[first + 1]->view(),
                   value = storage[first + 2]->view();
  storage.push_back(std::make_shared<Tensor>(test::random_tensor(
      Shape({problem.batch, problem.heads, problem.query_len, problem.value_dim}), seed + 5, 2.0,
      problem.dtype)));
  const TensorView grad_output = storage.back()->view();
  AttentionOptions options;
  if (problem.masked) options.mask = storage[first + 3]->view();
  options.causal = problem.causal;
  options.dropout = problem.dropout;
  options.seed = problem.seed;
  options.backend = problem.backend;
  options.fully_masked_rows = problem.fully_masked_rows;
  options.need_logsumexp = true;
  options.num_threads = 1;
  return {"sdpa backward " + problem.name, [=] {
            AttentionResult f = scaled_dot_product_attention(query, key, value, options);
            AttentionGradients g = scaled_dot_product_attention_backward(
                grad_output, query, key, value, f.output.view(), f.logsumexp.view(), options);
            Outputs outputs{std::move(f.output), std::move(f.logsumexp), {}};
            outputs.gradients.push_back(std::move(g.query));
            outputs.gradients.push_back(std::move(g.key));
            outputs.gradients.push_back(std::move(g.value));
            return outputs;
          }};
}

// Multi-head jobs on one shared module (forward is const).
std::vector<Job> make_multihead_jobs(const MultiHeadAttention& module,
                                     std::vector<std::shared_ptr<Tensor>>& storage) {
  const auto make = [&](Tensor t) {
    storage.push_back(std::make_shared<Tensor>(std::move(t)));
    return storage.back()->view();
  };
  const int64_t E = module.embed_dim();
  const TensorView x = make(test::random_tensor(Shape({2, 9, E}), 301, 2.0));
  const TensorView memory = make(test::random_tensor(Shape({2, 14, E}), 302, 2.0));
  const TensorView padding = make(random_mask(Shape({2, 14}), 0.8, 303));
  const TensorView attn_mask = make(random_mask(Shape({9, 9}), 0.7, 304));
  std::vector<Job> jobs;
  const auto add = [&](std::string name, TensorView q, TensorView kv,
                       MultiHeadForwardOptions options) {
    options.num_threads = 1;
    jobs.push_back({"multihead " + name, [&module, q, kv, options] {
                      MultiHeadResult result = module.forward(q, kv, kv, options);
                      return Outputs{std::move(result.output), std::move(result.weights), {}};
                    }});
  };
  MultiHeadForwardOptions self_attention;
  add("self", x, x, self_attention);
  MultiHeadForwardOptions causal_dropout;
  causal_dropout.causal = true;
  causal_dropout.dropout = 0.25;
  causal_dropout.seed = 7;
  causal_dropout.average_weights_over_heads = false;
  add("causal dropout", x, x, causal_dropout);
  MultiHeadForwardOptions masked;
  masked.attn_mask = attn_mask;
  masked.dropout = 0.1;
  masked.seed = 8;
  add("attn_mask dropout", x, x, masked);
  MultiHeadForwardOptions cross;
  cross.key_padding_mask = padding;
  cross.need_weights = false;
  add("cross padding", x, memory, cross);
  return jobs;
}

// Flat index of the first differing byte's element, or -1 when bitwise equal.
int64_t first_difference(const Tensor& got, const Tensor& expected) {
  if (got.shape() != expected.shape() || got.dtype() != expected.dtype()) return 0;
  const size_t item = dtype_size(got.dtype());
  const auto* g = static_cast<const unsigned char*>(got.data());
  const auto* e = static_cast<const unsigned char*>(expected.data());
  for (size_t i = 0; i < got.nbytes(); i += item) {
    if (std::memcmp(g + i, e + i, item) != 0) return static_cast<int64_t>(i / item);
  }
  return -1;
}

std::string describe_difference(const char* part, const Tensor& got, const Tensor& expected,
                                int64_t index) {
  std::ostringstream message;
  message << part << " differs: got shape " << got.shape().str() << ", expected "
          << expected.shape().str();
  if (got.shape() == expected.shape() && got.dtype() == DType::kFloat32) {
    message << "; first at flat index " << index << ": got " << got.data_as<float>()[index]
            << ", expected " << expected.data_as<float>()[index];
  }
  return message.str();
}

// Runs every job once on this thread for the expected results, then kThreads threads run
// all of them kRounds times each, starting at different jobs, and compare bitwise.
void expect_concurrent_results_match(const std::vector<Job>& jobs) {
  std::vector<Outputs> expected;
  for (const Job& job : jobs) expected.push_back(job.run());

  std::mutex failures_mutex;
  std::vector<std::string> failures;
  const auto record = [&](std::string failure) {
    const std::lock_guard<std::mutex> lock(failures_mutex);
    failures.push_back(std::move(failure));
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        for (size_t k = 0; k < jobs.size(); ++k) {
          const size_t j =
              (k + static_cast<size_t>(t) * 3 + static_cast<size_t>(round)) % jobs.size();
          const std::string where = jobs[j].name + " (thread " + std::to_string(t) + ", round " +
                                    std::to_string(round) + "): ";
          try {
            const Outputs got = jobs[j].run();
            const int64_t out = first_difference(got.output, expected[j].output);
            if (out >= 0) {
              record(where + describe_difference("output", got.output, expected[j].output, out));
            }
            const int64_t w = first_difference(got.weights, expected[j].weights);
            if (w >= 0) {
              record(where + describe_difference("weights", got.weights, expected[j].weights, w));
            }
            for (size_t g = 0; g < got.gradients.size(); ++g) {
              const int64_t d = first_difference(got.gradients[g], expected[j].gradients[g]);
              if (d >= 0) {
                record(where + describe_difference("gradient", got.gradients[g],
                                                   expected[j].gradients[g], d));
              }
            }
          } catch (const std::exception& e) {
            record(where + "threw " + e.what());
          }
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_TRUE(failures.empty()) << failures.size() << " mismatches, the first: "
                                << (failures.empty() ? "" : failures.front());
}

TEST(Concurrency, ScaledDotProductAttentionFromManyThreads) {
  std::vector<std::shared_ptr<Tensor>> storage;
  std::vector<Job> jobs;
  uint32_t seed = 1;
  for (const SdpaProblem& problem : kSdpaProblems) {
    jobs.push_back(make_sdpa_job(problem, storage, seed));
    seed += 10;
  }
  expect_concurrent_results_match(jobs);
}

TEST(Concurrency, BackwardFromManyThreads) {
  std::vector<std::shared_ptr<Tensor>> storage;
  std::vector<Job> jobs;
  uint32_t seed = 500;
  for (const SdpaProblem& problem : kSdpaProblems) {
    jobs.push_back(make_sdpa_backward_job(problem, storage, seed));
    seed += 10;
  }
  expect_concurrent_results_match(jobs);
}

TEST(Concurrency, MultiHeadForwardFromManyThreadsOnOneModule) {
  const MultiHeadAttention module(32, 4, {}, 42);
  std::vector<std::shared_ptr<Tensor>> storage;
  expect_concurrent_results_match(make_multihead_jobs(module, storage));
}

TEST(Concurrency, MixedCallsFromManyThreads) {
  const MultiHeadAttention packed(24, 3, {}, 1);
  MultiHeadOptions separate_dims;
  separate_dims.kdim = 16;  // kdim, vdim != embed_dim: separate q/k/v projection weights
  separate_dims.vdim = 8;
  const MultiHeadAttention unpacked(24, 2, separate_dims, 2);
  std::vector<std::shared_ptr<Tensor>> storage;
  std::vector<Job> jobs = make_multihead_jobs(packed, storage);
  // Cross-attention through separate q/k/v projections.
  const TensorView x =
      storage
          .emplace_back(std::make_shared<Tensor>(test::random_tensor(Shape({3, 6, 24}), 401, 2.0)))
          ->view();
  const TensorView keys =
      storage
          .emplace_back(std::make_shared<Tensor>(test::random_tensor(Shape({3, 11, 16}), 402, 2.0)))
          ->view();
  const TensorView values =
      storage
          .emplace_back(std::make_shared<Tensor>(test::random_tensor(Shape({3, 11, 8}), 403, 2.0)))
          ->view();
  jobs.push_back({"multihead unpacked cross", [&unpacked, x, keys, values] {
                    MultiHeadForwardOptions options;
                    options.num_threads = 1;
                    options.dropout = 0.5;
                    options.seed = 3;
                    MultiHeadResult result = unpacked.forward(x, keys, values, options);
                    return Outputs{std::move(result.output), std::move(result.weights), {}};
                  }});
  uint32_t seed = 500;
  for (const SdpaProblem& problem : kSdpaProblems) {
    jobs.push_back(make_sdpa_job(problem, storage, seed));
    seed += 10;
  }
  expect_concurrent_results_match(jobs);
}

}  // namespace
}  // namespace attend
