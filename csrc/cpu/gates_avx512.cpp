// The gate kernels (gates_kernels.inc) compiled for CPU_CAPABILITY=AVX512:
// ATen's at::vec::Vectorized in its AVX512 form, for CPUs with AVX-512 (F, BW, VL, DQ) + AVX2 + FMA
// (chosen at run time by prunopt::gates::gate_kernels(); see prunopt/vec_capability.h).
#include "prunopt/gates_kernels.h"
#include "prunopt/vec_capability.h"

#include <cstring>

#if PRUNOPT_VEC_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "prunopt/vec_target.h"
// GCC 12 reports the undefined pass-through operands of the intrinsics that
// ATen's AVX-512 Vectorized uses (_mm512_sllv_epi64, _mm512_cvtps_pd, ...)
// as maybe-uninitialized wherever they are inlined: false positives.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "gates_kernels.inc"
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
