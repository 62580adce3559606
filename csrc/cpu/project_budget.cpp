// Exact budget projection on the CPU (SPEC.md section 1).
//
// The multiplier lam* is found by a histogram-refined bisection: each pass over
// the data sorts every breakpoint (key2 = (t-1)/c and key1 = t/c) into one of B
// buckets of the current bracket [lo, hi) and accumulates, per bucket, the sums
// that define phi (prunopt/projection.h). A prefix scan over the buckets gives
// phi exactly at every bucket boundary, so one pass narrows the bracket by a
// factor B instead of 2. As soon as the bucket holding the sign change contains
// no breakpoint, phi is a single linear piece there and its root is one
// division: the result is the exact projection, not a bisection approximation.
//
// The first pass also validates the input (finite theta, positive finite cost)
// and brackets optimistically with [0, 1], where lam* lies for scores that were
// in [0, 1] before an optimizer step; on typical data two passes suffice, then
// one pass writes clamp(t - lam* c, 0, 1). Passes run in parallel over fixed
// chunks of all tensors at once (deterministic for a given thread count), reduce
// in double and allocate nothing of size n.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "prunopt/checks.h"
#include "prunopt/projection_entry.h"
#include "prunopt/cpu_math.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include "prunopt/projection.h"

namespace prunopt {
namespace cpu {
namespace {

using projection::Delta;
using projection::Piece;

constexpr int64_t kGrain = 1 << 15;     // elements per chunk at least
constexpr int64_t kMaxBuckets = 1 << 16;
constexpr int kMaxLevels = 200;         // never reached: doubles run out first

struct Segment {
  const void* t;
  const void* c;  // nullptr: unit cost
  void* out;
  int64_t n;
  int64_t offset;  // start in the concatenated index space
};

// Per-chunk accumulators of one pass.
struct ChunkAcc {
  Piece at_lo;            // U and F at lam = lo
  Piece at_zero;          // first pass only: U and F at lam = 0
  std::vector<Delta> hist;
  double max_key1 = -std::numeric_limits<double>::infinity();
  bool bad_theta = false;
  bool bad_cost = false;
};

// Calls f(segment, local_begin, local_end) for the parts of [begin, end).
template <typename F>
void for_each_piece(const std::vector<Segment>& segs, int64_t begin, int64_t end, F&& f) {
  // segments are few (one per tensor); a linear scan is cheaper than a search
  for (const auto& s : segs) {
    const int64_t b = std::max(begin, s.offset);
    const int64_t e = std::min(end, s.offset + s.n);
    if (b < e) {
      f(s, b - s.offset, e - s.offset);
    }
  }
}

int64_t num_chunks(int64_t total) {
  const int64_t by_size = (total + kGrain - 1) / kGrain;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), by_size));
}

// One pass: keys below `lo` go to acc.below, keys in [lo, hi) to bucket
// floor((key - lo) * B / (hi - lo)), keys >= hi nowhere (still ahead of lam).
// The first pass also validates, totals the costs, finds max key1 and sums
// "below 0" (for the slack test phi(0) <= 0) into acc.below0.
//
// Each block of kBlock elements is read twice while it sits in L1: once by a
// vectorised reduction (omp simd, which may reassociate the sums), once by the
// scatter loop that only acts on the keys inside the bracket (a few percent
// of them on the first pass, almost none later).
constexpr int64_t kBlock = 2048;
constexpr int kLanes = 4;

// Lane-wise partial sums: kLanes independent accumulators per quantity, so
// the adds do not form one long dependency chain.
struct Lanes {
  double u[kLanes] = {}, fct[kLanes] = {}, fcc[kLanes] = {};
  double u0[kLanes] = {}, f0ct[kLanes] = {}, f0cc[kLanes] = {};
  double maxk1[kLanes], bad_t[kLanes] = {}, bad_c[kLanes] = {};
  Lanes() {
    for (int l = 0; l < kLanes; ++l) {
      maxk1[l] = -std::numeric_limits<double>::infinity();
    }
  }
};

// At lam: i is in U if key2 >= lam, in F if key2 < lam <= key1, else in L.
template <typename scalar_t, bool kCost, bool kFirst>
inline void reduce_one(const scalar_t* tp, const scalar_t* cp, int64_t i, double lo, Lanes& L, int l) {
  using cpu_math::select_lt;
  const double t = static_cast<double>(tp[i]);
  const double c = kCost ? static_cast<double>(cp[i]) : 1.0;
  const double key1 = kCost ? t / c : t;
  const double key2 = kCost ? (t - 1.0) / c : t - 1.0;
  const double ct = c * t, cc = c * c;
  L.u[l] += c - select_lt(key2, lo, c);
  const double in_f = select_lt(key2, lo, 1.0) - select_lt(key1, lo, 1.0);  // 1 or 0
  L.fct[l] += in_f * ct;
  L.fcc[l] += in_f * cc;
  if (kFirst) {
    L.u0[l] += c - select_lt(key2, 0.0, c);
    const double in_f0 = select_lt(key2, 0.0, 1.0) - select_lt(key1, 0.0, 1.0);
    L.f0ct[l] += in_f0 * ct;
    L.f0cc[l] += in_f0 * cc;
    L.bad_t[l] += t - t;  // 0 for finite t, nan otherwise
    if (kCost) {
      L.bad_c[l] += (c - c) + select_lt(c, 0.0, 1.0) + static_cast<double>(c == 0.0);
    }
    L.maxk1[l] = cpu_math::maxd(L.maxk1[l], key1);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define PRUNOPT_HAVE_AVX2_PATH 1
// ---------------------------------------------------------------------------
// AVX2 fast path: float32 scores with unit costs (the common case). Sets are
// decided by float comparisons against thresholds rounded *up* to float, which
// for float scores is the same as comparing in double: t >= ceil_f(x) <=> t >= x.
// Sums are accumulated in double lanes (cvtps2pd), as in the scalar path.

inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// Smallest float >= x (x finite or +-inf).
inline float ceil_to_float(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) {
    f = std::nextafter(f, std::numeric_limits<float>::infinity());
  }
  return f;
}

struct FastAcc {
  double u = 0, fct = 0, fcc = 0;      // at lo
  double u0 = 0, f0ct = 0, f0cc = 0;   // at 0 (first pass)
  float maxk1 = -std::numeric_limits<float>::infinity();
  bool bad = false;
};

__attribute__((target("avx2,fma"))) inline double hsum(__m256d v) {
  __m128d lo = _mm256_castpd256_pd128(v), hi = _mm256_extractf128_pd(v, 1);
  lo = _mm_add_pd(lo, hi);
  return _mm_cvtsd_f64(_mm_add_sd(lo, _mm_unpackhi_pd(lo, lo)));
}

// Adds a float vector to two double accumulators.
__attribute__((target("avx2,fma"))) inline void add_ps(__m256d& a0, __m256d& a1, __m256 x) {
  a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
  a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}

// One block [b, e) of a float tensor; `scatter(i)` handles an element with a
// key inside the bracket.
template <bool kFirst, typename Scatter>
__attribute__((target("avx2,fma"))) void fast_block(const float* tp, int64_t b, int64_t e, double lo, double hi,
    FastAcc& acc, Scatter&& scatter) {
  const __m256 A = _mm256_set1_ps(ceil_to_float(lo));         // key1 >= lo
  const __m256 B = _mm256_set1_ps(ceil_to_float(lo + 1.0));   // key2 >= lo
  const __m256 H1 = _mm256_set1_ps(ceil_to_float(hi));        // key1 < hi
  const __m256 H2 = _mm256_set1_ps(ceil_to_float(hi + 1.0));  // key2 < hi
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  __m256d u0 = _mm256_setzero_pd(), u1 = u0, f0 = u0, f1 = u0, c0 = u0, c1 = u0;
  __m256d z_u0 = u0, z_u1 = u0, z_f0 = u0, z_f1 = u0, z_c0 = u0, z_c1 = u0;
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 vbad = zero;
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    const __m256 x = _mm256_loadu_ps(tp + i);
    const __m256 in_u = _mm256_cmp_ps(x, B, _CMP_GE_OQ);
    const __m256 in_f = _mm256_andnot_ps(in_u, _mm256_cmp_ps(x, A, _CMP_GE_OQ));
    add_ps(u0, u1, _mm256_and_ps(in_u, one));
    add_ps(f0, f1, _mm256_and_ps(in_f, x));
    add_ps(c0, c1, _mm256_and_ps(in_f, one));
    if (kFirst) {
      const __m256 zu = _mm256_cmp_ps(x, one, _CMP_GE_OQ);
      const __m256 zf = _mm256_andnot_ps(zu, _mm256_cmp_ps(x, zero, _CMP_GE_OQ));
      add_ps(z_u0, z_u1, _mm256_and_ps(zu, one));
      add_ps(z_f0, z_f1, _mm256_and_ps(zf, x));
      add_ps(z_c0, z_c1, _mm256_and_ps(zf, one));
      vmax = _mm256_max_ps(vmax, x);
      vbad = _mm256_or_ps(vbad, _mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_NEQ_UQ));  // inf or nan
    }
    const __m256 k1 = _mm256_and_ps(_mm256_cmp_ps(x, A, _CMP_GE_OQ), _mm256_cmp_ps(x, H1, _CMP_LT_OQ));
    const __m256 k2 = _mm256_and_ps(in_u, _mm256_cmp_ps(x, H2, _CMP_LT_OQ));
    int bits = _mm256_movemask_ps(_mm256_or_ps(k1, k2));
    while (bits) {
      const int l = __builtin_ctz(bits);
      bits &= bits - 1;
      scatter(i + l);
    }
  }
  FastAcc tail;
  for (; i < e; ++i) {  // the last < 8 elements, in double
    const double t = tp[i];
    if (t - 1.0 >= lo) {
      tail.u += 1;
    } else if (t >= lo) {
      tail.fct += t;
      tail.fcc += 1;
    }
    if (kFirst) {
      if (t >= 1.0) tail.u0 += 1; else if (t >= 0.0) { tail.f0ct += t; tail.f0cc += 1; }
      tail.maxk1 = std::max(tail.maxk1, tp[i]);
      tail.bad |= !std::isfinite(t);
    }
    if ((t - 1.0 >= lo && t - 1.0 < hi) || (t >= lo && t < hi)) {
      scatter(i);
    }
  }
  acc.u += hsum(_mm256_add_pd(u0, u1)) + tail.u;
  acc.fct += hsum(_mm256_add_pd(f0, f1)) + tail.fct;
  acc.fcc += hsum(_mm256_add_pd(c0, c1)) + tail.fcc;
  if (kFirst) {
    acc.u0 += hsum(_mm256_add_pd(z_u0, z_u1)) + tail.u0;
    acc.f0ct += hsum(_mm256_add_pd(z_f0, z_f1)) + tail.f0ct;
    acc.f0cc += hsum(_mm256_add_pd(z_c0, z_c1)) + tail.f0cc;
    float m[8];
    _mm256_storeu_ps(m, vmax);
    for (float v : m) acc.maxk1 = std::max(acc.maxk1, v);
    acc.maxk1 = std::max(acc.maxk1, tail.maxk1);
    acc.bad |= _mm256_movemask_ps(vbad) != 0 || tail.bad;
  }
}

__attribute__((target("avx2,fma"))) void fast_apply(const float* tp, float* op, int64_t b, int64_t e, double lam) {
  const __m256d L = _mm256_set1_pd(lam), Z = _mm256_setzero_pd(), O = _mm256_set1_pd(1.0);
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    const __m256 x = _mm256_loadu_ps(tp + i);
    __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d c = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    a = _mm256_min_pd(_mm256_max_pd(_mm256_sub_pd(a, L), Z), O);
    c = _mm256_min_pd(_mm256_max_pd(_mm256_sub_pd(c, L), Z), O);
    _mm256_storeu_ps(op + i, _mm256_set_m128(_mm256_cvtpd_ps(c), _mm256_cvtpd_ps(a)));
  }
  for (; i < e; ++i) {
    op[i] = static_cast<float>(cpu_math::clamp01(static_cast<double>(tp[i]) - lam));
  }
}
#endif  // x86-64 GCC/Clang

// One pass over all tensors: U and F at lam = lo, and the breakpoints inside
// [lo, hi) sorted into `buckets` buckets of equal width. The first pass also
// validates, finds max key1 and sums U and F at lam = 0 (the slack test).
//
// Each block of kBlock elements is read twice while it sits in L1: once by the
// lane-wise reduction, once by the scatter loop that only acts on the keys
// inside the bracket (a few percent of them on the first pass, almost none
// later).
template <typename scalar_t, bool kCost, bool kFirst>
void level_pass(
    const std::vector<Segment>& segs,
    int64_t total,
    double lo,
    double hi,
    int64_t buckets,
    std::vector<ChunkAcc>& accs) {
  const int64_t nchunks = static_cast<int64_t>(accs.size());
  const double scale = static_cast<double>(buckets) / (hi - lo);
  const double last = static_cast<double>(buckets - 1);
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      ChunkAcc& a = accs[ch];
      a.hist.assign(buckets, Delta{});
      Delta* hist = a.hist.data();
      Lanes L;
#ifdef PRUNOPT_HAVE_AVX2_PATH
      FastAcc fast;
#endif
      for_each_piece(segs, total * ch / nchunks, total * (ch + 1) / nchunks,
          [&](const Segment& s, int64_t b, int64_t e) {
        const scalar_t* tp = static_cast<const scalar_t*>(s.t);
        const scalar_t* cp = static_cast<const scalar_t*>(s.c);
#ifdef PRUNOPT_HAVE_AVX2_PATH
        if constexpr (std::is_same_v<scalar_t, float> && !kCost) {
          if (cpu_has_avx2()) {
            fast_block<kFirst>(tp, b, e, lo, hi, fast, [&](int64_t i) {
              const double t = tp[i];
              if (t - 1.0 >= lo && t - 1.0 < hi) {
                hist[static_cast<int64_t>(std::min((t - 1.0 - lo) * scale, last))].add2(t, 1.0);
              }
              if (t >= lo && t < hi) {
                hist[static_cast<int64_t>(std::min((t - lo) * scale, last))].add1(t, 1.0);
              }
            });
            return;
          }
        }
#endif
        for (int64_t b0 = b; b0 < e; b0 += kBlock) {
          const int64_t e0 = std::min(e, b0 + kBlock);
          int64_t i = b0;
          for (; i + kLanes <= e0; i += kLanes) {
            for (int l = 0; l < kLanes; ++l) {
              reduce_one<scalar_t, kCost, kFirst>(tp, cp, i + l, lo, L, l);
            }
          }
          for (; i < e0; ++i) {
            reduce_one<scalar_t, kCost, kFirst>(tp, cp, i, lo, L, 0);
          }
          for (i = b0; i < e0; ++i) {
            const double t = static_cast<double>(tp[i]);
            const double c = kCost ? static_cast<double>(cp[i]) : 1.0;
            const double key1 = kCost ? t / c : t;
            const double key2 = kCost ? (t - 1.0) / c : t - 1.0;
            if (key2 >= lo && key2 < hi) {
              hist[static_cast<int64_t>(std::min((key2 - lo) * scale, last))].add2(t, c);
            }
            if (key1 >= lo && key1 < hi) {
              hist[static_cast<int64_t>(std::min((key1 - lo) * scale, last))].add1(t, c);
            }
          }
        }
      });
      Piece at_lo, at_zero;
      double max_key1 = -std::numeric_limits<double>::infinity(), bad_t = 0, bad_c = 0;
      for (int l = 0; l < kLanes; ++l) {
        at_lo.merge(Piece{L.u[l], L.fct[l], L.fcc[l]});
        at_zero.merge(Piece{L.u0[l], L.f0ct[l], L.f0cc[l]});
        max_key1 = std::max(max_key1, L.maxk1[l]);
        bad_t += L.bad_t[l];
        bad_c += L.bad_c[l];
      }
#ifdef PRUNOPT_HAVE_AVX2_PATH
      at_lo.merge(Piece{fast.u, fast.fct, fast.fcc});
      at_zero.merge(Piece{fast.u0, fast.f0ct, fast.f0cc});
      max_key1 = std::max(max_key1, static_cast<double>(fast.maxk1));
      bad_t += fast.bad ? 1.0 : 0.0;
#endif
      a.at_lo = at_lo;
      if (kFirst) {
        a.at_zero = at_zero;
        a.max_key1 = max_key1;
        a.bad_theta = !(bad_t == 0.0);  // nan-propagating
        a.bad_cost = !(bad_c == 0.0);
      }
    }
  });
}

// Merges the chunks into accs[0].
void reduce_chunks(std::vector<ChunkAcc>& accs, int64_t buckets, bool first) {
  ChunkAcc& r = accs[0];
  for (size_t k = 1; k < accs.size(); ++k) {
    const ChunkAcc& a = accs[k];
    r.at_lo.merge(a.at_lo);
    for (int64_t j = 0; j < buckets; ++j) {
      r.hist[j].merge(a.hist[j]);
    }
    if (first) {
      r.at_zero.merge(a.at_zero);
      r.max_key1 = std::max(r.max_key1, a.max_key1);
      r.bad_theta |= a.bad_theta;
      r.bad_cost |= a.bad_cost;
    }
  }
}

int64_t buckets_for(int64_t keys) {
  int64_t b = 16;
  while (b < kMaxBuckets && b < 2 * keys) {
    b *= 2;
  }
  return b;
}

// Brackets lam* from a strided sample of m elements: solve the sample's own
// problem (budget scaled by m / n) by sorting its 2m breakpoints, then widen
// by kMargin sample keys on each side. This only steers the first pass: a bad
// guess costs one more pass, never accuracy.
template <typename scalar_t, bool kCost>
std::pair<double, double> sample_bracket(const std::vector<Segment>& segs, int64_t total, double budget) {
  const int64_t m = std::min<int64_t>(total, 4096);
  struct Key {
    double key, t, c;
    bool upper;  // key2: leaving U
  };
  std::vector<Key> keys;
  keys.reserve(2 * m);
  double sum_c = 0;
  size_t seg = 0;
  for (int64_t k = 0; k < m; ++k) {
    const int64_t g = (total / m) * k + (total % m) * k / m;  // spread over [0, total)
    while (g >= segs[seg].offset + segs[seg].n) {
      ++seg;
    }
    const int64_t i = g - segs[seg].offset;
    const double t = static_cast<double>(static_cast<const scalar_t*>(segs[seg].t)[i]);
    const double c = kCost ? static_cast<double>(static_cast<const scalar_t*>(segs[seg].c)[i]) : 1.0;
    if (!std::isfinite(t) || !std::isfinite(c) || !(c > 0)) {
      continue;  // the full pass reports it
    }
    keys.push_back(Key{(t - 1.0) / c, t, c, true});
    keys.push_back(Key{t / c, t, c, false});
    sum_c += c;
  }
  std::sort(keys.begin(), keys.end(), [](const Key& x, const Key& y) { return x.key < y.key; });
  const double budget_s = budget * static_cast<double>(m) / static_cast<double>(total);
  double s_u = sum_c, s_ct = 0, s_cc = 0;
  const int64_t nk = static_cast<int64_t>(keys.size());
  int64_t root = nk - 1;
  for (int64_t k = 0; k < nk; ++k) {
    const Key& x = keys[k];
    if (x.upper) {
      s_u -= x.c;
      s_ct += x.c * x.t;
      s_cc += x.c * x.c;
    } else {
      s_ct -= x.c * x.t;
      s_cc -= x.c * x.c;
    }
    if (s_u + s_ct - x.key * s_cc - budget_s <= 0.0) {
      root = k;
      break;
    }
  }
  if (nk == 0) {
    return {0.0, 1.0};
  }
  // the root's rank in the sample has a standard deviation of at most
  // sqrt(nk) / 2 keys: a margin of 3 sigma misses rarely (one more pass)
  const int64_t margin = 8 + static_cast<int64_t>(1.5 * std::sqrt(static_cast<double>(nk)));
  double lo = std::max(0.0, keys[std::max<int64_t>(0, root - margin)].key);
  double hi = keys[std::min<int64_t>(nk - 1, root + margin)].key;
  if (!(hi > lo)) {
    hi = lo + std::max(1.0, std::abs(lo));  // degenerate sample: any valid bracket
  }
  return {lo, hi};
}

template <typename scalar_t, bool kCost>
double solve_lambda(const std::vector<Segment>& segs, int64_t total, double budget, const char* op) {
  std::vector<ChunkAcc> accs(num_chunks(total));
  // Small inputs: a pass is cheaper than the sample; bracket [0, 1) instead.
  auto [lo, hi] = total < (1 << 16) ? std::pair<double, double>{0.0, 1.0}
                                    : sample_bracket<scalar_t, kCost>(segs, total, budget);
  int64_t buckets = 4096;
  level_pass<scalar_t, kCost, true>(segs, total, lo, hi, buckets, accs);
  reduce_chunks(accs, buckets, /*first=*/true);
  TORCH_CHECK_VALUE(!accs[0].bad_theta, op, ": theta contains a non-finite value");
  TORCH_CHECK_VALUE(!accs[0].bad_cost, op, ": cost must be positive and finite everywhere");

  if (projection::phi(accs[0].at_zero, 0.0, budget) <= 0.0) {
    return 0.0;  // slack budget: theta* = clamp(t, 0, 1)
  }
  if (budget == 0.0) {
    return std::numeric_limits<double>::infinity();  // all zeros
  }
  // Invariant: phi(known_lo) > 0 >= phi(known_hi); phi(max key1) = -S < 0.
  double known_lo = 0.0, known_hi = accs[0].max_key1;
  for (int level = 0; level < kMaxLevels; ++level) {
    const ChunkAcc& r = accs[0];
    Piece acc = r.at_lo;
    bool narrowed = false;
    if (projection::phi(acc, lo, budget) <= 0.0) {
      known_hi = std::min(known_hi, lo);  // the bracket lies above the root
    } else {
      known_lo = std::max(known_lo, lo);
      const double width = (hi - lo) / static_cast<double>(buckets);
      double bucket_lo = lo;
      for (int64_t j = 0; j < buckets; ++j) {
        const double bucket_hi = (j + 1 == buckets) ? hi : lo + width * static_cast<double>(j + 1);
        const Piece next = projection::cross(acc, r.hist[j]);
        if (projection::phi(next, bucket_hi, budget) <= 0.0) {
          const long long keys = r.hist[j].keys();
          if (keys == 0 || !(bucket_hi > bucket_lo) || bucket_lo + width == bucket_lo) {
            // one linear piece (or the bracket cannot shrink): exact root
            const double lam = projection::piece_root(acc, budget, bucket_hi);
            return std::min(std::max(lam, bucket_lo), bucket_hi);
          }
          known_lo = bucket_lo;
          known_hi = std::min(bucket_hi, known_hi);
          buckets = buckets_for(keys);
          narrowed = true;
          break;
        }
        acc = next;
        bucket_lo = bucket_hi;
      }
      if (!narrowed) {
        known_lo = std::max(known_lo, hi);  // the bracket lies below the root
      }
    }
    if (!narrowed) {
      buckets = 4096;
    }
    lo = known_lo;
    hi = known_hi;
    if (!(hi > lo)) {
      return hi;
    }
    level_pass<scalar_t, kCost, false>(segs, total, lo, hi, buckets, accs);
    reduce_chunks(accs, buckets, /*first=*/false);
  }
  return hi;
}

template <typename scalar_t, bool kCost>
void apply(const std::vector<Segment>& segs, int64_t total, double lam) {
  const int64_t nchunks = num_chunks(total);
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      for_each_piece(segs, total * ch / nchunks, total * (ch + 1) / nchunks,
          [&](const Segment& s, int64_t b, int64_t e) {
            const scalar_t* tp = static_cast<const scalar_t*>(s.t);
            const scalar_t* cp = static_cast<const scalar_t*>(s.c);
            scalar_t* op = static_cast<scalar_t*>(s.out);
#ifdef PRUNOPT_HAVE_AVX2_PATH
            if constexpr (std::is_same_v<scalar_t, float> && !kCost) {
              if (cpu_has_avx2()) {
                fast_apply(tp, op, b, e, lam);
                return;
              }
            }
#endif
            for (int64_t i = b; i < e; ++i) {
              const double c = kCost ? static_cast<double>(cp[i]) : 1.0;
              op[i] = static_cast<scalar_t>(cpu_math::clamp01(static_cast<double>(tp[i]) - lam * c));
            }
          });
    }
  });
}

// Projects `inputs` (contiguous) into `outputs` (contiguous, may alias inputs).
void project_into(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& costs,
    const std::vector<at::Tensor>& outputs,
    double budget,
    const char* op) {
  std::vector<Segment> segs;
  int64_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t n = inputs[i].numel();
    if (n == 0) {
      continue;
    }
    segs.push_back(Segment{inputs[i].data_ptr(), costs.empty() ? nullptr : costs[i].data_ptr(),
        outputs[i].data_ptr(), n, total});
    total += n;
  }
  if (total == 0) {
    return;
  }
  const bool has_cost = !costs.empty();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, inputs[0].scalar_type(), "project_budget", [&] {
    if (has_cost) {
      apply<scalar_t, true>(segs, total, solve_lambda<scalar_t, true>(segs, total, budget, op));
    } else {
      apply<scalar_t, false>(segs, total, solve_lambda<scalar_t, false>(segs, total, budget, op));
    }
  });
}

std::vector<at::Tensor> project_budget_cpu(
    at::TensorList theta, c10::optional<at::TensorList> cost, double budget) {
  return project_budget_entry(theta, cost, budget, project_into);
}

void project_budget_inplace_cpu(
    at::TensorList theta, c10::optional<at::TensorList> cost, double budget) {
  project_budget_inplace_entry(theta, cost, budget, project_into);
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("project_budget", &prunopt::cpu::project_budget_cpu);
  m.impl("project_budget_", &prunopt::cpu::project_budget_inplace_cpu);
}
