// The one TORCH_LIBRARY block of prunopt: every operator schema lives here.
// Kernels register themselves per device in csrc/cpu/*.cpp and csrc/cuda/*.cu
// (TORCH_LIBRARY_IMPL); fake (meta) kernels and autograd are registered from
// Python in prunopt/ops.py.
#include <torch/library.h>

#ifndef PRUNOPT_NO_PYTHON
#include <Python.h>

extern "C" {
// An empty Python module: importing prunopt._C loads this shared object and
// thereby runs the static registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "prunopt custom operators", -1, nullptr};
  return PyModule_Create(&module_def);
}
}
#endif  // PRUNOPT_NO_PYTHON

TORCH_LIBRARY(prunopt, m) {
  // Budget projection (SPEC.md section 1). `theta` is a list so that several
  // tensors share one budget without being concatenated.
  m.def("project_budget(Tensor[] theta, Tensor[]? cost, float budget) -> Tensor[]");
  m.def("project_budget_(Tensor(a!)[] theta, Tensor[]? cost, float budget) -> ()");
}

// ---------------------------------------------------------------------------
// Differentiable sparsification (SPEC.md section 4) and two-temperature
// architecture pruning (SPEC.md section 5). Kernels: csrc/cpu/{rgf_relu,
// sparse_gate,two_temperature_sigmoid}.cpp and csrc/cuda/*.cu of the same names.
TORCH_LIBRARY_FRAGMENT(prunopt, m) {
  // relu forward, elu(alpha) derivative backward (DS eq. 15).
  m.def("rgf_relu(Tensor x, float alpha) -> Tensor");
  m.def("rgf_relu_backward(Tensor grad, Tensor x, float alpha) -> Tensor");
  // Gates over the last dim of alpha (groups, n), one threshold beta per group:
  // signed (DS eq. 12) or non-negative (eq. 9-11); rgf_alpha = 0 is plain relu.
  m.def("sparse_gate(Tensor alpha, Tensor beta, bool signed, float rgf_alpha) -> Tensor");
  m.def("sparse_gate_backward(Tensor grad, Tensor alpha, Tensor beta, bool signed, float rgf_alpha) -> (Tensor, Tensor)");
  // sigmoid(t_l w) forward, t_s sigmoid'(t_s w) backward (AP eq. 6-7).
  m.def("two_temperature_sigmoid(Tensor w, float t_l, float t_s) -> Tensor");
  m.def("two_temperature_sigmoid_backward(Tensor grad, Tensor w, float t_s) -> Tensor");
}
