// Sparse gates of differentiable sparsification on the CPU (DS eq. 9-12, 15;
// Lee). alpha is (groups, n), beta is (groups,); every row is one
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
//   signed:       t_i = g_i sign(alpha_i) d(z_i),  P = sum t
//                 dalpha_k = sign(alpha_k) (t_k - s P)  (= g_k d(z_k) sign^2 - s sign P),
//                 dbeta = -s' L P
//   non-negative: h_j = (g_j - <g, a>) / T  (T := 1 when T = 0), q_j = h_j d(u_j),
//                 Q = sum q, dalpha_k = gamma_k (q_k - s Q),  dbeta = -s' G Q
//
// All arithmetic and every sum is in double (float inputs are widened on load;
// float/double rows run ATen's Vectorized per CPU capability, 4 double lanes
// with AVX2 and 8 with AVX-512: gates_kernels.inc, prunopt/gates_kernels.h).
// Each group is a few passes over its row: one reduction per sum, then the
// elementwise output. Two layouts:
//   * many groups: rows are split over threads; the per-element quantities a
//     later pass needs (gamma, t, q) are kept in a per-thread double scratch row
//     (rows up to kMaxScratch), so each exp is evaluated once;
//   * few long groups (fewer than 2 per thread, n >= kSplitMin): every row is
//     cut into fixed tiles and each pass is one parallel region over all tiles;
//     the partial sums are combined per row in tile order (deterministic for any
//     thread count) and gamma, gt, t and q are recomputed in double where a
//     later pass needs them instead of stored (no n-sized temporary; rows
//     longer than kMaxScratch do the same). They were once parked in the
//     output tensor, in its dtype: exp(alpha) overflowed float32 from alpha ~
//     88.7 (float16 from ~11) and float16 lost ~1e-2 of the gradient. Few regions matter: on a loaded machine every region can cost
//     a scheduler time slice.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <vector>

#include "prunopt/gates_kernels.h"
#include "prunopt/sparsification.h"
#include "prunopt/sparsification_checks.h"

namespace prunopt {
namespace cpu {
namespace {

namespace sp = prunopt::sparsification;
namespace g = prunopt::gates;

constexpr int64_t kGrain = 1 << 14;       // elements per task at least
constexpr int64_t kMaxScratch = 1 << 14;  // longest row kept in the scratch (2 x 128 KiB)
constexpr int64_t kSplitMin = 1 << 15;    // shortest row split over threads
constexpr int64_t kSegment = 1 << 13;     // segment of a split row

inline double* offset(double* p, int64_t b) {
  return p == nullptr ? nullptr : p + b;
}

// The segment primitives of one op call (prunopt/gates_kernels.h): the vector
// kernels of the CPU's capability for float/double (the table chosen once per
// call), else the scalar forms from index 0.
template <typename T>
struct Prims {
  const g::GateKernelsT<T>* v = nullptr;

  explicit Prims(const g::GateKernels* k) {
    if constexpr (g::has_vec<T>) {
      if (k != nullptr) v = &k->get<T>();
    }
  }
  double sum_abs(const T* a, int64_t n) const {
    return v ? v->sum_abs(a, n) : g::sum_abs_scalar(a, 0, n);
  }
  void signed_forward(const T* a, double th, T* out, int64_t n) const {
    v ? v->signed_forward(a, th, out, n) : g::signed_forward_scalar(a, th, out, 0, n);
  }
  double sum_exp(const T* a, double* buf, int64_t n) const {
    return v ? v->sum_exp(a, buf, n) : g::sum_exp_scalar(a, buf, 0, n);
  }
  double nonneg_gt(const T* a, double* buf, double th, int64_t n) const {
    return v ? v->nonneg_gt(a, buf, th, n) : g::nonneg_gt_scalar(a, buf, th, 0, n);
  }
  void divide(const T* a, const double* buf, double th, double Ts, T* out, int64_t n) const {
    v ? v->divide(a, buf, th, Ts, out, n) : g::divide_scalar(a, buf, th, Ts, out, 0, n);
  }
  double signed_t(const T* gr, const T* a, double th, double rgf, double* buf, int64_t n) const {
    return v ? v->signed_t(gr, a, th, rgf, buf, n) : g::signed_t_scalar(gr, a, th, rgf, buf, 0, n);
  }
  void signed_galpha(const T* gr, const T* a, const double* buf, double th, double rgf, double sP, T* galpha,
      int64_t n) const {
    v ? v->signed_galpha(gr, a, buf, th, rgf, sP, galpha, n)
      : g::signed_galpha_scalar(gr, a, buf, th, rgf, sP, galpha, 0, n);
  }
  g::Sum2 nonneg_tw(const T* gr, const T* a, const double* buf, double th, int64_t n) const {
    return v ? v->nonneg_tw(gr, a, buf, th, n) : g::nonneg_tw_scalar(gr, a, buf, th, 0, n);
  }
  double nonneg_q(const T* gr, const T* a, const double* buf, double th, double ga, double inv_ts, double rgf,
      double* qbuf, int64_t n) const {
    return v ? v->nonneg_q(gr, a, buf, th, ga, inv_ts, rgf, qbuf, n)
             : g::nonneg_q_scalar(gr, a, buf, th, ga, inv_ts, rgf, qbuf, 0, n);
  }
  void nonneg_galpha(const T* gr, const T* a, const double* buf, const double* qbuf, double th, double ga,
      double inv_ts, double rgf, double sQ, T* galpha, int64_t n) const {
    v ? v->nonneg_galpha(gr, a, buf, qbuf, th, ga, inv_ts, rgf, sQ, galpha, n)
      : g::nonneg_galpha_scalar(gr, a, buf, qbuf, th, ga, inv_ts, rgf, sQ, galpha, 0, n);
  }
};

// ---------------------------------------------------------------------------
// How the passes run. A pass is a reduction (per-row sums of f(r, b, e) over
// segments [b, e) of row r) or an elementwise sweep.
//   WholeRow: one row on the calling thread (the caller splits rows over threads)
//   Tiles:    every row cut into kSegment tiles; one parallel region per pass
//             over all tiles, partial sums combined per row in tile order
//             (deterministic for any thread count)
// ---------------------------------------------------------------------------
template <typename R>
struct One {
  R v;
  const R& operator[](int64_t) const {
    return v;
  }
};

struct WholeRow {
  int64_t r, n;
  template <typename R, typename F>
  One<R> reduce(F f) const {
    return {f(r, int64_t{0}, n)};
  }
  template <typename F>
  void each(F f) const {
    f(r, int64_t{0}, n);
  }
  template <typename F>
  void rows(F f) const {
    f(r);
  }
};

struct Tiles {
  int64_t groups, n;
  int64_t per_row() const {
    return (n + kSegment - 1) / kSegment;
  }
  template <typename F>
  void tiles(F f) const {
    const int64_t S = per_row();
    at::parallel_for(0, groups * S, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; ++k) {
        const int64_t b = (k % S) * kSegment;
        f(k, k / S, b, std::min(n, b + kSegment));
      }
    });
  }
  template <typename R, typename F>
  std::vector<R> reduce(F f) const {
    const int64_t S = per_row();
    std::vector<R> part(groups * S);
    tiles([&](int64_t k, int64_t r, int64_t b, int64_t e) { part[k] = f(r, b, e); });
    std::vector<R> total(groups);
    for (int64_t r = 0; r < groups; ++r) {
      for (int64_t k = 0; k < S; ++k) total[r] += part[r * S + k];
    }
    return total;
  }
  template <typename F>
  void each(F f) const {
    tiles([&](int64_t, int64_t r, int64_t b, int64_t e) { f(r, b, e); });
  }
  template <typename F>
  void rows(F f) const {
    for (int64_t r = 0; r < groups; ++r) f(r);
  }
};

// The gates of the rows `run` covers. buf: double scratch of n entries for
// WholeRow (or nullptr), always nullptr for Tiles.
template <typename T, typename Run>
void gate_forward(const Run& run, const Prims<T>& pr, const T* alpha, const T* beta, int64_t n, bool is_signed, T* out, double* buf) {
  auto s = [&](int64_t r) { return sp::sigmoid(static_cast<double>(beta[r])); };
  if (is_signed) {
    const auto L = run.template reduce<double>(
        [&](int64_t r, int64_t b, int64_t e) { return pr.sum_abs(alpha + r * n + b, e - b); });
    run.each([&](int64_t r, int64_t b, int64_t e) {
      pr.signed_forward(alpha + r * n + b, s(r) * L[r], out + r * n + b, e - b);
    });
    return;
  }
  const auto G = run.template reduce<double>(
      [&](int64_t r, int64_t b, int64_t e) { return pr.sum_exp(alpha + r * n + b, offset(buf, b), e - b); });
  const auto T_sum = run.template reduce<double>([&](int64_t r, int64_t b, int64_t e) {
    return pr.nonneg_gt(alpha + r * n + b, offset(buf, b), s(r) * G[r], e - b);
  });
  run.each([&](int64_t r, int64_t b, int64_t e) {
    pr.divide(alpha + r * n + b, offset(buf, b), s(r) * G[r], T_sum[r] > 0 ? T_sum[r] : 1.0, out + r * n + b, e - b);
  });
}

// The gradients of the rows `run` covers: dalpha into galpha, dbeta into gbeta.
// buf, qbuf: double scratch rows for WholeRow (or nullptr), nullptr for Tiles.
template <typename T, typename Run>
void gate_backward(const Run& run, const Prims<T>& pr, const T* grad, const T* alpha, const T* beta, int64_t n, bool is_signed,
    double rgf, T* galpha, T* gbeta, double* buf, double* qbuf) {
  auto s = [&](int64_t r) { return sp::sigmoid(static_cast<double>(beta[r])); };
  auto ds = [&](int64_t r) { return sp::sigmoid_slope(static_cast<double>(beta[r])); };
  if (is_signed) {
    const auto L = run.template reduce<double>(
        [&](int64_t r, int64_t b, int64_t e) { return pr.sum_abs(alpha + r * n + b, e - b); });
    const auto P = run.template reduce<double>([&](int64_t r, int64_t b, int64_t e) {
      const int64_t o = r * n + b;
      return pr.signed_t(grad + o, alpha + o, s(r) * L[r], rgf, offset(buf, b), e - b);
    });
    run.each([&](int64_t r, int64_t b, int64_t e) {
      const int64_t o = r * n + b;
      pr.signed_galpha(grad + o, alpha + o, offset(buf, b), s(r) * L[r], rgf, s(r) * P[r], galpha + o, e - b);
    });
    run.rows([&](int64_t r) { gbeta[r] = static_cast<T>(-ds(r) * L[r] * P[r]); });
    return;
  }
  const auto G = run.template reduce<double>(
      [&](int64_t r, int64_t b, int64_t e) { return pr.sum_exp(alpha + r * n + b, offset(buf, b), e - b); });
  const auto TW = run.template reduce<g::Sum2>([&](int64_t r, int64_t b, int64_t e) {
    return pr.nonneg_tw(grad + r * n + b, alpha + r * n + b, offset(buf, b), s(r) * G[r], e - b);
  });
  auto Ts = [&](int64_t r) { return TW[r].t > 0 ? TW[r].t : 1.0; };
  const auto Q = run.template reduce<double>([&](int64_t r, int64_t b, int64_t e) {
    const int64_t o = r * n + b;
    const double ts = Ts(r);
    return pr.nonneg_q(grad + o, alpha + o, offset(buf, b), s(r) * G[r], TW[r].w / ts, 1.0 / ts, rgf, offset(qbuf, b),
        e - b);
  });
  run.each([&](int64_t r, int64_t b, int64_t e) {
    const int64_t o = r * n + b;
    const double ts = Ts(r);
    pr.nonneg_galpha(grad + o, alpha + o, offset(buf, b), offset(qbuf, b), s(r) * G[r], TW[r].w / ts, 1.0 / ts, rgf,
        s(r) * Q[r], galpha + o, e - b);
  });
  run.rows([&](int64_t r) { gbeta[r] = static_cast<T>(-ds(r) * G[r] * Q[r]); });
}

bool split_rows(int64_t groups, int64_t n) {
  const int64_t threads = at::get_num_threads();
  return threads > 1 && groups < 2 * threads && n >= kSplitMin;
}

int64_t row_grain(int64_t n) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1));
}

// `rows` double scratch rows of n entries for a task, or none when n is too long
std::unique_ptr<double[]> scratch(int64_t n, int rows) {
  // not value-initialised: every entry is written before it is read
  return std::unique_ptr<double[]>(n <= kMaxScratch ? new double[static_cast<size_t>(n * rows)] : nullptr);
}

at::Tensor sparse_gate_cpu(const at::Tensor& alpha_in, const at::Tensor& beta_in, bool is_signed, double rgf_alpha) {
  check_gate_args(alpha_in, beta_in, rgf_alpha, "sparse_gate");
  const at::Tensor alpha = alpha_in.contiguous();
  const at::Tensor beta = beta_in.contiguous();
  at::Tensor a = at::empty_like(alpha, at::MemoryFormat::Contiguous);
  const int64_t groups = alpha.size(0), n = alpha.size(1);
  if (alpha.numel() == 0) return a;
  const g::GateKernels* k = g::gate_kernels();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "sparse_gate", [&] {
    const scalar_t* ap = alpha.const_data_ptr<scalar_t>();
    const scalar_t* bp = beta.const_data_ptr<scalar_t>();
    scalar_t* op = a.mutable_data_ptr<scalar_t>();
    const Prims<scalar_t> pr(k);
    if (split_rows(groups, n)) {
      gate_forward(Tiles{groups, n}, pr, ap, bp, n, is_signed, op, nullptr);
      return;
    }
    at::parallel_for(0, groups, row_grain(n), [&](int64_t b, int64_t e) {
      std::unique_ptr<double[]> buf;
      if (!is_signed) buf = scratch(n, 1);
      for (int64_t r = b; r < e; ++r) gate_forward(WholeRow{r, n}, pr, ap, bp, n, is_signed, op, buf.get());
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
  const g::GateKernels* k = g::gate_kernels();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "sparse_gate_backward", [&] {
    const scalar_t* ap = alpha.const_data_ptr<scalar_t>();
    const scalar_t* bp = beta.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* gap = galpha.mutable_data_ptr<scalar_t>();
    scalar_t* gbp = gbeta.mutable_data_ptr<scalar_t>();
    const Prims<scalar_t> pr(k);
    if (split_rows(groups, n)) {
      gate_backward(Tiles{groups, n}, pr, gp, ap, bp, n, is_signed, rgf_alpha, gap, gbp, nullptr, nullptr);
      return;
    }
    at::parallel_for(0, groups, row_grain(n), [&](int64_t b, int64_t e) {
      // signed: t; non-negative: gamma and q
      const auto buf = scratch(n, is_signed ? 1 : 2);
      double* qbuf = buf != nullptr && !is_signed ? buf.get() + n : nullptr;
      for (int64_t r = b; r < e; ++r) {
        gate_backward(WholeRow{r, n}, pr, gp, ap, bp, n, is_signed, rgf_alpha, gap, gbp, buf.get(), qbuf);
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
