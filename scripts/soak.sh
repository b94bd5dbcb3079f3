#!/usr/bin/env bash
# A soak run, not part of CI: tests/soak.cc (attend_soak --paths 1) for MINUTES (default 20) on
# random problems, options, SIMD targets, thread counts and faults, the serving and
# reduced-precision paths included (see the comment at its top); then the cache storm
# (tests/kv_cache_storm_test.cc) over every cache format (float32, float16, bfloat16, int8,
# float8_e4m3, float8_e5m2), STORM_SECONDS each, and ring attention under mpirun with 2 ranks
# (tests/ring_test.cc against the listing, tests/ring_fault_test.cc with every fault on every
# rank) RING_RUNS times, and the Python property tests with Hypothesis's soak profile
# (python/tests/test_properties.py). Prints every mismatch with the command that reproduces
# it, and the counts at the end.
#
#   scripts/soak.sh [MINUTES] [SEED]       (STORM_SECONDS=60, RING_RUNS=10 by default)
#   build/tests/attend_soak --seed S --index I --paths 1     one problem again
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-20}
seed=${2:-$(date +%s)}
storm_seconds=${STORM_SECONDS:-60}
ring_runs=${RING_RUNS:-10}
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target attend_soak kv_cache_storm_test
status=0
nice -n 10 build/tests/attend_soak --minutes "$minutes" --seed "$seed" --paths 1 || status=1
echo "cache storm: every cache format (float32, float16, bfloat16, int8, float8_e4m3," \
  "float8_e5m2), $storm_seconds s each"
ATTEND_STORM_SECONDS=$storm_seconds nice -n 10 build/tests/kv_cache_storm_test || status=1
if cmake --build build --target ring_test ring_fault_test 2>/dev/null; then
  mpi=(mpirun -n 2 --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1)
  passed=0
  for ((run = 1; run <= ring_runs; ++run)); do
    if "${mpi[@]}" build/tests/ring_test >/dev/null &&
      "${mpi[@]}" build/tests/ring_fault_test --all-ranks >/dev/null; then
      passed=$((passed + 1))
    else
      echo "ring under mpirun: run $run failed"
      status=1
    fi
  done
  echo "ring under mpirun -n 2: $passed of $ring_runs runs passed (ring_test and ring_fault_test --all-ranks)"
else
  echo "ring under mpirun: skipped (no MPI: attend_mpi is not built)"
fi
if [ -d build/python/attend ]; then
  cmake --build build --target attend_python
  (cd build/python && ATTEND_HYPOTHESIS_PROFILE=soak PYTHONPATH=$PWD /usr/bin/python3 -m pytest -q \
    -p no:cacheprovider --hypothesis-show-statistics ../../python/tests/test_properties.py) ||
    status=1
fi
exit $status
