#!/usr/bin/env bash
# A soak run, not part of CI: tests/soak.cc (attend_soak) for MINUTES (default 20) on random
# problems, options, SIMD targets, thread counts and faults; see the comment at its top. Prints
# every mismatch with the command that reproduces it, and the counts at the end.
#
#   scripts/soak.sh [MINUTES] [SEED]
#   build/tests/attend_soak --seed S --index I      one problem again
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-20}
seed=${2:-$(date +%s)}
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target attend_soak
nice -n 10 build/tests/attend_soak --minutes "$minutes" --seed "$seed"
