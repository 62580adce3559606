// Host helpers for ops that take lists of tensors and work on contiguous
// copies (shared by the CPU and CUDA entry points).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace prunopt {

// t.contiguous() for every tensor: the same tensor where it already is.
inline std::vector<at::Tensor> contiguous_all(at::TensorList ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) {
    out.push_back(t.contiguous());
  }
  return out;
}

// Writes the results computed in `work` (from contiguous_all(originals)) back
// into the originals that were not contiguous.
inline void copy_back(const std::vector<at::Tensor>& work, at::TensorList originals) {
  for (size_t i = 0; i < work.size(); ++i) {
    if (!work[i].is_same(originals[i])) {
      originals[i].copy_(work[i]);
    }
  }
}

}  // namespace prunopt
