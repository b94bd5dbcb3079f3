#!/usr/bin/env bash
# Every test: install what is missing, build everything, run the suite in parallel.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
start=$SECONDS
# The tests' own sources at -O1 (ATTEND_TEST_COMPILE_OPTIONS): what they check is the library,
# built at -O3 like everything else; -O1 compiles them in three quarters of the time.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTEND_TEST_COMPILE_OPTIONS=-O1 >/dev/null
cmake --build build
echo "test.sh: built in $((SECONDS - start)) s"
start=$SECONDS
# The property tests fail, not skip, if python3-hypothesis is missing.
ATTEND_REQUIRE_HYPOTHESIS=1 ctest --test-dir build -j2 --output-on-failure
echo "test.sh: tests ran in $((SECONDS - start)) s"
# The C++ suite again on the scalar fallback (what an x86-64 without SSSE3 runs, and the
# one-lane edge of every rule that depends on the vector width: rows or tiles, key splits,
# workspaces). Tests that iterate over the SIMD targets cover the others; this catches the
# tests that assume the host's best one. Python, MPI and the install test do not depend on
# the kernels' target.
start=$SECONDS
ATTEND_MAX_SIMD=SCALAR ctest --test-dir build -j2 --output-on-failure \
  -E '^(python_|ring_|RingCli|InstallAndFindPackage|CheckFloors)'
echo "test.sh: tests on SCALAR ran in $((SECONDS - start)) s"
