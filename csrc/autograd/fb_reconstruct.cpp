// Autograd of prunopt::fb_reconstruct in C++ (eq. 7, A.13, A.14), for every
// device: the training forward of FBConv2d is this op followed by conv2d, so
// its forward and backward dispatch without entering Python (a Python
// register_autograd costs tens of microseconds per call on the host, which is
// the whole step of a small layer on a GPU).
//
//   forward:  h = sum_n lam_n mu_n g^(n)                               (eq. 4)
//   backward: dL/dlam_n = mu_n <g^(n), dL/dh>,  dL/dg^(n) = sum lam_n mu_n dL/dh
//             one fused pass: prunopt::fb_reconstruct_backward
//
// Double backward: with create_graph the backward calls
// prunopt::fb_reconstruct_backward through the dispatcher, whose own autograd
// (registered from Python, prunopt/ops_interspace.py) is differentiable; a plain
// backward skips that autograd layer.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "prunopt/fb_checks.h"

namespace prunopt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor fb_reconstruct_call(const at::Tensor& coefficients, const at::Tensor& basis,
                               const c10::optional<at::Tensor>& mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("prunopt::fb_reconstruct", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&)>();
  return op.call(coefficients, basis, mask);
}

std::tuple<at::Tensor, at::Tensor> fb_reconstruct_backward_call(const at::Tensor& grad_h,
    const at::Tensor& coefficients, const at::Tensor& basis, const c10::optional<at::Tensor>& mask,
    std::array<bool, 2> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("prunopt::fb_reconstruct_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const c10::optional<at::Tensor>&, std::array<bool, 2>)>();
  return op.call(grad_h, coefficients, basis, mask, output_mask);
}

class FBReconstruct : public torch::autograd::Function<FBReconstruct> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& coefficients, const at::Tensor& basis,
                            const c10::optional<at::Tensor>& mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto h = fb_reconstruct_call(coefficients, basis, mask);
    ctx->save_for_backward({coefficients, basis, mask.has_value() ? *mask : at::Tensor()});
    return h;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const auto& coefficients = saved[0];
    const auto& basis = saved[1];
    c10::optional<at::Tensor> mask;
    if (saved[2].defined()) mask = saved[2];
    const bool need_lam = ctx->needs_input_grad(0), need_basis = ctx->needs_input_grad(1);
    if (!(need_lam || need_basis) || !grad_outputs[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    std::tuple<at::Tensor, at::Tensor> grads;
    if (at::GradMode::is_enabled()) {  // create_graph: keep the graph of the backward
      grads = fb_reconstruct_backward_call(grad_outputs[0], coefficients, basis, mask, {need_lam, need_basis});
    } else {
      at::AutoDispatchBelowADInplaceOrView guard;
      grads = fb_reconstruct_backward_call(grad_outputs[0], coefficients, basis, mask, {need_lam, need_basis});
    }
    return {need_lam ? std::get<0>(grads) : at::Tensor(), need_basis ? std::get<1>(grads) : at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor fb_reconstruct_autograd(const at::Tensor& coefficients, const at::Tensor& basis,
                                   const c10::optional<at::Tensor>& mask) {
  // (autograd::Function::apply reads every input's device: a None would be
  // "tensor does not have a device" instead of the kernel's ValueError)
  check_defined(coefficients, "coefficients", "fb_reconstruct");
  check_defined(basis, "basis", "fb_reconstruct");
  return FBReconstruct::apply(coefficients, basis, mask);
}

}  // namespace
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, Autograd, m) {
  m.impl("fb_reconstruct", &prunopt::fb_reconstruct_autograd);
}
