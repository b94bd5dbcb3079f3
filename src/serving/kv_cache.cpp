// kv_cache.cpp: the paged KV cache and attention over it (attend/kv_cache.hpp). Every block
// table is checked against the storage before a block is read; each sequence then runs as a
// dense call on its cached keys: a strided view of the blocks in place when they are
// consecutive, else a contiguous gathered copy.
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
#include "sdpa_boundary.hpp"
#include "serving/ragged.hpp"

namespace attend {
namespace {

using detail::RaggedSequence;

// One sequence's keys in the blocks: kept blocks first_block.. of its table row.
struct CachedKeys {
  const int32_t* table = nullptr;  // row s of block_tables
  int64_t first_block = 0;         // first kept (not evicted) entry
  int64_t blocks = 0;              // entries in use: ceil(len / block_size)
  int64_t start = 0;               // first kept token
  bool consecutive = false;        // kept blocks adjacent in storage, in order
};

int32_t table_entry(const TensorView& tables, int64_t s, int64_t n) {
  return tables.data_as<const int32_t>()[s * tables.strides[0] + n * tables.strides[1]];
}

void check_blocks(const char* name, const TensorView& blocks) {
  detail::check_view(name, blocks);
  if (blocks.rank() != 4) {
    throw Error(detail::describe(name, blocks) +
                ": expected (num_blocks, block_size, kv_heads, dim)");
  }
  if (!detail::is_attention_float(blocks.dtype)) {
    throw Error(std::string(name) + ": dtype " + dtype_name(blocks.dtype) +
                " is not supported (float32, float16 or bfloat16; an int8 cache attends "
                "through PagedKvCache::attend, which knows its scales)");
  }
}

// Tokens [start, start + length) of a sequence as (Hkv, length, D): in place when its kept
// blocks are consecutive and of the query's dtype, else gathered into `copy`.
TensorView cached_view(const TensorView& blocks, const CachedKeys& keys, int64_t length,
                       DType dtype, std::optional<Tensor>& copy) {
  const int64_t bs = blocks.shape[1], heads = blocks.shape[2], dim = blocks.shape[3];
  const Shape& st = blocks.strides;
  const auto element = static_cast<int64_t>(dtype_size(blocks.dtype));
  const auto block_data = [&](int32_t b) {
    return static_cast<char*>(blocks.data) + b * st[0] * element;
  };
  if (keys.consecutive && blocks.dtype == dtype && st[0] == bs * st[1]) {
    return TensorView(block_data(keys.table[keys.first_block]), dtype, Shape({heads, length, dim}),
                      Shape({st[2], st[1], st[3]}));
  }
  copy.emplace(dtype, Shape({length, heads, dim}));
  for (int64_t t = 0; t < length;) {
    const int64_t n = keys.first_block + t / bs;
    const int64_t rows = std::min(bs, length - t);
    const TensorView source(block_data(keys.table[n]), blocks.dtype, Shape({rows, heads, dim}),
                            Shape({st[1], st[2], st[3]}));
    if (blocks.dtype == dtype && st[3] == 1 && st[2] == dim && st[1] == heads * dim) {
      std::memcpy(copy->data_as<char>() + t * heads * dim * element, source.data,
                  static_cast<size_t>(rows * heads * dim * element));
      t += rows;
      continue;
    }
    const TensorView dest(
        copy->data_as<char>() + t * heads * dim * static_cast<int64_t>(dtype_size(dtype)), dtype,
        Shape({rows, heads, dim}));
    convert(source, dest);
    t += rows;
  }
  return TensorView(copy->data(), dtype, Shape({heads, length, dim}), Shape({dim, heads * dim, 1}));
}

// Runs of blocks adjacent in storage: kept keys [begin, begin + count) from block `block` on.
struct BlockRun {
  int64_t begin, count, block;
};

std::vector<BlockRun> block_runs(const CachedKeys& keys, int64_t length, int64_t block_size) {
  std::vector<BlockRun> runs;
  for (int64_t t = 0; t < length; t += block_size) {
    const int32_t b = keys.table[keys.first_block + t / block_size];
    const int64_t count = std::min(block_size, length - t);
    if (!runs.empty() && runs.back().block + runs.back().count / block_size == b &&
        runs.back().count % block_size == 0) {
      runs.back().count += count;
    } else {
      runs.push_back({t, count, b});
    }
  }
  return runs;
}

// Whether a sequence whose blocks are not all adjacent can run as runs of adjacent blocks
// merged by their log-sum-exp (no copy of K and V): float32 throughout, rows of the blocks
// contiguous, and no rule that each run would apply again (a sink) or that sees absolute key
// indices (user rules).
bool mergeable(const TensorView& query, const TensorView& key_blocks,
               const TensorView& value_blocks, const AttentionOptions& options) {
  const auto rows_contiguous = [](const TensorView& b) {
    return b.dtype == DType::kFloat32 && b.strides[3] == 1 && b.strides[2] == b.shape[3] &&
           b.strides[1] == b.shape[2] * b.shape[3];
  };
  return query.dtype == DType::kFloat32 && rows_contiguous(key_blocks) &&
         rows_contiguous(value_blocks) && !options.sinks && !options.user_rules;
}

// One sequence over its runs of adjacent blocks: each run is a dense call on its keys (the
// diagonal, the prefix and ALiBi's distances shifted by the run's first key; rows that see
// none of its keys get zero weight), then every row merges its runs in order (float64):
// o = Σ_r e^(lse_r − m)·o_r / Σ_r e^(lse_r − m), lse = m + log Σ_r e^(lse_r − m).
// False (nothing written) when the options make the boundary copy an operand.
bool attend_over_runs(const TensorView& query, const TensorView& key_blocks,
                      const TensorView& value_blocks, const CachedKeys& keys, int64_t length,
                      const TensorView& output, const TensorView* logsumexp,
                      const AttentionOptions& options, int threads) {
  const int64_t bs = key_blocks.shape[1];
  const std::vector<BlockRun> runs = block_runs(keys, length, bs);
  const int64_t heads = query.shape[0], lq = query.shape[1], ev = value_blocks.shape[3];
  const auto block_view = [&](const TensorView& blocks, const BlockRun& run) {
    const Shape& st = blocks.strides;
    return TensorView(blocks.data_as<float>() + run.block * st[0], DType::kFloat32,
                      Shape({blocks.shape[2], run.count, blocks.shape[3]}),
                      Shape({st[2], st[1], st[3]}));
  };
  // The parameters of run 0's dense call; each run then sets its own keys and positions.
  AttentionOptions o = options;
  o.fully_masked_rows = FullyMaskedRows::kZero;
  o.num_threads = 1;
  const TensorView k0 = block_view(key_blocks, runs[0]), v0 = block_view(value_blocks, runs[0]);
  const detail::Problem problem = detail::validate_inputs(query, k0, v0, o);
  detail::KernelInputs inputs;
  const detail::SdpaParams base = detail::make_params(query, k0, v0, problem, o, inputs);
  // An option that made the boundary copy an operand (another precision of the products):
  // the runs cannot swap their keys in; the caller gathers instead.
  if (inputs.query || inputs.key || inputs.value ||
      base.query != static_cast<const float*>(query.data) ||
      base.key != static_cast<const float*>(k0.data) ||
      base.value != static_cast<const float*>(v0.data)) {
    return false;
  }
  const detail::KernelRun kernel = detail::chosen_kernel_run(base, o.backend);
  const int64_t dense_offset =
      options.causal_alignment == CausalAlignment::kBottomRight ? length - lq : 0;
  const int64_t rows = heads * lq;
  const auto count = static_cast<int64_t>(runs.size());
  const int64_t stride = rows * (ev + 1);  // per run: outputs (H, Lq, Ev), then lse (H, Lq)
  std::vector<float> partial(static_cast<size_t>(count * stride));
  const auto run_one = [&](int64_t r) {
    const BlockRun& run = runs[static_cast<size_t>(r)];
    detail::SdpaParams p = base;
    p.key = block_view(key_blocks, run).data_as<const float>();
    p.value = block_view(value_blocks, run).data_as<const float>();
    p.key_len = run.count;
    p.diagonal_offset = dense_offset - run.begin;
    p.prefix = std::clamp<int64_t>(options.prefix - run.begin, 0, run.count);
    float* out = partial.data() + r * stride;
    p.output = out;
    p.output_strides = detail::OperandStrides{{0, 0, 0, lq * ev}, ev, 1};
    p.logsumexp = out + rows * ev;
    p.logsumexp_strides = detail::OperandStrides{{0, 0, 0, lq}, 1, 1};
    kernel(problem.kv_group > 1 ? detail::split_kv_heads(p, problem.kv_group) : p);
  };
  // One thread (decode inside a busy batch): no OpenMP region at all.
  std::exception_ptr failure;
  if (threads <= 1) {
    for (int64_t r = 0; r < count; ++r) run_one(r);
  } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t r = 0; r < count; ++r) {
      try {
        run_one(r);
      } catch (...) {
#pragma omp critical(attend_paged_failure)
        if (!failure) failure = std::current_exception();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);

  const int64_t group = problem.kv_group;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<double> acc(static_cast<size_t>(ev));
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t row = h * lq + i;
      float m = kNegInf;
      for (int64_t r = 0; r < count; ++r) {
        m = std::max(m, partial[static_cast<size_t>(r * stride + rows * ev + row)]);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      float lse = m;
      if (m == kNegInf) {  // every key excluded
        if (options.fully_masked_rows == FullyMaskedRows::kUniform) {
          // The listing's uniform weights: the mean of V over the kept keys.
          for (const BlockRun& run : runs) {
            const TensorView v = block_view(value_blocks, run);
            const float* head = v.data_as<const float>() + (h / group) * v.strides[0];
            for (int64_t j = 0; j < run.count; ++j) {
              for (int64_t c = 0; c < ev; ++c) {
                acc[static_cast<size_t>(c)] += head[j * v.strides[1] + c];
              }
            }
          }
          for (double& a : acc) a /= static_cast<double>(length);
          lse = static_cast<float>(-1e9 + std::log(static_cast<double>(length)));
        }
      } else {
        double total = 0;
        for (int64_t r = 0; r < count; ++r) {
          const float* part = partial.data() + r * stride;
          const double weight = std::exp(static_cast<double>(part[rows * ev + row]) - m);
          total += weight;
          for (int64_t c = 0; c < ev; ++c) {
            acc[static_cast<size_t>(c)] += weight * part[row * ev + c];
          }
        }
        for (double& a : acc) a /= total;
        lse = static_cast<float>(m + std::log(total));
      }
      float* dest = output.data_as<float>() + h * output.strides[0] + i * output.strides[1];
      for (int64_t c = 0; c < ev; ++c) {
        dest[c * output.strides[2]] = static_cast<float>(acc[static_cast<size_t>(c)]);
      }
      if (logsumexp) {
        logsumexp->data_as<float>()[h * logsumexp->strides[0] + i * logsumexp->strides[1]] = lse;
      }
    }
  }
  return true;
}

// int8 rows of a cache: token t, head h of `rows` (tokens, Hkv, D), any floating dtype:
// scale = max_e |x_e| / 127, q_e = round(x_e / scale) in [-127, 127] (all 0, scale 0, for
// a zero row).
void quantize_rows(const TensorView& rows, int8_t* out, float* scales) {
  Tensor values(DType::kFloat32, rows.shape);
  convert(rows, values.view());
  const int64_t count = rows.shape[0] * rows.shape[1], dim = rows.shape[2];
  const float* x = values.data_as<float>();
  for (int64_t r = 0; r < count; ++r, x += dim, out += dim) {
    float largest = 0;
    for (int64_t e = 0; e < dim; ++e) largest = std::max(largest, std::abs(x[e]));
    const float scale = largest / 127.0f;
    scales[r] = scale;
    for (int64_t e = 0; e < dim; ++e) {
      out[e] = scale == 0
                   ? int8_t{0}
                   : static_cast<int8_t>(std::clamp(std::nearbyint(x[e] / scale), -127.0f, 127.0f));
    }
  }
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

// paged_attention_into; `shared_blocks`: a block may appear in several sequences' tables
// (forked sequences of one PagedKvCache, read only here).
void paged_attention(const TensorView& query, const TensorView& cu_seqlens_q,
                     const TensorView& key_blocks, const TensorView& value_blocks,
                     const TensorView& block_tables, const TensorView& seq_lens,
                     const TensorView& output, const AttentionOptions& options,
                     const TensorView* logsumexp, const TensorView* key_mass, bool shared_blocks) {
  const int threads = detail::threads_of(options);
  detail::check_view("query", query);
  if (query.rank() != 3) {
    throw Error(detail::describe("query", query) + ": expected (total tokens, heads, dim)");
  }
  check_blocks("key_blocks", key_blocks);
  check_blocks("value_blocks", value_blocks);
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
    keys.consecutive = true;
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
      if (n > keys.first_block && b != table_entry(block_tables, s, n - 1) + 1) {
        keys.consecutive = false;
      }
    }
    keys.start = std::min(len, keys.first_block * bs);
    const int64_t kept = len - keys.start;
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
  const std::vector<const TensorView*> inputs = {&query,        &cu_seqlens_q, &key_blocks,
                                                 &value_blocks, &block_tables, &seq_lens};
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
    for (const TensorView* t :
         {&query, &cu_seqlens_q, &key_blocks, &value_blocks, &block_tables, &seq_lens, &output}) {
      if (detail::overlaps(*key_mass, *t)) {
        throw Error("key_mass overlaps the memory of another argument");
      }
    }
    if (logsumexp && detail::overlaps(*key_mass, *logsumexp)) {
      throw Error("key_mass overlaps the memory of logsumexp");
    }
    for (int64_t s = 0; s < batch; ++s) {
      for (int64_t t = 0; t < expected[1]; ++t) {
        key_mass->data_as<float>()[s * key_mass->strides[0] + t * key_mass->strides[1]] = 0.0f;
      }
    }
  }

  AttentionOptions per_sequence = options;
  per_sequence.need_logsumexp = false;
  detail::schedule_sequences(
      sequences, query.shape[1], threads, [&](size_t s, int sequence_threads) {
        const RaggedSequence& seq = sequences[s];
        if (key_mass) {  // the listing's weights of this sequence, summed per key
          std::optional<Tensor> key_copy, value_copy;
          write_key_mass(
              detail::sequence_view(query, seq.q_begin, seq.q_len),
              cached_view(key_blocks, cached[s], seq.k_len, query.dtype, key_copy),
              cached_view(value_blocks, cached[s], seq.k_len, query.dtype, value_copy),
              per_sequence, sequence_threads,
              key_mass->data_as<float>() + static_cast<int64_t>(s) * key_mass->strides[0],
              key_mass->strides[1], cached[s].start);
        }
        const bool in_place = cached[s].consecutive && key_blocks.dtype == query.dtype &&
                              key_blocks.strides[0] == key_blocks.shape[1] * key_blocks.strides[1];
        if (!in_place && mergeable(query, key_blocks, value_blocks, options)) {
          std::optional<TensorView> lse;
          if (logsumexp) lse = detail::sequence_rows(*logsumexp, seq.q_begin, seq.q_len);
          if (attend_over_runs(detail::sequence_view(query, seq.q_begin, seq.q_len), key_blocks,
                               value_blocks, cached[s], seq.k_len,
                               detail::sequence_view(output, seq.q_begin, seq.q_len),
                               lse ? &*lse : nullptr, options, sequence_threads)) {
            return;
          }
        }
        std::optional<Tensor> key_copy, value_copy;
        const TensorView k = cached_view(key_blocks, cached[s], seq.k_len, query.dtype, key_copy);
        const TensorView v =
            cached_view(value_blocks, cached[s], seq.k_len, query.dtype, value_copy);
        AttentionOptions o = per_sequence;
        o.num_threads = sequence_threads;
        AttentionOutputViews outs;
        outs.output = detail::sequence_view(output, seq.q_begin, seq.q_len);
        if (logsumexp) outs.logsumexp = detail::sequence_rows(*logsumexp, seq.q_begin, seq.q_len);
        scaled_dot_product_attention_into(detail::sequence_view(query, seq.q_begin, seq.q_len), k,
                                          v, outs, o);
      });
}

}  // namespace

void paged_attention_into(const TensorView& query, const TensorView& cu_seqlens_q,
                          const TensorView& key_blocks, const TensorView& value_blocks,
                          const TensorView& block_tables, const TensorView& seq_lens,
                          const TensorView& output, const AttentionOptions& options,
                          const TensorView* logsumexp, const TensorView* key_mass) {
  paged_attention(query, cu_seqlens_q, key_blocks, value_blocks, block_tables, seq_lens, output,
                  options, logsumexp, key_mass, false);
}

// ---------------------------------------------------------------------------------------
// PagedKvCache

PagedKvCache::PagedKvCache(const KvCacheConfig& config) : config_(config) {
  if (config_.value_dim == 0) config_.value_dim = config_.head_dim;
  if (config_.num_blocks < 1 || config_.num_blocks > INT32_MAX || config_.block_size < 1 ||
      config_.kv_heads < 1 || config_.head_dim < 1 || config_.value_dim < 1) {
    throw Error(
        "KvCacheConfig: num_blocks (up to 2^31 - 1), block_size, kv_heads, head_dim and "
        "value_dim must be >= 1");
  }
  if (!detail::is_attention_float(config_.dtype) && config_.dtype != DType::kInt8) {
    throw Error(std::string("KvCacheConfig: dtype ") + dtype_name(config_.dtype) +
                " is not supported (float32, float16, bfloat16 or int8)");
  }
  keys_ = Tensor::zeros(config_.dtype, Shape({config_.num_blocks, config_.block_size,
                                              config_.kv_heads, config_.head_dim}));
  values_ = Tensor::zeros(config_.dtype, Shape({config_.num_blocks, config_.block_size,
                                                config_.kv_heads, config_.value_dim}));
  if (config_.dtype == DType::kInt8) {
    const Shape scales({config_.num_blocks, config_.block_size, config_.kv_heads});
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
  const KvCacheConfig& c = config_;
  const int32_t from = seq.blocks.back(), to = take_block();
  const int64_t rows = seq.length % c.block_size;
  for (auto [storage, dim] : {std::pair{&keys_, c.head_dim}, std::pair{&values_, c.value_dim}}) {
    const size_t row_bytes = static_cast<size_t>(c.kv_heads * dim) * dtype_size(c.dtype);
    std::memcpy(storage->data_as<char>() + to * c.block_size * row_bytes,
                storage->data_as<char>() + from * c.block_size * row_bytes,
                static_cast<size_t>(rows) * row_bytes);
  }
  for (Tensor* scales : {&key_scales_, &value_scales_}) {
    if (scales->empty()) continue;
    float* base = scales->data_as<float>();
    std::memcpy(base + to * c.block_size * c.kv_heads, base + from * c.block_size * c.kv_heads,
                static_cast<size_t>(rows * c.kv_heads) * sizeof(float));
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
  const auto write_rows = [&](const TensorView& source, const Tensor& storage, int64_t dim,
                              const Tensor& scales) {
    const auto element = static_cast<int64_t>(dtype_size(c.dtype));
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
        from.shape = Shape({rows, c.kv_heads, dim});
        char* to_data = const_cast<char*>(storage.data_as<char>()) +
                        ((b * c.block_size + row) * c.kv_heads * dim) * element;
        if (c.dtype == DType::kInt8) {
          float* scale =
              const_cast<float*>(scales.data_as<float>()) + (b * c.block_size + row) * c.kv_heads;
          quantize_rows(from, reinterpret_cast<int8_t*>(to_data), scale);
        } else {
          convert(from, TensorView(to_data, c.dtype, Shape({rows, c.kv_heads, dim})));
        }
        t += rows;
      }
    }
  };
  try {
    write_rows(rope ? rotated.view() : key, keys_, c.head_dim, key_scales_);
    write_rows(value, values_, c.value_dim, value_scales_);
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
  if (config_.dtype == DType::kInt8) {
    if (key_mass) throw Error("PagedKvCache::attend: key_mass is not supported for int8 caches");
    return attend_int8(readers, query, cu_seqlens_q, output, options, logsumexp);
  }
  paged_attention(query, cu_seqlens_q, keys_.view(), values_.view(), tables.view(), lengths.view(),
                  output, options, logsumexp, key_mass, true);
}

void PagedKvCache::attend_int8(const std::vector<const Sequence*>& sequences,
                               const TensorView& query, const TensorView& cu_seqlens_q,
                               const TensorView& output, const AttentionOptions& options,
                               const TensorView* logsumexp) const {
  // The sequences are marked as read: their blocks stay as they are until this returns.
  const KvCacheConfig& c = config_;
  std::vector<int64_t> starts, kept;
  int64_t total = 0;
  for (size_t s = 0; s < sequences.size(); ++s) {
    const Sequence& seq = *sequences[s];
    int64_t first = 0;
    while (first < static_cast<int64_t>(seq.blocks.size()) &&
           seq.blocks[static_cast<size_t>(first)] < 0) {
      ++first;
    }
    starts.push_back(std::min(seq.length, first * c.block_size));
    kept.push_back(seq.length - starts.back());
    total += kept.back();
    if (starts.back() > 0 &&
        (options.prefix > 0 ||
         (options.causal && options.causal_alignment == CausalAlignment::kTopLeft))) {
      throw Error("sequence " + std::to_string(s) +
                  ": evicted blocks shift the positions that prefix and top-left causal "
                  "alignment count from");
    }
  }
  // Dequantized keys and values of every sequence, packed: x = scale·q.
  const auto dequantize = [&](const Tensor& blocks, const Tensor& scales, int64_t dim) {
    Tensor packed(DType::kFloat32, Shape({total, c.kv_heads, dim}));
    float* out = packed.data_as<float>();
    for (size_t s = 0; s < sequences.size(); ++s) {
      const Sequence& seq = *sequences[s];
      for (int64_t t = starts[s]; t < seq.length; ++t) {
        const int64_t row =
            seq.blocks[static_cast<size_t>(t / c.block_size)] * c.block_size + t % c.block_size;
        const int8_t* q = blocks.data_as<int8_t>() + row * c.kv_heads * dim;
        const float* scale = scales.data_as<float>() + row * c.kv_heads;
        for (int64_t h = 0; h < c.kv_heads; ++h) {
          for (int64_t e = 0; e < dim; ++e) *out++ = scale[h] * q[h * dim + e];
        }
      }
    }
    if (query.dtype == DType::kFloat32) return packed;
    Tensor as_query(query.dtype, packed.shape());
    convert(packed.view(), as_query.view());
    return as_query;
  };
  const Tensor k = dequantize(keys_, key_scales_, c.head_dim);
  const Tensor v = dequantize(values_, value_scales_, c.value_dim);
  Tensor cu_k(DType::kInt32, Shape({static_cast<int64_t>(sequences.size()) + 1}));
  cu_k.data_as<int32_t>()[0] = 0;
  for (size_t s = 0; s < sequences.size(); ++s) {
    cu_k.data_as<int32_t>()[s + 1] = cu_k.data_as<int32_t>()[s] + static_cast<int32_t>(kept[s]);
  }
  varlen_attention_into(query, k.view(), v.view(), cu_seqlens_q, cu_k.view(), output, options,
                        logsumexp);
}

}  // namespace attend
