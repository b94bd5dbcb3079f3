// failure.cpp: the failure policy of attend/mpi/ring.hpp (ring_internal.hpp's Communicator):
// waits polled with a deadline, failure notices, requests settled on exit paths, and the
// test-only fault injection (ATTEND_FAULT).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "attend/error.hpp"
#include "attend/tensor.hpp"
#include "mpi/ring_internal.hpp"

namespace attend::mpi::detail {
namespace {

// The notice a failing rank sends every other rank: its message, cut to fit.
constexpr int kFailureTag = 1 << 22;  // above the ring's tags (steps, 2^20 + steps)
constexpr int kNoticeBytes = 512;

// How long a wait may go without completing: ContextParallelOptions::timeout_seconds, else
// ATTEND_MPI_TIMEOUT, else 10 s.
double timeout_of(const ContextParallelOptions& parallel, const char* who) {
  double t = parallel.timeout_seconds;
  if (t == 0.0) {
    t = 10.0;
    if (const char* env = std::getenv("ATTEND_MPI_TIMEOUT"); env && *env) {
      char* end = nullptr;
      t = std::strtod(env, &end);
      if (*end != '\0') {
        throw Error(std::string(who) + ": ATTEND_MPI_TIMEOUT=\"" + env +
                    "\" is not a number of seconds");
      }
    }
  }
  if (!(t > 0.0)) {  // NaN too
    throw Error(std::string(who) + ": the timeout " + std::to_string(t) +
                " s must be positive (infinity: no deadline)");
  }
  return t;
}

// Between polls: spin for the first millisecond (a transfer about to complete), then sleep a
// little (a rank waiting for a slow peer leaves the core to it).
void pause_after(double waited) {
  if (waited > 1e-3) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

[[noreturn]] void timed_out(const char* who, const char* what, double timeout) {
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g", timeout);
  throw Error(std::string(who) + ": " + what + ": no progress in " + seconds +
              " s: another rank failed or stalled (ContextParallelOptions::timeout_seconds, "
              "ATTEND_MPI_TIMEOUT)");
}

struct Fault {
  int rank = -1, point = -1;
  std::string kind;
};

// ATTEND_FAULT=rank:point:kind, or nothing.
Fault fault_from_environment() {
  Fault f;
  const char* env = std::getenv("ATTEND_FAULT");
  if (!env || !*env) return f;
  char kind[16] = {};
  if (std::sscanf(env, "%d:%d:%15s", &f.rank, &f.point, kind) != 3) {
    throw Error(std::string("ATTEND_FAULT=\"") + env + "\" should be rank:point:kind");
  }
  f.kind = kind;
  return f;
}

}  // namespace

Communicator::Communicator(MPI_Comm comm, const char* who, const ContextParallelOptions& parallel)
    : who_(who) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw Error("context parallelism: MPI is not initialized (call MPI_Init)");
  if (comm == MPI_COMM_NULL) throw Error("context parallelism: the communicator is null");
  timeout_ = timeout_of(parallel, who);
  // Collective, as every step after it: a rank that never comes is a timeout, not a hang.
  auto handle = std::make_unique<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Comm_idup(comm, handle.get(), &request), "MPI_Comm_idup");
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    int done = 0;
    check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Comm_idup");
    if (done) break;
    const double waited = seconds_since(start);
    if (waited > timeout_) {
      keep_forever(std::move(handle));
      timed_out(who_, "duplicating the communicator", timeout_);
    }
    pause_after(waited);
  }
  comm_ = *handle;
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

Communicator::~Communicator() {
  if (comm_ != MPI_COMM_NULL && !failed_) MPI_Comm_free(&comm_);
}

void Communicator::keep_forever_erased(std::shared_ptr<void> storage) {
  static std::mutex mutex;
  static auto* kept = new std::vector<std::shared_ptr<void>>;  // never freed
  const std::lock_guard<std::mutex> lock(mutex);
  kept->push_back(std::move(storage));
}

void Communicator::check_for_notice() const {
  int flag = 0;
  MPI_Status status;
  if (MPI_Iprobe(MPI_ANY_SOURCE, kFailureTag, comm_, &flag, &status) != MPI_SUCCESS || !flag) {
    return;
  }
  char notice[kNoticeBytes] = {};
  MPI_Recv(notice, kNoticeBytes, MPI_CHAR, status.MPI_SOURCE, kFailureTag, comm_,
           MPI_STATUS_IGNORE);
  throw RemoteFailure(std::string(who_) + ": rank " + std::to_string(status.MPI_SOURCE) +
                      " failed: " + std::string(notice, strnlen(notice, sizeof notice)));
}

void Communicator::wait(MPI_Request* requests, int count, const char* what) const {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    int done = 0;
    check_mpi(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE), what);
    if (done) return;
    check_for_notice();
    const double waited = seconds_since(start);
    if (waited > timeout_) timed_out(who_, what, timeout_);
    pause_after(waited);
  }
}

void Communicator::barrier(const char* what) const {
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibarrier(comm_, &request), what);
  wait(&request, 1, what);
}

void Communicator::fail(const std::string& message) noexcept {
  failed_ = true;
  if (comm_ == MPI_COMM_NULL) return;
  // One buffer for every notice, kept for ever; the sends complete on their own (small
  // messages: eagerly), their requests freed.
  auto notice = std::make_unique<char[]>(kNoticeBytes);
  std::snprintf(notice.get(), kNoticeBytes, "%s", message.c_str());
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(notice.get(), kNoticeBytes, MPI_CHAR, r, kFailureTag, comm_, &request) ==
        MPI_SUCCESS) {
      MPI_Request_free(&request);
    }
  }
  try {
    keep_forever(std::move(notice));
  } catch (...) {  // out of memory: the notice stays allocated anyway
    (void)notice.release();
  }
}

void Communicator::fault_point() const {
  const int point = fault_points_++;
  const Fault f = fault_from_environment();
  if (f.rank != rank_ || f.point != point) return;
  const std::string what = "injected fault '" + f.kind + "' at point " + std::to_string(point) +
                           " on rank " + std::to_string(rank_) + " (ATTEND_FAULT)";
  if (f.kind == "throw") throw Error(what);
  if (f.kind == "std") throw std::runtime_error(what);
  if (f.kind == "alloc") {  // 2^60 floats: a byte count that fits, an allocation that fails
    const Tensor impossible(DType::kFloat32, Shape({int64_t{1} << 60}));
    throw Error(what + ": the allocation succeeded");
  }
  if (f.kind == "exit") {
    std::fflush(nullptr);
    std::_Exit(3);
  }
  if (f.kind == "stall") {
    std::this_thread::sleep_for(std::chrono::duration<double>(4 * std::min(timeout_, 1e6)));
    throw Error(what + ", after a stall");
  }
  throw Error("ATTEND_FAULT: unknown kind '" + f.kind + "' (throw, std, alloc, exit, stall)");
}

bool settle(MPI_Request* requests, int count) noexcept {
  for (int i = 0; i < count; ++i) {
    if (requests[i] != MPI_REQUEST_NULL) MPI_Cancel(&requests[i]);
  }
  int done = 0;
  return MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE) == MPI_SUCCESS && done;
}

}  // namespace attend::mpi::detail
