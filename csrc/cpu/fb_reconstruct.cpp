// Fused reconstruction of the masked spatial filters of a filter-basis
// convolution on the CPU (SPEC.md section 3, interspace pruning eq. 4):
//
//   h[m, k] = sum_n lam[m, n] * mu[m, n] * g[n, k],   m = (o, i), k = (y, x)
//
// One pass over lam and mu, no (lam * mu) temporary. Rows are processed in
// blocks of kRows so that the innermost loop runs over rows (contiguous in the
// transposed block) and vectorises; sums are accumulated in double (N terms).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "prunopt/fb_checks.h"

namespace prunopt {
namespace cpu {
namespace {

constexpr int64_t kRows = 32;

// Rows [b0, b1) of blocks: always inlined into a baseline and an AVX2+FMA
// clone (the extension is built for generic x86-64), picked at run time.
template <typename scalar_t>
__attribute__((always_inline)) inline void reconstruct_blocks(const scalar_t* lam, const scalar_t* mu,
    const double* g, int64_t rows, int64_t n, int64_t k, scalar_t* h, int64_t b0, int64_t b1) {
  std::vector<double> c(n * kRows);
  double acc[kRows];
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t r0 = blk * kRows;
    const int64_t nr = std::min(kRows, rows - r0);
    // c[j, r] = lam[r0 + r, j] * mu[r0 + r, j]  (transposed: rows innermost)
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        double v = 0.0;
        if (r < nr) {
          const int64_t idx = (r0 + r) * n + j;
          v = static_cast<double>(lam[idx]) * (mu ? static_cast<double>(mu[idx]) : 1.0);
        }
        c[j * kRows + r] = v;
      }
    }
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t r = 0; r < kRows; ++r) acc[r] = 0.0;
      for (int64_t j = 0; j < n; ++j) {
        const double gj = g[j * k + kk];
        const double* cj = c.data() + j * kRows;
        for (int64_t r = 0; r < kRows; ++r) acc[r] += cj[r] * gj;
      }
      for (int64_t r = 0; r < nr; ++r) h[(r0 + r) * k + kk] = static_cast<scalar_t>(acc[r]);
    }
  }
}

template <typename scalar_t>
void blocks_default(const scalar_t* lam, const scalar_t* mu, const double* g, int64_t rows, int64_t n, int64_t k,
                    scalar_t* h, int64_t b0, int64_t b1) {
  reconstruct_blocks(lam, mu, g, rows, n, k, h, b0, b1);
}

#if defined(__GNUC__) && defined(__x86_64__)
#define PRUNOPT_X86_DISPATCH 1
template <typename scalar_t>
__attribute__((target("avx2,fma"))) void blocks_avx2(const scalar_t* lam, const scalar_t* mu, const double* g,
    int64_t rows, int64_t n, int64_t k, scalar_t* h, int64_t b0, int64_t b1) {
  reconstruct_blocks(lam, mu, g, rows, n, k, h, b0, b1);
}
#endif

template <typename scalar_t>
void reconstruct_rows(const scalar_t* lam, const scalar_t* mu, const double* g /*N x K*/, int64_t rows,
                      int64_t n, int64_t k, scalar_t* h) {
#ifdef PRUNOPT_X86_DISPATCH
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  at::parallel_for(0, (rows + kRows - 1) / kRows, std::max<int64_t>(1, 2048 / (n * k + 1)), [&](int64_t b0, int64_t b1) {
#ifdef PRUNOPT_X86_DISPATCH
    if (avx2) return blocks_avx2(lam, mu, g, rows, n, k, h, b0, b1);
#endif
    blocks_default(lam, mu, g, rows, n, k, h, b0, b1);
  });
}

at::Tensor fb_reconstruct_cpu(const at::Tensor& coefficients, const at::Tensor& basis,
                              const c10::optional<at::Tensor>& mask) {
  check_fb_reconstruct_args(coefficients, basis, mask, "fb_reconstruct");
  const int64_t c_out = coefficients.size(0), c_in_g = coefficients.size(1), n = coefficients.size(2);
  const int64_t kh = basis.size(1), kw = basis.size(2);
  auto out = at::empty({c_out, c_in_g, kh, kw}, coefficients.options());
  if (out.numel() == 0) return out;
  if (n == 0) return out.zero_();
  auto lam = coefficients.contiguous();
  auto mu = mask.has_value() ? mask->contiguous() : at::Tensor();
  auto g = basis.to(at::kDouble).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, coefficients.scalar_type(), "fb_reconstruct", [&] {
    reconstruct_rows<scalar_t>(lam.data_ptr<scalar_t>(), mu.defined() ? mu.data_ptr<scalar_t>() : nullptr,
        g.data_ptr<double>(), c_out * c_in_g, n, kh * kw, out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("fb_reconstruct", &prunopt::cpu::fb_reconstruct_cpu);
}
