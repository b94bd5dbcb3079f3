#!/usr/bin/env python3
"""Fails, naming the include chain, when the kernels or the reference sit above the API.

The floors: files under src/kernels/ and src/reference/ are called by the boundary
(src/sdpa.cpp and the other entry points) and must not depend on it. From the public API
(include/attend/) they may reach, directly or through any chain of quoted includes, only the
vocabulary headers: types and constants that include nothing but the standard library and
each other (VOCABULARY below). An entry-point header (attend/sdpa.hpp, attend/kv_cache.hpp,
...) or a vocabulary header that starts including one breaks the floor. Run by .ci/run and by
CTest (check_floors).
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLOORS = ["src/kernels", "src/reference"]
VOCABULARY = {
    "attend/error.hpp",
    "attend/tensor.hpp",
    "attend/score_rules.hpp",
    "attend/score_mod.hpp",
    "attend/attention_options.hpp",
}
SEARCH = [ROOT / "include", ROOT / "src"]  # the library's include directories, in order
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def resolve(name, including):
    for base in [including.parent] + SEARCH:
        path = base / name
        if path.is_file():
            return path.resolve()
    return None  # a system or third-party header


def api_name(path):
    try:
        return path.relative_to(ROOT / "include").as_posix()
    except ValueError:
        return None


def main():
    failures = []
    for floor in FLOORS:
        for start in sorted((ROOT / floor).rglob("*")):
            if start.suffix not in {".h", ".hpp", ".cc", ".cpp"}:
                continue
            # Depth-first over quoted includes, keeping the chain that reached each file.
            stack, seen = [(start, [start.relative_to(ROOT).as_posix()])], set()
            while stack:
                path, chain = stack.pop()
                if path in seen:
                    continue
                seen.add(path)
                for name in INCLUDE.findall(path.read_text(encoding="utf-8")):
                    target = resolve(name, path)
                    if target is None:
                        continue
                    api = api_name(target)
                    step = chain + [api or target.relative_to(ROOT).as_posix()]
                    if api is not None and api not in VOCABULARY:
                        failures.append(" -> ".join(step))
                        continue
                    stack.append((target, step))
    if failures:
        print("the kernels and the reference include API headers beyond the vocabulary "
              f"({', '.join(sorted(VOCABULARY))}):", file=sys.stderr)
        for chain in sorted(set(failures)):
            print("  " + chain, file=sys.stderr)
        return 1
    print(f"floors hold: {', '.join(FLOORS)} reach only the vocabulary headers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
