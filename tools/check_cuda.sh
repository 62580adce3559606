#!/usr/bin/env bash
# Compiles every csrc/cuda/*.cu with nvcc for sm_80 and sm_90 (compile only:
# the CPU build of torch ships the CUDA headers, so no GPU is needed). Fails on
# any error. Only c10/ATen headers that need no CUDA library headers may be
# used (no ATen/cuda/CUDAContext.h: cuSPARSE/cuBLAS headers are absent here).
# Usage: tools/check_cuda.sh [nvcc]
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${1:-${NVCC:-nvcc}}
if ! command -v "$NVCC" >/dev/null 2>&1; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; else echo "check_cuda: nvcc not found, skipping"; exit 0; fi
fi
TORCH_INC=$(python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths()))")
PY_INC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
ABI=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
out=$(mktemp -d)
status=0
shopt -s nullglob
files=(csrc/cuda/*.cu)
for f in "${files[@]}"; do
  echo "nvcc: $f (sm_80, sm_90)"
  if ! "$NVCC" -c "$f" -o "$out/$(basename "$f").o" -std=c++20 -O3 --expt-relaxed-constexpr \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      -Xcompiler -fPIC -D_GLIBCXX_USE_CXX11_ABI="$ABI" -DPRUNOPT_WITH_CUDA -DTORCH_EXTENSION_NAME=_C \
      -Icsrc/include $TORCH_INC -I"$PY_INC" -Itools/cuda_shim; then
    status=1
  fi
done
rm -rf "$out"
echo "check_cuda: ${#files[@]} file(s), status $status"
exit $status
