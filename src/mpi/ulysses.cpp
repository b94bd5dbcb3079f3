// ulysses.cpp: head parallelism (attend/mpi/ring.hpp): sequence shards to head shards by one
// all-to-all, the ordinary kernel on the whole sequence for this rank's heads, one all-to-all
// back.
//
// Shapes: a shard (outer..., H, L_r, D) on rank r; a head shard (outer..., H_r, L, D) with the
// rows in global order (each rank's pieces put back at their global positions).
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <string>
#include <tuple>

#include "attend/error.hpp"
#include "attend/score_rules.hpp"
#include "mpi/ring_internal.hpp"

namespace attend::mpi {
namespace {

using detail::Piece;
using detail::RingPlan;
using Pieces = std::vector<std::vector<Piece>>;

// Heads [first, first + count) of each rank.
struct HeadSplit {
  std::vector<ShardPiece> of_rank;
};

HeadSplit split_heads(int64_t heads, int ranks) {
  HeadSplit s;
  for (int r = 0; r < ranks; ++r) {
    s.of_rank.push_back(shard_pieces(ShardLayout::kContiguous, heads, ranks, r)[0]);
  }
  return s;
}

int64_t length_of(const std::vector<Piece>& pieces) {
  int64_t n = 0;
  for (const Piece& p : pieces) n += p.length;
  return n;
}

int checked_count(int64_t floats) {
  if (floats > INT_MAX) {
    throw Error("head parallelism: an all-to-all block of " + std::to_string(floats) +
                " floats exceeds one MPI message; use more ranks");
  }
  return static_cast<int>(floats);
}

Shape with_heads(const RingPlan& plan, int64_t heads, int64_t length, int64_t width) {
  Shape s = plan.batch_shape;
  s[s.rank() - 1] = heads;
  s.push_back(length);
  s.push_back(width);
  return s;
}

// The exchange itself; counts in floats. Returns seconds spent. On failure, the buffers and
// counts are kept for ever (moved from): MPI may still use them.
double all_to_all(const detail::Communicator& comm, Tensor& send,
                  const std::vector<int64_t>& send_counts, Tensor& receive,
                  const std::vector<int64_t>& receive_counts, uint64_t& bytes_sent) {
  comm.fault_point();
  const auto start = std::chrono::steady_clock::now();
  const int n = comm.size();
  std::vector<int> sc(static_cast<size_t>(n)), sd(static_cast<size_t>(n)),
      rc(static_cast<size_t>(n)), rd(static_cast<size_t>(n));
  int64_t s_at = 0, r_at = 0;
  for (int r = 0; r < n; ++r) {
    sc[static_cast<size_t>(r)] = checked_count(send_counts[static_cast<size_t>(r)]);
    rc[static_cast<size_t>(r)] = checked_count(receive_counts[static_cast<size_t>(r)]);
    sd[static_cast<size_t>(r)] = checked_count(s_at);
    rd[static_cast<size_t>(r)] = checked_count(r_at);
    s_at += send_counts[static_cast<size_t>(r)];
    r_at += receive_counts[static_cast<size_t>(r)];
    if (r != comm.rank())
      bytes_sent += static_cast<uint64_t>(send_counts[static_cast<size_t>(r)]) * 4;
  }
  MPI_Request request = MPI_REQUEST_NULL;
  detail::check_mpi(MPI_Ialltoallv(send.data(), sc.data(), sd.data(), MPI_FLOAT, receive.data(),
                                   rc.data(), rd.data(), MPI_FLOAT, comm.get(), &request),
                    "MPI_Ialltoallv");
  comm.wait_collective(request, "an all-to-all", send, receive, sc, sd, rc, rd);
  return detail::seconds_since(start);
}

struct Exchange {
  const detail::Communicator& comm;
  const RingPlan& plan;
  const HeadSplit& heads;
  RingStatistics& stats;

  // x (outer..., H, L_me, D), this rank's shard of a sequence cut into `pieces`, to
  // (outer..., H_me, L, D).
  Tensor to_heads(const TensorView& x, const Pieces& pieces) {
    const int n = comm.size(), me = comm.rank();
    const int64_t width = x.shape.back(0), mine = x.shape.back(1);
    const int64_t outer = plan.batch / plan.batch_shape.back(0);
    const int64_t total = [&] {
      int64_t t = 0;
      for (const auto& p : pieces) t += length_of(p);
      return t;
    }();
    const ShardPiece my_heads = heads.of_rank[static_cast<size_t>(me)];
    Tensor send(DType::kFloat32, Shape({std::max<int64_t>(1, x.numel())}));
    std::vector<int64_t> send_counts, receive_counts;
    int64_t at = 0;
    for (int t = 0; t < n; ++t) {
      const ShardPiece h = heads.of_rank[static_cast<size_t>(t)];
      const Shape shape = with_heads(plan, h.length, mine, width);
      detail::copy_view(detail::narrow(x, x.rank() - 3, h.offset, h.length),
                        TensorView(send.data_as<float>() + at, DType::kFloat32, shape));
      send_counts.push_back(shape.numel());
      at += shape.numel();
      receive_counts.push_back(outer * my_heads.length * length_of(pieces[static_cast<size_t>(t)]) *
                               width);
    }
    Tensor received(DType::kFloat32,
                    Shape({std::max<int64_t>(1, outer * my_heads.length * total * width)}));
    stats.wait_seconds +=
        all_to_all(comm, send, send_counts, received, receive_counts, stats.bytes_sent);
    Tensor result(DType::kFloat32, with_heads(plan, my_heads.length, total, width));
    const float* from = received.data_as<float>();
    for (int s = 0; s < n; ++s) {
      const std::vector<Piece>& ps = pieces[static_cast<size_t>(s)];
      const int64_t ls = length_of(ps);
      for (int64_t o = 0; o < outer * my_heads.length; ++o) {
        for (const Piece& p : ps) {
          std::memcpy(result.data_as<float>() + (o * total + p.global) * width,
                      from + (o * ls + p.local) * width,
                      static_cast<size_t>(p.length * width) * sizeof(float));
        }
      }
      from += outer * my_heads.length * ls * width;
    }
    return result;
  }

  // y (outer..., H_me, L, D) back to this rank's shard (outer..., H, L_me, D).
  Tensor to_sequence(const TensorView& y, const Pieces& pieces) {
    const int n = comm.size(), me = comm.rank();
    const int64_t width = y.shape.back(0), total = y.shape.back(1);
    const int64_t outer = plan.batch / plan.batch_shape.back(0);
    const int64_t my_heads = heads.of_rank[static_cast<size_t>(me)].length;
    const Tensor whole = Tensor::copy_of(y);  // contiguous
    const int64_t mine = length_of(pieces[static_cast<size_t>(me)]);
    Tensor send(DType::kFloat32, Shape({std::max<int64_t>(1, whole.numel())}));
    std::vector<int64_t> send_counts, receive_counts;
    float* to = send.data_as<float>();
    for (int t = 0; t < n; ++t) {
      const std::vector<Piece>& ps = pieces[static_cast<size_t>(t)];
      for (int64_t o = 0; o < outer * my_heads; ++o) {
        for (const Piece& p : ps) {
          std::memcpy(to, whole.data_as<float>() + (o * total + p.global) * width,
                      static_cast<size_t>(p.length * width) * sizeof(float));
          to += p.length * width;
        }
      }
      send_counts.push_back(outer * my_heads * length_of(ps) * width);
      receive_counts.push_back(outer * heads.of_rank[static_cast<size_t>(t)].length * mine * width);
    }
    Tensor received(DType::kFloat32,
                    Shape({std::max<int64_t>(1, outer * plan.batch_shape.back(0) * mine * width)}));
    stats.wait_seconds +=
        all_to_all(comm, send, send_counts, received, receive_counts, stats.bytes_sent);
    Tensor result(DType::kFloat32, with_heads(plan, plan.batch_shape.back(0), mine, width));
    const float* from = received.data_as<float>();
    for (int s = 0; s < n; ++s) {
      const ShardPiece h = heads.of_rank[static_cast<size_t>(s)];
      const Shape shape = with_heads(plan, h.length, mine, width);
      detail::copy_view(
          TensorView(const_cast<float*>(from), DType::kFloat32, shape),
          detail::narrow(result.view(), result.view().rank() - 3, h.offset, h.length));
      from += shape.numel();
    }
    return result;
  }
};

// (..., L) as (..., L, 1): log-sum-exp through the same exchanges.
TensorView as_column(TensorView t) {
  t.shape.push_back(1);
  t.strides.push_back(1);
  return t;
}
TensorView without_column(TensorView t) {
  Shape shape = Shape::from(t.shape.data(), t.rank() - 1),
        strides = Shape::from(t.strides.data(), t.rank() - 1);
  t.shape = shape;
  t.strides = strides;
  return t;
}

void check_head_parallel(const AttentionOptions& o, const RingPlan& plan) {
  if (plan.batch_shape.rank() < 1) {
    throw Error("head parallelism needs a heads dimension: query (..., H, L, E)");
  }
  const int64_t heads = plan.batch_shape.back(0);
  if (heads < plan.ranks) {
    throw Error("head parallelism needs at least as many heads as ranks: " + std::to_string(heads) +
                " heads, " + std::to_string(plan.ranks) + " ranks (use ring attention)");
  }
  const char* refused = o.mask                ? "mask"
                        : o.bias              ? "bias"
                        : o.segment_ids_query ? "segment ids"
                        : o.user_rules        ? "user_rules"
                        : o.dropout > 0       ? "dropout"
                                              : nullptr;
  if (refused) {
    throw Error(std::string("head parallelism does not take ") + refused +
                " (use ring attention, which places it at global positions)");
  }
}

// The options of this rank's heads: ALiBi's slopes and the sinks of those heads.
AttentionOptions head_options(const AttentionOptions& options, const RingPlan& plan,
                              const ShardPiece& mine, Tensor& slopes) {
  AttentionOptions o = options;
  if (o.alibi && !o.alibi_slopes) {
    const std::vector<float> all = default_alibi_slopes(plan.batch_shape.back(0));
    slopes = Tensor(DType::kFloat32, Shape({static_cast<int64_t>(all.size())}));
    std::copy(all.begin(), all.end(), slopes.data_as<float>());
    o.alibi_slopes = slopes.view();
  }
  if (o.alibi_slopes) o.alibi_slopes = detail::narrow(*o.alibi_slopes, 0, mine.offset, mine.length);
  if (o.sinks) o.sinks = detail::narrow(*o.sinks, 0, mine.offset, mine.length);
  o.need_logsumexp = true;
  return o;
}

ShardResult ulysses_attention_float32(const detail::Communicator& comm, const TensorView& query,
                                      const TensorView& key, const TensorView& value,
                                      const AttentionOptions& options,
                                      const ContextParallelOptions& parallel) {
  const auto call_start = std::chrono::steady_clock::now();
  RingStatistics stats;
  const RingPlan plan =
      detail::agree_on_plan(comm, comm.who(), query, key, value, options, parallel.layout,
                            [&](const RingPlan& p) { check_head_parallel(options, p); });
  const HeadSplit heads = split_heads(plan.batch_shape.back(0), plan.ranks);
  Exchange exchange{comm, plan, heads, stats};
  const Tensor q = exchange.to_heads(query, plan.queries);
  const Tensor k = exchange.to_heads(key, plan.keys);
  const Tensor v = exchange.to_heads(value, plan.keys);
  Tensor slopes;
  const AttentionOptions o =
      head_options(options, plan, heads.of_rank[static_cast<size_t>(plan.rank)], slopes);
  comm.fault_point();
  const auto compute_start = std::chrono::steady_clock::now();
  const AttentionResult r = scaled_dot_product_attention(q.view(), k.view(), v.view(), o);
  stats.compute_seconds = detail::seconds_since(compute_start);
  stats.blocks_computed = 1;
  ShardResult result{exchange.to_sequence(r.output.view(), plan.queries), Tensor()};
  const Tensor lse = exchange.to_sequence(as_column(r.logsumexp.view()), plan.queries);
  result.logsumexp = Tensor::copy_of(without_column(lse.view()));
  stats.steps = 1;
  stats.total_seconds = detail::seconds_since(call_start);
  if (parallel.statistics) *parallel.statistics = stats;
  return result;
}

AttentionGradients ulysses_attention_backward_float32(
    const detail::Communicator& comm, const TensorView& grad_output, const TensorView& query,
    const TensorView& key, const TensorView& value, const TensorView& output,
    const TensorView& logsumexp, const AttentionOptions& options,
    const ContextParallelOptions& parallel) {
  const auto call_start = std::chrono::steady_clock::now();
  RingStatistics stats;
  const RingPlan plan = detail::agree_on_plan(
      comm, comm.who(), query, key, value, options, parallel.layout, [&](const RingPlan& p) {
        check_head_parallel(options, p);
        Shape out_shape = p.batch_shape, lse_shape = p.batch_shape;
        out_shape.push_back(p.query_shard_len());
        out_shape.push_back(p.value_dim);
        lse_shape.push_back(p.query_shard_len());
        for (auto [name, t, shape] : {std::tuple{"grad_output", &grad_output, out_shape},
                                      std::tuple{"output", &output, out_shape},
                                      std::tuple{"logsumexp", &logsumexp, lse_shape}}) {
          if (t->dtype != DType::kFloat32 || t->shape != shape) {
            throw Error(std::string(name) + " " + t->shape.str() + " " + dtype_name(t->dtype) +
                        " should be float32 " + shape.str());
          }
        }
      });
  const HeadSplit heads = split_heads(plan.batch_shape.back(0), plan.ranks);
  const ShardPiece mine = heads.of_rank[static_cast<size_t>(plan.rank)];
  Exchange exchange{comm, plan, heads, stats};
  const Tensor q = exchange.to_heads(query, plan.queries);
  const Tensor k = exchange.to_heads(key, plan.keys);
  const Tensor v = exchange.to_heads(value, plan.keys);
  const Tensor d_out = exchange.to_heads(grad_output, plan.queries);
  const Tensor out = exchange.to_heads(output, plan.queries);
  const Tensor lse = exchange.to_heads(as_column(logsumexp), plan.queries);
  Tensor slopes;
  const AttentionOptions o = head_options(options, plan, mine, slopes);
  comm.fault_point();
  const auto compute_start = std::chrono::steady_clock::now();
  const AttentionGradients h = scaled_dot_product_attention_backward(
      d_out.view(), q.view(), k.view(), v.view(), out.view(), without_column(lse.view()), o);
  stats.compute_seconds = detail::seconds_since(compute_start);
  AttentionGradients g;
  g.query = exchange.to_sequence(h.query.view(), plan.queries);
  g.key = exchange.to_sequence(h.key.view(), plan.keys);
  g.value = exchange.to_sequence(h.value.view(), plan.keys);
  if (options.sinks) {  // this rank's heads; zero elsewhere
    Tensor all = Tensor::zeros(DType::kFloat32, options.sinks->shape);
    convert(h.sinks.view(), detail::narrow(all.view(), 0, mine.offset, mine.length));
    g.sinks = Tensor(options.sinks->dtype, options.sinks->shape);
    convert(all.view(), g.sinks.view());
  }
  stats.steps = 1;
  stats.total_seconds = detail::seconds_since(call_start);
  if (parallel.statistics) *parallel.statistics = stats;
  return g;
}

}  // namespace

ShardResult ulysses_attention(MPI_Comm comm, const TensorView& query, const TensorView& key,
                              const TensorView& value, const AttentionOptions& options,
                              const ContextParallelOptions& parallel) {
  return detail::guarded(comm, "ulysses_attention", parallel, [&](const detail::Communicator& c) {
    return detail::forward_in_float32(
        query, key, value, [&](const TensorView& q, const TensorView& k, const TensorView& v) {
          return ulysses_attention_float32(c, q, k, v, options, parallel);
        });
  });
}

AttentionGradients ulysses_attention_backward(MPI_Comm comm, const TensorView& grad_output,
                                              const TensorView& query, const TensorView& key,
                                              const TensorView& value, const TensorView& output,
                                              const TensorView& logsumexp,
                                              const AttentionOptions& options,
                                              const ContextParallelOptions& parallel) {
  return detail::guarded(comm, "ulysses_attention_backward", parallel,
                         [&](const detail::Communicator& c) {
                           return detail::backward_in_float32(
                               grad_output, query, key, value, output,
                               [&](const TensorView& dout, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& o) {
                                 return ulysses_attention_backward_float32(
                                     c, dout, q, k, v, o, logsumexp, options, parallel);
                               });
                         });
}

}  // namespace attend::mpi
