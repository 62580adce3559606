// relu with rectified gradient flow on the CPU (DS eq. 15, Lee):
// forward relu(x), backward grad * elu'(x; alpha). One fused pass per direction,
// parallel over chunks; float/double run ATen's Vectorized per CPU capability
// (gates_kernels.inc, prunopt/gates_kernels.h), everything else the scalar math
// of prunopt/sparsification.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "prunopt/gates_kernels.h"
#include "prunopt/sparsification_checks.h"

namespace prunopt {
namespace cpu {
namespace {

namespace g = prunopt::gates;

// relu is a copy with a max: memory bound, so large chunks; the backward pass
// evaluates an exp per element.
constexpr int64_t kGrainForward = 1 << 16;
constexpr int64_t kGrainBackward = 1 << 14;

at::Tensor rgf_relu_cpu(const at::Tensor& x, double alpha) {
  check_float_tensor(x, "x", "rgf_relu");
  check_rgf_alpha(alpha, "rgf_relu", x.scalar_type());
  // At most the AVX2 clone: relu is a streaming copy with a max, and its
  // AVX-512 clone took 1.12-1.32x the time of its AVX2 clone at 1M float32
  // elements, 1 thread, in three runs on a 2-vCPU Xeon with AVX-512 (0.51-0.62
  // ms vs 0.45-0.48 ms; float64 0.98-1.11x; bench/compare_builds.py,
  // bench/results/simd_aten.md).
  return g::map_unary(
      x, kGrainForward, g::ReluOp{}, [](const auto& k, const auto* xp, auto* yp, int64_t n) { k.relu(xp, yp, n); },
      prunopt::vec::Capability::kAvx2);
}

at::Tensor rgf_relu_backward_cpu(const at::Tensor& grad, const at::Tensor& x, double alpha) {
  check_float_tensor(x, "x", "rgf_relu_backward");
  check_like(grad, x, "grad", "x", "rgf_relu_backward");
  check_rgf_alpha(alpha, "rgf_relu_backward", x.scalar_type());
  return g::map_binary(grad, x, kGrainBackward, g::RgfBackwardOp{alpha},
      [alpha](const auto& k, const auto* gp, const auto* xp, auto* yp, int64_t n) { k.rgf_backward(gp, xp, yp, n, alpha); });
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("rgf_relu", &prunopt::cpu::rgf_relu_cpu);
  m.impl("rgf_relu_backward", &prunopt::cpu::rgf_relu_backward_cpu);
}
