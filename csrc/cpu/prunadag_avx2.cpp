// prunAdag's scan and element passes (prunadag_kernels.inc) compiled for
// CPU_CAPABILITY=AVX2: ATen's at::vec::Vectorized in its AVX2 form
// (prunadag_vec.inc), for CPUs with AVX2 + FMA (chosen at run time by
// prunadag.cpp; see prunopt/prunadag_cpu.h). At par with the hand-written
// AVX2 intrinsics it replaced (0.96-1.07x their time, bench/results/simd_aten.md).
#include "prunopt/prunadag_cpu.h"

#include <algorithm>
#include <type_traits>

#if defined(PRUNOPT_PRUNADAG_X86)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,popcnt,bmi")
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "prunopt/vec_target.h"

namespace prunopt {
namespace prunadag_cpu {
namespace AVX2 {
namespace {
#include "prunadag_vec.inc"
#include "prunadag_kernels.inc"
}  // namespace

const Kernels* kernels() {
  static constexpr Kernels k = make_table();
  return &k;
}

}  // namespace AVX2
}  // namespace prunadag_cpu
}  // namespace prunopt
#pragma GCC pop_options
#endif
