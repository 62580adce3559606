// AVX2 building blocks of the CPU sparsification kernels (rgf_relu,
// two_temperature_sigmoid, sparse_gate), with runtime dispatch.
//
// The extension is built without -mavx2 (one binary for every x86-64 CPU), so
// ATen's at::vec::Vectorized would compile to its scalar DEFAULT form here. The
// functions below carry __attribute__((target("avx2,fma"))) instead and only run
// when the CPU reports AVX2 and FMA (checked once); everything else -- other
// CPUs, half/bfloat16, the last < 8 (float) or < 4 (double) elements of a range
// -- takes the scalar math of prunopt/sparsification.h. PRUNOPT_NO_SIMD=1 in the
// environment forces the scalar path (used by the tests to cover it).
//
// exp: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, then a polynomial
// (float: Cephes' degree-6 minimax, ~1 ulp; double: Taylor to r^13, truncation
// < 5e-18, ~1 ulp) and 2^n applied as two power-of-two factors so that the range
// up to overflow (inf) is covered. Results below e^-80 (float) / e^-700
// (double) are flushed to 0, so that neither exp nor the products formed with it
// go denormal (a microcode assist per lane); NaN propagates.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define PRUNOPT_SIMD_AVX2 1
#include <immintrin.h>
#define PRUNOPT_AVX2 __attribute__((target("avx2,fma")))
#else
#define PRUNOPT_SIMD_AVX2 0
#endif

namespace prunopt {
namespace simd {

// True when the AVX2 + FMA kernels may run: the CPU has both and PRUNOPT_NO_SIMD
// is unset or "0". Evaluated once per process.
inline bool avx2_enabled() {
#if PRUNOPT_SIMD_AVX2
  static const bool on = [] {
    const char* env = std::getenv("PRUNOPT_NO_SIMD");
    if (env != nullptr && env[0] != '\0' && !(env[0] == '0' && env[1] == '\0')) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return on;
#else
  return false;
#endif
}

template <typename T>
constexpr bool has_vec = std::is_same_v<T, float> || std::is_same_v<T, double>;

#if PRUNOPT_SIMD_AVX2
template <typename T>
struct VecOf;
template <>
struct VecOf<float> {
  using type = __m256;
  static constexpr int64_t size = 8;
};
template <>
struct VecOf<double> {
  using type = __m256d;
  static constexpr int64_t size = 4;
};

// the lane type of a vector type (declared only, for decltype)
PRUNOPT_AVX2 float scalar_tag(__m256);
PRUNOPT_AVX2 double scalar_tag(__m256d);
template <typename V>
using scalar_of = decltype(scalar_tag(std::declval<V>()));

// ---- thin overloads, so that the elementwise ops are written once for float and double
PRUNOPT_AVX2 inline __m256 vload(const float* p) { return _mm256_loadu_ps(p); }
PRUNOPT_AVX2 inline __m256d vload(const double* p) { return _mm256_loadu_pd(p); }
PRUNOPT_AVX2 inline void vstore(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
PRUNOPT_AVX2 inline void vstore(double* p, __m256d v) { _mm256_storeu_pd(p, v); }
PRUNOPT_AVX2 inline __m256 vset1(float x) { return _mm256_set1_ps(x); }
PRUNOPT_AVX2 inline __m256d vset1(double x) { return _mm256_set1_pd(x); }
PRUNOPT_AVX2 inline __m256 vadd(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
PRUNOPT_AVX2 inline __m256d vadd(__m256d a, __m256d b) { return _mm256_add_pd(a, b); }
PRUNOPT_AVX2 inline __m256 vsub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
PRUNOPT_AVX2 inline __m256d vsub(__m256d a, __m256d b) { return _mm256_sub_pd(a, b); }
PRUNOPT_AVX2 inline __m256 vmul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
PRUNOPT_AVX2 inline __m256d vmul(__m256d a, __m256d b) { return _mm256_mul_pd(a, b); }
PRUNOPT_AVX2 inline __m256 vdiv(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
PRUNOPT_AVX2 inline __m256d vdiv(__m256d a, __m256d b) { return _mm256_div_pd(a, b); }
// max(a, b) / min(a, b) return b when either is NaN: call them with the input
// second to propagate its NaN.
PRUNOPT_AVX2 inline __m256 vmax(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
PRUNOPT_AVX2 inline __m256d vmax(__m256d a, __m256d b) { return _mm256_max_pd(a, b); }
PRUNOPT_AVX2 inline __m256 vmin(__m256 a, __m256 b) { return _mm256_min_ps(a, b); }
PRUNOPT_AVX2 inline __m256d vmin(__m256d a, __m256d b) { return _mm256_min_pd(a, b); }
PRUNOPT_AVX2 inline __m256 vabs(__m256 a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
PRUNOPT_AVX2 inline __m256d vabs(__m256d a) { return _mm256_andnot_pd(_mm256_set1_pd(-0.0), a); }
PRUNOPT_AVX2 inline __m256 vneg(__m256 a) { return _mm256_xor_ps(_mm256_set1_ps(-0.0f), a); }
PRUNOPT_AVX2 inline __m256d vneg(__m256d a) { return _mm256_xor_pd(_mm256_set1_pd(-0.0), a); }
// lane masks (all ones / zeros); ordered compares are false for NaN
PRUNOPT_AVX2 inline __m256 vgt(__m256 a, __m256 b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
PRUNOPT_AVX2 inline __m256d vgt(__m256d a, __m256d b) { return _mm256_cmp_pd(a, b, _CMP_GT_OQ); }
PRUNOPT_AVX2 inline __m256 vlt(__m256 a, __m256 b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
PRUNOPT_AVX2 inline __m256d vlt(__m256d a, __m256d b) { return _mm256_cmp_pd(a, b, _CMP_LT_OQ); }
PRUNOPT_AVX2 inline __m256 visnan(__m256 a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
PRUNOPT_AVX2 inline __m256d visnan(__m256d a) { return _mm256_cmp_pd(a, a, _CMP_UNORD_Q); }
PRUNOPT_AVX2 inline __m256 vand(__m256 a, __m256 b) { return _mm256_and_ps(a, b); }
PRUNOPT_AVX2 inline __m256d vand(__m256d a, __m256d b) { return _mm256_and_pd(a, b); }
// mask ? b : a
PRUNOPT_AVX2 inline __m256 vselect(__m256 mask, __m256 b, __m256 a) { return _mm256_blendv_ps(a, b, mask); }
PRUNOPT_AVX2 inline __m256d vselect(__m256d mask, __m256d b, __m256d a) { return _mm256_blendv_pd(a, b, mask); }

// float <-> double lanes for the kernels that compute in double (sparse_gate)
PRUNOPT_AVX2 inline __m256d vload4d(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
PRUNOPT_AVX2 inline __m256d vload4d(const double* p) { return _mm256_loadu_pd(p); }
PRUNOPT_AVX2 inline void vstore4d(float* p, __m256d v) { _mm_storeu_ps(p, _mm256_cvtpd_ps(v)); }
PRUNOPT_AVX2 inline void vstore4d(double* p, __m256d v) { _mm256_storeu_pd(p, v); }

PRUNOPT_AVX2 inline double hsum(__m256d v) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

// exp of 8 floats. x is clamped to [-80, 89] (above, the result overflows to
// inf), n = round(x log2 e), r = x - n ln2 in two steps (n * 0.693359375 is
// exact), Cephes' expf polynomial, times 2^(n>>1) 2^(n - n>>1) (both factors
// normal). Below x = -80 (exp = 1.8e-35) the result is flushed to 0: denormal
// results -- of exp itself or of the products the kernels form with it (rgf_alpha
// exp(u) g) -- cost a microcode assist per lane, ~100x the arithmetic; what the
// flush drops is below 1.8e-35 relative to the O(1) terms it is added to.
PRUNOPT_AVX2 inline __m256 vexp(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-80.0f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_NLT_UQ);  // x >= lo or NaN
  x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(lo, x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_and_ps(keep, _mm256_mul_ps(_mm256_mul_ps(y, s1), s2));
}

// 2^k for integral doubles k with k + 1023 in [1, 2046]: k is moved into the
// low mantissa bits by adding 1.5 * 2^52, then biased and shifted into the exponent.
PRUNOPT_AVX2 inline __m256d vpow2i(__m256d k) {
  const __m256i bits = _mm256_castpd_si256(_mm256_add_pd(k, _mm256_set1_pd(6755399441055744.0)));
  return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(bits, _mm256_set1_epi64x(1023)), 52));
}

// exp of 4 doubles: x clamped to [-708, 710], n = round(x log2 e), r = x - n ln2
// with fdlibm's split ln2 (n * ln2_hi exact), Taylor polynomial to r^13 by
// Horner with FMA, times 2^floor(n/2) 2^(n - floor(n/2)). Below x = -700
// (exp = 9.9e-305) the result is flushed to 0, as for float.
PRUNOPT_AVX2 inline __m256d vexp(__m256d x) {
  const __m256d lo = _mm256_set1_pd(-700.0);
  const __m256d keep = _mm256_cmp_pd(x, lo, _CMP_NLT_UQ);  // x >= lo or NaN
  x = _mm256_min_pd(_mm256_set1_pd(710.0), _mm256_max_pd(lo, x));
  const __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(6.93147180369123816490e-01), x);
  r = _mm256_fnmadd_pd(n, _mm256_set1_pd(1.90821492927058770002e-10), r);
  // 1/k! for k = 13 .. 0
  __m256d p = _mm256_set1_pd(1.0 / 6227020800.0);
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 479001600.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 39916800.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 3628800.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 362880.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 40320.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 5040.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 720.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 120.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 24.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 6.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.5));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
  const __m256d y = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
  const __m256d n1 = _mm256_floor_pd(_mm256_mul_pd(n, _mm256_set1_pd(0.5)));
  const __m256d n2 = _mm256_sub_pd(n, n1);
  return _mm256_and_pd(keep, _mm256_mul_pd(_mm256_mul_pd(y, vpow2i(n1)), vpow2i(n2)));
}

// The slope of the thresholding relu in the backward pass (eq. 15), as
// sparsification::rgf_slope: 1 for u > 0, rgf * exp(u) for u <= 0, NaN for NaN.
// rgf_zero skips the exponential (plain relu slope).
template <typename V>
PRUNOPT_AVX2 inline V vrgf_slope(V u, V rgf, bool rgf_zero) {
  using T = scalar_of<V>;
  const V zero = vset1(T(0));
  const V below = rgf_zero ? vand(visnan(u), u) : vmul(rgf, vexp(vmin(zero, u)));
  return vselect(vgt(u, zero), vset1(T(1)), below);
}

template <typename T, typename Op>
PRUNOPT_AVX2 void map_unary_avx2(const T* x, T* y, int64_t n, const Op& op) {
  constexpr int64_t W = VecOf<T>::size;
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, op.vec(vload(x + i)));
  for (; i < n; ++i) y[i] = op(x[i]);
}

template <typename T, typename Op>
PRUNOPT_AVX2 void map_binary_avx2(const T* a, const T* b, T* y, int64_t n, const Op& op) {
  constexpr int64_t W = VecOf<T>::size;
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, op.vec(vload(a + i), vload(b + i)));
  for (; i < n; ++i) y[i] = op(a[i], b[i]);
}
#endif  // PRUNOPT_SIMD_AVX2

// y[i] = op(x[i]) for i in [0, n), parallel over chunks of at least `grain`.
// Op provides `template <class U> U operator()(U) const` (the scalar math, in
// opmath) and, for the AVX2 path, `vec(V) const` for V = __m256 / __m256d.
template <typename scalar_t, typename Op>
void map_unary(const scalar_t* x, scalar_t* y, int64_t n, int64_t grain, const Op& op) {
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
#if PRUNOPT_SIMD_AVX2
    if constexpr (has_vec<scalar_t>) {
      if (avx2_enabled()) {
        map_unary_avx2(x + b, y + b, e - b, op);
        return;
      }
    }
#endif
    using opmath_t = at::opmath_type<scalar_t>;
    for (int64_t i = b; i < e; ++i) y[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(x[i])));
  });
}

// y[i] = op(a[i], b[i]) for i in [0, n); as map_unary.
template <typename scalar_t, typename Op>
void map_binary(const scalar_t* a, const scalar_t* b, scalar_t* y, int64_t n, int64_t grain, const Op& op) {
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
#if PRUNOPT_SIMD_AVX2
    if constexpr (has_vec<scalar_t>) {
      if (avx2_enabled()) {
        map_binary_avx2(a + lo, b + lo, y + lo, hi - lo, op);
        return;
      }
    }
#endif
    using opmath_t = at::opmath_type<scalar_t>;
    for (int64_t i = lo; i < hi; ++i) {
      y[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(a[i]), static_cast<opmath_t>(b[i])));
    }
  });
}

// Tensor level: y = op(x) / y = op(a, b) into a new contiguous tensor
// (half/bfloat16/float/double; the inputs are validated by the caller; a and b
// have the same shape and dtype). The CPU twin of cuda::map_unary/map_binary.
template <typename Op>
at::Tensor map_unary(const at::Tensor& x_in, int64_t grain, const Op& op) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "prunopt_map_unary", [&] {
    map_unary(x.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), x.numel(), grain, op);
  });
  return y;
}

template <typename Op>
at::Tensor map_binary(const at::Tensor& a_in, const at::Tensor& b_in, int64_t grain, const Op& op) {
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = b_in.contiguous();
  at::Tensor y = at::empty_like(b, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.scalar_type(), "prunopt_map_binary", [&] {
    map_binary(a.const_data_ptr<scalar_t>(), b.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), b.numel(),
        grain, op);
  });
  return y;
}

}  // namespace simd
}  // namespace prunopt
