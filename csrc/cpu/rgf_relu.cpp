// relu with rectified gradient flow on the CPU (DS eq. 15, Lee):
// forward relu(x), backward grad * elu'(x; alpha). One fused pass per direction,
// parallel over chunks; float/double run 8/4 lanes of AVX2 when the CPU has it
// (prunopt/sparsification_simd.h), everything else the scalar math of
// prunopt/sparsification.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "prunopt/sparsification.h"
#include "prunopt/sparsification_checks.h"
#include "prunopt/sparsification_simd.h"

namespace prunopt {
namespace cpu {
namespace {

// relu is a copy with a max: memory bound, so large chunks; the backward pass
// evaluates an exp per element.
constexpr int64_t kGrainForward = 1 << 16;
constexpr int64_t kGrainBackward = 1 << 14;

struct ReluOp {
  template <typename U>
  U operator()(U x) const {
    return sparsification::relu(x);
  }
#if PRUNOPT_SIMD_AVX2
  // max(0, x) returns x when x is NaN
  template <typename V>
  PRUNOPT_AVX2 V vec(V x) const {
    return simd::vmax(simd::vset1(simd::scalar_of<V>(0)), x);
  }
#endif
};

// grad * slope(x): slope = 1 (x > 0), alpha exp(x) (x <= 0)
struct RgfBackwardOp {
  double alpha;
  template <typename U>
  U operator()(U g, U x) const {
    return g * sparsification::rgf_slope(x, static_cast<U>(alpha));
  }
#if PRUNOPT_SIMD_AVX2
  template <typename V>
  PRUNOPT_AVX2 V vec(V g, V x) const {
    return simd::vmul(g, simd::vrgf_slope(x, simd::vset1(static_cast<simd::scalar_of<V>>(alpha)), alpha == 0.0));
  }
#endif
};

at::Tensor rgf_relu_cpu(const at::Tensor& x, double alpha) {
  check_float_tensor(x, "x", "rgf_relu");
  check_rgf_alpha(alpha, "rgf_relu", x.scalar_type());
  return simd::map_unary(x, kGrainForward, ReluOp{});
}

at::Tensor rgf_relu_backward_cpu(const at::Tensor& grad, const at::Tensor& x, double alpha) {
  check_float_tensor(x, "x", "rgf_relu_backward");
  check_like(grad, x, "grad", "x", "rgf_relu_backward");
  check_rgf_alpha(alpha, "rgf_relu_backward", x.scalar_type());
  return simd::map_binary(grad, x, kGrainBackward, RgfBackwardOp{alpha});
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("rgf_relu", &prunopt::cpu::rgf_relu_cpu);
  m.impl("rgf_relu_backward", &prunopt::cpu::rgf_relu_backward_cpu);
}
