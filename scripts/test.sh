#!/usr/bin/env bash
# Every test: install what is missing, build everything, run the suite in parallel.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
start=$SECONDS
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build
echo "test.sh: built in $((SECONDS - start)) s"
start=$SECONDS
ctest --test-dir build -j2 --output-on-failure
echo "test.sh: tests ran in $((SECONDS - start)) s"
