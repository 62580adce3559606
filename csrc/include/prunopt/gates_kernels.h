// CPU kernels of the sparsification gates (rgf_relu, two_temperature_sigmoid,
// sparse_gate): the generic part.
//
// float and double run ATen's at::vec::Vectorized, compiled per CPU capability
// (csrc/cpu/gates_kernels.inc, compiled by gates_avx2.cpp and gates_avx512.cpp;
// see prunopt/vec_capability.h) and reached through a GateKernels table chosen
// once per op call. Everything else -- the DEFAULT capability (CPUs without
// AVX2, ATEN_CPU_CAPABILITY=default, PRUNOPT_NO_SIMD=1), half/bfloat16, and the
// last < one vector of elements of a range -- takes the scalar math of
// prunopt/sparsification.h below (libm exp). The scalar forms are also the
// vector kernels' tails, so every element of a range but the tail is computed
// by the same vector operations on AVX2 and AVX-512.
//
// Vector exp (gates_kernels.inc): Cody-Waite range reduction x = n ln2 + r,
// |r| <= ln2/2, then a polynomial (float: Cephes' degree-6 minimax, ~1 ulp;
// double: Taylor to r^13, truncation < 5e-18, ~1 ulp) and 2^n applied as two
// power-of-two factors so that the range up to overflow (inf) is covered.
// Results below e^-80 (float) / e^-700 (double) are flushed to 0, so that
// neither exp nor the products formed with it go denormal (a microcode assist
// per lane); NaN propagates.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "prunopt/sparsification.h"
#include "prunopt/vec_capability.h"

namespace prunopt {
namespace gates {

namespace sp = prunopt::sparsification;

template <typename T>
constexpr bool has_vec = std::is_same_v<T, float> || std::is_same_v<T, double>;

struct Sum2 {
  double t = 0, w = 0;
  Sum2& operator+=(const Sum2& o) {
    t += o.t;
    w += o.w;
    return *this;
  }
};

// One capability's kernels for one dtype. Elementwise maps over [0, n); the
// sparse_gate segment primitives over [0, n) of one row (see sparse_gate.cpp),
// all arithmetic and every sum in double. buf / qbuf are optional double
// scratch rows (nullptr: the quantity is recomputed in double where needed).
template <typename T>
struct GateKernelsT {
  void (*relu)(const T* x, T* y, int64_t n);
  void (*rgf_backward)(const T* g, const T* x, T* y, int64_t n, double alpha);
  void (*sigmoid)(const T* w, T* y, int64_t n, double t_l);
  void (*sigmoid_backward)(const T* g, const T* w, T* y, int64_t n, double t_s);
  double (*sum_abs)(const T* a, int64_t n);
  void (*signed_forward)(const T* a, double th, T* out, int64_t n);
  double (*sum_exp)(const T* a, double* buf, int64_t n);
  double (*nonneg_gt)(const T* a, double* buf, double th, int64_t n);
  void (*divide)(const T* a, const double* buf, double th, double Ts, T* out, int64_t n);
  double (*signed_t)(const T* g, const T* a, double th, double rgf, double* buf, int64_t n);
  void (*signed_galpha)(const T* g, const T* a, const double* buf, double th, double rgf, double sP, T* galpha,
      int64_t n);
  Sum2 (*nonneg_tw)(const T* g, const T* a, const double* buf, double th, int64_t n);
  double (*nonneg_q)(const T* g, const T* a, const double* buf, double th, double ga, double inv_ts, double rgf,
      double* qbuf, int64_t n);
  void (*nonneg_galpha)(const T* g, const T* a, const double* buf, const double* qbuf, double th, double ga,
      double inv_ts, double rgf, double sQ, T* galpha, int64_t n);
};

struct GateKernels {
  GateKernelsT<float> f;
  GateKernelsT<double> d;
  template <typename T>
  const GateKernelsT<T>& get() const {
    if constexpr (std::is_same_v<T, float>) {
      return f;
    } else {
      return d;
    }
  }
};

// The clones (defined in gates_avx2.cpp / gates_avx512.cpp).
namespace AVX2 {
const GateKernels* gate_kernels();
}
namespace AVX512 {
const GateKernels* gate_kernels();
}

// The kernels of the capability the CPU runs now, at most `widest`, or nullptr
// for the scalar path (reads the environment: call once per op, outside the
// loops). A kernel that is measured slower in its AVX-512 clone caps it at AVX2.
inline const GateKernels* gate_kernels(vec::Capability widest = vec::Capability::kAvx512) {
#if PRUNOPT_VEC_X86
  const vec::Capability cap = vec::cpu_capability();
  switch (static_cast<int>(cap) < static_cast<int>(widest) ? cap : widest) {
    case vec::Capability::kAvx512:
      return AVX512::gate_kernels();
    case vec::Capability::kAvx2:
      return AVX2::gate_kernels();
    default:
      return nullptr;
  }
#else
  (void)widest;
  return nullptr;
#endif
}

// ---------------------------------------------------------------------------
// Scalar elementwise ops (the scalar path in opmath, and the vector kernels' tails)
// ---------------------------------------------------------------------------

// relu forward (NaN stays NaN)
struct ReluOp {
  template <typename U>
  U operator()(U x) const {
    return sp::relu(x);
  }
};

// grad * slope(x): slope = 1 (x > 0), alpha exp(x) (x <= 0)
struct RgfBackwardOp {
  double alpha;
  template <typename U>
  U operator()(U g, U x) const {
    return g * sp::rgf_slope(x, static_cast<U>(alpha));
  }
};

// v = 1 / (1 + exp(-t_l w)): exact 0 / 1 at -inf / +inf, NaN stays NaN
struct SigmoidOp {
  double t_l;
  template <typename U>
  U operator()(U w) const {
    return sp::sigmoid(static_cast<U>(t_l) * w);
  }
};

// grad * (t_s e / (1 + e)^2) with e = exp(-|t_s w|) (sigmoid_slope, AP eq. 7);
// the slope is scaled before grad multiplies it (grad * t_s first overflowed
// to inf for a large t_s, and inf * a zero slope is NaN)
struct SigmoidSlopeOp {
  double t_s;
  template <typename U>
  U operator()(U g, U w) const {
    const U ts = static_cast<U>(t_s);
    return g * (ts * sp::sigmoid_slope(ts * w));
  }
};

// ---------------------------------------------------------------------------
// Scalar segment primitives of sparse_gate, each over [i, n) of one row: the
// whole path of the DEFAULT capability and half/bfloat16, and the tails of the
// vector kernels. Without buf / qbuf (rows longer than the scratch, split rows)
// a later pass recomputes the per-element quantity in double instead of reading
// it back, so no intermediate is ever rounded to (or overflows) the input dtype.
// ---------------------------------------------------------------------------

template <typename T>
inline double ld(const T* p, int64_t i) {
  return static_cast<double>(p[i]);
}

// gamma_i: from the scratch when it holds it, else exp(alpha_i)
template <typename T>
inline double gamma_at(const T* a, const double* buf, int64_t i) {
  return buf != nullptr ? buf[i] : std::exp(ld(a, i));
}

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

// ---------------------------------------------------------------------------
// Elementwise maps at tensor level (the CPU twins of cuda::map_unary/map_binary).
// Op provides `template <class U> U operator()(U...) const`, the scalar math in
// opmath; vfn(kernels, in..., out, n) runs the vector kernel of one range.
// ---------------------------------------------------------------------------

// y = op(x) into a new contiguous tensor (half/bfloat16/float/double; x is
// validated by the caller), parallel over chunks of at least `grain`; the
// vector kernels of at most the capability `widest` (see gate_kernels).
template <typename Op, typename VecFn>
at::Tensor map_unary(const at::Tensor& x_in, int64_t grain, const Op& op, const VecFn& vfn,
    vec::Capability widest = vec::Capability::kAvx512) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const GateKernels* k = gate_kernels(widest);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "prunopt_map_unary", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), grain, [&](int64_t b, int64_t e) {
      if constexpr (has_vec<scalar_t>) {
        if (k != nullptr) {
          vfn(k->get<scalar_t>(), xp + b, yp + b, e - b);
          return;
        }
      }
      using opmath_t = at::opmath_type<scalar_t>;
      for (int64_t i = b; i < e; ++i) yp[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(xp[i])));
    });
  });
  return y;
}

// y = op(a, b) into a new contiguous tensor; a and b have the same shape and dtype.
template <typename Op, typename VecFn>
at::Tensor map_binary(const at::Tensor& a_in, const at::Tensor& b_in, int64_t grain, const Op& op, const VecFn& vfn) {
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = b_in.contiguous();
  at::Tensor y = at::empty_like(b, at::MemoryFormat::Contiguous);
  const GateKernels* k = gate_kernels();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.scalar_type(), "prunopt_map_binary", [&] {
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, b.numel(), grain, [&](int64_t lo, int64_t hi) {
      if constexpr (has_vec<scalar_t>) {
        if (k != nullptr) {
          vfn(k->get<scalar_t>(), ap + lo, bp + lo, yp + lo, hi - lo);
          return;
        }
      }
      using opmath_t = at::opmath_type<scalar_t>;
      for (int64_t i = lo; i < hi; ++i) {
        yp[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(ap[i]), static_cast<opmath_t>(bp[i])));
      }
    });
  });
  return y;
}

}  // namespace gates
}  // namespace prunopt
