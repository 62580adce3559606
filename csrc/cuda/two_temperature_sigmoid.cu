// Two-temperature sigmoid on CUDA (AP eq. 6-7): grid-stride elementwise maps
// (elementwise_common.cuh) over the math of prunopt/sparsification.h, the same
// functions as the CPU kernel's scalar path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "elementwise_common.cuh"
#include "prunopt/sparsification.h"
#include "prunopt/sparsification_checks.h"

namespace prunopt {
namespace cuda {
namespace {

// v = sigmoid(t_l w)
template <typename T>
struct Sigmoid {
  T t_l;
  __device__ T operator()(T w) const { return sparsification::sigmoid(t_l * w); }
};

// grad * (t_s sigmoid'(t_s w)): the slope scaled first, as on the CPU
template <typename T>
struct SigmoidSlope {
  T t_s;
  __device__ T operator()(T g, T w) const { return g * (t_s * sparsification::sigmoid_slope(t_s * w)); }
};

at::Tensor two_temperature_sigmoid_cuda(const at::Tensor& w, double t_l, double t_s) {
  check_float_tensor(w, "w", "two_temperature_sigmoid");
  check_temperature(t_l, "t_l", "two_temperature_sigmoid", w.scalar_type());
  check_temperature(t_s, "t_s", "two_temperature_sigmoid", w.scalar_type());
  return map_unary<Sigmoid>(w, t_l);
}

at::Tensor two_temperature_sigmoid_backward_cuda(const at::Tensor& grad, const at::Tensor& w, double t_s) {
  check_float_tensor(w, "w", "two_temperature_sigmoid_backward");
  check_like(grad, w, "grad", "w", "two_temperature_sigmoid_backward");
  check_temperature(t_s, "t_s", "two_temperature_sigmoid_backward", w.scalar_type());
  return map_binary<SigmoidSlope>(grad, w, t_s);
}

}  // namespace
}  // namespace cuda
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CUDA, m) {
  m.impl("two_temperature_sigmoid", &prunopt::cuda::two_temperature_sigmoid_cuda);
  m.impl("two_temperature_sigmoid_backward", &prunopt::cuda::two_temperature_sigmoid_backward_cuda);
}
