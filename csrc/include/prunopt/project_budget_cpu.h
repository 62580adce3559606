// The budget projection's vectorised CPU passes: the generic part, shared by
// csrc/cpu/project_budget.cpp and the per-capability objects that compile
// csrc/cpu/project_budget_kernels.inc on ATen's at::vec::Vectorized
// (project_budget_avx2.cpp, project_budget_avx512.cpp; see
// prunopt/vec_capability.h). The passes cover float32 scores with unit costs
// (the common case); every other dtype, costs, and the DEFAULT capability take
// the scalar loops of project_budget.cpp. Torch-free.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "prunopt/projection.h"

namespace prunopt {
namespace projection_cpu {

using projection::Delta;
using projection::Piece;

// Smallest float >= x (x finite or +-inf).
inline float ceil_to_float(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) {
    f = std::nextafter(f, std::numeric_limits<float>::infinity());
  }
  return f;
}

// Largest float <= x.
inline float floor_to_float(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) > x) {
    f = std::nextafter(f, -std::numeric_limits<float>::infinity());
  }
  return f;
}

// Sums of one histogram pass over float scores (see level_block).
struct LevelAcc {
  double u = 0, fct = 0, fcc = 0;      // at lo
  double u0 = 0, f0ct = 0, f0cc = 0;   // at 0 (first pass)
  float maxk1 = -std::numeric_limits<float>::infinity();
  bool bad = false;
};

// Sums of one compaction pass over float scores (see compact_block).
struct CompactAcc {
  int64_t not_u = 0, not_f = 0;  // elements not in U / not in F
  double ft = 0;                 // sum of the F elements
  bool bad = false;              // a non-finite score
};

// U and F sums of a small set on the piece just right of lam, that piece's
// ends [kb, ka] (the nearest breakpoints <= lam and > lam), and the first two
// moments of the terms c_i clamp(t_i - lam c_i, 0, 1) (for the sample error).
struct PieceAt {
  Piece p;
  double kb, ka, s1, s2;
};

// One capability's passes (project_budget_kernels.inc).
struct Kernels {
  // The histogram pass over [b, e) of float scores with unit costs: U and F
  // at lo (and at 0, with the maximum key and the finiteness check, on the
  // first pass, level_block[1]) into acc; each breakpoint inside [lo, hi) into
  // hist[min((key - lo) * scale, last)].
  void (*level_block[2])(const float* tp, int64_t b, int64_t e, double lo, double hi, double scale, double last,
      Delta* hist, LevelAcc& acc);
  // One block [b, e) of the compaction pass with the bracket (a, bb): the
  // elements with a breakpoint inside it are appended to dst (room for e - b
  // + 16 values: the stores are vector-wide), their count is returned; U, F
  // and finiteness into acc.
  int64_t (*compact_block)(const float* tp, int64_t b, int64_t e, double a, double bb, float* dst, CompactAcc& acc);
  // op[i] = clamp(tp[i] - lam, 0, 1) over [b, e), in double, rounded once.
  void (*apply)(const float* tp, float* op, int64_t b, int64_t e, double lam);
  // The vector part of piece_at over a small set of m doubles (costs c or
  // unit costs, piece_at[kCost]): its sums into r (r.kb / r.ka the lanes'
  // max / min); returns the end of the vector part (the caller takes the rest).
  int64_t (*piece_at[2])(const double* t, const double* c, int64_t m, double lam, PieceAt& r);
};

// The clones (project_budget_avx2.cpp, project_budget_avx512.cpp; x86-64).
namespace AVX2 {
const Kernels* kernels();
}
namespace AVX512 {
const Kernels* kernels();
}

}  // namespace projection_cpu
}  // namespace prunopt
