// Resource limits: a call whose workspace cannot be allocated, and a cache whose storage is
// exhausted or cannot be allocated, raise attend::Error naming the problem ("out of memory",
// "the cache is full") and leave the cache and every output as they were. Allocation
// failure is injected (allocation_fault.hpp: every allocation of at least a threshold fails),
// swept over thresholds from 4 KiB to 64 MiB so that each of a call's allocations fails in
// turn; each threshold either lets the call succeed with the clean call's bits or is refused
// with nothing changed. Skipped under AddressSanitizer and ThreadSanitizer, which own malloc.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "allocation_fault.hpp"
#include "attend/error.hpp"
#include "attend/kv_cache.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "kv_format.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

constexpr float kUntouched = 7.25f;

// The bytes of each view's storage, one after the other (the views cover their storage).
std::vector<char> bytes_of(std::initializer_list<TensorView> views) {
  std::vector<char> all;
  for (const TensorView& v : views) {
    const auto* p = static_cast<const char*>(v.data);
    all.insert(all.end(), p, p + v.numel() * static_cast<int64_t>(dtype_size(v.dtype)));
  }
  return all;
}

Tensor filled(const Shape& shape) {
  Tensor t(DType::kFloat32, shape);
  std::fill_n(t.data_as<float>(), t.numel(), kUntouched);
  return t;
}

// Runs `call` under every threshold; `snapshot` returns the bytes that must not change when
// the call is refused, `reset` restores the outputs before each run. Returns how many
// thresholds refused the call (with "out of memory") and checks each outcome.
int sweep(const std::function<void()>& call, const std::function<std::vector<char>()>& snapshot,
          const std::function<void()>& reset) {
  reset();
  call();
  const std::vector<char> clean = snapshot();
  int refused = 0;
  for (size_t threshold = size_t{1} << 12; threshold <= size_t{1} << 26; threshold <<= 1) {
    SCOPED_TRACE("allocations of " + std::to_string(threshold) + " bytes and more fail");
    reset();
    const std::vector<char> before = snapshot();
    std::string message;
    {
      AllocationFault fault(threshold);
      try {
        call();
      } catch (const Error& e) {
        message = e.what();
      } catch (const std::exception& e) {
        message = std::string("not an attend::Error: ") + e.what();
      }
    }
    if (message.empty()) {
      EXPECT_TRUE(snapshot() == clean) << "succeeded with other results";
      continue;
    }
    ++refused;
    EXPECT_NE(message.find("out of memory"), std::string::npos) << message;
    EXPECT_TRUE(snapshot() == before) << "refused (" << message << ") after changing an output";
  }
  return refused;
}

#define SKIP_WITHOUT_ALLOCATION_FAULTS()                                              \
  if (!kAllocationFaultsAvailable)                                                    \
  GTEST_SKIP() << "skipped: allocation failure cannot be injected under a sanitizer " \
                  "(it owns malloc)"

TEST(ResourceLimits, ForwardWorkspaceThatCannotBeAllocated) {
  SKIP_WITHOUT_ALLOCATION_FAULTS();
  if (active_simd_target() == "SCALAR") {
    GTEST_SKIP() << "skipped on SCALAR: one-lane query tiles need no workspace as large as the "
                    "4 KiB the sweep starts at, so no threshold can refuse the call";
  }
  const Tensor q = random_tensor(Shape({2, 4, 200, 64}), 1);
  const Tensor k = random_tensor(Shape({2, 4, 1200, 64}), 2);
  const Tensor v = random_tensor(Shape({2, 4, 1200, 64}), 3);
  Tensor out, weights, lse;
  AttentionOptions options;
  options.causal = true;
  options.need_weights = true;
  options.num_threads = 2;
  const int refused = sweep(
      [&] {
        scaled_dot_product_attention_into(
            q.view(), k.view(), v.view(),
            AttentionOutputViews{out.view(), weights.view(), lse.view()}, options);
      },
      [&] {
        return bytes_of({out.view(), weights.view(), lse.view()});
      },
      [&] {
        out = filled(Shape({2, 4, 200, 64}));
        weights = filled(Shape({2, 4, 200, 1200}));
        lse = filled(Shape({2, 4, 200}));
      });
  EXPECT_GT(refused, 0) << "no threshold reached the call's workspace";
}

TEST(ResourceLimits, BackwardWorkspaceThatCannotBeAllocated) {
  SKIP_WITHOUT_ALLOCATION_FAULTS();
  const Shape shape({2, 4, 300, 64});
  const Tensor q = random_tensor(shape, 1), k = random_tensor(shape, 2);
  const Tensor v = random_tensor(shape, 3), grad = random_tensor(shape, 4);
  AttentionOptions options;
  options.need_logsumexp = true;
  options.num_threads = 2;
  const AttentionResult forward =
      scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
  Tensor dq, dk, dv;
  const int refused = sweep(
      [&] {
        scaled_dot_product_attention_backward_into(
            grad.view(), q.view(), k.view(), v.view(), forward.output.view(),
            forward.logsumexp.view(),
            AttentionGradientViews{dq.view(), dk.view(), dv.view(), {}, {}}, options);
      },
      [&] {
        return bytes_of({dq.view(), dk.view(), dv.view()});
      },
      [&] {
        dq = filled(shape);
        dk = filled(shape);
        dv = filled(shape);
      });
  EXPECT_GT(refused, 0) << "no threshold reached the call's workspace";
}

// Everything a cache holds that a caller can see.
std::vector<char> cache_state(const PagedKvCache& cache, const std::vector<int64_t>& ids) {
  std::vector<char> all = bytes_of({cache.key_blocks(), cache.value_blocks()});
  if (cache.key_scales().data != nullptr) {  // quantized formats
    const std::vector<char> scales = bytes_of({cache.key_scales(), cache.value_scales()});
    all.insert(all.end(), scales.begin(), scales.end());
  }
  const auto append_number = [&](int64_t n) {
    const auto* p = reinterpret_cast<const char*>(&n);
    all.insert(all.end(), p, p + sizeof n);
  };
  append_number(cache.free_blocks());
  for (int64_t id : ids) {
    append_number(cache.length(id));
    for (int32_t b : cache.block_table(id)) append_number(b);
  }
  return all;
}

class CacheLimits : public ::testing::TestWithParam<DType> {};

// A cache of three sequences of 700 tokens and a fork, attended by chunks of 64 queries under
// every threshold: refused with "out of memory" and the cache as it was. `outputs_kept`: the
// output and key_mass as they were too (PagedAttendLeavesTheOutputsAsTheyWere below).
void attend_under_allocation_failure(DType dtype, bool outputs_kept) {
  KvCacheConfig config;
  config.num_blocks = 200;
  config.block_size = 16;
  config.kv_heads = 2;
  config.head_dim = 64;
  config.dtype = dtype;
  PagedKvCache cache(config);
  std::vector<int64_t> ids;
  for (int s = 0; s < 3; ++s) ids.push_back(cache.add_sequence());
  std::vector<int32_t> cu = {0, 700, 1400, 2100};
  const Tensor k = random_tensor(Shape({2100, 2, 64}), 1),
               v = random_tensor(Shape({2100, 2, 64}), 2);
  cache.append(ids, k.view(), v.view(), TensorView(cu.data(), DType::kInt32, Shape({4})));
  ids.push_back(cache.fork(ids[0]));
  std::vector<int32_t> cu_q = {0, 64, 128, 192, 256};
  const Tensor q = random_tensor(Shape({256, 8, 64}), 3);
  Tensor out, mass;
  const int64_t width = ((700 + 15) / 16) * 16;
  const int refused = sweep(
      [&] {
        const TensorView mass_view = mass.view();
        cache.attend(ids, q.view(), TensorView(cu_q.data(), DType::kInt32, Shape({5})), out.view(),
                     {}, nullptr, &mass_view);
      },
      [&] {
        std::vector<char> all = cache_state(cache, ids);
        if (outputs_kept) {
          const std::vector<char> outputs = bytes_of({out.view(), mass.view()});
          all.insert(all.end(), outputs.begin(), outputs.end());
        }
        return all;
      },
      [&] {
        out = filled(Shape({256, 8, 64}));
        mass = filled(Shape({4, width}));
      });
  EXPECT_GT(refused, 0) << "no threshold reached attend's workspace";
}

TEST_P(CacheLimits, AttendWorkspaceThatCannotBeAllocatedLeavesTheCache) {
  SKIP_WITHOUT_ALLOCATION_FAULTS();
  attend_under_allocation_failure(GetParam(), false);
}

// Paged attention runs every sequence into staging tensors and copies them out at the end.
TEST_P(CacheLimits, PagedAttendLeavesTheOutputsAsTheyWere) {
  SKIP_WITHOUT_ALLOCATION_FAULTS();
  attend_under_allocation_failure(GetParam(), true);
}

// append under every threshold, a copy on write of a shared tail each time: refused with
// "out of memory" and the cache as it was, or done. `rope`: bfloat16 keys rotated (the
// rotated copy is allocated first); without it float32 keys as they are, so that the
// quantized formats' scratch (a block's rows widened, their codes and scales) is the
// allocation each small threshold reaches.
void append_under_allocation_failure(DType dtype, bool with_rope) {
  KvCacheConfig config;
  config.num_blocks = 200;
  config.block_size = 16;
  config.kv_heads = 2;
  config.head_dim = 64;
  config.dtype = dtype;
  PagedKvCache cache(config);
  std::vector<int64_t> ids;
  for (int s = 0; s < 3; ++s) ids.push_back(cache.add_sequence());
  std::vector<int32_t> cu = {0, 700, 1400, 2100};
  const Tensor k = random_tensor(Shape({2100, 2, 64}), 1),
               v = random_tensor(Shape({2100, 2, 64}), 2);
  const TensorView cu_view(cu.data(), DType::kInt32, Shape({4}));
  cache.append(ids, k.view(), v.view(), cu_view);
  // A fork shares blocks: its first append copies the shared tail.
  ids.push_back(cache.fork(ids[0]));

  // Each threshold on a fresh fork, removed after.
  const Tensor k2 =
      random_tensor(Shape({300, 2, 64}), 4, 1.0, with_rope ? DType::kBFloat16 : DType::kFloat32);
  std::vector<int32_t> cu2 = {0, 300};
  RopeOptions rope;
  int refused = 0;
  for (size_t threshold = size_t{1} << 12; threshold <= size_t{1} << 26; threshold <<= 1) {
    const int64_t target = cache.fork(ids[3]);  // shares a partly filled tail: copy on write
    std::vector<int64_t> all_ids = ids;
    all_ids.push_back(target);
    const std::vector<char> before = cache_state(cache, all_ids);
    std::string message;
    {
      AllocationFault fault(threshold);
      try {
        cache.append({target}, k2.view(), k2.view(),
                     TensorView(cu2.data(), DType::kInt32, Shape({2})),
                     with_rope ? &rope : nullptr);
      } catch (const Error& e) {
        message = e.what();
      }
    }
    if (!message.empty()) {
      ++refused;
      EXPECT_NE(message.find("out of memory"), std::string::npos) << message;
      EXPECT_TRUE(cache_state(cache, all_ids) == before)
          << "a refused append changed the cache: " << message;
    } else {
      EXPECT_EQ(cache.length(target), 700 + 300);
    }
    cache.remove_sequence(target);
  }
  // Every format allocates the rotated keys, the quantized formats their scratch: some
  // threshold must reach each.
  if (with_rope || detail::is_scaled_kv_format(dtype)) {
    EXPECT_GT(refused, 0) << "no threshold reached append's workspace";
  }
  EXPECT_EQ(cache.free_blocks(), 200 - 3 * ((700 + 15) / 16)) << "blocks lost to refused appends";
}

TEST_P(CacheLimits, AppendWorkspaceThatCannotBeAllocated) {
  SKIP_WITHOUT_ALLOCATION_FAULTS();
  append_under_allocation_failure(GetParam(), true);
}

// int8 and FP8 caches quantize the new rows through scratch (a block's rows at a time): failing
// it must leave the cache (tables, free list, copy on write, stored codes and scales) as it
// was.
TEST_P(CacheLimits, QuantizingAppendWorkspaceThatCannotBeAllocated) {
  SKIP_WITHOUT_ALLOCATION_FAULTS();
  append_under_allocation_failure(GetParam(), false);
}

TEST_P(CacheLimits, ExhaustedOrUnallocatableStorage) {
  KvCacheConfig config;
  config.num_blocks = 8;
  config.block_size = 4;
  config.kv_heads = 1;
  config.head_dim = 16;
  config.dtype = GetParam();
  PagedKvCache cache(config);
  const int64_t a = cache.add_sequence(), b = cache.fork(a);
  const Tensor k = random_tensor(Shape({30, 1, 16}), 1);
  std::vector<int32_t> cu = {0, 30};
  cache.append({a}, k.view(), k.view(), TensorView(cu.data(), DType::kInt32, Shape({2})));
  const std::vector<char> before = cache_state(cache, {a, b});
  // a: 30 tokens in all 8 blocks of 4; 6 more tokens for a and 6 for b need 3 more blocks.
  std::vector<int32_t> cu_more = {0, 6, 12};
  const Tensor more = random_tensor(Shape({12, 1, 16}), 2);
  std::string message;
  try {
    cache.append({a, b}, more.view(), more.view(),
                 TensorView(cu_more.data(), DType::kInt32, Shape({3})));
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("the cache is full"), std::string::npos) << message;
  EXPECT_TRUE(cache_state(cache, {a, b}) == before) << "a refused append changed the cache";

  // A fork of a shares its 8 blocks, the last partly filled: one token more needs a block for
  // the copy on write, and none is free.
  const int64_t c = cache.fork(a);
  const std::vector<char> before_fork = cache_state(cache, {a, b, c});
  const Tensor one = random_tensor(Shape({1, 1, 16}), 3);
  std::vector<int32_t> cu_one = {0, 1};
  message.clear();
  try {
    cache.append({c}, one.view(), one.view(), TensorView(cu_one.data(), DType::kInt32, Shape({2})));
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("the cache is full"), std::string::npos) << message;
  EXPECT_TRUE(cache_state(cache, {a, b, c}) == before_fork)
      << "a refused copy on write changed the cache";

  // Storage that cannot be allocated: a clear error, no cache.
  KvCacheConfig huge = config;
  huge.num_blocks = (int64_t{1} << 31) - 1;
  huge.block_size = int64_t{1} << 16;
  try {
    PagedKvCache impossible(huge);
    ADD_FAILURE() << "a cache of 2^47 tokens was allocated";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(m.find("out of memory") != std::string::npos ||
                m.find("too large") != std::string::npos || m.find("overflow") != std::string::npos)
        << m;
  }
  if (kAllocationFaultsAvailable) {
    AllocationFault fault(256);  // the smallest storage here: int8 keys, 512 bytes
    EXPECT_THROW(PagedKvCache{config}, Error);
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, CacheLimits,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                                           DType::kInt8, DType::kFloat8E4M3, DType::kFloat8E5M2),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

}  // namespace
}  // namespace attend::test
