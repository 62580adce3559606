// fb_reconstruct's generic row kernels (fb_reconstruct_kernels.inc) compiled
// for CPU_CAPABILITY=AVX2: ATen's at::vec::Vectorized in its AVX2 form (8 float / 4 double lanes), for CPUs with AVX2 + FMA
// (chosen at run time by fb_reconstruct.cpp; see prunopt/fb_reconstruct_cpu.h).
#include "prunopt/fb_reconstruct_cpu.h"

#include <algorithm>
#include <cstdint>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "prunopt/vec_target.h"
#include "fb_reconstruct_kernels.inc"
#pragma GCC pop_options
#endif
