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
