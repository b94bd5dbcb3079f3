"""Builds attend's Python package: CMake builds the extension module attend._attend (target
attend_python, see python/CMakeLists.txt) and setuptools installs it with python/attend/.

    pip install --no-build-isolation .

--no-build-isolation: pip then uses the installed setuptools and wheel (Debian's
python3-setuptools, python3-wheel) instead of downloading them. Needs what the CMake build
needs (scripts/install-deps.sh). ATTEND_CMAKE_ARGS adds CMake arguments.

ATTEND_BUILD_DIR=<a configured CMake build tree of this source> packages that tree's module
instead: `cmake --build <tree> --target attend_python` (nothing to do when it is up to date),
then its python/attend/_attend*.so goes into the wheel (test_packaging.py builds the wheel this
way; scripts/wheel_check.sh builds it from nothing).
"""

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent
VERSION = re.search(r"project\(attend VERSION ([0-9.]+)",
                    (ROOT / "CMakeLists.txt").read_text()).group(1)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        target = pathlib.Path(self.get_ext_fullpath(ext.name)).resolve()
        existing = os.environ.get("ATTEND_BUILD_DIR")
        if existing:
            build = pathlib.Path(existing).resolve()
            if not (build / "CMakeCache.txt").is_file():
                raise RuntimeError(f"ATTEND_BUILD_DIR={existing}: not a configured CMake build "
                                   "tree (no CMakeCache.txt)")
        else:
            build = pathlib.Path(self.build_temp).resolve() / "cmake"
            self.configure(build)
        subprocess.check_call(["cmake", "--build", str(build), "--target", "attend_python"])
        built = build / "python" / "attend" / target.name
        if not built.is_file():
            raise RuntimeError(f"{built} was not built (the build tree's Python is not "
                               f"{sys.executable}?)")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)

    def configure(self, build):
        configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                     "-DATTEND_BUILD_PYTHON=ON", "-DATTEND_BUILD_TESTS=OFF",
                     "-DATTEND_BUILD_TOOLS=OFF", "-DATTEND_BUILD_BENCH=OFF",
                     "-DATTEND_BUILD_EXAMPLES=OFF", f"-DPython3_EXECUTABLE={sys.executable}"]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        configure += shlex.split(os.environ.get("ATTEND_CMAKE_ARGS", ""))
        subprocess.check_call(configure)


# build/ is CMake's. With ATTEND_BUILD_DIR setuptools' own files go into that tree too, so
# that packaging a built tree writes nothing into the sources.
if os.environ.get("ATTEND_BUILD_DIR"):
    _PIP_DIR = pathlib.Path(os.environ["ATTEND_BUILD_DIR"]).resolve() / "pip"
    _PIP_DIR.mkdir(parents=True, exist_ok=True)
    SETUP_OPTIONS = {"build": {"build_base": str(_PIP_DIR)}, "egg_info": {"egg_base": str(_PIP_DIR)}}
else:
    SETUP_OPTIONS = {"build": {"build_base": "build-pip"}}


setup(
    name="attend",
    version=VERSION,
    description="Scaled dot-product attention on the CPU for NumPy and PyTorch",
    packages=["attend"],
    package_dir={"": "python"},
    package_data={"attend": ["*.pyi", "py.typed"]},  # type stubs of the compiled module
    ext_modules=[CMakeExtension("attend._attend")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["numpy"],
    options=SETUP_OPTIONS,
    zip_safe=False,
)
