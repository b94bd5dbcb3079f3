#!/usr/bin/env bash
# CI stage: build the libFuzzer targets (fuzz/) with clang in build-fuzz and run each for
# FUZZ_SECONDS (default 60) from its committed seed corpus and dictionary. Any finding (crash,
# sanitizer report, leak, timeout, out-of-memory) fails the stage and leaves the input in
# build-fuzz/fuzz-run/<target>/artifacts/. The four targets run at once, one process each.
# The fuzzers check logic, not dispatch: the build compiles one Highway target, the scalar one
# (ATTEND_SIMD_TARGETS=SCALAR), not every target six K/V formats each. Not clang's static target
# EMU128: fused_sdpa.cc alone took 5x as long for it (about 250 s of CPU against 41 s).
#
#   FUZZ_SECONDS=600 scripts/ci-fuzz.sh          a longer run; SECURITY.md has the record
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh clang libclang-rt-14-dev libomp-14-dev
seconds=${FUZZ_SECONDS:-60}
targets=(npy safetensors cli paged)

start=$SECONDS
cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
  -DATTEND_SIMD_TARGETS=SCALAR -DATTEND_BUILD_FUZZERS=ON -DATTEND_BUILD_TESTS=OFF -DATTEND_BUILD_BENCH=OFF \
  -DATTEND_BUILD_EXAMPLES=OFF -DATTEND_BUILD_PYTHON=OFF >/dev/null
cmake --build build-fuzz --target "${targets[@]/%/_fuzzer}"
echo "fuzz: built in $((SECONDS - start)) s"

# libFuzzer adds what it finds to the first corpus directory: a scratch copy, so the committed
# seeds stay as they are.
pids=()
for target in "${targets[@]}"; do
  run=build-fuzz/fuzz-run/$target
  rm -rf "$run/artifacts"
  mkdir -p "$run/corpus" "$run/artifacts"
  build-fuzz/fuzz/${target}_fuzzer -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -dict="fuzz/$target.dict" -artifact_prefix="$run/artifacts/" -print_final_stats=1 \
    "$run/corpus" "fuzz/corpus/$target" >"$run/log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!targets[@]}"; do
  target=${targets[$i]}
  log=build-fuzz/fuzz-run/$target/log
  if wait "${pids[$i]}"; then
    echo "${target}_fuzzer: no finding in ${seconds} s ($(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*$') executions)"
  else
    failed=1
    echo "${target}_fuzzer: FINDING (input in build-fuzz/fuzz-run/$target/artifacts/)"
    tail -n 60 "$log"
  fi
done
exit "$failed"
