// attend/mpi/ring.hpp: context parallelism over MPI (the optional attend_mpi library, built
// when MPI is found; the core library has no MPI dependency).
//
// The sequence is cut into shards, one per rank of a communicator; batch and heads are whole
// on every rank. Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"):
// each rank keeps its query shard and passes its key/value shard around the ring; at step s
// (s = 0 .. N−1) rank r holds the keys of rank (r − s) mod N and computes the blocks
// (its queries × those keys) with the fused kernel at their global positions
// (AttentionOptions::block), while the next shard travels (non-blocking sends and receives,
// double buffered). The blocks' outputs merge exactly by their log-sum-exp, in step order:
//
//   lse = log(Σ_s exp(lse_s) + exp(sink)),   O = Σ_s exp(lse_s − lse)·O_s
//
// so a result is bitwise the same from run to run for a given rank count, and equal to the
// single-process call within the error model. Blocks that causality or a window hide
// entirely are skipped.
//
// Layouts (ShardLayout): contiguous shards of any lengths (rank r holds positions
// [Σ_{r'<r} L_r', Σ_{r'<=r} L_r'), in rank order), or zigzag, balanced under causality: the
// sequence in 2N equal chunks, rank r holding chunks r and 2N − 1 − r (in that order).
//
// The options are the single-process call's (attend/sdpa.hpp), for the whole problem:
//   - mask and bias: this rank's query rows in shard order, every key in global order,
//     (..., Lq_r or 1, Lk or 1), Lk the global key length;
//   - segment_ids_query: this rank's (..., Lq_r); segment_ids_key: this rank's (..., Lk_r),
//     which travel with the keys;
//   - causal (and its alignment to the global lengths), window, ALiBi, softcap, sinks,
//     prefix, user rules (called with global indices), dropout (the draw of global
//     (batch, query, key): the same bits as one process), fully_masked_rows, scale,
//     num_threads and backend apply as in one process;
//   - need_weights and block are refused.
// Every rank checks its arguments, then all ranks compare theirs (shapes, dtypes, options,
// lengths the layout needs) in two allgathers before any exchange: a rank that disagrees
// makes every rank throw the same attend::Error, none is left waiting. MPI errors become
// attend::Error. Shards are float32, float16 or bfloat16: half precision is widened to
// float32 on entry (computed and sent as float32, twice its bytes on the wire) and the
// output (gradients) come back in the inputs' dtypes; logsumexp is float32.
//
// Failure without a hang (every call here): a failure on one rank after the collective check
// (an exception, an allocation that fails, a peer that stalls or vanishes) ends the call on
// every rank with an attend::Error within ContextParallelOptions::timeout_seconds (10 s by
// default). The policy: every wait polls (MPI_Test) with a deadline, so no rank blocks for
// longer than the timeout without progress; a rank that fails tells every other rank at once
// (a notice on the call's own communicator, which each wait also polls), so they end within
// milliseconds instead of at the deadline; a call succeeds on a rank only once every rank
// reached its end (a closing barrier). The library never calls MPI_Abort: the caller decides
// (abort the job, or go on: the caller's communicator stays usable). Requests in flight on
// an exit path are cancelled or completed; a buffer MPI may still use is never freed (it is
// kept, with the failed call's duplicate communicator, for the life of the process: a few
// buffers per failure, so that no message of a failed exchange can reach a later call).
// Rank-count-independent failures (bad arguments) are found by the collective check and need
// none of this. Fault injection for tests: ATTEND_FAULT (tests/ring_fault_test.cc).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "attend/tensor.hpp"

namespace attend::mpi {

enum class ShardLayout : uint8_t {
  kContiguous,  // one run of positions per rank, any lengths
  kZigzag,      // chunks r and 2N − 1 − r of 2N equal chunks: balanced causal work
};

// One run of global positions [offset, offset + length) held by a rank.
struct ShardPiece {
  int64_t offset = 0;
  int64_t length = 0;
};

// The runs of global positions rank `rank` of `ranks` holds, in the order of its shard, for
// a sequence of `length`: the contiguous layout splits as evenly as it can (the first
// length % ranks ranks one position more), zigzag needs 2·ranks | length. Throws
// attend::Error otherwise.
std::vector<ShardPiece> shard_pieces(ShardLayout layout, int64_t length, int ranks, int rank);

// What one call did, for benchmarks (per rank).
struct RingStatistics {
  int steps = 0;                 // ring steps (the rank count)
  int64_t blocks_computed = 0;   // kernel calls (zigzag: up to 4 per step)
  int64_t blocks_skipped = 0;    // blocks that position hides entirely
  double compute_seconds = 0.0;  // in the kernels and the merge
  double wait_seconds = 0.0;     // blocked on transfers (not hidden by computation)
  double total_seconds = 0.0;    // the whole call, validation included
  uint64_t bytes_sent = 0;       // by this rank
};

struct ContextParallelOptions {
  ShardLayout layout = ShardLayout::kContiguous;
  // Start the next step's transfer before computing this step's blocks (double buffering).
  // false: each transfer starts once every rank finished the previous step (a barrier) and
  // completes before the step computes: RingStatistics::wait_seconds is then the transfers
  // alone (benchmarks; what overlap hides).
  bool overlap = true;
  RingStatistics* statistics = nullptr;  // filled when not null
  // The bound on a failure: a wait for other ranks that makes no progress for this many
  // seconds ends the call with attend::Error on this rank (a peer failed or stalled). Keep it
  // above the longest computation of one step on the slowest rank. 0: the environment
  // variable ATTEND_MPI_TIMEOUT (seconds) if set, else 10; infinity: no deadline.
  double timeout_seconds = 0.0;
};

// This rank's output (..., Lq_r, Ev) and log-sum-exp (..., Lq_r), float32; lse as the
// single-process call's (AttentionResult::logsumexp), always returned.
struct ShardResult {
  Tensor output;
  Tensor logsumexp;
};

// query (..., Lq_r, E), key (..., Lk_r, E), value (..., Lk_r, Ev): this rank's shards.
ShardResult ring_attention(MPI_Comm comm, const TensorView& query, const TensorView& key,
                           const TensorView& value, const AttentionOptions& options = {},
                           const ContextParallelOptions& parallel = {});

// The backward of ring_attention (attend/sdpa_backward.hpp's formulas): grad_output and
// output (..., Lq_r, Ev), logsumexp (..., Lq_r) as ring_attention returned them. dQ stays on
// its rank; dK and dV travel around the ring with their blocks, each rank adding its part
// in ring order, and reach their owners: deterministic for a given rank count. The bias and
// sinks gradients are this rank's part (its query rows): sum them over the ranks for the
// whole problem's. Rows of the forward's logsumexp at the fully excluded value
// (kExcludedScore + log Lk, FullyMaskedRows::kUniform) are taken as fully excluded rows.
AttentionGradients ring_attention_backward(MPI_Comm comm, const TensorView& grad_output,
                                           const TensorView& query, const TensorView& key,
                                           const TensorView& value, const TensorView& output,
                                           const TensorView& logsumexp,
                                           const AttentionOptions& options = {},
                                           const ContextParallelOptions& parallel = {});

// ---- Head parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) ---------------------------
//
// The same shards as the ring (query (..., H, Lq_r, E) etc., any layout), but one all-to-all
// turns them into head shards (rank r gets heads [H·r/N, H·(r+1)/N) of the whole sequence,
// the remainder spread over the first ranks), the ordinary fused kernel runs once, and one
// all-to-all brings the output back to sequence shards. Moves 4 tensors of the shard's size
// (Q, K, V in, O out) per call against the ring's N − 1 K/V shards, and runs one call of the
// whole sequence (no per-block overhead); it needs H >= N heads (the last batch dimension).
// Supports causal (and its alignment), window, ALiBi, softcap, sinks, prefix and scale;
// refuses mask, bias, segment ids, user rules and dropout (their per-rank slices or indices
// would need the ring's block positions). ulysses_attention_backward: the same all-to-alls
// around the library's backward; the sinks gradient is this rank's part (its heads).
ShardResult ulysses_attention(MPI_Comm comm, const TensorView& query, const TensorView& key,
                              const TensorView& value, const AttentionOptions& options = {},
                              const ContextParallelOptions& parallel = {});

AttentionGradients ulysses_attention_backward(MPI_Comm comm, const TensorView& grad_output,
                                              const TensorView& query, const TensorView& key,
                                              const TensorView& value, const TensorView& output,
                                              const TensorView& logsumexp,
                                              const AttentionOptions& options = {},
                                              const ContextParallelOptions& parallel = {});

}  // namespace attend::mpi
