// Argument checks of the filter-basis convolution ops (host only; interspace
// pruning, Wimmer et al.). Every failure is a ValueError (TORCH_CHECK_VALUE) naming the
// argument, so the raw ops are as safe as the Python wrappers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Optional.h>

#include "prunopt/fb_conv.h"

namespace prunopt {

// A None passed for a Tensor argument arrives as an undefined tensor.
inline void check_defined(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " must be a tensor, got None");
}

inline void check_fb_basis(const at::Tensor& basis, int64_t n, c10::ScalarType dtype, c10::Device device,
                           const char* op) {
  check_defined(basis, "basis", op);
  TORCH_CHECK_VALUE(basis.dim() == 3, op, ": basis must have shape (N, kh, kw), got ", basis.sizes());
  TORCH_CHECK_VALUE(basis.size(0) == n, op, ": basis has ", basis.size(0),
      " elements but the coefficients have N = ", n);
  TORCH_CHECK_VALUE(basis.scalar_type() == dtype, op, ": basis must have dtype ", dtype, ", got ",
      basis.scalar_type());
  TORCH_CHECK_VALUE(basis.device() == device, op, ": basis must be on ", device, ", got ", basis.device());
}

inline void check_fb_reconstruct_args(const at::Tensor& coefficients, const at::Tensor& basis,
                                      const c10::optional<at::Tensor>& mask, const char* op) {
  check_defined(coefficients, "coefficients", op);
  TORCH_CHECK_VALUE(coefficients.dim() == 3, op,
      ": coefficients must have shape (C_out, C_in/groups, N), got ", coefficients.sizes());
  TORCH_CHECK_VALUE(coefficients.is_floating_point(), op, ": coefficients must be a floating tensor, got ",
      coefficients.scalar_type());
  check_fb_basis(basis, coefficients.size(2), coefficients.scalar_type(), coefficients.device(), op);
  if (mask.has_value()) {
    TORCH_CHECK_VALUE(mask->sizes() == coefficients.sizes(), op, ": mask must have the shape of coefficients ",
        coefficients.sizes(), ", got ", mask->sizes());
    TORCH_CHECK_VALUE(mask->scalar_type() == coefficients.scalar_type(), op,
        ": mask must have the dtype of coefficients (", coefficients.scalar_type(), "), got ", mask->scalar_type());
    TORCH_CHECK_VALUE(mask->device() == coefficients.device(), op, ": mask must be on ", coefficients.device());
  }
}

// dL/dh of fb_reconstruct_backward: the shape (C_out, C_in/groups, kh, kw) of
// the filters, the dtype and device of the coefficients.
inline void check_fb_grad_h(const at::Tensor& grad_h, const at::Tensor& coefficients, const at::Tensor& basis,
                            const char* op) {
  check_defined(grad_h, "grad_h", op);
  TORCH_CHECK_VALUE(grad_h.dim() == 4 && grad_h.size(0) == coefficients.size(0) &&
      grad_h.size(1) == coefficients.size(1) && grad_h.size(2) == basis.size(1) && grad_h.size(3) == basis.size(2),
      op, ": grad_h must have the shape of the filters (", coefficients.size(0), ", ", coefficients.size(1), ", ",
      basis.size(1), ", ", basis.size(2), "), got ", grad_h.sizes());
  TORCH_CHECK_VALUE(grad_h.scalar_type() == coefficients.scalar_type(), op, ": grad_h must have dtype ",
      coefficients.scalar_type(), ", got ", grad_h.scalar_type());
  TORCH_CHECK_VALUE(grad_h.device() == coefficients.device(), op, ": grad_h must be on ", coefficients.device());
}

// Checks input / bias / conv arguments; returns the output size {B, C_out, Ho, Wo}.
inline std::vector<int64_t> check_fb_conv_args(const at::Tensor& input, int64_t c_out, int64_t c_in_g,
    const at::Tensor& basis, const c10::optional<at::Tensor>& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, const char* op) {
  check_defined(input, "input", op);
  TORCH_CHECK_VALUE(input.dim() == 4, op, ": input must have shape (B, C_in, H, W), got ", input.sizes());
  // (as conv2d, which the dense path calls: padding alone is no image)
  TORCH_CHECK_VALUE(input.size(2) >= 1 && input.size(3) >= 1, op,
      ": input must have an image of at least 1 x 1, got ", input.sizes());
  TORCH_CHECK_VALUE(input.scalar_type() == basis.scalar_type(), op, ": input must have dtype ",
      basis.scalar_type(), ", got ", input.scalar_type());
  TORCH_CHECK_VALUE(input.device() == basis.device(), op, ": input must be on ", basis.device());
  TORCH_CHECK_VALUE(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2, op,
      ": stride, padding and dilation must have two entries");
  TORCH_CHECK_VALUE(stride[0] >= 1 && stride[1] >= 1, op, ": stride must be >= 1, got ", stride);
  TORCH_CHECK_VALUE(padding[0] >= 0 && padding[1] >= 0, op, ": padding must be >= 0, got ", padding);
  TORCH_CHECK_VALUE(dilation[0] >= 1 && dilation[1] >= 1, op, ": dilation must be >= 1, got ", dilation);
  // (bounded so that in + 2 pad and dilation (k - 1) stay far inside int64:
  // larger values overflowed the index arithmetic, undefined behaviour)
  constexpr int64_t kMax = (int64_t(1) << 31) - 1;
  TORCH_CHECK_VALUE(stride[0] <= kMax && stride[1] <= kMax, op, ": stride must be at most ", kMax, ", got ", stride);
  TORCH_CHECK_VALUE(padding[0] <= kMax && padding[1] <= kMax, op, ": padding must be at most ", kMax, ", got ",
      padding);
  TORCH_CHECK_VALUE(dilation[0] <= kMax && dilation[1] <= kMax, op, ": dilation must be at most ", kMax, ", got ",
      dilation);
  TORCH_CHECK_VALUE(groups >= 1 && c_out % groups == 0, op, ": groups must be >= 1 and divide C_out = ", c_out,
      ", got ", groups);
  TORCH_CHECK_VALUE(input.size(1) == c_in_g * groups, op, ": input has ", input.size(1),
      " channels but the coefficients with groups=", groups, " expect ", c_in_g * groups);
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == c_out, op, ": bias must have shape (", c_out,
        ",), got ", bias->sizes());
    TORCH_CHECK_VALUE(bias->scalar_type() == basis.scalar_type() && bias->device() == basis.device(), op,
        ": bias must have the dtype and device of basis");
  }
  const int64_t ho = fb::out_size(input.size(2), basis.size(1), stride[0], padding[0], dilation[0]);
  const int64_t wo = fb::out_size(input.size(3), basis.size(2), stride[1], padding[1], dilation[1]);
  TORCH_CHECK_VALUE(ho >= 1 && wo >= 1, op, ": input ", input.sizes(), " is smaller than the dilated kernel");
  return {input.size(0), c_out, ho, wo};
}

inline void check_fb_csr_args(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& values,
                              const at::Tensor& basis, const char* op) {
  check_defined(crow, "crow_indices", op);
  check_defined(col, "col_indices", op);
  check_defined(values, "values", op);
  check_defined(basis, "basis", op);
  TORCH_CHECK_VALUE(crow.dim() == 1 && crow.numel() >= 2 && crow.scalar_type() == at::kInt, op,
      ": crow_indices must be a 1-D int32 tensor of length C_out + 1, got ", crow.sizes(), " ", crow.scalar_type());
  TORCH_CHECK_VALUE(col.dim() == 1 && col.scalar_type() == at::kInt, op,
      ": col_indices must be a 1-D int32 tensor, got ", col.sizes(), " ", col.scalar_type());
  TORCH_CHECK_VALUE(values.dim() == 1 && values.numel() == col.numel(), op,
      ": values must be 1-D with as many entries as col_indices (", col.numel(), "), got ", values.sizes());
  TORCH_CHECK_VALUE(values.scalar_type() == basis.scalar_type(), op, ": values must have dtype ",
      basis.scalar_type(), ", got ", values.scalar_type());
  TORCH_CHECK_VALUE(crow.device() == basis.device() && col.device() == basis.device() &&
      values.device() == basis.device(), op, ": crow_indices, col_indices and values must be on ", basis.device());
}

// The filters h = einsum("oin,nkl->oikl", lam * mu, basis) through the
// dispatcher, so that the training path of fb_conv2d uses the fused
// fb_reconstruct kernel of the tensors' device.
inline at::Tensor reconstruct(const at::Tensor& coefficients, const at::Tensor& basis, const c10::optional<at::Tensor>& mask) {
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("prunopt::fb_reconstruct", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&)>();
  return op.call(coefficients, basis, mask);
}

// The geometry of a call whose arguments check_fb_conv_args validated (`out` is
// its output shape).
inline fb::Geometry fb_geometry(const at::Tensor& input, const at::Tensor& basis, int64_t c_out,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    const std::vector<int64_t>& out) {
  return fb::Geometry{input.size(0), input.size(1), input.size(2), input.size(3), basis.size(0), basis.size(1),
      basis.size(2), out[2], out[3], stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1], c_out,
      groups};
}

}  // namespace prunopt
