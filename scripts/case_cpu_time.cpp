// case_cpu_time.cpp: per-call process CPU time of `attend bench` cases on one thread, for
// comparing two builds on a loaded host (CPU time leaves out the time other processes hold
// the core; it still carries memory stalls). Each case is built as `attend bench` builds it
// (make_module_workload for module and paged cases, run_attention otherwise), called 3 times
// to warm up, then `rounds` times `calls` calls; prints the median per-call time (min, max).
//
// Build against a build directory B (not part of the CMake build):
//   g++ -std=c++20 -O2 -Iinclude -Isrc scripts/case_cpu_time.cpp \
//     B/src/bench/libattend_bench_support.a B/src/libattend.a \
//     /usr/lib/x86_64-linux-gnu/libhwy.so.1.0.3 /usr/lib/gcc/x86_64-linux-gnu/12/libgomp.so \
//     -lpthread -o case_cpu_time
// Use: case_cpu_time decode,decode-int8 [calls=20] [rounds=5]
#include <algorithm>
#include <attend/attend.hpp>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <sstream>
#include <string>
#include <vector>

#include "bench/cases.hpp"
using namespace attend;
using namespace attend::bench;
static double cpu_ms() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}
int main(int argc, char** argv) {
  std::string names = argv[1];
  int calls = argc > 2 ? atoi(argv[2]) : 20, rounds = argc > 3 ? atoi(argv[3]) : 5;
  std::stringstream ss(names);
  std::string name;
  while (std::getline(ss, name, ',')) {
    const BenchCase* c = find_bench_case(name);
    if (!c) {
      fprintf(stderr, "no case %s\n", name.c_str());
      return 1;
    }
    std::function<void()> f;
    CaseTensors t;
    if (c->workload != Workload::kAttention) {
      f = make_module_workload(*c, 1);
    } else {
      t = make_case_tensors(c->shape, false);
      f = [&] { run_attention(t, c->shape, 1, Backend::kAuto); };
    }
    for (int i = 0; i < 3; ++i) f();
    std::vector<double> per;
    for (int r = 0; r < rounds; ++r) {
      double t0 = cpu_ms();
      for (int i = 0; i < calls; ++i) f();
      per.push_back((cpu_ms() - t0) / calls);
    }
    std::sort(per.begin(), per.end());
    printf("%s %.3f ms (min %.3f max %.3f)\n", name.c_str(), per[per.size() / 2], per.front(),
           per.back());
    fflush(stdout);
  }
}
