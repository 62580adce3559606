#!/usr/bin/env bash
# The kernels under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# Builds the kernels and the C++ unit tests with -fsanitize=address,undefined
# (CMakeLists.txt, -DPRUNOPT_SANITIZE=ON) at -O0 into their own directory
# (build/sanitize by default; the normal prunopt/_C*.so is left alone), runs
# the C++ unit tests (ctest), then the op tests (tests/ops and the fuzz tests
# of the registered ops) against the sanitized libprunopt_ops.so: prunopt's
# loader takes it from PRUNOPT_EXTENSION_LIBRARY instead of prunopt._C.
#
# Why -O0: the sanitizers' instrumentation makes GCC's optimisers slow on the
# heavily templated kernels. fb_conv2d.cpp alone, instrumented, -g1: 518 s of
# CPU at -O1, 244 s at -O0 (an -O1 -g build took 44 min of it on a loaded
# host). At -O0 the whole script took 5.5 min on 2 cores (build 223 s, ctest
# 1 s, pytest 89 s; a lightly loaded host). PRUNOPT_SANITIZE_OPT=-O1 (or -O2)
# builds at another level (into another directory: build/sanitize-O1).
#
# Python is not instrumented, so libasan is preloaded (it must come first),
# with libstdc++ (C++ exceptions thrown through the sanitized code are then
# caught by torch's handlers); Python leaks by design, so leak detection is
# off. Every report is fatal: the run fails on the first one.
#
#   bash tools/sanitize.sh [BUILD_DIR] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/sanitize}
shift || true
opt=${PRUNOPT_SANITIZE_OPT:--O0}
prefix=$(python3 -c "import torch.utils; print(torch.utils.cmake_prefix_path)")

echo "-- configure and build ($build: ASan + UBSan, $opt)"
t0=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE= -DPRUNOPT_SANITIZE=ON \
  -DPRUNOPT_SANITIZE_OPT="$opt" -DPython3_EXECUTABLE="$(command -v python3)" >/dev/null
cmake --build "$build" -j "${MAX_JOBS:-2}"
t1=$(date +%s)

lib=$(cd "$build" && pwd)/libprunopt_ops.so
[ -f "$lib" ] || { echo "sanitize: $lib was not built"; exit 1; }
libasan=$(${CXX:-g++} -print-file-name=libasan.so)
libstdcxx=$(${CXX:-g++} -print-file-name=libstdc++.so)
for f in "$libasan" "$libstdcxx"; do
  [ -f "$f" ] || { echo "sanitize: $f not found (install the compiler's libasan)"; exit 1; }
done

# halt_on_error: the first report ends the process with a non-zero status;
# allocator_may_return_null: a huge allocation fails as torch expects (an
# error), not as an ASan abort
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:exitcode=86:allocator_may_return_null=1
export ASAN_OPTIONS=$ASAN_OPTIONS:strict_init_order=1:check_initialization_order=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:exitcode=87

echo "-- C++ unit tests under the sanitizers (ctest)"
ctest --test-dir "$build" --output-on-failure
t2=$(date +%s)

echo "-- op tests under the sanitizers (tests/ops, tests/fuzz/test_fuzz_ops.py)"
# The fused kernels' SIMD clones are all exercised: the tests switch
# PRUNOPT_NO_AVX512 themselves. Below -O2 the FB sparse path's AVX-512 and
# AVX2 clones agree to a stated tolerance, not bit for bit
# (prunopt.testing.kernels_optimised).
case "$opt" in -O0|-O1|-Og) unopt=1 ;; *) unopt=0 ;; esac
LD_PRELOAD="$libasan:$libstdcxx" PRUNOPT_EXTENSION_LIBRARY="$lib" PRUNOPT_REQUIRE_EXTENSION=1 \
  PRUNOPT_KERNELS_UNOPTIMISED=$unopt \
  python3 -m pytest -q -p no:cacheprovider tests/ops tests/fuzz/test_fuzz_ops.py "$@"
t3=$(date +%s)
echo "sanitize: build $((t1 - t0)) s, ctest $((t2 - t1)) s, pytest $((t3 - t2)) s"
