// Filter-basis 2D convolution on the CPU (Wimmer et al.; interspace
// pruning eq. 6, 8 and Alg. 1).
//
// Sparse path, for masked coefficients in CSR form (row o, column i*N + n):
//   1. basis maps  Z[b, c, n, p] = (g[n] * X[b, c])[p]  (Alg. 1 l. 7-8): for
//      stride 1 a K-term sum of shifted rows of a zero-padded copy of X[b, c],
//      otherwise im2col followed by the K^2 x N transform. Only the maps (c, n)
//      that some non-zero coefficient uses are computed (when the scan for them
//      is cheaper than computing all). Z is stored tile-major,
//      [b][tile of the mix][c][n][tile width], so the slice one output tile
//      reads is contiguous (no 4 KiB-strided rows aliasing in L1/L2).
//   2. mix  Y[b, o, p] = bias[o] + sum_{e in row o} val[e] * Z[b, g(o), col[e], p]
//      (eq. 8, Alg. 1 l. 9-10): a CSR x dense product. Tasks are (batch, tile of
//      P, output channel) with the channel innermost, so one tile of Z stays in
//      cache while every output channel reads it.
// Both steps run under at::parallel_for and accumulate in the input dtype, as
// conv2d does (each output is a sum of ||row o||_0 products); float16 and
// bfloat16 inputs in float32, rounded once at the end.
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
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "prunopt/fb_checks.h"
#include "prunopt/fb_conv.h"
#include "prunopt/fb_conv2d_kernels.h"

namespace prunopt {
namespace cpu {
namespace {

using fb::Geometry;
using namespace fbconv;

// The kernels are compiled for the baseline ISA of the build and for AVX2+FMA
// (fb_conv2d_kernels_*.cpp), and picked at run time (the extension is built
// for generic x86-64).
#ifdef PRUNOPT_X86_DISPATCH
inline bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
// and a third time for AVX-512 (64-byte vectors: half the loads and FMAs per
// row of the mix), unless PRUNOPT_NO_AVX512 is set (tests compare the two)
inline bool use_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && use_avx2();
  return ok && std::getenv("PRUNOPT_NO_AVX512") == nullptr;
}
#endif

// Step 1: Z[b, c, n, :] = sum_k g[n, k] col_c[k, :] for every used (c, n): a
// K^2 x N transform of the channel's im2col (the im2col itself for the
// standard basis).
template <typename scalar_t>
void basis_maps(const scalar_t* x, const Geometry& G, const double* g, bool identity,
                const std::vector<uint8_t>& used, scalar_t* z) {
  const int64_t P = G.p(), K = G.kh * G.kw, N = G.n;
  const auto taps = tap_geometry(G);
  std::vector<scalar_t> gs(N * K);
  for (int64_t i = 0; i < N * K; ++i) gs[i] = static_cast<scalar_t>(g[i]);
  at::parallel_for(0, G.batch * G.c_in, std::max<int64_t>(1, 4096 / (N * P + 1)), [&](int64_t t0, int64_t t1) {
    MapsArgs<scalar_t> a{x, &G, gs.data(), identity, used.data(), &taps, z};
#ifdef PRUNOPT_X86_DISPATCH
    if (use_avx512()) return maps_avx512<scalar_t>(a, t0, t1);
    if (use_avx2()) return maps_avx2<scalar_t>(a, t0, t1);
#endif
    maps_default<scalar_t>(a, t0, t1);
  });
}

// Step 2: the CSR x dense mix of eq. 8. A task is (batch, tile of kTile
// outputs, output channel); channels are innermost so the Z tile stays in cache.
template <typename scalar_t>
void csr_mix(const scalar_t* z, const Geometry& G, const int32_t* crow, const int32_t* col, const scalar_t* val,
             const scalar_t* bias, scalar_t* y) {
  const int64_t P = G.p();
  const int64_t tiles = (P + tile_width(P, kMixTile) - 1) / tile_width(P, kMixTile);
  const int64_t tasks = G.batch * tiles * G.c_out;
  const int64_t nnz = crow[G.c_out];
  const int64_t work_per_task = std::max<int64_t>(1, (nnz / std::max<int64_t>(1, G.c_out) + 1) * std::min(P, kTile));
  const int64_t grain = std::max<int64_t>(1, 16384 / work_per_task);
  // Channels innermost keep one tile's slice of Z in cache while every output
  // channel reads it, but write each channel's rows P apart (4 KiB at 32x32:
  // the same L1 set for every channel). When one image's Z fits in L2 anyway,
  // the tiles go innermost and y is written in order (3->64 @32x32, density
  // 0.1, one thread: 78 -> 45 us).
  const int64_t z_bytes = tiles * tile_width(P, kMixTile) * G.c_in * G.n * static_cast<int64_t>(sizeof(scalar_t));
  const bool o_outer = z_bytes <= (int64_t(256) << 10);
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    MixArgs<scalar_t> a{z, &G, crow, col, val, bias, y, o_outer};
#ifdef PRUNOPT_X86_DISPATCH
    if (use_avx512()) return mix_avx512<scalar_t>(a, t0, t1);
    if (use_avx2()) return mix_avx2<scalar_t>(a, t0, t1);
#endif
    mix_default<scalar_t>(a, t0, t1);
  });
}

// The sparse path on a validated CSR (int32 crow/col, contiguous values).
at::Tensor sparse_forward(const at::Tensor& input, const at::Tensor& crow, const at::Tensor& col,
    const at::Tensor& values, const at::Tensor& basis, const c10::optional<at::Tensor>& bias, const Geometry& G) {
  // float16 and bfloat16 run the float32 kernels on the converted input,
  // values and bias, and round the output once (as conv2d on the CPU). Their
  // own kernels converted in software in every product: on the VGG16-CIFAR
  // layers at p = 0.9, batch 1, one thread, float16 took 1.2-24x and bfloat16
  // up to 6x the time of this path (and were compiled for every clone).
  if (input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16) {
    const c10::optional<at::Tensor> bias_f =
        bias.has_value() ? c10::optional<at::Tensor>(bias->to(at::kFloat)) : c10::nullopt;
    return sparse_forward(input.to(at::kFloat), crow, col, values.to(at::kFloat), basis, bias_f, G)
        .to(input.scalar_type());
  }
  auto y = at::empty({G.batch, G.c_out, G.ho, G.wo}, input.options());
  auto x = input.contiguous();
  // the basis in double: a few hundred values, converted here rather than by
  // basis.to(kDouble) (an allocation and a dispatched copy: ~2 us of a small
  // layer's ~40 us)
  std::vector<double> gd(static_cast<size_t>(basis.numel()));
  {
    const auto bc = basis.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bc.scalar_type(), "fb_conv2d_basis", [&] {
      const scalar_t* s = bc.data_ptr<scalar_t>();
      for (size_t i = 0; i < gd.size(); ++i) gd[i] = static_cast<double>(s[i]);
    });
  }
  const double* gp = gd.data();
  // the standard basis (Alg. A1) in its natural order: Z is the im2col itself
  bool identity = G.n == G.kh * G.kw;
  for (int64_t n = 0; identity && n < G.n; ++n)
    for (int64_t k = 0; k < G.n; ++k) identity = identity && gp[n * G.n + k] == (n == k ? 1.0 : 0.0);
  // the column indices are checked first (a malformed CSR is an error, never
  // an out-of-bounds access): a max over them, which vectorises
  const int32_t* cp = col.data_ptr<int32_t>();
  const int32_t* rp = crow.data_ptr<int32_t>();
  const int64_t nnz = col.numel();
  const int64_t c_out_g = G.c_out / G.groups, c_in_g = G.c_in_g();
  const int64_t row_len = c_in_g * G.n;
  // (an or of signed compares: it vectorises with the baseline SSE2, where an
  // unsigned max does not; at 236K non-zeros the scalar max was 18% of a
  // 512-channel 2x2 layer's time)
  const int32_t rl = static_cast<int32_t>(std::min<int64_t>(row_len, std::numeric_limits<int32_t>::max()));
  std::atomic<bool> bad_col{false};
  at::parallel_for(0, nnz, 1 << 16, [&](int64_t e0, int64_t e1) {
    int32_t bad = 0;
    for (int64_t e = e0; e < e1; ++e) bad |= static_cast<int32_t>(cp[e] < 0) | static_cast<int32_t>(cp[e] >= rl);
    if (bad) bad_col = true;
  });
  TORCH_CHECK_VALUE(!bad_col.load(),
      "fb_conv2d_csr: col_indices must lie in [0, C_in/groups * N) = [0, ", row_len, ")");
  // maps (c, n) used by some non-zero coefficient. The scan costs about as
  // much per non-zero as a small image's mix, so when computing every map is
  // cheaper than scanning (small images, many non-zeros) all are marked used;
  // so they are when, at this density d, a map is unused with probability
  // (1 - d)^(C_out/groups) < 5% (512 output channels at d = 0.01: 0.6%).
  const double density = static_cast<double>(nnz) / static_cast<double>(std::max<int64_t>(1, G.c_out * row_len));
  const bool scan = G.c_in * G.n * G.kh * G.kw * G.p() * G.batch > 4 * nnz &&
                    std::pow(1.0 - density, static_cast<double>(c_out_g)) >= 0.05;
  std::vector<uint8_t> used(G.c_in * G.n, scan ? 0 : 1);
  if (scan) {
    uint8_t* __restrict u = used.data();
    for (int64_t o = 0; o < G.c_out; ++o) {
      uint8_t* __restrict ug = u + (o / c_out_g) * c_in_g * G.n;
      const int32_t e0 = rp[o], e1 = rp[o + 1];
      for (int32_t e = e0; e < e1; ++e) ug[cp[e]] = 1;
    }
  }
  if (y.numel() == 0) return y;
  // tile-major (see maps_body): whole tiles of the mix width
  const int64_t wz = tile_width(G.p(), kMixTile);
  auto z = at::empty({G.batch * ((G.p() + wz - 1) / wz) * wz * G.c_in * G.n}, input.options());
  auto b = bias.has_value() ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "fb_conv2d", [&] {
    basis_maps<scalar_t>(x.data_ptr<scalar_t>(), G, gp, identity, used, z.data_ptr<scalar_t>());
    csr_mix<scalar_t>(z.data_ptr<scalar_t>(), G, rp, cp, values.data_ptr<scalar_t>(),
        b.defined() ? b.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>());
  });
  return y;
}

at::Tensor fb_conv2d_cpu(const at::Tensor& input, const at::Tensor& coefficients, const at::Tensor& basis,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, double max_density) {
  const char* op = "fb_conv2d";
  check_fb_reconstruct_args(coefficients, basis, mask, op);
  TORCH_CHECK_VALUE(!std::isnan(max_density), op, ": max_density must be a number, got nan");
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
  const Geometry G = fb_geometry(input, basis, c_out, stride, padding, dilation, groups, out);
  return sparse_forward(input, crow_t, col_t, val_t, basis, bias, G);
}

at::Tensor fb_conv2d_csr_cpu(const at::Tensor& input, const at::Tensor& crow_indices, const at::Tensor& col_indices,
    const at::Tensor& values, const at::Tensor& basis, const c10::optional<at::Tensor>& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  const char* op = "fb_conv2d_csr";
  check_defined(basis, "basis", op);
  check_defined(input, "input", op);
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
  TORCH_CHECK_VALUE(rp[0] == 0 && rp[c_out] == col.numel(), op,
      ": crow_indices must start at 0 and end at nnz = ", col.numel());
  for (int64_t o = 0; o < c_out; ++o) {
    TORCH_CHECK_VALUE(rp[o] <= rp[o + 1], op, ": crow_indices must be non-decreasing");
  }
  const Geometry G = fb_geometry(input, basis, c_out, stride, padding, dilation, groups, out);
  return sparse_forward(input, crow, col, values.contiguous(), basis, bias, G);
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("fb_conv2d", &prunopt::cpu::fb_conv2d_cpu);
  m.impl("fb_conv2d_csr", &prunopt::cpu::fb_conv2d_csr_cpu);
}
