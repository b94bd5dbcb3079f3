// Failure without a hang over MPI (attend/mpi/ring.hpp): under mpirun with 2 to 4 ranks, a
// fault injected on one rank (ATTEND_FAULT=rank:point:kind, the library's test-only hook) at
// every fault point of the ring's and Ulysses' forward and backward must end the call on every
// rank with an attend::Error within the bound (the timeout, 10 s by default), the other ranks
// naming the failed one; each rank writes its output through a StagedFile opened before the
// call, and no output file (nor a temporary) is left; and the caller's communicator stays
// usable: a clean call after each failure returns the same bits as the first.
//
//   ring_fault_test [--kinds throw,std,alloc] [--all-ranks] [--stall SECONDS]
//
// --all-ranks: the fault on each rank in turn (default: rank 0 and the last); --stall S: also a
// rank that stalls at one point of each call (the last rank; every rank with --all-ranks),
// with ContextParallelOptions::timeout_seconds = S: the others must end by their own timeout
// (S plus a margin, their message saying so: the staller only wakes after 4 S), the staller
// by 4 S plus the margin.
// Prints the matrix (call x kind x faulty rank: points, the slowest seconds of the faulty rank
// and of the others) on rank 0 and exits non-zero on any rank that saw a case go wrong.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/mpi/ring.hpp"
#include "io/staged_file.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kHeads = 4, kShardLen = 8, kHeadDim = 16;
constexpr double kBound = 10.0;  // the default timeout: the bound every case must meet

struct Problem {
  Tensor query, key, value, grad_output;
  AttentionOptions options;
  Tensor output, logsumexp;  // the forward's, for the backward
};

struct Call {
  const char* name;
  bool ulysses, backward;
};
constexpr Call kCalls[] = {{"ring", false, false},
                           {"ring_backward", false, true},
                           {"ulysses", true, false},
                           {"ulysses_backward", true, true}};

// One call's outputs, flattened (output; or dQ, dK, dV).
std::vector<float> run(const Call& call, const Problem& p, const mpi::ContextParallelOptions& cp) {
  std::vector<float> out;
  const auto append = [&](const Tensor& t) {
    out.insert(out.end(), t.data_as<float>(), t.data_as<float>() + t.numel());
  };
  if (!call.backward) {
    const mpi::ShardResult r =
        call.ulysses ? mpi::ulysses_attention(MPI_COMM_WORLD, p.query.view(), p.key.view(),
                                              p.value.view(), p.options, cp)
                     : mpi::ring_attention(MPI_COMM_WORLD, p.query.view(), p.key.view(),
                                           p.value.view(), p.options, cp);
    append(r.output);
    append(r.logsumexp);
    return out;
  }
  const auto backward =
      call.ulysses ? mpi::ulysses_attention_backward : mpi::ring_attention_backward;
  const AttentionGradients g =
      backward(MPI_COMM_WORLD, p.grad_output.view(), p.query.view(), p.key.view(), p.value.view(),
               p.output.view(), p.logsumexp.view(), p.options, cp);
  append(g.query);
  append(g.key);
  append(g.value);
  return out;
}

struct Outcome {
  bool failed = false;
  double seconds = 0;
  std::string message;
  std::vector<float> result;
};

// The call with its output staged to `path` (opened before the call, committed after it).
Outcome run_staged(const Call& call, const Problem& p, const mpi::ContextParallelOptions& cp,
                   const std::string& path) {
  Outcome o;
  const auto start = std::chrono::steady_clock::now();
  try {
    detail::StagedFile file(path);
    file.write("attend ring_fault_test\n");
    o.result = run(call, p, cp);
    file.write(o.result.data(), o.result.size() * sizeof(float));
    file.commit();
  } catch (const Error& e) {
    o.failed = true;
    o.message = e.what();
  } catch (const std::exception& e) {
    o.failed = true;
    o.message = std::string("not an attend::Error: ") + e.what();
  }
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return o;
}

// Files in `dir` whose names start with `prefix` (the target or a temporary beside it).
int files_named(const fs::path& dir, const std::string& prefix) {
  int n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) ++n;
  }
  return n;
}

struct Options {
  std::vector<std::string> kinds = {"throw", "std", "alloc"};
  bool all_ranks = false;
  double stall = 0;  // seconds; 0: no stall cases
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--all-ranks") {
      o.all_ranks = true;
    } else if (a == "--kinds" && i + 1 < argc) {
      o.kinds.clear();
      std::stringstream list(argv[++i]);
      for (std::string k; std::getline(list, k, ',');) o.kinds.push_back(k);
    } else if (a == "--stall" && i + 1 < argc) {
      o.stall = std::atof(argv[++i]);
    } else {
      throw Error("ring_fault_test: unknown argument " + a);
    }
  }
  return o;
}

int main_of(int argc, char** argv) {
  const Options options = parse(argc, argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  // Every rank's shard of one problem (batch 1, heads 4, 8 positions per rank), causal.
  Problem p;
  const Shape shape({1, kHeads, kShardLen, kHeadDim});
  const auto seed = static_cast<uint32_t>(100 + 10 * rank);
  p.query = random_tensor(shape, seed);
  p.key = random_tensor(shape, seed + 1);
  p.value = random_tensor(shape, seed + 2);
  p.grad_output = random_tensor(shape, seed + 3);
  p.options.causal = true;
  {
    const mpi::ShardResult r = mpi::ring_attention(MPI_COMM_WORLD, p.query.view(), p.key.view(),
                                                   p.value.view(), p.options);
    p.output = Tensor::copy_of(r.output.view());
    p.logsumexp = Tensor::copy_of(r.logsumexp.view());
  }
  // Rank 0 makes the directory; every rank writes its own file there.
  std::string dir_name(256, '\0');
  if (rank == 0) {
    // Memory-backed where there is one: a commit flushes to disk.
    const fs::path base =
        fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    const fs::path dir = base / ("attend_fault_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    std::snprintf(dir_name.data(), dir_name.size(), "%s", dir.c_str());
  }
  MPI_Bcast(dir_name.data(), static_cast<int>(dir_name.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
  const fs::path dir(dir_name.c_str());
  const std::string prefix = "out_" + std::to_string(rank);
  const std::string path = (dir / (prefix + ".bin")).string();

  std::vector<int> faulty = {0};
  for (int r = 1; r < ranks; ++r) {
    if (options.all_ranks || r == ranks - 1) faulty.push_back(r);
  }
  int problems = 0, cases = 0;
  double slowest = 0;
  const auto problem = [&](const std::string& what) {
    ++problems;
    std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
  };
  for (const Call& call : kCalls) {
    // The clean result every call after a failure must repeat.
    const Outcome clean = run_staged(call, p, {}, path);
    if (clean.failed) problem(std::string(call.name) + ": the clean call failed: " + clean.message);
    fs::remove(path);
    std::vector<std::string> kinds = options.kinds;
    if (options.stall > 0) kinds.push_back("stall");
    for (const std::string& kind : kinds) {
      std::string row = std::string(call.name) + " " + kind + ":";
      for (const int f : faulty) {
        if (kind == "stall" && f != ranks - 1 && !options.all_ranks) continue;
        int points = 0;
        double faulty_slowest = 0, others_slowest = 0;
        for (int point = 0;; ++point) {
          if (kind == "stall" && point == 0) continue;  // one stall, at point 1 (each costs
          if (kind == "stall" && point > 1) break;      // the timeout)
          const std::string fault = std::to_string(f) + ":" + std::to_string(point) + ":" + kind;
          setenv("ATTEND_FAULT", fault.c_str(), 1);
          mpi::ContextParallelOptions cp;
          if (kind == "stall") cp.timeout_seconds = options.stall;
          const Outcome o = run_staged(call, p, cp, path);
          unsetenv("ATTEND_FAULT");
          int failed = o.failed ? 1 : 0, every = 0;
          double seconds[2] = {rank == f ? o.seconds : 0.0, rank == f ? 0.0 : o.seconds},
                 worst[2] = {};  // the faulty rank's, the others' slowest
          MPI_Allreduce(&failed, &every, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
          MPI_Allreduce(seconds, worst, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
          if (every == 0) {  // past the call's last fault point
            fs::remove(path);
            break;
          }
          ++points;
          ++cases;
          faulty_slowest = std::max(faulty_slowest, worst[0]);
          others_slowest = std::max(others_slowest, worst[1]);
          const std::string where = std::string(call.name) + " ATTEND_FAULT=" + fault + ": ";
          if (!o.failed) problem(where + "the call succeeded on this rank");
          if (o.message.rfind("not an attend::Error", 0) == 0) problem(where + o.message);
          // The bound: the failing rank at once, the others within milliseconds of its
          // notice; a stall: the others by their timeout, the staller after its 4 timeouts.
          const double bound = kind != "stall" ? kBound : options.stall * (rank == f ? 4.0 : 1.0);
          if (o.seconds > bound + 0.5) {
            problem(where + "ended after " + std::to_string(o.seconds) + " s: " + o.message);
          }
          // The others name the failed rank, or (a stall) their own or another's timeout.
          const bool names_cause =
              rank == f ? o.message.find("injected fault") != std::string::npos ||
                              o.message.find("out of memory") != std::string::npos
              : kind == "stall"
                  ? o.message.find("no progress") != std::string::npos
                  : o.message.find("rank " + std::to_string(f) + " failed") != std::string::npos;
          if (o.failed && !names_cause) problem(where + "unexpected message: " + o.message);
          if (files_named(dir, prefix) != 0) problem(where + "an output file was left");
          // The communicator still works, and gives the same bits.
          MPI_Barrier(MPI_COMM_WORLD);
          try {
            if (run(call, p, {}) != clean.result)
              problem(where + "the clean call after it differs");
          } catch (const std::exception& e) {
            problem(where + "the clean call after it failed: " + e.what());
          }
        }
        if (points == 0) problem(std::string(call.name) + " " + kind + ": no fault point fired");
        slowest = std::max(slowest, others_slowest);
        char cell[128];
        std::snprintf(cell, sizeof cell, " rank %d: %d point(s), %.3f s (others %.3f s);", f,
                      points, faulty_slowest, others_slowest);
        row += cell;
      }
      if (rank == 0) std::printf("%s\n", row.c_str());
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    fs::remove_all(dir);
    std::printf(
        "%d rank(s): %d fault cases, every rank ended with attend::Error; the slowest other "
        "rank after %.3f s\n",
        ranks, cases, slowest);
  }
  int any = problems, total = 0;
  MPI_Allreduce(&any, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0 && total) std::printf("FAILED: %d problem(s)\n", total);
  return total ? 1 : 0;
}

}  // namespace
}  // namespace attend::test

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int status = 1;
  try {
    status = attend::test::main_of(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ring_fault_test: %s\n", e.what());
  }
  MPI_Finalize();
  return status;
}
