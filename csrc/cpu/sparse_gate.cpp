// Sparse gates of differentiable sparsification on the CPU (DS eq. 9-12, 15;
// SPEC.md section 4). alpha is (groups, n), beta is (groups,); every row is one
// competition group with its own threshold sigmoid(beta_g) ||.||_1.
//
//   signed (eq. 12):       a_i = sign(alpha_i) r(|alpha_i| - s L),  L = ||alpha||_1
//   non-negative (9-11):   gamma = exp(alpha), u_i = gamma_i - s G, G = ||gamma||_1,
//                          gt_i = r(u_i), a = gt / T, T = sum(gt) (a = 0 when T = 0)
//
// r is relu forward; backward its slope is d(u) = 1 (u > 0) or rgf_alpha exp(u)
// (u <= 0), the elu derivative of eq. 15 (rgf_alpha = 0: plain relu). With
// g = dLoss/da and s' = s (1 - s):
//
//   signed:       P = sum_i g_i sign(alpha_i) d(z_i)
//                 dalpha_k = g_k d(z_k) sign(alpha_k)^2 - s sign(alpha_k) P,  dbeta = -s' L P
//   non-negative: h_j = (g_j - <g, a>) / T  (T := 1 when T = 0), q_j = h_j d(u_j),
//                 Q = sum q, dalpha_k = gamma_k (q_k - s Q),  dbeta = -s' G Q
//
// Each group is processed by one thread (groups are split over threads); all
// sums and the arithmetic are in double.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "prunopt/sparsification.h"
#include "prunopt/sparsification_checks.h"

namespace prunopt {
namespace cpu {
namespace {

namespace sp = prunopt::sparsification;

constexpr int64_t kGrain = 1 << 14;  // elements per task at least

int64_t row_grain(int64_t n) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1));
}

template <typename scalar_t>
void gate_forward_row(const scalar_t* al, double beta, int64_t n, bool is_signed, scalar_t* out) {
  const double s = sp::sigmoid(beta);
  if (is_signed) {
    double L = 0;
    for (int64_t i = 0; i < n; ++i) L += std::fabs(static_cast<double>(al[i]));
    const double th = s * L;
    for (int64_t i = 0; i < n; ++i) {
      const double x = static_cast<double>(al[i]);
      out[i] = static_cast<scalar_t>(sp::sign(x) * sp::relu(std::fabs(x) - th));
    }
    return;
  }
  double G = 0;
  for (int64_t i = 0; i < n; ++i) G += std::exp(static_cast<double>(al[i]));
  const double th = s * G;
  double T = 0;
  for (int64_t i = 0; i < n; ++i) T += sp::relu(std::exp(static_cast<double>(al[i])) - th);
  const double inv = 1.0 / (T > 0 ? T : 1.0);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<scalar_t>(sp::relu(std::exp(static_cast<double>(al[i])) - th) * inv);
  }
}

template <typename scalar_t>
double gate_backward_row(const scalar_t* g, const scalar_t* al, double beta, int64_t n, bool is_signed,
    double rgf_alpha, scalar_t* galpha) {
  const double s = sp::sigmoid(beta);
  const double ds = sp::sigmoid_slope(beta);
  if (is_signed) {
    double L = 0;
    for (int64_t i = 0; i < n; ++i) L += std::fabs(static_cast<double>(al[i]));
    const double th = s * L;
    double P = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double x = static_cast<double>(al[i]);
      P += static_cast<double>(g[i]) * sp::sign(x) * sp::rgf_slope(std::fabs(x) - th, rgf_alpha);
    }
    for (int64_t i = 0; i < n; ++i) {
      const double x = static_cast<double>(al[i]);
      const double sg = sp::sign(x);
      galpha[i] = static_cast<scalar_t>(
          static_cast<double>(g[i]) * sp::rgf_slope(std::fabs(x) - th, rgf_alpha) * sg * sg - s * sg * P);
    }
    return -ds * L * P;
  }
  double G = 0;
  for (int64_t i = 0; i < n; ++i) G += std::exp(static_cast<double>(al[i]));
  const double th = s * G;
  double T = 0, ga = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double gt = sp::relu(std::exp(static_cast<double>(al[i])) - th);
    T += gt;
    ga += static_cast<double>(g[i]) * gt;
  }
  const double Ts = T > 0 ? T : 1.0;
  ga /= Ts;  // <g, a>
  double Q = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double u = std::exp(static_cast<double>(al[i])) - th;
    Q += (static_cast<double>(g[i]) - ga) / Ts * sp::rgf_slope(u, rgf_alpha);
  }
  for (int64_t i = 0; i < n; ++i) {
    const double gamma = std::exp(static_cast<double>(al[i]));
    const double q = (static_cast<double>(g[i]) - ga) / Ts * sp::rgf_slope(gamma - th, rgf_alpha);
    galpha[i] = static_cast<scalar_t>(gamma * (q - s * Q));
  }
  return -ds * G * Q;
}

at::Tensor sparse_gate_cpu(const at::Tensor& alpha_in, const at::Tensor& beta_in, bool is_signed, double rgf_alpha) {
  check_gate_args(alpha_in, beta_in, rgf_alpha, "sparse_gate");
  const at::Tensor alpha = alpha_in.contiguous();
  const at::Tensor beta = beta_in.contiguous();
  at::Tensor a = at::empty_like(alpha, at::MemoryFormat::Contiguous);
  const int64_t groups = alpha.size(0), n = alpha.size(1);
  if (alpha.numel() == 0) return a;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "sparse_gate", [&] {
    const scalar_t* ap = alpha.const_data_ptr<scalar_t>();
    const scalar_t* bp = beta.const_data_ptr<scalar_t>();
    scalar_t* op = a.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, groups, row_grain(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        gate_forward_row(ap + r * n, static_cast<double>(bp[r]), n, is_signed, op + r * n);
      }
    });
  });
  return a;
}

std::tuple<at::Tensor, at::Tensor> sparse_gate_backward_cpu(const at::Tensor& grad_in, const at::Tensor& alpha_in,
    const at::Tensor& beta_in, bool is_signed, double rgf_alpha) {
  check_gate_args(alpha_in, beta_in, rgf_alpha, "sparse_gate_backward");
  check_like(grad_in, alpha_in, "grad", "alpha", "sparse_gate_backward");
  const at::Tensor alpha = alpha_in.contiguous();
  const at::Tensor beta = beta_in.contiguous();
  const at::Tensor g = grad_in.contiguous();
  at::Tensor galpha = at::empty_like(alpha, at::MemoryFormat::Contiguous);
  at::Tensor gbeta = at::empty_like(beta, at::MemoryFormat::Contiguous);
  const int64_t groups = alpha.size(0), n = alpha.size(1);
  if (alpha.numel() == 0) {
    gbeta.zero_();
    return {galpha, gbeta};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "sparse_gate_backward", [&] {
    const scalar_t* ap = alpha.const_data_ptr<scalar_t>();
    const scalar_t* bp = beta.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* gap = galpha.mutable_data_ptr<scalar_t>();
    scalar_t* gbp = gbeta.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, groups, row_grain(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        gbp[r] = static_cast<scalar_t>(gate_backward_row(gp + r * n, ap + r * n, static_cast<double>(bp[r]), n,
            is_signed, rgf_alpha, gap + r * n));
      }
    });
  });
  return {galpha, gbeta};
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("sparse_gate", &prunopt::cpu::sparse_gate_cpu);
  m.impl("sparse_gate_backward", &prunopt::cpu::sparse_gate_backward_cpu);
}
