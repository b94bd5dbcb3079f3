#!/usr/bin/env bash
# CI: the one AddressSanitizer + UndefinedBehaviorSanitizer build, with clang, in build-asan.
# Both the sanitizer stage (the test suite, scripts/ci-sanitizers.sh) and the fuzzing stage
# (the libFuzzer targets, scripts/ci-fuzz.sh) use it; the second call finds it built. One
# build instead of a gcc ASan build plus a clang fuzzing build: the library and the CLI are
# compiled under the sanitizers once (BENCHMARKS.md, "CI time").
#
# - Highway targets SCALAR, SSE4, AVX2 and AVX3 (AVX-512): every width the kernels run at on
#   x86 (1, 4, 8 and 16 lanes of float32), so the suite runs the scalar kernels over the grids
#   under ASan too, and the fuzzers run the host's best target. HWY_BROKEN_EMU128 makes SCALAR
#   clang's baseline as it is gcc 12's (clang's EMU128 takes 5x SCALAR's compile time for
#   fused_sdpa.cc); SSSE3 is left out (SSE4's width, no kernel code of its own).
# - The library, the CLI and the fuzzers carry libFuzzer's coverage instrumentation
#   (fuzz/CMakeLists.txt); the tests link the same objects and simply do not read it.
# - UBSan on the library and the CLI, not on the tests' own sources (ATTEND_TEST_COMPILE_OPTIONS:
#   it made them 60% slower to compile, and the tests' arithmetic is not what it checks).
# - -O1 -gline-tables-only: all a report's stack needs. No Python module (an instrumented
#   module cannot load into python3), benchmarks or examples.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh clang libclang-rt-14-dev libomp-14-dev
start=$SECONDS
sanitizers="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B build-asan -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -gline-tables-only" \
  "-DCMAKE_CXX_FLAGS=$sanitizers -DHWY_BROKEN_EMU128=1" \
  "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" \
  -DATTEND_SIMD_DISABLED_TARGETS=HWY_SSSE3 \
  -DATTEND_TEST_COMPILE_OPTIONS=-fno-sanitize=undefined \
  -DATTEND_BUILD_FUZZERS=ON -DATTEND_BUILD_BENCH=OFF -DATTEND_BUILD_EXAMPLES=OFF \
  -DATTEND_BUILD_PYTHON=OFF >/dev/null
cmake --build build-asan
echo "asan build: $((SECONDS - start)) s"
