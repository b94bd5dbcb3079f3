#!/usr/bin/env bash
# Every test: install what is missing, build everything, run the suite in parallel.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build
ctest --test-dir build -j2 --output-on-failure
