"""The type stubs (attend/_attend.pyi) against the compiled module, and the public API's
docstrings: what an editor shows a user.

- Every public name of attend._attend (function, class, method, property, constant) is in the
  stub and every stub name is in the module; properties are properties in both.
- Every stub function and method declares the module's argument names, in order, with the
  same keyword-only marker, every argument and the result annotated. The module's names come
  from inspect.signature where it works, else from the signature line its docstring opens
  with (pybind11 writes one; the METH_FASTCALL entries carry one by hand).
- Every public function, class, method and property of the attend package (its __all__, and
  attend.torch's and attend.serving's) has a docstring beyond pybind11's generated signature,
  and where it takes arrays, the docstring states their shapes: "(B, H, L, E)"-style
  notation or the word "shape". Stub functions that take arrays do as well.
- mypy's stubtest passes on the stub, where mypy is installed.
"""

import ast
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import attend
import attend.serving
import attend.torch
from attend import _attend

PACKAGE = pathlib.Path(attend.__file__).resolve().parent
STUB = ast.parse((PACKAGE / "_attend.pyi").read_text())

# Argument names that hold arrays (or lists of them) in attend's API.
ARRAY_ARGUMENTS = {
    "query", "key", "value", "x", "out", "attn_mask", "mask", "key_padding_mask", "ids",
    "encoding", "positions", "cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "key_blocks",
    "value_blocks", "block_tables", "seq_lens", "grad_output", "tensors", "logsumexp",
    "key_mass", "key_scales", "value_scales", "sinks", "alibi", "segment_ids", "lengths",
    "output", "bias", "array",
}
# A shape: a parenthesized list with a comma or a single symbol/ellipsis, e.g. (B, H, L, E),
# (B + 1), (..., Lq), (H); or the word.
SHAPE = re.compile(r"\((?:[^()]*,[^()]*|\.\.\.|[A-Za-z_][A-Za-z_0-9]*(?: ?[+*·] ?\w+)?)\)|\bshape")


def stub_classes():
    return {node.name: node for node in STUB.body if isinstance(node, ast.ClassDef)}


def stub_functions(body):
    return {node.name: node for node in body if isinstance(node, ast.FunctionDef)}


def is_property(node):
    return any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)


def stub_members(cls):
    """{name: "property" | "method" | "attribute"} of a stub class."""
    members = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            members[node.name] = "property" if is_property(node) else "method"
        elif isinstance(node, ast.AnnAssign):
            members[node.target.id] = "attribute"
    return members


def runtime_members(cls):
    """{name: "property" | "method" | "attribute"} of a class's public members and __init__,
    __call__ where the class defines them."""
    members = {}
    for name in dir(cls):
        if name.startswith("_") and name not in ("__init__", "__call__"):
            continue
        raw = inspect.getattr_static(cls, name)
        if name in ("__init__", "__call__") and name not in vars(cls):
            continue
        members[name] = "property" if isinstance(raw, property) else \
            "method" if callable(raw) or isinstance(raw, (classmethod, staticmethod)) else \
            "attribute"
    return members


def test_stub_names_are_the_module_names():
    assert (PACKAGE / "py.typed").exists()
    top = {}
    for node in STUB.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top[node.name] = node
        elif isinstance(node, ast.AnnAssign):
            top[node.target.id] = node
        elif isinstance(node, ast.Assign):
            top.update((t.id, node) for t in node.targets)
    public = {n for n in dir(_attend) if not n.startswith("_")}
    assert sorted(public - set(top)) == [], "missing from _attend.pyi"
    assert sorted(set(top) - set(dir(_attend)) - {"Array"}) == [], \
        "in _attend.pyi but not in the module"
    for name, cls in stub_classes().items():
        if name in ("Error", "DTypeError"):
            continue
        declared, actual = stub_members(cls), runtime_members(getattr(_attend, name))
        assert sorted(set(actual) - set(declared) - {"__init__"}) == [], \
            f"{name}: members missing from _attend.pyi"
        assert sorted(set(declared) - set(actual)) == [], f"{name}: not in the module"
        for member, kind in declared.items():
            if member in actual:
                assert kind == actual[member], f"{name}.{member}: a {actual[member]} in the " \
                                               f"module, a {kind} in the stub"


def split_top_level(text):
    parts, depth, current = [], 0, ""
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += c
    if current.strip():
        parts.append(current.strip())
    return parts


def runtime_arguments(function, name):
    """The argument names of a compiled function or method, "*" marking keyword-only ones,
    without self; None where the module states none."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (ValueError, TypeError):
        parameters = None
    if parameters is not None:
        names = []
        for p in parameters:
            if p.kind == p.KEYWORD_ONLY and "*" not in names:
                names.append("*")
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                names.append(("*" if p.kind == p.VAR_POSITIONAL else "**") + p.name)
            else:
                names.append(p.name)
        return [n for n in names if n != "self"]
    doc = function.__doc__ or ""
    line = re.match(r"(?:\d+\. )?(?:\w+\.)*" + re.escape(name) + r"\((.*?)\)(?: ->|$|\n|:)",
                    doc)
    if line is None:
        return None
    names = []
    for part in split_top_level(line.group(1)):
        argument = re.split(r"[:=]", part)[0].strip()
        if argument and argument not in ("self", "/"):
            names.append(argument)
    return names


def stub_arguments(node):
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        names.append("*")
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return [n for n in names if n != "self"]


def stub_callables():
    """(qualified name, stub node, runtime object, name) for every stub function and method."""
    found = []
    for name, node in stub_functions(STUB.body).items():
        found.append((name, node, getattr(_attend, name), name))
    for cls_name, cls in stub_classes().items():
        runtime = getattr(_attend, cls_name)
        for name, node in stub_functions(cls.body).items():
            if is_property(node):
                continue
            target = runtime if name == "__init__" and cls_name != "BoundPlan" else \
                getattr(runtime, name)
            found.append((f"{cls_name}.{name}", node, target, cls_name if name == "__init__" and
                          runtime.__doc__ and runtime.__doc__.startswith(cls_name + "(") else name))
    return found


@pytest.mark.parametrize("qualified, node, runtime, name", stub_callables(),
                         ids=[c[0] for c in stub_callables()])
def test_stub_signature_is_the_module_signature(qualified, node, runtime, name):
    everything = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    unannotated = [a.arg for a in everything if a.annotation is None and a.arg != "self"]
    assert unannotated == [], f"{qualified}: arguments without a type"
    assert node.returns is not None, f"{qualified}: no result type"
    if qualified.endswith(".__init__"):
        # pybind11 states the constructor's signature on __init__.
        cls = getattr(_attend, qualified.split(".")[0])
        actual = runtime_arguments(vars(cls)["__init__"], "__init__") \
            if "__init__" in vars(cls) else None
    else:
        actual = runtime_arguments(runtime, name)
    assert actual is not None, f"{qualified}: the module states no signature"
    assert stub_arguments(node) == actual, qualified


GENERATED = re.compile(r"(?:\d+\. )?[\w.]+\((?P<arguments>.*)\) -> (?P<result>.*)$")


def own_doc(value):
    """A docstring without the signature lines pybind11 generates ("name(a: T, b: U) -> R":
    every argument typed, a result without a colon; a hand-written "name(a) -> R: text"
    stays)."""
    lines = (inspect.getdoc(value) or "").splitlines()
    while lines:
        line = GENERATED.match(lines[0])
        generated = line is not None and ": " not in line.group("result") and all(
            ": " in a or a in ("*", "/") for a in split_top_level(line.group("arguments")))
        if not (generated or lines[0].startswith("Overloaded function") or not lines[0].strip()):
            break
        lines.pop(0)
    return "\n".join(lines).strip()


def public_api():
    """(qualified name, object, argument names or None) of the package's public API."""
    items = []
    for module in (attend, attend.torch, attend.serving):
        for name in module.__all__:
            value = getattr(module, name)
            qualified = f"{module.__name__}.{name}"
            items.append((qualified, value))
            if inspect.isclass(value) and not issubclass(value, BaseException):
                for member, raw in vars(value).items():
                    if member.startswith("_") and member != "__call__":
                        continue
                    if isinstance(raw, (classmethod, staticmethod)):
                        raw = raw.__func__
                    if callable(raw) or isinstance(raw, property):
                        items.append((f"{qualified}.{member}", raw))
    return items


def argument_names(value, name):
    if inspect.isclass(value):
        init = vars(value).get("__init__")
        names = runtime_arguments(init, "__init__") if init is not None else None
        doc_names = runtime_arguments(value, value.__name__)
        return (names or []) + (doc_names or [])
    if isinstance(value, property):
        return []
    return runtime_arguments(value, name.rsplit(".", 1)[-1]) or []


def test_every_public_callable_has_a_docstring_with_shapes():
    undocumented, shapeless = [], []
    for qualified, value in public_api():
        doc = own_doc(value)
        if not doc:
            undocumented.append(qualified)
            continue
        arrays = set(argument_names(value, qualified)) & ARRAY_ARGUMENTS
        if arrays and not SHAPE.search(doc):
            shapeless.append(f"{qualified} ({', '.join(sorted(arrays))})")
    assert undocumented == [], "no docstring"
    assert shapeless == [], "takes arrays, states no shape"


def test_stub_functions_taking_arrays_state_shapes():
    shapeless = []
    for qualified, node, _, _ in stub_callables():
        a = node.args
        typed = [x for x in a.posonlyargs + a.args + a.kwonlyargs
                 if x.annotation is not None and "Array" in ast.unparse(x.annotation)]
        if not typed or qualified.startswith("cpp_") or qualified.endswith("__init__"):
            continue
        doc = ast.get_docstring(node) or ""
        if not SHAPE.search(doc):
            shapeless.append(qualified)
    for name, cls in stub_classes().items():
        init = stub_functions(cls.body).get("__init__")
        if init is not None and any("Array" in ast.unparse(x.annotation or ast.Name("")) for x in
                                    init.args.args + init.args.kwonlyargs):
            if not SHAPE.search(ast.get_docstring(cls) or ""):
                shapeless.append(name)
    assert shapeless == []


# What mypy's stubtest reports that the stub cannot state: pybind11's metaclass, the `Array`
# alias (typing only), and the constructors of classes only the module makes.
STUBTEST_ALLOWED = r"""
attend\._attend\.(AttentionPlan|BoundPlan|MultiHeadAttention|MultiHeadTape|PagedKvCache)
attend\._attend\.(PatchEmbedding|PositionEmbedding|Rope|ServingOptions|SpatialSelfAttention)
attend\._attend\.TokenEmbedding
attend\._attend\.Array
attend\._attend\.(BoundPlan|MultiHeadTape)\.__init__
"""


def test_mypy_stubtest(tmp_path):
    """mypy's stubtest on the stub alone (the package's own sources are not its subject), where
    mypy is installed (Debian: python3-mypy)."""
    pytest.importorskip("mypy")
    stubs = tmp_path / "stubs" / "attend"
    stubs.mkdir(parents=True)
    (stubs / "__init__.pyi").write_text("")
    (stubs / "_attend.pyi").write_text((PACKAGE / "_attend.pyi").read_text())
    allowlist = tmp_path / "allowlist.txt"
    allowlist.write_text(STUBTEST_ALLOWED)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")  # not the user's configuration
    run = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "attend._attend", "--allowlist", str(allowlist),
         "--mypy-config-file", str(tmp_path / "mypy.ini")],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
        env={**os.environ, "MYPYPATH": str(tmp_path / "stubs"),
             "PYTHONPATH": str(PACKAGE.parent)})
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_on_the_package(tmp_path):
    """mypy on the package's own sources (attend/*.py with the stub of the compiled module) finds
    nothing, where mypy is installed (Debian: python3-mypy)."""
    pytest.importorskip("mypy")
    package = tmp_path / "attend"
    package.mkdir()
    for source in list(PACKAGE.glob("*.py")) + [PACKAGE / "_attend.pyi", PACKAGE / "py.typed"]:
        (package / source.name).write_text(source.read_text())
    (tmp_path / "mypy.ini").write_text("[mypy]\n")  # not the user's configuration
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"),
         "--cache-dir", str(tmp_path / "cache"), "-p", "attend"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
