// Torch-free math of prunAdag (Porcelli et al.; Algorithm 2.1), shared by the
// CPU and CUDA kernels.
//
// One selection scope: tau = the T-th largest |g| over its pruned elements,
// found by radix select on the bit patterns of |g| (for finite non-negative
// IEEE floats the unsigned bit pattern is monotone in the value), then the
// ratio r = ||g||_R / ||x||_M (Table 1), then one element pass (update_one).
#pragma once

#include <cstdint>
#include <cmath>
#include <cstring>

#include "prunopt/macros.h"

namespace prunopt {
namespace prunadag {

// Columns of the per-tensor `hyper` tensor (float64, ntensors x kHyperCols).
enum HyperCol { kLrK = 0, kLrK1 = 1, kWeightDecay = 2, kEps = 3, kMaximize = 4, kPrune = 5, kHyperCols = 6 };

// Unsigned key type and width of the magnitude bits of a float type.
template <typename T>
struct KeyOf;
template <>
struct KeyOf<float> {
  using type = uint32_t;
  static constexpr int kBits = 31;                 // bit 31 is the sign
  static constexpr uint32_t kInf = 0x7f800000u;    // keys >= kInf are inf/nan
};
template <>
struct KeyOf<double> {
  using type = uint64_t;
  static constexpr int kBits = 63;
  static constexpr uint64_t kInf = 0x7ff0000000000000ull;
};

// |v| as its monotone unsigned key (sign bit cleared).
template <typename T>
PRUNOPT_HD typename KeyOf<T>::type magnitude_key(T v) {
  typename KeyOf<T>::type k;
  memcpy(&k, &v, sizeof(T));
  return k & ((typename KeyOf<T>::type(1) << KeyOf<T>::kBits) - 1);
}

template <typename T>
PRUNOPT_HD T value_of_key(typename KeyOf<T>::type k) {
  T v;
  memcpy(&v, &k, sizeof(T));
  return v;
}

// Step 1, in the order of torch.optim.Adagrad: g <- -g if maximize (sgn = -1),
// then g <- g + weight_decay * x (so weight decay shrinks x under maximize too).
template <typename T>
PRUNOPT_HD T effective_grad(T x, T g, T wd, T sgn) {
  return g * sgn + wd * x;
}

// Width (bits) of radix digit `pass` (16, then the rest in 16-bit steps).
PRUNOPT_HD int digit_bits(int bits_left) {
  return bits_left < 16 ? bits_left : 16;
}

// Steps 2-8 for one element. tau_eff is tau for pruned tensors and -1 for
// tensors that always take the Adagrad step. nlr = -lr_k, lr = lr_k,
// a_scale = lr_k / (k+1) * (r or 1). version 0 = relevant_only (O = R).
// Every operation is in T: on the host an unqualified sqrt(float) is the C
// library's sqrt(double), so its result is cast back before the addition and
// the division (a correctly rounded double sqrt rounds to the float sqrt).
template <typename T>
PRUNOPT_HD void update_one(T& x, T& so, T& sd, T g, T tau_eff, T nlr, T lr, T a_scale, T eps, int version) {
  const T ag = g < T(0) ? -g : g;
  const bool rel = ag >= tau_eff;                          // eq. 2.6
  const T so_new = so + g * g;                             // eq. 2.7
  const T s = (g * nlr) / (static_cast<T>(sqrt(so_new)) + eps);  // eq. 2.9
  const T ax = x < T(0) ? -x : x;
  const bool m = !rel && x * g > T(0);                     // sign-matched irrelevant
  const T a = ax * a_scale;                                // Table 1
  const T as = s < T(0) ? -s : s;
  const bool acc = version != 0 && m && a <= as && (version < 3 || as <= ax);  // eq. 2.8
  const bool opt = rel || acc;                             // eq. 2.4
  const T sd_new = sd + x * x;                             // eq. 2.10
  const T sl = (ax * lr) / (static_cast<T>(sqrt(sd_new)) + eps);
  const T dec = m ? (a < sl ? a : sl) : T(0);              // eq. 2.16
  const T xd = x < T(0) ? x + dec : x - dec;
  x = opt ? x + s : xd;
  so = opt ? so_new : so;                                  // eq. 2.11
  sd = opt ? sd : sd_new;
}

// r = ||g||_R / ||x||_M, 0 if ||x||_M = 0 (prunopt reads the paper's S as M).
PRUNOPT_HD double ratio(double g_r2, double x_m2) {
  return x_m2 > 0.0 ? sqrt(g_r2) / sqrt(x_m2) : 0.0;
}

// Factor of a_i beyond lr_k |x_i| / (k+1): r for versions 1, 3 and
// relevant_only, 1 for versions 2 and 4.
PRUNOPT_HD bool uses_ratio(int version) {
  return version != 2 && version != 4;
}

PRUNOPT_HD double a_factor(int version, double r) {
  return uses_ratio(version) ? r : 1.0;
}

}  // namespace prunadag
}  // namespace prunopt
