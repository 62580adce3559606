// prunAdag's scan and element passes (prunadag_kernels.inc) for the DEFAULT
// CPU capability (CPUs without AVX2 + FMA, ATEN_CPU_CAPABILITY=default,
// PRUNOPT_NO_SIMD=1; chosen at run time by prunadag.cpp, see
// prunopt/prunadag_cpu.h): on x86-64 its baseline SSE2, 4 float / 2 double
// lanes, hand-written; elsewhere the scalar loops alone. No torch header is
// included here.
#include "prunopt/prunadag_cpu.h"

#include <algorithm>

#if defined(PRUNOPT_PRUNADAG_X86)
#include <immintrin.h>
#endif

namespace prunopt {
namespace prunadag_cpu {
namespace DEFAULT {
namespace {
#if defined(PRUNOPT_PRUNADAG_X86)
struct SimdF {
  using T = float;
  using V = __m128;
  using Acc = __m128d;
  static constexpr int W = 4;
  static constexpr bool kApprox = true;  // rsqrt (relative error <= 1.5 * 2^-12)
  static V rsqrt(V a) { return _mm_rsqrt_ps(a); }
  static V load(const float* p) { return _mm_loadu_ps(p); }
  static void store(float* p, V v) { _mm_storeu_ps(p, v); }
  static V set1(float v) { return _mm_set1_ps(v); }
  static V zero() { return _mm_setzero_ps(); }
  static V add(V a, V b) { return _mm_add_ps(a, b); }
  static V sub(V a, V b) { return _mm_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm_mul_ps(a, b); }
  static V div(V a, V b) { return _mm_div_ps(a, b); }
  static V sqrt(V a) { return _mm_sqrt_ps(a); }
  static V min(V a, V b) { return _mm_min_ps(a, b); }
  static V ge(V a, V b) { return _mm_cmpge_ps(a, b); }
  static V gt(V a, V b) { return _mm_cmpgt_ps(a, b); }
  static V lt(V a, V b) { return _mm_cmplt_ps(a, b); }
  static V le(V a, V b) { return _mm_cmple_ps(a, b); }
  static V nlt(V a, V b) { return _mm_cmpnlt_ps(a, b); }
  static V and_(V a, V b) { return _mm_and_ps(a, b); }
  static V or_(V a, V b) { return _mm_or_ps(a, b); }
  static V andnot(V a, V b) { return _mm_andnot_ps(a, b); }  // ~a & b
  static V blend(V m, V a, V b) { return _mm_or_ps(_mm_and_ps(m, a), _mm_andnot_ps(m, b)); }
  static V signbit() { return _mm_set1_ps(-0.0f); }
  static V ones() { return _mm_castsi128_ps(_mm_set1_epi32(-1)); }
  static int movemask(V a) { return _mm_movemask_ps(a); }
  using M = V;  // a compare lane is all ones or all zeros
  static M mand(M a, M b) { return and_(a, b); }
  static M mor(M a, M b) { return or_(a, b); }
  static M mandnot(M a, M b) { return andnot(a, b); }  // ~a & b
  static M mfalse() { return zero(); }
  static V select(M m, V v) { return and_(m, v); }        // v where m, else 0
  static V select_not(M m, V v) { return andnot(m, v); }  // 0 where m, else v
  static V sq_add_where(V acc, M m, V v) { return sq_add(acc, select(m, v)); }  // acc + v^2 where m
  // v where m (resp. where not m), old elsewhere; old is what p holds
  static void store_where(T* p, M m, V v, V old) { store(p, blend(m, v, old)); }
  static void store_where_not(T* p, M m, V v, V old) { store(p, blend(m, old, v)); }
  using C = __m128i;  // per-lane counts of true compare lanes (a true lane is -1)
  static C cnt_zero() { return _mm_setzero_si128(); }
  static C cnt_add(C c, V mask) { return _mm_sub_epi32(c, _mm_castps_si128(mask)); }
  static int64_t cnt_sum(C c) {
    alignas(16) int32_t t[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), c);
    return int64_t(t[0]) + t[1] + t[2] + t[3];
  }
  static void compress_store(float* dst, V v, int mask) {
    alignas(16) float t[4];
    _mm_store_ps(t, v);
    compress_scalar<float, 4>(dst, t, mask);
  }
  static Acc acc_zero() { return _mm_setzero_pd(); }
  static V sq_add(V acc, V v) { return _mm_add_ps(acc, _mm_mul_ps(v, v)); }
  static void acc_add(Acc& acc, V v) {
    acc = _mm_add_pd(acc, _mm_add_pd(_mm_cvtps_pd(v), _mm_cvtps_pd(_mm_movehl_ps(v, v))));
  }
  static void acc_sq(Acc& acc, V v) {
    const __m128d l = _mm_cvtps_pd(v), h = _mm_cvtps_pd(_mm_movehl_ps(v, v));
    acc = _mm_add_pd(acc, _mm_add_pd(_mm_mul_pd(l, l), _mm_mul_pd(h, h)));
  }
  static double acc_sum(Acc a) {
    double t[2];
    _mm_storeu_pd(t, a);
    return t[0] + t[1];
  }
};
struct SimdD {
  using T = double;
  using V = __m128d;
  using Acc = __m128d;
  static constexpr int W = 2;
  static constexpr bool kApprox = false;
  static V rsqrt(V a) { return a; }  // unused (kApprox = false)
  static V load(const double* p) { return _mm_loadu_pd(p); }
  static void store(double* p, V v) { _mm_storeu_pd(p, v); }
  static V set1(double v) { return _mm_set1_pd(v); }
  static V zero() { return _mm_setzero_pd(); }
  static V add(V a, V b) { return _mm_add_pd(a, b); }
  static V sub(V a, V b) { return _mm_sub_pd(a, b); }
  static V mul(V a, V b) { return _mm_mul_pd(a, b); }
  static V div(V a, V b) { return _mm_div_pd(a, b); }
  static V sqrt(V a) { return _mm_sqrt_pd(a); }
  static V min(V a, V b) { return _mm_min_pd(a, b); }
  static V ge(V a, V b) { return _mm_cmpge_pd(a, b); }
  static V gt(V a, V b) { return _mm_cmpgt_pd(a, b); }
  static V lt(V a, V b) { return _mm_cmplt_pd(a, b); }
  static V le(V a, V b) { return _mm_cmple_pd(a, b); }
  static V nlt(V a, V b) { return _mm_cmpnlt_pd(a, b); }
  static V and_(V a, V b) { return _mm_and_pd(a, b); }
  static V or_(V a, V b) { return _mm_or_pd(a, b); }
  static V andnot(V a, V b) { return _mm_andnot_pd(a, b); }
  static V blend(V m, V a, V b) { return _mm_or_pd(_mm_and_pd(m, a), _mm_andnot_pd(m, b)); }
  static V signbit() { return _mm_set1_pd(-0.0); }
  static V ones() { return _mm_castsi128_pd(_mm_set1_epi32(-1)); }
  static int movemask(V a) { return _mm_movemask_pd(a); }
  using M = V;  // a compare lane is all ones or all zeros
  static M mand(M a, M b) { return and_(a, b); }
  static M mor(M a, M b) { return or_(a, b); }
  static M mandnot(M a, M b) { return andnot(a, b); }  // ~a & b
  static M mfalse() { return zero(); }
  static V select(M m, V v) { return and_(m, v); }        // v where m, else 0
  static V select_not(M m, V v) { return andnot(m, v); }  // 0 where m, else v
  static V sq_add_where(V acc, M m, V v) { return sq_add(acc, select(m, v)); }  // acc + v^2 where m
  // v where m (resp. where not m), old elsewhere; old is what p holds
  static void store_where(T* p, M m, V v, V old) { store(p, blend(m, v, old)); }
  static void store_where_not(T* p, M m, V v, V old) { store(p, blend(m, old, v)); }
  using C = __m128i;
  static C cnt_zero() { return _mm_setzero_si128(); }
  static C cnt_add(C c, V mask) { return _mm_sub_epi64(c, _mm_castpd_si128(mask)); }
  static int64_t cnt_sum(C c) {
    alignas(16) int64_t t[2];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), c);
    return t[0] + t[1];
  }
  static void compress_store(double* dst, V v, int mask) {
    alignas(16) double t[2];
    _mm_store_pd(t, v);
    compress_scalar<double, 2>(dst, t, mask);
  }
  static Acc acc_zero() { return _mm_setzero_pd(); }
  static V sq_add(V acc, V v) { return _mm_add_pd(acc, _mm_mul_pd(v, v)); }
  static void acc_add(Acc& acc, V v) { acc = _mm_add_pd(acc, v); }
  static void acc_sq(Acc& acc, V v) { acc = _mm_add_pd(acc, _mm_mul_pd(v, v)); }
  static double acc_sum(Acc a) {
    double t[2];
    _mm_storeu_pd(t, a);
    return t[0] + t[1];
  }
};
template <typename T>
struct SimdOf;
template <>
struct SimdOf<float> { using type = SimdF; };
template <>
struct SimdOf<double> { using type = SimdD; };
#else
#define PRUNOPT_PRUNADAG_SCALAR_ONLY 1
#endif
#include "prunadag_kernels.inc"
}  // namespace

const Kernels* kernels() {
  static constexpr Kernels k = make_table();
  return &k;
}

}  // namespace DEFAULT
}  // namespace prunadag_cpu
}  // namespace prunopt
