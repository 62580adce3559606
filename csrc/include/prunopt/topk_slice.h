// topk_slice and prunadag_slice: one rank's part of the first round of the
// sharded top-k threshold and of the sharded PrunAdag select (see
// csrc/cpu/topk_slice.cpp). Host logic around device ops (topk_threshold on a
// fixed sample, topk_bracket or prunadag_bracket over the values), so one
// function each serves the CPU and the CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace prunopt {

// Entries of topk_slice's int64 head.
constexpr int64_t kSliceHeadSize = 12;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_slice(at::TensorList values, int64_t share,
    int64_t buckets, int64_t cap, at::IntArrayRef sample);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prunadag_slice(
    at::TensorList params, at::TensorList grads, const at::Tensor& hyper, int64_t share, int64_t buckets,
    int64_t cap, at::IntArrayRef sample);

}  // namespace prunopt
