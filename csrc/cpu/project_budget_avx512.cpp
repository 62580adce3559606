// The budget projection's vectorised passes (project_budget_kernels.inc)
// compiled for CPU_CAPABILITY=AVX512: ATen's at::vec::Vectorized in its AVX512 form
// (chosen at run time by project_budget.cpp; see prunopt/vec_capability.h).
#include "prunopt/project_budget_cpu.h"
#include "prunopt/cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "prunopt/vec_target.h"
// GCC 12 reports the undefined pass-through operands of the intrinsics that
// ATen's AVX-512 Vectorized uses as maybe-uninitialized: false positives.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "project_budget_kernels.inc"
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
