// prunAdag's scan and element passes (prunadag_kernels.inc) for CPUs with
// AVX-512 (F, DQ, with BW and VL as prunopt/vec_capability.h requires for
// the capability): 16 float lanes, compares into mask registers, one-uop
// masked blends, 32 vector registers (the AVX2 element pass spilled its
// constants to the stack and spent three uops per vblendvps on recent cores).
// The element pass does the same IEEE operations per element as the other
// clones (no FMA in it), so it gives the same bits.
//
// Hand-written on purpose: the AVX2 clone's at::vec traits compiled for
// CPU_CAPABILITY=AVX512 (compares as all-ones vectors, blendv, full stores;
// the same intrinsics for rsqrt14, compress and the mask) took 0.92-1.18x the
// time of these with 1 thread (16 paired measurements of prunadag_step_,
// versions 0 and 3, float32 and float64, 66K and 1.3M elements; median 1.02x)
// and 0.96-1.33x with 2 threads (float32 at 1.3M elements 1.15x and 1.33x),
// on a shared 2-vCPU Xeon with AVX-512 (bench/compare_builds.py,
// bench/results/simd_aten.md). No torch header is included here.
#include "prunopt/prunadag_cpu.h"

#include <algorithm>

#if defined(PRUNOPT_PRUNADAG_X86)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx2,fma,popcnt,bmi")
namespace prunopt {
namespace prunadag_cpu {
namespace AVX512 {
namespace {
struct SimdF {
  using T = float;
  using V = __m512;
  using M = __mmask16;
  using Acc = __m512d;
  static constexpr int W = 16;
  static constexpr bool kApprox = true;  // rsqrt14 (relative error <= 2^-14)
  static V rsqrt(V a) { return _mm512_maskz_rsqrt14_ps(0xFFFF, a); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V zero() { return _mm512_setzero_ps(); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_maskz_sqrt_ps(0xFFFF, a); }  // maskz: see lo_pd below
  static V min(V a, V b) { return _mm512_maskz_min_ps(0xFFFF, a, b); }
  static M ge(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static M gt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static M lt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M le(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  static M nlt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLT_UQ); }
  static V and_(V a, V b) { return _mm512_and_ps(a, b); }
  static V or_(V a, V b) { return _mm512_or_ps(a, b); }
  static V andnot(V a, V b) { return _mm512_andnot_ps(a, b); }  // ~a & b
  static V blend(M m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }  // a where m
  static V signbit() { return _mm512_set1_ps(-0.0f); }
  static int movemask(M m) { return static_cast<int>(m); }
  static M mand(M a, M b) { return static_cast<M>(a & b); }
  static M mor(M a, M b) { return static_cast<M>(a | b); }
  static M mandnot(M a, M b) { return static_cast<M>(~a & b); }
  static M mfalse() { return 0; }
  static V select(M m, V v) { return _mm512_maskz_mov_ps(m, v); }
  static V select_not(M m, V v) { return _mm512_maskz_mov_ps(static_cast<M>(~m), v); }
  // v where m (resp. where not m); p keeps what it holds (old) elsewhere
  static void store_where(float* p, M m, V v, V) { _mm512_mask_storeu_ps(p, m, v); }
  static void store_where_not(float* p, M m, V v, V) { _mm512_mask_storeu_ps(p, static_cast<M>(~m), v); }
  using C = __m512i;
  static C cnt_zero() { return _mm512_setzero_si512(); }
  static C cnt_add(C c, M m) { return _mm512_mask_add_epi32(c, m, c, _mm512_set1_epi32(1)); }
  static int64_t cnt_sum(C c) {
    alignas(64) int32_t t[16];
    _mm512_store_si512(t, c);
    int64_t s = 0;
    for (int j = 0; j < 16; ++j) s += t[j];
    return s;
  }
  static void compress_store(float* dst, V v, int mask) {
    _mm512_storeu_ps(dst, _mm512_maskz_compress_ps(static_cast<M>(mask), v));
  }
  // the halves of v in double. Here and in sqrt, min and rsqrt the maskz
  // forms with a full mask: GCC 12 warns (-Wmaybe-uninitialized) about the
  // undefined pass-through operand of the plain intrinsics.
  static __m512d lo_pd(V v) { return _mm512_maskz_cvtps_pd(0xFF, _mm512_maskz_extractf32x8_ps(0xFF, v, 0)); }
  static __m512d hi_pd(V v) { return _mm512_maskz_cvtps_pd(0xFF, _mm512_maskz_extractf32x8_ps(0xFF, v, 1)); }
  static Acc acc_zero() { return _mm512_setzero_pd(); }
  static V sq_add(V acc, V v) { return _mm512_fmadd_ps(v, v, acc); }
  static V sq_add_where(V acc, M m, V v) { return _mm512_mask3_fmadd_ps(v, v, acc, m); }
  static void acc_add(Acc& acc, V v) {
    acc = _mm512_add_pd(acc, _mm512_add_pd(lo_pd(v), hi_pd(v)));
  }
  static void acc_sq(Acc& acc, V v) {
    const __m512d l = lo_pd(v), h = hi_pd(v);
    acc = _mm512_fmadd_pd(l, l, acc);
    acc = _mm512_fmadd_pd(h, h, acc);
  }
  static double acc_sum(Acc a) {
    alignas(64) double t[8];
    _mm512_store_pd(t, a);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  }
};
struct SimdD {
  using T = double;
  using V = __m512d;
  using M = __mmask8;
  using Acc = __m512d;
  static constexpr int W = 8;
  static constexpr bool kApprox = false;
  static V rsqrt(V a) { return a; }  // unused (kApprox = false)
  static V load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, V v) { _mm512_storeu_pd(p, v); }
  static V set1(double v) { return _mm512_set1_pd(v); }
  static V zero() { return _mm512_setzero_pd(); }
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static V sub(V a, V b) { return _mm512_sub_pd(a, b); }
  static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
  static V div(V a, V b) { return _mm512_div_pd(a, b); }
  static V sqrt(V a) { return _mm512_maskz_sqrt_pd(0xFF, a); }
  static V min(V a, V b) { return _mm512_maskz_min_pd(0xFF, a, b); }
  static M ge(V a, V b) { return _mm512_cmp_pd_mask(a, b, _CMP_GE_OQ); }
  static M gt(V a, V b) { return _mm512_cmp_pd_mask(a, b, _CMP_GT_OQ); }
  static M lt(V a, V b) { return _mm512_cmp_pd_mask(a, b, _CMP_LT_OQ); }
  static M le(V a, V b) { return _mm512_cmp_pd_mask(a, b, _CMP_LE_OQ); }
  static M nlt(V a, V b) { return _mm512_cmp_pd_mask(a, b, _CMP_NLT_UQ); }
  static V and_(V a, V b) { return _mm512_and_pd(a, b); }
  static V or_(V a, V b) { return _mm512_or_pd(a, b); }
  static V andnot(V a, V b) { return _mm512_andnot_pd(a, b); }
  static V blend(M m, V a, V b) { return _mm512_mask_blend_pd(m, b, a); }
  static V signbit() { return _mm512_set1_pd(-0.0); }
  static int movemask(M m) { return static_cast<int>(m); }
  static M mand(M a, M b) { return static_cast<M>(a & b); }
  static M mor(M a, M b) { return static_cast<M>(a | b); }
  static M mandnot(M a, M b) { return static_cast<M>(~a & b); }
  static M mfalse() { return 0; }
  static V select(M m, V v) { return _mm512_maskz_mov_pd(m, v); }
  static V select_not(M m, V v) { return _mm512_maskz_mov_pd(static_cast<M>(~m), v); }
  static void store_where(double* p, M m, V v, V) { _mm512_mask_storeu_pd(p, m, v); }
  static void store_where_not(double* p, M m, V v, V) { _mm512_mask_storeu_pd(p, static_cast<M>(~m), v); }
  using C = __m512i;
  static C cnt_zero() { return _mm512_setzero_si512(); }
  static C cnt_add(C c, M m) { return _mm512_mask_add_epi64(c, m, c, _mm512_set1_epi64(1)); }
  static int64_t cnt_sum(C c) {
    alignas(64) int64_t t[8];
    _mm512_store_si512(t, c);
    int64_t s = 0;
    for (int j = 0; j < 8; ++j) s += t[j];
    return s;
  }
  static void compress_store(double* dst, V v, int mask) {
    _mm512_storeu_pd(dst, _mm512_maskz_compress_pd(static_cast<M>(mask), v));
  }
  static Acc acc_zero() { return _mm512_setzero_pd(); }
  static V sq_add(V acc, V v) { return _mm512_fmadd_pd(v, v, acc); }
  static V sq_add_where(V acc, M m, V v) { return _mm512_mask3_fmadd_pd(v, v, acc, m); }
  static void acc_add(Acc& acc, V v) { acc = _mm512_add_pd(acc, v); }
  static void acc_sq(Acc& acc, V v) { acc = _mm512_fmadd_pd(v, v, acc); }
  static double acc_sum(Acc a) {
    alignas(64) double t[8];
    _mm512_store_pd(t, a);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  }
};
template <typename T>
struct SimdOf;
template <>
struct SimdOf<float> { using type = SimdF; };
template <>
struct SimdOf<double> { using type = SimdD; };
#include "prunadag_kernels.inc"
}  // namespace

const Kernels* kernels() {
  static constexpr Kernels k = make_table();
  return &k;
}

}  // namespace AVX512
}  // namespace prunadag_cpu
}  // namespace prunopt
#pragma GCC pop_options
#endif
