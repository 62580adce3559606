// prunAdag on the CPU (Porcelli et al.): the exact global top-T threshold and
// the fused step over one selection scope.
//
// Memory passes per step (float32, version 3; Adagrad makes 5 streams):
//   1. sample: 2K-32K elements in 128-2048 cache-line blocks (growing as n^(2/3))
//      give a bracket [lo, hi] of keys |g| that holds tau with high probability;
//   2. scan (reads g, x): counts |g| > hi, keeps lo <= |g| <= hi as a small
//      list of candidates (effective g, x), and sums ||g||^2 over |g| > hi and
//      ||x||^2 over {|g| < lo, x g > 0} in double; inf/NaN raise here, before
//      anything is written;
//   3. exact select of tau among the candidates (nth_element on their keys),
//      then the candidates' share of ||g||_R and ||x||_M -> r;
//   4. element pass (reads g, x, both sums; writes x, both sums).
// That is 2 + 7 = 9 streams (floor ~1.8x Adagrad). If the bracket misses tau
// (the sample was not representative) or the candidates exceed a fixed cap
// (e.g. massive ties), the step falls back to an exact radix select on the
// bit patterns of |g| (16 bits per pass) and a separate norms pass: the same
// result, only slower. Either way tau is bit-exact with torch.kthvalue on the
// concatenation, and nothing of size n is allocated.
//
// Work is cut into fixed chunks of the concatenated index space (independent
// of the thread count, so every sum has a fixed order and results are
// deterministic) and run with at::parallel_for over all tensors at once.
// The scan and element passes are written once (prunadag_kernels.inc) over a
// SIMD traits type and compiled per CPU capability in their own objects
// (prunadag_default.cpp, prunadag_avx2.cpp, prunadag_avx512.cpp; see
// prunopt/prunadag_cpu.h); each piece of work takes the table of the
// capability prunopt::vec::cpu_capability() names. The AVX2 traits are ATen's
// at::vec::Vectorized (at par with the hand-written AVX2 intrinsics they
// replaced), and so are the DEFAULT capability's (Vectorized's DEFAULT form,
// about twice as fast as the hand-written SSE2 traits it replaced, see
// prunadag_default.cpp); the AVX-512 traits stay hand-written (mask
// registers: measured faster than a Vectorized form, see prunadag_avx512.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "prunopt/checks.h"
#include "prunopt/cpu_math.h"
#include "prunopt/prunadag.h"
#include "prunopt/prunadag_cpu.h"
#include "prunopt/prunadag_reduced.h"
#include "prunopt/tensor_list.h"
#include "prunopt/vec_capability.h"

namespace prunopt {
namespace cpu {
namespace {

using namespace prunopt::prunadag;
using prunadag_cpu::Seg;
using prunadag_cpu::ScanOut;
using prunadag_cpu::NormGuard;

// Fixed work unit (elements of the concatenated index space).
constexpr int64_t kChunk = 1 << 16;
// Sample: up to kSampleBlocks blocks of kSampleLen contiguous elements (one
// cache line of float32 each; see sample_blocks); below kSampleMin pruned
// elements every element is a candidate instead.
constexpr int64_t kSampleBlocks = 2048;
constexpr int64_t kSampleBlocksMin = 128;
constexpr int64_t kSampleLen = 16;
constexpr int64_t kSampleMin = 1 << 16;
// Fewer candidates than this are selected and summed on the calling thread
// (a parallel region costs more than the work: ~10 us each on 2 cores).
constexpr int64_t kSerialCandidates = 1 << 14;

int64_t num_chunks(int64_t total) {
  return std::max<int64_t>(1, (total + kChunk - 1) / kChunk);
}

// Calls f(seg, b, e) for the pieces of the segments inside [begin, end).
template <typename F>
void for_each_piece(const std::vector<Seg>& segs, int64_t begin, int64_t end, F&& f) {
  auto it = std::upper_bound(segs.begin(), segs.end(), begin,
      [](int64_t v, const Seg& s) { return v < s.offset; });
  if (it != segs.begin()) {
    --it;
  }
  for (; it != segs.end() && it->offset < end; ++it) {
    const int64_t b = std::max(begin, it->offset);
    const int64_t e = std::min(end, it->offset + it->n);
    if (b < e) {
      f(*it, b - it->offset, e - it->offset);
    }
  }
}

// Runs body(chunk, begin, end) over the fixed chunks, in parallel.
template <typename F>
void for_each_chunk(int64_t total, F&& body) {
  const int64_t nchunks = num_chunks(total);
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      body(ch, ch * kChunk, std::min(total, (ch + 1) * kChunk));
    }
  });
}

// ---------------------------------------------------------------- SIMD kernels
// The passes of the capability this CPU runs now (the environment is read at
// each call: PRUNOPT_NO_AVX512 and PRUNOPT_NO_SIMD switch clones within a
// process; one call per piece of 2^16 elements).
const prunadag_cpu::Kernels* kernels() {
#if defined(PRUNOPT_PRUNADAG_X86)
  switch (vec::cpu_capability()) {
    case vec::Capability::kAvx512:
      return prunadag_cpu::AVX512::kernels();
    case vec::Capability::kAvx2:
      return prunadag_cpu::AVX2::kernels();
    default:
      break;
  }
#endif
  return prunadag_cpu::DEFAULT::kernels();
}

// The scan of one piece (see scan_range in prunadag_kernels.inc).
template <typename scalar_t, bool kX, bool kNorms>
void scan_range(const Seg& s, int64_t b, int64_t e, scalar_t lo, scalar_t hi, ScanOut<scalar_t>& out,
    scalar_t* cg, scalar_t* cx) {
  kernels()->get<scalar_t>().scan[kX][kNorms](s, b, e, lo, hi, out, cg, cx);
}

// The scan of the pieces of one chunk [begin, end) into `out`: pruned pieces
// against [lo, hi], the others for finiteness only (everything is "below"
// +inf; their candidates' slots are past the chunk's count and unused).
template <typename scalar_t, bool kX, bool kNorms>
void scan_chunk(const std::vector<Seg>& segs, int64_t begin, int64_t end, scalar_t lo, scalar_t hi,
    ScanOut<scalar_t>& out, scalar_t* cg, scalar_t* cx) {
  constexpr scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  for_each_piece(segs, begin, end, [&](const Seg& s, int64_t b, int64_t e) {
    if (s.prune) {
      scan_range<scalar_t, kX, kNorms>(s, b, e, lo, hi, out, cg, cx);
    } else {
      ScanOut<scalar_t> check;
      scan_range<scalar_t, kX, false>(s, b, e, inf, inf, check, cg + out.ncand, nullptr);
      out.bad |= check.bad;
    }
  });
}

// The element pass of one piece (see update_range in prunadag_kernels.inc).
template <typename scalar_t>
void update_range(const Seg& s, int64_t b, int64_t e, scalar_t tau, double r, int version) {
  kernels()->get<scalar_t>().update(s, b, e, tau, r, version);
}

// ||g||_R^2 and ||x||_M^2 over a piece (see norms_range in prunadag_kernels.inc).
template <typename scalar_t>
void norms_range(const Seg& s, int64_t b, int64_t e, scalar_t tau, double& g_r2, double& x_m2) {
  kernels()->get<scalar_t>().norms(s, b, e, tau, g_r2, x_m2);
}

// ---------------------------------------------------------------- exact radix select (fallback)

// Histogram chunks: one per thread (a 2^16-bin histogram each); the counts
// are integers, so the merged histogram does not depend on the split.
int64_t hist_chunks(int64_t total) {
  const int64_t by_size = (total + kChunk - 1) / kChunk;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), by_size));
}

// One histogram pass of digit [shift, shift + bits) over the pruned keys whose
// higher bits equal `prefix` (under `pmask`).
template <typename scalar_t, bool kWd>
std::vector<int64_t> hist_pass(const std::vector<Seg>& segs, int64_t total, int shift, int bits,
    typename KeyOf<scalar_t>::type prefix, typename KeyOf<scalar_t>::type pmask) {
  using K = typename KeyOf<scalar_t>::type;
  const int64_t nchunks = hist_chunks(total);
  const int64_t nbins = int64_t(1) << bits;
  const K dmask = static_cast<K>(nbins - 1);
  std::vector<std::vector<uint32_t>> hists(nchunks);
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      hists[ch].assign(nbins, 0u);
      uint32_t* hist = hists[ch].data();
      for_each_piece(segs, total * ch / nchunks, total * (ch + 1) / nchunks,
          [&](const Seg& s, int64_t b, int64_t e) {
        if (!s.prune) {
          return;
        }
        const scalar_t* gp = static_cast<const scalar_t*>(s.g);
        const scalar_t* xp = static_cast<const scalar_t*>(s.x);
        const scalar_t wd = static_cast<scalar_t>(s.h[kWeightDecay]);
        const scalar_t sgn = s.h[kMaximize] != 0.0 ? scalar_t(-1) : scalar_t(1);
        for (int64_t i = b; i < e; ++i) {
          // with weight decay the sign of g matters: |-g + wd x| != |g + wd x|
          const K key = magnitude_key<scalar_t>(kWd ? effective_grad<scalar_t>(xp[i], gp[i], wd, sgn) : gp[i]);
          hist[(key >> shift) & dmask] += (key & pmask) == prefix;
        }
      });
    }
  });
  std::vector<int64_t> out(nbins, 0);
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    for (int64_t j = 0; j < nbins; ++j) {
      out[j] += hists[ch][j];
    }
  }
  return out;
}

// The k-th largest key among the pruned elements (1 <= k <= n), all finite.
template <typename scalar_t, bool kWd>
scalar_t radix_select(const std::vector<Seg>& segs, int64_t total, int64_t k) {
  using K = typename KeyOf<scalar_t>::type;
  K prefix = 0, pmask = 0;
  int bits_left = KeyOf<scalar_t>::kBits;
  while (bits_left > 0) {
    const int bits = digit_bits(bits_left);
    const int shift = bits_left - bits;
    const std::vector<int64_t> hist = hist_pass<scalar_t, kWd>(segs, total, shift, bits, prefix, pmask);
    int64_t above = 0;
    int64_t j = static_cast<int64_t>(hist.size()) - 1;
    for (; j > 0; --j) {
      if (above + hist[j] >= k) {
        break;
      }
      above += hist[j];
    }
    k -= above;
    prefix |= static_cast<K>(j) << shift;
    pmask |= static_cast<K>((int64_t(1) << bits) - 1) << shift;
    bits_left = shift;
  }
  return value_of_key<scalar_t>(prefix);
}

// ---------------------------------------------------------------- sampled select

// Whether the fast sampled selection may be used (PRUNOPT_PRUNADAG_SELECT=radix
// forces the exact fallback, for tests and comparisons).
bool sampling_enabled() {
  const char* v = std::getenv("PRUNOPT_PRUNADAG_SELECT");
  return v == nullptr || std::strcmp(v, "radix") != 0;
}

// Effective |g| of global element i (which lies in segment s at local j).
template <typename scalar_t>
scalar_t abs_effective(const Seg& s, int64_t j, bool with_x) {
  const scalar_t g = static_cast<const scalar_t*>(s.g)[j];
  if (!with_x) {
    return std::abs(g);
  }
  const scalar_t x = static_cast<const scalar_t*>(s.x)[j];
  const scalar_t sgn = s.h[kMaximize] != 0.0 ? scalar_t(-1) : scalar_t(1);
  return std::abs(effective_grad<scalar_t>(x, g, static_cast<scalar_t>(s.h[kWeightDecay]), sgn));
}

// Shift that maps keys in [kmin, kmin + span] onto at most 4096 histogram bins.
inline int bin_shift(uint64_t span) {
  int shift = 0;
  while ((span >> shift) >= 4096) {
    ++shift;
  }
  return shift;
}

// The keys at two ascending positions p1 <= p2 of `keys` (which it reorders):
// a histogram of the keys' top bits over their range (at most 4096 bins),
// then nth_element inside the one or two bins that hold p1 and p2. Same
// values as two std::nth_element calls, at about a quarter of their cost on
// the 32K-key sample (no branchy partitioning of the whole sample).
template <typename K>
void select_two(std::vector<K>& keys, int64_t p1, int64_t p2, K& v1, K& v2) {
  K kmin = keys[0], kmax = keys[0];
  for (const K key : keys) {
    kmin = key < kmin ? key : kmin;
    kmax = key > kmax ? key : kmax;
  }
  const uint64_t span = static_cast<uint64_t>(kmax) - static_cast<uint64_t>(kmin);
  const int shift = bin_shift(span);
  std::vector<int32_t> hist((span >> shift) + 1, 0);
  for (const K key : keys) {
    ++hist[(key - kmin) >> shift];
  }
  // bins of p1 and p2 and the number of keys below each
  int64_t b1 = -1, b2 = -1, below1 = 0, below2 = 0, acc = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(hist.size()); ++b) {
    if (b1 < 0 && acc + hist[b] > p1) {
      b1 = b;
      below1 = acc;
    }
    if (acc + hist[b] > p2) {
      b2 = b;
      below2 = acc;
      break;
    }
    acc += hist[b];
  }
  // keys of bin b1 first, then those of b2 (if another bin)
  std::vector<K> in1, in2;
  in1.reserve(hist[b1]);
  if (b2 != b1) {
    in2.reserve(hist[b2]);
  }
  for (const K key : keys) {
    const int64_t b = static_cast<int64_t>((key - kmin) >> shift);
    if (b == b1) {
      in1.push_back(key);
    } else if (b == b2) {
      in2.push_back(key);
    }
  }
  std::nth_element(in1.begin(), in1.begin() + (p1 - below1), in1.end());
  v1 = in1[p1 - below1];
  if (b2 == b1) {
    std::nth_element(in1.begin() + (p1 - below1), in1.begin() + (p2 - below1), in1.end());
    v2 = in1[p2 - below1];
  } else {
    std::nth_element(in2.begin(), in2.begin() + (p2 - below2), in2.end());
    v2 = in2[p2 - below2];
  }
}

// Sample blocks for a scope of `total` elements. The sample costs ~s (its
// misses and the serial select of two order statistics) and the candidates
// the bracket lets through ~n / sqrt(s), so the best s grows as n^(2/3):
// 2048 blocks (32K keys, tuned at n = 10M, where candidates are ~1.5% of n)
// scaled by (total / 10M)^(2/3), between 128 and 2048 blocks. (A fixed 32K
// keys took 0.2 ms at n = 100K, twice a whole Adagrad step there.)
int64_t sample_blocks(int64_t total) {
  const double scaled = static_cast<double>(kSampleBlocks) * std::pow(static_cast<double>(total) / 1e7, 2.0 / 3.0);
  return std::clamp<int64_t>(static_cast<int64_t>(scaled), kSampleBlocksMin, kSampleBlocks);
}

// A bracket [lo, hi] of |g| values that holds the k-th largest of the n pruned
// elements with high probability: sample_blocks(total) blocks of kSampleLen
// contiguous elements spread evenly over the index space; the sample's order
// statistics at rank k/n * s -/+ 4.5 binomial standard deviations + 8 (a
// miss only costs the exact fallback). For small n, [0, inf]: every element
// is a candidate. Returns the expected number of candidates (for the cap).
template <typename scalar_t>
int64_t sample_bracket(const std::vector<Seg>& segs, int64_t total, int64_t n, int64_t k, bool with_x,
    scalar_t& lo, scalar_t& hi) {
  using K = typename KeyOf<scalar_t>::type;
  constexpr scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  lo = scalar_t(0);
  hi = inf;
  if (n < kSampleMin) {
    return n;
  }
  struct Piece {
    const Seg* s;
    int64_t b, e;
  };
  std::vector<Piece> pieces;
  const int64_t nblocks = sample_blocks(total);
  pieces.reserve(nblocks + 16);
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t start = blk * (total - kSampleLen) / (nblocks - 1);
    for_each_piece(segs, start, std::min(total, start + kSampleLen), [&](const Seg& s, int64_t b, int64_t e) {
      if (s.prune) {
        pieces.push_back(Piece{&s, b, e});
      }
    });
  }
  // The blocks are cache and TLB misses (each on its own page). Software
  // prefetches that miss the TLB may be dropped, so each task first makes one
  // demand load per line, all independent of each other, and the core
  // overlaps their misses; then it gathers the keys. Two tasks (fixed split,
  // concatenated in order; the bracket depends only on the multiset anyway).
  constexpr int64_t kTasks = 2;
  const int64_t npieces = static_cast<int64_t>(pieces.size());
  std::vector<std::vector<K>> parts(kTasks);
  at::parallel_for(0, kTasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pb = t * npieces / kTasks, pe = (t + 1) * npieces / kTasks;
      uint64_t touch = 0;
      for (int64_t i = pb; i < pe; ++i) {
        const Piece& p = pieces[i];
        const scalar_t* g = static_cast<const scalar_t*>(p.s->g);
        touch += magnitude_key<scalar_t>(g[p.b]) + magnitude_key<scalar_t>(g[p.e - 1]);
        if (with_x && p.s->h[kWeightDecay] != 0.0) {  // x only enters through weight decay
          const scalar_t* x = static_cast<const scalar_t*>(p.s->x);
          touch += magnitude_key<scalar_t>(x[p.b]) + magnitude_key<scalar_t>(x[p.e - 1]);
        }
      }
      asm volatile("" : : "r"(touch));  // keep the loads
      std::vector<K>& part = parts[t];
      part.resize((pe - pb) * kSampleLen);
      int64_t m = 0;
      for (int64_t i = pb; i < pe; ++i) {
        const Piece& p = pieces[i];
        const bool wd = with_x && p.s->h[kWeightDecay] != 0.0;
        for (int64_t j = p.b; j < p.e; ++j) {
          const K key = magnitude_key<scalar_t>(abs_effective<scalar_t>(*p.s, j, wd));
          part[m] = key;
          m += key < KeyOf<scalar_t>::kInf;  // inf/NaN are found (and rejected) by the scan
        }
      }
      part.resize(m);
    }
  });
  std::vector<K> sample;
  sample.reserve(nblocks * kSampleLen);
  for (const auto& part : parts) {
    sample.insert(sample.end(), part.begin(), part.end());
  }
  const int64_t ns = static_cast<int64_t>(sample.size());
  if (ns < 64) {
    return n;  // mostly non-pruned tensors at the sample points: no bracket
  }
  const double q = static_cast<double>(k) / static_cast<double>(n);  // fraction above tau
  const double mu = q * ns;
  const double d = 4.5 * std::sqrt(std::max(mu * (1.0 - q), 1.0)) + 8.0;
  // ranks counted from the top (0 = the largest sample) -> ascending positions
  const int64_t r_hi = static_cast<int64_t>(std::floor(mu - d));
  const int64_t r_lo = static_cast<int64_t>(std::ceil(mu + d));
  if (r_lo < ns || r_hi >= 0) {
    const int64_t p_lo = r_lo < ns ? ns - 1 - r_lo : 0;
    const int64_t p_hi = r_hi >= 0 ? ns - 1 - r_hi : ns - 1;
    K k_lo, k_hi;
    select_two(sample, p_lo, p_hi, k_lo, k_hi);
    if (r_lo < ns) {
      lo = value_of_key<scalar_t>(k_lo);
    }
    if (r_hi >= 0) {
      hi = value_of_key<scalar_t>(k_hi);
    }
  }
  const double frac = std::min(1.0, (std::min<double>(r_lo, ns) - std::max<double>(r_hi, 0)) / ns);
  return static_cast<int64_t>(frac * static_cast<double>(n)) + 1;
}

// Result of the selection: tau and (when asked) the squared norms.
struct Selected {
  double g_r2 = 0.0, x_m2 = 0.0;
  bool ok = false;   // false: bracket missed or too many candidates (use the fallback)
};

// Scratch buffers of one thread for a chunk's candidates (reused, never
// initialised: the scan writes before it reads).
template <typename T>
T* scratch(int slot, int64_t size) {
  thread_local std::vector<T> bufs[2];
  if (static_cast<int64_t>(bufs[slot].size()) < size) {
    bufs[slot].resize(size);
  }
  return bufs[slot].data();
}

// The r-th largest (r >= 1) of the candidate keys, all in [klo, khi]: a
// 4096-bin histogram over the key range, then nth_element inside one bin.
template <typename K, typename T>
K kth_largest_candidate(const std::vector<ScanOut<T>>& outs, K klo, K khi, int64_t r, int64_t ncand) {
  const uint64_t span = static_cast<uint64_t>(khi) - static_cast<uint64_t>(klo);
  const int shift = bin_shift(span);
  const int64_t nbins = static_cast<int64_t>(span >> shift) + 1;
  // Histogram and bin collection run over the chunks' candidate lists in
  // parallel (one histogram and one key list per task, merged in task order, so
  // the result does not depend on the thread count: the keys of a bin form a
  // multiset and nth_element only needs their values).
  const int64_t nouts = static_cast<int64_t>(outs.size());
  constexpr int64_t kTasks = 8;
  const int64_t grain = ncand < kSerialCandidates ? kTasks : 1;  // few: no parallel region
  const int64_t per = (nouts + kTasks - 1) / kTasks;
  std::vector<std::vector<int64_t>> hists(kTasks);
  at::parallel_for(0, kTasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      std::vector<int64_t>& h = hists[t];
      h.assign(nbins, 0);
      for (int64_t i = t * per; i < std::min(nouts, (t + 1) * per); ++i) {
        const auto& o = outs[i];
        for (int64_t j = 0; j < o.ncand; ++j) {
          ++h[(magnitude_key<T>(o.cg[j]) - klo) >> shift];
        }
      }
    }
  });
  std::vector<int64_t> hist(nbins, 0);
  for (const auto& h : hists) {
    for (int64_t b = 0; b < nbins; ++b) {
      hist[b] += h[b];
    }
  }
  int64_t bin = nbins - 1, above = 0;
  for (; bin > 0 && above + hist[bin] < r; --bin) {
    above += hist[bin];
  }
  std::vector<std::vector<K>> parts(kTasks);
  at::parallel_for(0, kTasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = t * per; i < std::min(nouts, (t + 1) * per); ++i) {
        const auto& o = outs[i];
        for (int64_t j = 0; j < o.ncand; ++j) {
          const K key = magnitude_key<T>(o.cg[j]);
          if (static_cast<int64_t>((key - klo) >> shift) == bin) {
            parts[t].push_back(key);
          }
        }
      }
    }
  });
  std::vector<K> keys;
  keys.reserve(hist[bin]);
  for (const auto& part : parts) {
    keys.insert(keys.end(), part.begin(), part.end());
  }
  const int64_t pos = static_cast<int64_t>(keys.size()) - (r - above);  // ascending position
  std::nth_element(keys.begin(), keys.begin() + pos, keys.end());
  return keys[pos];
}

// Scan + exact select among the candidates. kNorms: also ||g||_R^2 and
// ||x||_M^2. Raises ValueError (nothing written) on a non-finite gradient.
template <typename scalar_t, bool kX, bool kNorms>
Selected sampled_select(const std::vector<Seg>& segs, int64_t total, int64_t n, int64_t k, const char* op,
    const char* what, scalar_t& tau) {
  using K = typename KeyOf<scalar_t>::type;
  constexpr scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  constexpr int64_t kPad = 16;  // the W-wide candidate stores may write past the count
  scalar_t lo = inf, hi = inf;  // k <= 0: no candidates, finiteness only
  const int64_t expected = k > 0 ? sample_bracket<scalar_t>(segs, total, n, k, kX, lo, hi) : 0;
  // Cap on the kept candidates: 4x the expectation (small n: all of them).
  const int64_t cap = n < kSampleMin ? n : std::max<int64_t>(4 * expected, kChunk);
  const int64_t nchunks = num_chunks(total);
  std::vector<ScanOut<scalar_t>> outs(nchunks);
  std::atomic<int64_t> kept{0};
  std::atomic<bool> overflow{false};
  for_each_chunk(total, [&](int64_t ch, int64_t begin, int64_t end) {
    ScanOut<scalar_t>& out = outs[ch];
    scalar_t* cg = scratch<scalar_t>(0, end - begin + kPad);
    scalar_t* cx = kNorms ? scratch<scalar_t>(1, end - begin + kPad) : nullptr;
    scan_chunk<scalar_t, kX, kNorms>(segs, begin, end, lo, hi, out, cg, cx);
    if (kept.fetch_add(out.ncand) + out.ncand > cap) {
      overflow = true;
    }
    if (!overflow && out.ncand > 0) {
      out.cg.assign(cg, cg + out.ncand);
      if (kNorms) {
        out.cx.assign(cx, cx + out.ncand);
      }
    }
  });
  Selected res;
  int64_t above = 0, ncand = 0;
  bool bad = false;
  for (const auto& o : outs) {
    above += o.above;
    ncand += o.ncand;
    bad |= o.bad;
  }
  TORCH_CHECK_VALUE(!bad, op, ": ", what, " contain a non-finite value; nothing was updated");
  if (k <= 0) {
    res.ok = true;  // check only (T >= n: every element is relevant)
    return res;
  }
  if (overflow || above >= k || above + ncand < k) {
    return res;
  }
  const K tkey = kth_largest_candidate<K, scalar_t>(outs, magnitude_key<scalar_t>(lo),
      magnitude_key<scalar_t>(hi), k - above, ncand);
  tau = value_of_key<scalar_t>(tkey);
  if constexpr (kNorms) {
    // The candidates' share, per chunk in parallel, then summed in chunk order.
    std::vector<double> cg2(nchunks, 0.0), cx2(nchunks, 0.0);
    at::parallel_for(0, nchunks, ncand < kSerialCandidates ? nchunks : 1, [&](int64_t cb, int64_t ce) {
      for (int64_t ch = cb; ch < ce; ++ch) {
        const auto& o = outs[ch];
        double sg = 0.0, sx = 0.0;
        for (int64_t j = 0; j < o.ncand; ++j) {  // branch-free (cpu_math.h): the split is ~50/50
          const scalar_t g = o.cg[j], x = o.cx[j];
          // key >= tkey without a compare GCC would turn into a branch (keys < 2^(bits-1))
          const K diff = magnitude_key<scalar_t>(g) - tkey;
          const double rel = static_cast<double>(1 - static_cast<int>(diff >> (8 * sizeof(K) - 1)));
          sg += rel * (double(g) * double(g));
          sx += cpu_math::select_lt(0.0, static_cast<double>(x * g), (1.0 - rel) * (double(x) * double(x)));
        }
        cg2[ch] = sg;
        cx2[ch] = sx;
      }
    });
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      res.g_r2 += outs[ch].g2 + cg2[ch];
      res.x_m2 += outs[ch].x2 + cx2[ch];
    }
  }
  res.ok = true;
  return res;
}

// ||g||_R^2 and ||x||_M^2 for a known tau, squares in double (a pass over g and x).
template <typename scalar_t>
Selected exact_norms(const std::vector<Seg>& segs, int64_t total, scalar_t tau) {
  Selected res;
  const int64_t nchunks = num_chunks(total);
  std::vector<double> gr(nchunks, 0.0), xm(nchunks, 0.0);
  for_each_chunk(total, [&](int64_t ch, int64_t begin, int64_t end) {
    for_each_piece(segs, begin, end, [&](const Seg& s, int64_t b, int64_t e) {
      if (s.prune) {
        norms_range<scalar_t>(s, b, e, tau, gr[ch], xm[ch]);
      }
    });
  });
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    res.g_r2 += gr[ch];
    res.x_m2 += xm[ch];
  }
  res.ok = true;
  return res;
}

// tau (and the norms with kNorms) for one scope: sampled select, or the exact
// radix select + norms pass when the sample's bracket missed.
template <typename scalar_t, bool kX, bool kNorms>
Selected select_scope(const std::vector<Seg>& segs, int64_t total, int64_t n, int64_t k, const char* op,
    const char* what, scalar_t& tau) {
  tau = scalar_t(0);
  if (k <= 0 || sampling_enabled()) {
    const Selected s = sampled_select<scalar_t, kX, kNorms>(segs, total, n, k, op, what, tau);
    if (s.ok) {
      if constexpr (kNorms) {
        // The scan sums ||g||^2 over the surely relevant elements in short
        // float blocks, where squares of |g| < ~1e-19 are denormal and of
        // |g| < ~1e-23 are 0 (vanishing gradients). Each element loses less
        // than 2^-126, so below n 2^-102 the loss could exceed 2^-24 of the
        // sum. ||x||^2 leaves out squares below NormGuard::kXMin^2, which
        // could exceed 2^-24 (2^-53) of the sum below n kXMin^2 2^24 (2^53).
        // Then both norms are taken again in double (a pass over g and x;
        // never for parameters and gradients of ordinary size).
        constexpr double kXMin = NormGuard<scalar_t>::kXMin;
        constexpr bool kFloat = std::is_same<scalar_t, float>::value;
        const double nd = static_cast<double>(n);
        if ((kFloat && s.g_r2 < nd * 0x1p-102) || s.x_m2 < nd * kXMin * kXMin * (kFloat ? 0x1p24 : 0x1p53)) {
          return exact_norms<scalar_t>(segs, total, tau);
        }
      }
      return s;
    }
  } else {
    sampled_select<scalar_t, kX, false>(segs, total, n, 0, op, what, tau);  // finiteness check only
  }
  tau = radix_select<scalar_t, kX>(segs, total, k);
  if constexpr (kNorms) {
    return exact_norms<scalar_t>(segs, total, tau);
  }
  Selected res;
  res.ok = true;
  return res;
}

template <typename scalar_t>
void update_pass(const std::vector<Seg>& segs, int64_t total, scalar_t tau, double r, int version) {
  for_each_chunk(total, [&](int64_t, int64_t begin, int64_t end) {
    for_each_piece(segs, begin, end,
        [&](const Seg& s, int64_t b, int64_t e) { update_range<scalar_t>(s, b, e, tau, r, version); });
  });
}

// ---------------------------------------------------------------- entry points

void check_list(at::TensorList ts, const at::Tensor& ref, size_t count, const char* op, const char* name) {
  TORCH_CHECK_VALUE(ts.size() == count, op, ": ", name, " must have ", count, " tensors, got ", ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    TORCH_CHECK_VALUE(ts[i].scalar_type() == ref.scalar_type(), op, ": ", name, "[", i, "] must have dtype ",
        ref.scalar_type(), ", got ", ts[i].scalar_type());
    TORCH_CHECK_VALUE(ts[i].device() == ref.device(), op, ": ", name, "[", i, "] must be on ", ref.device());
    TORCH_CHECK_VALUE(ts[i].layout() == at::kStrided, op, ": ", name, "[", i, "] must be a dense (strided) tensor");
  }
}

// params and grads of one dtype, device and layout (that of params[0]), each
// grads[i] shaped like params[i].
void check_pairs(at::TensorList params, at::TensorList grads, const char* op) {
  const size_t nt = params.size();
  check_list(params, params[0], nt, op, "params");
  check_list(grads, params[0], nt, op, "grads");
  for (size_t i = 0; i < nt; ++i) {
    TORCH_CHECK_VALUE(grads[i].sizes() == params[i].sizes(), op, ": grads[", i, "] must have the shape of params[",
        i, "] ", params[i].sizes());
  }
}

// The segments of contiguous (x, g) lists with their rows of `hyper` (empty
// tensors skipped; the tensors stay owned by the caller), the number of
// pruned elements and whether a tensor has weight decay.
struct ParamSegments {
  std::vector<Seg> segs;
  int64_t total = 0, n_pruned = 0;
  bool any_wd = false;
};

ParamSegments param_segments(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& gs,
    const double* hp) {
  ParamSegments out;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i].numel() == 0) {
      continue;
    }
    Seg sg{};
    sg.x = const_cast<void*>(xs[i].data_ptr());
    sg.g = gs[i].data_ptr();
    sg.n = xs[i].numel();
    sg.offset = out.total;
    for (int c = 0; c < kHyperCols; ++c) {
      sg.h[c] = hp[i * kHyperCols + c];
    }
    sg.prune = sg.h[kPrune] != 0.0;
    out.any_wd |= sg.h[kWeightDecay] != 0.0;
    out.n_pruned += sg.prune ? sg.n : 0;
    out.segs.push_back(sg);
    out.total += sg.n;
  }
  return out;
}

// A (params, grads, hyper) triple checked (check_pairs) and made contiguous,
// with its segments (which point into xs and gs: kept together).
struct PreparedPairs {
  at::Tensor h;
  std::vector<at::Tensor> xs, gs;
  ParamSegments ps;
};

PreparedPairs prepare_pairs(at::TensorList params, at::TensorList grads, const at::Tensor& hyper, const char* op) {
  check_pairs(params, grads, op);
  PreparedPairs pp;
  pp.h = hyper.contiguous();
  pp.xs = contiguous_all(params);
  pp.gs = contiguous_all(grads);
  pp.ps = param_segments(pp.xs, pp.gs, pp.h.data_ptr<double>());
  return pp;
}

at::Tensor topk_threshold_cpu(at::TensorList values, int64_t k) {
  const char* op = "topk_threshold";
  TORCH_CHECK_VALUE(!values.empty(), op, ": values must not be empty");
  const auto& v0 = values[0];
  TORCH_CHECK_VALUE(v0.scalar_type() == at::kFloat || v0.scalar_type() == at::kDouble, op,
      ": values must be float32 or float64, got ", v0.scalar_type());
  check_list(values, v0, values.size(), op, "values");
  std::vector<at::Tensor> keep;
  std::vector<Seg> segs;
  int64_t total = 0;
  for (const auto& v : values) {
    if (v.numel() == 0) {
      continue;
    }
    keep.push_back(v.contiguous());
    Seg s{};
    s.g = keep.back().data_ptr();
    s.x = nullptr;
    s.n = v.numel();
    s.offset = total;
    s.prune = true;
    segs.push_back(s);
    total += s.n;
  }
  TORCH_CHECK_VALUE(k >= 1 && k <= total, op, ": k must be in [1, n=", total, "], got ", k);
  return AT_DISPATCH_FLOATING_TYPES(v0.scalar_type(), "topk_threshold", [&] {
    scalar_t tau;
    select_scope<scalar_t, false, false>(segs, total, total, k, op, "values", tau);
    return at::scalar_tensor(tau, v0.options());
  });
}

void prunadag_step_cpu(at::TensorList params, at::TensorList opt_sums, at::TensorList dec_sums,
    at::TensorList grads, const at::Tensor& hyper, int64_t relevant, int64_t version,
    const std::optional<at::Tensor>& found_nonfinite, const std::optional<at::Tensor>& selection) {
  const char* op = "prunadag_step_";
  const size_t nt = params.size();
  TORCH_CHECK_VALUE(version >= 0 && version <= 4, op, ": version must be 0 (relevant_only) or 1..4, got ", version);
  check_prunadag_writes(params, opt_sums, dec_sums, found_nonfinite, op);
  // A given selection [tau, r] (the global threshold and ratio of a scope
  // whose elements are spread over several processes) replaces steps 2 and the
  // ratio's norms: this call only checks finiteness and runs the element pass.
  // A third element 1 ([tau, r, 1]) says the caller has checked every
  // gradient finite already (the sharded step agrees on it over the ranks in
  // its selection): the element pass alone, one read of g less.
  const bool given = selection.has_value() && selection->defined();
  double given_tau = 0.0, given_r = 0.0;
  bool checked = false;
  if (given) {
    const auto& sel = *selection;
    TORCH_CHECK_VALUE(sel.scalar_type() == at::kDouble && (sel.numel() == 2 || sel.numel() == 3) &&
        sel.device().is_cpu(), op, ": selection must be a float64 tensor of 2 elements [tau, r] (or 3: [tau, r, "
        "checked]) on the CPU, got ", sel.scalar_type(), " ", sel.sizes(), " on ", sel.device());
    const at::Tensor sc = sel.contiguous();
    given_tau = sc.data_ptr<double>()[0];
    given_r = sc.data_ptr<double>()[1];
    TORCH_CHECK_VALUE(std::isfinite(given_tau) && given_tau >= 0.0, op,
        ": selection[0] (the threshold tau) must be finite and >= 0, got ", given_tau);
    TORCH_CHECK_VALUE(std::isfinite(given_r) && given_r >= 0.0, op,
        ": selection[1] (the ratio r) must be finite and >= 0, got ", given_r);
    if (sel.numel() == 3) {
      const double c = sc.data_ptr<double>()[2];
      TORCH_CHECK_VALUE(c == 0.0 || c == 1.0, op, ": selection[2] (gradients already checked finite) must be 0 or 1, "
          "got ", c);
      checked = c == 1.0;
    }
  }
  if (nt > 0 && is_reduced_float(params[0].scalar_type())) {
    // float16 / bfloat16: computed in float32, stored in the params' dtype
    return step_in_float32(params, opt_sums, dec_sums, grads, hyper, relevant, version, found_nonfinite, selection,
        /*host_flag=*/true, &prunadag_step_cpu);
  }
  const bool flagged = found_nonfinite.has_value() && found_nonfinite->defined();
  if (flagged) {
    const auto& f = *found_nonfinite;
    TORCH_CHECK_VALUE(f.scalar_type() == at::kFloat && f.numel() == 1 && f.device().is_cpu(), op,
        ": found_nonfinite must be a one-element float32 tensor on the CPU, got ", f.scalar_type(), " ", f.sizes(),
        " on ", f.device());
    if (f.item<float>() != 0.0f) {
      return;  // an earlier scope of this step had a non-finite gradient: skip
    }
  }
  if (nt == 0) {
    return;
  }
  const auto& p0 = params[0];
  TORCH_CHECK_VALUE(p0.scalar_type() == at::kFloat || p0.scalar_type() == at::kDouble, op,
      ": params must be float16, bfloat16, float32 or float64, got ", p0.scalar_type());
  check_list(params, p0, nt, op, "params");
  check_list(opt_sums, p0, nt, op, "opt_sums");
  check_list(dec_sums, p0, nt, op, "dec_sums");
  check_list(grads, p0, nt, op, "grads");
  TORCH_CHECK_VALUE(hyper.scalar_type() == at::kDouble && hyper.dim() == 2 && hyper.size(0) == (int64_t)nt &&
      hyper.size(1) == kHyperCols, op, ": hyper must be a float64 tensor of shape (", nt, ", ", kHyperCols,
      "), got ", hyper.scalar_type(), " ", hyper.sizes());
  const at::Tensor h = hyper.to(at::kCPU).contiguous();
  const double* hp = h.data_ptr<double>();
  for (size_t i = 0; i < nt; ++i) {
    TORCH_CHECK_VALUE(opt_sums[i].sizes() == params[i].sizes() && dec_sums[i].sizes() == params[i].sizes() &&
        grads[i].sizes() == params[i].sizes(), op, ": opt_sums[", i, "], dec_sums[", i, "] and grads[", i,
        "] must have the shape of params[", i, "] ", params[i].sizes());
  }
  // Work on contiguous tensors in the same logical order; copy back the ones
  // that were not contiguous after the update.
  const auto xs = contiguous_all(params), sos = contiguous_all(opt_sums), sds = contiguous_all(dec_sums),
             gs = contiguous_all(grads);
  std::vector<Seg> segs;
  int64_t total = 0, n_pruned = 0;
  bool any_wd = false;
  for (size_t i = 0; i < nt; ++i) {
    if (params[i].numel() == 0) {
      continue;
    }
    Seg s{};
    s.x = xs[i].data_ptr();
    s.so = sos[i].data_ptr();
    s.sd = sds[i].data_ptr();
    s.g = gs[i].data_ptr();
    s.n = params[i].numel();
    s.offset = total;
    for (int c = 0; c < kHyperCols; ++c) {
      s.h[c] = hp[i * kHyperCols + c];
    }
    s.prune = s.h[kPrune] != 0.0;
    any_wd |= s.h[kWeightDecay] != 0.0;
    if (s.prune) {
      n_pruned += s.n;
    }
    segs.push_back(s);
    total += s.n;
  }
  if (total == 0) {
    return;
  }
  TORCH_CHECK_VALUE(given || n_pruned == 0 || (relevant >= 1 && relevant <= n_pruned), op,
      ": relevant (T) must be in [1, n=", n_pruned, "], got ", relevant);
  bool skipped = false;
  AT_DISPATCH_FLOATING_TYPES(p0.scalar_type(), "prunadag_step_", [&] {
    if (given) {
      const scalar_t tau = static_cast<scalar_t>(given_tau);
      TORCH_CHECK_VALUE(static_cast<double>(tau) == given_tau, op, ": selection[0] (the threshold tau) must be a ",
          "value of the params' dtype, got ", given_tau);
      try {
        scalar_t unused;
        if (checked) {
          // (finiteness known)
        } else if (any_wd) {
          sampled_select<scalar_t, true, false>(segs, total, n_pruned, 0, op, "grads", unused);
        } else {
          sampled_select<scalar_t, false, false>(segs, total, n_pruned, 0, op, "grads", unused);
        }
      } catch (const c10::ValueError&) {
        if (!flagged) {
          throw;
        }
        found_nonfinite->fill_(1.0);
        skipped = true;
        return;
      }
      update_pass<scalar_t>(segs, total, tau, given_r, static_cast<int>(version));
      return;
    }
    // T >= n: every element is relevant; the pass only checks finiteness.
    const int64_t k = (n_pruned == 0 || relevant >= n_pruned) ? 0 : relevant;
    // The ratio r (versions 1, 3, relevant_only) needs the norms, which read x.
    const bool norms = k > 0 && version != 2 && version != 4;
    scalar_t tau;
    Selected sel;
    try {
      if (norms) {
        sel = select_scope<scalar_t, true, true>(segs, total, n_pruned, k, op, "grads", tau);
      } else if (any_wd) {
        sel = select_scope<scalar_t, true, false>(segs, total, n_pruned, k, op, "grads", tau);
      } else {
        sel = select_scope<scalar_t, false, false>(segs, total, n_pruned, k, op, "grads", tau);
      }
    } catch (const c10::ValueError&) {
      if (!flagged) {
        throw;  // the only ValueError of the selection: a non-finite gradient
      }
      found_nonfinite->fill_(1.0);
      skipped = true;
      return;
    }
    const double r = norms ? ratio(sel.g_r2, sel.x_m2) : 0.0;
    update_pass<scalar_t>(segs, total, tau, r, static_cast<int>(version));
  });
  if (skipped) {
    return;
  }
  copy_back(xs, params);
  copy_back(sos, opt_sums);
  copy_back(sds, dec_sums);
}

// The one pass of topk_bracket and prunadag_bracket, per chunk: the count
// above hi, the candidates in [lo, hi] (kX: with their x, and the norms'
// sums outside the bracket) and the non-finite flag; segments that are not
// pruned are only checked for finiteness.
template <typename scalar_t, bool kX>
std::vector<ScanOut<scalar_t>> bracket_scan(const std::vector<Seg>& segs, int64_t total, scalar_t lo, scalar_t hi) {
  constexpr int64_t kPad = 16;  // the W-wide candidate stores may write past the count
  std::vector<ScanOut<scalar_t>> outs(total > 0 ? num_chunks(total) : 0);
  if (total == 0) {
    return outs;
  }
  for_each_chunk(total, [&](int64_t ch, int64_t begin, int64_t end) {
    ScanOut<scalar_t>& out = outs[ch];
    scalar_t* cg = scratch<scalar_t>(0, end - begin + kPad);
    scalar_t* cx = kX ? scratch<scalar_t>(1, end - begin + kPad) : nullptr;
    scan_chunk<scalar_t, kX, kX>(segs, begin, end, lo, hi, out, cg, cx);
    if (out.ncand > 0 && !out.bad) {
      out.cg.assign(cg, cg + out.ncand);
      if (kX) {
        out.cx.assign(cx, cx + out.ncand);
      }
    }
  });
  return outs;
}

std::tuple<at::Tensor, at::Tensor> topk_bracket_cpu(at::TensorList values, double lo, double hi) {
  const char* op = "topk_bracket";
  TORCH_CHECK_VALUE(!values.empty(), op, ": values must not be empty");
  const auto& v0 = values[0];
  TORCH_CHECK_VALUE(v0.scalar_type() == at::kFloat || v0.scalar_type() == at::kDouble, op,
      ": values must be float32 or float64, got ", v0.scalar_type());
  check_list(values, v0, values.size(), op, "values");
  TORCH_CHECK_VALUE(std::isfinite(lo) && lo >= 0.0, op, ": lo must be finite and >= 0, got ", lo);
  TORCH_CHECK_VALUE(!std::isnan(hi) && hi >= lo, op, ": hi must be >= lo (inf allowed), got lo=", lo, ", hi=", hi);
  std::vector<at::Tensor> keep;
  std::vector<Seg> segs;
  int64_t total = 0;
  for (const auto& v : values) {
    if (v.numel() == 0) {
      continue;
    }
    keep.push_back(v.contiguous());
    Seg sg{};
    sg.g = keep.back().data_ptr();
    sg.n = v.numel();
    sg.offset = total;
    sg.prune = true;
    segs.push_back(sg);
    total += sg.n;
  }
  at::Tensor above = at::zeros({}, v0.options().dtype(at::kLong));
  at::Tensor cands;
  AT_DISPATCH_FLOATING_TYPES(v0.scalar_type(), "topk_bracket", [&] {
    const scalar_t lo_t = static_cast<scalar_t>(lo), hi_t = static_cast<scalar_t>(hi);
    TORCH_CHECK_VALUE(static_cast<double>(lo_t) == lo && static_cast<double>(hi_t) == hi, op,
        ": lo and hi must be values of the values' dtype, got lo=", lo, ", hi=", hi);
    const auto outs = bracket_scan<scalar_t, false>(segs, total, lo_t, hi_t);
    int64_t n_above = 0, ncand = 0;
    bool bad = false;
    for (const auto& o : outs) {
      n_above += o.above;
      ncand += o.ncand;
      bad |= o.bad;
    }
    TORCH_CHECK_VALUE(!bad, op, ": values contain a non-finite value");
    above.fill_(n_above);
    cands = at::empty({ncand}, v0.options());
    scalar_t* dst = cands.data_ptr<scalar_t>();
    for (const auto& o : outs) {  // in index order: deterministic
      for (const scalar_t c : o.cg) {
        *dst++ = std::abs(c);  // (-c for c < 0 left -0.0 a negative zero: its bits are not |v|'s)
      }
    }
  });
  return {above, cands};
}

at::Tensor prunadag_norms_cpu(at::TensorList params, at::TensorList grads, const at::Tensor& hyper,
    const at::Tensor& tau) {
  const char* op = "prunadag_norms";
  const size_t nt = params.size();
  TORCH_CHECK_VALUE(grads.size() == nt, op, ": grads must have ", nt, " tensors, got ", grads.size());
  TORCH_CHECK_VALUE(hyper.scalar_type() == at::kDouble && hyper.dim() == 2 && hyper.size(0) == (int64_t)nt &&
      hyper.size(1) == kHyperCols, op, ": hyper must be a float64 tensor of shape (", nt, ", ", kHyperCols,
      "), got ", hyper.scalar_type(), " ", hyper.sizes());
  TORCH_CHECK_VALUE(tau.scalar_type() == at::kDouble && tau.numel() == 1 && tau.device().is_cpu(), op,
      ": tau must be a one-element float64 tensor on the CPU, got ", tau.scalar_type(), " ", tau.sizes(), " on ",
      tau.device());
  const double tau_d = tau.item<double>();
  TORCH_CHECK_VALUE(std::isfinite(tau_d) && tau_d >= 0.0, op, ": tau must be finite and >= 0, got ", tau_d);
  auto out = at::zeros({3}, hyper.options().device(at::kCPU));
  if (nt == 0) {
    return out;
  }
  const auto& p0 = params[0];
  if (is_reduced_float(p0.scalar_type())) {
    // float16 / bfloat16: the values the fused step computes with (float32)
    check_list(params, p0, nt, op, "params");
    check_list(grads, p0, nt, op, "grads");
    std::vector<at::Tensor> xs, gs;
    for (size_t i = 0; i < nt; ++i) {
      TORCH_CHECK_VALUE(grads[i].sizes() == params[i].sizes(), op, ": grads[", i, "] must have the shape of params[",
          i, "] ", params[i].sizes());
      xs.push_back(params[i].to(at::kFloat));
      gs.push_back(grads[i].to(at::kFloat));
    }
    return prunadag_norms_cpu(xs, gs, hyper, tau);
  }
  TORCH_CHECK_VALUE(p0.scalar_type() == at::kFloat || p0.scalar_type() == at::kDouble, op,
      ": params must be float16, bfloat16, float32 or float64, got ", p0.scalar_type());
  const PreparedPairs pp = prepare_pairs(params, grads, hyper, op);
  const auto& segs = pp.ps.segs;
  const int64_t total = pp.ps.total, n_pruned = pp.ps.n_pruned;
  const bool any_wd = pp.ps.any_wd;
  if (total == 0) {
    return out;
  }
  double* o = out.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES(p0.scalar_type(), "prunadag_norms", [&] {
    const scalar_t t = static_cast<scalar_t>(tau_d);
    TORCH_CHECK_VALUE(static_cast<double>(t) == tau_d, op, ": tau must be a value of the params' dtype, got ", tau_d);
    try {
      scalar_t unused;
      if (any_wd) {
        sampled_select<scalar_t, true, false>(segs, total, n_pruned, 0, op, "grads", unused);
      } else {
        sampled_select<scalar_t, false, false>(segs, total, n_pruned, 0, op, "grads", unused);
      }
    } catch (const c10::ValueError&) {
      o[2] = 1.0;  // a non-finite effective gradient: reported, not raised (the caller agrees on it first)
      return;
    }
    const Selected sel = exact_norms<scalar_t>(segs, total, t);
    o[0] = sel.g_r2;
    o[1] = sel.x_m2;
  });
  return out;
}

// The bracket pass of the sharded PrunAdag step: the scan of the one-process
// fused step (counts, the ratio's norms outside [lo, hi], candidates with
// their share of ||x||_M^2 should they fall below tau) over this process's
// part of a scope, non-finite values reported instead of raised.
std::tuple<at::Tensor, at::Tensor, at::Tensor> prunadag_bracket_cpu(at::TensorList params, at::TensorList grads,
    const at::Tensor& hyper, double lo, double hi) {
  const char* op = "prunadag_bracket";
  const size_t nt = params.size();
  TORCH_CHECK_VALUE(grads.size() == nt, op, ": grads must have ", nt, " tensors, got ", grads.size());
  TORCH_CHECK_VALUE(hyper.scalar_type() == at::kDouble && hyper.dim() == 2 && hyper.size(0) == (int64_t)nt &&
      hyper.size(1) == kHyperCols && hyper.device().is_cpu(), op, ": hyper must be a float64 CPU tensor of shape (",
      nt, ", ", kHyperCols, "), got ", hyper.scalar_type(), " ", hyper.sizes(), " on ", hyper.device());
  TORCH_CHECK_VALUE(std::isfinite(lo) && lo >= 0.0, op, ": lo must be finite and >= 0, got ", lo);
  TORCH_CHECK_VALUE(!std::isnan(hi) && hi >= lo, op, ": hi must be >= lo (inf allowed), got lo=", lo, ", hi=", hi);
  auto summary = at::zeros({4}, hyper.options());
  if (nt == 0) {
    // no params: no dtype to follow (float32 keys)
    return {summary, at::empty({0}, hyper.options().dtype(at::kFloat)), at::empty({0}, hyper.options())};
  }
  const auto& p0 = params[0];
  TORCH_CHECK_VALUE(p0.scalar_type() == at::kFloat || p0.scalar_type() == at::kDouble, op,
      ": params must be float32 or float64, got ", p0.scalar_type());
  const PreparedPairs pp = prepare_pairs(params, grads, hyper, op);
  const auto& segs = pp.ps.segs;
  const int64_t total = pp.ps.total;
  at::Tensor cand_g, cand_x;
  double* o = summary.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES(p0.scalar_type(), "prunadag_bracket", [&] {
    const scalar_t lo_t = static_cast<scalar_t>(lo), hi_t = static_cast<scalar_t>(hi);
    TORCH_CHECK_VALUE(static_cast<double>(lo_t) == lo && static_cast<double>(hi_t) == hi, op,
        ": lo and hi must be values of the params' dtype, got lo=", lo, ", hi=", hi);
    const auto outs = bracket_scan<scalar_t, true>(segs, total, lo_t, hi_t);
    int64_t n_above = 0, ncand = 0;
    double g2 = 0.0, x2 = 0.0;
    bool bad = false;
    for (const auto& out : outs) {  // in chunk order: deterministic
      n_above += out.above;
      ncand += out.ncand;
      g2 += out.g2;
      x2 += out.x2;
      bad |= out.bad;
    }
    if (bad) {
      o[3] = 1.0;  // reported, not raised: the processes agree on it first
      ncand = 0;
    } else {
      o[0] = static_cast<double>(n_above);
      o[1] = g2;
      o[2] = x2;
    }
    cand_g = at::empty({ncand}, p0.options());
    cand_x = at::empty({ncand}, p0.options().dtype(at::kDouble));
    if (ncand > 0) {
      scalar_t* dg = cand_g.data_ptr<scalar_t>();
      double* dm = cand_x.data_ptr<double>();
      for (const auto& out : outs) {  // in index order
        for (size_t j = 0; j < out.cg.size(); ++j) {
          const scalar_t g = out.cg[j], x = out.cx[j];
          *dg++ = std::abs(g);  // (-g for g < 0 left -0.0 a negative zero: its bits are not |ge|'s)
          *dm++ = x * g > scalar_t(0) ? double(x) * double(x) : 0.0;
        }
      }
    }
  });
  return {summary, cand_g, cand_x};
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("topk_threshold", &prunopt::cpu::topk_threshold_cpu);
  m.impl("prunadag_step_", &prunopt::cpu::prunadag_step_cpu);
  m.impl("prunadag_norms", &prunopt::cpu::prunadag_norms_cpu);
  m.impl("topk_bracket", &prunopt::cpu::topk_bracket_cpu);
  m.impl("prunadag_bracket", &prunopt::cpu::prunadag_bracket_cpu);
}
