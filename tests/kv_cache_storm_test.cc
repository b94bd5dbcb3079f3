// A storm over one PagedKvCache (attend/kv_cache.hpp, its public API only) of each storage
// format (float32, float16, bfloat16, int8, float8_e4m3, float8_e5m2) checked against a
// shadow model: several threads append (batches of their sequences, some refused when the
// cache is full), fork, evict outside a window, remove, attend (decode, grouped-query) and
// read key_mass at random for a bounded time, each over its own sequences (the cache refuses
// two threads on one sequence), all sharing the cache's blocks and free list.
//
// The shadow, per thread: each sequence's tokens as the cache's format stores them, its
// evicted blocks, and an abstract label per block (a fork shares its parent's labels; an
// append into a partly filled tail block that another sequence shares gets a fresh label:
// copy on write) with reference counts. A token's stored form comes from the library's own
// encoding, the one the cache's append calls: convert() for float32, float16 and bfloat16,
// detail::quantize_kv_rows (kv_format.hpp) for the scaled formats (codes and one scale per
// token and K/V head); its logical K/V is what that form stands for (widen(stored), or
// scale · widen(code) in float32). After every step the touched sequences must agree with
// the shadow: length, block table (-1 exactly where evicted; one physical block per label and
// one label per physical block), every kept token's stored bytes and scales (bitwise), and
// attention (output and key_mass) against a float64 dense listing over the shadow's logical
// K/V of the kept tokens, within paged attention's error model (tests/error_model.hpp,
// paged_row_tolerance: float32 products on the stored values). Every few steps all threads
// stop and one checks the whole cache: free_blocks() = num_blocks - live labels, no physical
// block under two labels. At the end every sequence is removed and every block is free.
//
// ATTEND_STORM_SECONDS (default 1) bounds the run of each format: seconds in CI, minutes in
// the soak (scripts/soak.sh). Each call runs on one thread inside (num_threads = 1), so that
// ThreadSanitizer sees every access (scripts/ci-sanitizers.sh runs it under TSan).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "attend/error.hpp"
#include "attend/kv_cache.hpp"
#include "error_model.hpp"
#include "kv_format.hpp"

namespace attend::test {
namespace {

constexpr int kThreads = 4;
constexpr int64_t kBlocks = 48, kBlockSize = 4, kKvHeads = 2, kHeads = 4, kDim = 8;
constexpr int kMaxSequences = 6;    // per thread
constexpr int64_t kMaxLength = 40;  // tokens; longer sequences are evicted or removed
constexpr int kStepsPerRound = 25;  // between whole-cache checks

double storm_seconds() {
  const char* env = std::getenv("ATTEND_STORM_SECONDS");
  return env && *env ? std::atof(env) : 1.0;
}

// Tokens (n, Hkv, E) as the cache stores them.
struct Stored {
  std::vector<uint8_t> bytes;  // (n, Hkv, E) elements of the cache's dtype (codes if scaled)
  std::vector<float> scales;   // (n, Hkv), scaled formats only
  std::vector<float> logical;  // (n, Hkv, E): what they stand for, float32

  void insert(const Stored& from, int64_t first, int64_t last, size_t element_size) {
    const auto row = static_cast<int64_t>(kKvHeads * kDim * element_size);
    bytes.insert(bytes.end(), from.bytes.begin() + first * row, from.bytes.begin() + last * row);
    if (!from.scales.empty()) {
      scales.insert(scales.end(), from.scales.begin() + first * kKvHeads,
                    from.scales.begin() + last * kKvHeads);
    }
    logical.insert(logical.end(), from.logical.begin() + first * kKvHeads * kDim,
                   from.logical.begin() + last * kKvHeads * kDim);
  }
};

struct ShadowSequence {
  Stored keys, values;
  std::vector<int64_t> labels;  // per block: its label, -1 evicted
  int64_t length() const { return static_cast<int64_t>(keys.logical.size()) / (kKvHeads * kDim); }
  int64_t first_kept() const {
    int64_t b = 0;
    while (b < static_cast<int64_t>(labels.size()) && labels[static_cast<size_t>(b)] < 0) ++b;
    return b * kBlockSize;
  }
};

enum Op { kAdd, kAppend, kFork, kEvict, kRemove, kAttend, kKeyMass, kRefused, kOps };
constexpr const char* kOpNames[] = {"add",    "append", "fork",     "evict",
                                    "remove", "attend", "key_mass", "append refused (full)"};

// Everything one thread owns: its sequences' shadows, its labels' reference counts and
// physical blocks.
struct Worker {
  PagedKvCache* cache = nullptr;
  DType dtype = DType::kFloat32;
  std::mt19937_64 random;
  std::map<int64_t, ShadowSequence> sequences;
  std::map<int64_t, int> references;    // label -> sequences listing it
  std::map<int64_t, int32_t> physical;  // label -> block
  std::atomic<int64_t>* next_label = nullptr;
  int64_t counts[kOps] = {};
  std::vector<std::string> problems;

  void problem(const std::string& what) {
    if (problems.size() < 10) problems.push_back(what);
  }
  int64_t uniform(int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(random);
  }
  std::vector<float> normal(int64_t n) {
    std::normal_distribution<float> d;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = d(random);
    return v;
  }
  // Tokens x (n, Hkv, E) float32 as the cache stores them, by the library's encoding of the
  // format (the calls PagedKvCache::append makes): convert() into the dtype, or
  // quantize_kv_rows per (token, K/V head) row of E; logical = widen(stored), times the
  // row's scale for the scaled formats (float32).
  Stored encode(const std::vector<float>& x) const {
    const auto n = static_cast<int64_t>(x.size()), rows = n / kDim;
    Stored out;
    out.bytes.resize(static_cast<size_t>(n) * dtype_size(dtype));
    out.logical.resize(x.size());
    const bool scaled = detail::is_scaled_kv_format(dtype);
    if (scaled) {
      out.scales.resize(static_cast<size_t>(rows));
      detail::quantize_kv_rows(dtype, x.data(), rows, kDim, out.bytes.data(), out.scales.data());
    } else {
      convert(TensorView(const_cast<float*>(x.data()), DType::kFloat32, Shape({n})),
              TensorView(out.bytes.data(), dtype, Shape({n})));
    }
    for (int64_t r = 0; r < rows; ++r) {
      const void* row = out.bytes.data() + r * kDim * static_cast<int64_t>(dtype_size(dtype));
      for (int64_t e = 0; e < kDim; ++e) {
        const float widened = detail::widen_kv(dtype, row, e);
        out.logical[static_cast<size_t>(r * kDim + e)] =
            scaled ? out.scales[static_cast<size_t>(r)] * widened : widened;
      }
    }
    return out;
  }
  int64_t pick() {
    auto it = sequences.begin();
    std::advance(it, uniform(0, static_cast<int64_t>(sequences.size()) - 1));
    return it->first;
  }
  void drop(int64_t label) {
    if (label < 0) return;
    if (--references[label] == 0) {
      references.erase(label);
      physical.erase(label);
    }
  }

  // The cache agrees with the shadow on sequence `id`.
  void check(int64_t id) {
    const ShadowSequence& s = sequences.at(id);
    const std::string where = "sequence " + std::to_string(id) + ": ";
    if (cache->length(id) != s.length()) return problem(where + "length differs");
    const std::vector<int32_t> table = cache->block_table(id);
    if (table.size() != s.labels.size()) return problem(where + "block table size differs");
    for (size_t i = 0; i < table.size(); ++i) {
      const int64_t label = s.labels[i];
      if ((table[i] < 0) != (label < 0)) return problem(where + "evicted blocks differ");
      if (label < 0) continue;
      const auto [it, added] = physical.emplace(label, table[i]);
      if (it->second != table[i]) return problem(where + "a shared block was copied, or not");
    }
    // Every kept token's key and value as stored (elements or codes, and scales), bitwise.
    const auto size = static_cast<int64_t>(dtype_size(dtype));
    for (int64_t t = s.first_kept(); t < s.length(); ++t) {
      const int64_t block = table[static_cast<size_t>(t / kBlockSize)], row = t % kBlockSize;
      for (const auto& [blocks, scales, shadow] :
           {std::tuple{cache->key_blocks(), cache->key_scales(), &s.keys},
            std::tuple{cache->value_blocks(), cache->value_scales(), &s.values}}) {
        const Shape& st = blocks.strides;
        for (int64_t h = 0; h < kKvHeads; ++h) {
          for (int64_t e = 0; e < kDim; ++e) {
            const int64_t at = block * st[0] + row * st[1] + h * st[2] + e * st[3];
            if (std::memcmp(static_cast<const char*>(blocks.data) + at * size,
                            shadow->bytes.data() + ((t * kKvHeads + h) * kDim + e) * size,
                            static_cast<size_t>(size)) != 0) {
              return problem(where + "token " + std::to_string(t) + " differs from the shadow");
            }
          }
          if (shadow->scales.empty()) continue;
          const float scale =
              scales.data_as<const float>()[block * scales.strides[0] + row * scales.strides[1] +
                                            h * scales.strides[2]];
          if (std::memcmp(&scale, &shadow->scales[static_cast<size_t>(t * kKvHeads + h)],
                          sizeof scale) != 0) {
            return problem(where + "the scale of token " + std::to_string(t) +
                           " differs from the shadow");
          }
        }
      }
    }
  }

  void add() {
    if (sequences.size() >= kMaxSequences) return remove();
    sequences[cache->add_sequence()];
    ++counts[kAdd];
  }

  void append() {
    std::vector<int64_t> ids;
    for (int n = static_cast<int>(uniform(1, 3)); n > 0 && ids.size() < sequences.size(); --n) {
      const int64_t id = pick();
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
    }
    std::vector<int32_t> cu = {0};
    for (size_t i = 0; i < ids.size(); ++i) {
      cu.push_back(cu.back() + static_cast<int32_t>(uniform(1, 2 * kBlockSize)));
    }
    const int64_t total = cu.back(), row = kKvHeads * kDim;
    const std::vector<float> keys = normal(total * row), values = normal(total * row);
    std::vector<std::vector<int32_t>> before;
    for (int64_t id : ids) before.push_back(cache->block_table(id));
    try {
      cache->append(ids,
                    TensorView(const_cast<float*>(keys.data()), DType::kFloat32,
                               Shape({total, kKvHeads, kDim})),
                    TensorView(const_cast<float*>(values.data()), DType::kFloat32,
                               Shape({total, kKvHeads, kDim})),
                    TensorView(cu.data(), DType::kInt32, Shape({static_cast<int64_t>(cu.size())})));
    } catch (const Error& e) {
      // Refused: the cache had too few free blocks; nothing of it may have changed.
      if (std::string(e.what()).find("the cache is full") == std::string::npos) {
        problem(std::string("append refused for another reason: ") + e.what());
      }
      for (size_t i = 0; i < ids.size(); ++i) {
        if (cache->block_table(ids[i]) != before[i]) problem("a refused append changed a table");
        check(ids[i]);
      }
      ++counts[kRefused];
      return;
    }
    const Stored k = encode(keys), v = encode(values);
    for (size_t i = 0; i < ids.size(); ++i) {
      ShadowSequence& s = sequences.at(ids[i]);
      const int64_t length = s.length(), count = cu[i + 1] - cu[i];
      // Copy on write: a partly filled tail block that another sequence lists.
      if (count > 0 && length % kBlockSize != 0 && references[s.labels.back()] > 1) {
        drop(s.labels.back());
        s.labels.back() = (*next_label)++;
        references[s.labels.back()] = 1;
      }
      while (static_cast<int64_t>(s.labels.size()) * kBlockSize < length + count) {
        s.labels.push_back((*next_label)++);
        references[s.labels.back()] = 1;
      }
      s.keys.insert(k, cu[i], cu[i + 1], dtype_size(dtype));
      s.values.insert(v, cu[i], cu[i + 1], dtype_size(dtype));
      check(ids[i]);
    }
    ++counts[kAppend];
  }

  void fork() {
    if (sequences.size() >= kMaxSequences) return remove();
    const int64_t parent = pick();
    const int64_t child = cache->fork(parent);
    ShadowSequence copy = sequences.at(parent);
    for (int64_t label : copy.labels) {
      if (label >= 0) ++references[label];
    }
    sequences[child] = std::move(copy);
    check(child);
    ++counts[kFork];
  }

  void evict() {
    const int64_t id = pick();
    ShadowSequence& s = sequences.at(id);
    if (s.length() == 0) return;
    const int64_t window = uniform(1, s.length());
    cache->evict_outside_window(id, window);
    // Block i goes when all its tokens j < length - window.
    for (int64_t i = 0; (i + 1) * kBlockSize <= s.length() - window; ++i) {
      drop(s.labels[static_cast<size_t>(i)]);
      s.labels[static_cast<size_t>(i)] = -1;
    }
    check(id);
    ++counts[kEvict];
  }

  void remove() {
    const int64_t id = pick();
    cache->remove_sequence(id);
    for (int64_t label : sequences.at(id).labels) drop(label);
    sequences.erase(id);
    ++counts[kRemove];
  }

  // One decode query per sequence, grouped-query (H = 2 Hkv), against the float64 listing
  // over the shadow's kept tokens; with key_mass half the time.
  void attend() {
    std::vector<int64_t> ids;
    for (int n = static_cast<int>(uniform(1, 3)); n > 0; --n) {
      const int64_t id = pick();
      const ShadowSequence& s = sequences.at(id);
      if (s.first_kept() < s.length() && std::find(ids.begin(), ids.end(), id) == ids.end()) {
        ids.push_back(id);
      }
    }
    if (ids.empty()) return;
    const auto batch = static_cast<int64_t>(ids.size());
    const std::vector<float> query = normal(batch * kHeads * kDim);
    std::vector<int32_t> cu(ids.size() + 1);
    for (size_t i = 0; i <= ids.size(); ++i) cu[i] = static_cast<int32_t>(i);
    std::vector<float> output(static_cast<size_t>(batch * kHeads * kDim));
    int64_t width = 0;
    for (int64_t id : ids) {
      width = std::max(width, static_cast<int64_t>(sequences.at(id).labels.size()) * kBlockSize);
    }
    const bool with_mass = uniform(0, 1) == 1;
    std::vector<float> mass(static_cast<size_t>(batch * width), -1.0f);
    const TensorView mass_view(mass.data(), DType::kFloat32, Shape({batch, width}));
    AttentionOptions options;
    options.num_threads = 1;
    cache->attend(
        ids,
        TensorView(const_cast<float*>(query.data()), DType::kFloat32, Shape({batch, kHeads, kDim})),
        TensorView(cu.data(), DType::kInt32, Shape({batch + 1})),
        TensorView(output.data(), DType::kFloat32, Shape({batch, kHeads, kDim})), options, nullptr,
        with_mass ? &mass_view : nullptr);
    // Each row against the float64 listing on the shadow's logical K/V of the kept tokens,
    // within paged_row_tolerance (tests/error_model.hpp) of the row's K/V head: A =
    // scale·||q||·max||k||, max|v| over those tokens. key_mass entry t (Σ_h w_ht, summed in
    // float64 and rounded once to float32) within Σ_h w_ht times each head's relative weight
    // tolerance, plus that rounding and the weights' floor.
    const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t id = ids[static_cast<size_t>(b)];
      const ShadowSequence& s = sequences.at(id);
      const std::vector<float>& keys = s.keys.logical;
      const std::vector<float>& values = s.values.logical;
      const int64_t first = s.first_kept(), length = s.length();
      std::vector<double> expected_mass(static_cast<size_t>(width), 0.0),
          mass_tolerance(static_cast<size_t>(width), kWeightsFloor);
      for (int64_t h = 0; h < kHeads; ++h) {
        const int64_t g = h / (kHeads / kKvHeads);
        const float* q = query.data() + (b * kHeads + h) * kDim;
        std::vector<double> p;
        double top = -INFINITY, q_norm = 0, max_key_norm = 0, max_value = 0;
        for (int64_t e = 0; e < kDim; ++e) q_norm += double{q[e]} * q[e];
        for (int64_t j = first; j < length; ++j) {
          const float* k = keys.data() + (j * kKvHeads + g) * kDim;
          const float* v = values.data() + (j * kKvHeads + g) * kDim;
          double dot = 0, key_norm = 0;
          for (int64_t e = 0; e < kDim; ++e) {
            dot += double{q[e]} * k[e];
            key_norm += double{k[e]} * k[e];
            max_value = std::max(max_value, std::abs(double{v[e]}));
          }
          max_key_norm = std::max(max_key_norm, std::sqrt(key_norm));
          p.push_back(dot * scale);
          top = std::max(top, p.back());
        }
        const PagedRowTolerance tolerance =
            paged_row_tolerance(scale * std::sqrt(q_norm) * max_key_norm, length - first, kDim);
        double sum = 0;
        for (double& x : p) sum += (x = std::exp(x - top));
        for (int64_t e = 0; e < kDim; ++e) {
          double o = 0;
          for (int64_t j = first; j < length; ++j) {
            o += p[static_cast<size_t>(j - first)] / sum *
                 values[static_cast<size_t>((j * kKvHeads + g) * kDim + e)];
          }
          const float got = output[static_cast<size_t>((b * kHeads + h) * kDim + e)];
          if (!(std::abs(got - o) <= tolerance.output(max_value))) {
            char line[240];
            std::snprintf(line, sizeof line,
                          "sequence %lld, head %lld, column %lld: attention %.9g, the listing "
                          "%.9g, tolerance %.3g",
                          static_cast<long long>(id), static_cast<long long>(h),
                          static_cast<long long>(e), got, o, tolerance.output(max_value));
            return problem(line);
          }
        }
        for (int64_t j = first; j < length; ++j) {
          const double w = p[static_cast<size_t>(j - first)] / sum;
          expected_mass[static_cast<size_t>(j)] += w;
          mass_tolerance[static_cast<size_t>(j)] += tolerance.weight_relative() * w;
        }
      }
      if (!with_mass) continue;
      for (int64_t t = 0; t < width; ++t) {
        const float got = mass[static_cast<size_t>(b * width + t)];
        const double want = expected_mass[static_cast<size_t>(t)];
        const double allowed = mass_tolerance[static_cast<size_t>(t)] + kUnitRoundoff * want;
        if (!(std::abs(got - want) <= allowed)) {
          char line[200];
          std::snprintf(line, sizeof line,
                        "sequence %lld: key_mass of token %lld %.9g, the listing %.9g, "
                        "tolerance %.3g",
                        static_cast<long long>(id), static_cast<long long>(t), got, want, allowed);
          return problem(line);
        }
      }
    }
    ++counts[with_mass ? kKeyMass : kAttend];
  }

  void step() {
    if (sequences.empty()) return add();
    int64_t longest = 0;
    for (const auto& [id, s] : sequences) longest = std::max(longest, s.length());
    const int64_t r = uniform(0, 99);
    if (longest > kMaxLength && r < 50) return uniform(0, 1) ? evict() : remove();
    if (r < 10) return add();
    if (r < 45) return append();
    if (r < 55) return fork();
    if (r < 65) return evict();
    if (r < 72) return remove();
    attend();
  }
};

void storm(DType dtype) {
  KvCacheConfig config;
  config.num_blocks = kBlocks;
  config.block_size = kBlockSize;
  config.kv_heads = kKvHeads;
  config.head_dim = kDim;
  config.dtype = dtype;
  PagedKvCache cache(config);
  std::atomic<int64_t> next_label{0};
  std::vector<Worker> workers(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    workers[static_cast<size_t>(t)].cache = &cache;
    workers[static_cast<size_t>(t)].dtype = dtype;
    workers[static_cast<size_t>(t)].random.seed(1234 + 97 * static_cast<uint64_t>(t));
    workers[static_cast<size_t>(t)].next_label = &next_label;
  }
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(storm_seconds());
  std::atomic<bool> stop{false};
  int64_t rounds = 0;
  std::vector<std::string> whole_cache_problems;
  // Between rounds, with every thread stopped: the whole cache against every shadow.
  const auto whole_cache_check = [&]() noexcept {
    ++rounds;
    std::map<int32_t, int64_t> label_of;  // block -> label
    int64_t live = 0;
    for (Worker& w : workers) {
      for (const auto& [label, block] : w.physical) {
        if (!label_of.emplace(block, label).second) {
          whole_cache_problems.push_back("block " + std::to_string(block) + " under two labels");
        }
      }
      live += static_cast<int64_t>(w.references.size());
    }
    if (cache.free_blocks() != kBlocks - live) {
      whole_cache_problems.push_back("free_blocks() " + std::to_string(cache.free_blocks()) +
                                     ", the shadow expects " + std::to_string(kBlocks - live));
    }
    if (std::chrono::steady_clock::now() > deadline) stop = true;
  };
  std::barrier sync(kThreads, whole_cache_check);
  std::vector<std::thread> threads;
  for (Worker& worker : workers) {
    threads.emplace_back([&, w = &worker] {
      while (!stop.load()) {
        for (int n = 0; n < kStepsPerRound; ++n) {
          try {
            w->step();
          } catch (const std::exception& e) {
            w->problem(std::string("unexpected exception: ") + e.what());
          }
        }
        sync.arrive_and_wait();
      }
      // The end: every sequence removed.
      while (!w->sequences.empty()) w->remove();
    });
  }
  for (std::thread& t : threads) t.join();
  int64_t totals[kOps] = {};
  for (const Worker& w : workers) {
    for (const std::string& p : w.problems) ADD_FAILURE() << p;
    for (int op = 0; op < kOps; ++op) totals[op] += w.counts[op];
  }
  for (const std::string& p : whole_cache_problems) ADD_FAILURE() << p;
  EXPECT_EQ(cache.free_blocks(), kBlocks) << "blocks not returned after every sequence's removal";
  std::string summary = std::string(dtype_name(dtype)) + " storm: " + std::to_string(kThreads) +
                        " threads, " + std::to_string(rounds) + " whole-cache checks";
  for (int op = 0; op < kOps; ++op) {
    summary += ", " + std::to_string(totals[op]) + " " + kOpNames[op];
  }
  std::printf("%s\n", summary.c_str());
  EXPECT_GT(totals[kAppend], 0);
  EXPECT_GT(totals[kAttend] + totals[kKeyMass], 0);
}

// Every format the cache can be made with (kv_format.hpp's is_kv_format).
TEST(PagedKvCacheStorm, Float32) { storm(DType::kFloat32); }
TEST(PagedKvCacheStorm, Float16) { storm(DType::kFloat16); }
TEST(PagedKvCacheStorm, BFloat16) { storm(DType::kBFloat16); }
TEST(PagedKvCacheStorm, Int8) { storm(DType::kInt8); }
TEST(PagedKvCacheStorm, Float8E4M3) { storm(DType::kFloat8E4M3); }
TEST(PagedKvCacheStorm, Float8E5M2) { storm(DType::kFloat8E5M2); }

}  // namespace
}  // namespace attend::test
