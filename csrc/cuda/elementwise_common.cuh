// Launch helpers shared by the CUDA kernels of the sparsification ops.
//
// A CUDA build of torch ships c10/cuda; the CPU build used by the compile-only
// check (tools/check_cuda.sh) does not, so there the kernels are launched on the
// default stream without a device guard. Real builds always take the first branch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define PRUNOPT_CUDA_STREAM() c10::cuda::getCurrentCUDAStream().stream()
#define PRUNOPT_DEVICE_GUARD(dev) c10::cuda::CUDAGuard prunopt_device_guard_(dev)
#define PRUNOPT_LAUNCH_CHECK() C10_CUDA_KERNEL_LAUNCH_CHECK()
#else
#include <c10/util/Exception.h>
#define PRUNOPT_CUDA_STREAM() static_cast<cudaStream_t>(0)
#define PRUNOPT_DEVICE_GUARD(dev) (void)(dev)
#define PRUNOPT_LAUNCH_CHECK()                                                     \
  do {                                                                             \
    const cudaError_t prunopt_err_ = cudaGetLastError();                           \
    TORCH_CHECK(prunopt_err_ == cudaSuccess, "CUDA kernel launch failed: ",        \
        cudaGetErrorString(prunopt_err_));                                         \
  } while (0)
#endif

namespace prunopt {
namespace cuda {

constexpr int kThreads = 256;

inline int num_blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(b, 65535LL * 8)));
}

// Sum of `v` over the block (blockDim.x == kThreads); every thread gets the result.
__device__ __forceinline__ double block_sum(double v, double* smem) {
  const int t = threadIdx.x;
  smem[t] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) smem[t] += smem[t + s];
    __syncthreads();
  }
  const double r = smem[0];
  __syncthreads();
  return r;
}

}  // namespace cuda
}  // namespace prunopt
