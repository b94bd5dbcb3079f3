// serve_bench_command.cpp: `attend serve-bench` runs N requests, with prompt and output lengths
// drawn from a seeded distribution, through the tiny decoder (examples/tiny_decoder) by
// continuous batching with chunked prefill: each step admits waiting requests up to the
// concurrency and runs, within a budget of --step-tokens new tokens, every running request's
// single-token decode first, then chunks of the prompts still being prefilled (first come,
// first served; a prompt's last chunk yields its first output token), and a request leaves,
// freeing its cache blocks, once it has its output. The budget bounds a step's work, so a
// burst of long prompts no longer stalls the decodes beside it. For each concurrency it
// prints tokens per second (generated tokens / wall time), the per-token latency percentiles
// (each generated token counts the duration of the step that produced it) and the cache
// memory (peak in use, allocated). A progress bar goes to stderr when it is a terminal
// (--progress: always; --quiet: never).
#include "serve_bench_command.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "tiny_decoder.hpp"

namespace attend::cli {
namespace {

struct ServeBenchArguments {
  std::string requests_text = "64";
  std::string concurrency_text = "1,8,32";
  std::string prompt_max_text = "256";
  std::string output_max_text = "128";
  std::string seed_text = "1";
  std::string threads_text;
  std::string step_tokens_text = "128";
  support::ProgressChoice progress;
};

struct Request {
  int64_t prompt, output;
};

struct Running {
  size_t request;
  int64_t id;
  int64_t generated = 0;
  int32_t last = 0;
  int64_t prefilled = 0;  // prompt tokens in the cache so far
};

// The prompt of request r (deterministic tokens).
std::vector<int32_t> prompt_of(const std::vector<Request>& requests, size_t r) {
  std::vector<int32_t> prompt;
  for (int64_t t = 0; t < requests[r].prompt; ++t) {
    prompt.push_back(static_cast<int32_t>((t * 7 + static_cast<int64_t>(r) * 13) % 256));
  }
  return prompt;
}

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto at = static_cast<size_t>(p / 100.0 * static_cast<double>(values.size() - 1) + 0.5);
  return values[std::min(at, values.size() - 1)];
}

void run_load(const ServeBenchArguments& arguments, const std::vector<Request>& requests,
              int64_t concurrency, int threads, int64_t max_len, int64_t step_tokens) {
  example::TinyDecoderConfig config;
  config.block_size = 16;
  config.cache_blocks = concurrency * ((max_len + 15) / 16) + 1;
  config.num_threads = threads;
  example::TinyDecoder model(config);
  std::deque<size_t> waiting;
  for (size_t r = 0; r < requests.size(); ++r) waiting.push_back(r);
  std::vector<Running> running;
  std::vector<double> latencies;  // one per generated token, ms
  int64_t generated = 0, peak_blocks = 0;
  size_t finished = 0;
  const bool progress = support::draw_progress(arguments.progress);
  const auto start = std::chrono::steady_clock::now();
  while (!waiting.empty() || !running.empty()) {
    while (!waiting.empty() && static_cast<int64_t>(running.size()) < concurrency) {
      const size_t r = waiting.front();
      waiting.pop_front();
      running.push_back({r, model.add_sequence()});
    }
    // The step's batch: decodes first, then prompt chunks within the budget (at least one
    // token per step, so that a budget below the decodes still makes progress).
    std::vector<int64_t> ids;
    std::vector<std::vector<int32_t>> tokens;
    std::vector<size_t> in_step;  // indices into `running`
    int64_t budget = step_tokens;
    for (size_t s = 0; s < running.size(); ++s) {
      if (running[s].prefilled < requests[running[s].request].prompt) continue;
      ids.push_back(running[s].id);
      tokens.push_back({running[s].last});
      in_step.push_back(s);
      --budget;
    }
    for (size_t s = 0; s < running.size() && (budget > 0 || ids.empty()); ++s) {
      Running& r = running[s];
      const int64_t prompt = requests[r.request].prompt;
      if (r.prefilled >= prompt) continue;
      const int64_t take = std::min(prompt - r.prefilled, std::max<int64_t>(budget, 1));
      const std::vector<int32_t> whole = prompt_of(requests, r.request);
      ids.push_back(r.id);
      tokens.emplace_back(whole.begin() + r.prefilled, whole.begin() + r.prefilled + take);
      in_step.push_back(s);
      budget -= take;
    }
    const auto before = std::chrono::steady_clock::now();
    const std::vector<int32_t> next = model.step(ids, tokens);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - before)
            .count();
    peak_blocks = std::max(peak_blocks, model.cache_blocks_used());
    std::vector<bool> produced(running.size(), false);
    for (size_t n = 0; n < in_step.size(); ++n) {
      Running& r = running[in_step[n]];
      const int64_t prompt = requests[r.request].prompt;
      if (r.prefilled < prompt) {
        r.prefilled += static_cast<int64_t>(tokens[n].size());
        if (r.prefilled < prompt) continue;  // a middle chunk: no output token yet
      }
      r.last = next[n];
      produced[in_step[n]] = true;
    }
    std::vector<Running> still;
    for (size_t s = 0; s < running.size(); ++s) {
      Running r = running[s];
      if (!produced[s]) {
        still.push_back(r);
        continue;
      }
      ++r.generated;
      ++generated;
      latencies.push_back(ms);
      if (r.generated >= requests[r.request].output) {
        model.remove_sequence(r.id);
        ++finished;
        if (progress) {
          const size_t width = 30, done = finished * width / requests.size();
          std::fprintf(stderr, "\rconcurrency %3lld [%s%s] %zu/%zu requests",
                       static_cast<long long>(concurrency), std::string(done, '#').c_str(),
                       std::string(width - done, '.').c_str(), finished, requests.size());
        }
      } else {
        still.push_back(r);
      }
    }
    running = std::move(still);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (progress) std::fprintf(stderr, "\n");
  const double block_bytes = static_cast<double>(model.cache_bytes()) /
                             static_cast<double>(config.cache_blocks * config.layers);
  std::printf("%11lld %8zu %8lld %10.0f %9.2f %9.2f %10.2f %10.2f\n",
              static_cast<long long>(concurrency), requests.size(),
              static_cast<long long>(generated), static_cast<double>(generated) / seconds,
              percentile(latencies, 50), percentile(latencies, 99),
              static_cast<double>(peak_blocks) * block_bytes / (1 << 20),
              static_cast<double>(model.cache_bytes()) / (1 << 20));
  std::fflush(stdout);
}

void run_serve_bench(const ServeBenchArguments& arguments, const CLI::App& command) {
  const auto count =
      static_cast<int64_t>(parse_integer("--requests", arguments.requests_text, 1, 100000));
  const auto prompt_max =
      static_cast<int64_t>(parse_integer("--prompt-max", arguments.prompt_max_text, 1, 65536));
  const auto output_max =
      static_cast<int64_t>(parse_integer("--output-max", arguments.output_max_text, 1, 65536));
  const uint64_t seed = parse_integer("--seed", arguments.seed_text, 0, UINT64_MAX);
  const int threads = threads_from(command, arguments.threads_text, 0);
  std::vector<int64_t> levels;
  std::stringstream list(arguments.concurrency_text);
  for (std::string item; std::getline(list, item, ',');) {
    levels.push_back(static_cast<int64_t>(parse_integer("--concurrency", item, 1, 4096)));
  }
  // Prompts uniform in [prompt_max / 16, prompt_max], outputs in [output_max / 8, output_max].
  std::mt19937_64 random(seed);
  std::vector<Request> requests;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t prompt = std::uniform_int_distribution<int64_t>(
        std::max<int64_t>(1, prompt_max / 16), prompt_max)(random);
    const int64_t output = std::uniform_int_distribution<int64_t>(
        std::max<int64_t>(1, output_max / 8), output_max)(random);
    requests.push_back({prompt, output});
  }
  std::printf(
      "tiny decoder (2 layers, width 128, 8 query heads, 2 K/V heads, paged cache of "
      "16-token blocks); prompts %lld..%lld, outputs %lld..%lld tokens, seed %llu\n",
      static_cast<long long>(std::max<int64_t>(1, prompt_max / 16)),
      static_cast<long long>(prompt_max),
      static_cast<long long>(std::max<int64_t>(1, output_max / 8)),
      static_cast<long long>(output_max), static_cast<unsigned long long>(seed));
  std::printf(
      "concurrency requests   tokens   tokens/s    p50 ms    p99 ms  cache MiB  alloc MiB\n");
  const auto step_tokens =
      static_cast<int64_t>(parse_integer("--step-tokens", arguments.step_tokens_text, 1, 1 << 20));
  for (const int64_t c : levels) {
    run_load(arguments, requests, c, threads, prompt_max + output_max, step_tokens);
  }
}

}  // namespace

Command add_serve_bench_command(CLI::App& app) {
  auto arguments = std::make_shared<ServeBenchArguments>();
  CLI::App* command = app.add_subcommand(
      "serve-bench",
      "Continuous batching on the paged KV cache: N seeded requests through a tiny decoder; "
      "prints tokens/s, per-token latency p50/p99 and cache memory per concurrency");
  command->add_option("--requests", arguments->requests_text, "requests to serve (default 64)")
      ->type_name("INT");
  command
      ->add_option("--concurrency", arguments->concurrency_text,
                   "comma-separated concurrency levels (default 1,8,32)")
      ->type_name("INT[,INT...]");
  command
      ->add_option("--prompt-max", arguments->prompt_max_text,
                   "longest prompt; prompts are uniform in [max/16, max] (default 256)")
      ->type_name("INT");
  command
      ->add_option("--output-max", arguments->output_max_text,
                   "longest output; outputs are uniform in [max/8, max] (default 128)")
      ->type_name("INT");
  command->add_option("--seed", arguments->seed_text, "seed of the lengths (default 1)")
      ->type_name("INT");
  command
      ->add_option("--step-tokens", arguments->step_tokens_text,
                   "new tokens per step: decodes, then prompt chunks (default 128)")
      ->type_name("INT");
  add_threads_option(*command, arguments->threads_text, "all");
  support::add_progress_options(*command, arguments->progress, "no progress bar");
  return {command, [arguments, command] { run_serve_bench(*arguments, *command); }};
}

}  // namespace attend::cli
