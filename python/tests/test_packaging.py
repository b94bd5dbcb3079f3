"""What the package ships beside the code: `python3 -m attend info` (the command-line tool's
`attend info`). The stubs and docstrings: test_stubs.py."""

import os
import pathlib
import subprocess
import sys

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
