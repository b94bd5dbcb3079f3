// ring_backward.cpp: ring attention's backward (attend/mpi/ring.hpp).
//
// With the forward's merged O and lse (global), each block's gradients are exact on their own
// (attend/sdpa_backward.hpp: P_ij = exp(s_ij − lse_i), D_i = dO_i·O_i). Rank r at step s holds
// the key block of o = (r − s) mod N and:
//   1. starts the next key/value block's transfer (as the forward);
//   2. computes its blocks' backward: dQ (batch, Lq_r, E) += on the spot; the block's
//      contribution C = (dK, dV) of o's keys, (batch, Lk_o, E + Ev);
//   3. receives o's running sum from rank r − 1 (which added its own at step s − 1), adds C
//      to it and sends it on to rank r + 1: after N steps the sum reaches o itself.
// Every sum runs in a fixed order (dQ over steps; dK and dV along the ring from the owner
// on), whatever the timing: deterministic for a given rank count.
#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <string>

#include "attend/error.hpp"
#include "dropout.hpp"
#include "mpi/ring_internal.hpp"
#include "partial_softmax.hpp"

namespace attend::mpi {
namespace {

using detail::Piece;
using detail::RingPlan;

constexpr int kSumTag = 1 << 20;  // tags of the dK/dV sums: kSumTag + the sender's step

// to += from, elementwise over `to`'s shape (any strides; `from` contiguous of that shape).
void add_into(const TensorView& to, const Tensor& from) {
  const int rank = to.rank();
  const int64_t n = to.numel();
  int64_t index[Shape::kMaxRank] = {};
  const float* src = from.data_as<const float>();
  for (int64_t i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (int d = 0; d < rank; ++d) offset += index[d] * to.strides[d];
    to.data_as<float>()[offset] += src[i];
    for (int d = rank - 1; d >= 0; --d) {
      if (++index[d] < to.shape[d]) break;
      index[d] = 0;
    }
  }
}

// rows [piece.local, + length) of every batch index of a (batch, rows, width) buffer
// += the block's (batch, length, width).
void add_rows(float* to, int64_t rows, int64_t width, const Piece& piece, const Tensor& from,
              int64_t batch) {
  const float* src = from.data_as<const float>();
  for (int64_t b = 0; b < batch; ++b) {
    float* dst = to + (b * rows + piece.local) * width;
    const float* s = src + b * piece.length * width;
    for (int64_t n = 0; n < piece.length * width; ++n) dst[n] += s[n];
  }
}

void check_shape(const char* name, const TensorView& t, const Shape& expected) {
  if (t.dtype != DType::kFloat32) {
    throw Error(std::string(name) + ": dtype " + dtype_name(t.dtype) +
                " is not supported (float32, or float16 and bfloat16 for grad_output and "
                "output; logsumexp is float32)");
  }
  if (t.shape != expected) {
    throw Error(std::string(name) + " " + t.shape.str() + " should be " + expected.str());
  }
}

// The running dK/dV sums in flight: two send buffers (a send completes before its buffer is
// reused) and one receive buffer. On an exit path the requests are cancelled, and the
// buffers kept for ever if one is still pending.
struct SumExchange {
  Tensor sums[2], incoming;
  MPI_Request sends[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  MPI_Request receive = MPI_REQUEST_NULL;
  ~SumExchange() {
    MPI_Request all[3] = {sends[0], sends[1], receive};
    if (!detail::settle(all, 3)) {
      for (Tensor& t : sums) detail::Communicator::keep_forever(std::move(t));
      detail::Communicator::keep_forever(std::move(incoming));
    }
  }
};

AttentionGradients ring_attention_backward_float32(
    const detail::Communicator& comm, const TensorView& grad_output, const TensorView& query,
    const TensorView& key, const TensorView& value, const TensorView& output,
    const TensorView& logsumexp, const AttentionOptions& options,
    const ContextParallelOptions& parallel) {
  const auto call_start = std::chrono::steady_clock::now();
  RingStatistics stats;
  const RingPlan plan = detail::agree_on_plan(
      comm, comm.who(), query, key, value, options, parallel.layout, [&](const RingPlan& p) {
        Shape out_shape = p.batch_shape, lse_shape = p.batch_shape;
        out_shape.push_back(p.query_shard_len());
        out_shape.push_back(p.value_dim);
        lse_shape.push_back(p.query_shard_len());
        check_shape("grad_output", grad_output, out_shape);
        check_shape("output", output, out_shape);
        check_shape("logsumexp", logsumexp, lse_shape);
      });
  const int64_t rows = plan.query_shard_len(), E = plan.head_dim, Ev = plan.value_dim;
  const int64_t batch = plan.batch;
  const int dim = query.rank() - 2;
  comm.fault_point();

  AttentionGradients g;
  g.query = Tensor::zeros(DType::kFloat32, query.shape);
  g.key = Tensor(DType::kFloat32, key.shape);
  g.value = Tensor(DType::kFloat32, value.shape);
  Tensor bias_sum;  // float32 accumulator of the bias gradient, bias's shape
  if (options.bias) bias_sum = Tensor::zeros(DType::kFloat32, options.bias->shape);

  // The running dK/dV sums: two send buffers (a send completes before its buffer is reused),
  // one receive buffer, one for this step's contribution.
  int64_t largest = 1;
  for (int r = 0; r < plan.ranks; ++r) {
    largest = std::max(largest, batch * plan.key_shard_len[static_cast<size_t>(r)] * (E + Ev));
  }
  if (largest * static_cast<int64_t>(sizeof(float)) > INT_MAX) {
    throw Error("ring_attention_backward: a dK/dV block exceeds one MPI message (2 GiB)");
  }
  SumExchange exchange;
  for (Tensor& t : exchange.sums) t = Tensor(DType::kFloat32, Shape({largest}));
  exchange.incoming = Tensor(DType::kFloat32, Shape({largest}));
  Tensor contribution(DType::kFloat32, Shape({largest}));

  // Rows that saw no key anywhere (FullyMaskedRows::kUniform): their uniform weights pass a
  // gradient to every value, dV_j += Z_ij/((1 − p)·Lk)·dO_i. Found by the forward's lse.
  std::vector<int64_t> dead;
  std::vector<int64_t> global_query(static_cast<size_t>(rows));
  for (const Piece& p : plan.queries[static_cast<size_t>(plan.rank)]) {
    for (int64_t i = 0; i < p.length; ++i)
      global_query[static_cast<size_t>(p.local + i)] = p.global + i;
  }
  Tensor dout = Tensor::copy_of(grad_output), lse = Tensor::copy_of(logsumexp);
  if (detail::may_leave_rows_empty(options)) {
    const float empty = attend::detail::fully_excluded_logsumexp(plan.key_len);
    for (int64_t row = 0; row < batch * rows; ++row) {
      if (lse.data_as<float>()[row] == empty) dead.push_back(row);
    }
  }
  const uint32_t threshold = attend::detail::dropout_threshold(options.dropout);
  const double uniform = 1.0 / ((1.0 - options.dropout) * static_cast<double>(plan.key_len));

  detail::KeyBlocks blocks(plan, key, value, options.segment_ids_key);
  for (int step = 0; step < plan.ranks; ++step) {
    stats.wait_seconds += blocks.advance(comm, step, parallel.overlap);
    const int owner = blocks.owner(step);
    const int64_t lk = plan.key_shard_len[static_cast<size_t>(owner)];
    const int64_t floats = batch * lk * (E + Ev);
    if (step > 0) {
      detail::check_mpi(
          MPI_Irecv(exchange.incoming.data(), static_cast<int>(floats), MPI_FLOAT, comm.previous(),
                    kSumTag + step - 1, comm.get(), &exchange.receive),
          "MPI_Irecv of a dK/dV sum");
    }
    const auto compute_start = std::chrono::steady_clock::now();
    float* dk = contribution.data_as<float>();
    float* dv = dk + batch * lk * E;
    std::fill_n(dk, floats, 0.0f);
    const TensorView k = blocks.key(step), v = blocks.value(step);
    const std::optional<TensorView> segments = blocks.segments(step);
    for (const Piece& q : plan.queries[static_cast<size_t>(plan.rank)]) {
      for (const Piece& kp : plan.keys[static_cast<size_t>(owner)]) {
        const AttentionOptions block = detail::block_options(options, plan, q, kp, segments);
        if (detail::block_is_hidden(block, q.length, kp.length)) {
          ++stats.blocks_skipped;
          continue;
        }
        const AttentionGradients r = scaled_dot_product_attention_backward(
            detail::narrow(grad_output, dim, q.local, q.length),
            detail::narrow(query, dim, q.local, q.length),
            detail::narrow(k, dim, kp.local, kp.length),
            detail::narrow(v, dim, kp.local, kp.length),
            detail::narrow(output, dim, q.local, q.length),
            detail::narrow(logsumexp, dim, q.local, q.length), block);
        add_rows(g.query.data_as<float>(), rows, E, q, r.query, batch);
        add_rows(dk, lk, E, kp, r.key, batch);
        add_rows(dv, lk, Ev, kp, r.value, batch);
        if (options.bias) {
          Tensor block_bias(DType::kFloat32, r.bias.shape());
          convert(r.bias.view(), block_bias.view());
          add_into(detail::block_slice(bias_sum.view(), q, kp), block_bias);
        }
        ++stats.blocks_computed;
      }
    }
    for (int64_t row : dead) {
      const int64_t b = row / rows, i = row % rows;
      const float* g_row = dout.data_as<float>() + row * Ev;
      for (const Piece& kp : plan.keys[static_cast<size_t>(owner)]) {
        for (int64_t j = 0; j < kp.length; ++j) {
          if (options.dropout > 0 &&
              !attend::detail::dropout_keep(options.seed, threshold, b,
                                            global_query[static_cast<size_t>(i)], kp.global + j)) {
            continue;
          }
          float* to = dv + (b * lk + kp.local + j) * Ev;
          for (int64_t c = 0; c < Ev; ++c) to[c] += static_cast<float>(uniform * g_row[c]);
        }
      }
    }
    stats.compute_seconds += detail::seconds_since(compute_start);
    // The running sum of o's gradients: what came from rank r − 1, plus this rank's part.
    const auto wait_start = std::chrono::steady_clock::now();
    float* sum = exchange.sums[step % 2].data_as<float>();
    comm.wait(&exchange.sends[step % 2], 1, "waiting for a dK/dV sum to leave");
    if (step > 0) {
      comm.wait(&exchange.receive, 1, "waiting for a dK/dV sum");
      const float* in = exchange.incoming.data_as<float>();
      for (int64_t n = 0; n < floats; ++n) sum[n] = in[n] + dk[n];
    } else {
      std::copy_n(dk, floats, sum);
    }
    stats.wait_seconds += detail::seconds_since(wait_start);
    detail::check_mpi(MPI_Isend(sum, static_cast<int>(floats), MPI_FLOAT, comm.next(),
                                kSumTag + step, comm.get(), &exchange.sends[step % 2]),
                      "MPI_Isend of a dK/dV sum");
    stats.bytes_sent += static_cast<uint64_t>(floats) * sizeof(float);
  }
  // This rank's own keys' gradients, summed by every rank, arrive from rank r − 1.
  comm.fault_point();
  const int64_t lk = plan.key_shard_len[static_cast<size_t>(plan.rank)];
  detail::check_mpi(
      MPI_Irecv(exchange.incoming.data(), static_cast<int>(batch * lk * (E + Ev)), MPI_FLOAT,
                comm.previous(), kSumTag + plan.ranks - 1, comm.get(), &exchange.receive),
      "MPI_Irecv of this rank's dK/dV");
  comm.wait(&exchange.receive, 1, "waiting for this rank's dK/dV");
  comm.wait(exchange.sends, 2, "waiting for the dK/dV sums to leave");
  const Tensor& incoming = exchange.incoming;
  stats.bytes_sent += blocks.bytes_sent();
  Shape k_shape = plan.batch_shape, v_shape = plan.batch_shape;
  k_shape.push_back(lk);
  k_shape.push_back(E);
  v_shape.push_back(lk);
  v_shape.push_back(Ev);
  detail::copy_view(TensorView(incoming.data_as<float>(), k_shape), g.key.view());
  detail::copy_view(TensorView(incoming.data_as<float>() + batch * lk * E, v_shape),
                    g.value.view());

  if (options.bias) {
    g.bias = Tensor(options.bias->dtype, options.bias->shape);
    convert(bias_sum.view(), g.bias.view());
  }
  // The sinks' gradient over this rank's rows: dSink_h = −Σ_i exp(sink_h − lse_i)·dO_i·O_i.
  if (options.sinks) {
    Tensor sinks(DType::kFloat32, options.sinks->shape), out = Tensor::copy_of(output);
    convert(*options.sinks, sinks.view());
    const int64_t heads = options.sinks->shape[0];
    std::vector<double> grad(static_cast<size_t>(heads), 0.0);
    for (int64_t row = 0; row < batch * rows; ++row) {
      const int64_t h = (row / rows) % heads;
      double delta = 0.0;
      for (int64_t c = 0; c < Ev; ++c) {
        delta += double{dout.data_as<float>()[row * Ev + c]} *
                 double{out.data_as<float>()[row * Ev + c]};
      }
      grad[static_cast<size_t>(h)] -=
          std::exp(double{sinks.data_as<float>()[h]} - double{lse.data_as<float>()[row]}) * delta;
    }
    Tensor grad64(DType::kFloat64, options.sinks->shape);
    std::copy(grad.begin(), grad.end(), grad64.data_as<double>());
    g.sinks = Tensor(options.sinks->dtype, options.sinks->shape);
    convert(grad64.view(), g.sinks.view());
  }
  stats.steps = plan.ranks;
  stats.total_seconds = detail::seconds_since(call_start);
  if (parallel.statistics) *parallel.statistics = stats;
  return g;
}

}  // namespace

AttentionGradients ring_attention_backward(MPI_Comm comm, const TensorView& grad_output,
                                           const TensorView& query, const TensorView& key,
                                           const TensorView& value, const TensorView& output,
                                           const TensorView& logsumexp,
                                           const AttentionOptions& options,
                                           const ContextParallelOptions& parallel) {
  return detail::guarded(comm, "ring_attention_backward", parallel,
                         [&](const detail::Communicator& c) {
                           return detail::backward_in_float32(
                               grad_output, query, key, value, output,
                               [&](const TensorView& dout, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& o) {
                                 return ring_attention_backward_float32(
                                     c, dout, q, k, v, o, logsumexp, options, parallel);
                               });
                         });
}

}  // namespace attend::mpi
