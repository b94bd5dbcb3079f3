// ring.cpp: ring attention's forward (attend/mpi/ring.hpp).
//
// Shapes on rank r: Q (batch, Lq_r, E) in pieces (one contiguous, two zigzag), the key block of
// step s (batch, Lk_o, E) and its values (batch, Lk_o, Ev), o = (r − s) mod N. Per step:
//   1. start sending this block onward and receiving the next (overlap), or not;
//   2. every (query piece × key piece) block that position does not hide entirely:
//      O_b, lse_b = fused kernel at global positions (empty rows zero, lse −inf);
//   3. merge in fixed order into (acc, lse_acc) (partial_softmax.hpp: merge_logsumexp):
//        lse' = log(exp(lse_acc) + exp(lse_b)),  acc = acc·exp(lse_acc − lse') + O_b·exp(lse_b −
//        lse')
//   4. wait for the next block.
// Then the sink joins each row once, and rows that saw no key anywhere get what one process
// gives them (FullyMaskedRows): zero, or the uniform weights over every key (a second pass
// of the values around the ring, only when some rank has such a row).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>

#include "attend/error.hpp"
#include "dropout.hpp"
#include "mpi/ring_internal.hpp"
#include "partial_softmax.hpp"

namespace attend::mpi {
namespace {

using detail::Piece;
using detail::RingPlan;

// (batch, Lq_r) rows: the running output and log-sum-exp.
struct Accumulator {
  Tensor output;            // (batch..., Lq_r, Ev) float32
  std::vector<double> lse;  // (batch · Lq_r), −inf before any key
  int64_t rows = 0, value_dim = 0;

  // Merges a block's result for the rows [piece.local, + piece.length) of every batch index.
  void merge(const AttentionResult& block, const Piece& piece) {
    float* acc = output.data_as<float>();
    const float* o = block.output.data_as<const float>();
    const float* l = block.logsumexp.data_as<const float>();
    const int64_t batch = static_cast<int64_t>(lse.size()) / rows;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < piece.length; ++i) {
        const double block_lse = l[b * piece.length + i];
        if (block_lse == -INFINITY) continue;  // no visible key in this block
        const int64_t row = b * rows + piece.local + i;
        double& running = lse[static_cast<size_t>(row)];
        const float* from = o + (b * piece.length + i) * value_dim;
        float* to = acc + row * value_dim;
        if (running == -INFINITY) {
          std::copy_n(from, value_dim, to);
          running = block_lse;
          continue;
        }
        const attend::detail::LogSumExpMerge m = attend::detail::merge_logsumexp(running, block_lse);
        for (int64_t e = 0; e < value_dim; ++e) to[e] = to[e] * m.keep + from[e] * m.add;
        running = m.logsumexp;
      }
    }
  }
};

// Rows that saw no key anywhere under FullyMaskedRows::kUniform: the listing's uniform
// weights 1/Lk over every key (then dropout), so O_i = Σ_j Z_ij/((1 − p)·Lk)·V_j. The values
// go around the ring once more (blocking: this is the rare case).
void uniform_rows(const detail::Communicator& comm, const RingPlan& plan, detail::KeyBlocks& blocks,
                  const std::vector<int64_t>& dead, const AttentionOptions& options,
                  Tensor& output) {
  const uint32_t threshold = attend::detail::dropout_threshold(options.dropout);
  const double weight = 1.0 / ((1.0 - options.dropout) * static_cast<double>(plan.key_len));
  const int64_t rows = plan.query_shard_len(), ev = plan.value_dim;
  // The global position of each local query row.
  std::vector<int64_t> global(static_cast<size_t>(rows));
  for (const Piece& p : plan.queries[static_cast<size_t>(plan.rank)]) {
    for (int64_t i = 0; i < p.length; ++i) global[static_cast<size_t>(p.local + i)] = p.global + i;
  }
  std::vector<double> sums(dead.size() * static_cast<size_t>(ev), 0.0);
  for (int step = 0; step < plan.ranks; ++step) {
    if (step > 0) {
      blocks.start(comm, step - 1);
      blocks.finish(comm);
    }
    const TensorView v = blocks.value(step);
    const int owner = blocks.owner(step);
    const int64_t lk = v.shape.back(1);
    for (size_t d = 0; d < dead.size(); ++d) {
      const int64_t b = dead[d] / rows, i = dead[d] % rows;
      const float* values = v.data_as<const float>() + b * lk * ev;
      for (const Piece& k : plan.keys[static_cast<size_t>(owner)]) {
        for (int64_t j = 0; j < k.length; ++j) {
          if (options.dropout > 0 &&
              !attend::detail::dropout_keep(options.seed, threshold, b,
                                            global[static_cast<size_t>(i)], k.global + j)) {
            continue;
          }
          const float* vj = values + (k.local + j) * ev;
          for (int64_t e = 0; e < ev; ++e)
            sums[d * static_cast<size_t>(ev) + static_cast<size_t>(e)] += weight * vj[e];
        }
      }
    }
  }
  for (size_t d = 0; d < dead.size(); ++d) {
    float* o = output.data_as<float>() + dead[d] * ev;
    for (int64_t e = 0; e < ev; ++e)
      o[e] = static_cast<float>(sums[d * static_cast<size_t>(ev) + static_cast<size_t>(e)]);
  }
}

ShardResult ring_attention_float32(const detail::Communicator& comm, const TensorView& query,
                                   const TensorView& key, const TensorView& value,
                                   const AttentionOptions& options,
                                   const ContextParallelOptions& parallel) {
  const auto call_start = std::chrono::steady_clock::now();
  RingStatistics stats;
  const RingPlan plan =
      detail::agree_on_plan(comm, comm.who(), query, key, value, options, parallel.layout);
  comm.fault_point();
  const int64_t rows = plan.query_shard_len();
  const std::vector<Piece>& my_queries = plan.queries[static_cast<size_t>(plan.rank)];

  Shape out_shape = plan.batch_shape, lse_shape = plan.batch_shape;
  out_shape.push_back(rows);
  out_shape.push_back(plan.value_dim);
  lse_shape.push_back(rows);
  Accumulator acc{Tensor::zeros(DType::kFloat32, out_shape),
                  std::vector<double>(static_cast<size_t>(plan.batch * rows), -INFINITY), rows,
                  plan.value_dim};

  detail::KeyBlocks blocks(plan, key, value, options.segment_ids_key);
  const int q_dim = query.rank() - 2;
  for (int step = 0; step < plan.ranks; ++step) {
    stats.wait_seconds += blocks.advance(comm, step, parallel.overlap);
    const auto compute_start = std::chrono::steady_clock::now();
    const int owner = blocks.owner(step);
    const TensorView k = blocks.key(step), v = blocks.value(step);
    const std::optional<TensorView> segments = blocks.segments(step);
    for (const Piece& q : my_queries) {
      for (const Piece& kp : plan.keys[static_cast<size_t>(owner)]) {
        const AttentionOptions block = detail::block_options(options, plan, q, kp, segments);
        if (detail::block_is_hidden(block, q.length, kp.length)) {
          ++stats.blocks_skipped;
          continue;
        }
        const AttentionResult r =
            scaled_dot_product_attention(detail::narrow(query, q_dim, q.local, q.length),
                                         detail::narrow(k, q_dim, kp.local, kp.length),
                                         detail::narrow(v, q_dim, kp.local, kp.length), block);
        acc.merge(r, q);
        ++stats.blocks_computed;
      }
    }
    stats.compute_seconds += detail::seconds_since(compute_start);
  }

  // The sink joins each row's denominator once; rows that saw no key at all.
  ShardResult result{std::move(acc.output), Tensor(DType::kFloat32, lse_shape)};
  float* out = result.output.data_as<float>();
  float* lse = result.logsumexp.data_as<float>();
  Tensor sinks;
  if (options.sinks) {
    sinks = Tensor(DType::kFloat32, options.sinks->shape);
    convert(*options.sinks, sinks.view());
  }
  const int64_t heads = plan.batch_shape.rank() > 0 ? plan.batch_shape.back(0) : 1;
  std::vector<int64_t> dead;
  for (int64_t row = 0; row < plan.batch * rows; ++row) {
    double running = acc.lse[static_cast<size_t>(row)];
    if (options.sinks) {
      const double sink = sinks.data_as<float>()[(row / rows) % heads];
      const attend::detail::LogSumExpMerge m = attend::detail::merge_logsumexp(running, sink);
      for (int64_t e = 0; e < plan.value_dim; ++e) out[row * plan.value_dim + e] *= m.keep;
      running = m.logsumexp;
    } else if (running == -INFINITY && options.fully_masked_rows == FullyMaskedRows::kUniform) {
      dead.push_back(row);
      running = attend::detail::fully_excluded_logsumexp(plan.key_len);
    }
    lse[row] = static_cast<float>(running);
  }
  comm.fault_point();
  if (detail::may_leave_rows_empty(options)) {
    // Collective whenever such rows are possible, so that every rank takes part.
    auto flags = std::make_unique<int[]>(2);  // this rank's, anywhere's
    flags[0] = dead.empty() ? 0 : 1;
    MPI_Request request = MPI_REQUEST_NULL;
    detail::check_mpi(
        MPI_Iallreduce(&flags[0], &flags[1], 1, MPI_INT, MPI_MAX, comm.get(), &request),
        "MPI_Iallreduce");
    comm.wait_collective(request, "whether any row saw no key", flags);
    if (flags[1]) {
      detail::KeyBlocks values(plan, key, value, std::nullopt);
      uniform_rows(comm, plan, values, dead, options, result.output);
    }
  }
  stats.steps = plan.ranks;
  stats.bytes_sent = blocks.bytes_sent();
  stats.total_seconds = detail::seconds_since(call_start);
  if (parallel.statistics) *parallel.statistics = stats;
  return result;
}

}  // namespace

ShardResult ring_attention(MPI_Comm comm, const TensorView& query, const TensorView& key,
                           const TensorView& value, const AttentionOptions& options,
                           const ContextParallelOptions& parallel) {
  return detail::guarded(comm, "ring_attention", parallel, [&](const detail::Communicator& c) {
    return detail::forward_in_float32(
        query, key, value, [&](const TensorView& q, const TensorView& k, const TensorView& v) {
          return ring_attention_float32(c, q, k, v, options, parallel);
        });
  });
}

}  // namespace attend::mpi
