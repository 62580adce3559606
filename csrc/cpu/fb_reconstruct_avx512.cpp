// fb_reconstruct's generic row kernels (fb_reconstruct_kernels.inc) compiled
// for CPU_CAPABILITY=AVX512: ATen's at::vec::Vectorized in its AVX512 form (16 float / 8 double lanes), for CPUs with AVX-512 (F, BW, VL, DQ)
// (chosen at run time by fb_reconstruct.cpp; see prunopt/fb_reconstruct_cpu.h).
#include "prunopt/fb_reconstruct_cpu.h"

#include <algorithm>
#include <cstdint>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "prunopt/vec_target.h"
// GCC 12 reports the undefined pass-through operands of the intrinsics that
// ATen's AVX-512 Vectorized uses as maybe-uninitialized: false positives.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "fb_reconstruct_kernels.inc"
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
