#!/usr/bin/env bash
# CI stage: 64-bit Arm, tested under emulation. Cross-builds the library, the CLI and the core
# tests for aarch64 in build-arm (Debian's g++-aarch64-linux-gnu, the arm64 multiarch packages;
# cmake/toolchains/aarch64-linux-gnu.cmake) and runs the tests under qemu-aarch64 (user mode),
# two at a time. The kernels are compiled for NEON only on Arm (src/CMakeLists.txt leaves out
# Highway's SVE targets), so every test runs on NEON. Emulation checks results, not speed.
#
# Bounded: each test binary gets ARM_TEST_SECONDS (default 300; they take 5-30 s each on the
# 2-core CI machine), and the stage prints its duration.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
seconds=${ARM_TEST_SECONDS:-300}
tests=(runtime_test sdpa_contract_test sdpa_differential_test sdpa_backward_test score_mod_test
       cli_test gemm_test hardening_test bf16_test)

# The arm64 packages need the architecture known to dpkg before apt can see them.
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo dpkg --add-architecture arm64
  $sudo apt-get update -qq
fi
scripts/install-deps.sh g++-aarch64-linux-gnu qemu-user libc6:arm64 libstdc++6:arm64 \
  libgomp1:arm64 libhwy-dev:arm64 libgtest-dev:arm64

# Tests are listed at run time (PRE_TEST), not by running every binary under qemu at build.
cmake -S . -B build-arm -G Ninja --no-warn-unused-cli -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake \
  -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST \
  -DATTEND_BUILD_BENCH=OFF -DATTEND_BUILD_EXAMPLES=OFF \
  -DATTEND_BUILD_MPI=OFF >/dev/null  # the host's MPI is x86-64; attend_mpi is tested natively
cmake --build build-arm --target attend_cli "${tests[@]}"
echo "arm: built in $((SECONDS - start)) s"

# One process per binary (the case grids are prepared once per process), two at a time; each
# one's output goes to build-arm/test-logs/<name>.log and is printed when it fails.
export QEMU_LD_PREFIX=/  # see the toolchain file
qemu-aarch64 build-arm/tools/attend/attend info | sed 's/^/arm: /'
logs=build-arm/test-logs
rm -rf "$logs"
mkdir -p "$logs"
run_one() {
  local name=$1 seconds=$2 logs=$3 begin=$SECONDS
  if timeout "$seconds" qemu-aarch64 "build-arm/tests/$name" >"$logs/$name.log" 2>&1; then
    echo "arm: $name passed ($((SECONDS - begin)) s, $(grep -c '^\[       OK' "$logs/$name.log") tests)"
  else
    echo "arm: $name FAILED (status $?, $((SECONDS - begin)) s); its log:"
    tail -n 80 "$logs/$name.log"
    return 1
  fi
}
export -f run_one
failed=0
printf '%s\n' "${tests[@]}" | xargs -P 2 -I{} bash -c 'run_one "$@"' _ {} "$seconds" "$logs" ||
  failed=1
echo "arm: ${#tests[@]} test binaries under qemu-aarch64 (NEON), stage took $((SECONDS - start)) s"
exit "$failed"
