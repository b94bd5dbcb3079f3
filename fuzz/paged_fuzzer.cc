// paged_fuzzer: block tables, sequence lengths and cu_seqlens from arbitrary bytes, against
// storage allocated to the exact size (ASan sees any read past a block, a table or an offset
// array). paged_attention_into (float blocks, and int8 blocks with their scales),
// varlen_attention_into and PagedKvCache (append, attend, fork, eviction) must either run or
// end in an attend::Error with a printable message; anything else (a crash, a sanitizer
// report, another exception, a hang) is a finding.
//
// Input: byte 0 batch B (1 + b % 4), byte 1 block size (1 + b % 8), byte 2 blocks (1 + b % 16),
// byte 3 flags (bit 0 causal, bit 1 window, bit 2 kv_heads 1 instead of 2, bit 3 prefix 1,
// bits 4-6 the cache's format: float32, float16, bfloat16, int8, float8_e4m3, float8_e5m2;
// bit 7 the raw call's blocks in bfloat16 and an infinite scale in the int8 call's block 0),
// then int32 little-endian words, as many as there are: cu_seqlens_q (B + 1), seq_lens (B),
// block tables (B × 4), then cu_seqlens_k (B + 1) for the ragged call. Missing words are 0.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

#include "attend/error.hpp"
#include "attend/kv_cache.hpp"
#include "attend/tensor.hpp"
#include "attend/varlen.hpp"
#include "test_support.hpp"

namespace {

struct Words {
  const uint8_t* data;
  size_t size;
  size_t at = 4;
  int32_t next() {
    int32_t w = 0;
    if (at + 4 <= size) std::memcpy(&w, data + at, 4);
    at += 4;
    return w;
  }
};

// An int32 tensor of exactly `count` words.
attend::Tensor words(Words& in, int64_t count) {
  attend::Tensor t(attend::DType::kInt32, attend::Shape({count}));
  for (int64_t n = 0; n < count; ++n) t.data_as<int32_t>()[n] = in.next();
  return t;
}

void check_message(const attend::Error& e) {
  if (attend::test::first_unprintable_byte(e.what()) != std::string_view::npos) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const int64_t batch = 1 + data[0] % 4, block_size = 1 + data[1] % 8, blocks = 1 + data[2] % 16;
  const uint8_t flags = data[3];
  constexpr int64_t kHeads = 2, kDim = 4, kMaxTable = 4;
  const int64_t kv_heads = (flags & 4) ? 1 : 2;
  Words in{data, size};
  const attend::Tensor cu_q = words(in, batch + 1);
  const attend::Tensor lens = words(in, batch);
  attend::Tensor tables(attend::DType::kInt32, attend::Shape({batch, kMaxTable}));
  for (int64_t n = 0; n < batch * kMaxTable; ++n) tables.data_as<int32_t>()[n] = in.next();
  const attend::Tensor cu_k = words(in, batch + 1);

  attend::AttentionOptions options;
  options.causal = (flags & 1) != 0;
  if (flags & 2) options.window = attend::SlidingWindow{2, 0};
  if (flags & 8) options.prefix = 1;
  options.num_threads = 1;
  // Total queries: the last offset when it is small and non-negative, else a few.
  const int32_t last_q = cu_q.data_as<int32_t>()[batch];
  const int64_t total_q = last_q >= 0 && last_q <= 64 ? last_q : 3;
  const attend::Tensor query =
      attend::Tensor::zeros(attend::DType::kFloat32, attend::Shape({total_q, kHeads, kDim}));
  attend::Tensor output(attend::DType::kFloat32, attend::Shape({total_q, kHeads, kDim}));
  const attend::Tensor key_blocks =
      attend::Tensor::zeros((flags & 128) ? attend::DType::kBFloat16 : attend::DType::kFloat32,
                            attend::Shape({blocks, block_size, kv_heads, kDim}));
  try {
    attend::paged_attention_into(query.view(), cu_q.view(), key_blocks.view(), key_blocks.view(),
                                 tables.view(), lens.view(), output.view(), options);
  } catch (const attend::Error& e) {
    check_message(e);
  }
  // The same tables over caller int8 blocks with their scales (bit 7: a scale that is not
  // finite in block 0).
  const attend::Tensor int8_blocks = attend::Tensor::zeros(
      attend::DType::kInt8, attend::Shape({blocks, block_size, kv_heads, kDim}));
  attend::Tensor scales(attend::DType::kFloat32, attend::Shape({blocks, block_size, kv_heads}));
  for (int64_t n = 0; n < scales.numel(); ++n) scales.data_as<float>()[n] = 0.5f;
  if (flags & 128) scales.data_as<float>()[0] = std::numeric_limits<float>::infinity();
  try {
    const attend::TensorView scale_view = scales.view();
    attend::paged_attention_into(query.view(), cu_q.view(), int8_blocks.view(), int8_blocks.view(),
                                 tables.view(), lens.view(), output.view(), options, nullptr,
                                 nullptr, &scale_view, &scale_view);
  } catch (const attend::Error& e) {
    check_message(e);
  }

  const int32_t last_k = cu_k.data_as<int32_t>()[batch];
  const int64_t total_k = last_k >= 0 && last_k <= 64 ? last_k : 5;
  const attend::Tensor keys =
      attend::Tensor::zeros(attend::DType::kFloat32, attend::Shape({total_k, kv_heads, kDim}));
  try {
    attend::varlen_attention_into(query.view(), keys.view(), keys.view(), cu_q.view(), cu_k.view(),
                                  output.view(), options);
  } catch (const attend::Error& e) {
    check_message(e);
  }

  // The cache: append the ragged keys to B sequences of a cache of `blocks` blocks.
  try {
    attend::KvCacheConfig config;
    config.num_blocks = blocks;
    config.block_size = block_size;
    config.kv_heads = kv_heads;
    config.head_dim = kDim;
    constexpr attend::DType kFormats[] = {attend::DType::kFloat32,    attend::DType::kFloat16,
                                          attend::DType::kBFloat16,   attend::DType::kInt8,
                                          attend::DType::kFloat8E4M3, attend::DType::kFloat8E5M2};
    config.dtype = kFormats[((flags >> 4) & 7) % 6];
    attend::PagedKvCache cache(config);
    std::vector<int64_t> ids;
    for (int64_t s = 0; s < batch; ++s) ids.push_back(cache.add_sequence());
    cache.append(ids, keys.view(), keys.view(), cu_k.view());
    cache.attend(ids, query.view(), cu_q.view(), output.view(), options);
    // A fork of the first sequence takes all the keys again (copy on write of a shared block).
    ids = {cache.fork(ids[0])};
    attend::Tensor all(attend::DType::kInt32, attend::Shape({2}));
    all.data_as<int32_t>()[0] = 0;
    all.data_as<int32_t>()[1] = static_cast<int32_t>(total_k);
    cache.append(ids, keys.view(), keys.view(), all.view());
    cache.evict_outside_window(ids[0], 3);
  } catch (const attend::Error& e) {
    check_message(e);
  }
  return 0;
}
