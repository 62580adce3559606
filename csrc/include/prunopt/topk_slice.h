// topk_slice: one rank's part of the sharded top-k threshold's first round
// (see csrc/cpu/topk_slice.cpp). Host logic around two device ops
// (topk_threshold on a fixed sample, topk_bracket over the values), so one
// function serves the CPU and the CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace prunopt {

// Entries of topk_slice's int64 head.
constexpr int64_t kSliceHeadSize = 12;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_slice(at::TensorList values, int64_t share,
    int64_t buckets, int64_t cap);

}  // namespace prunopt
