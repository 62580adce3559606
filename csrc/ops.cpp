// The one TORCH_LIBRARY block of prunopt: every operator schema lives here.
// Kernels register themselves per device in csrc/cpu/*.cpp and csrc/cuda/*.cu
// (TORCH_LIBRARY_IMPL); fake (meta) kernels and autograd are registered from
// Python in prunopt/ops/, except the autograd of fb_reconstruct (the op of
// FBConv2d's training path), which is in C++: csrc/autograd/fb_reconstruct.cpp.
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
  // Budget projection (ProM supplement A.2). `theta` is a list so that several
  // tensors share one budget without being concatenated.
  m.def("project_budget(Tensor[] theta, Tensor[]? cost, float budget) -> Tensor[]");
  m.def("project_budget_(Tensor(a!)[] theta, Tensor[]? cost, float budget) -> ()");
  // One pass over theta (and cost) for a bracket [lo, hi] of the multiplier
  // lam (0 <= lo <= hi, hi may be inf): float64 [sum c over U, sum c t and
  // sum c^2 over F, 1 if a score is not finite, 1 if a cost is not positive
  // and finite] over the elements without a breakpoint ((t-1)/c or t/c)
  // strictly inside (lo, hi) (U: x = 1 on the whole bracket, F: x = t - lam c
  // on it), and the other elements' theta and cost (empty without costs) in
  // index order. Bad input is reported, not raised (then the sums are 0 and
  // no elements are returned): the sharded projection agrees on it over the
  // processes first.
  m.def("project_budget_bracket(Tensor[] theta, Tensor[]? cost, float lo, float hi) -> (Tensor, Tensor, Tensor)");
  // The projection for a given multiplier lam >= 0 (inf allowed):
  // out[i] = clamp(theta[i] - lam cost[i], 0, 1), computed in double and
  // rounded once (the last pass of project_budget). `out` may be `theta`
  // itself (in place); theta and cost are not checked for finiteness here.
  m.def("project_budget_apply_(Tensor(a!)[] out, Tensor[] theta, Tensor[]? cost, float lam) -> ()");

  // Interspace pruning: filter-basis convolution (Wimmer et al.).
  // Kernels: csrc/cpu/fb_reconstruct.cpp, csrc/cpu/fb_conv2d.cpp,
  // csrc/cuda/fb_conv2d.cu; fake kernels and autograd in prunopt/ops/ (fb_reconstruct's
  // autograd: csrc/autograd/fb_reconstruct.cpp).
  // h = einsum("oin,nkl->oikl", lam * mu, basis)   (eq. 4)
  m.def("fb_reconstruct(Tensor coefficients, Tensor basis, Tensor? mask) -> Tensor");
  // its backward (eq. 7, A.13, A.14): (dL/dlam * mu, dL/dbasis) from dL/dh; an
  // output whose output_mask entry is false is returned empty (numel 0).
  m.def("fb_reconstruct_backward(Tensor grad_h, Tensor coefficients, Tensor basis, Tensor? mask, "
        "bool[2] output_mask) -> (Tensor, Tensor)");
  // eq. 6/8: sparse (eq. 8, Alg. 1) when density(lam * mu) <= max_density,
  // else reconstruct + conv2d. Input (B, C_in, H, W); output contiguous.
  m.def("fb_conv2d(Tensor input, Tensor coefficients, Tensor basis, Tensor? mask, Tensor? bias, "
        "int[2] stride, int[2] padding, int[2] dilation, int groups, float max_density) -> Tensor");
  // eq. 8 on lam * mu already in CSR form (int32 indices; column i*N + n).
  m.def("fb_conv2d_csr(Tensor input, Tensor crow_indices, Tensor col_indices, Tensor values, Tensor basis, "
        "Tensor? bias, int[2] stride, int[2] padding, int[2] dilation, int groups) -> Tensor");

  // prunAdag (Porcelli et al.). The k-th largest |v| over a tensor list (exact
  // radix select, = torch.kthvalue at rank n - k + 1 on the concatenation), and
  // one fused step over one selection scope. `hyper` is float64 (ntensors, 6):
  // [lr_k, lr_k / (k+1), weight_decay, eps, maximize, prune] per tensor; `version`
  // is 1..4, or 0 for "relevant_only"; `relevant` is the resolved T. Without
  // `found_nonfinite` a non-finite gradient raises on the CPU; with it (one
  // float32 element on the params' device) the op sets it to 1 and writes
  // nothing, and writes nothing when it is already non-zero (no host sync).
  // With `selection` (float64 [tau, r] on the params' device: the threshold of
  // eq. 2.6 and the ratio of Table 1, e.g. agreed over several processes) the
  // op takes R = {|g| >= tau} and r as given (`relevant` is not used) and runs
  // the finiteness check and the element pass only; [tau, r, 1] says the
  // caller checked the gradients finite already (the CPU kernel then runs the
  // element pass alone).
  m.def("topk_threshold(Tensor[] values, int k) -> Tensor");
  m.def(
      "prunadag_step_(Tensor(a!)[] params, Tensor(b!)[] opt_sums, Tensor(c!)[] dec_sums, Tensor[] grads, "
      "Tensor hyper, int relevant, int version, Tensor(d!)? found_nonfinite=None, Tensor? selection=None) -> ()");
  // This process's share of the ratio's squared norms for a given threshold
  // (float64 [||g||_R^2, ||x||_M^2, 1 if an effective gradient of any tensor is
  // not finite else 0]; pruned tensors only in the norms), for a scope whose
  // elements are spread over several processes. `tau` is float64 (1 element)
  // on the params' device.
  m.def("prunadag_norms(Tensor[] params, Tensor[] grads, Tensor hyper, Tensor tau) -> Tensor");
  // One pass over |v| for a bracket [lo, hi] of the k-th largest: how many
  // |v| > hi (int64, 0-dim) and the |v| with lo <= |v| <= hi in index order
  // (the candidates; what the sharded threshold selects among).
  m.def("topk_bracket(Tensor[] values, float lo, float hi) -> (Tensor, Tensor)");
  // One rank's slice of the sharded threshold's first round: from a fixed
  // strided sample of |v| (about (6 n)^(2/3) values within [sample[0],
  // sample[1]], blocks of sample[2]) a bracket of the share-th largest, widened to a grid
  // of at most `buckets` buckets of 2^j ulps, read in one topk_bracket pass;
  // returns the int64 head [n_r, above, start, j, nb, bad, w_above, w_lo,
  // w_end, w_m, scan_start, scan_stop], the candidates' histogram on the grid
  // (int64, nb), the window (bit patterns of the candidates in the grid
  // buckets around the share, at most `cap`; int32 for float32, int64 for
  // float64) and the candidates (|v| inside the bracket, index order).
  m.def("topk_slice(Tensor[] values, int share, int buckets, int cap, int[] sample) -> (Tensor, Tensor, Tensor, "
      "Tensor)");
  // prunAdag's bracket pass over one scope's local part (effective gradients
  // ge = +-g + weight_decay x of the pruned tensors, bracket [lo, hi] of |ge|):
  // float64 [#{|ge| > hi}, sum ge^2 over |ge| > hi, sum x^2 over |ge| < lo with
  // x ge > 0, 1 if an effective gradient of any tensor is not finite else 0],
  // and the candidates lo <= |ge| <= hi in index order: their |ge| (dtype) and
  // x^2 where x ge > 0, else 0 (float64). The sharded PrunAdag step selects
  // tau among every rank's candidates and completes the ratio's norms from
  // them (no second pass over g and x).
  m.def("prunadag_bracket(Tensor[] params, Tensor[] grads, Tensor hyper, float lo, float hi) "
      "-> (Tensor, Tensor, Tensor)");
  // prunAdag's form of topk_slice: the sample is of the effective gradients,
  // the pass is prunadag_bracket's; returns the int64 head (topk_slice's), the
  // float64 sums [G, X, G_w, X_w] (G, X: prunadag_bracket's outside the
  // bracket; G_w = G + the candidates' c^2 at or above the window, X_w = X +
  // their m below it), the histogram, the window's bit patterns and m, and
  // the candidates with their m.
  m.def("prunadag_slice(Tensor[] params, Tensor[] grads, Tensor hyper, int share, int buckets, int cap, "
      "int[] sample) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");

  // Differentiable sparsification (Lee) and two-temperature
  // architecture pruning (Colombo & Gao). Kernels: csrc/cpu/{rgf_relu,
  // sparse_gate,two_temperature_sigmoid}.cpp and csrc/cuda/*.cu of the same names.
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
