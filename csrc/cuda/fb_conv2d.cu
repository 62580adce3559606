// Filter-basis convolution on CUDA (Wimmer et al.; interspace pruning
// eq. 4, 6, 8, Alg. 1): the three ops of csrc/cpu/fb_reconstruct.cpp and
// csrc/cpu/fb_conv2d.cpp with simple, obviously correct kernels.
//
// * fb_reconstruct: one thread per filter tap h[m, k] = sum_n lam mu g[n, k];
//   its backward one thread per coefficient for dlam and per-block double
//   partial sums of dg, summed by ATen.
// * sparse path: one thread per basis map entry Z[b, c, n, p] (im2col fused with
//   the K^2 x N transform), then one thread per output Y[b, o, p] summing the
//   CSR row o of lam * mu against Z (eq. 8). Sums in at::opmath_type.
// * fb_conv2d counts the non-zeros with ATen ops, takes the dense path
//   (reconstruct + conv2d, cuDNN) above max_density and builds the CSR with
//   ATen ops otherwise.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <tuple>

#include "prunopt/fb_checks.h"
#include "prunopt/fb_conv.h"

namespace prunopt {
namespace cuda {
namespace {

constexpr int kThreads = 256;

inline int64_t blocks_for(int64_t n) { return (n + kThreads - 1) / kThreads; }

template <typename scalar_t>
__global__ void reconstruct_kernel(const scalar_t* __restrict__ lam, const scalar_t* __restrict__ mu,
                                   const scalar_t* __restrict__ g, int64_t rows, int64_t n, int64_t k,
                                   scalar_t* __restrict__ h) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * k) return;
  const int64_t m = i / k, kk = i % k;
  acc_t acc = 0;
  for (int64_t j = 0; j < n; ++j) {
    acc_t c = static_cast<acc_t>(lam[m * n + j]);
    if (mu != nullptr) c *= static_cast<acc_t>(mu[m * n + j]);
    acc += c * static_cast<acc_t>(g[j * k + kk]);
  }
  h[i] = static_cast<scalar_t>(acc);
}

at::Tensor fb_reconstruct_cuda(const at::Tensor& coefficients, const at::Tensor& basis,
                               const c10::optional<at::Tensor>& mask) {
  check_fb_reconstruct_args(coefficients, basis, mask, "fb_reconstruct");
  const c10::cuda::CUDAGuard guard(coefficients.device());
  const int64_t c_out = coefficients.size(0), c_in_g = coefficients.size(1), n = coefficients.size(2);
  const int64_t kh = basis.size(1), kw = basis.size(2);
  auto out = at::empty({c_out, c_in_g, kh, kw}, coefficients.options());
  if (out.numel() == 0) return out;
  auto lam = coefficients.contiguous();
  auto mu = mask.has_value() ? mask->contiguous() : at::Tensor();
  auto g = basis.contiguous();
  const int64_t total = out.numel();
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lam.scalar_type(), "fb_reconstruct_cuda", [&] {
    reconstruct_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(
        lam.data_ptr<scalar_t>(), mu.defined() ? mu.data_ptr<scalar_t>() : nullptr, g.data_ptr<scalar_t>(),
        c_out * c_in_g, n, kh * kw, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// dlam[m, n] = mu[m, n] sum_k dh[m, k] g[n, k]   (eq. 7, A.13): one thread per coefficient.
template <typename scalar_t>
__global__ void reconstruct_grad_lam_kernel(const scalar_t* __restrict__ dh, const scalar_t* __restrict__ mu,
                                            const scalar_t* __restrict__ g, int64_t rows, int64_t n, int64_t k,
                                            scalar_t* __restrict__ dlam) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * n) return;
  const int64_t m = i / n, j = i % n;
  acc_t acc = 0;
  for (int64_t kk = 0; kk < k; ++kk) acc += static_cast<acc_t>(dh[m * k + kk]) * static_cast<acc_t>(g[j * k + kk]);
  if (mu != nullptr) acc *= static_cast<acc_t>(mu[i]);
  dlam[i] = static_cast<scalar_t>(acc);
}

// Partial sums of dg[n, k] = sum_m lam[m, n] mu[m, n] dh[m, k] (A.14) in double:
// block b stages its rows [b * rows_per_block, ...) of lam * mu (in double, as
// before) and dh in shared memory with coalesced loads, then thread t sums the
// entries t, t + blockDim, ... over those rows. (One block per 1024 rows read
// lam and dh with a stride of N per thread and kept 81 of 256 threads busy:
// 131 us for 256x512x9 on an H100.)
template <typename scalar_t>
__global__ void reconstruct_grad_basis_kernel(const scalar_t* __restrict__ dh, const scalar_t* __restrict__ lam,
                                              const scalar_t* __restrict__ mu, int64_t rows, int64_t n, int64_t k,
                                              int64_t rows_per_block, double* __restrict__ partial) {
  extern __shared__ double smem[];
  double* sc = smem;                           // rows_per_block x n: lam * mu
  double* sd = smem + rows_per_block * n;      // rows_per_block x k: dh
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t nr = r0 + rows_per_block < rows ? rows_per_block : rows - r0;
  for (int64_t e = threadIdx.x; e < nr * n; e += blockDim.x) {
    double c = static_cast<double>(lam[r0 * n + e]);
    if (mu != nullptr) c *= static_cast<double>(mu[r0 * n + e]);
    sc[e] = c;
  }
  for (int64_t e = threadIdx.x; e < nr * k; e += blockDim.x) {
    sd[e] = static_cast<double>(dh[r0 * k + e]);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < n * k; e += blockDim.x) {
    const int64_t j = e / k, kk = e % k;
    double acc = 0;
    for (int64_t m = 0; m < nr; ++m) {
      acc += sc[m * n + j] * sd[m * k + kk];
    }
    partial[static_cast<int64_t>(blockIdx.x) * n * k + e] = acc;
  }
}

std::tuple<at::Tensor, at::Tensor> fb_reconstruct_backward_cuda(const at::Tensor& grad_h,
    const at::Tensor& coefficients, const at::Tensor& basis, const c10::optional<at::Tensor>& mask,
    std::array<bool, 2> output_mask) {
  const char* op = "fb_reconstruct_backward";
  check_fb_reconstruct_args(coefficients, basis, mask, op);
  check_fb_grad_h(grad_h, coefficients, basis, op);
  const c10::cuda::CUDAGuard guard(coefficients.device());
  const int64_t rows = coefficients.size(0) * coefficients.size(1), n = coefficients.size(2);
  const int64_t k = basis.size(1) * basis.size(2);
  auto dh = grad_h.contiguous();
  auto lam = coefficients.contiguous();
  auto mu = mask.has_value() ? mask->contiguous() : at::Tensor();
  auto g = basis.contiguous();
  auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor dlam = at::empty({0}, coefficients.options()), dg = at::empty({0}, basis.options());
  if (output_mask[0]) {
    dlam = at::empty(coefficients.sizes(), coefficients.options());
    if (dlam.numel() > 0) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lam.scalar_type(), "fb_reconstruct_grad_lam", [&] {
        reconstruct_grad_lam_kernel<scalar_t><<<blocks_for(dlam.numel()), kThreads, 0, stream>>>(
            dh.data_ptr<scalar_t>(), mu.defined() ? mu.data_ptr<scalar_t>() : nullptr, g.data_ptr<scalar_t>(),
            rows, n, k, dlam.data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
  }
  if (output_mask[1]) {
    // rows per block: up to 64, within 32 KB of shared memory (doubles)
    const int64_t kRowsPerBlock = std::max<int64_t>(1, std::min<int64_t>(64, 4096 / std::max<int64_t>(1, n + k)));
    const size_t smem = static_cast<size_t>(kRowsPerBlock * (n + k)) * sizeof(double);
    const int64_t blocks = rows > 0 ? (rows + kRowsPerBlock - 1) / kRowsPerBlock : 0;
    auto partial = at::zeros({std::max<int64_t>(blocks, 1), n * k}, coefficients.options().dtype(at::kDouble));
    if (blocks > 0 && n * k > 0) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lam.scalar_type(), "fb_reconstruct_grad_basis", [&] {
        reconstruct_grad_basis_kernel<scalar_t><<<blocks, kThreads, smem, stream>>>(
            dh.data_ptr<scalar_t>(), lam.data_ptr<scalar_t>(), mu.defined() ? mu.data_ptr<scalar_t>() : nullptr,
            rows, n, k, kRowsPerBlock, partial.data_ptr<double>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    dg = partial.sum(0).to(basis.scalar_type()).reshape(basis.sizes());
  }
  return std::make_tuple(dlam, dg);
}

using fb::Geometry;

// Z[b, c, n, p] = sum_{ky, kx} g[n, ky, kx] X[b, c, oy*sh + ky*dh - ph, ox*sw + kx*dw - pw]
template <typename scalar_t>
__global__ void basis_maps_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ g, Geometry G,
                                  scalar_t* __restrict__ z) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t P = G.ho * G.wo;
  const int64_t total = G.batch * G.c_in * G.n * P;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t p = i % P;
  const int64_t n = (i / P) % G.n;
  const int64_t bc = i / (P * G.n);
  const int64_t oy = p / G.wo, ox = p % G.wo;
  const scalar_t* xc = x + bc * G.h * G.w;
  const scalar_t* gn = g + n * G.kh * G.kw;
  acc_t acc = 0;
  for (int64_t ky = 0; ky < G.kh; ++ky) {
    const int64_t iy = oy * G.sh + ky * G.dh - G.ph;
    if (iy < 0 || iy >= G.h) continue;
    for (int64_t kx = 0; kx < G.kw; ++kx) {
      const int64_t ix = ox * G.sw + kx * G.dw - G.pw;
      if (ix < 0 || ix >= G.w) continue;
      acc += static_cast<acc_t>(gn[ky * G.kw + kx]) * static_cast<acc_t>(xc[iy * G.w + ix]);
    }
  }
  z[i] = static_cast<scalar_t>(acc);
}

// Y[b, o, p] = bias[o] + sum_{e in row o} val[e] Z[b, group(o) * C_in/groups * N + col[e], p]   (eq. 8)
template <typename scalar_t>
__global__ void csr_mix_kernel(const scalar_t* __restrict__ z, const int32_t* __restrict__ crow,
                               const int32_t* __restrict__ col, const scalar_t* __restrict__ val,
                               const scalar_t* __restrict__ bias, Geometry G, scalar_t* __restrict__ y) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t P = G.ho * G.wo;
  const int64_t total = G.batch * G.c_out * P;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t p = i % P;
  const int64_t o = (i / P) % G.c_out;
  const int64_t b = i / (P * G.c_out);
  const int64_t c_in_g = G.c_in / G.groups;
  const int64_t grp = o / (G.c_out / G.groups);
  const scalar_t* zg = z + ((b * G.c_in + grp * c_in_g) * G.n) * P + p;
  acc_t acc = bias != nullptr ? static_cast<acc_t>(bias[o]) : acc_t(0);
  for (int32_t e = crow[o]; e < crow[o + 1]; ++e) {
    acc += static_cast<acc_t>(val[e]) * static_cast<acc_t>(zg[static_cast<int64_t>(col[e]) * P]);
  }
  y[i] = static_cast<scalar_t>(acc);
}

at::Tensor sparse_forward(const at::Tensor& input, const at::Tensor& crow, const at::Tensor& col,
    const at::Tensor& values, const at::Tensor& basis, const c10::optional<at::Tensor>& bias, const Geometry& G) {
  auto y = at::empty({G.batch, G.c_out, G.ho, G.wo}, input.options());
  if (y.numel() == 0) return y;
  auto x = input.contiguous();
  auto g = basis.contiguous();
  auto z = at::empty({G.batch, G.c_in, G.n, G.ho * G.wo}, input.options());
  auto b = bias.has_value() ? bias->contiguous() : at::Tensor();
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "fb_conv2d_cuda", [&] {
    if (z.numel() > 0) {
      basis_maps_kernel<scalar_t><<<blocks_for(z.numel()), kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), G, z.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    csr_mix_kernel<scalar_t><<<blocks_for(y.numel()), kThreads, 0, stream>>>(
        z.data_ptr<scalar_t>(), crow.data_ptr<int32_t>(), col.data_ptr<int32_t>(), values.data_ptr<scalar_t>(),
        b.defined() ? b.data_ptr<scalar_t>() : nullptr, G, y.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

at::Tensor fb_conv2d_cuda(const at::Tensor& input, const at::Tensor& coefficients, const at::Tensor& basis,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, double max_density) {
  const char* op = "fb_conv2d";
  check_fb_reconstruct_args(coefficients, basis, mask, op);
  TORCH_CHECK_VALUE(!std::isnan(max_density), op, ": max_density must be a number, got nan");
  check_defined(input, "input", op);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t c_out = coefficients.size(0), c_in_g = coefficients.size(1), n = coefficients.size(2);
  const auto out = check_fb_conv_args(input, c_out, c_in_g, basis, bias, stride, padding, dilation, groups, op);
  TORCH_CHECK_VALUE(c_in_g * n < (int64_t(1) << 31) && coefficients.numel() < (int64_t(1) << 31), op,
      ": coefficients too large for int32 CSR indices");
  auto lam_mu = mask.has_value() ? coefficients * *mask : coefficients.contiguous();
  auto flat = lam_mu.reshape({c_out, c_in_g * n});
  auto nz = flat.ne(0);
  const int64_t nnz = nz.sum().item<int64_t>();
  const double density = coefficients.numel() ? static_cast<double>(nnz) / coefficients.numel() : 0.0;
  if (density > max_density) {
    return at::conv2d(input, reconstruct(coefficients, basis, mask), bias, stride, padding, dilation, groups)
        .contiguous();
  }
  auto crow = at::zeros({c_out + 1}, nz.options().dtype(at::kLong));
  crow.narrow(0, 1, c_out).copy_(nz.sum(1).cumsum(0));
  auto col = nz.nonzero().select(1, 1).to(at::kInt).contiguous();
  auto values = flat.masked_select(nz);  // row-major, the order of nonzero()
  const Geometry G = fb_geometry(input, basis, c_out, stride, padding, dilation, groups, out);
  return sparse_forward(input, crow.to(at::kInt), col, values, basis, bias, G);
}

at::Tensor fb_conv2d_csr_cuda(const at::Tensor& input, const at::Tensor& crow_indices, const at::Tensor& col_indices,
    const at::Tensor& values, const at::Tensor& basis, const c10::optional<at::Tensor>& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  const char* op = "fb_conv2d_csr";
  check_defined(basis, "basis", op);
  check_defined(input, "input", op);
  TORCH_CHECK_VALUE(basis.dim() == 3, op, ": basis must have shape (N, kh, kw), got ", basis.sizes());
  check_fb_csr_args(crow_indices, col_indices, values, basis, op);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t c_out = crow_indices.numel() - 1;
  TORCH_CHECK_VALUE(input.dim() == 4, op, ": input must have shape (B, C_in, H, W), got ", input.sizes());
  TORCH_CHECK_VALUE(groups >= 1 && input.size(1) % groups == 0, op, ": groups must divide C_in = ", input.size(1));
  const int64_t c_in_g = input.size(1) / groups;
  const auto out = check_fb_conv_args(input, c_out, c_in_g, basis, bias, stride, padding, dilation, groups, op);
  auto crow = crow_indices.contiguous();
  auto col = col_indices.contiguous();
  // a malformed CSR must be an error, never an out-of-bounds read
  const int64_t row_len = c_in_g * basis.size(0);
  auto crow_cpu = crow.cpu();
  const int32_t* rp = crow_cpu.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(rp[0] == 0 && rp[c_out] == col.numel(), op,
      ": crow_indices must start at 0 and end at nnz = ", col.numel());
  for (int64_t o = 0; o < c_out; ++o) {
    TORCH_CHECK_VALUE(rp[o] <= rp[o + 1], op, ": crow_indices must be non-decreasing");
  }
  if (col.numel() > 0) {
    TORCH_CHECK_VALUE(col.min().item<int32_t>() >= 0 && col.max().item<int32_t>() < row_len, op,
        ": col_indices must lie in [0, C_in/groups * N) = [0, ", row_len, ")");
  }
  const Geometry G = fb_geometry(input, basis, c_out, stride, padding, dilation, groups, out);
  return sparse_forward(input, crow, col, values.contiguous(), basis, bias, G);
}

}  // namespace
}  // namespace cuda
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CUDA, m) {
  m.impl("fb_reconstruct", &prunopt::cuda::fb_reconstruct_cuda);
  m.impl("fb_reconstruct_backward", &prunopt::cuda::fb_reconstruct_backward_cuda);
  m.impl("fb_conv2d", &prunopt::cuda::fb_conv2d_cuda);
  m.impl("fb_conv2d_csr", &prunopt::cuda::fb_conv2d_csr_cuda);
}
