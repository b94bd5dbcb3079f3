// measure.cc: see measure.hpp.
#include "bench/measure.hpp"

#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/tensor.hpp"

namespace attend::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double process_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

double median_of(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

}  // namespace

RepeatedTiming time_repeated(const std::function<void()>& call, int repetitions,
                             double min_seconds) {
  if (repetitions < 1) {
    throw Error("repetitions must be >= 1, got " + std::to_string(repetitions));
  }
  if (!(min_seconds >= 0)) {
    throw Error("min time must be >= 0 seconds, got " + std::to_string(min_seconds));
  }
  call();  // warm-up: page faults, OpenMP thread start, dispatch initialization
  std::vector<double> per_call, cpu_per_call;
  RepeatedTiming timing;
  for (int r = 0; r < repetitions; ++r) {
    int64_t calls = 0;
    const double cpu_start = process_cpu_seconds();
    const auto start = Clock::now();
    double elapsed = 0;
    do {
      call();
      ++calls;
      elapsed = seconds_since(start);
    } while (elapsed < min_seconds);
    per_call.push_back(elapsed / static_cast<double>(calls));
    cpu_per_call.push_back((process_cpu_seconds() - cpu_start) / static_cast<double>(calls));
    timing.calls_per_repetition = std::max(timing.calls_per_repetition, calls);
  }
  timing.best_seconds = *std::min_element(per_call.begin(), per_call.end());
  timing.median_seconds = median_of(per_call);
  timing.median_cpu_seconds = median_of(cpu_per_call);
  return timing;
}

double measure_write_seconds(int64_t bytes, int num_threads, double min_seconds) {
  if (bytes <= 0) throw Error("write probe: bytes must be > 0, got " + std::to_string(bytes));
  if (num_threads < 1) {
    throw Error("write probe: num_threads must be >= 1, got " + std::to_string(num_threads));
  }
  Tensor buffer(DType::kUInt8, Shape{bytes});
  auto* base = buffer.data_as<unsigned char>();
  const int64_t chunk = (bytes + num_threads - 1) / num_threads;
  int fill = 0;
  auto write_all = [&] {
    ++fill;
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int t = 0; t < num_threads; ++t) {
      const int64_t first = std::min(bytes, t * chunk);
      const int64_t last = std::min(bytes, first + chunk);
      std::memset(base + first, fill & 0xff, static_cast<size_t>(last - first));
    }
  };
  const RepeatedTiming timing = time_repeated(write_all, 5, min_seconds / 5);
  return timing.median_seconds;
}

int64_t peak_rss_bytes() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

}  // namespace attend::bench
