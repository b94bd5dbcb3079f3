#!/usr/bin/env bash
# CI stage: the test suite under AddressSanitizer + UndefinedBehaviorSanitizer (clang, in
# build-asan, scripts/ci-asan-build.sh: the build the fuzzing stage reuses; every report is
# fatal, leaks included), then the thread tests and the cache storm under ThreadSanitizer (gcc,
# build-tsan). What the ASan build compiles, and why: scripts/ci-asan-build.sh.
# - SIMD targets SCALAR, AVX2 and AVX3: the tests that dispatch iterate the supported
#   targets, so 1, 8 and 16 lanes run the grids under ASan (scripts/ci-asan-build.sh says
#   why not SSE4's 4). The Release stage tests all five targets over the grids.
# - UBSan on the library and the CLI, not on the tests' own sources.
# - Leaks: LeakSanitizer on, with no suppression for the OpenMP runtime. clang's libomp keeps
#   a hot team per parallel level and, when a region asks for more threads than the team
#   has, drops the old team's per-thread arrays without freeing them (1,440 bytes each;
#   reproduced with num_threads(2) then num_threads(8) in a 20-line program). Its stacks end
#   in libomp.so without symbols, and `leak:libomp.so` would also hide every leak of memory
#   allocated inside a parallel region (each such stack passes through libomp: a planted
#   leak of 500 blocks in a parallel region was suppressed with it). KMP_HOT_TEAMS_MAX_LEVEL=0
#   (libomp: no hot teams; a team is built and freed per region) removes libomp's own leak
#   and the planted one is still reported. libgomp (gcc) ignores the variable.
# - ring_test with 2 and 3 ranks (even and odd rings), not 1 and 4: under ASan each mpirun
#   takes 10-25 s of both cores. The fault-injection tests run with 2, 3 and 4 ranks; the
#   Release stage runs ring_test with 1 to 4.
# The TSan build compiles the static target only (ATTEND_SIMD_TARGETS=STATIC): it checks threads
# sharing plans and caches, not the SIMD code.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# The TSan build's configuration: -O1, -g1 (line tables: all a report's stack needs, for a
# third less compile time than -g), no benchmarks, examples or Python.
lean=(-G Ninja -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1"
      -DATTEND_BUILD_BENCH=OFF -DATTEND_BUILD_EXAMPLES=OFF
      -DATTEND_BUILD_PYTHON=OFF)  # an instrumented module cannot load into python3

# 1. ASan + UBSan, the suite (ring_test: 2 and 3 ranks).
scripts/ci-asan-build.sh
start=$SECONDS
# allocator_may_return_null: an impossible allocation returns null, as malloc does, and the
# library must turn that into attend::Error (tests/hardening_test.cc) instead of ASan aborting.
# Leaks: no suppressions file (OpenMPI's own allocations: tests/mpi_lsan.supp, for the ring
# tests only); KMP_HOT_TEAMS_MAX_LEVEL=0 instead of suppressing libomp (header above).
export KMP_HOT_TEAMS_MAX_LEVEL=0
export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1:strict_string_checks=1:check_initialization_order=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# Left out here, run by the Release stage: ring_test with 1 and 4 ranks (header); the
# packaging test (a consumer project built against the installed library); the decode bench
# line (its read-bandwidth probe streams hundreds of MB: timing code, the decode it runs is in
# the paged tests); the two training runs (hundreds of steps of the forward, backward and
# optimizer that the multihead and backward tests run under ASan). About 28 s of wall.
ctest --test-dir build-asan -j2 --output-on-failure -E \
  '^(ring_test_[14]_ranks|InstallAndFindPackage|BenchCommand\.DecodeJsonLineHasTheReadBandwidthKeys|TrainDemoCommand\.TrainsAndWritesTheCurves|TrainReverse\.LearnsToReverseAndIsReproducible)$'
echo "sanitizers: ASan tests $((SECONDS - start)) s"
start=$SECONDS

# 2. TSan, the concurrency test only: many std::threads in the library at once. Each call
#    runs single-threaded inside (num_threads = 1) because libgomp is not TSan-instrumented.
cmake -S . -B build-tsan "${lean[@]}" -DATTEND_BUILD_TOOLS=OFF -DATTEND_SIMD_TARGETS=STATIC \
  "-DCMAKE_CXX_FLAGS=-fsanitize=thread" \
  "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread" >/dev/null
cmake --build build-tsan --target concurrency_test serving_test kv_cache_storm_test
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 build-tsan/tests/concurrency_test
# Several threads on one plan, several threads appending to and attending over one cache.
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 build-tsan/tests/serving_test \
  --gtest_filter='AttentionPlan.SeveralThreadsRunOnePlan:PagedKvCache.ThreadsAppendAndAttendDifferentSequences'
# The cache storm: threads appending, forking, evicting and attending against a shadow model,
# one run per cache format, 0.5 s each: 3 s in all for the six formats (about 700 appends and
# 850 attends each under TSan). The three float formats share one write path (convert) and
# the three scaled ones another (quantize, scales), so the threads' accesses are the same
# within each half. Under ASan it runs with the whole suite, 1 s per format.
ATTEND_STORM_SECONDS=0.5 TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  build-tsan/tests/kv_cache_storm_test
echo "sanitizers: TSan build and test $((SECONDS - start)) s"
