// Argument checks of the sparsification / architecture-pruning ops, shared by
// the CPU and CUDA kernels. Every failure is a ValueError naming the argument.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace prunopt {

inline void check_float_tensor(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK_VALUE(t.is_floating_point(), op, ": ", name,
      " must be a real floating tensor, got ", t.scalar_type());
}

inline void check_like(const at::Tensor& t, const at::Tensor& ref, const char* name,
    const char* ref_name, const char* op) {
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), op, ": ", name, " must have the shape of ",
      ref_name, " ", ref.sizes(), ", got ", t.sizes());
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), op, ": ", name,
      " must have the dtype of ", ref_name, " (", ref.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " must be on the device of ",
      ref_name, " (", ref.device(), "), got ", t.device());
}

// The kernels compute in the tensor's opmath type (float for float16,
// bfloat16 and float32): a scalar argument above its largest finite value
// would be inf there (inf * 0 = NaN where the float64 reference is finite).
inline double opmath_max(at::ScalarType dtype) {
  return dtype == at::kDouble ? std::numeric_limits<double>::max()
                              : static_cast<double>(std::numeric_limits<float>::max());
}

inline void check_rgf_alpha(double rgf_alpha, const char* op, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(std::isfinite(rgf_alpha) && rgf_alpha >= 0.0, op,
      ": alpha (the elu slope of the rectified gradient flow) must be a finite number >= 0, got ",
      rgf_alpha);
  TORCH_CHECK_VALUE(rgf_alpha <= opmath_max(dtype), op,
      ": alpha (the elu slope of the rectified gradient flow) must be at most ", opmath_max(dtype),
      " (the largest finite value the kernel computes with for ", dtype, " tensors), got ", rgf_alpha);
}

inline void check_temperature(double t, const char* name, const char* op, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(std::isfinite(t) && t > 0.0, op, ": ", name,
      " must be a finite temperature > 0, got ", t);
  TORCH_CHECK_VALUE(t <= opmath_max(dtype), op, ": ", name, " must be at most ", opmath_max(dtype),
      " (the largest finite value the kernel computes with for ", dtype, " tensors), got ", t);
}

// alpha: (groups, n) with n >= 1; beta: (groups,).
inline void check_gate_args(const at::Tensor& alpha, const at::Tensor& beta, double rgf_alpha,
    const char* op) {
  check_float_tensor(alpha, "alpha", op);
  TORCH_CHECK_VALUE(alpha.dim() == 2, op, ": alpha must be 2-D (groups, gates), got ",
      alpha.dim(), "-D");
  TORCH_CHECK_VALUE(alpha.size(1) >= 1 || alpha.size(0) == 0, op,
      ": every group needs at least one gate, got alpha of shape ", alpha.sizes());
  TORCH_CHECK_VALUE(beta.dim() == 1 && beta.size(0) == alpha.size(0), op,
      ": beta must have shape (groups,) = (", alpha.size(0), ",), got ", beta.sizes());
  TORCH_CHECK_VALUE(beta.scalar_type() == alpha.scalar_type(), op,
      ": beta must have the dtype of alpha (", alpha.scalar_type(), "), got ", beta.scalar_type());
  TORCH_CHECK_VALUE(beta.device() == alpha.device(), op,
      ": beta must be on the device of alpha (", alpha.device(), "), got ", beta.device());
  check_rgf_alpha(rgf_alpha, op, alpha.scalar_type());
}

}  // namespace prunopt
