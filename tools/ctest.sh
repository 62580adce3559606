#!/usr/bin/env bash
# Configures CMakeLists.txt against the installed torch, builds the kernels and
# the C++ unit tests, and runs them with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/cmake}
prefix=$(python3 -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
cmake -S . -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
  -DPython3_EXECUTABLE="$(command -v python3)" >/dev/null
cmake --build "$build" -j "${MAX_JOBS:-2}"
ctest --test-dir "$build" --output-on-failure
