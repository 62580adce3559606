// Two-temperature sigmoid on CUDA (AP eq. 6-7): grid-stride elementwise kernels
// over the math of prunopt/sparsification.h.
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
__global__ void tts_forward_kernel(const scalar_t* __restrict__ w, scalar_t* __restrict__ v,
    at::opmath_type<scalar_t> t_l, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x) {
    v[i] = static_cast<scalar_t>(sparsification::sigmoid(t_l * static_cast<opmath_t>(w[i])));
  }
}

template <typename scalar_t>
__global__ void tts_backward_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ w,
    scalar_t* __restrict__ out, at::opmath_type<scalar_t> t_s, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x) {
    out[i] = static_cast<scalar_t>(static_cast<opmath_t>(g[i]) * t_s *
        sparsification::sigmoid_slope(t_s * static_cast<opmath_t>(w[i])));
  }
}

at::Tensor two_temperature_sigmoid_cuda(const at::Tensor& w_in, double t_l, double t_s) {
  check_float_tensor(w_in, "w", "two_temperature_sigmoid");
  check_temperature(t_l, "t_l", "two_temperature_sigmoid");
  check_temperature(t_s, "t_s", "two_temperature_sigmoid");
  PRUNOPT_DEVICE_GUARD(w_in.device());
  const at::Tensor w = w_in.contiguous();
  at::Tensor v = at::empty_like(w, at::MemoryFormat::Contiguous);
  const int64_t n = w.numel();
  if (n == 0) return v;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "two_temperature_sigmoid_cuda", [&] {
    tts_forward_kernel<scalar_t><<<num_blocks(n), kThreads, 0, PRUNOPT_CUDA_STREAM()>>>(
        w.const_data_ptr<scalar_t>(), v.mutable_data_ptr<scalar_t>(), static_cast<at::opmath_type<scalar_t>>(t_l), n);
  });
  PRUNOPT_LAUNCH_CHECK();
  return v;
}

at::Tensor two_temperature_sigmoid_backward_cuda(const at::Tensor& grad_in, const at::Tensor& w_in, double t_s) {
  check_float_tensor(w_in, "w", "two_temperature_sigmoid_backward");
  check_like(grad_in, w_in, "grad", "w", "two_temperature_sigmoid_backward");
  check_temperature(t_s, "t_s", "two_temperature_sigmoid_backward");
  PRUNOPT_DEVICE_GUARD(w_in.device());
  const at::Tensor w = w_in.contiguous();
  const at::Tensor g = grad_in.contiguous();
  at::Tensor out = at::empty_like(w, at::MemoryFormat::Contiguous);
  const int64_t n = w.numel();
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "two_temperature_sigmoid_backward_cuda", [&] {
    tts_backward_kernel<scalar_t><<<num_blocks(n), kThreads, 0, PRUNOPT_CUDA_STREAM()>>>(
        g.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
        static_cast<at::opmath_type<scalar_t>>(t_s), n);
  });
  PRUNOPT_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CUDA, m) {
  m.impl("two_temperature_sigmoid", &prunopt::cuda::two_temperature_sigmoid_cuda);
  m.impl("two_temperature_sigmoid_backward", &prunopt::cuda::two_temperature_sigmoid_backward_cuda);
}
