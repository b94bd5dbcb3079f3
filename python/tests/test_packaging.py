"""What the package ships beside the code: `python3 -m attend info` (the command-line tool's
`attend info`). The stubs and docstrings: test_stubs.py."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import attend
from attend import _attend

PACKAGE = pathlib.Path(attend.__file__).resolve().parent


def test_python_m_attend_info():
    environment = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    run = subprocess.run([sys.executable, "-m", "attend", "info"], capture_output=True,
                         text=True, env=environment, timeout=120)
    assert run.returncode == 0, run.stderr
    def without_threads(report):  # conftest limits this process's threads
        return [line for line in report.splitlines() if not line.startswith("default threads")]
    assert without_threads(run.stdout) == without_threads(_attend.runtime_report())
    assert run.stdout.startswith(f"attend {attend.version()}\n")
    assert f"SIMD target active:     {attend.active_simd_target()}" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "attend", "info"], capture_output=True,
                         text=True, env=dict(environment, ATTEND_MAX_SIMD="NOSUCH"), timeout=120)
    assert bad.returncode == 1 and "NOSUCH" in bad.stderr and bad.stdout == ""


def test_python_m_attend_info_is_the_command_line_tools():
    """The same report as `attend info` of the command-line tool built beside the package
    (<build>/tools/attend/attend), both run in one environment."""
    tool = PACKAGE.parent.parent / "tools" / "attend" / "attend"
    if not tool.exists():
        pytest.skip(f"no command-line tool at {tool} (the package was not run from its build)")
    environment = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    runs = [subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120)
            for command in ([sys.executable, "-m", "attend", "info"], [str(tool), "info"])]
    assert runs[0].returncode == 0 and runs[1].returncode == 0, runs[0].stderr + runs[1].stderr
    assert runs[0].stdout == runs[1].stdout


def _build_tree():
    """The CMake build tree this package was run from (<build>/python/attend), and its source
    directory, or None."""
    build = PACKAGE.parent.parent
    cache = build / "CMakeCache.txt"
    if not cache.is_file():
        return None
    for line in cache.read_text().splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:INTERNAL="):
            return build, pathlib.Path(line.split("=", 1)[1])
    return None


def test_the_wheel_installs_offline_into_a_fresh_venv(tmp_path):
    """`pip wheel` of the sources packages the module of the build tree the tests run from
    (setup.py's ATTEND_BUILD_DIR: no second compile), the wheel installs with pip offline
    (--no-index) into a fresh --system-site-packages venv, and that venv's Python, outside the
    sources, imports attend from the venv and computes. The wheel built from nothing (its own
    CMake build, minutes of CPU): scripts/wheel_check.sh."""
    tree = _build_tree()
    if tree is None:
        pytest.skip("the package was not run from a CMake build tree")
    build, source = tree
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        pytest.skip("pip is not installed for this Python (Debian: python3-pip)")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    environment.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
                       ATTEND_BUILD_DIR=str(build))
    wheels = tmp_path / "wheels"
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                          "--no-build-isolation", "-w", str(wheels), "-q"],
                         capture_output=True, text=True, env=environment, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    [wheel] = wheels.glob("attend-*.whl")
    assert wheel.name.startswith(f"attend-{attend.version()}-")
    import zipfile
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"attend/__init__.py", "attend/_attend.pyi", "attend/py.typed"} <= names
    assert any(n.startswith("attend/_attend.") and n.endswith(".so") for n in names), names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # --system-site-packages: the venv's python finds the system's pip, numpy and torch
    run = subprocess.run([python, "-m", "pip", "install", "--no-deps", str(wheel), "-q"],
                         capture_output=True, text=True, env=environment, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    script = ("import attend, numpy as np\n"
              "q = np.arange(2 * 3 * 4 * 8, dtype=np.float32).reshape(2, 3, 4, 8) / 100\n"
              "out = attend.scaled_dot_product_attention(q, q, q, is_causal=True)\n"
              "print(attend.__file__)\n"
              "print(attend.version(), out.shape, float(out.sum()))\n")
    run = subprocess.run([python, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         env=environment, timeout=120)
    assert run.returncode == 0, run.stderr
    installed, result = run.stdout.splitlines()
    assert pathlib.Path(installed).resolve().is_relative_to(venv.resolve())
    q = np.arange(2 * 3 * 4 * 8, dtype=np.float32).reshape(2, 3, 4, 8) / 100
    out = attend.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert result == f"{attend.version()} {out.shape} {float(out.sum())}"
    info = subprocess.run([python, "-m", "attend", "info"], capture_output=True, text=True,
                          cwd=tmp_path, env=environment, timeout=120)
    assert info.returncode == 0 and info.stdout.startswith(f"attend {attend.version()}\n")
