// CPU capabilities of the vectorised kernels: ATen's at::vec::Vectorized
// compiled once per capability, as PyTorch compiles its own CPU kernels.
//
// The extension is one binary for every x86-64 CPU (no -mavx2 on the command
// line; setuptools gives one flag set per extension), so a kernel file is
// compiled per capability by a small translation unit that includes the
// generic headers first, then switches the code generation of the rest of the
// file with `#pragma GCC target(...)` and defines PyTorch's capability macros
// (CPU_CAPABILITY=AVX2 + CPU_CAPABILITY_AVX2, or AVX512) before including
// prunopt/vec_target.h (the ATen vec headers) and the kernel body:
//
//   #include "prunopt/vec_capability.h"  // and the kernel's generic headers
//   #pragma GCC push_options
//   #pragma GCC target("avx2,fma")
//   #define CPU_CAPABILITY AVX2
//   #define CPU_CAPABILITY_AVX2
//   #include "prunopt/vec_target.h"
//   #include "gates_kernels.inc"           // namespace ...::CPU_CAPABILITY { ... }
//   #pragma GCC pop_options
//
// Vectorized lives in `inline namespace CPU_CAPABILITY` and the kernel bodies
// in a namespace of that name too, so the clones never share a symbol; every
// header included before the pragma keeps the generic code generation, so no
// inline function of torch or the standard library is emitted in an AVX2 form
// that another file could pick up. The generic file that owns an op picks the
// clone at run time with cpu_capability().
#pragma once

#include <ATen/ATen.h>
#include <ATen/Version.h>

#include <cstdlib>
#include <string>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#define PRUNOPT_VEC_X86 1
#else
#define PRUNOPT_VEC_X86 0
#endif

namespace prunopt {
namespace vec {

// The clones, in increasing order; the values are PyTorch's CPUCapability ones.
enum class Capability : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && !(v[0] == '0' && v[1] == '\0');
}

// What this CPU can run, as PyTorch decides it for its own kernels
// (at::get_cpu_capability(), which honours ATEN_CPU_CAPABILITY=default/avx2/
// avx512), capped by the instruction sets the clones are compiled for
// (AVX2 clone: avx2 + fma; AVX512 clone: avx512f/bw/vl/dq + avx2 + fma), so an
// ATEN_CPU_CAPABILITY that overstates the CPU cannot select a clone it would
// fault in. Evaluated once per process.
inline Capability machine_capability() {
#if PRUNOPT_VEC_X86
  static const Capability cap = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const std::string aten = at::get_cpu_capability();
    if (aten == "AVX512" && avx512) return Capability::kAvx512;
    if ((aten == "AVX512" || aten == "AVX2") && avx2) return Capability::kAvx2;
    return Capability::kDefault;
  }();
  return cap;
#else
  return Capability::kDefault;
#endif
}

// The clone a kernel runs now: machine_capability(), at most AVX2 while
// PRUNOPT_NO_AVX512 is set and DEFAULT (the scalar path) while PRUNOPT_NO_SIMD
// is set (to anything but "" or "0"). The environment is read at every call
// (the tests switch clones within one process), so callers resolve it once per
// op call, outside their loops.
inline Capability cpu_capability() {
  const Capability cap = machine_capability();
  if (cap == Capability::kDefault || env_flag("PRUNOPT_NO_SIMD")) return Capability::kDefault;
  if (cap == Capability::kAvx512 && std::getenv("PRUNOPT_NO_AVX512") != nullptr) return Capability::kAvx2;
  return cap;
}

}  // namespace vec
}  // namespace prunopt
