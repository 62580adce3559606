// Argument checks shared by the CPU and CUDA entry points (host only).
// Every failure is a ValueError (TORCH_CHECK_VALUE) that names the argument.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace prunopt {

// Validates theta/cost/budget of the projection ops.
inline void check_projection_args(
    at::TensorList theta,
    const c10::optional<at::TensorList>& cost,
    double budget,
    const char* op) {
  TORCH_CHECK_VALUE(std::isfinite(budget) && budget >= 0.0, op,
      ": budget must be a finite number >= 0, got ", budget);
  if (theta.empty()) {
    TORCH_CHECK_VALUE(!cost.has_value() || cost->empty(), op,
        ": cost must have as many tensors as theta (0), got ", cost->size());
    return;
  }
  const auto& t0 = theta[0];
  for (size_t i = 0; i < theta.size(); ++i) {
    const auto& t = theta[i];
    TORCH_CHECK_VALUE(t.is_floating_point(), op, ": theta[", i,
        "] must be a real floating tensor, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.scalar_type() == t0.scalar_type(), op,
        ": all theta tensors must share one dtype, theta[", i, "] is ", t.scalar_type(),
        " but theta[0] is ", t0.scalar_type());
    TORCH_CHECK_VALUE(t.device() == t0.device(), op,
        ": all theta tensors must be on one device, theta[", i, "] is on ", t.device(),
        " but theta[0] is on ", t0.device());
  }
  if (cost.has_value()) {
    TORCH_CHECK_VALUE(cost->size() == theta.size(), op,
        ": cost must have as many tensors as theta (", theta.size(), "), got ", cost->size());
    for (size_t i = 0; i < theta.size(); ++i) {
      const auto& c = (*cost)[i];
      TORCH_CHECK_VALUE(c.sizes() == theta[i].sizes(), op, ": cost[", i,
          "] must have the shape of theta[", i, "] ", theta[i].sizes(), ", got ", c.sizes());
      TORCH_CHECK_VALUE(c.scalar_type() == t0.scalar_type(), op, ": cost[", i,
          "] must have the dtype of theta (", t0.scalar_type(), "), got ", c.scalar_type());
      TORCH_CHECK_VALUE(c.device() == t0.device(), op, ": cost[", i,
          "] must be on the device of theta (", t0.device(), "), got ", c.device());
    }
  }
}

// Storage offsets (in elements) of every element of t: numel int64 values on
// the CPU (from its sizes and strides alone; the data is never read).
inline at::Tensor element_offsets(const at::Tensor& t) {
  at::Tensor off = at::full({}, t.storage_offset(), at::kLong);
  for (int64_t d = 0; d < t.dim(); ++d) {
    off = off.unsqueeze(-1) + at::arange(t.size(d), at::kLong) * t.stride(d);
  }
  return off.reshape({-1});
}

// Whether two elements of t are one memory location (an expand()-ed or
// otherwise self-overlapping view). Exact: the cheap tests first (ATen's,
// dense layouts, strides that each step over the extent of the smaller
// ones), the sorted offsets of every element only for a view none decides.
inline bool has_internal_overlap_exact(const at::Tensor& t) {
  if (t.numel() <= 1) return false;
  if (at::has_internal_overlap(t) == at::MemOverlap::Yes) return true;
  if (t.is_non_overlapping_and_dense()) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dimensions of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  bool separated = true;
  int64_t extent = 0;  // the largest offset reached by the smaller-stride dimensions
  for (const auto& [stride, size] : dims) {
    separated = separated && stride > extent;
    extent += (size - 1) * stride;
  }
  if (separated) return false;
  const at::Tensor sorted = std::get<0>(element_offsets(t).sort());
  return (sorted.slice(0, 1) == sorted.slice(0, 0, -1)).any().item<bool>();
}

// A tensor an op writes in place, with the argument it came from: `list[index]`
// ("theta[2]", "opt_sums[0]") or `list` alone when index < 0. The name is
// formatted only for an error message (these checks run on every step).
struct Written {
  const char* list;
  int64_t index;
  at::Tensor tensor;
  std::string name() const { return index < 0 ? std::string(list) : std::string(list) + "[" + std::to_string(index) + "]"; }
};

// None of the written tensors may overlap itself (an expand()-ed tensor: its
// elements would be written several times, and copying a result back into it
// fails after the others were written) or another (the same tensor twice,
// overlapping views: in the projection every element counted twice against the
// budget; the same tensor twice gave all zeros). ValueError before anything is
// written. The tensors are sorted by storage and first offset, and each is
// compared only with those of its storage that start within its extent: views
// of one flat buffer cost a sort, not a comparison of every pair.
inline void check_disjoint_writes(const std::vector<Written>& ts, const char* op) {
  auto last_offset = [](const at::Tensor& t) {
    int64_t hi = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) hi += (t.size(d) - 1) * t.stride(d);
    return hi;
  };
  struct Extent {
    const void* storage;
    int64_t first, last;
    size_t i;
    bool operator<(const Extent& o) const { return std::tie(storage, first, i) < std::tie(o.storage, o.first, o.i); }
  };
  std::vector<Extent> extents;
  extents.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i].tensor;
    if (!t.defined() || t.numel() == 0 || t.is_meta() || !t.has_storage()) continue;
    TORCH_CHECK_VALUE(!has_internal_overlap_exact(t), op, ": ", ts[i].name(),
        " has elements sharing one memory location (e.g. an expand()-ed tensor); clone() it before writing it in "
        "place");
    extents.push_back({t.storage().unsafeGetStorageImpl(), t.storage_offset(), last_offset(t), i});
  }
  std::sort(extents.begin(), extents.end());
  for (size_t u = 0; u < extents.size(); ++u) {
    for (size_t v = u + 1; v < extents.size() && extents[v].storage == extents[u].storage &&
         extents[v].first <= extents[u].last; ++v) {
      const size_t i = std::min(extents[u].i, extents[v].i);
      const size_t j = std::max(extents[u].i, extents[v].i);
      const at::Tensor& a = ts[i].tensor;
      const at::Tensor& b = ts[j].tensor;
      if (a.element_size() != b.element_size()) continue;  // (views of one storage as different dtypes: not ours)
      const bool shared =
          a.is_same(b) || at::isin(element_offsets(a), element_offsets(b)).any().item<bool>();
      TORCH_CHECK_VALUE(!shared, op, ": ", ts[i].name(), " and ", ts[j].name(),
          " share memory (the same tensor twice or overlapping views): each element must be written once; pass "
          "each tensor once (or clone() one)");
    }
  }
}

// The in-place projection treats every element as a separate score (see
// check_disjoint_writes).
// project_budget_bracket's arguments: a non-empty theta list, theta / cost
// as for the projection, 0 <= lo <= hi (lo finite, hi may be inf).
inline void check_projection_bracket_args(at::TensorList theta, const c10::optional<at::TensorList>& cost,
    double lo, double hi, const char* op) {
  TORCH_CHECK_VALUE(!theta.empty(), op, ": theta must not be empty (a list of tensors)");
  check_projection_args(theta, cost, 0.0, op);
  TORCH_CHECK_VALUE(std::isfinite(lo) && lo >= 0.0, op, ": lo must be finite and >= 0, got ", lo);
  TORCH_CHECK_VALUE(!std::isnan(hi) && hi >= lo, op, ": hi must be >= lo (inf allowed), got lo=", lo, ", hi=", hi);
}

// (`name`: the argument the tensors came in, for the message)
inline void check_no_overlap(at::TensorList theta, const char* op, const char* name = "theta") {
  std::vector<Written> ts;
  ts.reserve(theta.size());
  for (size_t i = 0; i < theta.size(); ++i) ts.push_back({name, static_cast<int64_t>(i), theta[i]});
  check_disjoint_writes(ts, op);
}

// project_budget_apply_'s arguments: out and theta of one length, each
// out[i] of the shape, dtype and device of theta[i], the out tensors sharing
// no memory; lam >= 0 (inf allowed).
inline void check_projection_apply_args(at::TensorList out, at::TensorList theta,
    const c10::optional<at::TensorList>& cost, double lam, const char* op) {
  check_projection_args(theta, cost, 0.0, op);
  TORCH_CHECK_VALUE(!std::isnan(lam) && lam >= 0.0, op, ": lam must be >= 0 (inf allowed), got ", lam);
  TORCH_CHECK_VALUE(out.size() == theta.size(), op, ": out must have as many tensors as theta (", theta.size(),
      "), got ", out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    TORCH_CHECK_VALUE(out[i].sizes() == theta[i].sizes() && out[i].scalar_type() == theta[i].scalar_type() &&
        out[i].device() == theta[i].device(), op, ": out[", i, "] must have the shape, dtype and device of theta[",
        i, "] (", theta[i].sizes(), ", ", theta[i].scalar_type(), ", ", theta[i].device(), "), got ",
        out[i].sizes(), ", ", out[i].scalar_type(), ", ", out[i].device());
  }
  check_no_overlap(out, op, "out");
}

// prunadag_step_ writes params, opt_sums, dec_sums (and found_nonfinite):
// each element once (see check_disjoint_writes).
inline void check_prunadag_writes(at::TensorList params, at::TensorList opt_sums, at::TensorList dec_sums,
    const c10::optional<at::Tensor>& found_nonfinite, const char* op) {
  std::vector<Written> ts;
  ts.reserve(params.size() + opt_sums.size() + dec_sums.size() + 1);
  for (const auto& [name, list] : {std::make_pair("params", params), std::make_pair("opt_sums", opt_sums),
           std::make_pair("dec_sums", dec_sums)}) {
    for (size_t i = 0; i < list.size(); ++i) ts.push_back({name, static_cast<int64_t>(i), list[i]});
  }
  if (found_nonfinite.has_value() && found_nonfinite->defined()) ts.push_back({"found_nonfinite", -1, *found_nonfinite});
  check_disjoint_writes(ts, op);
}

}  // namespace prunopt
