// ragged.hpp: what ragged batches (varlen.cpp) and paged attention (paged_attention.cpp) share:
// the sequences of a batch and how they are spread over threads.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"
#include "work_size.hpp"

namespace attend::detail {

// Sequence s: queries [q_begin, q_begin + q_len) of the packed query, keys k_len.
struct RaggedSequence {
  int64_t q_begin, q_len, k_begin, k_len;
};

// The offsets of one cu_seqlens tensor (int32 (B + 1), 0 first, non-decreasing, `total`
// last), as int64. Throws attend::Error naming `name`.
std::vector<int64_t> read_offsets(const char* name, const TensorView& cu, int64_t total);
// Rows [begin, begin + length) of a packed (total, heads, dim) tensor as (heads, length, dim).
TensorView sequence_view(const TensorView& packed, int64_t begin, int64_t length);
// Rows [begin, begin + length) of a packed float32 (total, heads) tensor as (heads, length).
TensorView sequence_rows(const TensorView& packed, int64_t begin, int64_t length);
// An output of the packed layout: shape, dtype, no zero strides, no overlap with `inputs`.
void check_packed_output(const char* name, const TensorView& out, const Shape& expected,
                         DType dtype, const std::vector<const TensorView*>& inputs);

// Runs body(s, threads) for every sequence with queries: those with at least a thread's share
// of the work one after another on all threads, then the rest in parallel on one thread
// each, the largest first. Each sequence's result does not depend on its thread count.
// `dims` (E + Ev) sizes the work: a batch with less than kMultiplyAddsPerThread
// multiply-adds per thread uses fewer threads (work_size.hpp: waking and joining threads
// would cost more than the work).

template <class Body>
void schedule_sequences(const std::vector<RaggedSequence>& sequences, int64_t heads, int64_t dims,
                        int threads, const Body& body) {
  std::vector<std::pair<double, size_t>> work;
  double total = 0;
  for (size_t s = 0; s < sequences.size(); ++s) {
    if (sequences[s].q_len == 0) continue;
    const double w = static_cast<double>(heads) * static_cast<double>(sequences[s].q_len) *
                     static_cast<double>(sequences[s].k_len);
    work.emplace_back(w, s);
    total += w;
  }
  threads = threads_for_work(threads, total * static_cast<double>(dims));
  std::stable_sort(work.begin(), work.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  size_t first_small = 0;
  while (first_small < work.size() && threads > 1 && work[first_small].first * threads >= total) {
    body(work[first_small++].second, threads);
  }
  if (threads <= 1) {
    for (size_t n = first_small; n < work.size(); ++n) body(work[n].second, 1);
    return;
  }
  std::exception_ptr failure;
  const auto count = static_cast<int64_t>(work.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (auto n = static_cast<int64_t>(first_small); n < count; ++n) {
    try {
      body(work[static_cast<size_t>(n)].second, 1);
    } catch (...) {
#pragma omp critical(attend_varlen_failure)
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

inline int threads_of(const AttentionOptions& options) {
  if (options.num_threads < 0) {
    throw Error("num_threads must be >= 0 (0 = default), got " +
                std::to_string(options.num_threads));
  }
  return options.num_threads > 0 ? options.num_threads : default_num_threads();
}

}  // namespace attend::detail
