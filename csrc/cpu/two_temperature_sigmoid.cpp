// Two-temperature sigmoid on the CPU (AP eq. 6-7, Colombo & Gao):
// forward v = sigmoid(t_l w), backward grad * t_s sigmoid(t_s w)(1 - sigmoid(t_s w)).
// One fused pass per direction, parallel over chunks; float/double run 8/4 lanes
// of AVX2 when the CPU has it (prunopt/sparsification_simd.h), everything else
// the scalar math of prunopt/sparsification.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "prunopt/sparsification.h"
#include "prunopt/sparsification_checks.h"
#include "prunopt/sparsification_simd.h"

namespace prunopt {
namespace cpu {
namespace {

constexpr int64_t kGrain = 1 << 14;

// v = 1 / (1 + exp(-t_l w)): exact 0 / 1 at -inf / +inf, NaN stays NaN
struct SigmoidOp {
  double t_l;
  template <typename U>
  U operator()(U w) const {
    return sparsification::sigmoid(static_cast<U>(t_l) * w);
  }
#if PRUNOPT_SIMD_AVX2
  template <typename V>
  PRUNOPT_AVX2 V vec(V w) const {
    using T = simd::scalar_of<V>;
    const V one = simd::vset1(T(1));
    const V e = simd::vexp(simd::vneg(simd::vmul(simd::vset1(static_cast<T>(t_l)), w)));
    return simd::vdiv(one, simd::vadd(one, e));
  }
#endif
};

// grad * (t_s e / (1 + e)^2) with e = exp(-|t_s w|) (sigmoid_slope, eq. 7);
// the slope is scaled before grad multiplies it (grad * t_s first overflowed
// to inf for a large t_s, and inf * a zero slope is NaN)
struct SigmoidSlopeOp {
  double t_s;
  template <typename U>
  U operator()(U g, U w) const {
    const U ts = static_cast<U>(t_s);
    return g * (ts * sparsification::sigmoid_slope(ts * w));
  }
#if PRUNOPT_SIMD_AVX2
  template <typename V>
  PRUNOPT_AVX2 V vec(V g, V w) const {
    using T = simd::scalar_of<V>;
    const V ts = simd::vset1(static_cast<T>(t_s));
    const V e = simd::vexp(simd::vneg(simd::vabs(simd::vmul(ts, w))));
    const V d = simd::vadd(simd::vset1(T(1)), e);
    return simd::vmul(g, simd::vmul(ts, simd::vdiv(e, simd::vmul(d, d))));
  }
#endif
};

at::Tensor two_temperature_sigmoid_cpu(const at::Tensor& w, double t_l, double t_s) {
  check_float_tensor(w, "w", "two_temperature_sigmoid");
  check_temperature(t_l, "t_l", "two_temperature_sigmoid", w.scalar_type());
  check_temperature(t_s, "t_s", "two_temperature_sigmoid", w.scalar_type());
  return simd::map_unary(w, kGrain, SigmoidOp{t_l});
}

at::Tensor two_temperature_sigmoid_backward_cpu(const at::Tensor& grad, const at::Tensor& w, double t_s) {
  check_float_tensor(w, "w", "two_temperature_sigmoid_backward");
  check_like(grad, w, "grad", "w", "two_temperature_sigmoid_backward");
  check_temperature(t_s, "t_s", "two_temperature_sigmoid_backward", w.scalar_type());
  return simd::map_binary(grad, w, kGrain, SigmoidSlopeOp{t_s});
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("two_temperature_sigmoid", &prunopt::cpu::two_temperature_sigmoid_cpu);
  m.impl("two_temperature_sigmoid_backward", &prunopt::cpu::two_temperature_sigmoid_backward_cpu);
}
