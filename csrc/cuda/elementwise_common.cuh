// Launch helpers shared by the CUDA kernels of the sparsification ops: the
// stream/guard/launch-check macros, a block-wide double sum, and grid-stride
// elementwise maps (map_unary / map_binary) used by rgf_relu and
// two_temperature_sigmoid.
//
// A CUDA build of torch ships c10/cuda; the CPU build used by the compile-only
// check (tools/check_cuda.sh) does not, so there the kernels are launched on the
// default stream without a device guard. Real builds always take the first branch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
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

// Grid-stride elementwise kernels: y = op(x), y = op(a, b), computed in opmath.
template <typename scalar_t, typename Op>
__global__ void unary_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t n, Op op) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x) {
    y[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(x[i])));
  }
}

template <typename scalar_t, typename Op>
__global__ void binary_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
    scalar_t* __restrict__ y, int64_t n, Op op) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x) {
    y[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(a[i]), static_cast<opmath_t>(b[i])));
  }
}

// y = Op<opmath_t>{params...}(x) elementwise into a new contiguous tensor, on
// the current stream of x's device; half/bfloat16/float/double. The inputs are
// validated by the caller.
template <template <typename> class Op, typename... Params>
at::Tensor map_unary(const at::Tensor& x_in, Params... params) {
  PRUNOPT_DEVICE_GUARD(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel();
  if (n == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "prunopt_map_unary_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    unary_kernel<scalar_t><<<num_blocks(n), kThreads, 0, PRUNOPT_CUDA_STREAM()>>>(
        x.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), n, Op<opmath_t>{static_cast<opmath_t>(params)...});
  });
  PRUNOPT_LAUNCH_CHECK();
  return y;
}

// y = Op<opmath_t>{params...}(a, b) elementwise; a and b have the same shape and dtype.
template <template <typename> class Op, typename... Params>
at::Tensor map_binary(const at::Tensor& a_in, const at::Tensor& b_in, Params... params) {
  PRUNOPT_DEVICE_GUARD(b_in.device());
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = b_in.contiguous();
  at::Tensor y = at::empty_like(b, at::MemoryFormat::Contiguous);
  const int64_t n = b.numel();
  if (n == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.scalar_type(), "prunopt_map_binary_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    binary_kernel<scalar_t><<<num_blocks(n), kThreads, 0, PRUNOPT_CUDA_STREAM()>>>(a.const_data_ptr<scalar_t>(),
        b.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), n, Op<opmath_t>{static_cast<opmath_t>(params)...});
  });
  PRUNOPT_LAUNCH_CHECK();
  return y;
}

}  // namespace cuda
}  // namespace prunopt
