// A call of one of our ops without any tensor argument (None for the only
// Tensor, an empty Tensor[] list) is a ValueError naming the argument.
//
// The dispatcher picks a kernel from the dispatch keys of the tensor
// arguments; with none there is no backend key, and the call ended in
// NotImplementedError ("There were no tensor arguments to this function ...")
// before any of our checks ran. BackendSelect is the one key that every call
// carries (it is in the default included set), so a kernel there sees every
// call: it refuses a call without tensors and passes any other straight to
// the keys below it (one boxed hop). Registered for every op of csrc/ops.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <string>

namespace prunopt {
namespace {

// The dispatch keys of the tensors an argument holds (none: empty). The
// dispatcher's own key extraction skips optional lists (`Tensor[]?`), so a
// call whose only tensors sit in one (e.g. theta = [] with costs given) has
// no backend key of its own: these keys supply it, and the kernel below then
// reports the empty list by name.
c10::DispatchKeySet keys_of(const c10::IValue& v) {
  c10::DispatchKeySet ks;
  if (v.isTensor()) {
    if (v.toTensor().defined()) ks = ks | v.toTensor().key_set();
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) ks = ks | t.key_set();
  } else if (v.isList()) {  // Tensor?[]
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor() && e.toTensor().defined()) ks = ks | e.toTensor().key_set();
    }
  }
  return ks;
}

void require_a_tensor(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  c10::DispatchKeySet held;
  for (size_t i = 0; i < n; ++i) held = held | keys_of((*stack)[stack->size() - n + i]);
  if (held.empty()) {
    std::string name = op.schema().name();
    name = name.substr(name.find("::") + 2);
    for (const auto& a : args) {  // the first Tensor or Tensor[] argument (not an optional one)
      const auto kind = a.type()->kind();
      if (kind == c10::TypeKind::TensorType) {
        TORCH_CHECK_VALUE(false, name, ": ", a.name(), " must be a tensor, got None");
      }
      if (kind == c10::TypeKind::ListType && a.type()->containedType(0)->kind() == c10::TypeKind::TensorType) {
        TORCH_CHECK_VALUE(false, name, ": ", a.name(), " must not be empty (a list of tensors)");
      }
    }
    TORCH_CHECK_VALUE(false, name, ": needs at least one tensor argument");
  }
  // (the keys of every tensor held, optional lists included, below this one)
  op.redispatchBoxed((ks | held) & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER,
      c10::DispatchKey::BackendSelect), stack);
}

}  // namespace
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, BackendSelect, m) {
  for (const char* name : {"project_budget", "project_budget_", "project_budget_bracket", "project_budget_apply_",
           "fb_reconstruct", "fb_reconstruct_backward",
           "fb_conv2d", "fb_conv2d_csr", "topk_threshold", "prunadag_step_", "prunadag_norms", "topk_bracket",
           "prunadag_bracket", "topk_slice", "prunadag_slice", "rgf_relu", "rgf_relu_backward", "sparse_gate",
           "sparse_gate_backward",
           "two_temperature_sigmoid", "two_temperature_sigmoid_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&prunopt::require_a_tensor>());
  }
}
