// prunAdag on the CPU (SPEC.md section 2): the exact global top-T threshold and
// the fused step over one selection scope.
//
// Threshold: radix select on the key bits(|g|) (monotone for finite floats),
// 16 bits per pass (float: 2 passes, double: 4), each pass a histogram per
// fixed chunk of the concatenated index space, merged in integer counts, so
// the result is exact and deterministic and nothing of size n is allocated.
// The first pass also finds non-finite gradients: the step then raises
// ValueError before anything is written.
//
// Step: radix passes -> tau; one reduction pass (||g||_R^2, ||x||_M^2 in
// double, fixed lanes and chunks) -> r; one element pass that classifies and
// updates x and both accumulators. The element and reduction passes use SSE2
// packed arithmetic (branchless masks and blends: see cpu_math.h for why).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "prunopt/prunadag.h"
#include "prunopt/tensor_list.h"

namespace prunopt {
namespace cpu {
namespace {

using namespace prunopt::prunadag;

constexpr int64_t kGrain = 1 << 15;

struct Seg {
  void* x;
  void* so;
  void* sd;
  const void* g;
  int64_t n;
  int64_t offset;
  bool prune;
  double h[kHyperCols];
};

int64_t num_chunks(int64_t total) {
  const int64_t by_size = (total + kGrain - 1) / kGrain;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), by_size));
}

template <typename F>
void for_each_piece(const std::vector<Seg>& segs, int64_t begin, int64_t end, F&& f) {
  for (const auto& s : segs) {
    const int64_t b = std::max(begin, s.offset);
    const int64_t e = std::min(end, s.offset + s.n);
    if (b < e) {
      f(s, b - s.offset, e - s.offset);
    }
  }
}

// ---------------------------------------------------------------- selection

// One histogram pass of digit [shift, shift + bits) over the keys whose higher
// bits equal `prefix` (under `pmask`). Returns the merged counts; `bad` is set
// if a key (pruned or not) is inf/nan.
template <typename scalar_t, bool kWd>
std::vector<int64_t> hist_pass(const std::vector<Seg>& segs, int64_t total, int shift, int bits,
    typename KeyOf<scalar_t>::type prefix, typename KeyOf<scalar_t>::type pmask, bool check, bool& bad) {
  using K = typename KeyOf<scalar_t>::type;
  const int64_t nchunks = num_chunks(total);
  const int64_t nbins = int64_t(1) << bits;
  const K dmask = static_cast<K>(nbins - 1);
  std::vector<std::vector<uint32_t>> hists(nchunks);
  std::vector<char> bads(nchunks, 0);
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      hists[ch].assign(nbins, 0u);
      uint32_t* hist = hists[ch].data();
      K worst = 0;
      for_each_piece(segs, total * ch / nchunks, total * (ch + 1) / nchunks,
          [&](const Seg& s, int64_t b, int64_t e) {
        const scalar_t* gp = static_cast<const scalar_t*>(s.g);
        const scalar_t* xp = static_cast<const scalar_t*>(s.x);
        const scalar_t wd = static_cast<scalar_t>(s.h[kWeightDecay]);
        if (!s.prune) {
          if (check) {
            for (int64_t i = b; i < e; ++i) {
              const K key = magnitude_key<scalar_t>(kWd ? gp[i] + wd * xp[i] : gp[i]);
              worst = std::max(worst, key);
            }
          }
          return;
        }
        if (pmask == 0) {
          for (int64_t i = b; i < e; ++i) {
            const K key = magnitude_key<scalar_t>(kWd ? gp[i] + wd * xp[i] : gp[i]);
            worst = std::max(worst, key);
            hist[(key >> shift) & dmask]++;
          }
        } else {
          for (int64_t i = b; i < e; ++i) {
            const K key = magnitude_key<scalar_t>(kWd ? gp[i] + wd * xp[i] : gp[i]);
            if ((key & pmask) == prefix) {
              hist[(key >> shift) & dmask]++;
            }
          }
        }
      });
      bads[ch] = worst >= KeyOf<scalar_t>::kInf;
    }
  });
  std::vector<int64_t> out(nbins, 0);
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    bad |= bads[ch] != 0;
    for (int64_t j = 0; j < nbins; ++j) {
      out[j] += hists[ch][j];
    }
  }
  return out;
}

// The k-th largest key among the pruned elements (1 <= k <= n). Raises
// ValueError (nothing written yet) if a gradient is not finite.
template <typename scalar_t, bool kWd>
scalar_t select_threshold(const std::vector<Seg>& segs, int64_t total, int64_t k, const char* op, const char* what) {
  using K = typename KeyOf<scalar_t>::type;
  K prefix = 0, pmask = 0;
  int bits_left = KeyOf<scalar_t>::kBits;
  bool first = true;
  while (bits_left > 0) {
    const int bits = digit_bits(bits_left);
    const int shift = bits_left - bits;
    bool bad = false;
    const std::vector<int64_t> hist = hist_pass<scalar_t, kWd>(segs, total, shift, bits, prefix, pmask, first, bad);
    TORCH_CHECK_VALUE(!bad, op, ": ", what, " contain a non-finite value; nothing was updated");
    if (k <= 0) {
      return scalar_t(0);  // check-only pass (T >= n): every element is relevant
    }
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
    first = false;
  }
  return value_of_key<scalar_t>(prefix);
}

// ---------------------------------------------------------------- SIMD traits

#if defined(__SSE2__)
struct SimdF {
  using T = float;
  using V = __m128;
  static constexpr int W = 4;
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
  static V le(V a, V b) { return _mm_cmple_ps(a, b); }
  static V and_(V a, V b) { return _mm_and_ps(a, b); }
  static V or_(V a, V b) { return _mm_or_ps(a, b); }
  static V andnot(V a, V b) { return _mm_andnot_ps(a, b); }  // ~a & b
  static V xor_(V a, V b) { return _mm_xor_ps(a, b); }
  static V signbit() { return _mm_set1_ps(-0.0f); }
  static V ones() { return _mm_castsi128_ps(_mm_set1_epi32(-1)); }
  // lo/hi += v^2 in double
  static void acc_sq(__m128d& lo, __m128d& hi, V v) {
    const __m128d l = _mm_cvtps_pd(v), h = _mm_cvtps_pd(_mm_movehl_ps(v, v));
    lo = _mm_add_pd(lo, _mm_mul_pd(l, l));
    hi = _mm_add_pd(hi, _mm_mul_pd(h, h));
  }
};
struct SimdD {
  using T = double;
  using V = __m128d;
  static constexpr int W = 2;
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
  static V le(V a, V b) { return _mm_cmple_pd(a, b); }
  static V and_(V a, V b) { return _mm_and_pd(a, b); }
  static V or_(V a, V b) { return _mm_or_pd(a, b); }
  static V andnot(V a, V b) { return _mm_andnot_pd(a, b); }
  static V xor_(V a, V b) { return _mm_xor_pd(a, b); }
  static V signbit() { return _mm_set1_pd(-0.0); }
  static V ones() { return _mm_castsi128_pd(_mm_set1_epi32(-1)); }
  static void acc_sq(__m128d& lo, __m128d& hi, V v) {
    (void)hi;
    lo = _mm_add_pd(lo, _mm_mul_pd(v, v));
  }
};
template <typename T>
struct SimdOf;
template <>
struct SimdOf<float> { using type = SimdF; };
template <>
struct SimdOf<double> { using type = SimdD; };
#endif

// ---------------------------------------------------------------- reductions

struct Norms {
  double g_r2 = 0, x_m2 = 0;
};

// ||g||_R^2 and ||x||_M^2 over the pruned elements of one chunk range.
template <typename scalar_t>
Norms norms_range(const Seg& s, int64_t b, int64_t e, scalar_t tau) {
  const scalar_t* xp = static_cast<const scalar_t*>(s.x);
  const scalar_t* gp = static_cast<const scalar_t*>(s.g);
  const scalar_t wd = static_cast<scalar_t>(s.h[kWeightDecay]);
  const scalar_t sgn = s.h[kMaximize] != 0.0 ? scalar_t(-1) : scalar_t(1);
  Norms out;
  int64_t i = b;
#if defined(__SSE2__)
  using S = typename SimdOf<scalar_t>::type;
  using V = typename S::V;
  __m128d gr_lo = _mm_setzero_pd(), gr_hi = _mm_setzero_pd(), xm_lo = _mm_setzero_pd(), xm_hi = _mm_setzero_pd();
  const V vwd = S::set1(wd), vsgn = S::set1(sgn), vtau = S::set1(tau), sb = S::signbit(), z = S::zero();
  for (; i + S::W <= e; i += S::W) {
    const V x = S::load(xp + i);
    const V g = S::mul(S::add(S::load(gp + i), S::mul(vwd, x)), vsgn);
    const V rel = S::ge(S::andnot(sb, g), vtau);
    const V m = S::andnot(rel, S::gt(S::mul(x, g), z));
    S::acc_sq(gr_lo, gr_hi, S::and_(rel, g));
    S::acc_sq(xm_lo, xm_hi, S::and_(m, x));
  }
  double tmp[2];
  _mm_storeu_pd(tmp, _mm_add_pd(gr_lo, gr_hi));
  out.g_r2 = tmp[0] + tmp[1];
  _mm_storeu_pd(tmp, _mm_add_pd(xm_lo, xm_hi));
  out.x_m2 = tmp[0] + tmp[1];
#endif
  for (; i < e; ++i) {
    const scalar_t x = xp[i];
    const scalar_t g = effective_grad<scalar_t>(x, gp[i], wd, sgn);
    const bool rel = std::abs(g) >= tau;
    const double gd = g, xd = x;
    out.g_r2 += rel ? gd * gd : 0.0;
    out.x_m2 += (!rel && x * g > scalar_t(0)) ? xd * xd : 0.0;
  }
  return out;
}

template <typename scalar_t>
Norms norms_pass(const std::vector<Seg>& segs, int64_t total, scalar_t tau) {
  const int64_t nchunks = num_chunks(total);
  std::vector<Norms> parts(nchunks);
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      Norms acc;
      for_each_piece(segs, total * ch / nchunks, total * (ch + 1) / nchunks,
          [&](const Seg& s, int64_t b, int64_t e) {
        if (s.prune) {
          const Norms p = norms_range<scalar_t>(s, b, e, tau);
          acc.g_r2 += p.g_r2;
          acc.x_m2 += p.x_m2;
        }
      });
      parts[ch] = acc;
    }
  });
  Norms out;
  for (const auto& p : parts) {
    out.g_r2 += p.g_r2;
    out.x_m2 += p.x_m2;
  }
  return out;
}

// ---------------------------------------------------------------- element pass

template <typename scalar_t>
void update_range(const Seg& s, int64_t b, int64_t e, scalar_t tau, double r, int version) {
  scalar_t* xp = static_cast<scalar_t*>(s.x);
  scalar_t* sop = static_cast<scalar_t*>(s.so);
  scalar_t* sdp = static_cast<scalar_t*>(s.sd);
  const scalar_t* gp = static_cast<const scalar_t*>(s.g);
  const scalar_t wd = static_cast<scalar_t>(s.h[kWeightDecay]);
  const scalar_t sgn = s.h[kMaximize] != 0.0 ? scalar_t(-1) : scalar_t(1);
  const scalar_t tau_eff = s.prune ? tau : scalar_t(-1);
  const scalar_t lr = static_cast<scalar_t>(s.h[kLrK]);
  const scalar_t nlr = static_cast<scalar_t>(-s.h[kLrK]);
  const scalar_t a_scale = static_cast<scalar_t>(s.h[kLrK1] * a_factor(version, r));
  const scalar_t eps = static_cast<scalar_t>(s.h[kEps]);
  int64_t i = b;
#if defined(__SSE2__)
  using S = typename SimdOf<scalar_t>::type;
  using V = typename S::V;
  const V vwd = S::set1(wd), vsgn = S::set1(sgn), vtau = S::set1(tau_eff), vlr = S::set1(lr), vnlr = S::set1(nlr);
  const V vas = S::set1(a_scale), veps = S::set1(eps), sb = S::signbit(), z = S::zero();
  const V use_acc = version != 0 ? S::ones() : z;
  const V use_b = version >= 3 ? S::ones() : z;
  for (; i + S::W <= e; i += S::W) {
    const V x = S::load(xp + i), so = S::load(sop + i), sd = S::load(sdp + i);
    const V g = S::mul(S::add(S::load(gp + i), S::mul(vwd, x)), vsgn);
    const V rel = S::ge(S::andnot(sb, g), vtau);                              // eq. 2.6
    const V so_new = S::add(so, S::mul(g, g));                                // eq. 2.7
    const V st = S::div(S::mul(g, vnlr), S::add(S::sqrt(so_new), veps));     // eq. 2.9
    const V ax = S::andnot(sb, x);
    const V m = S::andnot(rel, S::gt(S::mul(x, g), z));
    const V a = S::mul(ax, vas);                                              // Table 1
    const V as = S::andnot(sb, st);
    const V bound_ok = S::or_(S::andnot(use_b, S::ones()), S::le(as, ax));
    const V acc = S::and_(S::and_(use_acc, m), S::and_(S::le(a, as), bound_ok));  // eq. 2.8
    const V opt = S::or_(rel, acc);                                           // eq. 2.4
    const V sd_new = S::add(sd, S::mul(x, x));                                // eq. 2.10
    const V sl = S::div(S::mul(ax, vlr), S::add(S::sqrt(sd_new), veps));
    const V dec = S::and_(m, S::min(sl, a));                                  // eq. 2.16
    const V xd = S::sub(x, S::or_(dec, S::and_(sb, x)));                      // x - copysign(dec, x)
    S::store(xp + i, S::or_(S::and_(opt, S::add(x, st)), S::andnot(opt, xd)));
    S::store(sop + i, S::or_(S::and_(opt, so_new), S::andnot(opt, so)));      // eq. 2.11
    S::store(sdp + i, S::or_(S::and_(opt, sd), S::andnot(opt, sd_new)));
  }
#endif
  for (; i < e; ++i) {
    const scalar_t g = effective_grad<scalar_t>(xp[i], gp[i], wd, sgn);
    update_one<scalar_t>(xp[i], sop[i], sdp[i], g, tau_eff, nlr, lr, a_scale, eps, version);
  }
}

template <typename scalar_t>
void update_pass(const std::vector<Seg>& segs, int64_t total, scalar_t tau, double r, int version) {
  const int64_t nchunks = num_chunks(total);
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      for_each_piece(segs, total * ch / nchunks, total * (ch + 1) / nchunks,
          [&](const Seg& s, int64_t b, int64_t e) { update_range<scalar_t>(s, b, e, tau, r, version); });
    }
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
    const scalar_t tau = select_threshold<scalar_t, false>(segs, total, k, op, "values");
    return at::scalar_tensor(tau, v0.options());
  });
}

void prunadag_step_cpu(at::TensorList params, at::TensorList opt_sums, at::TensorList dec_sums,
    at::TensorList grads, const at::Tensor& hyper, int64_t relevant, int64_t version) {
  const char* op = "prunadag_step_";
  const size_t nt = params.size();
  TORCH_CHECK_VALUE(version >= 0 && version <= 4, op, ": version must be 0 (relevant_only) or 1..4, got ", version);
  if (nt == 0) {
    return;
  }
  const auto& p0 = params[0];
  TORCH_CHECK_VALUE(p0.scalar_type() == at::kFloat || p0.scalar_type() == at::kDouble, op,
      ": params must be float32 or float64, got ", p0.scalar_type());
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
  TORCH_CHECK_VALUE(n_pruned == 0 || (relevant >= 1 && relevant <= n_pruned), op,
      ": relevant (T) must be in [1, n=", n_pruned, "], got ", relevant);
  AT_DISPATCH_FLOATING_TYPES(p0.scalar_type(), "prunadag_step_", [&] {
    // T >= n: every element is relevant; the pass only checks finiteness.
    const int64_t k = (n_pruned == 0 || relevant >= n_pruned) ? 0 : relevant;
    const scalar_t tau = any_wd ? select_threshold<scalar_t, true>(segs, total, k, op, "grads")
                                : select_threshold<scalar_t, false>(segs, total, k, op, "grads");
    double r = 0.0;
    if (n_pruned > 0 && version != 2 && version != 4) {
      const Norms nr = norms_pass<scalar_t>(segs, total, tau);
      r = ratio(nr.g_r2, nr.x_m2);
    }
    update_pass<scalar_t>(segs, total, tau, r, static_cast<int>(version));
  });
  copy_back(xs, params);
  copy_back(sos, opt_sums);
  copy_back(sds, dec_sums);
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("topk_threshold", &prunopt::cpu::topk_threshold_cpu);
  m.impl("prunadag_step_", &prunopt::cpu::prunadag_step_cpu);
}
