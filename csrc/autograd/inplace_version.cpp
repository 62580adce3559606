// Version counters of the tensors our in-place ops write (ADInplaceOrView).
//
// ATen's own in-place ops bump the version counter of every tensor they
// mutate, which is how autograd notices that a tensor saved for backward was
// overwritten ("one of the variables needed for gradient computation has been
// modified by an inplace operation") and how views and caches notice changes.
// A custom op gets that only from a kernel at the ADInplaceOrView key; without
// it, prunopt::project_budget_ / prunopt::prunadag_step_ changed tensors in
// place with their versions unchanged, so a backward through a tensor saved
// before the step silently used the new values.
//
// One boxed kernel serves every mutable op: it reads which arguments the
// schema marks as written (`Tensor(a!)`, `Tensor(a!)[]`, `Tensor(a!)?`), runs
// the op below this key, then bumps each written tensor's version once.
//
// At the Autograd key, a second boxed kernel refuses what ATen's in-place ops
// refuse while grad mode is on: writing a leaf that requires grad (or a view
// of one). Our in-place ops are not differentiable, so a written tensor that
// is part of a graph (requires grad) is refused too: its gradient would
// silently ignore the write. Under torch.no_grad() (optimizer steps) both are
// allowed, as for ATen's ops. The check comes before the op runs: nothing is
// written.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

namespace prunopt {
namespace {

// A tensor the call writes: the schema argument it came from and its place in
// that argument's list (-1 for a single Tensor).
struct WrittenArg {
  size_t arg;
  int64_t index;
  at::Tensor tensor;
};

// Every tensor the call on the stack writes (the schema's `Tensor(a!)`,
// `Tensor(a!)[]`, `Tensor(a!)?` arguments); None writes nothing.
std::vector<WrittenArg> written_arguments(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  std::vector<WrittenArg> out;
  for (size_t i = 0; i < n; ++i) {
    const auto* alias = args[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    const c10::IValue& v = (*stack)[stack->size() - n + i];
    if (v.isTensor()) {
      out.push_back({i, -1, v.toTensor()});
    } else if (v.isTensorList()) {
      int64_t j = 0;
      for (const at::Tensor& t : v.toTensorList()) out.push_back({i, j++, t});
    } else if (v.isList()) {  // Tensor?[]
      int64_t j = 0;
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) out.push_back({i, j, e.toTensor()});
        ++j;
      }
    }
  }
  return out;
}

void refuse_grad_writes(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (at::GradMode::is_enabled()) {
    for (const auto& w : written_arguments(op, stack)) {
      const at::Tensor& t = w.tensor;
      if (!t.defined() || !t.requires_grad()) continue;
      const std::string& arg = op.schema().arguments()[w.arg].name();
      const std::string name = w.index < 0 ? arg : arg + "[" + std::to_string(w.index) + "]";
      TORCH_CHECK(!t.is_leaf(), op.schema().name(), ": ", name,
          ": a leaf Variable that requires grad is being used in an in-place operation.");
      TORCH_CHECK(!(t.is_view() && t._base().is_leaf()), op.schema().name(), ": ", name,
          ": a view of a leaf Variable that requires grad is being used in an in-place operation.");
      TORCH_CHECK(false, op.schema().name(), ": ", name,
          " requires grad, but the op writes it in place and is not differentiable: call it under "
          "torch.no_grad() or on a detached tensor");
    }
  }
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

void bump_written_versions(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const std::vector<WrittenArg> written = written_arguments(op, stack);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const auto& w : written) {
    if (w.tensor.defined() && !w.tensor.is_inference()) {
      w.tensor.unsafeGetTensorImpl()->bump_version();
    }
  }
}

}  // namespace
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, ADInplaceOrView, m) {
  m.impl("project_budget_", torch::CppFunction::makeFromBoxedFunction<&prunopt::bump_written_versions>());
  m.impl("project_budget_apply_", torch::CppFunction::makeFromBoxedFunction<&prunopt::bump_written_versions>());
  m.impl("prunadag_step_", torch::CppFunction::makeFromBoxedFunction<&prunopt::bump_written_versions>());
}

TORCH_LIBRARY_IMPL(prunopt, Autograd, m) {
  m.impl("project_budget_", torch::CppFunction::makeFromBoxedFunction<&prunopt::refuse_grad_writes>());
  m.impl("project_budget_apply_", torch::CppFunction::makeFromBoxedFunction<&prunopt::refuse_grad_writes>());
  m.impl("prunadag_step_", torch::CppFunction::makeFromBoxedFunction<&prunopt::refuse_grad_writes>());
}
