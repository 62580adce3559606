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
// prunAdag (SPEC.md section 2). The k-th largest |v| over a tensor list (exact
// radix select, = torch.kthvalue at rank n - k + 1 on the concatenation), and
// one fused step over one selection scope. `hyper` is float64 (ntensors, 6):
// [lr_k, lr_k / (k+1), weight_decay, eps, maximize, prune] per tensor; `version`
// is 1..4, or 0 for "relevant_only"; `relevant` is the resolved T.
// ---------------------------------------------------------------------------
TORCH_LIBRARY_FRAGMENT(prunopt, m) {
  m.def("topk_threshold(Tensor[] values, int k) -> Tensor");
  m.def(
      "prunadag_step_(Tensor(a!)[] params, Tensor(b!)[] opt_sums, Tensor(c!)[] dec_sums, Tensor[] grads, "
      "Tensor hyper, int relevant, int version) -> ()");
}
