// Sparse gates of differentiable sparsification on CUDA (DS eq. 9-12, 15). One
// block per group (row of alpha); block-wide sums in double. The formulas are
// those of csrc/cpu/sparse_gate.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <tuple>

#include "elementwise_common.cuh"
#include "prunopt/sparsification.h"
#include "prunopt/sparsification_checks.h"

namespace prunopt {
namespace cuda {
namespace {

namespace sp = prunopt::sparsification;

template <typename scalar_t>
__global__ void gate_forward_kernel(const scalar_t* __restrict__ alpha, const scalar_t* __restrict__ beta,
    scalar_t* __restrict__ out, int64_t n, bool is_signed) {
  __shared__ double smem[kThreads];
  const int64_t r = blockIdx.x;
  const scalar_t* al = alpha + r * n;
  scalar_t* o = out + r * n;
  const double s = sp::sigmoid(static_cast<double>(beta[r]));
  double acc = 0;
  if (is_signed) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += fabs(static_cast<double>(al[i]));
    const double th = s * block_sum(acc, smem);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const double x = static_cast<double>(al[i]);
      o[i] = static_cast<scalar_t>(sp::sign(x) * sp::relu(fabs(x) - th));
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += exp(static_cast<double>(al[i]));
  const double th = s * block_sum(acc, smem);
  double t = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) t += sp::relu(exp(static_cast<double>(al[i])) - th);
  const double T = block_sum(t, smem);
  const double Ts = T > 0 ? T : 1.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    o[i] = static_cast<scalar_t>(sp::relu(exp(static_cast<double>(al[i])) - th) / Ts);
  }
}

template <typename scalar_t>
__global__ void gate_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ alpha,
    const scalar_t* __restrict__ beta, scalar_t* __restrict__ galpha, scalar_t* __restrict__ gbeta, int64_t n,
    bool is_signed, double rgf_alpha) {
  __shared__ double smem[kThreads];
  const int64_t r = blockIdx.x;
  const scalar_t* al = alpha + r * n;
  const scalar_t* g = grad + r * n;
  scalar_t* ga = galpha + r * n;
  const double b = static_cast<double>(beta[r]);
  const double s = sp::sigmoid(b);
  const double ds = sp::sigmoid_slope(b);
  if (is_signed) {
    double l = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) l += fabs(static_cast<double>(al[i]));
    const double L = block_sum(l, smem);
    const double th = s * L;
    double p = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const double x = static_cast<double>(al[i]);
      p += static_cast<double>(g[i]) * sp::sign(x) * sp::rgf_slope(fabs(x) - th, rgf_alpha);
    }
    const double P = block_sum(p, smem);
    // dalpha = sign (t - s P) with t = g sign d, as on the CPU
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const double x = static_cast<double>(al[i]);
      const double sg = sp::sign(x);
      const double t = static_cast<double>(g[i]) * sg * sp::rgf_slope(fabs(x) - th, rgf_alpha);
      ga[i] = static_cast<scalar_t>(sg * (t - s * P));
    }
    if (threadIdx.x == 0) gbeta[r] = static_cast<scalar_t>(-ds * L * P);
    return;
  }
  double gsum = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) gsum += exp(static_cast<double>(al[i]));
  const double G = block_sum(gsum, smem);
  const double th = s * G;
  double t = 0, w = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double gt = sp::relu(exp(static_cast<double>(al[i])) - th);
    t += gt;
    w += static_cast<double>(g[i]) * gt;
  }
  const double T = block_sum(t, smem);
  const double Ts = T > 0 ? T : 1.0;
  const double gdota = block_sum(w, smem) / Ts;
  const double inv_ts = 1.0 / Ts;
  double q = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    q += (static_cast<double>(g[i]) - gdota) * inv_ts * sp::rgf_slope(exp(static_cast<double>(al[i])) - th, rgf_alpha);
  }
  const double Q = block_sum(q, smem);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double gamma = exp(static_cast<double>(al[i]));
    const double qi = (static_cast<double>(g[i]) - gdota) * inv_ts * sp::rgf_slope(gamma - th, rgf_alpha);
    ga[i] = static_cast<scalar_t>(gamma * (qi - s * Q));
  }
  if (threadIdx.x == 0) gbeta[r] = static_cast<scalar_t>(-ds * G * Q);
}

at::Tensor sparse_gate_cuda(const at::Tensor& alpha_in, const at::Tensor& beta_in, bool is_signed, double rgf_alpha) {
  check_gate_args(alpha_in, beta_in, rgf_alpha, "sparse_gate");
  PRUNOPT_DEVICE_GUARD(alpha_in.device());
  const at::Tensor alpha = alpha_in.contiguous();
  const at::Tensor beta = beta_in.contiguous();
  at::Tensor a = at::empty_like(alpha, at::MemoryFormat::Contiguous);
  if (alpha.numel() == 0) return a;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "sparse_gate_cuda", [&] {
    gate_forward_kernel<scalar_t><<<alpha.size(0), kThreads, 0, PRUNOPT_CUDA_STREAM()>>>(
        alpha.const_data_ptr<scalar_t>(), beta.const_data_ptr<scalar_t>(), a.mutable_data_ptr<scalar_t>(),
        alpha.size(1), is_signed);
  });
  PRUNOPT_LAUNCH_CHECK();
  return a;
}

std::tuple<at::Tensor, at::Tensor> sparse_gate_backward_cuda(const at::Tensor& grad_in, const at::Tensor& alpha_in,
    const at::Tensor& beta_in, bool is_signed, double rgf_alpha) {
  check_gate_args(alpha_in, beta_in, rgf_alpha, "sparse_gate_backward");
  check_like(grad_in, alpha_in, "grad", "alpha", "sparse_gate_backward");
  PRUNOPT_DEVICE_GUARD(alpha_in.device());
  const at::Tensor alpha = alpha_in.contiguous();
  const at::Tensor beta = beta_in.contiguous();
  const at::Tensor g = grad_in.contiguous();
  at::Tensor galpha = at::empty_like(alpha, at::MemoryFormat::Contiguous);
  at::Tensor gbeta = at::zeros_like(beta, at::MemoryFormat::Contiguous);
  if (alpha.numel() == 0) return {galpha, gbeta};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "sparse_gate_backward_cuda", [&] {
    gate_backward_kernel<scalar_t><<<alpha.size(0), kThreads, 0, PRUNOPT_CUDA_STREAM()>>>(
        g.const_data_ptr<scalar_t>(), alpha.const_data_ptr<scalar_t>(), beta.const_data_ptr<scalar_t>(),
        galpha.mutable_data_ptr<scalar_t>(), gbeta.mutable_data_ptr<scalar_t>(), alpha.size(1), is_signed, rgf_alpha);
  });
  PRUNOPT_LAUNCH_CHECK();
  return {galpha, gbeta};
}

}  // namespace
}  // namespace cuda
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CUDA, m) {
  m.impl("sparse_gate", &prunopt::cuda::sparse_gate_cuda);
  m.impl("sparse_gate_backward", &prunopt::cuda::sparse_gate_backward_cuda);
}
