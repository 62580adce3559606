// Torch-free index math of the filter-basis convolution (Wimmer et al.,
// interspace pruning eq. 4, 6, 8), shared by the CPU and CUDA kernels.
//
//   h[o,i]  = sum_n lam[o,i,n] mu[o,i,n] g[n]                     (eq. 4)
//   Z[i,n]  = g[n] * X[i]     (cross-correlation, Alg. 1 l. 7-8)
//   Y[o]    = sum_{(i,n): lam mu != 0} lam[o,i,n] Z[i,n] + b[o]    (eq. 8)
#pragma once

#include <cstdint>

#include "prunopt/macros.h"

namespace prunopt {
namespace fb {

// Output length of a convolution along one dimension (as conv2d).
PRUNOPT_HD int64_t out_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation) {
  return (in + 2 * pad - dilation * (kernel - 1) - 1) / stride + 1;
}

// First output index o >= 0 whose input index o*stride + offset is >= 0, and one
// past the last whose input index is < in (offset = k*dilation - pad): the
// outputs in [lo, hi) read inside the image, the others read zero padding.
PRUNOPT_HD void valid_range(int64_t in, int64_t out, int64_t stride, int64_t offset, int64_t* lo, int64_t* hi) {
  int64_t l = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  int64_t h = in - offset <= 0 ? 0 : (in - offset + stride - 1) / stride;
  if (h > out) h = out;
  if (l > h) l = h;
  *lo = l;
  *hi = h;
}

// The shape of one fb_conv2d call, shared by the CPU and CUDA kernels (built
// from validated arguments by fb_geometry in fb_checks.h).
struct Geometry {
  int64_t batch, c_in, h, w, n, kh, kw, ho, wo, sh, sw, ph, pw, dh, dw, c_out, groups;
  PRUNOPT_HD int64_t p() const { return ho * wo; }
  PRUNOPT_HD int64_t c_in_g() const { return c_in / groups; }
};

}  // namespace fb
}  // namespace prunopt
