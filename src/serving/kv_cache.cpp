// kv_cache.cpp: the paged KV cache's block bookkeeping (attend/kv_cache.hpp): storage kept
// head-major per block, a free list, sequences' block tables with reference counts (fork
// shares blocks; a shared tail block is copied before it is written), appends that quantize
// into the cache's format (kv_format.hpp), eviction outside a window. Attention over the
// blocks is paged_attention.cpp's.
#include "attend/kv_cache.hpp"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "attend/error.hpp"
#include "attend/rope.hpp"
#include "kv_format.hpp"
#include "sdpa_boundary.hpp"
#include "serving/paged_attention.hpp"
#include "serving/ragged.hpp"

namespace attend {

namespace {

// (num_blocks, block_size, Hkv[, dim]) view of storage kept as (num_blocks, Hkv, block_size[,
// dim]).
TensorView block_major_view(const Tensor& storage) {
  const Shape& s = storage.shape();
  auto* data = const_cast<void*>(storage.data());
  if (s.rank() == 3) {
    return TensorView(data, storage.dtype(), Shape({s[0], s[2], s[1]}),
                      Shape({s[1] * s[2], 1, s[2]}));
  }
  return TensorView(data, storage.dtype(), Shape({s[0], s[2], s[1], s[3]}),
                    Shape({s[1] * s[2] * s[3], s[3], s[2] * s[3], 1}));
}

// Rows [row, row + count) of block b of a (num_blocks, block_size, Hkv[, dim]) view:
// (count, Hkv[, dim]).
TensorView rows_of(const TensorView& blocks, int64_t b, int64_t row, int64_t count) {
  TensorView v = blocks;
  v.data = static_cast<char*>(blocks.data) + (b * blocks.strides[0] + row * blocks.strides[1]) *
                                                 static_cast<int64_t>(dtype_size(blocks.dtype));
  v.shape = Shape::from(blocks.shape.data() + 1, blocks.rank() - 1);
  v.shape[0] = count;
  v.strides = Shape::from(blocks.strides.data() + 1, blocks.rank() - 1);
  return v;
}

}  // namespace

TensorView PagedKvCache::key_blocks() const { return block_major_view(keys_); }
TensorView PagedKvCache::value_blocks() const { return block_major_view(values_); }
TensorView PagedKvCache::key_scales() const {
  return key_scales_.empty() ? TensorView() : block_major_view(key_scales_);
}
TensorView PagedKvCache::value_scales() const {
  return value_scales_.empty() ? TensorView() : block_major_view(value_scales_);
}

PagedKvCache::PagedKvCache(const KvCacheConfig& config) : config_(config) {
  if (config_.value_dim == 0) config_.value_dim = config_.head_dim;
  if (config_.num_blocks < 1 || config_.num_blocks > INT32_MAX || config_.block_size < 1 ||
      config_.kv_heads < 1 || config_.head_dim < 1 || config_.value_dim < 1) {
    throw Error(
        "KvCacheConfig: num_blocks (up to 2^31 - 1), block_size, kv_heads, head_dim and "
        "value_dim must be >= 1");
  }
  if (!detail::is_kv_format(config_.dtype)) {
    throw Error(std::string("KvCacheConfig: dtype ") + dtype_name(config_.dtype) +
                " is not supported (float32, float16, bfloat16, int8, float8_e4m3 or "
                "float8_e5m2)");
  }
  // Storage (num_blocks, Hkv, block_size, dim): see key_blocks().
  keys_ = Tensor::zeros(config_.dtype, Shape({config_.num_blocks, config_.kv_heads,
                                              config_.block_size, config_.head_dim}));
  values_ = Tensor::zeros(config_.dtype, Shape({config_.num_blocks, config_.kv_heads,
                                                config_.block_size, config_.value_dim}));
  if (detail::is_scaled_kv_format(config_.dtype)) {
    const Shape scales({config_.num_blocks, config_.kv_heads, config_.block_size});
    key_scales_ = Tensor::zeros(DType::kFloat32, scales);
    value_scales_ = Tensor::zeros(DType::kFloat32, scales);
  }
  for (int64_t b = config_.num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
  sharers_.assign(static_cast<size_t>(config_.num_blocks), 0);
}

int64_t PagedKvCache::free_blocks() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(free_.size());
}

PagedKvCache::Sequence& PagedKvCache::find(int64_t id) {
  const auto it = sequences_.find(id);
  if (it == sequences_.end()) throw Error("PagedKvCache: no sequence " + std::to_string(id));
  return it->second;
}

const PagedKvCache::Sequence& PagedKvCache::find(int64_t id) const {
  const auto it = sequences_.find(id);
  if (it == sequences_.end()) throw Error("PagedKvCache: no sequence " + std::to_string(id));
  return it->second;
}

int32_t PagedKvCache::take_block() {
  const int32_t b = free_.back();
  free_.pop_back();
  sharers_[static_cast<size_t>(b)] = 1;
  return b;
}

void PagedKvCache::release_block(int32_t block) {
  if (--sharers_[static_cast<size_t>(block)] == 0) free_.push_back(block);
}

int64_t PagedKvCache::fork(int64_t id) {
  const std::lock_guard<std::mutex> lock(mutex_);
  const Sequence& source = find(id);
  if (source.writing) {
    throw Error("PagedKvCache::fork: sequence " + std::to_string(id) +
                " is being appended to by another thread");
  }
  Sequence copy;
  copy.length = source.length;
  copy.blocks = source.blocks;
  for (int32_t b : copy.blocks) {
    if (b >= 0) ++sharers_[static_cast<size_t>(b)];
  }
  sequences_.emplace(next_id_, std::move(copy));
  return next_id_++;
}

int64_t PagedKvCache::add_sequence() {
  const std::lock_guard<std::mutex> lock(mutex_);
  sequences_.emplace(next_id_, Sequence{});
  return next_id_++;
}

void PagedKvCache::remove_sequence(int64_t id) {
  const std::lock_guard<std::mutex> lock(mutex_);
  Sequence& seq = find(id);
  if (seq.readers > 0 || seq.writing) {
    throw Error("PagedKvCache: sequence " + std::to_string(id) + " is in use by another thread");
  }
  for (int32_t b : seq.blocks) {
    if (b >= 0) release_block(b);
  }
  std::sort(free_.begin(), free_.end(), std::greater<>());
  sequences_.erase(id);
}

int64_t PagedKvCache::length(int64_t id) const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return find(id).length;
}

std::vector<int32_t> PagedKvCache::block_table(int64_t id) const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return find(id).blocks;
}

bool PagedKvCache::shared_tail(const Sequence& seq, int64_t count) const {
  if (count == 0 || seq.length % config_.block_size == 0 || seq.blocks.empty()) return false;
  const int32_t tail = seq.blocks.back();
  return tail >= 0 && sharers_[static_cast<size_t>(tail)] > 1;
}

void PagedKvCache::copy_tail_block(Sequence& seq) {
  // Copy on write: the filled rows of the shared last block into a block of its own.
  const int32_t from = seq.blocks.back(), to = take_block();
  const int64_t rows = seq.length % config_.block_size;
  for (const TensorView& v : {key_blocks(), value_blocks(), key_scales(), value_scales()}) {
    if (v.data == nullptr) continue;  // no scales
    convert(rows_of(v, from, 0, rows), rows_of(v, to, 0, rows));
  }
  release_block(from);
  seq.blocks.back() = to;
}

void PagedKvCache::append(const std::vector<int64_t>& ids, const TensorView& key,
                          const TensorView& value, const TensorView& cu_seqlens,
                          const RopeOptions* rope) {
  const KvCacheConfig& c = config_;
  for (auto [name, t, dim] :
       {std::tuple{"key", &key, c.head_dim}, std::tuple{"value", &value, c.value_dim}}) {
    detail::check_view(name, *t);
    if (t->rank() != 3 || t->shape[1] != c.kv_heads || t->shape[2] != dim ||
        !is_floating(t->dtype)) {
      throw Error("PagedKvCache::append: " + detail::describe(name, *t) +
                  " should be floating (new tokens, " + std::to_string(c.kv_heads) + ", " +
                  std::to_string(dim) + ")");
    }
  }
  if (key.shape[0] != value.shape[0]) {
    throw Error("PagedKvCache::append: key and value hold different token counts");
  }
  const std::vector<int64_t> offsets = detail::read_offsets("cu_seqlens", cu_seqlens, key.shape[0]);
  if (offsets.size() != ids.size() + 1) {
    throw Error("PagedKvCache::append: cu_seqlens has " + std::to_string(offsets.size()) +
                " offsets for " + std::to_string(ids.size()) + " sequences (should be B + 1)");
  }
  struct Write {
    Sequence* seq;
    int64_t first_token, count, source;
  };
  // Quantized formats: scratch for the rows of one block at a time (at most block_size
  // tokens, and no more than the call's): the rows widened to float32, their codes and
  // scales. Allocated before anything changes, so that a scratch that cannot be allocated
  // refuses the call ("out of memory") with the cache as it was; writing the rows then
  // allocates nothing.
  Tensor widened, codes, row_scales;
  if (detail::is_scaled_kv_format(c.dtype)) {
    const int64_t rows = std::min(c.block_size, key.shape[0]);
    const Shape shape({rows, c.kv_heads, std::max(c.head_dim, c.value_dim)});
    widened = Tensor(DType::kFloat32, shape);
    codes = Tensor(c.dtype, shape);
    row_scales = Tensor(DType::kFloat32, Shape({rows, c.kv_heads}));
  }
  std::vector<Write> writes;
  Tensor rotated;  // with rope: the keys as written
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    int64_t needed = 0;
    for (size_t s = 0; s < ids.size(); ++s) {
      Sequence& seq = find(ids[s]);
      if (seq.readers > 0 || seq.writing) {
        throw Error("PagedKvCache::append: sequence " + std::to_string(ids[s]) +
                    " is in use by another thread");
      }
      for (size_t r = 0; r < s; ++r) {
        if (ids[r] == ids[s]) {
          throw Error("PagedKvCache::append: sequence " + std::to_string(ids[s]) +
                      " is listed twice");
        }
      }
      const int64_t count = offsets[s + 1] - offsets[s];
      if (seq.length + count > INT32_MAX) {
        throw Error("PagedKvCache::append: sequence " + std::to_string(ids[s]) +
                    " would pass 2^31 - 1 tokens");
      }
      const int64_t blocks = (seq.length + count + c.block_size - 1) / c.block_size;
      needed += std::max<int64_t>(blocks - static_cast<int64_t>(seq.blocks.size()), 0);
      needed += shared_tail(seq, count) ? 1 : 0;  // copied before writing into it
      writes.push_back({&seq, seq.length, count, offsets[s]});
    }
    if (needed > static_cast<int64_t>(free_.size())) {
      throw Error("PagedKvCache::append: the cache is full: the new tokens need " +
                  std::to_string(needed) + " blocks, " + std::to_string(free_.size()) +
                  " are free");
    }
    if (rope) {  // rotated keys at their positions, before anything changes
      Tensor positions(DType::kInt64, Shape({key.shape[0]}));
      for (const Write& w : writes) {
        for (int64_t t = 0; t < w.count; ++t) {
          positions.data_as<int64_t>()[w.source + t] = w.first_token + t;
        }
      }
      rotated = Tensor(DType::kFloat32, key.shape);
      convert(key, rotated.view());
      apply_rope_at(rotated.view(), positions.view(), *rope);
    }
    for (const Write& w : writes) {
      if (shared_tail(*w.seq, w.count)) copy_tail_block(*w.seq);
      const int64_t blocks = (w.first_token + w.count + c.block_size - 1) / c.block_size;
      while (static_cast<int64_t>(w.seq->blocks.size()) < blocks)
        w.seq->blocks.push_back(take_block());
      w.seq->writing = true;
    }
  }
  // The sequences are marked: their blocks are this thread's until the flags are cleared.
  // Rows of the new tokens into their blocks (views: key_blocks()), quantized with their
  // scales for the scaled formats.
  const auto write_rows = [&](const TensorView& source, const TensorView& blocks,
                              const TensorView& scales) {
    for (const Write& w : writes) {
      for (int64_t t = 0; t < w.count;) {
        const int64_t position = w.first_token + t;
        const int64_t row = position % c.block_size;
        const int64_t rows = std::min(c.block_size - row, w.count - t);
        const int32_t b = w.seq->blocks[static_cast<size_t>(position / c.block_size)];
        TensorView from = source;
        from.data =
            static_cast<char*>(source.data) +
            (w.source + t) * source.strides[0] * static_cast<int64_t>(dtype_size(source.dtype));
        from.shape[0] = rows;
        const TensorView to = rows_of(blocks, b, row, rows);
        if (detail::is_scaled_kv_format(c.dtype)) {
          // Codes and scales of (rows, Hkv) rows, contiguous in the scratch, then into their
          // places.
          const int64_t dim = from.shape[2];
          const TensorView x(widened.data(), DType::kFloat32, from.shape);
          const TensorView q(codes.data(), c.dtype, from.shape);
          const TensorView s(row_scales.data(), DType::kFloat32, Shape({rows, c.kv_heads}));
          convert(from, x);
          detail::quantize_kv_rows(c.dtype, x.data_as<float>(), rows * c.kv_heads, dim, q.data,
                                   s.data_as<float>());
          convert(q, to);  // same dtype: a copy of the codes
          convert(s, rows_of(scales, b, row, rows));
        } else {
          convert(from, to);
        }
        t += rows;
      }
    }
  };
  try {
    write_rows(rope ? rotated.view() : key, key_blocks(), key_scales());
    write_rows(value, value_blocks(), value_scales());
  } catch (...) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (const Write& w : writes) w.seq->writing = false;
    throw;
  }
  const std::lock_guard<std::mutex> lock(mutex_);
  for (const Write& w : writes) {
    w.seq->length += w.count;
    w.seq->writing = false;
  }
}

void PagedKvCache::evict_outside_window(int64_t id, int64_t window) {
  if (window < 0) throw Error("evict_outside_window: window must be >= 0");
  const std::lock_guard<std::mutex> lock(mutex_);
  Sequence& seq = find(id);
  if (seq.readers > 0 || seq.writing) {
    throw Error("PagedKvCache: sequence " + std::to_string(id) + " is in use by another thread");
  }
  const int64_t keep_from = seq.length - window;  // tokens j < keep_from are never seen again
  for (size_t n = 0; n < seq.blocks.size(); ++n) {
    if (static_cast<int64_t>(n + 1) * config_.block_size > keep_from) break;
    if (seq.blocks[n] >= 0) {
      release_block(seq.blocks[n]);
      seq.blocks[n] = -1;
    }
  }
  std::sort(free_.begin(), free_.end(), std::greater<>());
}

void PagedKvCache::attend(const std::vector<int64_t>& ids, const TensorView& query,
                          const TensorView& cu_seqlens_q, const TensorView& output,
                          const AttentionOptions& options, const TensorView* logsumexp,
                          const TensorView* key_mass) const {
  const auto batch = static_cast<int64_t>(ids.size());
  std::vector<const Sequence*> readers;
  Tensor tables, lengths(DType::kInt32, Shape({batch}));
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    int64_t widest = 1;
    for (int64_t id : ids) {
      const Sequence& seq = find(id);
      if (seq.writing) {
        throw Error("PagedKvCache::attend: sequence " + std::to_string(id) +
                    " is being appended to by another thread");
      }
      widest = std::max<int64_t>(widest, static_cast<int64_t>(seq.blocks.size()));
    }
    tables = Tensor(DType::kInt32, Shape({batch, widest}));
    std::fill_n(tables.data_as<int32_t>(), tables.numel(), -1);
    for (int64_t s = 0; s < batch; ++s) {
      const Sequence& seq = find(ids[static_cast<size_t>(s)]);
      std::copy(seq.blocks.begin(), seq.blocks.end(), tables.data_as<int32_t>() + s * widest);
      lengths.data_as<int32_t>()[s] = static_cast<int32_t>(seq.length);
      ++seq.readers;
      readers.push_back(&seq);
    }
  }
  struct Release {
    std::mutex& mutex;
    std::vector<const Sequence*>& readers;
    ~Release() {
      const std::lock_guard<std::mutex> lock(mutex);
      for (const Sequence* seq : readers) --seq->readers;
    }
  } release{mutex_, readers};
  const TensorView key_scale_view = key_scales(), value_scale_view = value_scales();
  detail::paged_attention(query, cu_seqlens_q, key_blocks(), value_blocks(), tables.view(),
                          lengths.view(), output, options, logsumexp, key_mass, true,
                          key_scales_.empty() ? nullptr : &key_scale_view,
                          value_scales_.empty() ? nullptr : &value_scale_view);
}

}  // namespace attend
