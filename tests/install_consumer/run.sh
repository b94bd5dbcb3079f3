#!/usr/bin/env bash
# Usage: run.sh CMAKE BUILD_DIR CONSUMER_SOURCE CXX [CXX_FLAGS [LINKER_FLAGS]]. Installs attend
# from BUILD_DIR into ./install, builds the consumer project against it in ./consumer (with
# the flags attend was built with, e.g. sanitizers) and runs it.
set -euo pipefail
cmake=$1 build=$2 source=$3 cxx=$4 cxx_flags=${5:-} linker_flags=${6:-}
rm -rf install consumer
"$cmake" --install "$build" --prefix "$PWD/install" >/dev/null
"$cmake" -S "$source" -B consumer -G Ninja -DCMAKE_PREFIX_PATH="$PWD/install" \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CXX_FLAGS="$cxx_flags" \
  -DCMAKE_EXE_LINKER_FLAGS="$linker_flags" >/dev/null
"$cmake" --build consumer >/dev/null
consumer/consumer
