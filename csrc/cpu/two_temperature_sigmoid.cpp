// Two-temperature sigmoid on the CPU (AP eq. 6-7, SPEC.md section 5):
// forward v = sigmoid(t_l w), backward grad * t_s sigmoid(t_s w)(1 - sigmoid(t_s w)).
// One fused pass per direction, parallel over fixed chunks.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "prunopt/sparsification.h"
#include "prunopt/sparsification_checks.h"

namespace prunopt {
namespace cpu {
namespace {

constexpr int64_t kGrain = 1 << 13;

at::Tensor two_temperature_sigmoid_cpu(const at::Tensor& w_in, double t_l, double t_s) {
  check_float_tensor(w_in, "w", "two_temperature_sigmoid");
  check_temperature(t_l, "t_l", "two_temperature_sigmoid");
  check_temperature(t_s, "t_s", "two_temperature_sigmoid");
  const at::Tensor w = w_in.contiguous();
  at::Tensor v = at::empty_like(w, at::MemoryFormat::Contiguous);
  const int64_t n = w.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "two_temperature_sigmoid", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* vp = v.mutable_data_ptr<scalar_t>();
    const opmath_t tl = static_cast<opmath_t>(t_l);
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        vp[i] = static_cast<scalar_t>(sparsification::sigmoid(tl * static_cast<opmath_t>(wp[i])));
      }
    });
  });
  return v;
}

at::Tensor two_temperature_sigmoid_backward_cpu(const at::Tensor& grad_in, const at::Tensor& w_in, double t_s) {
  check_float_tensor(w_in, "w", "two_temperature_sigmoid_backward");
  check_like(grad_in, w_in, "grad", "w", "two_temperature_sigmoid_backward");
  check_temperature(t_s, "t_s", "two_temperature_sigmoid_backward");
  const at::Tensor w = w_in.contiguous();
  const at::Tensor g = grad_in.contiguous();
  at::Tensor gw = at::empty_like(w, at::MemoryFormat::Contiguous);
  const int64_t n = w.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "two_temperature_sigmoid_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* op = gw.mutable_data_ptr<scalar_t>();
    const opmath_t ts = static_cast<opmath_t>(t_s);
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        op[i] = static_cast<scalar_t>(static_cast<opmath_t>(gp[i]) * ts *
            sparsification::sigmoid_slope(ts * static_cast<opmath_t>(wp[i])));
      }
    });
  });
  return gw;
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("two_temperature_sigmoid", &prunopt::cpu::two_temperature_sigmoid_cpu);
  m.impl("two_temperature_sigmoid_backward", &prunopt::cpu::two_temperature_sigmoid_backward_cpu);
}
