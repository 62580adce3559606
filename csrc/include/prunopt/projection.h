// Torch-free math of the budget projection (ProM supplement A.2), shared by the
// CPU and CUDA kernels.
//
//   theta* = clamp(t - lam* c, 0, 1),  lam* = max(0, lam1),  phi(lam1) = 0
//   phi(lam) = sum_i c_i clamp(t_i - lam c_i, 0, 1) - S          (non-increasing)
//
// Element i has two breakpoints: key2 = (t_i - 1) / c_i, where it leaves the
// upper set U (t - lam c >= 1) for the free set F, and key1 = t_i / c_i, where it
// leaves F for the lower set L. Between consecutive breakpoints phi is linear,
// so the root on a known piece is one division (piece_root).
#pragma once

#include "prunopt/macros.h"

namespace prunopt {
namespace projection {

// The sums that define phi on one piece:
//   phi(lam) = u_c + f_ct - lam * f_cc - S,
// u_c = sum_U c_i, f_ct = sum_F c_i t_i, f_cc = sum_F c_i^2. Kernels sum U and
// F directly at the bracket's lower end (no large sums are subtracted, so no
// cancellation) and move across a bucket of breakpoints with a Delta.
struct Piece {
  double u_c = 0, f_ct = 0, f_cc = 0;

  PRUNOPT_HD void merge(const Piece& o) {
    u_c += o.u_c;
    f_ct += o.f_ct;
    f_cc += o.f_cc;
  }
};

// Breakpoints inside one bucket: crossing key2 moves i from U to F, crossing
// key1 moves it from F to L.
struct Delta {
  double c2 = 0, ct2 = 0, cc2 = 0;  // key2 crossings
  double ct1 = 0, cc1 = 0;          // key1 crossings
  long long n2 = 0, n1 = 0;

  PRUNOPT_HD void add2(double t, double c) {
    c2 += c;
    ct2 += c * t;
    cc2 += c * c;
    n2 += 1;
  }
  PRUNOPT_HD void add1(double t, double c) {
    ct1 += c * t;
    cc1 += c * c;
    n1 += 1;
  }
  PRUNOPT_HD void merge(const Delta& o) {
    c2 += o.c2;
    ct2 += o.ct2;
    cc2 += o.cc2;
    ct1 += o.ct1;
    cc1 += o.cc1;
    n2 += o.n2;
    n1 += o.n1;
  }
  PRUNOPT_HD long long keys() const {
    return n1 + n2;
  }
};

// The piece after crossing every breakpoint of `d`.
PRUNOPT_HD Piece cross(const Piece& p, const Delta& d) {
  Piece q;
  q.u_c = p.u_c - d.c2;
  q.f_ct = p.f_ct + (d.ct2 - d.ct1);
  q.f_cc = p.f_cc + (d.cc2 - d.cc1);
  return q;
}

// phi(lam) on the piece `p` (eq. 14 of the supplement, weighted).
PRUNOPT_HD double phi(const Piece& p, double lam, double budget) {
  return p.u_c + p.f_ct - lam * p.f_cc - budget;
}

// Root of phi on the piece `p`; `fallback` if it has no free element.
PRUNOPT_HD double piece_root(const Piece& p, double budget, double fallback) {
  if (!(p.f_cc > 0)) {
    return fallback;
  }
  return (p.u_c + p.f_ct - budget) / p.f_cc;
}

// theta*_i for a given multiplier (eq. 16-17).
PRUNOPT_HD double project_one(double t, double c, double lam) {
  const double v = t - lam * c;
  return v < 0.0 ? 0.0 : (v > 1.0 ? 1.0 : v);
}

}  // namespace projection
}  // namespace prunopt
