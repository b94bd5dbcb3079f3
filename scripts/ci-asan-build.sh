#!/usr/bin/env bash
# CI: the one AddressSanitizer + UndefinedBehaviorSanitizer build, with clang, in build-asan.
# Both the sanitizer stage (the test suite, scripts/ci-sanitizers.sh) and the fuzzing stage
# (the libFuzzer targets, scripts/ci-fuzz.sh) use it; the second call finds it built. One
# build instead of a gcc ASan build plus a clang fuzzing build: the library and the CLI are
# compiled under the sanitizers once (BENCHMARKS.md, "CI time").
#
# - Highway targets SCALAR, AVX2 and AVX3 (AVX-512): 1, 8 and 16 lanes of float32, so the
#   suite runs the scalar kernels over the grids under ASan too, the kernels that live only up
#   to 8 lanes (short keys) and the AVX-512 ones (bf16 products), and the fuzzers run the
#   host's best target. HWY_BROKEN_EMU128 makes SCALAR clang's baseline as it is gcc 12's
#   (clang's EMU128 takes 5x SCALAR's compile time for fused_sdpa.cc). SSSE3 and SSE4 (4
#   lanes, no kernel code of their own) are left out: each target is a quarter of the
#   kernels' compile here, and the Release stage runs all five targets over the grids.
# - The library, the CLI and the fuzzers carry libFuzzer's coverage instrumentation
#   (fuzz/CMakeLists.txt); the tests link the same objects and simply do not read it.
# - UBSan on the SIMD kernels' sources (ATTEND_KERNEL_COMPILE_OPTIONS) without its
#   pointer-overflow and alignment checks: they instrument every pointer step and typed access
#   of the unrolled register blocks and made fused_sdpa.cc 2x slower to compile (per target:
#   asan 43 s, asan+ubsan 164 s, without those two checks 81 s of CPU); ASan checks every
#   access those pointers make. The rest of the library keeps all of UBSan.
# - UBSan on the library and the CLI, not on the tests' own sources (ATTEND_TEST_COMPILE_OPTIONS:
#   it made them 60% slower to compile, and the tests' arithmetic is not what it checks).
# - The library at -O1 (ATTEND_LIBRARY_COMPILE_OPTIONS: the kernels and the reference the
#   tests compare with run at a usable speed), what only drives it (tests, CLI, fuzzers) at
#   -O0, which compiles those in about half the time (the CLI's cli_main.cpp: 16 s of CPU at
#   -O1, 6 at -O0). -gline-tables-only: all a report's stack needs. No Python module (an
#   instrumented module cannot load into python3), benchmarks or examples.
# - Linked with lld (Debian's lld): 71 executables, each linked in about half the time.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh clang libclang-rt-14-dev libomp-14-dev lld
start=$SECONDS
sanitizers="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B build-asan -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O0 -gline-tables-only" \
  -DATTEND_LIBRARY_COMPILE_OPTIONS=-O1 \
  "-DCMAKE_CXX_FLAGS=$sanitizers -DHWY_BROKEN_EMU128=1" \
  "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined -fuse-ld=lld" \
  -DATTEND_SIMD_DISABLED_TARGETS='HWY_SSSE3;HWY_SSE4' \
  -DATTEND_KERNEL_COMPILE_OPTIONS=-fno-sanitize=pointer-overflow,alignment \
  -DATTEND_TEST_COMPILE_OPTIONS=-fno-sanitize=undefined \
  -DATTEND_BUILD_FUZZERS=ON -DATTEND_BUILD_BENCH=OFF -DATTEND_BUILD_EXAMPLES=OFF \
  -DATTEND_BUILD_PYTHON=OFF >/dev/null
cmake --build build-asan
echo "asan build: $((SECONDS - start)) s"
