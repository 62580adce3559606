// relu with rectified gradient flow on the CPU (DS eq. 15, SPEC.md section 4):
// forward relu(x), backward grad * elu'(x; alpha). One fused, branch-free pass
// per direction, parallel over fixed chunks.
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

constexpr int64_t kGrain = 1 << 14;

at::Tensor rgf_relu_cpu(const at::Tensor& x_in, double alpha) {
  check_float_tensor(x_in, "x", "rgf_relu");
  check_rgf_alpha(alpha, "rgf_relu");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rgf_relu", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        yp[i] = static_cast<scalar_t>(sparsification::relu(static_cast<at::opmath_type<scalar_t>>(xp[i])));
      }
    });
  });
  return y;
}

at::Tensor rgf_relu_backward_cpu(const at::Tensor& grad_in, const at::Tensor& x_in, double alpha) {
  check_float_tensor(x_in, "x", "rgf_relu_backward");
  check_like(grad_in, x_in, "grad", "x", "rgf_relu_backward");
  check_rgf_alpha(alpha, "rgf_relu_backward");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor g = grad_in.contiguous();
  at::Tensor gx = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rgf_relu_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* op = gx.mutable_data_ptr<scalar_t>();
    const opmath_t a = static_cast<opmath_t>(alpha);
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        op[i] = static_cast<scalar_t>(
            static_cast<opmath_t>(gp[i]) * sparsification::rgf_slope(static_cast<opmath_t>(xp[i]), a));
      }
    });
  });
  return gx;
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("rgf_relu", &prunopt::cpu::rgf_relu_cpu);
  m.impl("rgf_relu_backward", &prunopt::cpu::rgf_relu_backward_cpu);
}
