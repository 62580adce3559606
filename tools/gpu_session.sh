#!/usr/bin/env bash
# What a session with a lent GPU runs there, in one call of the device tool:
#   bash tools/gpu_session.sh          (results and logs in $OUT, else /tmp/gpu_out)
# Builds the extension for the GPU's architecture, runs the CUDA tests and the
# device-parametrised suites (pytest -n 8), then the GPU
# benchmark (prunopt/bench/bench_gpu.py -> gpu.md / gpu.json in $OUT; copy them to
# bench/results/ with the device name in the commit).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())") || exit 1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
# the system g++: the one set there (CXX=/opt/gcc/bin/g++, a wrapper) links
# libstdc++ statically into the extension, and every error an op raises then
# crashes the process (tests/test_build.py checks for it). PRUNOPT_KEEP_CXX=1
# keeps the environment's compiler.
if [ "${PRUNOPT_KEEP_CXX:-0}" = 0 ] && [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
echo "compiler: ${CXX:-default}"
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== build (sm_$arch)"
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "== CUDA tests and device-parametrised suites"
python3 -m pytest -q -n 8 -p no:cacheprovider tests/ops/test_cuda_kernels.py tests/ops/test_interspace_ops.py \
  tests/ops/test_interspace_reconstruct_ops.py tests/ops/test_projection_ops.py tests/ops/test_gates_ops.py \
  tests/nn/test_fb_layers.py tests/ops/test_prunadag_ops.py tests/optim/test_prunadag.py tests/test_build.py \
  > "$OUT/tests.log" 2>&1
tail -30 "$OUT/tests.log"
echo "== GPU benchmark"
python -m prunopt.bench.bench_gpu --out "$OUT" 2>&1 | tail -60
