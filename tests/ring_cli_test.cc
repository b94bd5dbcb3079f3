// `attend ring` under mpirun (tools/attend/ring_command.cpp): whole files scattered by rank 0
// and gathered back, per-rank shard files, ring and head parallelism, against the library's
// single-process call within the error model; a rank that cannot read its shard fails every
// rank and nothing is written.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "attend/npy.hpp"
#include "attend/sdpa.hpp"
#include "error_model.hpp"
#include "sdpa_cases.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

// Runs `mpirun -np ranks attend ring <arguments>` in `directory`; returns the exit status.
// `environment`: more NAME=value settings for every rank.
int run_ring(int ranks, const std::string& directory, const std::string& arguments,
             const std::string& environment = "") {
  // Under ASan, OpenMPI's own leaks are suppressed as for ring_test (tests/CMakeLists.txt).
  const std::string command =
      "cd '" + directory + "' && " + environment +
      " OMP_NUM_THREADS=1 LSAN_OPTIONS=suppressions=" ATTEND_MPI_LSAN_SUPPRESSIONS
      " ASAN_OPTIONS=\"$ASAN_OPTIONS:fast_unwind_on_malloc=0\" " ATTEND_MPIEXEC " -np " +
      std::to_string(ranks) +
      " --allow-run-as-root --oversubscribe " ATTEND_CLI_PATH " ring --quiet " + arguments +
      " > ring.log 2>&1";
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TensorView slice(const Tensor& t, int64_t start, int64_t length) {
  TensorView v = t.view();
  v.data = static_cast<float*>(v.data) + start * v.strides[2];
  v.shape[2] = length;
  return v;
}

struct Inputs {
  Tensor query = random_tensor(Shape({2, 3, 48, 16}), 31);
  Tensor key = random_tensor(Shape({2, 3, 48, 16}), 32);
  Tensor value = random_tensor(Shape({2, 3, 48, 16}), 33);
};

void expect_equal_to_one_process(const Inputs& in, const Tensor& output, bool causal) {
  AttentionOptions options;
  options.causal = causal;
  const ReferenceProblem problem =
      reference_problem(in.query.view(), in.key.view(), in.value.view(), options);
  const ReferenceResult expected = independent_attention(problem);
  const Tolerances tolerances = sdpa_tolerances(problem, {Accumulation::kFloat32, 0.0, false});
  ASSERT_EQ(output.shape(), in.query.shape());
  for (int64_t n = 0; n < output.numel(); ++n) {
    ASSERT_NEAR(output.data_as<float>()[n], expected.output[static_cast<size_t>(n)],
                tolerances.output[static_cast<size_t>(n / 16)])
        << "element " << n;
  }
}

TEST(RingCli, WholeFilesScatteredAndGathered) {
  TemporaryDirectory dir;
  const Inputs in;
  write_npy(dir / "q.npy", in.query.view());
  write_npy(dir / "k.npy", in.key.view());
  write_npy(dir / "v.npy", in.value.view());
  for (const char* layout : {"contiguous", "zigzag"}) {
    SCOPED_TRACE(layout);
    ASSERT_EQ(0, run_ring(3, dir.path().string(),
                          std::string("--query q.npy --key k.npy --value v.npy --out o.npy "
                                      "--lse l.npy --causal --layout ") +
                              layout))
        << read_file_bytes(dir / "ring.log");
    expect_equal_to_one_process(in, read_npy(dir / "o.npy"), true);
    EXPECT_EQ(read_npy(dir / "l.npy").shape(), Shape({2, 3, 48}));
  }
  ASSERT_EQ(0, run_ring(3, dir.path().string(),
                        "--query q.npy --key k.npy --value v.npy --out u.npy --method ulysses"))
      << read_file_bytes(dir / "ring.log");
  expect_equal_to_one_process(in, read_npy(dir / "u.npy"), false);
}

TEST(RingCli, ShardFilesPerRank) {
  TemporaryDirectory dir;
  const Inputs in;
  const int64_t cut = 29;  // unequal shards
  for (int r = 0; r < 2; ++r) {
    const int64_t start = r == 0 ? 0 : cut, length = r == 0 ? cut : 48 - cut;
    write_npy(dir / ("q_" + std::to_string(r) + ".npy"), slice(in.query, start, length));
    write_npy(dir / ("k_" + std::to_string(r) + ".npy"), slice(in.key, start, length));
    write_npy(dir / ("v_" + std::to_string(r) + ".npy"), slice(in.value, start, length));
  }
  const std::string files =
      "--query 'q_{rank}.npy' --key 'k_{rank}.npy' --value 'v_{rank}.npy' --out 'o_{rank}.npy' ";
  ASSERT_EQ(0, run_ring(2, dir.path().string(), files + "--causal"))
      << read_file_bytes(dir / "ring.log");
  const Tensor first = read_npy(dir / "o_0.npy"), second = read_npy(dir / "o_1.npy");
  Tensor whole(DType::kFloat32, in.query.shape());
  convert(first.view(), slice(whole, 0, cut));
  convert(second.view(), slice(whole, cut, 48 - cut));
  expect_equal_to_one_process(in, whole, true);

  // Rank 1's value shard is missing: every rank fails, no output is written.
  TemporaryDirectory empty;
  for (const char* name : {"q_0.npy", "k_0.npy", "v_0.npy", "q_1.npy", "k_1.npy"}) {
    write_file_bytes(empty / name, read_file_bytes(dir / name));
  }
  EXPECT_NE(0, run_ring(2, empty.path().string(), files));
  const std::string log = read_file_bytes(empty / "ring.log");
  EXPECT_NE(log.find("rank 1: --value v_1.npy"), std::string::npos) << log;
  for (const char* name : {"o_0.npy", "o_1.npy"}) {
    EXPECT_TRUE(read_file_bytes(empty / name).empty()) << name << " was written";
  }
}

// A rank that fails in the middle of the ring (tests/ring_fault_test.cc covers every point of
// every call in-process, allocation failures too): an exception, a process that exits
// without MPI_Finalize, a rank that stalls (with ATTEND_MPI_TIMEOUT=1). Every rank ends, the
// command fails within the bound (the timeout, plus mpirun's start), and no output file (nor
// a temporary one) is left.
TEST(RingCli, AFailedRankEndsEveryRankWithoutOutput) {
  TemporaryDirectory dir;
  const Inputs in;
  for (int r = 0; r < 3; ++r) {
    write_npy(dir / ("q_" + std::to_string(r) + ".npy"), slice(in.query, 16 * r, 16));
    write_npy(dir / ("k_" + std::to_string(r) + ".npy"), slice(in.key, 16 * r, 16));
    write_npy(dir / ("v_" + std::to_string(r) + ".npy"), slice(in.value, 16 * r, 16));
  }
  const std::string files =
      "--query 'q_{rank}.npy' --key 'k_{rank}.npy' --value 'v_{rank}.npy' --out 'o_{rank}.npy' ";
  for (const char* kind : {"throw", "exit", "stall"}) {
    SCOPED_TRACE(kind);
    const auto start = std::chrono::steady_clock::now();
    // Point 2: rank 1 at the second step of the ring forward (0: after the collective check).
    EXPECT_NE(0, run_ring(3, dir.path().string(), files + "--causal",
                          std::string("ATTEND_MPI_TIMEOUT=1 ATTEND_FAULT=1:2:") + kind));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string log = read_file_bytes(dir / "ring.log");
    EXPECT_LT(seconds, 20.0) << log;     // a hang would last until the CTest timeout
    if (std::string(kind) == "stall") {  // the others' timeout
      EXPECT_NE(log.find("no progress in 1 s"), std::string::npos) << log;
    } else if (std::string(kind) != "exit") {  // the others report the failed rank
      EXPECT_NE(log.find("rank 1 failed"), std::string::npos) << log;
    }
    int files_left = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("o_", 0) == 0) ++files_left;
    }
    EXPECT_EQ(files_left, 0) << log;
  }
}

}  // namespace
}  // namespace attend::test
