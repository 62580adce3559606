// fb_reconstruct's generic row kernels (fb_reconstruct_kernels.inc) compiled
// for CPU_CAPABILITY=DEFAULT: ATen's at::vec::Vectorized in its DEFAULT form (arrays of 8 float / 4 double lanes; GCC compiles them to SSE2 pairs on x86-64)
// (chosen at run time by fb_reconstruct.cpp; see prunopt/fb_reconstruct_cpu.h).
#include "prunopt/fb_reconstruct_cpu.h"

#include <algorithm>
#include <cstdint>

#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "prunopt/vec_target.h"
#include "fb_reconstruct_kernels.inc"
