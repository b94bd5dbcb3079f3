# Cross build for 64-bit Arm Linux on a Debian x86-64 host (scripts/ci-arm.sh):
#
#   cmake -S . -B build-arm -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake
#
# Compiler: Debian's g++-aarch64-linux-gnu. Libraries: the arm64 packages of Debian's multiarch
# (libhwy-dev:arm64, libgtest-dev:arm64, libgomp1:arm64) under /usr/lib/aarch64-linux-gnu;
# header-only CLI11 and nlohmann-json come from /usr/share. Programs run under qemu-aarch64
# with QEMU_LD_PREFIX=/: the loader and libc of libc6:arm64, the same multiarch release as
# the libraries above. (/usr/aarch64-linux-gnu holds the cross toolchain's own, older libc:
# its loader with multiarch's libc hangs at the first thread.)
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Search /usr/lib/aarch64-linux-gnu (and its cmake/ package files), never the host's
# /usr/lib/x86_64-linux-gnu.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
# What the build runs (GoogleTest's test listing, the CLI tests' child processes) goes
# through the emulator.
set(CMAKE_CROSSCOMPILING_EMULATOR /usr/bin/qemu-aarch64)
