// A storm over one PagedKvCache (attend/kv_cache.hpp, its public API only) checked against a
// shadow model: several threads append (batches of their sequences, some refused when the
// cache is full), fork, evict outside a window, remove, attend (decode, grouped-query) and
// read key_mass at random for a bounded time, each over its own sequences (the cache refuses
// two threads on one sequence), all sharing the cache's blocks and free list.
//
// The shadow, per thread: each sequence's logical keys and values, its evicted blocks, and an
// abstract label per block (a fork shares its parent's labels; an append into a partly filled
// tail block that another sequence shares gets a fresh label: copy on write) with reference
// counts. After every step the touched sequences must agree with it: length, block table
// (-1 exactly where evicted; one physical block per label and one label per physical block),
// every kept token's key and value read from the cache's storage, and attention (output and
// key_mass) equal to a float64 dense listing over the shadow's kept tokens. Every few steps
// all threads stop and one checks the whole cache: free_blocks() = num_blocks - live labels,
// no physical block under two labels. At the end every sequence is removed and every block
// is free.
//
// ATTEND_STORM_SECONDS (default 1 per dtype) bounds the run: seconds in CI, minutes in the
// soak (scripts/soak.sh). Each call runs on one thread inside (num_threads = 1), so that
// ThreadSanitizer sees every access (scripts/ci-sanitizers.sh runs it under TSan).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attend/error.hpp"
#include "attend/kv_cache.hpp"

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

struct ShadowSequence {
  std::vector<float> keys, values;  // (length, Hkv, E): the values as stored (dtype-rounded)
  std::vector<int64_t> labels;      // per block: its label, -1 evicted
  int64_t length() const { return static_cast<int64_t>(keys.size()) / (kKvHeads * kDim); }
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
  // x as the cache stores it: through its dtype and back.
  std::vector<float> stored(const std::vector<float>& x) const {
    if (dtype == DType::kFloat32) return x;
    const Shape shape({static_cast<int64_t>(x.size())});
    Tensor narrow(dtype, shape), wide(DType::kFloat32, shape);
    convert(TensorView(const_cast<float*>(x.data()), DType::kFloat32, shape), narrow.view());
    convert(narrow.view(), wide.view());
    return std::vector<float>(wide.data_as<float>(), wide.data_as<float>() + x.size());
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
    // Every kept token's key and value, read from storage.
    const int64_t row = kKvHeads * kDim;
    Tensor k(DType::kFloat32, Shape({kKvHeads, kDim})), v(DType::kFloat32, Shape({kKvHeads, kDim}));
    for (int64_t t = s.first_kept(); t < s.length(); ++t) {
      const int64_t block = table[static_cast<size_t>(t / kBlockSize)];
      for (auto [blocks, to] : {std::pair{cache->key_blocks(), &k}, {cache->value_blocks(), &v}}) {
        TensorView at = blocks;
        at.data = static_cast<char*>(at.data) +
                  (block * at.strides[0] + (t % kBlockSize) * at.strides[1]) *
                      static_cast<int64_t>(dtype_size(at.dtype));
        at.shape = Shape({kKvHeads, kDim});
        at.strides = Shape({blocks.strides[2], blocks.strides[3]});
        convert(at, to->view());
      }
      if (!std::equal(k.data_as<float>(), k.data_as<float>() + row, s.keys.data() + t * row) ||
          !std::equal(v.data_as<float>(), v.data_as<float>() + row, s.values.data() + t * row)) {
        return problem(where + "token " + std::to_string(t) + " differs from the shadow");
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
    const std::vector<float> k = stored(keys), v = stored(values);
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
      s.keys.insert(s.keys.end(), k.begin() + cu[i] * row, k.begin() + cu[i + 1] * row);
      s.values.insert(s.values.end(), v.begin() + cu[i] * row, v.begin() + cu[i + 1] * row);
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
    const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
    for (int64_t b = 0; b < batch; ++b) {
      const ShadowSequence& s = sequences.at(ids[static_cast<size_t>(b)]);
      const int64_t first = s.first_kept(), length = s.length();
      std::vector<double> expected_mass(static_cast<size_t>(width), 0.0);
      for (int64_t h = 0; h < kHeads; ++h) {
        const int64_t g = h / (kHeads / kKvHeads);
        const float* q = query.data() + (b * kHeads + h) * kDim;
        std::vector<double> p;
        double top = -INFINITY;
        for (int64_t j = first; j < length; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < kDim; ++e) {
            dot += double{q[e]} * s.keys[static_cast<size_t>((j * kKvHeads + g) * kDim + e)];
          }
          p.push_back(dot * scale);
          top = std::max(top, p.back());
        }
        double sum = 0;
        for (double& x : p) sum += (x = std::exp(x - top));
        for (int64_t e = 0; e < kDim; ++e) {
          double o = 0;
          for (int64_t j = first; j < length; ++j) {
            o += p[static_cast<size_t>(j - first)] / sum *
                 s.values[static_cast<size_t>((j * kKvHeads + g) * kDim + e)];
          }
          const float got = output[static_cast<size_t>((b * kHeads + h) * kDim + e)];
          if (!(std::abs(got - o) <= 1e-4 + 1e-4 * std::abs(o))) {
            return problem("attention differs from the listing: " + std::to_string(got) +
                           " against " + std::to_string(o));
          }
        }
        for (int64_t j = first; j < length; ++j) {
          expected_mass[static_cast<size_t>(j)] += p[static_cast<size_t>(j - first)] / sum;
        }
      }
      if (!with_mass) continue;
      for (int64_t t = 0; t < width; ++t) {
        const float got = mass[static_cast<size_t>(b * width + t)];
        if (!(std::abs(got - expected_mass[static_cast<size_t>(t)]) <= 1e-4)) {
          return problem("key_mass of token " + std::to_string(t) +
                         " differs: " + std::to_string(got) + " against " +
                         std::to_string(expected_mass[static_cast<size_t>(t)]));
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

TEST(PagedKvCacheStorm, Float32) { storm(DType::kFloat32); }
TEST(PagedKvCacheStorm, Float16) { storm(DType::kFloat16); }

}  // namespace
}  // namespace attend::test
