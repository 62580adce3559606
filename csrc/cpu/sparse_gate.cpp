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
// All arithmetic and every sum is in double (float inputs are widened on load,
// 4 double lanes of AVX2 when the CPU has them, prunopt/sparsification_simd.h).
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

#include "prunopt/sparsification.h"
#include "prunopt/sparsification_checks.h"
#include "prunopt/sparsification_simd.h"

namespace prunopt {
namespace cpu {
namespace {

namespace sp = prunopt::sparsification;
namespace sd = prunopt::simd;

constexpr int64_t kGrain = 1 << 14;       // elements per task at least
constexpr int64_t kMaxScratch = 1 << 14;  // longest row kept in the scratch (2 x 128 KiB)
constexpr int64_t kSplitMin = 1 << 15;    // shortest row split over threads
constexpr int64_t kSegment = 1 << 13;     // segment of a split row

inline double* offset(double* p, int64_t b) {
  return p == nullptr ? nullptr : p + b;
}

template <typename T>
inline double ld(const T* p, int64_t i) {
  return static_cast<double>(p[i]);
}

// gamma_i: from the scratch when it holds it, else exp(alpha_i)
template <typename T>
inline double gamma_at(const T* a, const double* buf, int64_t i) {
  return buf != nullptr ? buf[i] : std::exp(ld(a, i));
}

struct Sum2 {
  double t = 0, w = 0;
  Sum2& operator+=(const Sum2& o) {
    t += o.t;
    w += o.w;
    return *this;
  }
};

// ---------------------------------------------------------------------------
// Segment primitives, each over [0, n) of one row. `*_scalar(..., i, n)` runs
// from index i (the vector tails and the non-AVX2 path), `*_avx2(..., n)` the
// vector body. buf / qbuf are the optional double scratch rows: without them
// (rows longer than kMaxScratch, split rows) a later pass recomputes the
// per-element quantity in double instead of reading it back, so no
// intermediate is ever rounded to (or overflows) the input dtype.
// ---------------------------------------------------------------------------

// sum |a_i|
template <typename T>
double sum_abs_scalar(const T* a, int64_t i, int64_t n) {
  double s = 0;
  for (; i < n; ++i) s += std::fabs(ld(a, i));
  return s;
}

// out_i = sign(a_i) relu(|a_i| - th)
template <typename T>
void signed_forward_scalar(const T* a, double th, T* out, int64_t i, int64_t n) {
  for (; i < n; ++i) {
    const double x = ld(a, i);
    out[i] = static_cast<T>(sp::sign(x) * sp::relu(std::fabs(x) - th));
  }
}

// sum exp(a_i), gamma_i -> buf
template <typename T>
double sum_exp_scalar(const T* a, double* buf, int64_t i, int64_t n) {
  double s = 0;
  for (; i < n; ++i) {
    const double e = std::exp(ld(a, i));
    if (buf != nullptr) buf[i] = e;
    s += e;
  }
  return s;
}

// gt_i = relu(gamma_i - th) -> buf (if any); returns sum gt
template <typename T>
double nonneg_gt_scalar(const T* a, double* buf, double th, int64_t i, int64_t n) {
  double s = 0;
  for (; i < n; ++i) {
    const double gt = sp::relu(gamma_at(a, buf, i) - th);
    if (buf != nullptr) buf[i] = gt;
    s += gt;
  }
  return s;
}

// out_i = gt_i / Ts, gt from buf (if any) or recomputed in double
template <typename T>
void divide_scalar(const T* a, const double* buf, double th, double Ts, T* out, int64_t i, int64_t n) {
  for (; i < n; ++i) {
    const double gt = buf != nullptr ? buf[i] : sp::relu(std::exp(ld(a, i)) - th);
    out[i] = static_cast<T>(gt / Ts);
  }
}

// t_i = g_i sign(a_i) d(|a_i| - th)
template <typename T>
inline double signed_t_at(const T* g, const T* a, double th, double rgf, int64_t i) {
  const double x = ld(a, i);
  return ld(g, i) * sp::sign(x) * sp::rgf_slope(std::fabs(x) - th, rgf);
}

// t -> buf (if any); returns P = sum t
template <typename T>
double signed_t_scalar(const T* g, const T* a, double th, double rgf, double* buf, int64_t i, int64_t n) {
  double s = 0;
  for (; i < n; ++i) {
    const double t = signed_t_at(g, a, th, rgf, i);
    if (buf != nullptr) buf[i] = t;
    s += t;
  }
  return s;
}

// galpha_i = sign(a_i) (t_i - sP), t from buf (if any) or recomputed in double
template <typename T>
void signed_galpha_scalar(const T* g, const T* a, const double* buf, double th, double rgf, double sP, T* galpha,
    int64_t i, int64_t n) {
  for (; i < n; ++i) {
    const double t = buf != nullptr ? buf[i] : signed_t_at(g, a, th, rgf, i);
    galpha[i] = static_cast<T>(sp::sign(ld(a, i)) * (t - sP));
  }
}

// sum gt_i and sum g_i gt_i, gt_i = relu(gamma_i - th)
template <typename T>
Sum2 nonneg_tw_scalar(const T* g, const T* a, const double* buf, double th, int64_t i, int64_t n) {
  Sum2 s;
  for (; i < n; ++i) {
    const double gt = sp::relu(gamma_at(a, buf, i) - th);
    s.t += gt;
    s.w += ld(g, i) * gt;
  }
  return s;
}

// q_i = (g_i - ga) / Ts d(gamma_i - th)
template <typename T>
inline double nonneg_q_at(const T* g, double gamma, double th, double ga, double inv_ts, double rgf, int64_t i) {
  return (ld(g, i) - ga) * inv_ts * sp::rgf_slope(gamma - th, rgf);
}

// q -> qbuf (if any); returns Q = sum q
template <typename T>
double nonneg_q_scalar(const T* g, const T* a, const double* buf, double th, double ga, double inv_ts, double rgf,
    double* qbuf, int64_t i, int64_t n) {
  double s = 0;
  for (; i < n; ++i) {
    const double q = nonneg_q_at(g, gamma_at(a, buf, i), th, ga, inv_ts, rgf, i);
    if (qbuf != nullptr) qbuf[i] = q;
    s += q;
  }
  return s;
}

// galpha_i = gamma_i (q_i - sQ), q from qbuf (if any) or recomputed in double
template <typename T>
void nonneg_galpha_scalar(const T* g, const T* a, const double* buf, const double* qbuf, double th, double ga,
    double inv_ts, double rgf, double sQ, T* galpha, int64_t i, int64_t n) {
  for (; i < n; ++i) {
    const double gamma = gamma_at(a, buf, i);
    const double q = qbuf != nullptr ? qbuf[i] : nonneg_q_at(g, gamma, th, ga, inv_ts, rgf, i);
    galpha[i] = static_cast<T>(gamma * (q - sQ));
  }
}

#if PRUNOPT_SIMD_AVX2
PRUNOPT_AVX2 inline __m256d vsign(__m256d x) {
  const __m256d zero = _mm256_setzero_pd(), one = _mm256_set1_pd(1.0);
  return _mm256_sub_pd(_mm256_and_pd(sd::vgt(x, zero), one), _mm256_and_pd(sd::vlt(x, zero), one));
}
PRUNOPT_AVX2 inline __m256d vrelu(__m256d x) {
  return _mm256_max_pd(_mm256_setzero_pd(), x);  // NaN stays NaN
}
template <typename T>
PRUNOPT_AVX2 inline __m256d vgamma(const T* a, const double* buf, int64_t i) {
  return buf != nullptr ? _mm256_loadu_pd(buf + i) : sd::vexp(sd::vload4d(a + i));
}

template <typename T>
PRUNOPT_AVX2 double sum_abs_avx2(const T* a, int64_t n) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_add_pd(acc0, sd::vabs(sd::vload4d(a + i)));
    acc1 = _mm256_add_pd(acc1, sd::vabs(sd::vload4d(a + i + 4)));
  }
  for (; i + 4 <= n; i += 4) acc0 = _mm256_add_pd(acc0, sd::vabs(sd::vload4d(a + i)));
  return sd::hsum(_mm256_add_pd(acc0, acc1)) + sum_abs_scalar(a, i, n);
}

template <typename T>
PRUNOPT_AVX2 void signed_forward_avx2(const T* a, double th, T* out, int64_t n) {
  const __m256d vth = _mm256_set1_pd(th);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d x = sd::vload4d(a + i);
    sd::vstore4d(out + i, _mm256_mul_pd(vsign(x), vrelu(_mm256_sub_pd(sd::vabs(x), vth))));
  }
  signed_forward_scalar(a, th, out, i, n);
}

template <typename T>
PRUNOPT_AVX2 double sum_exp_avx2(const T* a, double* buf, int64_t n) {
  __m256d acc = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d e = sd::vexp(sd::vload4d(a + i));
    if (buf != nullptr) _mm256_storeu_pd(buf + i, e);
    acc = _mm256_add_pd(acc, e);
  }
  return sd::hsum(acc) + sum_exp_scalar(a, buf, i, n);
}

template <typename T>
PRUNOPT_AVX2 double nonneg_gt_avx2(const T* a, double* buf, double th, int64_t n) {
  const __m256d vth = _mm256_set1_pd(th);
  __m256d acc = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d gt = vrelu(_mm256_sub_pd(vgamma(a, buf, i), vth));
    if (buf != nullptr) _mm256_storeu_pd(buf + i, gt);
    acc = _mm256_add_pd(acc, gt);
  }
  return sd::hsum(acc) + nonneg_gt_scalar(a, buf, th, i, n);
}

template <typename T>
PRUNOPT_AVX2 void divide_avx2(const T* a, const double* buf, double th, double Ts, T* out, int64_t n) {
  const __m256d vts = _mm256_set1_pd(Ts), vth = _mm256_set1_pd(th);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d gt =
        buf != nullptr ? _mm256_loadu_pd(buf + i) : vrelu(_mm256_sub_pd(sd::vexp(sd::vload4d(a + i)), vth));
    sd::vstore4d(out + i, _mm256_div_pd(gt, vts));
  }
  divide_scalar(a, buf, th, Ts, out, i, n);
}

// t of the 4 elements at a + i, g + i (signed_t_at's operations)
template <typename T>
PRUNOPT_AVX2 inline __m256d vsigned_t(const T* g, const T* a, __m256d vth, __m256d vrgf, bool rgf_zero, int64_t i) {
  const __m256d x = sd::vload4d(a + i);
  const __m256d d = sd::vrgf_slope(_mm256_sub_pd(sd::vabs(x), vth), vrgf, rgf_zero);
  return _mm256_mul_pd(_mm256_mul_pd(sd::vload4d(g + i), vsign(x)), d);
}

template <typename T>
PRUNOPT_AVX2 double signed_t_avx2(const T* g, const T* a, double th, double rgf, double* buf, int64_t n) {
  const __m256d vth = _mm256_set1_pd(th), vrgf = _mm256_set1_pd(rgf);
  const bool rgf_zero = rgf == 0.0;
  __m256d acc = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d t = vsigned_t(g, a, vth, vrgf, rgf_zero, i);
    if (buf != nullptr) _mm256_storeu_pd(buf + i, t);
    acc = _mm256_add_pd(acc, t);
  }
  return sd::hsum(acc) + signed_t_scalar(g, a, th, rgf, buf, i, n);
}

template <typename T>
PRUNOPT_AVX2 void signed_galpha_avx2(const T* g, const T* a, const double* buf, double th, double rgf, double sP,
    T* galpha, int64_t n) {
  const __m256d vsp = _mm256_set1_pd(sP), vth = _mm256_set1_pd(th), vrgf = _mm256_set1_pd(rgf);
  const bool rgf_zero = rgf == 0.0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d t = buf != nullptr ? _mm256_loadu_pd(buf + i) : vsigned_t(g, a, vth, vrgf, rgf_zero, i);
    sd::vstore4d(galpha + i, _mm256_mul_pd(vsign(sd::vload4d(a + i)), _mm256_sub_pd(t, vsp)));
  }
  signed_galpha_scalar(g, a, buf, th, rgf, sP, galpha, i, n);
}

template <typename T>
PRUNOPT_AVX2 Sum2 nonneg_tw_avx2(const T* g, const T* a, const double* buf, double th, int64_t n) {
  const __m256d vth = _mm256_set1_pd(th);
  __m256d acc_t = _mm256_setzero_pd(), acc_w = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d gt = vrelu(_mm256_sub_pd(vgamma(a, buf, i), vth));
    acc_t = _mm256_add_pd(acc_t, gt);
    acc_w = _mm256_fmadd_pd(sd::vload4d(g + i), gt, acc_w);
  }
  Sum2 s = nonneg_tw_scalar(g, a, buf, th, i, n);
  s.t += sd::hsum(acc_t);
  s.w += sd::hsum(acc_w);
  return s;
}

// q of the 4 elements at i (nonneg_q_at's operations)
template <typename T>
PRUNOPT_AVX2 inline __m256d vnonneg_q(const T* g, __m256d gamma, __m256d vth, __m256d vga, __m256d vinv,
    __m256d vrgf, bool rgf_zero, int64_t i) {
  const __m256d d = sd::vrgf_slope(_mm256_sub_pd(gamma, vth), vrgf, rgf_zero);
  return _mm256_mul_pd(_mm256_mul_pd(_mm256_sub_pd(sd::vload4d(g + i), vga), vinv), d);
}

template <typename T>
PRUNOPT_AVX2 double nonneg_q_avx2(const T* g, const T* a, const double* buf, double th, double ga, double inv_ts,
    double rgf, double* qbuf, int64_t n) {
  const __m256d vth = _mm256_set1_pd(th), vga = _mm256_set1_pd(ga), vinv = _mm256_set1_pd(inv_ts),
                vrgf = _mm256_set1_pd(rgf);
  const bool rgf_zero = rgf == 0.0;
  __m256d acc = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d q = vnonneg_q(g, vgamma(a, buf, i), vth, vga, vinv, vrgf, rgf_zero, i);
    if (qbuf != nullptr) _mm256_storeu_pd(qbuf + i, q);
    acc = _mm256_add_pd(acc, q);
  }
  return sd::hsum(acc) + nonneg_q_scalar(g, a, buf, th, ga, inv_ts, rgf, qbuf, i, n);
}

template <typename T>
PRUNOPT_AVX2 void nonneg_galpha_avx2(const T* g, const T* a, const double* buf, const double* qbuf, double th,
    double ga, double inv_ts, double rgf, double sQ, T* galpha, int64_t n) {
  const __m256d vsq = _mm256_set1_pd(sQ), vth = _mm256_set1_pd(th), vga = _mm256_set1_pd(ga),
                vinv = _mm256_set1_pd(inv_ts), vrgf = _mm256_set1_pd(rgf);
  const bool rgf_zero = rgf == 0.0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d gamma = vgamma(a, buf, i);
    const __m256d q = qbuf != nullptr ? _mm256_loadu_pd(qbuf + i) : vnonneg_q(g, gamma, vth, vga, vinv, vrgf, rgf_zero, i);
    sd::vstore4d(galpha + i, _mm256_mul_pd(gamma, _mm256_sub_pd(q, vsq)));
  }
  nonneg_galpha_scalar(g, a, buf, qbuf, th, ga, inv_ts, rgf, sQ, galpha, i, n);
}

// AVX2 body for float/double when the CPU has it, else the scalar form from 0
#define PRUNOPT_GATE_PRIMITIVE(fn, ...)                                 \
  do {                                                                  \
    if constexpr (sd::has_vec<T>) {                                     \
      if (sd::avx2_enabled()) return fn##_avx2(__VA_ARGS__, n);         \
    }                                                                   \
    return fn##_scalar(__VA_ARGS__, 0, n);                              \
  } while (0)
#else
#define PRUNOPT_GATE_PRIMITIVE(fn, ...) return fn##_scalar(__VA_ARGS__, 0, n)
#endif

template <typename T>
double sum_abs(const T* a, int64_t n) {
  PRUNOPT_GATE_PRIMITIVE(sum_abs, a);
}
template <typename T>
void signed_forward(const T* a, double th, T* out, int64_t n) {
  PRUNOPT_GATE_PRIMITIVE(signed_forward, a, th, out);
}
template <typename T>
double sum_exp(const T* a, double* buf, int64_t n) {
  PRUNOPT_GATE_PRIMITIVE(sum_exp, a, buf);
}
template <typename T>
double nonneg_gt(const T* a, double* buf, double th, int64_t n) {
  PRUNOPT_GATE_PRIMITIVE(nonneg_gt, a, buf, th);
}
template <typename T>
void divide(const T* a, const double* buf, double th, double Ts, T* out, int64_t n) {
  PRUNOPT_GATE_PRIMITIVE(divide, a, buf, th, Ts, out);
}
template <typename T>
double signed_t(const T* g, const T* a, double th, double rgf, double* buf, int64_t n) {
  PRUNOPT_GATE_PRIMITIVE(signed_t, g, a, th, rgf, buf);
}
template <typename T>
void signed_galpha(const T* g, const T* a, const double* buf, double th, double rgf, double sP, T* galpha, int64_t n) {
  PRUNOPT_GATE_PRIMITIVE(signed_galpha, g, a, buf, th, rgf, sP, galpha);
}
template <typename T>
Sum2 nonneg_tw(const T* g, const T* a, const double* buf, double th, int64_t n) {
  PRUNOPT_GATE_PRIMITIVE(nonneg_tw, g, a, buf, th);
}
template <typename T>
double nonneg_q(const T* g, const T* a, const double* buf, double th, double ga, double inv_ts, double rgf,
    double* qbuf, int64_t n) {
  PRUNOPT_GATE_PRIMITIVE(nonneg_q, g, a, buf, th, ga, inv_ts, rgf, qbuf);
}
template <typename T>
void nonneg_galpha(const T* g, const T* a, const double* buf, const double* qbuf, double th, double ga, double inv_ts,
    double rgf, double sQ, T* galpha, int64_t n) {
  PRUNOPT_GATE_PRIMITIVE(nonneg_galpha, g, a, buf, qbuf, th, ga, inv_ts, rgf, sQ, galpha);
}
#undef PRUNOPT_GATE_PRIMITIVE

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
void gate_forward(const Run& run, const T* alpha, const T* beta, int64_t n, bool is_signed, T* out, double* buf) {
  auto s = [&](int64_t r) { return sp::sigmoid(static_cast<double>(beta[r])); };
  if (is_signed) {
    const auto L = run.template reduce<double>(
        [&](int64_t r, int64_t b, int64_t e) { return sum_abs(alpha + r * n + b, e - b); });
    run.each([&](int64_t r, int64_t b, int64_t e) {
      signed_forward(alpha + r * n + b, s(r) * L[r], out + r * n + b, e - b);
    });
    return;
  }
  const auto G = run.template reduce<double>(
      [&](int64_t r, int64_t b, int64_t e) { return sum_exp(alpha + r * n + b, offset(buf, b), e - b); });
  const auto T_sum = run.template reduce<double>([&](int64_t r, int64_t b, int64_t e) {
    return nonneg_gt(alpha + r * n + b, offset(buf, b), s(r) * G[r], e - b);
  });
  run.each([&](int64_t r, int64_t b, int64_t e) {
    divide(alpha + r * n + b, offset(buf, b), s(r) * G[r], T_sum[r] > 0 ? T_sum[r] : 1.0, out + r * n + b, e - b);
  });
}

// The gradients of the rows `run` covers: dalpha into galpha, dbeta into gbeta.
// buf, qbuf: double scratch rows for WholeRow (or nullptr), nullptr for Tiles.
template <typename T, typename Run>
void gate_backward(const Run& run, const T* grad, const T* alpha, const T* beta, int64_t n, bool is_signed,
    double rgf, T* galpha, T* gbeta, double* buf, double* qbuf) {
  auto s = [&](int64_t r) { return sp::sigmoid(static_cast<double>(beta[r])); };
  auto ds = [&](int64_t r) { return sp::sigmoid_slope(static_cast<double>(beta[r])); };
  if (is_signed) {
    const auto L = run.template reduce<double>(
        [&](int64_t r, int64_t b, int64_t e) { return sum_abs(alpha + r * n + b, e - b); });
    const auto P = run.template reduce<double>([&](int64_t r, int64_t b, int64_t e) {
      const int64_t o = r * n + b;
      return signed_t(grad + o, alpha + o, s(r) * L[r], rgf, offset(buf, b), e - b);
    });
    run.each([&](int64_t r, int64_t b, int64_t e) {
      const int64_t o = r * n + b;
      signed_galpha(grad + o, alpha + o, offset(buf, b), s(r) * L[r], rgf, s(r) * P[r], galpha + o, e - b);
    });
    run.rows([&](int64_t r) { gbeta[r] = static_cast<T>(-ds(r) * L[r] * P[r]); });
    return;
  }
  const auto G = run.template reduce<double>(
      [&](int64_t r, int64_t b, int64_t e) { return sum_exp(alpha + r * n + b, offset(buf, b), e - b); });
  const auto TW = run.template reduce<Sum2>([&](int64_t r, int64_t b, int64_t e) {
    return nonneg_tw(grad + r * n + b, alpha + r * n + b, offset(buf, b), s(r) * G[r], e - b);
  });
  auto Ts = [&](int64_t r) { return TW[r].t > 0 ? TW[r].t : 1.0; };
  const auto Q = run.template reduce<double>([&](int64_t r, int64_t b, int64_t e) {
    const int64_t o = r * n + b;
    const double ts = Ts(r);
    return nonneg_q(grad + o, alpha + o, offset(buf, b), s(r) * G[r], TW[r].w / ts, 1.0 / ts, rgf, offset(qbuf, b),
        e - b);
  });
  run.each([&](int64_t r, int64_t b, int64_t e) {
    const int64_t o = r * n + b;
    const double ts = Ts(r);
    nonneg_galpha(grad + o, alpha + o, offset(buf, b), offset(qbuf, b), s(r) * G[r], TW[r].w / ts, 1.0 / ts, rgf,
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "sparse_gate", [&] {
    const scalar_t* ap = alpha.const_data_ptr<scalar_t>();
    const scalar_t* bp = beta.const_data_ptr<scalar_t>();
    scalar_t* op = a.mutable_data_ptr<scalar_t>();
    if (split_rows(groups, n)) {
      gate_forward(Tiles{groups, n}, ap, bp, n, is_signed, op, nullptr);
      return;
    }
    at::parallel_for(0, groups, row_grain(n), [&](int64_t b, int64_t e) {
      std::unique_ptr<double[]> buf;
      if (!is_signed) buf = scratch(n, 1);
      for (int64_t r = b; r < e; ++r) gate_forward(WholeRow{r, n}, ap, bp, n, is_signed, op, buf.get());
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
    if (split_rows(groups, n)) {
      gate_backward(Tiles{groups, n}, gp, ap, bp, n, is_signed, rgf_alpha, gap, gbp, nullptr, nullptr);
      return;
    }
    at::parallel_for(0, groups, row_grain(n), [&](int64_t b, int64_t e) {
      // signed: t; non-negative: gamma and q
      const auto buf = scratch(n, is_signed ? 1 : 2);
      double* qbuf = buf != nullptr && !is_signed ? buf.get() + n : nullptr;
      for (int64_t r = b; r < e; ++r) {
        gate_backward(WholeRow{r, n}, gp, ap, bp, n, is_signed, rgf_alpha, gap, gbp, buf.get(), qbuf);
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
