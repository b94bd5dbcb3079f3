#!/usr/bin/env bash
# The main job: install what is missing, build, run `attend demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target attend_cli
build/tools/attend/attend demo "$@"
