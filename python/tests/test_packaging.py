"""What the package ships beside the code: type stubs that name what the compiled module holds,
`python3 -m attend info` (the command-line tool's `attend info`), a docstring on every public
function, class and method."""

import ast
import inspect
import os
import pathlib
import subprocess
import sys

import attend
import attend.serving
import attend.torch
from attend import _attend

PACKAGE = pathlib.Path(attend.__file__).resolve().parent


def stub_names(tree):
    """Top-level names a stub defines, and {class: method and attribute names}."""
    names, methods = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            methods[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            methods[node.name] |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets)
    return names, methods


def test_stubs_name_what_the_compiled_module_holds():
    assert (PACKAGE / "py.typed").exists()
    names, methods = stub_names(ast.parse((PACKAGE / "_attend.pyi").read_text()))
    public = {n for n in dir(_attend) if not n.startswith("_")}
    assert public - names == set(), "missing from _attend.pyi"
    assert names - public - {"Array"} == set(), "in _attend.pyi but not in the module"
    for cls, declared in methods.items():
        if cls in ("Error", "DTypeError"):
            continue
        actual = {n for n in dir(getattr(_attend, cls)) if not n.startswith("_")}
        assert actual - declared == set(), f"{cls}: methods missing from _attend.pyi"
        assert declared - actual - {"__init__", "__call__"} == set(), \
            f"{cls}: methods not in the module"


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


def test_every_public_function_has_a_docstring():
    undocumented = []
    for module in (attend, attend.torch, attend.serving):
        for name in module.__all__:
            value = getattr(module, name)
            if not (inspect.getdoc(value) or "").strip():
                undocumented.append(f"{module.__name__}.{name}")
            if inspect.isclass(value):
                for member, function in vars(value).items():
                    if not member.startswith("_") and callable(function) and \
                            not (inspect.getdoc(function) or "").strip():
                        undocumented.append(f"{module.__name__}.{name}.{member}")
    assert undocumented == []
