// Argument checks shared by the CPU and CUDA entry points (host only).
// Every failure is a ValueError (TORCH_CHECK_VALUE) that names the argument.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <vector>

namespace prunopt {

// Validates theta/cost/budget of the projection ops.
inline void check_projection_args(
    at::TensorList theta,
    const c10::optional<at::TensorList>& cost,
    double budget,
    const char* op) {
  TORCH_CHECK_VALUE(std::isfinite(budget) && budget >= 0.0, op,
      ": budget must be a finite number >= 0, got ", budget);
  if (theta.empty()) {
    TORCH_CHECK_VALUE(!cost.has_value() || cost->empty(), op,
        ": cost must have as many tensors as theta (0), got ", cost->size());
    return;
  }
  const auto& t0 = theta[0];
  for (size_t i = 0; i < theta.size(); ++i) {
    const auto& t = theta[i];
    TORCH_CHECK_VALUE(t.is_floating_point(), op, ": theta[", i,
        "] must be a real floating tensor, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.scalar_type() == t0.scalar_type(), op,
        ": all theta tensors must share one dtype, theta[", i, "] is ", t.scalar_type(),
        " but theta[0] is ", t0.scalar_type());
    TORCH_CHECK_VALUE(t.device() == t0.device(), op,
        ": all theta tensors must be on one device, theta[", i, "] is on ", t.device(),
        " but theta[0] is on ", t0.device());
  }
  if (cost.has_value()) {
    TORCH_CHECK_VALUE(cost->size() == theta.size(), op,
        ": cost must have as many tensors as theta (", theta.size(), "), got ", cost->size());
    for (size_t i = 0; i < theta.size(); ++i) {
      const auto& c = (*cost)[i];
      TORCH_CHECK_VALUE(c.sizes() == theta[i].sizes(), op, ": cost[", i,
          "] must have the shape of theta[", i, "] ", theta[i].sizes(), ", got ", c.sizes());
      TORCH_CHECK_VALUE(c.scalar_type() == t0.scalar_type(), op, ": cost[", i,
          "] must have the dtype of theta (", t0.scalar_type(), "), got ", c.scalar_type());
      TORCH_CHECK_VALUE(c.device() == t0.device(), op, ": cost[", i,
          "] must be on the device of theta (", t0.device(), "), got ", c.device());
    }
  }
}

}  // namespace prunopt
