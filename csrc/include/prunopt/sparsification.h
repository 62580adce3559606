// Torch-free math of the differentiable-sparsification and architecture-pruning
// ops (Lee; Colombo & Gao), shared by the CPU and CUDA kernels.
//
//   rgf_relu:   y = relu(x);  dy/dx := 1 (x > 0), rgf_alpha * exp(x) (x <= 0)
//               (the elu(., rgf_alpha) derivative: rectified gradient flow, DS eq. 15;
//               rgf_alpha = 0 is the plain relu derivative)
//   two-temperature sigmoid (AP eq. 6-7):
//               v = sigmoid(t_l w);  dv/dw := t_s sigmoid(t_s w) (1 - sigmoid(t_s w))
//   gates over one group of n entries (DS eq. 9-12), s = sigmoid(beta):
//     signed:       a_i = sign(alpha_i) r(|alpha_i| - s ||alpha||_1)
//     non-negative: gamma = exp(alpha), gt_i = r(gamma_i - s ||gamma||_1), a = gt / sum(gt)
//   with r = relu forward and rgf_relu's derivative backward.
#pragma once

#include <math.h>

#include "prunopt/macros.h"

namespace prunopt {
namespace sparsification {

PRUNOPT_HD float exp_(float x) {
  return expf(x);
}
PRUNOPT_HD double exp_(double x) {
  return exp(x);
}
PRUNOPT_HD float abs_(float x) {
  return fabsf(x);
}
PRUNOPT_HD double abs_(double x) {
  return fabs(x);
}

// relu that propagates NaN (as torch.relu does).
template <typename T>
PRUNOPT_HD T relu(T x) {
  return x < T(0) ? T(0) : x;
}

// Derivative of the thresholding relu as used in the backward pass: 1 for
// x > 0, rgf_alpha * exp(x) otherwise (elu's derivative; eq. 15). exp is taken
// of min(x, 0) so the unused branch never overflows; a NaN x gives NaN, as in
// the reference (the vector CPU kernels in gates_kernels.inc do the same).
template <typename T>
PRUNOPT_HD T rgf_slope(T x, T rgf_alpha) {
  const T neg = x > T(0) ? T(0) : x;
  const T e = rgf_alpha * exp_(neg);
  return x > T(0) ? T(1) : e;
}

// sigmoid(x) = 1 / (1 + exp(-x)); exact limits 0 and 1 at +-inf, no NaN.
template <typename T>
PRUNOPT_HD T sigmoid(T x) {
  return T(1) / (T(1) + exp_(-x));
}

// d sigmoid(x)/dx = sigmoid(x)(1 - sigmoid(x)) = e / (1 + e)^2 with e = exp(-|x|),
// symmetric and free of the cancellation in 1 - sigmoid(x).
template <typename T>
PRUNOPT_HD T sigmoid_slope(T x) {
  const T e = exp_(-abs_(x));
  const T d = T(1) + e;
  return e / (d * d);
}

template <typename T>
PRUNOPT_HD T sign(T x) {
  return T(x > T(0)) - T(x < T(0));
}

}  // namespace sparsification
}  // namespace prunopt
