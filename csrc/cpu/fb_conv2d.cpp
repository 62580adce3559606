// Filter-basis 2D convolution on the CPU (SPEC.md section 3; interspace
// pruning eq. 6, 8 and Alg. 1).
//
// Sparse path, for masked coefficients in CSR form (row o, column i*N + n):
//   1. basis maps  Z[b, c, n, p] = (g[n] * X[b, c])[p]  -- im2col of X fused with
//      the K^2 x N transform: for every non-zero g[n, k] one shifted, strided
//      axpy of an input row into Z (Alg. 1 l. 7-8). Only the maps (c, n) that
//      some non-zero coefficient uses are computed.
//   2. mix  Y[b, o, p] = bias[o] + sum_{e in row o} val[e] * Z[b, g(o), col[e], p]
//      (eq. 8, Alg. 1 l. 9-10): a CSR x dense product. Tasks are (batch, tile of
//      P, output channel) with the channel innermost, so one tile of Z stays in
//      cache while every output channel reads it.
// Both steps run under at::parallel_for and accumulate in the input dtype, as
// conv2d does (each output is a sum of ||row o||_0 products).
//
// fb_conv2d counts the non-zeros of lam * mu (one parallel pass); if the density
// exceeds max_density it reconstructs the filters and calls conv2d (the dense
// path), else it builds the CSR in a second pass and runs the sparse path.
// fb_conv2d_csr runs the sparse path on a CSR built once (FBConv2d caches it).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "prunopt/fb_checks.h"
#include "prunopt/fb_conv.h"

namespace prunopt {
namespace cpu {
namespace {

struct Geometry {
  int64_t batch, c_in, h, w, n, kh, kw, ho, wo, sh, sw, ph, pw, dh, dw, c_out, groups;
  int64_t p() const { return ho * wo; }
  int64_t c_in_g() const { return c_in / groups; }
};

struct Tap {  // one non-zero basis entry g[n, ky, kx]
  int64_t n, ky, kx;
  double w;
};

// Step 1: Z[b, c, n, :] for every used (c, n).
template <typename scalar_t>
void basis_maps(const scalar_t* x, const Geometry& G, const std::vector<Tap>& taps,
                const std::vector<uint8_t>& used, scalar_t* z) {
  const int64_t P = G.p();
  at::parallel_for(0, G.batch * G.c_in, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t bc = t0; bc < t1; ++bc) {
      const int64_t c = bc % G.c_in;
      const scalar_t* xc = x + bc * G.h * G.w;
      scalar_t* zc = z + bc * G.n * P;
      for (int64_t n = 0; n < G.n; ++n) {
        if (used[c * G.n + n]) std::fill(zc + n * P, zc + (n + 1) * P, scalar_t(0));
      }
      for (const Tap& t : taps) {
        if (!used[c * G.n + t.n]) continue;
        const scalar_t w = static_cast<scalar_t>(t.w);
        const int64_t offy = t.ky * G.dh - G.ph, offx = t.kx * G.dw - G.pw;
        int64_t ylo, yhi, xlo, xhi;
        fb::valid_range(G.h, G.ho, G.sh, offy, &ylo, &yhi);
        fb::valid_range(G.w, G.wo, G.sw, offx, &xlo, &xhi);
        scalar_t* zn = zc + t.n * P;
        for (int64_t oy = ylo; oy < yhi; ++oy) {
          const scalar_t* xr = xc + (oy * G.sh + offy) * G.w + offx;
          scalar_t* zr = zn + oy * G.wo;
          if (G.sw == 1) {
#pragma omp simd
            for (int64_t ox = xlo; ox < xhi; ++ox) zr[ox] += w * xr[ox];
          } else {
            for (int64_t ox = xlo; ox < xhi; ++ox) zr[ox] += w * xr[ox * G.sw];
          }
        }
      }
    }
  });
}

// Step 2: the CSR x dense mix of eq. 8.
template <typename scalar_t>
void csr_mix(const scalar_t* z, const Geometry& G, const int32_t* crow, const int32_t* col, const scalar_t* val,
             const scalar_t* bias, scalar_t* y) {
  const int64_t P = G.p();
  const int64_t tile = std::min<int64_t>(P, 512);
  const int64_t tiles = (P + tile - 1) / tile;
  const int64_t c_out_g = G.c_out / G.groups;
  const int64_t row_len = G.c_in_g() * G.n;
  const int64_t tasks = G.batch * tiles * G.c_out;
  // ~ tasks of at least a few thousand multiply-adds per chunk
  const int64_t nnz = crow[G.c_out];
  const int64_t work_per_task = std::max<int64_t>(1, (nnz / std::max<int64_t>(1, G.c_out) + 1) * tile);
  const int64_t grain = std::max<int64_t>(1, 32768 / work_per_task);
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    std::vector<scalar_t> acc(tile);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o = t % G.c_out;
      const int64_t bt = t / G.c_out;
      const int64_t tl = bt % tiles, b = bt / tiles;
      const int64_t p0 = tl * tile, len = std::min(tile, P - p0);
      const scalar_t b0 = bias ? bias[o] : scalar_t(0);
      scalar_t* a = acc.data();
      for (int64_t p = 0; p < len; ++p) a[p] = b0;
      const scalar_t* zg = z + (b * G.c_in + (o / c_out_g) * G.c_in_g()) * G.n * P + p0;
      for (int64_t e = crow[o]; e < crow[o + 1]; ++e) {
        const scalar_t v = val[e];
        const scalar_t* zr = zg + static_cast<int64_t>(col[e]) * P;
#pragma omp simd
        for (int64_t p = 0; p < len; ++p) a[p] += v * zr[p];
      }
      (void)row_len;
      std::copy(a, a + len, y + (b * G.c_out + o) * P + p0);
    }
  });
}

Geometry geometry(const at::Tensor& input, const at::Tensor& basis, int64_t c_out, at::IntArrayRef stride,
                  at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, const std::vector<int64_t>& out) {
  return Geometry{input.size(0), input.size(1), input.size(2), input.size(3), basis.size(0), basis.size(1),
      basis.size(2), out[2], out[3], stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1], c_out,
      groups};
}

// The sparse path on a validated CSR (int32 crow/col, contiguous values).
at::Tensor sparse_forward(const at::Tensor& input, const at::Tensor& crow, const at::Tensor& col,
    const at::Tensor& values, const at::Tensor& basis, const c10::optional<at::Tensor>& bias, const Geometry& G) {
  auto y = at::empty({G.batch, G.c_out, G.ho, G.wo}, input.options());
  if (y.numel() == 0) return y;
  auto x = input.contiguous();
  // taps: the non-zero entries of the basis (9 of 81 for the standard basis)
  auto g = basis.to(at::kDouble).contiguous();
  const double* gp = g.data_ptr<double>();
  std::vector<Tap> taps;
  for (int64_t n = 0; n < G.n; ++n)
    for (int64_t ky = 0; ky < G.kh; ++ky)
      for (int64_t kx = 0; kx < G.kw; ++kx) {
        const double w = gp[(n * G.kh + ky) * G.kw + kx];
        if (w != 0.0) taps.push_back(Tap{n, ky, kx, w});
      }
  // maps (c, n) used by some non-zero coefficient
  const int32_t* cp = col.data_ptr<int32_t>();
  const int32_t* rp = crow.data_ptr<int32_t>();
  const int64_t c_out_g = G.c_out / G.groups, c_in_g = G.c_in_g();
  std::vector<uint8_t> used(G.c_in * G.n, 0);
  for (int64_t o = 0; o < G.c_out; ++o) {
    const int64_t base = (o / c_out_g) * c_in_g * G.n;
    for (int64_t e = rp[o]; e < rp[o + 1]; ++e) used[base + cp[e]] = 1;
  }
  auto z = at::empty({G.batch, G.c_in, G.n, G.p()}, input.options());
  auto b = bias.has_value() ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "fb_conv2d", [&] {
    basis_maps<scalar_t>(x.data_ptr<scalar_t>(), G, taps, used, z.data_ptr<scalar_t>());
    csr_mix<scalar_t>(z.data_ptr<scalar_t>(), G, rp, cp, values.data_ptr<scalar_t>(),
        b.defined() ? b.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>());
  });
  return y;
}

at::Tensor reconstruct(const at::Tensor& coefficients, const at::Tensor& basis, const c10::optional<at::Tensor>& mask) {
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("prunopt::fb_reconstruct", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&)>();
  return op.call(coefficients, basis, mask);
}

at::Tensor fb_conv2d_cpu(const at::Tensor& input, const at::Tensor& coefficients, const at::Tensor& basis,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, double max_density) {
  const char* op = "fb_conv2d";
  check_fb_reconstruct_args(coefficients, basis, mask, op);
  const int64_t c_out = coefficients.size(0), c_in_g = coefficients.size(1), n = coefficients.size(2);
  const auto out = check_fb_conv_args(input, c_out, c_in_g, basis, bias, stride, padding, dilation, groups, op);
  const int64_t row_len = c_in_g * n;
  TORCH_CHECK_VALUE(row_len < (int64_t(1) << 31) && coefficients.numel() < (int64_t(1) << 31), op,
      ": coefficients too large for int32 CSR indices");
  auto lam = coefficients.contiguous();
  auto mu = mask.has_value() ? mask->contiguous() : at::Tensor();
  // pass 1: non-zeros of lam * mu per row
  std::vector<int32_t> crow(c_out + 1, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lam.scalar_type(), "fb_conv2d_count", [&] {
    const scalar_t* lp = lam.data_ptr<scalar_t>();
    const scalar_t* mp = mu.defined() ? mu.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, c_out, std::max<int64_t>(1, 4096 / (row_len + 1)), [&](int64_t o0, int64_t o1) {
      for (int64_t o = o0; o < o1; ++o) {
        int32_t cnt = 0;
        for (int64_t j = o * row_len; j < (o + 1) * row_len; ++j) {
          const scalar_t v = mp ? lp[j] * mp[j] : lp[j];
          cnt += static_cast<int32_t>(v != scalar_t(0));
        }
        crow[o + 1] = cnt;
      }
    });
  });
  for (int64_t o = 0; o < c_out; ++o) crow[o + 1] += crow[o];
  const int64_t nnz = crow[c_out];
  const double density = coefficients.numel() ? static_cast<double>(nnz) / coefficients.numel() : 0.0;
  if (density > max_density) {  // dense path: reconstruct (eq. 4) + conv2d (eq. 6)
    return at::conv2d(input, reconstruct(coefficients, basis, mask), bias, stride, padding, dilation, groups)
        .contiguous();
  }
  // pass 2: the CSR of lam * mu
  auto crow_t = at::from_blob(crow.data(), {c_out + 1}, at::kInt).clone();
  auto col_t = at::empty({nnz}, at::kInt);
  auto val_t = at::empty({nnz}, lam.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lam.scalar_type(), "fb_conv2d_csr_build", [&] {
    const scalar_t* lp = lam.data_ptr<scalar_t>();
    const scalar_t* mp = mu.defined() ? mu.data_ptr<scalar_t>() : nullptr;
    int32_t* cp = col_t.data_ptr<int32_t>();
    scalar_t* vp = val_t.data_ptr<scalar_t>();
    at::parallel_for(0, c_out, std::max<int64_t>(1, 4096 / (row_len + 1)), [&](int64_t o0, int64_t o1) {
      for (int64_t o = o0; o < o1; ++o) {
        int64_t e = crow[o];
        for (int64_t j = 0; j < row_len; ++j) {
          const scalar_t v = mp ? lp[o * row_len + j] * mp[o * row_len + j] : lp[o * row_len + j];
          if (v != scalar_t(0)) {
            cp[e] = static_cast<int32_t>(j);
            vp[e] = v;
            ++e;
          }
        }
      }
    });
  });
  const Geometry G = geometry(input, basis, c_out, stride, padding, dilation, groups, out);
  return sparse_forward(input, crow_t, col_t, val_t, basis, bias, G);
}

at::Tensor fb_conv2d_csr_cpu(const at::Tensor& input, const at::Tensor& crow_indices, const at::Tensor& col_indices,
    const at::Tensor& values, const at::Tensor& basis, const c10::optional<at::Tensor>& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  const char* op = "fb_conv2d_csr";
  TORCH_CHECK_VALUE(basis.dim() == 3, op, ": basis must have shape (N, kh, kw), got ", basis.sizes());
  check_fb_csr_args(crow_indices, col_indices, values, basis, op);
  const int64_t c_out = crow_indices.numel() - 1;
  TORCH_CHECK_VALUE(input.dim() == 4, op, ": input must have shape (B, C_in, H, W), got ", input.sizes());
  TORCH_CHECK_VALUE(groups >= 1 && input.size(1) % groups == 0, op, ": groups must divide C_in = ", input.size(1));
  const int64_t c_in_g = input.size(1) / groups;
  const auto out = check_fb_conv_args(input, c_out, c_in_g, basis, bias, stride, padding, dilation, groups, op);
  auto crow = crow_indices.contiguous();
  auto col = col_indices.contiguous();
  // a malformed CSR must be an error, never an out-of-bounds read
  const int32_t* rp = crow.data_ptr<int32_t>();
  const int32_t* cp = col.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(rp[0] == 0 && rp[c_out] == col.numel(), op,
      ": crow_indices must start at 0 and end at nnz = ", col.numel());
  for (int64_t o = 0; o < c_out; ++o) {
    TORCH_CHECK_VALUE(rp[o] <= rp[o + 1], op, ": crow_indices must be non-decreasing");
  }
  const int64_t row_len = c_in_g * basis.size(0);
  int32_t bad = 0;
  for (int64_t e = 0; e < col.numel(); ++e) bad |= static_cast<int32_t>(cp[e] < 0 || cp[e] >= row_len);
  TORCH_CHECK_VALUE(!bad, op, ": col_indices must lie in [0, C_in/groups * N) = [0, ", row_len, ")");
  const Geometry G = geometry(input, basis, c_out, stride, padding, dilation, groups, out);
  return sparse_forward(input, crow, col, values.contiguous(), basis, bias, G);
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("fb_conv2d", &prunopt::cpu::fb_conv2d_cpu);
  m.impl("fb_conv2d_csr", &prunopt::cpu::fb_conv2d_csr_cpu);
}
