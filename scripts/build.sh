#!/usr/bin/env bash
# Configures and builds lathe into BUILD_DIR (default: build). The CUDA backend is built when nvcc is found;
# pass -DLATHE_CUDA=OFF (or any other CMake option) after the directory to change that.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}; shift || true
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build" -j"$(nproc)"
