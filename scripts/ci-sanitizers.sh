#!/usr/bin/env bash
# CI stage: the test suite under AddressSanitizer + UndefinedBehaviorSanitizer (gcc, in
# build-asan; every report is fatal, leaks included), then the thread tests and the cache storm
# under ThreadSanitizer (build-tsan). Lean builds: -O1, no benchmarks or examples, and -g1: line
# tables, all a report's stack needs, for a third less compile time than -g.
# What runs where under ASan (each choice cuts compile time; BENCHMARKS.md, section CI):
# - SIMD targets: built with -msse4.2, so Highway compiles SSE4, AVX2 and AVX-512 (AVX3) and
#   leaves out SCALAR (and SSSE3, SSE4's width with no kernel code of its own). The tests that
#   dispatch run on each of the three (they iterate the supported targets); the scalar kernels
#   run under ASan+UBSan in the fuzzers' clang build (scripts/ci-fuzz.sh, which compiles
#   SCALAR only), so every width the kernels run at on x86 (16, 8, 4 and 1 lanes of float32)
#   runs under ASan somewhere, the scalar one on fuzzed inputs only. The Release stage tests
#   all five targets over the grids.
# - UBSan on the library, not on the tests' own sources (ATTEND_TEST_COMPILE_OPTIONS): it made
#   them 60% slower to compile (cli_test.cc: 17.3 s of CPU with it, 10.8 s without), and the
#   tests' own arithmetic is not what it is there to check. ASan instruments both.
# - ring_test with 2 and 3 ranks (even and odd rings), not 1 and 4: under ASan each mpirun
#   takes 10-25 s of both cores. The fault-injection tests run with 2, 3 and 4 ranks; the
#   Release stage runs ring_test with 1 to 4.
# The TSan build compiles the static target only (ATTEND_SIMD_TARGETS=STATIC): it checks threads
# sharing plans and caches, not the SIMD code.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
lean=(-G Ninja -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1"
      -DATTEND_BUILD_BENCH=OFF -DATTEND_BUILD_EXAMPLES=OFF
      -DATTEND_BUILD_PYTHON=OFF)  # an instrumented module cannot load into python3

# 1. ASan + UBSan, the suite (ring_test: 2 and 3 ranks).
start=$SECONDS
sanitizers="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
# SSE4 as the baseline (Highway's SSE4 needs PCLMUL and AES too): the targets better than the
# baseline and the baseline itself are compiled, SSE4, AVX2 and AVX3 (AVX-512).
sse4="-msse4.2 -mpopcnt -mpclmul -maes"
cmake -S . -B build-asan "${lean[@]}" \
  -DATTEND_TEST_COMPILE_OPTIONS=-fno-sanitize=undefined \
  "-DCMAKE_CXX_FLAGS=$sanitizers $sse4" \
  "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" >/dev/null
cmake --build build-asan
echo "sanitizers: ASan build $((SECONDS - start)) s"
start=$SECONDS
# allocator_may_return_null: an impossible allocation returns null, as malloc does, and the
# library must turn that into attend::Error (tests/hardening_test.cc) instead of ASan aborting.
# Leaks: none reported, libgomp's thread pool included (its threads' stacks keep it
# reachable), so there is no suppressions file; add one here only for a third-party leak.
export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1:strict_string_checks=1:check_initialization_order=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build-asan -j2 --output-on-failure -E '^ring_test_[14]_ranks$'
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
# The cache storm: threads appending, forking, evicting and attending against a shadow model
# (2 x 2 s; under ASan it runs with the whole suite).
ATTEND_STORM_SECONDS=2 TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  build-tsan/tests/kv_cache_storm_test
echo "sanitizers: TSan build and test $((SECONDS - start)) s"
