// relu with rectified gradient flow on CUDA (DS eq. 15): grid-stride elementwise
// kernels over the math of prunopt/sparsification.h.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "elementwise_common.cuh"
#include "prunopt/sparsification.h"
#include "prunopt/sparsification_checks.h"

namespace prunopt {
namespace cuda {
namespace {

template <typename scalar_t>
__global__ void rgf_relu_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x) {
    y[i] = static_cast<scalar_t>(sparsification::relu(static_cast<at::opmath_type<scalar_t>>(x[i])));
  }
}

template <typename scalar_t>
__global__ void rgf_relu_backward_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ x,
    scalar_t* __restrict__ out, at::opmath_type<scalar_t> alpha, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x) {
    out[i] = static_cast<scalar_t>(
        static_cast<opmath_t>(g[i]) * sparsification::rgf_slope(static_cast<opmath_t>(x[i]), alpha));
  }
}

at::Tensor rgf_relu_cuda(const at::Tensor& x_in, double alpha) {
  check_float_tensor(x_in, "x", "rgf_relu");
  check_rgf_alpha(alpha, "rgf_relu");
  PRUNOPT_DEVICE_GUARD(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel();
  if (n == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rgf_relu_cuda", [&] {
    rgf_relu_kernel<scalar_t><<<num_blocks(n), kThreads, 0, PRUNOPT_CUDA_STREAM()>>>(
        x.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), n);
  });
  PRUNOPT_LAUNCH_CHECK();
  return y;
}

at::Tensor rgf_relu_backward_cuda(const at::Tensor& grad_in, const at::Tensor& x_in, double alpha) {
  check_float_tensor(x_in, "x", "rgf_relu_backward");
  check_like(grad_in, x_in, "grad", "x", "rgf_relu_backward");
  check_rgf_alpha(alpha, "rgf_relu_backward");
  PRUNOPT_DEVICE_GUARD(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor g = grad_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel();
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rgf_relu_backward_cuda", [&] {
    rgf_relu_backward_kernel<scalar_t><<<num_blocks(n), kThreads, 0, PRUNOPT_CUDA_STREAM()>>>(
        g.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
        static_cast<at::opmath_type<scalar_t>>(alpha), n);
  });
  PRUNOPT_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CUDA, m) {
  m.impl("rgf_relu", &prunopt::cuda::rgf_relu_cuda);
  m.impl("rgf_relu_backward", &prunopt::cuda::rgf_relu_backward_cuda);
}
