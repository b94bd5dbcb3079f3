"""Builds attend's Python package: CMake builds the extension module attend._attend (target
attend_python, see python/CMakeLists.txt) and setuptools installs it with python/attend/.

    pip install --no-build-isolation .

--no-build-isolation: pip then uses the installed setuptools and wheel (Debian's
python3-setuptools, python3-wheel) instead of downloading them. Needs what the CMake build
needs (scripts/install-deps.sh). ATTEND_CMAKE_ARGS adds CMake arguments.
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
        build = pathlib.Path(self.build_temp).resolve() / "cmake"
        target = pathlib.Path(self.get_ext_fullpath(ext.name)).resolve()
        configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                     "-DATTEND_BUILD_PYTHON=ON", "-DATTEND_BUILD_TESTS=OFF",
                     "-DATTEND_BUILD_TOOLS=OFF", "-DATTEND_BUILD_BENCH=OFF",
                     "-DATTEND_BUILD_EXAMPLES=OFF", f"-DPython3_EXECUTABLE={sys.executable}"]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        configure += shlex.split(os.environ.get("ATTEND_CMAKE_ARGS", ""))
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", str(build), "--target", "attend_python"])
        built = build / "python" / "attend" / target.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)


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
    options={"build": {"build_base": "build-pip"}},  # build/ is CMake's
    zip_safe=False,
)
