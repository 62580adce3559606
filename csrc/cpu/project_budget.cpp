// Exact budget projection on the CPU (ProM supplement A.2).
//
// solve_lambda (the fast solver, below) brackets the multiplier lam* from a
// sample, sorts every element into L / U / F / "breakpoint inside the bracket"
// in one fused pass (summing U and F in double, copying the last class into a
// small buffer), and solves the buffer exactly; docs/projection.md has the
// details. When the sample misleads, it falls back to solve_lambda_histogram:
//
// a histogram-refined bisection: each pass over
// the data sorts every breakpoint (key2 = (t-1)/c and key1 = t/c) into one of B
// buckets of the current bracket [lo, hi) and accumulates, per bucket, the sums
// that define phi (prunopt/projection.h). A prefix scan over the buckets gives
// phi exactly at every bucket boundary, so one pass narrows the bracket by a
// factor B instead of 2. As soon as the bucket holding the sign change contains
// no breakpoint, phi is a single linear piece there and its root is one
// division: the result is the exact projection, not a bisection approximation.
//
// Both validate the input (finite theta, positive finite cost) in their first
// pass, before anything is written; then one pass writes
// clamp(t - lam* c, 0, 1). Passes run in parallel over fixed chunks of all
// tensors at once (deterministic for a given thread count) and reduce in
// double. float32 scores with unit costs and the small exact sets take
// vectorised passes on ATen's at::vec::Vectorized, compiled per CPU capability
// (project_budget_kernels.inc; see vec_kernels below).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "prunopt/checks.h"
#include "prunopt/projection_entry.h"
#include "prunopt/cpu_math.h"
#include "prunopt/project_budget_cpu.h"
#include "prunopt/vec_capability.h"
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include "prunopt/projection.h"

namespace prunopt {
namespace cpu {
namespace {

using projection::Delta;
using projection::Piece;
using projection_cpu::ceil_to_float;
using projection_cpu::floor_to_float;
using projection_cpu::PieceAt;

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
  // Adds the sums of one block (two-level summation: a chunk's sums are sums of
  // block sums, so n equal addends, e.g. tied scores, no longer accumulate one
  // rounding each into one long running sum: 6.5e-12 off in float64 at 1e6 ties).
  void absorb(const Lanes& o) {
    for (int l = 0; l < kLanes; ++l) {
      u[l] += o.u[l];
      fct[l] += o.fct[l];
      fcc[l] += o.fcc[l];
      u0[l] += o.u0[l];
      f0ct[l] += o.f0ct[l];
      f0cc[l] += o.f0cc[l];
      maxk1[l] = std::max(maxk1[l], o.maxk1[l]);
      bad_t[l] += o.bad_t[l];
      bad_c[l] += o.bad_c[l];
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

// ---------------------------------------------------------------------------
// Vectorised passes: float32 scores with unit costs (the common case) and the
// small exact sets, on ATen's at::vec::Vectorized compiled per capability
// (project_budget_kernels.inc, project_budget_avx2.cpp / _avx512.cpp). The
// kernels of the capability this CPU runs now, or nullptr for the scalar
// loops (the DEFAULT capability: CPUs without AVX2, ATEN_CPU_CAPABILITY=default,
// PRUNOPT_NO_SIMD=1). Reads the environment: once per pass.
// The DEFAULT capability keeps the scalar loops on purpose: the same kernels
// compiled for CPU_CAPABILITY=DEFAULT (Vectorized's arrays, lane-by-lane
// helpers for the widening, movemask and the left-packing store) took
// 1.9-2.2x their time (float32, unit costs, 64K-8M elements and the histogram
// solver, 1 thread, both builds under ATEN_CPU_CAPABILITY=default;
// bench/compare_builds.py --ops projection, bench/results/simd_aten.md).
const projection_cpu::Kernels* vec_kernels() {
#if PRUNOPT_VEC_X86
  switch (vec::cpu_capability()) {
    case vec::Capability::kAvx512:
      return projection_cpu::AVX512::kernels();
    case vec::Capability::kAvx2:
      return projection_cpu::AVX2::kernels();
    default:
      break;
  }
#endif
  return nullptr;
}

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
  const projection_cpu::Kernels* vk = vec_kernels();
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      ChunkAcc& a = accs[ch];
      a.hist.assign(buckets, Delta{});
      Delta* hist = a.hist.data();
      Lanes L;
      projection_cpu::LevelAcc fast;
      for_each_piece(segs, total * ch / nchunks, total * (ch + 1) / nchunks,
          [&](const Segment& s, int64_t b, int64_t e) {
        const scalar_t* tp = static_cast<const scalar_t*>(s.t);
        const scalar_t* cp = static_cast<const scalar_t*>(s.c);
        if constexpr (std::is_same_v<scalar_t, float> && !kCost) {
          if (vk != nullptr) {
            vk->level_block[kFirst](tp, b, e, lo, hi, scale, last, hist, fast);
            return;
          }
        }
        for (int64_t b0 = b; b0 < e; b0 += kBlock) {
          const int64_t e0 = std::min(e, b0 + kBlock);
          int64_t i = b0;
          Lanes Lb;
          for (; i + kLanes <= e0; i += kLanes) {
            for (int l = 0; l < kLanes; ++l) {
              reduce_one<scalar_t, kCost, kFirst>(tp, cp, i + l, lo, Lb, l);
            }
          }
          for (; i < e0; ++i) {
            reduce_one<scalar_t, kCost, kFirst>(tp, cp, i, lo, Lb, 0);
          }
          L.absorb(Lb);
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
      at_lo.merge(Piece{fast.u, fast.fct, fast.fcc});
      at_zero.merge(Piece{fast.u0, fast.f0ct, fast.f0cc});
      max_key1 = std::max(max_key1, static_cast<double>(fast.maxk1));
      bad_t += fast.bad ? 1.0 : 0.0;
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

// The fallback solver (see solve_lambda): correct for any input, at the price
// of two or more passes. `hint`, if it is a valid bracket, replaces the sample.
template <typename scalar_t, bool kCost>
double solve_lambda_histogram(const std::vector<Segment>& segs, int64_t total, double budget, const char* op,
    std::pair<double, double> hint = {0.0, 0.0}) {
  std::vector<ChunkAcc> accs(num_chunks(total));
  // Small inputs: a pass is cheaper than the sample; bracket [0, 1) instead.
  auto [lo, hi] = hint.second > hint.first && hint.first >= 0.0 && std::isfinite(hint.second) ? hint
      : total < (1 << 16) ? std::pair<double, double>{0.0, 1.0}
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
  // Invariant: phi(v_lo) > 0 >= phi(v_hi), both established by sums taken
  // directly over the data (every pass sums U and F at its lo; phi(max key1) =
  // -S < 0). Crossing the buckets (running sums, projection::cross) only
  // *proposes* the next bracket: the crossing subtracts, and with costs over
  // several orders of magnitude (c^2 up to 1e12) the running sums cancelled to
  // a few digits, picked a wrong bucket and missed the root by up to 2e-2. The
  // next pass's direct sums confirm or refute the proposal, and the root is
  // taken from the direct sums of a bracket that the pass found free of
  // breakpoints (phi is one linear piece there).
  double v_lo = 0.0, v_hi = accs[0].max_key1;
  bool piece = false;  // the bracket was proposed as one linear piece (one bucket)
  double reach = 0.0;  // after a refuted proposal: how far below it the next bracket starts
  for (int level = 0; level < kMaxLevels; ++level) {
    const ChunkAcc& r = accs[0];
    const Piece direct = r.at_lo;
    if (projection::phi(direct, lo, budget) <= 0.0) {
      // the root lies below lo. The running sums that proposed [lo, hi) were
      // close, so the next bracket reaches down from lo by a width that grows
      // 16-fold with each refutation in a row (rather than going back to v_lo,
      // far below, whence the crossing would cancel as much again)
      v_hi = std::min(v_hi, lo);
      reach = reach > 0.0 ? reach * 16.0 : 16.0 * std::max(hi - lo, std::abs(lo) * 0x1p-40);
      lo = std::max(v_lo, v_hi - reach);
      hi = v_hi;
      buckets = 4096;
      piece = false;
    } else {
      reach = 0.0;
      v_lo = std::max(v_lo, lo);
      const long long keys_in_bracket = piece ? r.hist[0].keys() : -1;
      if (keys_in_bracket == 0) {
        // no breakpoint in [lo, hi): phi is linear there, with the direct sums at lo
        // (no free element: phi is a constant > 0 there, the root lies above)
        const double lam = projection::piece_root(direct, budget, std::numeric_limits<double>::infinity());
        if (lam <= hi) {
          return std::max(lam, lo);
        }
        v_lo = std::max(v_lo, hi);  // phi(hi) > 0 on that piece: the root lies above
        lo = v_lo;
        hi = v_hi;
        buckets = 4096;
        piece = false;
      } else {
        piece = false;
        Piece acc = direct;
        const double width = (hi - lo) / static_cast<double>(buckets);
        double bucket_lo = lo;
        bool proposed = false;
        for (int64_t j = 0; j < buckets; ++j) {
          const double bucket_hi = (j + 1 == buckets) ? hi : lo + width * static_cast<double>(j + 1);
          const Piece next = projection::cross(acc, r.hist[j]);
          if (projection::phi(next, bucket_hi, budget) <= 0.0) {
            const long long keys = r.hist[j].keys();
            if (!(bucket_hi > bucket_lo) || bucket_lo + width == bucket_lo) {
              // the bracket cannot shrink (double resolution): the root to within an ulp of lam
              const double lam = projection::piece_root(acc, budget, bucket_hi);
              return std::min(std::max(lam, bucket_lo), bucket_hi);
            }
            lo = bucket_lo;
            hi = std::min(bucket_hi, v_hi);
            buckets = keys == 0 ? 1 : buckets_for(keys);
            piece = keys == 0;
            proposed = true;
            break;
          }
          acc = next;
          bucket_lo = bucket_hi;
        }
        if (!proposed) {
          lo = std::max(v_lo, hi);  // the running sums say: above the bracket
          hi = v_hi;
          buckets = 4096;
        }
        if (!(hi > lo) && v_hi > v_lo) {
          // the running sums point at or beyond v_hi, where phi <= 0 is verified:
          // they cancelled; the root lies just below v_hi, so reach down from it
          reach = 16.0 * std::max(width, std::abs(v_hi) * 0x1p-40);
          lo = std::max(v_lo, v_hi - reach);
          hi = v_hi;
          buckets = 4096;
          piece = false;
        }
      }
    }
    if (!(hi > lo)) {
      return hi;
    }
    level_pass<scalar_t, kCost, false>(segs, total, lo, hi, buckets, accs);
    reduce_chunks(accs, buckets, /*first=*/false);
  }
  return v_hi;
}

// ===========================================================================
// The fast solver: one pass over the data, then work on a small buffer.
//
// 1. A sample of the elements (short runs spread over the data) gives a guess
//    lam_s of lam*: the root of the sampled phi, found exactly by the
//    piece-wise Newton iteration below. Its error is estimated from the sample
//    itself (the standard deviation of the sampled phi over its slope), and
//    [a, b] = lam_s -+ kZ sigma brackets lam* with high probability.
// 2. One fused pass over the data (all threads) validates the input and sorts
//    every element into: L (key1 <= a: zero on all of [a, b]), U (key2 >= b:
//    one), F (key2 <= a, key1 >= b: free on all of [a, b]), whose sums it
//    accumulates in double, or B (a breakpoint strictly inside (a, b)), which it
//    copies into a small per-chunk buffer (a few percent of the data). On [a, b]
//    phi is then exactly   base(lam) + sum_{i in B} c_i clamp(t_i - lam c_i, 0, 1).
// 3. The same two steps repeat on the buffer until it is small, then the exact
//    piece-wise Newton iteration solves it, with the double sums of the base.
// A bracket that misses lam* is detected at the end (phi(a) <= 0 or
// phi(b) > 0 on the final set), as is a buffer that does not shrink (many equal
// breakpoints at lam*): both fall back to the histogram solver above, which is
// correct for any input. The result never depends on the sample, only the time.
// ===========================================================================

constexpr int64_t kSample0 = 8192;      // sampled elements at the first level
constexpr int64_t kSampleN = 2048;      // at the buffer levels
constexpr int64_t kSampleRun = 8;       // consecutive elements per sample read
constexpr int64_t kExactMax = 4096;     // sets this small are solved exactly
constexpr double kZ = 4.0;              // bracket half-width in sample sigmas
constexpr int kMaxFastLevels = 8;
constexpr int64_t kCompactBlock = 8192; // elements per buffer reservation

// Freed breakpoint buffers are kept for the next call (a few, at most 64 MB
// in all): fresh memory from malloc costs a page fault per 4 KB, which at 1M
// elements is as much as the pass itself.
class BlockPool {
 public:
  static BlockPool& instance() {
    static BlockPool* pool = new BlockPool();  // never destroyed: no exit-order issues
    return *pool;
  }
  // The largest free block, or {nullptr, 0}.
  std::pair<void*, size_t> take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (blocks_.empty()) {
      return {nullptr, 0};
    }
    auto best = std::max_element(blocks_.begin(), blocks_.end(),
        [](const auto& x, const auto& y) { return x.second < y.second; });
    const auto block = *best;
    blocks_.erase(best);
    bytes_ -= block.second;
    return block;
  }
  void give(void* p, size_t bytes) {
    if (p == nullptr) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (blocks_.size() < kMaxBlocks && bytes_ + bytes <= kMaxBytes) {
        blocks_.emplace_back(p, bytes);
        bytes_ += bytes;
        return;
      }
    }
    std::free(p);
  }

 private:
  static constexpr size_t kMaxBlocks = 16;
  static constexpr size_t kMaxBytes = size_t(64) << 20;
  std::mutex mu_;
  std::vector<std::pair<void*, size_t>> blocks_;
  size_t bytes_ = 0;
};

// A growable buffer of trivially copyable values that the vector kernels may
// write up to 16 values past its size (reserve() keeps that room).
template <typename T>
struct RawBuf {
  T* p = nullptr;
  int64_t n = 0, cap = 0;
  RawBuf() = default;
  RawBuf(const RawBuf&) = delete;
  RawBuf& operator=(const RawBuf&) = delete;
  RawBuf(RawBuf&& o) noexcept : p(o.p), n(o.n), cap(o.cap) {
    o.p = nullptr;
    o.n = o.cap = 0;
  }
  ~RawBuf() {
    BlockPool::instance().give(p, static_cast<size_t>(cap) * sizeof(T));
  }
  void reserve(int64_t k) {
    if (k <= cap) {
      return;
    }
    if (p == nullptr) {
      const auto block = BlockPool::instance().take();
      p = static_cast<T*>(block.first);
      cap = static_cast<int64_t>(block.second / sizeof(T));
      if (k <= cap) {
        return;
      }
    }
    const int64_t want = std::max<int64_t>(k, 2 * cap);
    T* q = static_cast<T*>(std::realloc(p, static_cast<size_t>(want) * sizeof(T)));
    TORCH_CHECK(q != nullptr, "project_budget: out of memory for the breakpoint buffer");
    p = q;
    cap = want;
  }
};

// One chunk's share of a compaction pass.
template <typename scalar_t>
struct PassChunk {
  Piece base;                  // U and F sums over [a, b]
  RawBuf<scalar_t> t, c;       // the elements with a breakpoint inside (a, b)
  bool bad_theta = false, bad_cost = false;
};

// A small set of elements in double, with the costs (empty: unit costs).
struct SmallSet {
  std::vector<double> t, c;
  int64_t size() const {
    return static_cast<int64_t>(t.size());
  }
};

// One element's share of piece_at (scalar path and vector tails).
template <bool kCost>
inline void piece_one(double t, double c, double lam, PieceAt& r) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const double k1 = kCost ? t / c : t;
  const double k2 = kCost ? (t - 1.0) / c : t - 1.0;
  const bool up = k2 > lam;
  const bool fr = !up && k1 > lam;
  r.p.u_c += cpu_math::select_lt(lam, k2, c);
  r.p.f_ct += static_cast<double>(fr) * (c * t);
  r.p.f_cc += static_cast<double>(fr) * (c * c);
  const double v = c * cpu_math::clamp01(t - lam * c);
  r.s1 += v;
  r.s2 += v * v;
  r.kb = std::max(r.kb, k1 <= lam ? k1 : (k2 <= lam ? k2 : -kInf));
  r.ka = std::min(r.ka, up ? k2 : (k1 > lam ? k1 : kInf));
}

template <bool kCost>
PieceAt piece_at_scalar(const SmallSet& s, double lam, int64_t begin = 0) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  PieceAt r{Piece{}, -kInf, kInf, 0.0, 0.0};
  for (int64_t i = begin; i < s.size(); ++i) {
    piece_one<kCost>(s.t[i], kCost ? s.c[i] : 1.0, lam, r);
  }
  return r;
}

// Sums, piece ends and moments at lam (the vectorised kernels when the
// capability has them: the vector part, then the scalar tail, merged in the
// order of the scalar loop's sums).
template <bool kCost>
PieceAt piece_at(const SmallSet& s, double lam) {
  if (const projection_cpu::Kernels* vk = vec_kernels()) {
    PieceAt v;
    const int64_t i = vk->piece_at[kCost](s.t.data(), kCost ? s.c.data() : nullptr, s.size(), lam, v);
    PieceAt r = piece_at_scalar<kCost>(s, lam, i);
    r.p.merge(v.p);
    r.s1 += v.s1;
    r.s2 += v.s2;
    r.kb = std::max(r.kb, v.kb);
    r.ka = std::min(r.ka, v.ka);
    return r;
  }
  return piece_at_scalar<kCost>(s, lam);
}

// Root of phi(lam) = base(lam) + w sum_{i in s} c_i clamp(t_i - lam c_i, 0, 1) - S
// on [a, b] (b finite): w = 1 is the exact problem of a set, w = N/m the
// sampled estimate of N elements. Newton on phi's pieces, safeguarded by
// bisection: each step evaluates the piece right of lam; its root, when it
// lies on that piece, is the exact root (one division). status: -1 if
// phi(a) <= 0 (lam = a), +1 if the root lies above b (lam = b; only detected
// with check_b), 0 otherwise.
struct Root {
  double lam;
  int status;
  double s1, s2, slope;  // moments and slope of the last piece evaluated
};

template <bool kCost>
Root newton_root(const SmallSet& s, double w, const Piece& base, double budget, double a, double b, bool check_b,
    double start = std::numeric_limits<double>::quiet_NaN()) {
  auto total = [&](const PieceAt& r) {
    return Piece{base.u_c + w * r.p.u_c, base.f_ct + w * r.p.f_ct, base.f_cc + w * r.p.f_cc};
  };
  const bool warm = start > a && start < b;  // a guess inside: no status at a
  double lam = warm ? start : a;
  PieceAt r = piece_at<kCost>(s, lam);
  Piece q = total(r);
  if (!warm && projection::phi(q, a, budget) <= 0.0) {
    return Root{a, -1, r.s1, r.s2, q.f_cc};
  }
  if (check_b) {
    if (!(b > a)) {
      return Root{b, 1, r.s1, r.s2, q.f_cc};  // phi(b) = phi(a) > 0
    }
    const PieceAt rb = piece_at<kCost>(s, b);
    const Piece qb = total(rb);
    if (projection::phi(qb, b, budget) > 0.0) {
      return Root{b, 1, rb.s1, rb.s2, qb.f_cc};
    }
  }
  double width2 = b - a, width1 = b - a;  // the bracket's width two and one steps ago
  for (int it = 0; it < 400; ++it) {
    const double ph = projection::phi(q, lam, budget);
    if (ph == 0.0) {
      return Root{lam, 0, r.s1, r.s2, q.f_cc};
    }
    if (ph > 0.0) {
      a = lam;
    } else {
      b = lam;
    }
    double next = std::numeric_limits<double>::quiet_NaN();
    if (q.f_cc > 0.0) {
      // phi is this linear piece on [kb, ka] (the set's breakpoints) within
      // [a, b] (inside the bracket, where the base is linear): exact root
      const double root = (q.u_c + q.f_ct - budget) / q.f_cc;
      if (root >= std::max(r.kb, a) && root <= std::min(r.ka, b)) {
        return Root{root, 0, r.s1, r.s2, q.f_cc};
      }
      next = root;
    }
    // bisect if Newton leaves the bracket or the bracket did not halve in
    // two steps (guaranteed progress when the pieces are many and tiny)
    if (!(next > a && next < b) || (it >= 1 && b - a > 0.5 * width2)) {
      next = a + 0.5 * (b - a);
    }
    width2 = width1;
    width1 = b - a;
    if (!(next > a && next < b)) {
      return Root{b, 0, r.s1, r.s2, q.f_cc};  // a and b adjacent doubles
    }
    lam = next;
    r = piece_at<kCost>(s, lam);
    q = total(r);
  }
  return Root{b, 0, r.s1, r.s2, q.f_cc};
}

// Copies `m` elements spread over [0, total) into a small set, in runs of
// kSampleRun consecutive elements (one or two cache lines per read). Elements
// that are not finite or have a bad cost are skipped (the pass reports them).
// When total < m the runs would overlap (their starts are less than
// kSampleRun apart): each run starts where the previous one ended, so every
// element is read once and the segment cursor only moves forward (a run that
// started inside the previous one read element -1 of the next tensor).
template <typename scalar_t, bool kCost>
SmallSet gather_sample(const std::vector<Segment>& segs, int64_t total, int64_t m) {
  SmallSet s;
  const int64_t runs = std::max<int64_t>(1, (std::min(m, total) + kSampleRun - 1) / kSampleRun);
  s.t.resize(runs * kSampleRun);
  if (kCost) {
    s.c.resize(runs * kSampleRun);
  }
  auto start = [&](int64_t k) { return (total / runs) * k + (total % runs) * k / runs; };
  constexpr int64_t kAhead = 16;  // runs prefetched ahead (independent cache misses)
  size_t seg = 0, pseg = 0;
  int64_t out = 0, done = 0;  // done: the end of the previous run
  for (int64_t k = 0; k < runs; ++k) {
    if (k + kAhead < runs) {
      const int64_t g = start(k + kAhead);
      while (g >= segs[pseg].offset + segs[pseg].n) {
        ++pseg;
      }
      __builtin_prefetch(static_cast<const scalar_t*>(segs[pseg].t) + (g - segs[pseg].offset));
      if (kCost) {
        __builtin_prefetch(static_cast<const scalar_t*>(segs[pseg].c) + (g - segs[pseg].offset));
      }
    }
    const int64_t g0 = std::max(start(k), done);
    const int64_t g1 = std::min(total, start(k) + kSampleRun);
    done = std::max(done, g1);
    for (int64_t g = g0; g < g1; ++g) {
      while (g >= segs[seg].offset + segs[seg].n) {
        ++seg;
      }
      const int64_t i = g - segs[seg].offset;
      const double t = static_cast<double>(static_cast<const scalar_t*>(segs[seg].t)[i]);
      const double c = kCost ? static_cast<double>(static_cast<const scalar_t*>(segs[seg].c)[i]) : 1.0;
      s.t[out] = t;
      if (kCost) {
        s.c[out] = c;
      }
      // skip what is not finite or has a bad cost (the pass reports it)
      out += std::isfinite(t) && std::isfinite(c) && c > 0;
    }
  }
  s.t.resize(out);
  if (kCost) {
    s.c.resize(out);
  }
  return s;
}

struct Bracket {
  double a, b;
  double frac;  // fraction of the sample with a breakpoint inside (a, b)
};

// [a, b] within [lo, hi] around the sampled root: kZ standard deviations of
// the sampled phi, divided by its slope (the free set's sum of c^2).
template <bool kCost>
Bracket sample_bracket_fast(const SmallSet& smp, int64_t population, const Piece& base, double budget, double lo,
    double hi) {
  const int64_t m = smp.size();
  if (m == 0) {
    return Bracket{lo, hi, 1.0};
  }
  double b = hi;
  if (!std::isfinite(b)) {  // phi(max key1) = base - S <= 0 on the sample (base = 0 here)
    b = lo;
    for (int64_t i = 0; i < m; ++i) {
      b = std::max(b, kCost ? smp.t[i] / smp.c[i] : smp.t[i]);
    }
  }
  const double w = static_cast<double>(population) / static_cast<double>(m);
  // warm start: the root of every 8th sampled element (8x cheaper steps)
  double start = std::numeric_limits<double>::quiet_NaN();
  if (m >= 2048) {
    SmallSet sub;
    for (int64_t i = 0; i < m; i += 8) {
      sub.t.push_back(smp.t[i]);
      if (kCost) {
        sub.c.push_back(smp.c[i]);
      }
    }
    start = newton_root<kCost>(sub, static_cast<double>(population) / static_cast<double>(sub.size()), base, budget,
        lo, b, false).lam;
  }
  const Root r = newton_root<kCost>(smp, w, base, budget, lo, b, false, start);
  const double mean = r.s1 / static_cast<double>(m);
  const double var = std::max(0.0, r.s2 / static_cast<double>(m) - mean * mean);
  // no free sampled element: no error estimate; a narrow guess (a miss costs
  // the fallback, a bracket over everything would copy all the data)
  double delta = r.slope > 0.0 ? kZ * w * std::sqrt(static_cast<double>(m) * var) / r.slope
                               : 1e-3 * std::max(1.0, std::abs(r.lam));
  delta = std::max(delta, 1e-12 * std::max(1.0, std::abs(r.lam)));
  const double a = std::max(lo, r.lam - delta);
  const double bb = std::min(hi, r.lam + delta);
  int64_t inside = 0;
  for (int64_t i = 0; i < m; ++i) {
    const double c = kCost ? smp.c[i] : 1.0;
    const double k1 = smp.t[i] / c, k2 = (smp.t[i] - 1.0) / c;
    inside += (k1 > a && k1 < bb) || (k2 > a && k2 < bb);
  }
  return Bracket{a, bb, static_cast<double>(inside) / static_cast<double>(m)};
}

// Scalar compaction of [b0, e0) of one segment (any dtype, any costs).
template <typename scalar_t, bool kCost, bool kValidate>
void scalar_compact(const scalar_t* tp, const scalar_t* cp, int64_t b0, int64_t e0, double a, double b,
    PassChunk<scalar_t>& out, double& bad_t, double& bad_c) {
  double u = 0, ft = 0, fcc = 0;
  for (int64_t blk = b0; blk < e0; blk += kCompactBlock) {
    const int64_t be = std::min(e0, blk + kCompactBlock);
    // two-level sums (block, then chunk): n equal addends (tied scores) do not
    // each round into one long running sum
    double bu = 0, bft = 0, bfcc = 0;
    out.t.reserve(out.t.n + (be - blk) + 8);
    if (kCost) {
      out.c.reserve(out.t.n + (be - blk) + 8);
    }
    scalar_t* bt = out.t.p;
    scalar_t* bc = out.c.p;
    int64_t pos = out.t.n;
    for (int64_t i = blk; i < be; ++i) {
      const double t = static_cast<double>(tp[i]);
      const double c = kCost ? static_cast<double>(cp[i]) : 1.0;
      const double k1 = kCost ? t / c : t;
      const double k2 = kCost ? (t - 1.0) / c : t - 1.0;
      const bool in_b = ((k1 > a) & (k1 < b)) | ((k2 > a) & (k2 < b));
      const double is_u = static_cast<double>(!in_b & (k2 >= b));
      const double is_f = static_cast<double>(!in_b & (k2 <= a) & (k1 >= b));
      bu += is_u * c;
      bft += is_f * (c * t);
      bfcc += is_f * (c * c);
      bt[pos] = tp[i];
      if (kCost) {
        bc[pos] = cp[i];
      }
      pos += in_b;
      if (kValidate) {
        bad_t += t - t;  // 0 for finite t, nan otherwise
        if (kCost) {
          bad_c += (c - c) + cpu_math::select_lt(c, 0.0, 1.0) + static_cast<double>(c == 0.0);
        }
      }
    }
    out.t.n = pos;
    if (kCost) {
      out.c.n = pos;
    }
    u += bu;
    ft += bft;
    fcc += bfcc;
  }
  out.base.merge(Piece{u, ft, fcc});
}

// The compaction pass of float32 scores with unit costs on the vectorised
// kernels (compact_block, project_budget_kernels.inc), block by block so that
// the buffer grows before each block's stores.
void fast_compact(const projection_cpu::Kernels* vk, const float* tp, int64_t b0, int64_t e0, double a, double b,
    PassChunk<float>& out, bool& bad) {
  projection_cpu::CompactAcc acc;
  for (int64_t blk = b0; blk < e0; blk += kCompactBlock) {
    const int64_t be = std::min(e0, blk + kCompactBlock);
    out.t.reserve(out.t.n + (be - blk) + 16);
    out.t.n += vk->compact_block(tp, blk, be, a, b, out.t.p + out.t.n, acc);
  }
  bad |= acc.bad;
  const double len = static_cast<double>(e0 - b0);
  out.base.merge(Piece{len - static_cast<double>(acc.not_u), acc.ft, len - static_cast<double>(acc.not_f)});
}

// One compaction pass over all segments with the bracket [a, b], in parallel
// over fixed chunks (deterministic for a given thread count).
template <typename scalar_t, bool kCost, bool kValidate>
std::vector<PassChunk<scalar_t>> compact_pass(
    const std::vector<Segment>& segs, int64_t total, double a, double b, double frac) {
  const int64_t nchunks = num_chunks(total);
  std::vector<PassChunk<scalar_t>> chunks(nchunks);
  const projection_cpu::Kernels* vk = vec_kernels();
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      PassChunk<scalar_t>& out = chunks[ch];
      const int64_t begin = total * ch / nchunks, end = total * (ch + 1) / nchunks;
      // room for the expected share of the buffer (it grows if needed)
      const int64_t expect = static_cast<int64_t>(std::min(1.0, 1.5 * frac + 0.002) * static_cast<double>(end - begin));
      out.t.reserve(expect + 64);
      if (kCost) {
        out.c.reserve(expect + 64);
      }
      double bad_t = 0, bad_c = 0;
      bool bad_fast = false;
      for_each_piece(segs, begin, end, [&](const Segment& s, int64_t lb, int64_t le) {
        const scalar_t* tp = static_cast<const scalar_t*>(s.t);
        const scalar_t* cp = static_cast<const scalar_t*>(s.c);
        if constexpr (std::is_same_v<scalar_t, float> && !kCost) {
          if (vk != nullptr) {
            fast_compact(vk, tp, lb, le, a, b, out, bad_fast);
            return;
          }
        }
        scalar_compact<scalar_t, kCost, kValidate>(tp, cp, lb, le, a, b, out, bad_t, bad_c);
      });
      if (kValidate) {
        out.bad_theta = bad_fast || !(bad_t == 0.0);  // nan-propagating
        out.bad_cost = !(bad_c == 0.0);
      }
    }
  });
  return chunks;
}

template <typename scalar_t, bool kCost>
std::vector<Segment> buffer_segments(const std::vector<PassChunk<scalar_t>>& chunks, int64_t& total) {
  std::vector<Segment> segs;
  total = 0;
  for (const auto& ch : chunks) {
    if (ch.t.n > 0) {
      segs.push_back(Segment{ch.t.p, kCost ? ch.c.p : nullptr, nullptr, ch.t.n, total});
      total += ch.t.n;
    }
  }
  return segs;
}

template <typename scalar_t, bool kCost>
SmallSet gather_all(const std::vector<PassChunk<scalar_t>>& chunks) {
  SmallSet s;
  for (const auto& ch : chunks) {
    for (int64_t i = 0; i < ch.t.n; ++i) {
      s.t.push_back(static_cast<double>(ch.t.p[i]));
      if (kCost) {
        s.c.push_back(static_cast<double>(ch.c.p[i]));
      }
    }
  }
  return s;
}

// lam* = max(0, lam1) (0: slack budget, +inf: zero budget), validating the
// input first. Throws ValueError naming the argument before anything is
// written.
// PRUNOPT_PROJECTION_SOLVER=histogram skips the fast solver (tests run the
// fallback on inputs the sample would not mislead); read per call.
inline bool histogram_forced() {
  const char* v = std::getenv("PRUNOPT_PROJECTION_SOLVER");
  return v != nullptr && std::strcmp(v, "histogram") == 0;
}

template <typename scalar_t, bool kCost>
double solve_lambda(const std::vector<Segment>& segs, int64_t total, double budget, const char* op) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (histogram_forced()) {
    return solve_lambda_histogram<scalar_t, kCost>(segs, total, budget, op);
  }
  Piece base;
  double lo = 0.0, hi = kInf;
  std::vector<PassChunk<scalar_t>> cur;
  int64_t count = total;
  for (int level = 0; level <= kMaxFastLevels; ++level) {
    int64_t n_in = 0;
    std::vector<Segment> in = level == 0 ? segs : buffer_segments<scalar_t, kCost>(cur, n_in);
    if (level > 0 && n_in <= kExactMax) {
      // exact solve of the last buffer, with the sums of everything else
      const SmallSet set = gather_all<scalar_t, kCost>(cur);
      double b = hi;
      if (!std::isfinite(b)) {  // no U or F in the base: phi(max key1) = -S
        b = lo;
        for (int64_t i = 0; i < set.size(); ++i) {
          b = std::max(b, kCost ? set.t[i] / set.c[i] : set.t[i]);
        }
      }
      const Root r = newton_root<kCost>(set, 1.0, base, budget, lo, b, true);
      if (r.status == 0) {
        return r.lam;
      }
      if (r.status < 0 && lo == 0.0) {
        return 0.0;  // phi(0) <= 0: slack budget
      }
      // lam* is outside the bracket: the sample was misleading
      return solve_lambda_histogram<scalar_t, kCost>(segs, total, budget, op,
          r.status < 0 ? std::pair<double, double>{0.0, lo} : std::pair<double, double>{hi, hi + std::max(1.0, hi)});
    }
    if (level > 0 && 2 * n_in > count) {
      break;  // the buffer does not shrink (many breakpoints at lam*)
    }
    if (level > 0) {
      count = n_in;
    }
    Bracket br{0.0, 0.0, 0.0};
    if (budget > 0.0) {
      const SmallSet smp = gather_sample<scalar_t, kCost>(in, count, level == 0 ? kSample0 : kSampleN);
      br = sample_bracket_fast<kCost>(smp, count, base, budget, lo, hi);
    }
    std::vector<PassChunk<scalar_t>> next = level == 0
        ? compact_pass<scalar_t, kCost, true>(in, count, br.a, br.b, br.frac)
        : compact_pass<scalar_t, kCost, false>(in, count, br.a, br.b, br.frac);
    if (level == 0) {
      bool bad_theta = false, bad_cost = false;
      for (const auto& ch : next) {
        bad_theta |= ch.bad_theta;
        bad_cost |= ch.bad_cost;
      }
      TORCH_CHECK_VALUE(!bad_theta, op, ": theta contains a non-finite value");
      TORCH_CHECK_VALUE(!bad_cost, op, ": cost must be positive and finite everywhere");
      if (budget == 0.0) {
        return kInf;  // all zeros (a slack zero budget, all t <= 0, gives zeros too)
      }
    }
    for (const auto& ch : next) {
      base.merge(ch.base);
    }
    lo = br.a;
    hi = br.b;
    cur = std::move(next);
    if (level == 0 && total <= kExactMax) {
      count = total;  // tiny input: its buffer is solved exactly next
    }
  }
  return solve_lambda_histogram<scalar_t, kCost>(segs, total, budget, op, {lo, hi});
}

template <typename scalar_t, bool kCost>
void apply(const std::vector<Segment>& segs, int64_t total, double lam) {
  const int64_t nchunks = num_chunks(total);
  const projection_cpu::Kernels* vk = vec_kernels();
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      for_each_piece(segs, total * ch / nchunks, total * (ch + 1) / nchunks,
          [&](const Segment& s, int64_t b, int64_t e) {
            const scalar_t* tp = static_cast<const scalar_t*>(s.t);
            const scalar_t* cp = static_cast<const scalar_t*>(s.c);
            scalar_t* op = static_cast<scalar_t*>(s.out);
            if constexpr (std::is_same_v<scalar_t, float> && !kCost) {
              if (vk != nullptr) {
                vk->apply(tp, op, b, e, lam);
                return;
              }
            }
            for (int64_t i = b; i < e; ++i) {
              const double c = kCost ? static_cast<double>(cp[i]) : 1.0;
              op[i] = static_cast<scalar_t>(cpu_math::clamp01(static_cast<double>(tp[i]) - lam * c));
            }
          });
    }
  });
}

// A fresh output of many MB costs a page fault per 4 KB on its first write:
// on the project's VM that is ~5x the time of the write itself. Where
// transparent huge pages are enabled on request ("madvise", the common
// default), asking for them for the output's 2 MB-aligned interior makes that
// one fault per 2 MB (torch's own THP_MEM_ALLOC_ENABLE does the same). Only a
// hint: without THP, or on other systems, nothing changes.
void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  if (bytes < 4 * kHuge) {
    return;
  }
  const uintptr_t p = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (p + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (p + bytes) & ~(kHuge - 1);
  if (end > begin) {
    (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // a hint; errors are harmless
  }
#else
  (void)data;
  (void)bytes;
#endif
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
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (outputs[i].data_ptr() != inputs[i].data_ptr()) {
      advise_huge_pages(outputs[i].data_ptr(), outputs[i].nbytes());
    }
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

// project_budget_bracket: the compaction pass of solve_lambda alone, for a
// bracket [lo, hi] of lam that the caller chose (the sharded projection takes
// it from every process's sample). The scores' and costs' checks are made in
// the same pass and reported, not raised, so that the processes can agree on
// them first; then the sums are 0 and no elements are returned.
std::tuple<at::Tensor, at::Tensor, at::Tensor> project_budget_bracket_cpu(
    at::TensorList theta, c10::optional<at::TensorList> cost, double lo, double hi) {
  const char* op = "project_budget_bracket";
  check_projection_bracket_args(theta, cost, lo, hi, op);
  const bool has_cost = cost.has_value();
  const auto inputs = contiguous_all(theta);
  const auto costs = has_cost ? contiguous_all(*cost) : std::vector<at::Tensor>{};
  std::vector<Segment> segs;
  int64_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t n = inputs[i].numel();
    if (n > 0) {
      segs.push_back(Segment{inputs[i].data_ptr(), has_cost ? costs[i].data_ptr() : nullptr, nullptr, n, total});
      total += n;
    }
  }
  const auto opts = theta[0].options();
  at::Tensor summary = at::zeros({5}, opts.dtype(at::kDouble));
  at::Tensor t_in = at::empty({0}, opts), c_in = at::empty({0}, opts);
  if (total == 0) {
    return {summary, t_in, c_in};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, theta[0].scalar_type(), "project_budget_bracket", [&] {
    auto run = [&](auto cost_tag) {
      constexpr bool kCost = decltype(cost_tag)::value;
      const auto chunks = compact_pass<scalar_t, kCost, true>(segs, total, lo, hi, 0.05);
      Piece base;
      bool bad_theta = false, bad_cost = false;
      int64_t n_in = 0;
      for (const auto& ch : chunks) {
        base.merge(ch.base);
        bad_theta |= ch.bad_theta;
        bad_cost |= ch.bad_cost;
        n_in += ch.t.n;
      }
      double* out = summary.data_ptr<double>();
      if (bad_theta || bad_cost) {
        out[3] = bad_theta ? 1.0 : 0.0;
        out[4] = bad_cost ? 1.0 : 0.0;
        return;
      }
      out[0] = base.u_c;
      out[1] = base.f_ct;
      out[2] = base.f_cc;
      t_in = at::empty({n_in}, opts);
      if (kCost) {
        c_in = at::empty({n_in}, opts);
      }
      int64_t pos = 0;
      for (const auto& ch : chunks) {
        if (ch.t.n > 0) {
          std::memcpy(t_in.data_ptr<scalar_t>() + pos, ch.t.p, sizeof(scalar_t) * ch.t.n);
          if (kCost) {
            std::memcpy(c_in.data_ptr<scalar_t>() + pos, ch.c.p, sizeof(scalar_t) * ch.t.n);
          }
          pos += ch.t.n;
        }
      }
    };
    if (has_cost) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
  return {summary, t_in, c_in};
}

// project_budget_apply_: the last pass of the projection for a given lam
// (out = clamp(theta - lam cost, 0, 1) in double, rounded once); out may be
// theta itself.
void project_budget_apply_cpu(
    at::TensorList out, at::TensorList theta, c10::optional<at::TensorList> cost, double lam) {
  const char* op = "project_budget_apply_";
  check_projection_apply_args(out, theta, cost, lam, op);
  if (theta.empty()) {
    return;
  }
  const bool has_cost = cost.has_value();
  const auto inputs = contiguous_all(theta);
  const auto costs = has_cost ? contiguous_all(*cost) : std::vector<at::Tensor>{};
  auto outputs = contiguous_all(out);
  std::vector<Segment> segs;
  int64_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t n = inputs[i].numel();
    if (n > 0) {
      segs.push_back(Segment{inputs[i].data_ptr(), has_cost ? costs[i].data_ptr() : nullptr,
          outputs[i].data_ptr(), n, total});
      total += n;
    }
  }
  if (total == 0) {
    return;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {  // a fresh output: one page fault per 2 MB (see above)
    if (outputs[i].data_ptr() != inputs[i].data_ptr()) {
      advise_huge_pages(outputs[i].data_ptr(), outputs[i].nbytes());
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, theta[0].scalar_type(), "project_budget_apply_", [&] {
    if (has_cost) {
      apply<scalar_t, true>(segs, total, lam);
    } else {
      apply<scalar_t, false>(segs, total, lam);
    }
  });
  copy_back(outputs, out);
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
  m.impl("project_budget_bracket", &prunopt::cpu::project_budget_bracket_cpu);
  m.impl("project_budget_apply_", &prunopt::cpu::project_budget_apply_cpu);
}
