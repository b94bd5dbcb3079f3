// work_size.hpp: how many threads a piece of work is worth, the one rule for every parallel
// region of attend (the attention kernels' work lists, the ragged and paged schedulers, the
// projection GEMM).
//
//   threads = min(num_threads, items, floor(multiply_adds / kMultiplyAddsPerThread) + 1)
//
// so work below kMultiplyAddsPerThread runs inline on the calling thread (no parallel region)
// and each further thread gets at least that much. The count changes who computes a work item,
// never how: every caller computes each item with the same instruction sequence on any thread,
// so results are bitwise the same at any thread count.
//
// A region of one thread is never opened: parallel_for runs such work inline (libgomp's
// one-thread region still ends in a futex wake, a system call per region).
//
// The constant: a thread is worth waking for 2^22 multiply-adds (tens of microseconds of the
// GEMM or the attention kernels on one AVX-512 core, more on narrower targets). Starting and joining a region of 2 threads costs about 3-4 us where the
// waiting thread spins on an idle core (libgomp's default) and about 60 us where it sleeps
// (OMP_WAIT_POLICY=passive: a futex wake, an interrupt between cores of a virtual machine),
// measured on a 2-vCPU Zen 5 guest; on a busy host a waiting thread may first wait for the
// scheduler. A decoding step of a small model (32 sequences of a few hundred keys, a 128-wide
// layer: 0.5-2 M multiply-adds per call) stays on one thread: in the tiny decoder's steps
// (attend serve-bench) every threshold from 2^18 to never gave 2 threads the speed of one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace attend::detail {

inline constexpr double kMultiplyAddsPerThread = 4194304.0;

// The threads worth using for `multiply_adds` of work split into `items` independent items,
// at most `num_threads` (>= 1); 1 means run inline.
inline int threads_for_work(int num_threads, double multiply_adds,
                            int64_t items = std::numeric_limits<int64_t>::max()) {
  const double worth = multiply_adds / kMultiplyAddsPerThread + 1;
  const double threads = std::min({static_cast<double>(num_threads), static_cast<double>(items),
                                   std::max(1.0, worth)});
  return std::max(1, static_cast<int>(threads));
}

// Runs body(i) for i in [0, count): inline on the calling thread when threads <= 1, else an
// OpenMP `parallel for` on `threads` threads, schedule(static). body must not throw.
template <class Body>
void parallel_for(int threads, int64_t count, const Body& body) {
  if (threads <= 1 || count <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < count; ++i) body(i);
}

}  // namespace attend::detail
