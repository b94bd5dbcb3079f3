// ring_bench.hpp: `attend bench --ring`, context parallelism against one process (built with
// attend_mpi only; run under mpirun).
#pragma once

#include <cstdint>

namespace attend::cli {

struct RingBenchSettings {
  int64_t batch = 1, heads = 8, length = 16384, head_dim = 64;  // the whole problem
  int threads = 1;                                              // per rank
  int repetitions = 3;
  bool causal = true, non_causal = true;
  bool baseline = true;  // rank 0 alone on the whole problem
  bool json = false;
};

void run_ring_bench(const RingBenchSettings& settings);

}  // namespace attend::cli
