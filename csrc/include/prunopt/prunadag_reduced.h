// prunAdag's fused step on float16 / bfloat16 tensors, shared by the CPU and
// CUDA entry points: as torch.optim.Adagrad(fused=True) does it (ATen's
// FusedAdagradKernel.cpp), every element is computed in float32 from the
// stored values and the results (parameter and both accumulators) are rounded
// once to the parameter's dtype; the accumulators stay in the parameter's
// dtype. Here that is float32 working copies of the four lists, the float32
// step (the same selection, ratio and element pass as for float32
// parameters), then one rounding copy back.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace prunopt {
namespace prunadag {

inline bool is_reduced_float(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16;
}

// `step` is the float32 entry point (same signature). With host_flag, a
// found_nonfinite set by the step (read on the host: CPU only) means nothing
// was written, and the copy back is skipped; without it the copy back always
// runs, which leaves a skipped step's values unchanged (a float16/bfloat16
// value round-trips through float32 exactly).
template <typename Step>
void step_in_float32(at::TensorList params, at::TensorList opt_sums, at::TensorList dec_sums, at::TensorList grads,
    const at::Tensor& hyper, int64_t relevant, int64_t version, const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& selection, bool host_flag, Step&& step) {
  const char* op = "prunadag_step_";
  const size_t nt = params.size();
  TORCH_CHECK_VALUE(opt_sums.size() == nt && dec_sums.size() == nt && grads.size() == nt, op,
      ": opt_sums, dec_sums and grads must have ", nt, " tensors");
  const auto& p0 = params[0];
  // The lists must agree before anything is upcast (a float32 accumulator next
  // to a float16 parameter would otherwise pass the float32 checks).
  for (size_t i = 0; i < nt; ++i) {
    for (const at::TensorList* lst : {&params, &opt_sums, &dec_sums, &grads}) {
      const auto& t = (*lst)[i];
      TORCH_CHECK_VALUE(t.scalar_type() == p0.scalar_type() && t.device() == p0.device() &&
          t.layout() == at::kStrided && t.sizes() == params[i].sizes(), op, ": params[", i, "], opt_sums[", i,
          "], dec_sums[", i, "] and grads[", i, "] must be dense tensors of the dtype and device of params[0] (",
          p0.scalar_type(), " on ", p0.device(), ") and the shape of params[", i, "]");
    }
  }
  const bool flagged = host_flag && found_nonfinite.has_value() && found_nonfinite->defined();
  if (flagged && found_nonfinite->item<float>() != 0.0f) {
    return;  // an earlier scope of this step had a non-finite gradient
  }
  auto up = [](at::TensorList ts) {
    std::vector<at::Tensor> out;
    out.reserve(ts.size());
    for (const auto& t : ts) {
      out.push_back(t.to(at::kFloat));
    }
    return out;
  };
  const auto xs = up(params), sos = up(opt_sums), sds = up(dec_sums), gs = up(grads);
  step(xs, sos, sds, gs, hyper, relevant, version, found_nonfinite, selection);
  if (flagged && found_nonfinite->item<float>() != 0.0f) {
    return;  // skipped: nothing was written
  }
  for (size_t i = 0; i < nt; ++i) {
    if (params[i].numel() == 0) {
      continue;
    }
    params[i].copy_(xs[i]);
    opt_sums[i].copy_(sos[i]);
    dec_sums[i].copy_(sds[i]);
  }
}

}  // namespace prunadag
}  // namespace prunopt
