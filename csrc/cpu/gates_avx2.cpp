// The gate kernels (gates_kernels.inc) compiled for CPU_CAPABILITY=AVX2:
// ATen's at::vec::Vectorized in its AVX2 form, for CPUs with AVX2 + FMA
// (chosen at run time by prunopt::gates::gate_kernels(); see prunopt/vec_capability.h).
#include "prunopt/gates_kernels.h"
#include "prunopt/vec_capability.h"

#include <cstring>

#if PRUNOPT_VEC_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "prunopt/vec_target.h"
#include "gates_kernels.inc"
#pragma GCC pop_options
#endif
