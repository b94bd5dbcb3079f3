// paged_attention.cpp: attention over K/V blocks listed by block tables (paged_attention_into,
// attend/kv_cache.hpp; PagedKvCache::attend). Every block table is checked against the
// storage before a block is read. The decoding sequences (up to kMaxDecodeQueries queries)
// then run together as one work list over all threads, their blocks read in place through
// the tables (run_over_stored_keys_batch: the key split's units of every sequence, largest
// first, merged per row in a fixed order), each sequence with the bits of its own dense
// call; prefill chunks run a sequence at a time on a contiguous gathered copy.
#include "serving/paged_attention.hpp"

#include "attend/kv_cache.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attend/error.hpp"
#include "attend/rope.hpp"
#include "attend/varlen.hpp"
#include "grouped_query.hpp"
#include "kernels/kernel_list.hpp"
#include "kv_format.hpp"
#include "sdpa_boundary.hpp"
#include "serving/ragged.hpp"

namespace attend {
namespace {

using detail::RaggedSequence;

// Queries per sequence up to which paged attention reads the blocks in place (decoding,
// speculative verification); longer chunks (prefill) run on a gathered copy.
constexpr int64_t kMaxDecodeQueries = 16;

// One sequence's keys in the blocks: kept blocks first_block.. of its table row.
struct CachedKeys {
  const int32_t* table = nullptr;  // row s of block_tables
  int64_t first_block = 0;         // first kept (not evicted) entry
  int64_t blocks = 0;              // entries in use: ceil(len / block_size)
  int64_t start = 0;               // first kept token
};

int32_t table_entry(const TensorView& tables, int64_t s, int64_t n) {
  return tables.data_as<const int32_t>()[s * tables.strides[0] + n * tables.strides[1]];
}

// Blocks (num_blocks, block_size, Hkv, dim) in a K/V format (kv_format.hpp), with scales
// (num_blocks, block_size, Hkv) float32 exactly when the format is a scaled one.
void check_blocks(const char* name, const TensorView& blocks, const char* scales_name,
                  const TensorView* scales) {
  detail::check_view(name, blocks);
  if (blocks.rank() != 4) {
    throw Error(detail::describe(name, blocks) +
                ": expected (num_blocks, block_size, kv_heads, dim)");
  }
  if (!detail::is_kv_format(blocks.dtype)) {
    throw Error(std::string(name) + ": dtype " + dtype_name(blocks.dtype) +
                " is not supported (float32, float16, bfloat16, int8, float8_e4m3 or "
                "float8_e5m2)");
  }
  const bool scaled = detail::is_scaled_kv_format(blocks.dtype);
  if (scaled != (scales != nullptr)) {
    throw Error(std::string(name) + " of dtype " + dtype_name(blocks.dtype) +
                (scaled ? " needs " : " takes no ") + scales_name +
                " (int8 and float8 blocks have one float32 scale per token and head)");
  }
  if (!scales) return;
  detail::check_view(scales_name, *scales);
  const Shape expected({blocks.shape[0], blocks.shape[1], blocks.shape[2]});
  if (scales->dtype != DType::kFloat32 || scales->shape != expected) {
    throw Error(detail::describe(scales_name, *scales) + " " + dtype_name(scales->dtype) +
                " should be float32 " + expected.str() + " (num_blocks, block_size, kv_heads)");
  }
}

// Every scale of the tokens a sequence reads (kept blocks, Hkv heads) is finite.
void check_scales_finite(const char* name, const TensorView& scales, const CachedKeys& keys,
                         int64_t length, const std::string& which) {
  const Shape& st = scales.strides;
  const int64_t bs = scales.shape[1], heads = scales.shape[2];
  for (int64_t t = keys.start; t < length; ++t) {
    const int64_t block = keys.table[t / bs];
    for (int64_t h = 0; h < heads; ++h) {
      const float x = scales.data_as<const float>()[block * st[0] + (t % bs) * st[1] + h * st[2]];
      if (!std::isfinite(x)) {
        throw Error(which + ": " + name + " of token " + std::to_string(t) + ", head " +
                    std::to_string(h) + " (block " + std::to_string(block) + ") is not finite");
      }
    }
  }
}

// Tokens [start, start + length) of a sequence as a contiguous (Hkv, length, D) copy of
// `dtype`, gathered from its kept blocks (the scaled formats dequantized: scale · code).
TensorView gathered_keys(const TensorView& blocks, const TensorView* scales, const CachedKeys& keys,
                         int64_t length, DType dtype, std::optional<Tensor>& copy) {
  const int64_t bs = blocks.shape[1], heads = blocks.shape[2], dim = blocks.shape[3];
  const Shape& st = blocks.strides;
  const auto element = static_cast<int64_t>(dtype_size(blocks.dtype));
  const DType gathered = scales ? DType::kFloat32 : dtype;
  Tensor rows(gathered, Shape({length, heads, dim}));
  for (int64_t t = 0; t < length; t += bs) {
    const int64_t block = keys.table[keys.first_block + t / bs];
    const int64_t count = std::min(bs, length - t);
    const TensorView source(static_cast<char*>(blocks.data) + block * st[0] * element, blocks.dtype,
                            Shape({count, heads, dim}), Shape({st[1], st[2], st[3]}));
    const TensorView dest(
        rows.data_as<char>() + t * heads * dim * static_cast<int64_t>(dtype_size(gathered)),
        gathered, Shape({count, heads, dim}));
    if (!scales) {
      convert(source, dest);
      continue;
    }
    float* out = dest.data_as<float>();
    for (int64_t r = 0; r < count; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const float scale =
            scales->data_as<const float>()[block * scales->strides[0] + r * scales->strides[1] +
                                           h * scales->strides[2]];
        const char* code =
            static_cast<const char*>(source.data) + (r * st[1] + h * st[2]) * element;
        for (int64_t e = 0; e < dim; ++e) {
          *out++ = scale * detail::widen_kv(blocks.dtype, code, e * st[3]);
        }
      }
    }
  }
  if (gathered != dtype) {
    copy.emplace(dtype, rows.shape());
    convert(rows.view(), copy->view());
  } else {
    copy.emplace(std::move(rows));
  }
  return TensorView(copy->data(), dtype, Shape({heads, length, dim}), Shape({dim, heads * dim, 1}));
}

// key_mass row `row` (stride `step`): at position start + j, Σ over heads and queries of
// key j's weight, from the dense call's weights (H, Lq, Lk) summed in float64, in order.
void write_key_mass(const TensorView& query, const TensorView& k, const TensorView& v,
                    const AttentionOptions& options, int threads, float* row, int64_t step,
                    int64_t start) {
  AttentionOptions o = options;
  o.need_weights = true;
  o.need_logsumexp = false;
  o.num_threads = threads;
  const AttentionResult r = scaled_dot_product_attention(query, k, v, o);
  const int64_t lk = k.shape[1], rows = r.weights.numel() / lk;
  std::vector<double> sums(static_cast<size_t>(lk), 0.0);
  const float* w = r.weights.data_as<float>();
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t j = 0; j < lk; ++j) sums[static_cast<size_t>(j)] += w[n * lk + j];
  }
  for (int64_t j = 0; j < lk; ++j) {
    row[(start + j) * step] = static_cast<float>(sums[static_cast<size_t>(j)]);
  }
}

}  // namespace

namespace detail {

void paged_attention(const TensorView& query, const TensorView& cu_seqlens_q,
                     const TensorView& key_blocks, const TensorView& value_blocks,
                     const TensorView& block_tables, const TensorView& seq_lens,
                     const TensorView& output, const AttentionOptions& options,
                     const TensorView* logsumexp, const TensorView* key_mass, bool shared_blocks,
                     const TensorView* key_scales, const TensorView* value_scales) {
  const int threads = detail::threads_of(options);
  detail::check_view("query", query);
  if (query.rank() != 3) {
    throw Error(detail::describe("query", query) + ": expected (total tokens, heads, dim)");
  }
  check_blocks("key_blocks", key_blocks, "key_scales", key_scales);
  check_blocks("value_blocks", value_blocks, "value_scales", value_scales);
  for (int d = 0; d < 3; ++d) {
    if (key_blocks.shape[d] != value_blocks.shape[d]) {
      throw Error(detail::describe("key_blocks", key_blocks) + " and " +
                  detail::describe("value_blocks", value_blocks) + " differ in dimension " +
                  std::to_string(d));
    }
  }
  if (key_blocks.shape[1] < 1) throw Error("key_blocks: block_size must be >= 1");
  if (options.mask || options.bias || options.segment_ids_query || options.segment_ids_key ||
      options.dropout != 0.0 || options.need_weights) {
    throw Error(
        "paged attention: mask, bias, segment ids, dropout and need_weights are not "
        "supported");
  }
  const std::vector<int64_t> q_offsets =
      detail::read_offsets("cu_seqlens_q", cu_seqlens_q, query.shape[0]);
  const auto batch = static_cast<int64_t>(q_offsets.size()) - 1;
  detail::check_view("block_tables", block_tables);
  detail::check_view("seq_lens", seq_lens);
  if (block_tables.dtype != DType::kInt32 || block_tables.rank() != 2 ||
      block_tables.shape[0] != batch) {
    throw Error(detail::describe("block_tables", block_tables) + " " +
                dtype_name(block_tables.dtype) + " should be int32 (B = " + std::to_string(batch) +
                ", max_blocks)");
  }
  if (seq_lens.dtype != DType::kInt32 || seq_lens.rank() != 1 || seq_lens.shape[0] != batch) {
    throw Error(detail::describe("seq_lens", seq_lens) + " " + dtype_name(seq_lens.dtype) +
                " should be int32 (B = " + std::to_string(batch) + ")");
  }
  const int64_t num_blocks = key_blocks.shape[0], bs = key_blocks.shape[1];
  std::vector<uint8_t> used(static_cast<size_t>(num_blocks), 0);
  std::vector<RaggedSequence> sequences;
  std::vector<CachedKeys> cached;
  for (int64_t s = 0; s < batch; ++s) {
    const std::string which = "sequence " + std::to_string(s);
    const int64_t len = seq_lens.data_as<const int32_t>()[s * seq_lens.strides[0]];
    const int64_t lq = q_offsets[static_cast<size_t>(s) + 1] - q_offsets[static_cast<size_t>(s)];
    if (len < 0) throw Error(which + ": seq_lens " + std::to_string(len) + " is negative");
    CachedKeys keys;
    keys.table = block_tables.data_as<const int32_t>() + s * block_tables.strides[0];
    keys.blocks = (len + bs - 1) / bs;
    if (keys.blocks > block_tables.shape[1]) {
      throw Error(which + ": length " + std::to_string(len) + " needs " +
                  std::to_string(keys.blocks) + " blocks of " + std::to_string(bs) +
                  " but the block table has " + std::to_string(block_tables.shape[1]));
    }
    if (block_tables.strides[1] != 1 && keys.blocks > 1) {
      throw Error("block_tables: the last dimension must be contiguous");
    }
    while (keys.first_block < keys.blocks && table_entry(block_tables, s, keys.first_block) == -1) {
      ++keys.first_block;
    }
    for (int64_t n = keys.first_block; n < keys.blocks; ++n) {
      const int32_t b = table_entry(block_tables, s, n);
      if (b < 0 || b >= num_blocks) {
        throw Error(which + ": block table entry " + std::to_string(n) + " is " +
                    std::to_string(b) + ", outside [0, " + std::to_string(num_blocks) + ")" +
                    (b == -1 ? " (only leading entries may be evicted)" : ""));
      }
      if (used[static_cast<size_t>(b)] && !shared_blocks) {
        throw Error(which + ": block " + std::to_string(b) +
                    " is listed twice in the batch's block tables");
      }
      used[static_cast<size_t>(b)] = 1;
    }
    keys.start = std::min(len, keys.first_block * bs);
    const int64_t kept = len - keys.start;
    if (!shared_blocks) {  // the caller's scales (a PagedKvCache's own are finite)
      if (key_scales) check_scales_finite("key_scales", *key_scales, keys, len, which);
      if (value_scales) check_scales_finite("value_scales", *value_scales, keys, len, which);
    }
    if (lq > 0 && kept == 0) {
      throw Error(which + " has " + std::to_string(lq) +
                  " queries but no cached keys (softmax over no keys is undefined)");
    }
    if (keys.start > 0 &&
        (options.prefix > 0 ||
         (options.causal && options.causal_alignment == CausalAlignment::kTopLeft))) {
      throw Error(which +
                  ": evicted blocks shift the positions that prefix and top-left "
                  "causal alignment count from");
    }
    if (lq > 0) {
      // The dense call's own checks, on stand-in views of the sequence's shapes.
      const TensorView k(key_blocks.data, query.dtype,
                         Shape({key_blocks.shape[2], kept, key_blocks.shape[3]}));
      const TensorView v(value_blocks.data, query.dtype,
                         Shape({value_blocks.shape[2], kept, value_blocks.shape[3]}));
      try {
        (void)detail::validate_inputs(
            detail::sequence_view(query, q_offsets[static_cast<size_t>(s)], lq), k, v, options);
      } catch (const Error& error) {
        throw Error(which + ": " + error.what());
      }
    }
    sequences.push_back({q_offsets[static_cast<size_t>(s)], lq, 0, kept});
    cached.push_back(keys);
  }
  std::vector<const TensorView*> inputs = {&query,        &cu_seqlens_q, &key_blocks,
                                           &value_blocks, &block_tables, &seq_lens};
  for (const TensorView* scales : {key_scales, value_scales}) {
    if (scales) inputs.push_back(scales);
  }
  detail::check_packed_output("output", output,
                              Shape({query.shape[0], query.shape[1], value_blocks.shape[3]}),
                              query.dtype, inputs);
  if (logsumexp) {
    detail::check_packed_output("logsumexp", *logsumexp, Shape({query.shape[0], query.shape[1]}),
                                DType::kFloat32, inputs);
    if (detail::overlaps(*logsumexp, output))
      throw Error("logsumexp overlaps the memory of output");
  }
  if (key_mass) {
    detail::check_view("key_mass", *key_mass);
    const Shape expected({batch, block_tables.shape[1] * bs});
    if (key_mass->shape != expected || key_mass->dtype != DType::kFloat32) {
      throw Error(detail::describe("key_mass", *key_mass) + " " + dtype_name(key_mass->dtype) +
                  " should be float32 " + expected.str() + " (B, max_blocks · block_size)");
    }
    for (int d = 0; d < 2; ++d) {
      if (key_mass->strides[d] == 0 && key_mass->shape[d] > 1) {
        throw Error("key_mass: zero stride in dimension " + std::to_string(d));
      }
    }
    for (const TensorView* t : inputs) {
      if (detail::overlaps(*key_mass, *t)) {
        throw Error("key_mass overlaps the memory of another argument");
      }
    }
    if (detail::overlaps(*key_mass, output)) {
      throw Error("key_mass overlaps the memory of another argument");
    }
    if (logsumexp && detail::overlaps(*key_mass, *logsumexp)) {
      throw Error("key_mass overlaps the memory of logsumexp");
    }
  }

  // The results go to staging tensors first, copied into the caller's views once every
  // sequence has run: a sequence that fails (a workspace that cannot be allocated) leaves
  // output, logsumexp and key_mass as they were. Staging costs a copy of the outputs, small
  // beside the keys and values a call reads.
  Tensor staged_output(output.dtype, output.shape);
  std::optional<Tensor> staged_lse, staged_mass;
  if (logsumexp) staged_lse.emplace(DType::kFloat32, logsumexp->shape);
  if (key_mass) staged_mass.emplace(Tensor::zeros(DType::kFloat32, key_mass->shape));
  const TensorView out_view = staged_output.view();

  AttentionOptions per_sequence = options;
  per_sequence.need_logsumexp = false;
  // Decoding shapes (up to kMaxDecodeQueries queries) read the blocks in place through the
  // block table (the row groups; sdpa_boundary.hpp's StoredKeys); longer chunks of queries
  // (prefill) and bfloat16 products gather each sequence's keys into a contiguous copy for
  // the query tiles.
  // kBFloat16 reads them in place where the grouped-query tiles take the sequence's shape on
  // bfloat16 products (stored_kv_bf16_products), and gathers a copy for the dense call's
  // bfloat16 products otherwise.
  detail::StoredKeys blocks{key_blocks, value_blocks, key_scales, value_scales};
  const bool readable = blocks.readable_in_place();
  const int64_t kv_heads = key_blocks.shape[2];
  const int64_t kv_group =
      kv_heads > 0 && query.shape[1] % kv_heads == 0 ? query.shape[1] / kv_heads : 1;
  const auto reads_in_place = [&](const RaggedSequence& seq) {
    if (!readable || seq.q_len <= 0 || seq.q_len > kMaxDecodeQueries) return false;
    if (options.compute == ComputePrecision::kAuto ||
        options.compute == ComputePrecision::kFloat32) {
      return true;
    }
    return options.compute == ComputePrecision::kBFloat16 &&
           detail::stored_kv_bf16_products(key_blocks.dtype, options, kv_group, seq.q_len,
                                           seq.k_len, query.shape[2], value_blocks.shape[3]);
  };
  // The sequences read in place, collected here and run after the others as one work list
  // over all threads (run_over_stored_keys_batch: a short sequence does not hold a thread,
  // a long one is shared by all), each with the bits of its own dense call.
  std::vector<detail::StoredKeysCall> in_place;
  const auto in_place_call = [&](size_t s) {
    const RaggedSequence& seq = sequences[s];
    const CachedKeys& keys = cached[s];
    detail::StoredKeysCall call{detail::sequence_view(query, seq.q_begin, seq.q_len), blocks, {}};
    call.stored.table = keys.table + keys.first_block;
    call.stored.length = seq.k_len;
    call.outputs.output = detail::sequence_view(out_view, seq.q_begin, seq.q_len);
    if (staged_lse) {
      call.outputs.logsumexp = detail::sequence_rows(staged_lse->view(), seq.q_begin, seq.q_len);
    }
    return call;
  };
  // What is left to run a sequence at a time: prefill chunks, and key_mass's dense calls.
  std::vector<RaggedSequence> one_at_a_time = sequences;
  for (size_t s = 0; s < sequences.size(); ++s) {
    if (reads_in_place(sequences[s])) {
      in_place.push_back(in_place_call(s));
      if (!key_mass) one_at_a_time[s].q_len = 0;
    }
  }
  detail::schedule_sequences(
      one_at_a_time, query.shape[1], query.shape[2] + value_blocks.shape[3], threads,
      [&](size_t s, int sequence_threads) {
        const RaggedSequence& seq = sequences[s];
        const CachedKeys& keys = cached[s];
        const bool read_in_place = reads_in_place(seq);
        const TensorView q = detail::sequence_view(query, seq.q_begin, seq.q_len);
        AttentionOptions o = per_sequence;
        o.num_threads = sequence_threads;
        // Each sequence's keys gathered at most once (key_mass and a prefill chunk).
        std::optional<Tensor> key_copy, value_copy;
        std::optional<std::pair<TensorView, TensorView>> copies;
        const auto gathered = [&]() -> const std::pair<TensorView, TensorView>& {
          if (!copies) {
            copies.emplace(
                gathered_keys(key_blocks, key_scales, keys, seq.k_len, query.dtype, key_copy),
                gathered_keys(value_blocks, value_scales, keys, seq.k_len, query.dtype,
                              value_copy));
          }
          return *copies;
        };
        if (key_mass) {  // the listing's weights of this sequence, summed per key
          const Shape mass_strides = staged_mass->view().strides;
          write_key_mass(q, gathered().first, gathered().second, per_sequence, sequence_threads,
                         staged_mass->data_as<float>() + static_cast<int64_t>(s) * mass_strides[0],
                         mass_strides[1], keys.start);
        }
        if (read_in_place) return;
        AttentionOutputViews outs;
        outs.output = detail::sequence_view(out_view, seq.q_begin, seq.q_len);
        if (staged_lse) {
          outs.logsumexp = detail::sequence_rows(staged_lse->view(), seq.q_begin, seq.q_len);
        }
        scaled_dot_product_attention_into(q, gathered().first, gathered().second, outs, o);
      });
  if (!in_place.empty()) {
    AttentionOptions o = per_sequence;
    o.num_threads = threads;
    detail::run_over_stored_keys_batch(in_place, o);
  }
  convert(staged_output.view(), output);
  if (logsumexp) convert(staged_lse->view(), *logsumexp);
  if (key_mass) convert(staged_mass->view(), *key_mass);
}

}  // namespace detail

void paged_attention_into(const TensorView& query, const TensorView& cu_seqlens_q,
                          const TensorView& key_blocks, const TensorView& value_blocks,
                          const TensorView& block_tables, const TensorView& seq_lens,
                          const TensorView& output, const AttentionOptions& options,
                          const TensorView* logsumexp, const TensorView* key_mass,
                          const TensorView* key_scales, const TensorView* value_scales) {
  detail::paged_attention(query, cu_seqlens_q, key_blocks, value_blocks, block_tables, seq_lens,
                          output, options, logsumexp, key_mass, false, key_scales, value_scales);
}

}  // namespace attend
