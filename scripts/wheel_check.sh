#!/bin/bash
# The wheel from nothing, by hand (issue 24, part 5): `pip wheel` of the sources with their own
# CMake build (setup.py), installed with pip offline into a fresh --system-site-packages venv,
# imported from outside the sources and run on a tiny call, `python -m attend info` included.
#
#   scripts/wheel_check.sh                 # a full Release build of the library and the module
#   scripts/wheel_check.sh --reuse build   # package an existing configured build tree instead
#
# The full build compiles every SIMD target of the kernels (several minutes of CPU on a cold
# ccache; `. /work/ccache.env`-style CMAKE_CXX_COMPILER_LAUNCHER=ccache makes it cheap when
# warm), which is why CI runs the reusing variant only (python/tests/test_packaging.py).
# PYTHON picks the interpreter (default /usr/bin/python3, which has Debian's numpy and torch).
# Leaves nothing behind but the sources' build-pip/ (ignored by git) and ATTEND_CMAKE_ARGS's
# effects; the wheel is copied to $WHEEL_OUT when set.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-/usr/bin/python3}
reuse=
if [[ ${1:-} == --reuse ]]; then
  reuse=$(cd "${2:?--reuse takes a build directory}" && pwd)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH

start=$(date +%s)
if [[ -n $reuse ]]; then
  ATTEND_BUILD_DIR=$reuse "$python" -m pip wheel "$root" --no-deps --no-build-isolation \
    -w "$work/wheels"
else
  "$python" -m pip wheel "$root" --no-deps --no-build-isolation -w "$work/wheels"
fi
wheel=$(ls "$work"/wheels/attend-*.whl)
echo "wheel_check: built $(basename "$wheel") in $(( $(date +%s) - start )) s"

"$python" -m venv --system-site-packages --without-pip "$work/venv"
# --system-site-packages: the venv's Python finds the system's pip, numpy and torch.
"$work/venv/bin/python" -m pip install --no-deps "$wheel"
cd "$work"
"$work/venv/bin/python" - "$work/venv" <<'PY'
import pathlib, sys
import numpy as np
import attend
venv = pathlib.Path(sys.argv[1]).resolve()
assert pathlib.Path(attend.__file__).resolve().is_relative_to(venv), attend.__file__
q = np.arange(2 * 3 * 4 * 8, dtype=np.float32).reshape(2, 3, 4, 8) / 100
out = attend.scaled_dot_product_attention(q, q, q, is_causal=True)
assert out.shape == (2, 3, 4, 8) and np.isfinite(out).all()
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    module = attend.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.rand(1, 3, 16)
    with torch.no_grad():
        y, _ = module(x, x, x, need_weights=False)
    assert y.shape == (1, 3, 16)
print(f"wheel_check: attend {attend.version()} from {attend.__file__} computes "
      f"({attend.active_simd_target()}, torch {'yes' if torch else 'no'})")
PY
"$work/venv/bin/python" -m attend info | head -3
if [[ -n ${WHEEL_OUT:-} ]]; then cp "$wheel" "$WHEEL_OUT"/; fi
echo "wheel_check: OK"
