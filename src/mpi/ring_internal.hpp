// ring_internal.hpp: what the ring's forward and backward share: the communicator (MPI errors
// as attend::Error), the plan every rank agrees on before any exchange, the options of one
// block, and the key/value shards travelling around the ring.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "attend/mpi/ring.hpp"
#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"

namespace attend::mpi::detail {

// A duplicate of the caller's communicator (its own message space; errors returned, not
// fatal), freed on destruction.
class Communicator {
 public:
  explicit Communicator(MPI_Comm comm);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int next() const { return (rank_ + 1) % size_; }
  int previous() const { return (rank_ + size_ - 1) % size_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

// Throws attend::Error "<what>: <MPI's message>" unless rc is MPI_SUCCESS.
void check_mpi(int rc, const char* what);

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

// `length` entries of dimension `dim` from `start` (a view of the same storage).
TensorView narrow(TensorView view, int dim, int64_t start, int64_t length);

// The travelling key/value shard of one rank: K (batch, Lk_o, E), V (batch, Lk_o, Ev) and, with
// documents, the key segment ids as int32 (segment batch..., Lk_o), packed in one buffer.
class KeyBlocks {
 public:
  KeyBlocks(const RingPlan& plan, const TensorView& key, const TensorView& value,
            const std::optional<TensorView>& segment_ids_key);
  // The block held at step s (owner (rank − s) mod N) and its views.
  int owner(int step) const;
  TensorView key(int step) const;
  TensorView value(int step) const;
  std::optional<TensorView> segments(int step) const;
  // Sends the block of step s onward and receives that of step s + 1; finish() waits for both
  // and makes it current. Returns seconds blocked.
  void start(const Communicator& comm, int step);
  double finish();
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

// The listing's log-sum-exp of a row with every key excluded: -1e9 + log Lk.
float fully_excluded_logsumexp(int64_t key_len);

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace attend::mpi::detail
