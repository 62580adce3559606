// Host-side entry points of the projection ops, shared by the CPU and CUDA
// kernels: validation, contiguous inputs, output allocation and, for the
// in-place op, copying back into non-contiguous views. Each device supplies
// only `project_into(inputs, costs, outputs, budget, op)`.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "prunopt/checks.h"
#include "prunopt/tensor_list.h"

namespace prunopt {

template <typename ProjectInto>
std::vector<at::Tensor> project_budget_entry(
    at::TensorList theta, const c10::optional<at::TensorList>& cost, double budget, ProjectInto&& project_into) {
  check_projection_args(theta, cost, budget, "project_budget");
  auto inputs = contiguous_all(theta);
  auto costs = cost.has_value() ? contiguous_all(*cost) : std::vector<at::Tensor>{};
  std::vector<at::Tensor> outputs;
  outputs.reserve(inputs.size());
  for (const auto& t : inputs) {
    outputs.push_back(at::empty_like(t));
  }
  project_into(inputs, costs, outputs, budget, "project_budget");
  return outputs;
}

// Everything is validated (here: members that overlap themselves or each
// other; inside project_into: the values) before the first write, so an
// error leaves theta untouched.
template <typename ProjectInto>
void project_budget_inplace_entry(
    at::TensorList theta, const c10::optional<at::TensorList>& cost, double budget, ProjectInto&& project_into) {
  check_projection_args(theta, cost, budget, "project_budget_");
  check_no_overlap(theta, "project_budget_");
  auto inputs = contiguous_all(theta);
  auto costs = cost.has_value() ? contiguous_all(*cost) : std::vector<at::Tensor>{};
  project_into(inputs, costs, inputs, budget, "project_budget_");
  copy_back(inputs, theta);
}

}  // namespace prunopt
