// read_bandwidth.hpp: the machine's measured memory read bandwidth, the denominator of the
// memory-bound cases' "% of read" (decode).
#pragma once

#include <cstdint>
#include <string>

namespace attend::bench {

// 512 MiB: larger than the whole L3 cache of the machines we measure on (the development
// host reports 300 MiB, shared with other tenants), so that most of every pass comes from
// memory even when the other tenants leave the L3 to us. There, on 2 threads, 64 MiB read at
// about 43 GB/s (L3), 128 MiB at 33–37, 192 MiB at 29–34, 256 MiB at 26–31 and 512 MiB to
// 2 GiB alike at 28–29. Faulting in costs about 0.6 s per GiB on 2 threads, which keeps it
// from being larger still.
inline constexpr int64_t kReadProbeDefaultBytes = int64_t{512} << 20;

struct ReadBandwidth {
  double gbps = 0;  // bytes read per second of wall time over all threads, in 10⁹/s
  int threads = 0;
  int64_t bytes = 0;   // size of the buffer read: the bytes asked for, rounded up to floats
  std::string target;  // the SIMD target the probe dispatched to, e.g. "AVX3"
};

// Reads a `bytes`-byte float buffer, allocated and faulted in by the first call (each thread
// writes the part it will read) and kept for later calls of the same size, with `num_threads` OpenMP threads each sum their contiguous part as 8
// slices read side by side (8 streams, 8 independent vector accumulators), through the same
// Highway dispatch as the kernels (so ATTEND_MAX_SIMD caps it too). GB/s = bytes read /
// wall time of the whole parallel region, as decode's GB/s is, not per-thread CPU time as
// in the FMA peak: FMA units belong to one core, but memory bandwidth is one resource
// shared by all threads, so while one thread is descheduled the others read faster, and
// summing each thread's bytes / its own CPU time would count that bandwidth twice. Each
// trial repeats whole passes over the buffer for about `min_seconds`; the best of three
// trials is returned. With the defaults the whole probe takes 0.5-0.7 s on 2 threads.
// Throws attend::Error when num_threads < 1, bytes <= 0 or min_seconds is not positive.
ReadBandwidth measure_read_bandwidth(int num_threads, int64_t bytes = kReadProbeDefaultBytes,
                                     double min_seconds = 0.05);

}  // namespace attend::bench
