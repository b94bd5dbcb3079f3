#!/usr/bin/env python3
"""The documentation's code blocks, kept true the way doctests keep Rust's and Python's.

Every ```cpp block of README.md and docs/*.md is either
  - a whole program (it has `int main`): compiled against the *installed* package
    (find_package(attend), attend::attend, and attend::attend_mpi for a block that includes
    <attend/mpi/...>, run under mpiexec with 2 ranks) and run; it must exit with status 0; or
  - marked, on the line before its fence, `<!-- fragment of examples/NAME.cpp -->`: every
    non-blank line of the block must appear in that file, in the same order (the example is
    built and run as a test of its own).
Anything else fails: a snippet nobody compiles drifts from the API.

Every ```python block is run by test_python_blocks.py under pytest (one test per block).

  doc_blocks.py cpp --source DIR --build DIR --work DIR --cmake CMAKE --cxx CXX
                    [--cxx-flags FLAGS] [--mpiexec MPIEXEC]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FRAGMENT = re.compile(r"<!--\s*fragment of (\S+)\s*-->")


@dataclass
class Block:
    document: Path  # the Markdown file
    line: int  # line of the opening fence, 1-based
    language: str
    code: str
    fragment_of: str  # "examples/x.cpp" when marked as a fragment, else ""

    @property
    def where(self) -> str:
        return f"{self.document.name}:{self.line}"

    @property
    def name(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "_", self.document.stem).lower() + f"_{self.line}"


def documents(source: Path):
    """README.md and docs/*.md."""
    return [source / "README.md"] + sorted((source / "docs").glob("*.md"))


def blocks(document: Path):
    """Every fenced block of `document` with its language and fragment marker."""
    lines = document.read_text(encoding="utf-8").split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        start, language = i, opening.group(1).lower()
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        previous = lines[start - 1] if start > 0 else ""
        marker = FRAGMENT.search(previous)
        found.append(Block(document, start + 1, language, "\n".join(body) + "\n",
                           marker.group(1) if marker else ""))
    return found


def cpp_blocks(source: Path):
    return [b for d in documents(source) for b in blocks(d) if b.language in ("cpp", "c++")]


def python_blocks(source: Path):
    return [b for d in documents(source) for b in blocks(d) if b.language == "python"]


def check_fragment(block: Block, source: Path) -> str:
    """"" when every non-blank line of the block is in the named file, in order."""
    path = source / block.fragment_of
    if not path.is_file():
        return f"{block.where}: marked as a fragment of {block.fragment_of}, which does not exist"
    file_lines = [line.strip() for line in path.read_text(encoding="utf-8").split("\n")]
    at = 0
    for wanted in (line.strip() for line in block.code.split("\n")):
        if not wanted:
            continue
        try:
            at = file_lines.index(wanted, at) + 1
        except ValueError:
            return (f"{block.where}: the line {wanted!r} is not in {block.fragment_of} "
                    "(or not in this order); update the README or the example")
    return ""


def run_cpp(arguments) -> int:
    source, work = Path(arguments.source), Path(arguments.work)
    failures, programs = [], []
    for block in cpp_blocks(source):
        if block.fragment_of:
            problem = check_fragment(block, source)
            if problem:
                failures.append(problem)
            else:
                print(f"{block.where}: fragment of {block.fragment_of}: every line found")
        elif re.search(r"\bint\s+main\s*\(", block.code):
            programs.append(block)
        else:
            failures.append(
                f"{block.where}: a ```cpp block must be a whole program (with int main) or be "
                "marked <!-- fragment of examples/NAME.cpp --> on the line before it")

    # The programs, built against the package as `cmake --install` lays it out.
    shutil.rmtree(work, ignore_errors=True)
    (work / "project").mkdir(parents=True)
    subprocess.run([arguments.cmake, "--install", arguments.build, "--prefix", work / "install"],
                   check=True, stdout=subprocess.DEVNULL)
    mpi_wanted = any("attend/mpi/" in b.code for b in programs)
    cmake_lists = [
        "cmake_minimum_required(VERSION 3.25)",
        "project(doc_examples CXX)",
        "set(CMAKE_CXX_STANDARD 20)",
        "find_package(attend REQUIRED)",
        "add_compile_options(-Wall -Wextra -Werror)",
    ]
    runnable = []
    for block in programs:
        mpi = "attend/mpi/" in block.code
        if mpi and not arguments.mpiexec:
            print(f"{block.where}: skipped (attend_mpi was not built)")
            continue
        (work / "project" / f"{block.name}.cpp").write_text(block.code, encoding="utf-8")
        guard = "if(TARGET attend::attend_mpi)\n  " if mpi else ""
        cmake_lists.append(
            f"{guard}add_executable({block.name} {block.name}.cpp)  # {block.where}\n"
            f"{'  ' if mpi else ''}target_link_libraries({block.name} PRIVATE "
            f"{'attend::attend_mpi' if mpi else 'attend::attend'})" + ("\nendif()" if mpi else ""))
        runnable.append((block, mpi))
    (work / "project" / "CMakeLists.txt").write_text("\n".join(cmake_lists) + "\n")
    configure = subprocess.run(
        [arguments.cmake, "-S", work / "project", "-B", work / "build", "-G", "Ninja",
         f"-DCMAKE_PREFIX_PATH={work / 'install'}", f"-DCMAKE_CXX_COMPILER={arguments.cxx}",
         f"-DCMAKE_CXX_FLAGS={arguments.cxx_flags}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if configure.returncode != 0:
        print(configure.stdout)
        failures.append("the documentation's programs: find_package(attend) failed")
        runnable = []
    if runnable:  # all at once, two compilers at a time; ninja -k 0: every error, not the first
        build = subprocess.run([arguments.cmake, "--build", work / "build", "-j", "2", "--",
                                "-k", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
        if build.returncode != 0:
            print(build.stdout)
    for block, mpi in runnable:
        if not (work / "build" / block.name).exists():
            failures.append(f"{block.where}: does not compile against the installed package")
            continue
        program = [str(work / "build" / block.name)]
        if mpi:
            program = [arguments.mpiexec, "-np", "2", "--allow-run-as-root", "--oversubscribe",
                       "-x", "OMP_NUM_THREADS=1"] + program
        run = subprocess.run(program, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="2"))
        output = run.stdout.strip().replace("\n", "\n    ")
        print(f"{block.where}: compiled and ran{' on 2 MPI ranks' if mpi else ''}, "
              f"status {run.returncode}\n    {output}")
        if run.returncode != 0:
            failures.append(f"{block.where}: exited with status {run.returncode}")

    for failure in failures:
        print("FAILED " + failure)
    print(f"{len(programs)} program(s), "
          f"{sum(1 for b in cpp_blocks(source) if b.fragment_of)} fragment(s), "
          f"{len(failures)} failure(s)")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cpp = commands.add_parser("cpp", help="check, build and run the C++ blocks")
    cpp.add_argument("--source", required=True)
    cpp.add_argument("--build", required=True)
    cpp.add_argument("--work", required=True)
    cpp.add_argument("--cmake", required=True)
    cpp.add_argument("--cxx", required=True)
    cpp.add_argument("--cxx-flags", default="")
    cpp.add_argument("--mpiexec", default="")
    arguments = parser.parse_args()
    return run_cpp(arguments)


if __name__ == "__main__":
    sys.exit(main())
