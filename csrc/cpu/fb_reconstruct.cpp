// Fused reconstruction of the masked spatial filters of a filter-basis
// convolution and its backward on the CPU (Wimmer et al., interspace
// pruning eq. 4, 7, A.13, A.14). With rows m = (o, i), taps k = (y, x):
//
//   forward    h[m, k]     = sum_n lam[m, n] mu[m, n] g[n, k]            (eq. 4)
//   backward   dlam[m, n]  = mu[m, n] sum_k dh[m, k] g[n, k]             (eq. 7, A.13)
//              dg[n, k]    = sum_m lam[m, n] mu[m, n] dh[m, k]           (A.14)
//
// Both are one pass over the (C_out * C_in/groups)-row tensors and are bound by
// memory bandwidth in training (the rows are short: N, K <= 32 floats), so the
// work per row must stay at a few vector instructions:
//
// * A row is held in C vectors of V lanes (V = Vectorized<scalar>::size(), C =
//   ceil(max(N, K) / V)); the basis is kept padded with zeros to C*V lanes, so
//   h[m, :] = sum_n c[n] * g[n, :] is N broadcast multiply-adds per vector and
//   dlam[m, :] = sum_k dh[m, k] * g^T[k, :] is K. Rows are read and written C*V
//   wide: a row's surplus lanes read the start of the next row (finite data
//   that only reaches discarded lanes) and are overwritten when the next row is
//   stored, so only the last rows of a thread's chunk (whose surplus would
//   cross into another thread's rows or past the tensor) go through padded
//   local copies.
// * dg is accumulated as N x C vectors in the input dtype over blocks of
//   kBlockRows rows (short float blocks), each block added in double to the
//   chunk's double accumulator; chunks are summed in double in order.
// * Per-row sums (N or K terms) are in the input dtype, as conv2d's. Half and
//   BFloat16, and rows longer than 128 bytes (32 floats, 16 doubles), take a
//   scalar loop with float / double sums.
//
// The vector loops are ATen's at::vec::Vectorized, compiled per CPU
// capability (fb_reconstruct_kernels.inc in fb_reconstruct_default.cpp,
// _avx2.cpp, _avx512.cpp; prunopt/fb_reconstruct_cpu.h) and picked at run time
// with prunopt/vec_capability.h. The 3x3 basis in float (every 3x3 FB layer
// in training) has its own hand-written AVX2 loops with the basis held in
// registers (see forward_3x3_body), compiled a second time with AVX-512VL's
// 32 registers on CPUs that have them: a row of 9 is one 8-lane vector and one
// lane (the generic rows take 16 lanes for it: one AVX-512 vector, two AVX2
// ones). They are kept because they are measured faster than the generic rows
// on the same shapes: float32, C_out = C_in = 64 / 256 / 512, 3x3, masked, 1
// thread, both paths in one process and build, interleaved per burst of calls
// (bench/fb_reconstruct_3x3_paths.py; shared 2-vCPU Intel Xeon @ 2.50GHz,
// AVX-512, 2026-11-28): forward 0.063 / 0.80 / 3.45 ms here against the
// generic AVX-512 rows' 0.107 / 1.31 / 5.17 ms (the generic rows take 1.73 /
// 1.65 / 1.52x as long), backward 0.123 / 1.53 / 5.92 ms against 0.215 / 2.91
// / 11.3 ms (1.75 / 1.93 / 1.98x); the generic AVX2 rows 1.89-2.38x as long as
// the AVX2 clone; 2 threads at 512x512: 1.20x forward, 1.93x backward
// (float64, the same code under both settings: 0.96-1.01x). PRUNOPT_FB_GENERIC_3X3=1 sends the float 3x3
// basis to the generic rows (bench/results/simd_aten.md).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <tuple>
#include <type_traits>
#include <vector>

#include "prunopt/fb_checks.h"
#include "prunopt/fb_reconstruct_cpu.h"
#include "prunopt/vec_capability.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

namespace prunopt {
namespace cpu {
namespace {

using fb_rows::BackwardArgs;
using fb_rows::Dims;
using fb_rows::kBlockRows;

#if defined(__GNUC__) && defined(__x86_64__)
#define PRUNOPT_X86_DISPATCH 1
// The 3x3 float loops: AVX2 from the AVX2 capability on, their AVX-512VL
// clone on the AVX512 one (prunopt/vec_capability.h: torch's capability capped
// by the CPU; PRUNOPT_NO_AVX512 and PRUNOPT_NO_SIMD read per call, so that
// tests can compare the clones).
inline bool use_avx2() {
  return vec::cpu_capability() != vec::Capability::kDefault;
}
inline bool use_avx512() {
  return vec::cpu_capability() == vec::Capability::kAvx512;
}
#endif

// The generic row kernels of the capability this CPU runs now (fb_reconstruct_kernels.inc).
inline const fb_rows::Rows* rows_kernels() {
#if defined(PRUNOPT_X86_DISPATCH)
  switch (vec::cpu_capability()) {
    case vec::Capability::kAvx512:
      return fb_rows::AVX512::rows();
    case vec::Capability::kAvx2:
      return fb_rows::AVX2::rows();
    default:
      break;
  }
#endif
  return fb_rows::DEFAULT::rows();
}

template <typename scalar_t>
constexpr bool kVectorised = std::is_same<scalar_t, float>::value || std::is_same<scalar_t, double>::value;

// ---- scalar loops (Half, BFloat16, long rows) -------------------------------------------------

template <typename scalar_t>
void forward_rows_scalar(const scalar_t* lam, const scalar_t* mu, const double* g, const Dims& d, scalar_t* h,
                         int64_t r0, int64_t r1) {
  using acc_t = at::opmath_type<scalar_t>;
  std::vector<acc_t> c(d.n);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < d.n; ++j) {
      c[j] = static_cast<acc_t>(lam[r * d.n + j]) * (mu ? static_cast<acc_t>(mu[r * d.n + j]) : acc_t(1));
    }
    for (int64_t kk = 0; kk < d.k; ++kk) {
      acc_t acc = 0;
      for (int64_t j = 0; j < d.n; ++j) acc += c[j] * static_cast<acc_t>(g[j * d.k + kk]);
      h[r * d.k + kk] = static_cast<scalar_t>(acc);
    }
  }
}

template <typename scalar_t>
void backward_rows_scalar(const scalar_t* dh, const scalar_t* lam, const scalar_t* mu, const double* g, const Dims& d,
                          scalar_t* dlam, double* dg, int64_t r0, int64_t r1) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t* dr = dh + r * d.k;
    for (int64_t j = 0; j < d.n; ++j) {
      const acc_t mj = mu ? static_cast<acc_t>(mu[r * d.n + j]) : acc_t(1);
      if (dlam) {
        acc_t acc = 0;
        for (int64_t kk = 0; kk < d.k; ++kk) acc += static_cast<acc_t>(dr[kk]) * static_cast<acc_t>(g[j * d.k + kk]);
        dlam[r * d.n + j] = static_cast<scalar_t>(acc * mj);
      }
      if (dg) {
        const double cj = static_cast<double>(lam[r * d.n + j]) * static_cast<double>(mj);
        for (int64_t kk = 0; kk < d.k; ++kk) dg[j * d.k + kk] += cj * static_cast<double>(dr[kk]);
      }
    }
  }
}

#ifdef PRUNOPT_X86_DISPATCH
// ---- the 3x3 basis (N = K = 9) in float with AVX2: a row is one vector + one lane --------------
//
// The eight taps / coefficients 0..7 of a row are one vector, the ninth a
// scalar, so no read or write leaves the row. The basis stays in registers;
// the ninth column is a horizontal sum. This is the shape of every 3x3 FB
// layer in training, where these kernels must run at memory speed.
//
// Horizontal sums use one association, ((v0+v1)+(v2+v3)) + ((v4+v5)+(v6+v7)),
// whether a row is summed alone (hsum8) or with seven others (hsum8x8), so a
// row's result does not depend on how rows fall into groups or thread chunks.
__attribute__((target("avx2,fma"), always_inline)) inline float hsum8(__m256 v) {
  const __m256 h1 = _mm256_hadd_ps(v, v);
  const __m256 h2 = _mm256_hadd_ps(h1, h1);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}

// Lane j of the result = hsum8(p[j]), bitwise (a horizontal-add tree over
// eight rows: ~1.5 instructions per row instead of four).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 hsum8x8(const __m256* p) {
  const __m256 s01 = _mm256_hadd_ps(p[0], p[1]), s23 = _mm256_hadd_ps(p[2], p[3]);
  const __m256 s45 = _mm256_hadd_ps(p[4], p[5]), s67 = _mm256_hadd_ps(p[6], p[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// The 72 products lam * mu (or lam) of rows [r, r + 8) into out.
__attribute__((target("avx2,fma"), always_inline)) inline void block_products(const float* lam, const float* mu,
                                                                              int64_t r, float* out) {
  const float* la = lam + r * 9;
  const float* ma = mu ? mu + r * 9 : nullptr;
  for (int q = 0; q < 9; ++q) {
    __m256 v = _mm256_loadu_ps(la + 8 * q);
    if (ma) v = _mm256_mul_ps(v, _mm256_loadu_ps(ma + 8 * q));
    _mm256_store_ps(out + 8 * q, v);
  }
}

// g: 9 x 9 doubles (row n = g^(n)). Inlined into two clones (below): AVX2,
// and AVX2 with AVX-512VL, the same instructions with 32 vector registers.
__attribute__((target("avx2,fma"), always_inline)) inline void forward_3x3_body(const float* lam, const float* mu,
    const double* g, float* h, int64_t r0, int64_t r1) {
  __m256 G[9];
  alignas(32) float tmp[8];
  for (int n = 0; n < 9; ++n) {
    for (int k = 0; k < 8; ++k) tmp[k] = static_cast<float>(g[n * 9 + k]);
    G[n] = _mm256_load_ps(tmp);
  }
  for (int n = 0; n < 8; ++n) tmp[n] = static_cast<float>(g[n * 9 + 8]);
  const __m256 g8 = _mm256_load_ps(tmp);  // column 8, n = 0..7
  const float g88 = static_cast<float>(g[80]);
  // Blocks of 8 rows: the 72 products lam * mu of the next block are formed
  // (9 contiguous vector multiplies into the other half of cbuf) while this
  // block's rows are transformed, so the broadcasts never wait on a store just
  // made (per-row store-then-broadcast was ~17% slower). Tap 8 of the block's
  // rows is one horizontal-add tree instead of eight horizontal sums.
  alignas(32) float cbuf[2][72];
  int64_t r = r0;
  int cur = 0;
  if (r + 8 <= r1) block_products(lam, mu, r, cbuf[0]);
  for (; r + 8 <= r1; r += 8) {
    const float* cc = cbuf[cur];
    if (r + 16 <= r1) block_products(lam, mu, r + 8, cbuf[cur ^ 1]);
    __m256 p[8];
    for (int j = 0; j < 8; ++j) {
      const float* cr = cc + 9 * j;
      __m256 a0 = _mm256_mul_ps(_mm256_broadcast_ss(cr + 8), G[8]);
      __m256 a1 = _mm256_mul_ps(_mm256_broadcast_ss(cr + 1), G[1]);
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(cr + 0), G[0], a0);
      a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(cr + 3), G[3], a1);
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(cr + 2), G[2], a0);
      a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(cr + 5), G[5], a1);
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(cr + 4), G[4], a0);
      a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(cr + 7), G[7], a1);
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(cr + 6), G[6], a0);
      _mm256_storeu_ps(h + (r + j) * 9, _mm256_add_ps(a0, a1));
      p[j] = _mm256_mul_ps(_mm256_loadu_ps(cr), g8);
    }
    _mm256_store_ps(tmp, hsum8x8(p));  // lane j: taps 0..7 of row j times column 8
    for (int j = 0; j < 8; ++j) h[(r + j) * 9 + 8] = tmp[j] + cc[9 * j + 8] * g88;
    cur ^= 1;
  }
  alignas(32) float cb[8];
  for (; r < r1; ++r) {
    const float* lr = lam + r * 9;
    __m256 c = _mm256_loadu_ps(lr);
    float c8 = lr[8];
    if (mu) {
      c = _mm256_mul_ps(c, _mm256_loadu_ps(mu + r * 9));
      c8 *= mu[r * 9 + 8];
    }
    _mm256_store_ps(cb, c);
    __m256 acc = _mm256_mul_ps(_mm256_set1_ps(c8), G[8]);
    for (int n = 0; n < 8; ++n) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(cb + n), G[n], acc);
    const float h8 = hsum8(_mm256_mul_ps(c, g8)) + c8 * g88;
    _mm256_storeu_ps(h + r * 9, acc);
    h[r * 9 + 8] = h8;
  }
}

// Adds a block's row 8 (A8 = dg[8][0..7]), column 8 (Acol = dg[0..7][8]) and
// corner of dg to the double accumulator.
__attribute__((target("avx2,fma"), always_inline)) inline void add_dg_edges(double* dg, __m256 a8, __m256 acol,
                                                                            float a88) {
  alignas(32) float t[8];
  _mm256_store_ps(t, a8);
  for (int k = 0; k < 8; ++k) dg[72 + k] += t[k];
  _mm256_store_ps(t, acol);
  for (int n = 0; n < 8; ++n) dg[n * 9 + 8] += t[n];
  dg[80] += a88;
}

// dlam (may be null) and dg (9 x 9 doubles, added to; may be null) of rows [r0, r1).
__attribute__((target("avx2,fma"), always_inline)) inline void backward_3x3_body(const float* dh, const float* lam,
    const float* mu, const double* g, float* dlam, double* dg, int64_t r0, int64_t r1) {
  alignas(32) float tmp[8];
  __m256 GT[9];  // GT[k] = (g[0][k], ..., g[7][k])
  for (int k = 0; k < 9; ++k) {
    for (int n = 0; n < 8; ++n) tmp[n] = static_cast<float>(g[n * 9 + k]);
    GT[k] = _mm256_load_ps(tmp);
  }
  for (int k = 0; k < 8; ++k) tmp[k] = static_cast<float>(g[72 + k]);
  const __m256 g8row = _mm256_load_ps(tmp);  // g[8][0..7]
  const float g88 = static_cast<float>(g[80]);
  alignas(32) float buf[8];
  for (int64_t b0 = r0; b0 < r1; b0 += kBlockRows) {
    const int64_t b1 = std::min(r1, b0 + kBlockRows);
    if (dlam && dg) {
      // Both outputs in one pass over the block: each broadcast dh[k] feeds the
      // dlam FMA and the dg FMA (AT[k] = (dg[0][k], ..., dg[7][k])), and dh, lam
      // and mu are loaded once. Each dg element gets the same FMAs in the same
      // row order as the two-pass loops below, so the result is bitwise equal.
      __m256 AT[8], A8 = _mm256_setzero_ps(), Acol = _mm256_setzero_ps();
      for (int k = 0; k < 8; ++k) AT[k] = _mm256_setzero_ps();
      float a88 = 0.f;
      for (int64_t r = b0; r < b1; ++r) {
        const float* dr = dh + r * 9;
        const __m256 d = _mm256_loadu_ps(dr);
        const float d8 = dr[8];
        const float* lr = lam + r * 9;
        __m256 c = _mm256_loadu_ps(lr);
        float c8 = lr[8];
        __m256 m = _mm256_set1_ps(1.f);
        float m8 = 1.f;
        if (mu) {
          m = _mm256_loadu_ps(mu + r * 9);
          m8 = mu[r * 9 + 8];
          c = _mm256_mul_ps(c, m);
          c8 *= m8;
        }
        __m256 acc = _mm256_mul_ps(_mm256_set1_ps(d8), GT[8]);
        for (int k = 0; k < 8; ++k) {
          const __m256 b = _mm256_broadcast_ss(dr + k);
          acc = _mm256_fmadd_ps(b, GT[k], acc);
          AT[k] = _mm256_fmadd_ps(c, b, AT[k]);
        }
        float l8 = hsum8(_mm256_mul_ps(d, g8row)) + d8 * g88;
        if (mu) {
          acc = _mm256_mul_ps(acc, m);
          l8 *= m8;
        }
        _mm256_storeu_ps(dlam + r * 9, acc);
        dlam[r * 9 + 8] = l8;
        A8 = _mm256_fmadd_ps(_mm256_set1_ps(c8), d, A8);
        Acol = _mm256_fmadd_ps(c, _mm256_set1_ps(d8), Acol);
        a88 += c8 * d8;
      }
      for (int k = 0; k < 8; ++k) {
        _mm256_store_ps(tmp, AT[k]);
        for (int n = 0; n < 8; ++n) dg[n * 9 + k] += tmp[n];
      }
      add_dg_edges(dg, A8, Acol, a88);
      continue;
    }
    if (dlam) {  // dlam[n] = mu[n] <g[n], dh>: a K-sum per coefficient
      for (int64_t r = b0; r < b1; ++r) {
        const float* dr = dh + r * 9;
        const __m256 d = _mm256_loadu_ps(dr);
        const float d8 = dr[8];
        __m256 acc = _mm256_mul_ps(_mm256_set1_ps(d8), GT[8]);
        for (int k = 0; k < 8; ++k) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(dr + k), GT[k], acc);
        float l8 = hsum8(_mm256_mul_ps(d, g8row)) + d8 * g88;
        if (mu) {
          acc = _mm256_mul_ps(acc, _mm256_loadu_ps(mu + r * 9));
          l8 *= mu[r * 9 + 8];
        }
        _mm256_storeu_ps(dlam + r * 9, acc);
        dlam[r * 9 + 8] = l8;
      }
    }
    if (dg) {  // dg[n][k] += c[n] dh[k] over the block (rows still in L1), then into double
      __m256 A[8], A8 = _mm256_setzero_ps(), Acol = _mm256_setzero_ps();
      for (int n = 0; n < 8; ++n) A[n] = _mm256_setzero_ps();
      float a88 = 0.f;
      for (int64_t r = b0; r < b1; ++r) {
        const float* lr = lam + r * 9;
        __m256 c = _mm256_loadu_ps(lr);
        float c8 = lr[8];
        if (mu) {
          c = _mm256_mul_ps(c, _mm256_loadu_ps(mu + r * 9));
          c8 *= mu[r * 9 + 8];
        }
        const __m256 d = _mm256_loadu_ps(dh + r * 9);
        const float d8 = dh[r * 9 + 8];
        _mm256_store_ps(buf, c);
        for (int n = 0; n < 8; ++n) A[n] = _mm256_fmadd_ps(_mm256_broadcast_ss(buf + n), d, A[n]);
        A8 = _mm256_fmadd_ps(_mm256_set1_ps(c8), d, A8);
        Acol = _mm256_fmadd_ps(c, _mm256_set1_ps(d8), Acol);
        a88 += c8 * d8;
      }
      for (int n = 0; n < 8; ++n) {
        _mm256_store_ps(tmp, A[n]);
        for (int k = 0; k < 8; ++k) dg[n * 9 + k] += tmp[k];
      }
      add_dg_edges(dg, A8, Acol, a88);
    }
  }
}

// The clones. With 16 ymm registers GCC keeps part of each kernel's working
// set on the stack: in the backward four of the dg accumulators and a88, a
// store-to-load chain through memory per row (perf; 8.5 ns a row on one
// thread with L2-resident rows). AVX-512VL gives the same AVX2 instructions 32
// registers (7.6 ns). Same operations in the same order, so the same bits
// (test_3x3_clones_agree_bitwise; PRUNOPT_NO_AVX512=1 picks the AVX2 clone).
__attribute__((target("avx2,fma"))) void forward_3x3_avx2(const float* lam, const float* mu, const double* g,
                                                         float* h, int64_t r0, int64_t r1) {
  forward_3x3_body(lam, mu, g, h, r0, r1);
}
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void forward_3x3_avx512(const float* lam, const float* mu,
    const double* g, float* h, int64_t r0, int64_t r1) {
  forward_3x3_body(lam, mu, g, h, r0, r1);
}
__attribute__((target("avx2,fma"))) void backward_3x3_avx2(const float* dh, const float* lam, const float* mu,
    const double* g, float* dlam, double* dg, int64_t r0, int64_t r1) {
  backward_3x3_body(dh, lam, mu, g, dlam, dg, r0, r1);
}
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void backward_3x3_avx512(const float* dh, const float* lam,
    const float* mu, const double* g, float* dlam, double* dg, int64_t r0, int64_t r1) {
  backward_3x3_body(dh, lam, mu, g, dlam, dg, r0, r1);
}

// Whether this call takes the 3x3 float loops: PRUNOPT_FB_GENERIC_3X3=1 (read
// per call, as the capability switches) sends the float 3x3 basis to the
// generic rows instead, so that tests and bench/compare_builds.py
// (--ops fb_reconstruct_3x3) can set the two side by side in one build.
template <typename scalar_t>
bool use_3x3(const Dims& d) {
  return std::is_same<scalar_t, float>::value && d.n == 9 && d.k == 9 && use_avx2() &&
         !vec::env_flag("PRUNOPT_FB_GENERIC_3X3");
}
#endif

template <typename scalar_t>
int row_lanes(const fb_rows::Rows* rk) {
  if constexpr (kVectorised<scalar_t>) {
    return rk->get<scalar_t>().lanes;
  } else {
    return 1;
  }
}

// Vectors of `lanes` per row for the vector path (rows of up to 128 bytes),
// or 0 for the scalar loops.
template <typename scalar_t>
int vectors_per_row(const Dims& d, int lanes) {
  if constexpr (!kVectorised<scalar_t>) {
    return 0;
  } else {
    if (std::max(d.n, d.k) * static_cast<int64_t>(sizeof(scalar_t)) > fb_rows::kMaxRowBytes) return 0;
    return static_cast<int>((std::max(d.n, d.k) + lanes - 1) / lanes);
  }
}

// rows x cols of src (double) into rows x (c * V) of the output dtype, zero padded.
template <typename scalar_t>
std::vector<scalar_t> padded(const double* src, int64_t rows, int64_t cols, int64_t width, bool transpose) {
  std::vector<scalar_t> out(rows * width, scalar_t(0));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      out[i * width + j] = static_cast<scalar_t>(transpose ? src[j * rows + i] : src[i * cols + j]);
  return out;
}

// Chunks of rows per task: enough rows to amortise a task (~16k multiply-adds).
inline int64_t grain_rows(const Dims& d) { return std::max<int64_t>(kBlockRows, 16384 / std::max<int64_t>(1, d.n * d.k)); }

template <typename scalar_t>
void reconstruct_rows(const scalar_t* lam, const scalar_t* mu, const double* g, const Dims& d, scalar_t* h) {
  const fb_rows::Rows* rk = rows_kernels();
  const int lanes = row_lanes<scalar_t>(rk);
  const int c = vectors_per_row<scalar_t>(d, lanes);
  if (c == 0) {
    at::parallel_for(0, d.rows, grain_rows(d), [&](int64_t r0, int64_t r1) {
      forward_rows_scalar(lam, mu, g, d, h, r0, r1);
    });
    return;
  }
#ifdef PRUNOPT_X86_DISPATCH
  if constexpr (std::is_same<scalar_t, float>::value) {
    if (use_3x3<scalar_t>(d)) {
      const auto fwd3 = use_avx512() ? &forward_3x3_avx512 : &forward_3x3_avx2;
      at::parallel_for(0, d.rows, grain_rows(d), [&](int64_t r0, int64_t r1) {
        fwd3(lam, mu, g, h, r0, r1);
      });
      return;
    }
  }
#endif
  if constexpr (kVectorised<scalar_t>) {
    const auto gpad = padded<scalar_t>(g, d.n, d.k, c * lanes, false);
    const auto forward = rk->get<scalar_t>().forward;
    at::parallel_for(0, d.rows, grain_rows(d), [&](int64_t r0, int64_t r1) {
      forward(lam, mu, gpad.data(), d, c, h, r0, r1);
    });
  }
}

// dg: n x k doubles (zeroed here). Chunks are fixed by the row count and the
// grain, summed in double in chunk order.
template <typename scalar_t>
void reconstruct_backward_rows(const scalar_t* dh, const scalar_t* lam, const scalar_t* mu, const double* g,
                               const Dims& d, scalar_t* dlam, double* dg) {
  const fb_rows::Rows* rk = rows_kernels();
  const int lanes = row_lanes<scalar_t>(rk);
  const int c = vectors_per_row<scalar_t>(d, lanes);
  const int64_t grain = grain_rows(d);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (d.rows + grain - 1) / grain));
  const int64_t per_chunk = (d.rows + chunks - 1) / chunks;
  std::vector<double> partial(dg ? chunks * d.n * d.k : 0, 0.0);
  const auto gtpad = c ? padded<scalar_t>(g, d.k, d.n, c * lanes, true) : std::vector<scalar_t>();
#ifdef PRUNOPT_X86_DISPATCH
  // the 3x3 float loops' clone for this call, or null (the environment is read here, outside the loops)
  decltype(&backward_3x3_avx2) bwd3 = nullptr;
  if (c != 0 && use_3x3<scalar_t>(d)) bwd3 = use_avx512() ? &backward_3x3_avx512 : &backward_3x3_avx2;
#endif
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t ch = c0; ch < c1; ++ch) {
      const int64_t r0 = ch * per_chunk, r1 = std::min(d.rows, r0 + per_chunk);
      if (r0 >= r1) continue;
      double* dgc = dg ? partial.data() + ch * d.n * d.k : nullptr;
      if (c == 0) {
        backward_rows_scalar(dh, lam, mu, g, d, dlam, dgc, r0, r1);
        continue;
      }
#ifdef PRUNOPT_X86_DISPATCH
      if constexpr (std::is_same<scalar_t, float>::value) {
        if (bwd3 != nullptr) {
          bwd3(dh, lam, mu, g, dlam, dgc, r0, r1);
          continue;
        }
      }
#endif
      if constexpr (kVectorised<scalar_t>) {
        BackwardArgs<scalar_t> a{dh, lam, mu, gtpad.data(), d, dlam, dgc};
        rk->get<scalar_t>().backward(a, c, r0, r1);
      }
    }
  });
  if (dg) {
    std::fill(dg, dg + d.n * d.k, 0.0);
    for (int64_t ch = 0; ch < chunks; ++ch)
      for (int64_t i = 0; i < d.n * d.k; ++i) dg[i] += partial[ch * d.n * d.k + i];
  }
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
  const Dims d{c_out * c_in_g, n, kh * kw};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, coefficients.scalar_type(), "fb_reconstruct", [&] {
    reconstruct_rows<scalar_t>(lam.data_ptr<scalar_t>(), mu.defined() ? mu.data_ptr<scalar_t>() : nullptr,
        g.data_ptr<double>(), d, out.data_ptr<scalar_t>());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fb_reconstruct_backward_cpu(const at::Tensor& grad_h,
    const at::Tensor& coefficients, const at::Tensor& basis, const c10::optional<at::Tensor>& mask,
    std::array<bool, 2> output_mask) {
  const char* op = "fb_reconstruct_backward";
  check_fb_reconstruct_args(coefficients, basis, mask, op);
  check_fb_grad_h(grad_h, coefficients, basis, op);
  const int64_t n = coefficients.size(2), k = basis.size(1) * basis.size(2);
  const Dims d{coefficients.size(0) * coefficients.size(1), n, k};
  auto dlam = output_mask[0] ? at::empty(coefficients.sizes(), coefficients.options()) : at::Tensor();
  auto dg = output_mask[1] ? at::empty({n, k}, coefficients.options().dtype(at::kDouble)) : at::Tensor();
  if (output_mask[1]) dg.zero_();
  if (d.rows > 0 && n > 0 && k > 0 && (output_mask[0] || output_mask[1])) {
    auto dh = grad_h.contiguous();
    auto lam = coefficients.contiguous();
    auto mu = mask.has_value() ? mask->contiguous() : at::Tensor();
    auto g = basis.to(at::kDouble).contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, coefficients.scalar_type(), "fb_reconstruct_backward", [&] {
      reconstruct_backward_rows<scalar_t>(dh.data_ptr<scalar_t>(), lam.data_ptr<scalar_t>(),
          mu.defined() ? mu.data_ptr<scalar_t>() : nullptr, g.data_ptr<double>(), d,
          output_mask[0] ? dlam.data_ptr<scalar_t>() : nullptr, output_mask[1] ? dg.data_ptr<double>() : nullptr);
    });
  } else if (output_mask[0]) {
    dlam.zero_();
  }
  return std::make_tuple(output_mask[0] ? dlam : at::empty({0}, coefficients.options()),
                         output_mask[1] ? dg.to(basis.scalar_type()).reshape(basis.sizes())
                                        : at::empty({0}, basis.options()));
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("fb_reconstruct", &prunopt::cpu::fb_reconstruct_cpu);
  m.impl("fb_reconstruct_backward", &prunopt::cpu::fb_reconstruct_backward_cpu);
}
