#!/usr/bin/env bash
# CI stage: run the libFuzzer targets (fuzz/) for FUZZ_SECONDS each (default 60) from their
# committed seed corpora and dictionaries. Any finding (crash, sanitizer report, leak, timeout,
# out-of-memory) fails the stage and leaves the input in build-asan/fuzz-run/<target>/artifacts/.
# The four targets run at once, one process each. They come from the one clang ASan+UBSan
# build (scripts/ci-asan-build.sh, build-asan) that the sanitizer stage builds and tests; this
# stage builds only what is missing (nothing after that stage). The fuzzers run the host's best
# SIMD target: they check logic, not dispatch (the suite runs every target under ASan).
#
#   FUZZ_SECONDS=600 scripts/ci-fuzz.sh          a longer run; SECURITY.md has the record
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-60}
targets=(npy safetensors cli paged)

start=$SECONDS
scripts/ci-asan-build.sh >/dev/null  # builds the fuzzers with the rest
echo "fuzz: built in $((SECONDS - start)) s"
# libomp without hot teams: its own leak when a team grows (scripts/ci-sanitizers.sh).
export KMP_HOT_TEAMS_MAX_LEVEL=0

# libFuzzer adds what it finds to the first corpus directory: a scratch copy, so the committed
# seeds stay as they are.
pids=()
for target in "${targets[@]}"; do
  run=build-asan/fuzz-run/$target
  rm -rf "$run/artifacts"
  mkdir -p "$run/corpus" "$run/artifacts"
  build-asan/fuzz/${target}_fuzzer -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -dict="fuzz/$target.dict" -artifact_prefix="$run/artifacts/" -print_final_stats=1 \
    "$run/corpus" "fuzz/corpus/$target" >"$run/log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!targets[@]}"; do
  target=${targets[$i]}
  log=build-asan/fuzz-run/$target/log
  if wait "${pids[$i]}"; then
    echo "${target}_fuzzer: no finding in ${seconds} s ($(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*$') executions)"
  else
    failed=1
    echo "${target}_fuzzer: FINDING (input in build-asan/fuzz-run/$target/artifacts/)"
    tail -n 60 "$log"
  fi
done
exit "$failed"
