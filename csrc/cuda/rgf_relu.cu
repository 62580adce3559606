// relu with rectified gradient flow on CUDA (DS eq. 15): grid-stride
// elementwise maps (elementwise_common.cuh) over the math of
// prunopt/sparsification.h, the same functions as the CPU kernel's scalar path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "elementwise_common.cuh"
#include "prunopt/sparsification.h"
#include "prunopt/sparsification_checks.h"

namespace prunopt {
namespace cuda {
namespace {

template <typename T>
struct Relu {
  __device__ T operator()(T x) const { return sparsification::relu(x); }
};

template <typename T>
struct RgfBackward {
  T alpha;
  __device__ T operator()(T g, T x) const { return g * sparsification::rgf_slope(x, alpha); }
};

at::Tensor rgf_relu_cuda(const at::Tensor& x, double alpha) {
  check_float_tensor(x, "x", "rgf_relu");
  check_rgf_alpha(alpha, "rgf_relu", x.scalar_type());
  return map_unary<Relu>(x);
}

at::Tensor rgf_relu_backward_cuda(const at::Tensor& grad, const at::Tensor& x, double alpha) {
  check_float_tensor(x, "x", "rgf_relu_backward");
  check_like(grad, x, "grad", "x", "rgf_relu_backward");
  check_rgf_alpha(alpha, "rgf_relu_backward", x.scalar_type());
  return map_binary<RgfBackward>(grad, x, alpha);
}

}  // namespace
}  // namespace cuda
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CUDA, m) {
  m.impl("rgf_relu", &prunopt::cuda::rgf_relu_cuda);
  m.impl("rgf_relu_backward", &prunopt::cuda::rgf_relu_backward_cuda);
}
