#!/usr/bin/env bash
# CI stage: the whole test suite under AddressSanitizer + UndefinedBehaviorSanitizer (gcc, in
# build-asan; every report is fatal, leaks included), then tests/concurrency_test.cc under
# ThreadSanitizer (build-tsan). Lean builds: -O1, no benchmarks or examples, and -g1: line
# tables, all a report's stack needs, for a third less compile time than -g.
# SIMD targets: the ASan build leaves out SSSE3 only, whose vectors have SSE4's width and
# whose kernel code is SSE4's (no kernel branches on either), so every vector width the
# kernels run at (AVX-512, AVX2, SSE4, the scalar fallback) still runs under ASan on x86; the
# Release stage tests SSSE3. The TSan build compiles the static target only
# (ATTEND_SIMD_TARGETS=STATIC): it checks threads sharing plans and caches, not the SIMD code.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
lean=(-G Ninja -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1"
      -DATTEND_BUILD_BENCH=OFF -DATTEND_BUILD_EXAMPLES=OFF
      -DATTEND_BUILD_PYTHON=OFF)  # an instrumented module cannot load into python3

# 1. ASan + UBSan, the whole suite.
start=$SECONDS
sanitizers="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B build-asan "${lean[@]}" -DATTEND_SIMD_DISABLED_TARGETS=HWY_SSSE3 \
  "-DCMAKE_CXX_FLAGS=$sanitizers" \
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
ctest --test-dir build-asan -j2 --output-on-failure
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
