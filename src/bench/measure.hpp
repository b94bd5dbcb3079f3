// measure.hpp: wall-clock timing by repetition, a memory-write probe and peak RSS, for
// `attend bench` and the benchmark suites. No assertion anywhere depends on these figures.
#pragma once

#include <cstdint>
#include <functional>

namespace attend::bench {

struct RepeatedTiming {
  double median_seconds = 0;  // per call: the median over repetitions
  double best_seconds = 0;    // per call: the fastest repetition
  int64_t calls_per_repetition = 0;
  // Process CPU time per call (all threads), the median over repetitions: on a shared host
  // it leaves out the time other processes hold the cores (not what they take from caches).
  double median_cpu_seconds = 0;
};

// One untimed warm-up call, then `repetitions` repetitions; each repeats `call` until it has
// run at least `min_seconds` (at least once) and counts elapsed / calls. Throws
// attend::Error when repetitions < 1 or min_seconds < 0.
RepeatedTiming time_repeated(const std::function<void()>& call, int repetitions,
                             double min_seconds);

// Seconds to overwrite a `bytes`-byte buffer (already faulted in) once, memset split over
// `num_threads` OpenMP threads: the cost of streaming that much output to memory. Median of
// repetitions lasting at least `min_seconds` in all.
double measure_write_seconds(int64_t bytes, int num_threads, double min_seconds = 0.1);

// Peak resident set size of this process so far (getrusage), in bytes; 0 if unavailable.
int64_t peak_rss_bytes();

}  // namespace attend::bench
