// Two-temperature sigmoid on the CPU (AP eq. 6-7, Colombo & Gao):
// forward v = sigmoid(t_l w), backward grad * t_s sigmoid(t_s w)(1 - sigmoid(t_s w)).
// One fused pass per direction, parallel over chunks; float/double run ATen's
// Vectorized per CPU capability (gates_kernels.inc, prunopt/gates_kernels.h),
// everything else the scalar math of prunopt/sparsification.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "prunopt/gates_kernels.h"
#include "prunopt/sparsification_checks.h"

namespace prunopt {
namespace cpu {
namespace {

namespace g = prunopt::gates;

constexpr int64_t kGrain = 1 << 14;

at::Tensor two_temperature_sigmoid_cpu(const at::Tensor& w, double t_l, double t_s) {
  check_float_tensor(w, "w", "two_temperature_sigmoid");
  check_temperature(t_l, "t_l", "two_temperature_sigmoid", w.scalar_type());
  check_temperature(t_s, "t_s", "two_temperature_sigmoid", w.scalar_type());
  return g::map_unary(w, kGrain, g::SigmoidOp{t_l}, [t_l](const auto& k, const auto* wp, auto* yp, int64_t n) {
    k.sigmoid(wp, yp, n, t_l);
  });
}

at::Tensor two_temperature_sigmoid_backward_cpu(const at::Tensor& grad, const at::Tensor& w, double t_s) {
  check_float_tensor(w, "w", "two_temperature_sigmoid_backward");
  check_like(grad, w, "grad", "w", "two_temperature_sigmoid_backward");
  check_temperature(t_s, "t_s", "two_temperature_sigmoid_backward", w.scalar_type());
  return g::map_binary(grad, w, kGrain, g::SigmoidSlopeOp{t_s},
      [t_s](const auto& k, const auto* gp, const auto* wp, auto* yp, int64_t n) { k.sigmoid_backward(gp, wp, yp, n, t_s); });
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("two_temperature_sigmoid", &prunopt::cpu::two_temperature_sigmoid_cpu);
  m.impl("two_temperature_sigmoid_backward", &prunopt::cpu::two_temperature_sigmoid_backward_cpu);
}
