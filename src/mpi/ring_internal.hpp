// ring_internal.hpp: what the ring's forward and backward share: the communicator (MPI errors
// as attend::Error), the plan every rank agrees on before any exchange, the options of one
// block, and the key/value shards travelling around the ring.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attend/error.hpp"
#include "attend/mpi/ring.hpp"
#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"

namespace attend::mpi::detail {

// Throws attend::Error "<what>: <MPI's message>" unless rc is MPI_SUCCESS.
void check_mpi(int rc, const char* what);

// One call's communicator: a duplicate of the caller's (its own message space; errors
// returned, not fatal) and the failure policy of attend/mpi/ring.hpp: waits that poll with a
// deadline and for other ranks' failure notices. Freed on destruction, unless the call failed
// (then kept, with whatever messages of the failed exchange it may still receive).
class Communicator {
 public:
  // `who` names the call in messages (a string literal).
  Communicator(MPI_Comm comm, const char* who, const ContextParallelOptions& parallel);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  MPI_Comm get() const { return comm_; }
  const char* who() const { return who_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int next() const { return (rank_ + 1) % size_; }
  int previous() const { return (rank_ + size_ - 1) % size_; }

  // Returns once the `count` requests completed. Throws attend::Error when another rank
  // reports a failure (RemoteFailure), or when nothing completes for the timeout. `what`
  // names the wait in messages.
  void wait(MPI_Request* requests, int count, const char* what) const;
  // A non-blocking collective on `request` using `buffers` (moved from on failure: a pending
  // collective cannot be cancelled, so its buffers are kept for ever, never freed).
  template <class... Buffers>
  void wait_collective(MPI_Request& request, const char* what, Buffers&... buffers) const {
    try {
      wait(&request, 1, what);
    } catch (...) {
      (keep_forever(std::move(buffers)), ...);
      throw;
    }
  }
  void barrier(const char* what) const;  // MPI_Ibarrier, waited for

  // Test-only fault injection: the n-th call of fault_point() in this call (n from 0) on the
  // rank named by ATTEND_FAULT=rank:n:kind acts, kind one of: throw (attend::Error), std
  // (std::runtime_error), alloc (an allocation that fails), exit (the process ends, code 3,
  // without MPI_Finalize), stall (sleeps 4 timeouts, then throws: the others must time out first).
  // Inert when unset.
  void fault_point() const;

  // This rank failed with `message`: tells every other rank (a notice each waits for) and
  // keeps the duplicate for ever. No-op for a failure learnt from another rank.
  void fail(const std::string& message) noexcept;
  void abandon() noexcept { failed_ = true; }  // keep the duplicate (messages may be in flight)

  // Moves `storage` into a list kept for the life of the process (under a request that may
  // still use it; reachable, so not a leak for LeakSanitizer).
  template <class T>
  static void keep_forever(T&& storage) {
    keep_forever_erased(std::make_shared<std::decay_t<T>>(std::forward<T>(storage)));
  }

 private:
  static void keep_forever_erased(std::shared_ptr<void> storage);
  void check_for_notice() const;
  MPI_Comm comm_ = MPI_COMM_NULL;
  const char* who_ = "";
  int rank_ = 0, size_ = 1;
  double timeout_ = 10.0;
  bool failed_ = false;
  mutable int fault_points_ = 0;
};

// An error every rank throws alike (found from data every rank has, such as the collective
// check's): no notice is needed and nothing is in flight.
class AgreedError : public Error {
 public:
  using Error::Error;
};

// A failure another rank reported.
class RemoteFailure : public Error {
 public:
  using Error::Error;
};

// Cancels the active requests among `count` and tests them once: false when some are still
// pending (the caller then keeps their buffers for ever). For destructors on exit paths.
bool settle(MPI_Request* requests, int count) noexcept;

// Runs body(comm) on a Communicator of `comm` under the failure policy: on success, a closing
// barrier (every rank reached its end) before returning; on an exception, every other rank
// is told (Communicator::fail) and this rank throws attend::Error (a non-attend exception
// becomes one naming it).
template <class Body>
auto guarded(MPI_Comm comm, const char* who, const ContextParallelOptions& parallel,
             const Body& body) {
  Communicator c(comm, who, parallel);
  try {
    auto result = body(c);
    c.fault_point();
    c.barrier("the closing barrier");
    return result;
  } catch (const AgreedError&) {
    throw;
  } catch (const RemoteFailure&) {
    c.abandon();
    throw;
  } catch (const Error& e) {
    c.fail(e.what());
    throw;
  } catch (const std::exception& e) {
    c.fail(e.what());
    throw Error(std::string(who) + ": " + e.what());
  } catch (...) {
    c.fail("an exception that is not a std::exception");
    throw Error(std::string(who) + ": an exception that is not a std::exception");
  }
}

// A run of this rank's shard: `length` positions from `local` in the shard, at `global`.
struct Piece {
  int64_t local = 0;
  int64_t global = 0;
  int64_t length = 0;
};

// What every rank agreed on: the global lengths and every rank's pieces of queries and keys.
struct RingPlan {
  int ranks = 1, rank = 0;
  Shape batch_shape;  // the leading dimensions of query (the same on every rank)
  int64_t batch = 1;  // their product
  int64_t head_dim = 0, value_dim = 0;
  int64_t query_len = 0, key_len = 0;       // global
  std::vector<std::vector<Piece>> queries;  // [rank] -> pieces of its query shard
  std::vector<std::vector<Piece>> keys;     // [rank] -> pieces of its key shard
  std::vector<int64_t> key_shard_len;       // [rank]
  int64_t query_shard_len() const { return query_shard_len_of(rank); }
  int64_t query_shard_len_of(int r) const;
};

// The collective check (two allgathers): each rank's own arguments first (shapes, dtypes,
// what the ring does not support, then the library's own validation of one block), then
// agreement with rank 0 on shapes and options, and the lengths the layout needs. Throws the
// same attend::Error on every rank when any rank fails. `local_check` adds the caller's own
// checks (the backward's gradients and saved outputs); `who` prefixes messages.
RingPlan agree_on_plan(const Communicator& comm, const char* who, const TensorView& query,
                       const TensorView& key, const TensorView& value,
                       const AttentionOptions& options, ShardLayout layout,
                       const std::function<void(const RingPlan&)>& local_check = {});

// Whether a row may see no key at all and then need the uniform weights of
// FullyMaskedRows::kUniform over every key (a second pass; without sinks, which empty it).
bool may_leave_rows_empty(const AttentionOptions& options);

// `from` (same dtype, any strides) into `to` of its shape (any strides): whole rows when both
// last dimensions are contiguous (attend::convert goes element by element).
void copy_view(const TensorView& from, const TensorView& to);

// Half-precision shards: a float32 copy (in `storage`) of a float16 or bfloat16 view, what the
// ring computes and sends; any other view as it is (the collective check names what it
// refuses). in_dtype: a float32 result back in the caller's dtype.
TensorView as_float32(const TensorView& t, Tensor& storage);
Tensor in_dtype(Tensor t, DType dtype);

// A backward over float32 shards for shards of any float dtype: `backward(dO, Q, K, V, O)` on
// float32 copies (as_float32), the gradients back in Q's, K's and V's dtypes.
template <class Backward>
AttentionGradients backward_in_float32(const TensorView& grad_output, const TensorView& query,
                                       const TensorView& key, const TensorView& value,
                                       const TensorView& output, const Backward& backward) {
  Tensor storage[5];
  AttentionGradients g = backward(as_float32(grad_output, storage[0]),
                                  as_float32(query, storage[1]), as_float32(key, storage[2]),
                                  as_float32(value, storage[3]), as_float32(output, storage[4]));
  g.query = in_dtype(std::move(g.query), query.dtype);
  g.key = in_dtype(std::move(g.key), key.dtype);
  g.value = in_dtype(std::move(g.value), value.dtype);
  return g;
}

// A forward over float32 shards for shards of any float dtype: `forward(Q, K, V)` on float32
// copies (as_float32), the output back in Q's dtype.
template <class Forward>
ShardResult forward_in_float32(const TensorView& query, const TensorView& key,
                               const TensorView& value, const Forward& forward) {
  Tensor storage[3];
  ShardResult r = forward(as_float32(query, storage[0]), as_float32(key, storage[1]),
                          as_float32(value, storage[2]));
  r.output = in_dtype(std::move(r.output), query.dtype);
  return r;
}

// `length` entries of dimension `dim` from `start` (a view of the same storage).
TensorView narrow(TensorView view, int dim, int64_t start, int64_t length);

// The travelling key/value shard of one rank: K (batch, Lk_o, E), V (batch, Lk_o, Ev) and, with
// documents, the key segment ids as int32 (segment batch..., Lk_o), packed in one buffer.
class KeyBlocks {
 public:
  KeyBlocks(const RingPlan& plan, const TensorView& key, const TensorView& value,
            const std::optional<TensorView>& segment_ids_key);
  ~KeyBlocks();  // requests in flight cancelled; their buffers kept for ever if still pending
  KeyBlocks(const KeyBlocks&) = delete;
  KeyBlocks& operator=(const KeyBlocks&) = delete;
  // The block held at step s (owner (rank − s) mod N) and its views.
  int owner(int step) const;
  TensorView key(int step) const;
  TensorView value(int step) const;
  std::optional<TensorView> segments(int step) const;
  // Sends the block of step s onward and receives that of step s + 1; finish() waits for both
  // and makes it current. Returns seconds blocked.
  void start(const Communicator& comm, int step);
  double finish(const Communicator& comm);
  // One step of the ring: the block of step s made current (s > 0: without overlap, after a
  // barrier, so that the wait is the transfer alone) and, with overlap, the transfer of step
  // s + 1's block started; then a fault point. Returns seconds blocked.
  double advance(const Communicator& comm, int step, bool overlap);
  uint64_t bytes_sent() const { return bytes_sent_; }

 private:
  int64_t floats_for(int owner) const;
  const float* current() const { return buffers_[current_].data_as<float>(); }
  const RingPlan& plan_;
  Shape segment_shape_;  // the key segment ids' leading dimensions (rank − 1 of them)
  bool documents_ = false;
  int current_ = 0;
  Tensor buffers_[2];
  MPI_Request requests_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  uint64_t bytes_sent_ = 0;
};

// The block's slice of a (..., rows, columns) mask or bias (this rank's query rows, every key
// in global order), leaving broadcast dimensions whole.
TensorView block_slice(const TensorView& t, const Piece& q, const Piece& k);

// The options of block (query piece q of this rank, key piece k of `owner`): global
// positions, the block's slices of mask, bias and segment ids, no sinks (the merge adds each
// row's sink once), fully excluded rows zero (a block where a row sees no key adds nothing).
AttentionOptions block_options(const AttentionOptions& options, const RingPlan& plan,
                               const Piece& q, const Piece& k,
                               const std::optional<TensorView>& key_segments);

// Whether causality, the window or the prefix hide every key of the block from every query.
bool block_is_hidden(const AttentionOptions& block, int64_t query_len, int64_t key_len);

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace attend::mpi::detail
