// prunAdag's CPU kernels: the generic part, shared by the op file
// (csrc/cpu/prunadag.cpp) and the per-capability objects that compile the
// scan and element passes (csrc/cpu/prunadag_kernels.inc) once per CPU
// capability: prunadag_default.cpp, prunadag_avx2.cpp, prunadag_avx512.cpp.
// prunadag.cpp picks one table of kernels per op call with
// prunopt::vec::cpu_capability() (prunopt/vec_capability.h).
//
// Torch-free on purpose: the DEFAULT and AVX512 objects include nothing of
// torch (they are hand-written intrinsics), so they compile in seconds.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "prunopt/prunadag.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#define PRUNOPT_PRUNADAG_X86 1
#endif

namespace prunopt {
namespace prunadag_cpu {

using namespace prunopt::prunadag;

// One tensor's share of the concatenated index space.
struct Seg {
  void* x;
  void* so;
  void* sd;
  const void* g;
  int64_t n;
  int64_t offset;
  bool prune;
  double h[kHyperCols];
};

// Per-chunk result of the scan pass: cg holds the candidates' effective
// gradients, cx their parameter values (when norms are needed).
template <typename T>
struct ScanOut {
  int64_t above = 0;
  int64_t ncand = 0;
  double g2 = 0.0, x2 = 0.0;
  bool bad = false;
  std::vector<T> cg, cx;
};

// The scan's ||x||^2 leaves out |x| < kXMin, whose squares could be denormal
// (float: x^2 >= 2^-120 > FLT_MIN = 2^-126 for the others).
template <typename T>
struct NormGuard;
template <>
struct NormGuard<float> {
  static constexpr float kXMin = 0x1p-60f;
};
template <>
struct NormGuard<double> {
  static constexpr double kXMin = 0x1p-500;
};

// Left-packing permutations for the branch-free candidate stores: row m lists
// the lanes set in mask m, for 8 x 32-bit lanes (f) and 4 x 64-bit lanes as
// pairs of 32-bit lanes (d).
struct CompressLut {
  int32_t f[256][8];
  int32_t d[16][8];
  constexpr CompressLut() : f(), d() {
    for (int m = 0; m < 256; ++m) {
      int j = 0;
      for (int l = 0; l < 8; ++l) {
        if (m >> l & 1) {
          f[m][j++] = l;
        }
      }
    }
    for (int m = 0; m < 16; ++m) {
      int j = 0;
      for (int l = 0; l < 4; ++l) {
        if (m >> l & 1) {
          d[m][j++] = 2 * l;
          d[m][j++] = 2 * l + 1;
        }
      }
    }
  }
};
alignas(64) inline constexpr CompressLut kCompressLut{};

// Scalar left-pack without branches: writes W slots, keeps popcount(mask).
template <typename T, int W>
inline void compress_scalar(T* dst, const T* lanes, int mask) {
  int j = 0;
  for (int l = 0; l < W; ++l) {
    dst[j] = lanes[l];
    j += (mask >> l) & 1;
  }
}

// One capability's passes for one dtype, over the piece [b, e) of a segment
// (see prunadag_kernels.inc). scan[kX][kNorms]: the scan (kX: the parameter is
// read; kNorms: the sure parts of both norms are summed); each entry picks
// the segment's weight decay / maximize specialisation itself, update the
// version's.
template <typename T>
struct KernelsT {
  void (*scan[2][2])(const Seg& s, int64_t b, int64_t e, T lo, T hi, ScanOut<T>& out, T* cg, T* cx);
  void (*update)(const Seg& s, int64_t b, int64_t e, T tau, double r, int version);
  void (*norms)(const Seg& s, int64_t b, int64_t e, T tau, double& g_r2, double& x_m2);
};

struct Kernels {
  KernelsT<float> f;
  KernelsT<double> d;
  template <typename T>
  const KernelsT<T>& get() const {
    if constexpr (std::is_same_v<T, float>) {
      return f;
    } else {
      return d;
    }
  }
};

// The clones (prunadag_default.cpp, prunadag_avx2.cpp, prunadag_avx512.cpp;
// the last two on x86-64 only).
namespace DEFAULT {
const Kernels* kernels();
}
namespace AVX2 {
const Kernels* kernels();
}
namespace AVX512 {
const Kernels* kernels();
}

}  // namespace prunadag_cpu
}  // namespace prunopt
