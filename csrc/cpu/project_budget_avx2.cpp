// The budget projection's vectorised passes (project_budget_kernels.inc)
// compiled for CPU_CAPABILITY=AVX2: ATen's at::vec::Vectorized in its AVX2 form
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
#pragma GCC target("avx2,fma")
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "prunopt/vec_target.h"
#include "project_budget_kernels.inc"
#pragma GCC pop_options
#endif
