// decode_loop: a batch of prompts of different lengths prefilled in one step, then decoded
// greedily together, one token per sequence per step, through the paged KV cache
// (examples/tiny_decoder: embedding, RoPE, grouped-query attention, MLP, seeded weights).
// Prints tokens per second, and checks that the cached decode gives the logits a full
// recomputation without the cache gives (exit status 1 if not): run as a test.
//
//   decode_loop [STEPS]      STEPS decode steps after the prefill, 1 to 4000 (default 32);
//                            bad arguments: one "error:" line and exit status 2
#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "arguments.hpp"
#include "tiny_decoder.hpp"

namespace {

// The four sequences hold at most 70 + 4000 + 1 tokens each: 255 of the cache's 1024 blocks
// of 16 tokens.
constexpr uint64_t kMaxSteps = 4000;

int decode(int steps) {
  attend::example::TinyDecoder model({});
  // Four requests: prompts of 5, 37, 1 and 70 tokens.
  std::vector<std::vector<int32_t>> tokens;
  std::vector<int64_t> ids;
  for (const int length : {5, 37, 1, 70}) {
    std::vector<int32_t> prompt;
    for (int t = 0; t < length; ++t) prompt.push_back((t * 31 + length) % 256);
    tokens.push_back(prompt);
    ids.push_back(model.add_sequence());
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<int32_t> next = model.step(ids, tokens);  // prefill: the whole prompts
  const auto prefilled = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<int32_t>> last;
    for (size_t r = 0; r < ids.size(); ++r) {
      tokens[r].push_back(next[r]);
      last.push_back({next[r]});
    }
    next = model.step(ids, last);  // decode: one token per sequence
  }
  const auto done = std::chrono::steady_clock::now();
  const double decode_seconds = std::chrono::duration<double>(done - prefilled).count();
  const double prefill_seconds = std::chrono::duration<double>(prefilled - start).count();
  std::printf("prefill: 113 tokens in %.2f ms; decode: %d steps x %zu sequences, %.0f tokens/s\n",
              prefill_seconds * 1e3, steps, ids.size(),
              static_cast<double>(steps * static_cast<int>(ids.size())) / decode_seconds);

  // The last step's logits against a recomputation of each whole sequence without the cache.
  const std::vector<float>& logits = model.last_logits();
  const int64_t vocab = model.config().vocab;
  double worst = 0;
  for (size_t r = 0; r < ids.size(); ++r) {
    const std::vector<float> expected = model.logits_without_cache(tokens[r]);
    for (int64_t v = 0; v < vocab; ++v) {
      worst = std::max(worst, std::abs(double{logits[r * vocab + v]} - expected[v]));
    }
  }
  std::printf("largest logit difference against recomputation without the cache: %.2e\n", worst);
  if (!(worst < 1e-4)) {
    std::fprintf(stderr, "decode_loop: the cached decode disagrees with the recomputation\n");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app(
      "decode_loop: four prompts prefilled in one step, then decoded greedily together through "
      "the paged KV cache; checks the logits against a recomputation without the cache",
      "decode_loop");
  std::string steps_text = "32";
  app.add_option(
         "STEPS", steps_text,
         "decode steps after the prefill, 1 to " + std::to_string(kMaxSteps) + " (default 32)")
      ->type_name("INT");
  return attend::support::run_checked(app, argc, argv, [&] {
    const auto steps = attend::support::parse_integer("STEPS", steps_text, 1, kMaxSteps);
    return decode(static_cast<int>(steps));
  });
}
