#!/usr/bin/env bash
# Installs the Debian 12 packages attend builds with (as root, or through sudo), skipping
# what is already there.
set -euo pipefail
packages=(g++ cmake ninja-build libhwy-dev libgtest-dev libgmock-dev libbenchmark-dev
          libcli11-dev nlohmann-json3-dev
          # attend_mpi (context parallelism) and its tests under mpirun
          libopenmpi-dev openmpi-bin
          # the Python package (python/) and its tests
          python3-dev pybind11-dev python3-pybind11 python3-numpy python3-torch python3-pytest
          # attend.torch.patch's tests on torchvision's VisionTransformer; the randomized
          # (property-based) tests of the Python package
          python3-torchvision python3-hypothesis
          # the type checks of the package and its stub (python/tests/test_stubs.py)
          python3-mypy)
packages+=("$@")
missing=()
# A name without an architecture is ambiguous to dpkg once the arm64 one is installed too
# (scripts/ci-arm.sh): then ask for the native one.
native=$(dpkg --print-architecture)
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || dpkg -s "$p:$native" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
