// prunAdag's scan and element passes (prunadag_kernels.inc) for the DEFAULT
// CPU capability (CPUs without AVX2 + FMA, ATEN_CPU_CAPABILITY=default,
// PRUNOPT_NO_SIMD=1; chosen at run time by prunadag.cpp, see
// prunopt/prunadag_cpu.h): on x86-64, ATen's at::vec::Vectorized in its
// DEFAULT form (prunadag_vec.inc; 8 float / 4 double lanes held in arrays,
// which GCC compiles to pairs of SSE2 operations), with the approximate rsqrt
// of the float acceptance estimate taken by SSE's rsqrtps on each half.
// Elsewhere the scalar loops alone (the traits assume x86's lane counts).
//
// It replaced hand-written SSE2 traits (4 float / 2 double lanes, the same
// operations per element): this form took 0.38-0.65x their time with 1 thread
// and 0.34-0.76x with 2 threads (prunadag_step_, versions 0 and 3, float32 and
// float64, 66K and 1.3M elements, both builds under ATEN_CPU_CAPABILITY=default,
// 5 interleaved rounds; bench/compare_builds.py, bench/results/simd_aten.md):
// the wider vectors halve the per-vector work of the loops (candidate marks,
// the estimate's decision branch, prefetches).
#include "prunopt/prunadag_cpu.h"

#include <algorithm>

#if defined(PRUNOPT_PRUNADAG_X86)
#include <immintrin.h>
#endif
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "prunopt/vec_target.h"

namespace prunopt {
namespace prunadag_cpu {
namespace DEFAULT {
namespace {
#if defined(PRUNOPT_PRUNADAG_X86)
#include "prunadag_vec.inc"
#else
#define PRUNOPT_PRUNADAG_SCALAR_ONLY 1
#endif
#include "prunadag_kernels.inc"
}  // namespace

const Kernels* kernels() {
  static constexpr Kernels k = make_table();
  return &k;
}

}  // namespace DEFAULT
}  // namespace prunadag_cpu
}  // namespace prunopt
