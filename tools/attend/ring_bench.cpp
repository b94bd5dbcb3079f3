// ring_bench.cpp: `mpirun -np N attend bench --ring [--ring-shape B,H,L,E] [--threads T]`:
// context parallelism against one process, in one run.
//
// 1. Loopback bandwidth: a ping-pong of one K/V shard's bytes between ranks 0 and 1.
// 2. For non-causal (contiguous layout) and causal (zigzag): rank 0 alone runs the whole
//    problem (the baseline, T threads, the other ranks idle in a sleeping barrier); then every
//    rank runs ring attention on its shard with overlap and without it (the transfers then
//    complete before each step computes, which measures them), and head parallelism when
//    H >= N. Each call's time is the slowest rank's; medians of the repetitions.
// Reported: parallel efficiency T_1 / (N·T_N), the ring's time over its compute alone
// (the slowest rank's kernel and merge time, from the run without overlap), and the exchange
// per step in GB/s beside the loopback bandwidth.
#include "ring_bench.hpp"

#include <mpi.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/mpi/ring.hpp"
#include "attend/sdpa.hpp"
#include "mpi_session.hpp"
#include "ring_shards.hpp"

namespace attend::cli {
namespace {

double now() { return MPI_Wtime(); }

// This process's CPU time: on a shared host the ranks may get less than a core each, and the
// CPU seconds a call costs (summed over the ranks) measure its work whatever the share.
double cpu_now() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double sum_over_ranks(MPI_Comm comm, double x) {
  double s = x;
  MPI_Allreduce(&x, &s, 1, MPI_DOUBLE, MPI_SUM, comm);
  return s;
}

// A barrier that sleeps instead of spinning: idle ranks leave the cores to rank 0's baseline.
void quiet_barrier(MPI_Comm comm) {
  MPI_Request request;
  MPI_Ibarrier(comm, &request);
  for (int done = 0;;) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) return;
    const timespec pause{0, 1000000};
    nanosleep(&pause, nullptr);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double max_over_ranks(MPI_Comm comm, double x) {
  double m = x;
  MPI_Allreduce(&x, &m, 1, MPI_DOUBLE, MPI_MAX, comm);
  return m;
}

// One-way bandwidth between ranks 0 and 1 for messages of `bytes`: median of ping-pongs.
double loopback_gbps(MPI_Comm comm, int64_t bytes, int rank) {
  std::vector<char> buffer(static_cast<size_t>(bytes));
  std::vector<double> times;
  for (int rep = 0; rep < 11; ++rep) {
    MPI_Barrier(comm);
    const double start = now();
    const int count = static_cast<int>(bytes);
    if (rank == 0) {
      MPI_Send(buffer.data(), count, MPI_BYTE, 1, 7, comm);
      MPI_Recv(buffer.data(), count, MPI_BYTE, 1, 7, comm, MPI_STATUS_IGNORE);
    } else if (rank == 1) {
      MPI_Recv(buffer.data(), count, MPI_BYTE, 0, 7, comm, MPI_STATUS_IGNORE);
      MPI_Send(buffer.data(), count, MPI_BYTE, 0, 7, comm);
    }
    if (rep > 0) times.push_back((now() - start) / 2);
  }
  double one_way = median(times);
  MPI_Bcast(&one_way, 1, MPI_DOUBLE, 0, comm);
  return static_cast<double>(bytes) / one_way / 1e9;
}

// The whole problem, the same on every rank.
Tensor seeded(const Shape& shape, uint32_t seed) {
  Tensor t(DType::kFloat32, shape);
  uint32_t x = seed * 2654435761u + 1;
  for (int64_t n = 0; n < t.numel(); ++n) {
    x = x * 1664525u + 1013904223u;
    t.data_as<float>()[n] = static_cast<float>(x >> 8) / 8388608.0f - 1.0f;
  }
  return t;
}

struct Row {
  std::string method;  // "1 rank", "ring", "ring (no overlap)", "ulysses"
  bool causal = false;
  std::string layout;
  double seconds = 0;          // median, the slowest rank
  double compute_seconds = 0;  // median, the slowest rank
  double wait_seconds = 0;
  double bytes_per_step = 0;  // one rank's K/V shard
  double efficiency = 0;      // T_1 / (N · T_N)
  double gflops = 0;          // of the whole problem per second
  double cpu_seconds = 0;     // median, summed over the ranks
  double cpu_efficiency = 0;  // CPU(1 rank) / Σ CPU(ranks)
};

}  // namespace

void run_ring_bench(const RingBenchSettings& s) {
  ensure_mpi();
  MPI_Comm comm = MPI_COMM_WORLD;
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  const int64_t B = s.batch, H = s.heads, L = s.length, E = s.head_dim;
  if (L % (2 * ranks) != 0) {
    throw Error("--ring-shape: the length " + std::to_string(L) +
                " must be a multiple of 2 x the rank count (" + std::to_string(2 * ranks) +
                ") for the zigzag layout");
  }
  const Shape shape{B, H, L, E};
  const Tensor q = seeded(shape, 1), k = seeded(shape, 2), v = seeded(shape, 3);
  const double shard_bytes = static_cast<double>(B * H * (L / ranks) * 2 * E) * sizeof(float);
  const double loopback =
      ranks >= 2 ? loopback_gbps(comm, static_cast<int64_t>(shard_bytes), rank) : 0.0;
  if (rank == 0) {
    std::fprintf(stderr,
                 "attend bench --ring: %d rank(s) x %d thread(s), (%lld, %lld, %lld, %lld)\n",
                 ranks, s.threads, static_cast<long long>(B), static_cast<long long>(H),
                 static_cast<long long>(L), static_cast<long long>(E));
  }
  std::vector<Row> rows;
  for (bool causal : {false, true}) {
    if ((causal && !s.causal) || (!causal && !s.non_causal)) continue;
    const double flops = attention_flops(B * H, L, L, E, E, causal);
    AttentionOptions options;
    options.causal = causal;
    options.num_threads = s.threads;
    const mpi::ShardLayout layout =
        causal ? mpi::ShardLayout::kZigzag : mpi::ShardLayout::kContiguous;
    const char* layout_name = causal ? "zigzag" : "contiguous";
    // 1. Rank 0 alone.
    double baseline = 0, baseline_cpu = 0;
    if (s.baseline) {
      if (rank == 0) std::fprintf(stderr, "  %s: 1 rank ...\n", causal ? "causal" : "non-causal");
      std::vector<double> times, cpus;
      for (int rep = 0; rep <= s.repetitions; ++rep) {
        if (rank == 0) {
          const double start = now(), cpu_start = cpu_now();
          (void)scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
          if (rep > 0) {  // the first call warms up
            times.push_back(now() - start);
            cpus.push_back(cpu_now() - cpu_start);
          }
        }
        quiet_barrier(comm);
      }
      double measured[2] = {rank == 0 ? median(times) : 0, rank == 0 ? median(cpus) : 0};
      MPI_Bcast(measured, 2, MPI_DOUBLE, 0, comm);
      baseline = measured[0];
      baseline_cpu = measured[1];
      rows.push_back({"1 rank", causal, "-", baseline, baseline, 0, 0, 1.0, flops / baseline / 1e9,
                      baseline_cpu, 1.0});
    }
    // 2. The shards, ring with and without overlap, head parallelism.
    const auto pieces = mpi::shard_pieces(layout, L, ranks, rank);
    const Tensor qs = gather_rows(q.view(), pieces), ks = gather_rows(k.view(), pieces),
                 vs = gather_rows(v.view(), pieces);
    struct Method {
      const char* name;
      bool overlap;
      bool ulysses;
    };
    for (const Method m : {Method{"ring", true, false}, Method{"ring (no overlap)", false, false},
                           Method{"ulysses", true, true}}) {
      if (m.ulysses && H < ranks) continue;
      if (rank == 0)
        std::fprintf(stderr, "  %s: %s ...\n", causal ? "causal" : "non-causal", m.name);
      mpi::RingStatistics stats;
      mpi::ContextParallelOptions parallel;
      parallel.layout = layout;
      parallel.overlap = m.overlap;
      parallel.statistics = &stats;
      std::vector<double> times, computes, waits, cpus;
      for (int rep = 0; rep <= s.repetitions; ++rep) {
        MPI_Barrier(comm);
        const double start = now(), cpu_start = cpu_now();
        if (m.ulysses) {
          (void)mpi::ulysses_attention(comm, qs.view(), ks.view(), vs.view(), options, parallel);
        } else {
          (void)mpi::ring_attention(comm, qs.view(), ks.view(), vs.view(), options, parallel);
        }
        const double cpu = sum_over_ranks(comm, cpu_now() - cpu_start);
        const double elapsed = max_over_ranks(comm, now() - start);
        const double compute = max_over_ranks(comm, stats.compute_seconds);
        const double wait = max_over_ranks(comm, stats.wait_seconds);
        if (rep > 0) {
          times.push_back(elapsed);
          computes.push_back(compute);
          waits.push_back(wait);
          cpus.push_back(cpu);
        }
      }
      const double t = median(times), cpu = median(cpus);
      rows.push_back({m.name, causal, m.ulysses ? "-" : layout_name, t, median(computes),
                      median(waits), m.ulysses ? 0 : shard_bytes,
                      baseline > 0 ? baseline / (ranks * t) : 0, flops / t / 1e9, cpu,
                      baseline_cpu > 0 ? baseline_cpu / cpu : 0});
    }
  }
  if (rank != 0) return;
  // The ring's compute alone: the run without overlap's kernel and merge time.
  const auto compute_alone = [&](bool causal) {
    for (const Row& r : rows) {
      if (r.causal == causal && r.method == "ring (no overlap)") return r.compute_seconds;
    }
    return 0.0;
  };
  if (s.json) {
    for (const Row& r : rows) {
      nlohmann::json j = {{"bench", "ring"},
                          {"ranks", ranks},
                          {"threads", s.threads},
                          {"batch", B},
                          {"heads", H},
                          {"length", L},
                          {"head_dim", E},
                          {"causal", r.causal},
                          {"method", r.method},
                          {"layout", r.layout},
                          {"median_seconds", r.seconds},
                          {"compute_seconds", r.compute_seconds},
                          {"wait_seconds", r.wait_seconds},
                          {"efficiency", r.efficiency},
                          {"gflops", r.gflops},
                          {"loopback_gbps", loopback},
                          {"cpu_seconds", r.cpu_seconds},
                          {"cpu_efficiency", r.cpu_efficiency}};
      if (r.bytes_per_step > 0 && r.method == "ring (no overlap)" && ranks > 1) {
        j["exchange_gbps"] = r.bytes_per_step * (ranks - 1) / r.wait_seconds / 1e9;
      }
      if (r.method == "ring") j["time_over_compute"] = r.seconds / compute_alone(r.causal);
      std::cout << j.dump() << '\n';
    }
    return;
  }
  std::printf(
      "attend bench --ring: %d rank(s) x %d thread(s), (B, H, L, E) = (%lld, %lld, %lld, %lld), "
      "median of %d\n",
      ranks, s.threads, static_cast<long long>(B), static_cast<long long>(H),
      static_cast<long long>(L), static_cast<long long>(E), s.repetitions);
  std::printf("%-18s %-6s %-10s %10s %10s %10s %8s %8s %10s %9s %10s\n", "method", "causal",
              "layout", "median", "compute", "waiting", "GFLOP/s", "effic.", "vs compute", "CPU",
              "CPU effic.");
  for (const Row& r : rows) {
    char versus[32] = "-";
    if (r.method == "ring" && compute_alone(r.causal) > 0) {
      std::snprintf(versus, sizeof versus, "%+.1f%%",
                    100.0 * (r.seconds / compute_alone(r.causal) - 1));
    }
    char efficiency[32] = "-";
    if (r.efficiency > 0)
      std::snprintf(efficiency, sizeof efficiency, "%.1f%%", 100 * r.efficiency);
    char cpu_efficiency[32] = "-";
    if (r.cpu_efficiency > 0) {
      std::snprintf(cpu_efficiency, sizeof cpu_efficiency, "%.1f%%", 100 * r.cpu_efficiency);
    }
    std::printf("%-18s %-6s %-10s %9.3fs %9.3fs %9.3fs %8.1f %8s %10s %8.3fs %10s\n",
                r.method.c_str(), r.causal ? "yes" : "no", r.layout.c_str(), r.seconds,
                r.compute_seconds, r.wait_seconds, r.gflops, efficiency, versus, r.cpu_seconds,
                cpu_efficiency);
  }
  if (ranks > 1) {
    for (const Row& r : rows) {
      if (r.method != "ring (no overlap)" || r.wait_seconds <= 0) continue;
      std::printf(
          "exchange per step (%s): %.1f MB in %.2f ms = %.2f GB/s; loopback ping-pong of "
          "the same size: %.2f GB/s\n",
          r.causal ? "causal" : "non-causal", r.bytes_per_step / 1e6,
          1e3 * r.wait_seconds / (ranks - 1), r.bytes_per_step * (ranks - 1) / r.wait_seconds / 1e9,
          loopback);
    }
  }
  std::printf(
      "effic.: T(1 rank) / (ranks x T); vs compute: the ring's time over the slowest "
      "rank's compute alone (from the run without overlap); CPU: process CPU time of a call "
      "summed over the ranks (MPI's busy waits included); CPU effic. = CPU(1 rank) / that: "
      "the work's overhead whatever share of the cores the ranks got; FLOPs: "
      "attend::attention_flops of the whole problem.\n");
}

}  // namespace attend::cli
