// ATen's vec headers for one capability clone (see prunopt/vec_capability.h):
// included after `#pragma GCC target(...)` and the definition of CPU_CAPABILITY
// and CPU_CAPABILITY_AVX2 / CPU_CAPABILITY_AVX512, once per translation unit.
//
// GCC's C++ front end does not define __AVX__ / __AVX2__ / __AVX512F__ after a
// target pragma, and sleef.h declares its vector functions (which Vectorized's
// inline members name: acos, erf, ...) only under those macros. They are
// defined around sleef.h alone, so that its declarations exist. The kernels
// call no Sleef function (they write their own exp: bit-identical across the
// clones and flushed to 0 below e^-80 / e^-700, free of denormals), so the
// extension links no Sleef symbol.
#pragma once

#if !defined(CPU_CAPABILITY)
#error "define CPU_CAPABILITY (and CPU_CAPABILITY_AVX2 or CPU_CAPABILITY_AVX512) before prunopt/vec_target.h"
#endif

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#if !defined(__AVX__)
#define __AVX__ 1
#define PRUNOPT_VEC_DEFINED_AVX 1
#endif
#if !defined(__AVX2__)
#define __AVX2__ 1
#define PRUNOPT_VEC_DEFINED_AVX2 1
#endif
#if defined(CPU_CAPABILITY_AVX512) && !defined(__AVX512F__)
#define __AVX512F__ 1
#define PRUNOPT_VEC_DEFINED_AVX512F 1
#endif
#define SLEEF_STATIC_LIBS
#include <sleef.h>
#if defined(PRUNOPT_VEC_DEFINED_AVX)
#undef __AVX__
#undef PRUNOPT_VEC_DEFINED_AVX
#endif
#if defined(PRUNOPT_VEC_DEFINED_AVX2)
#undef __AVX2__
#undef PRUNOPT_VEC_DEFINED_AVX2
#endif
#if defined(PRUNOPT_VEC_DEFINED_AVX512F)
#undef __AVX512F__
#undef PRUNOPT_VEC_DEFINED_AVX512F
#endif
#endif

// The vec headers' bfloat16/half helpers pass vectors through lambdas' static
// invokers, which GCC builds outside the target pragma and warns about (an ABI
// note on functions the clones never call).
#pragma GCC diagnostic ignored "-Wpsabi"
// "#pragma unroll" in the vec headers (GCC < 13 applies this too late for its
// preprocessor, PR 53431, and still warns)
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#include <ATen/cpu/vec/vec.h>
