// topk_slice: one rank's slice of the sharded top-k threshold
// (prunopt.distributed.topk_threshold's bracketed select, step 1), in one
// call. From a fixed strided sample of |v| the rank brackets its share-th
// largest; the bracket, widened to a grid of at most `buckets` buckets of
// 2^j ulps aligned at multiples of 2^j, is read in one topk_bracket pass
// (the count above it, the candidates inside it, the finiteness check); the
// candidates' histogram on the grid is the slice; the candidates in the grid
// buckets around the share, at most `cap` of them, are the window.
//
// Outputs (on the values' device):
//   head   int64[12]: [n_r, above, start, j, nb, bad,            (the slice)
//                      w_above, w_lo, w_end, w_m,                (the window)
//                      scan_start, scan_stop]                    (what was read:
//          [scan_start, scan_stop), before a bracket open above is narrowed)
//          bit patterns of |v| (start, w_lo, w_end, scan_*); nb buckets of
//          2^j from start; bad = 1 on a non-finite value (then above = 0, no
//          candidates, no window); w_m = -1 when no window (cap = 0, bad, or
//          the share's bucket alone holds more than cap candidates).
//   hist   int64[nb]: candidates per grid bucket.
//   window the window's bit patterns (int32 for float32, int64 for float64),
//          in index order; w_above values lie at or above w_end, and for any
//          bit pattern t in [w_lo, w_end) this rank has exactly
//          w_above + #{window >= t} values >= t (w_lo = 0 when nothing lies
//          below the window, w_end = top + 1 when nothing lies above it).
//   inside the candidates (|v| with bit patterns in [scan_start, scan_stop)), in
//          index order.
// The reference is prunopt/reference/prunadag.py:topk_slice_reference; the
// bit-exact agreement of both is tested. On CUDA the small host steps (the
// sample's two order statistics, the grid, the histogram and the window)
// synchronise with the host: the bracketed select runs on the CPU.
#include "prunopt/topk_slice.h"

#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace prunopt {
namespace {

// The sample: about (6 n_r)^(2/3) values within [2^15, 2^20], in blocks of
// 128 contiguous values at a fixed stride; the bracket spans the sample's
// order statistics 5 standard deviations of a binomial count (plus 8 ranks)
// either side of the share (and at least cap / 2 values of the rank).
constexpr int64_t kSampleMin = int64_t{1} << 15;
constexpr int64_t kSampleMax = int64_t{1} << 20;
constexpr int64_t kSampleBlock = 128;
constexpr double kSampleScale = 6.0;
constexpr double kSampleSigmas = 5.0;

struct Fmt {
  bool f32;
  int64_t top;  // the largest finite magnitude's bit pattern
};

int64_t value_bits(double x, const Fmt& f) {
  if (f.f32) {
    const float v = static_cast<float>(x);
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<int64_t>(u & 0x7fffffffu);
  }
  uint64_t u;
  std::memcpy(&u, &x, 8);
  return static_cast<int64_t>(u & 0x7fffffffffffffffull);
}

double bits_value(int64_t b, const Fmt& f) {
  if (f.f32) {
    const uint32_t u = static_cast<uint32_t>(b);
    float v;
    std::memcpy(&v, &u, 4);
    return static_cast<double>(v);
  }
  const uint64_t u = static_cast<uint64_t>(b);
  double v;
  std::memcpy(&v, &u, 8);
  return v;
}

int bit_length(uint64_t x) {
  int n = 0;
  while (x) {
    ++n;
    x >>= 1;
  }
  return n;
}

int64_t ceil_shift(int64_t x, int j) {  // ceil(x / 2^j), 0 <= x < 2^63 (unsigned: no overflow)
  return static_cast<int64_t>((static_cast<uint64_t>(x) + ((uint64_t{1} << j) - 1)) >> j);
}

// (stop is unsigned: a float64 grid aligned past the largest finite may end
// at 2^63)
struct Grid {
  int j = 0;
  int64_t start = 0;
  uint64_t stop = 0;
};

// 2^j ulps per bucket, aligned at multiples of 2^j, at most `buckets` buckets
// from `first` to `end` (exclusive).
Grid make_grid(int64_t first, int64_t end, int64_t buckets) {
  Grid g;
  g.j = std::max(0, bit_length(static_cast<uint64_t>((end - first - 1) / buckets)) - 1);
  while (ceil_shift(end, g.j) - (first >> g.j) > buckets) {
    ++g.j;
  }
  g.start = (first >> g.j) << g.j;
  g.stop = static_cast<uint64_t>(ceil_shift(end, g.j)) << g.j;
  return g;
}

at::Tensor kth_largest(const at::Tensor& sample, int64_t r) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("prunopt::topk_threshold", "")
                       .typed<at::Tensor(at::TensorList, int64_t)>();
  return op.call(at::TensorList(sample), r);
}

std::tuple<at::Tensor, at::Tensor> bracket_pass(at::TensorList values, double lo, double hi) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("prunopt::topk_bracket", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(at::TensorList, double, double)>();
  return op.call(values, lo, hi);
}

// |v| of the fixed sample of the flat values (all of them when they are
// few), written into a buffer of this thread that later calls reuse (a fresh
// allocation of the sample's size costs its page faults at every call; the
// tensor is valid until this thread's next call).
template <typename scalar_t>
at::Tensor sample_of(const std::vector<at::Tensor>& flat, int64_t n_r) {
  const int64_t size = std::min(
      std::max(static_cast<int64_t>(std::pow(kSampleScale * static_cast<double>(n_r), 2.0 / 3.0)), kSampleMin),
      kSampleMax);
  const bool all = n_r <= size;
  const int64_t every = all ? 1 : n_r / size;
  int64_t count = 0;  // the sample's size
  for (const auto& v : flat) {
    const int64_t n = v.numel(), nb = n / kSampleBlock;
    count += all ? n : nb >= every ? (nb > every / 2 ? (nb - every / 2 + every - 1) / every * kSampleBlock : 0)
                                   : (n > every / 2 ? (n - every / 2 + every - 1) / every : 0);
  }
  thread_local std::vector<scalar_t> buf;
  if (static_cast<int64_t>(buf.size()) < count) {
    buf.resize(count);
  }
  scalar_t* out = buf.data();
  for (const auto& v : flat) {
    const at::Tensor c = v.contiguous();
    const scalar_t* p = c.data_ptr<scalar_t>();
    const int64_t n = c.numel(), nb = n / kSampleBlock;
    if (all) {
      for (int64_t i = 0; i < n; ++i) {
        *out++ = std::abs(p[i]);
      }
    } else if (nb >= every) {  // blocks every/2, every/2 + every, ... of kSampleBlock values
      // (blocks far apart: each is a few cache lines the hardware prefetcher
      // does not foresee, so the blocks a few strides ahead are requested now)
      constexpr int64_t kAhead = 4;
      for (int64_t b = every / 2; b < nb; b += every) {
        const scalar_t* q = p + b * kSampleBlock;
        if (b + kAhead * every < nb) {
          const char* ahead = reinterpret_cast<const char*>(q + kAhead * every * kSampleBlock);
          for (int64_t line = 0; line < kSampleBlock * static_cast<int64_t>(sizeof(scalar_t)); line += 64) {
            __builtin_prefetch(ahead + line);
          }
        }
        for (int64_t i = 0; i < kSampleBlock; ++i) {
          out[i] = std::abs(q[i]);
        }
        out += kSampleBlock;
      }
    } else {  // single values every/2, every/2 + every, ...
      for (int64_t i = every / 2; i < n; i += every) {
        *out++ = std::abs(p[i]);
      }
    }
  }
  TORCH_INTERNAL_ASSERT(out == buf.data() + count);
  return at::from_blob(buf.data(), {count},
      at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value));
}

// The same sample on another device (ATen ops on the values' device).
at::Tensor sample_on_device(const std::vector<at::Tensor>& flat, int64_t n_r) {
  const int64_t size = std::min(
      std::max(static_cast<int64_t>(std::pow(kSampleScale * static_cast<double>(n_r), 2.0 / 3.0)), kSampleMin),
      kSampleMax);
  std::vector<at::Tensor> parts;
  if (n_r <= size) {
    parts = flat;
  } else {
    const int64_t every = n_r / size;
    for (const auto& v : flat) {
      const int64_t nb = v.numel() / kSampleBlock;
      if (nb >= every) {
        parts.push_back(v.narrow(0, 0, nb * kSampleBlock).view({nb, kSampleBlock}).slice(0, every / 2, nb, every)
                            .reshape(-1));
      } else {
        parts.push_back(v.slice(0, std::min(every / 2, v.numel()), v.numel(), every));
      }
    }
  }
  return at::cat(parts).abs_();
}

// (lo, hi): likely to hold the share-th largest |v| and spread values either
// side of it; (0, inf) from an empty or non-finite sample.
std::pair<double, double> bracket_of_sample(const at::Tensor& sample, int64_t share, int64_t n_r, int64_t spread) {
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t ns = sample.numel();
  if (ns == 0) {
    return {0.0, inf};
  }
  const double q = static_cast<double>(share) / static_cast<double>(n_r);
  const double p = q * static_cast<double>(ns);
  double margin = ns == n_r ? 0.0 : kSampleSigmas * std::sqrt(std::max(p * (1 - q), 1.0)) + 8;
  margin = std::max(margin, static_cast<double>(spread * ns) / static_cast<double>(n_r));
  const int64_t top = static_cast<int64_t>(std::floor(p - margin));
  const int64_t bottom = static_cast<int64_t>(std::ceil(p + margin));
  try {
    const double hi = top < 1 ? inf : kth_largest(sample, top).item<double>();
    const double lo = bottom > ns ? 0.0 : kth_largest(sample, bottom).item<double>();
    return {lo, hi};
  } catch (const c10::ValueError&) {  // topk_threshold's only ValueError here: a non-finite value
    return {0.0, inf};
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_slice(at::TensorList values, int64_t share,
    int64_t buckets, int64_t cap) {
  const char* op = "topk_slice";
  TORCH_CHECK_VALUE(!values.empty(), op, ": values must not be empty");
  const auto& v0 = values[0];
  TORCH_CHECK_VALUE(v0.scalar_type() == at::kFloat || v0.scalar_type() == at::kDouble, op,
      ": values must be float32 or float64, got ", v0.scalar_type());
  for (size_t i = 0; i < values.size(); ++i) {  // (the messages of topk_bracket's checks)
    TORCH_CHECK_VALUE(values[i].scalar_type() == v0.scalar_type(), op, ": values[", i, "] must have dtype ",
        v0.scalar_type(), ", got ", values[i].scalar_type());
    TORCH_CHECK_VALUE(values[i].device() == v0.device(), op, ": values[", i, "] must be on ", v0.device());
    TORCH_CHECK_VALUE(values[i].layout() == at::kStrided, op, ": values[", i, "] must be a dense (strided) tensor");
  }
  TORCH_CHECK_VALUE(buckets >= 1, op, ": buckets must be >= 1, got ", buckets);
  TORCH_CHECK_VALUE(cap >= 0, op, ": cap must be >= 0, got ", cap);
  const Fmt f{v0.scalar_type() == at::kFloat,
      v0.scalar_type() == at::kFloat ? int64_t{0x7f7fffff} : int64_t{0x7fefffffffffffff}};
  const auto int_type = f.f32 ? at::kInt : at::kLong;
  const auto dev = v0.device();
  const auto i64 = v0.options().dtype(at::kLong);

  std::vector<at::Tensor> flat;
  int64_t n_r = 0;
  for (const auto& v : values) {
    if (v.numel()) {
      flat.push_back(v.reshape(-1));
      n_r += v.numel();
    }
  }
  std::vector<int64_t> head(kSliceHeadSize, 0);
  if (n_r == 0) {
    head[8] = f.top + 1;  // a rank without values: a = m = 0 over [0, top + 1)
    return {at::tensor(head, i64.device(at::kCPU)).to(dev), at::zeros({0}, i64),
        at::empty({0}, v0.options().dtype(int_type)), at::empty({0}, v0.options())};
  }
  // the bracket from the sample (all of this rank's values where its share
  // exceeds them, or is out of range: the collective reports it)
  const double inf = std::numeric_limits<double>::infinity();
  std::pair<double, double> br{0.0, inf};
  if (share >= 1 && share <= n_r) {
    at::Tensor smp;
    if (dev.is_cpu()) {
      AT_DISPATCH_FLOATING_TYPES(v0.scalar_type(), "topk_slice", [&] { smp = sample_of<scalar_t>(flat, n_r); });
    } else {
      smp = sample_on_device(flat, n_r);
    }
    br = bracket_of_sample(smp, share, n_r, cap / 2);
  }
  const int64_t first = value_bits(br.first, f);
  const int64_t end = std::min(br.second == inf ? f.top + 1 : value_bits(br.second, f), f.top) + 1;
  Grid g = make_grid(first, end, buckets);
  const int64_t scan_start = g.start;
  const int64_t scan_stop = static_cast<int64_t>(std::min<uint64_t>(g.stop, static_cast<uint64_t>(f.top + 1)));
  int64_t above = 0;
  bool bad = false;
  at::Tensor inside = at::empty({0}, v0.options());
  try {
    auto got = bracket_pass(flat, bits_value(g.start, f), bits_value(scan_stop - 1, f));
    above = std::get<0>(got).item<int64_t>();
    inside = std::get<1>(got);
  } catch (const c10::ValueError&) {  // topk_bracket's only ValueError here: a non-finite value
    bad = true;
  }
  const at::Tensor bits_dev = inside.view(int_type);
  const at::Tensor bits = bits_dev.device().is_cpu() ? bits_dev : bits_dev.cpu();
  const int64_t nc = bits.numel();
  const int32_t* k32 = f.f32 && nc ? bits.data_ptr<int32_t>() : nullptr;
  const int64_t* k64 = !f.f32 && nc ? bits.data_ptr<int64_t>() : nullptr;
  auto key = [&](int64_t i) -> int64_t { return k32 ? static_cast<int64_t>(k32[i]) : k64[i]; };
  if (br.second == inf && nc && !bad) {
    // a bracket open above: the grid ends at the largest candidate
    int64_t mx = 0;
    for (int64_t i = 0; i < nc; ++i) {
      mx = std::max(mx, key(i));
    }
    g = make_grid(g.start, mx + 1, buckets);
  }
  const int64_t nb = static_cast<int64_t>((g.stop - static_cast<uint64_t>(g.start)) >> g.j);
  at::Tensor hist = at::zeros({nb}, i64.device(at::kCPU));
  int64_t* h = hist.data_ptr<int64_t>();
  for (int64_t i = 0; i < nc; ++i) {
    ++h[(key(i) - g.start) >> g.j];
  }
  head[0] = n_r;
  head[1] = above;
  head[2] = g.start;
  head[3] = g.j;
  head[4] = nb;
  head[5] = bad ? 1 : 0;
  head[10] = scan_start;
  head[11] = scan_stop;
  // the window: whole grid buckets around the share's, at most cap candidates
  head[9] = -1;
  at::Tensor window = at::empty({0}, bits.options());
  if (cap > 0 && !bad) {
    std::vector<int64_t> ge(nb + 1, above);  // ge[i]: values >= start + i 2^j
    for (int64_t i = nb - 1; i >= 0; --i) {
      ge[i] = ge[i + 1] + h[i];
    }
    int64_t count = 0;
    for (int64_t i = 0; i < nb; ++i) {
      count += ge[i] >= share ? 1 : 0;
    }
    const int64_t centre = std::max<int64_t>(count - 1, 0);
    auto span_a = [&](int64_t r) { return std::max<int64_t>(centre - r, 0); };
    auto span_b = [&](int64_t r) { return std::min<int64_t>(centre + 1 + r, nb); };
    // (a window's end may pass the largest finite only where the grid does: capped at top + 1)
    auto end_of = [&](int64_t b) {
      return static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(g.start) + (static_cast<uint64_t>(b) << g.j),
          static_cast<uint64_t>(f.top + 1)));
    };
    auto fits = [&](int64_t r) { return ge[span_a(r)] - ge[span_b(r)] <= cap; };
    if (fits(0)) {
      int64_t lo_r = 0, hi_r = nb;
      while (lo_r < hi_r) {
        const int64_t mid = (lo_r + hi_r + 1) / 2;
        if (fits(mid)) {
          lo_r = mid;
        } else {
          hi_r = mid - 1;
        }
      }
      const int64_t w_lo = g.start + (span_a(lo_r) << g.j);
      const int64_t w_end = end_of(span_b(lo_r));
      // one branch-free pass (the candidates fall in and out of the window at
      // random: branches would mispredict): the count at or above the end, and
      // the window's bit patterns compacted in index order
      const uint64_t width = static_cast<uint64_t>(w_end - w_lo);
      at::Tensor buf = at::empty({nc + 1}, bits.options());
      int64_t w_above = above, m = 0;
      if (k32) {
        int32_t* w = buf.data_ptr<int32_t>();
        for (int64_t i = 0; i < nc; ++i) {
          const int64_t b = k32[i];
          w[m] = static_cast<int32_t>(b);
          m += static_cast<uint64_t>(b - w_lo) < width ? 1 : 0;
          w_above += b >= w_end ? 1 : 0;
        }
      } else {
        int64_t* w = buf.data_ptr<int64_t>();
        for (int64_t i = 0; i < nc; ++i) {
          const int64_t b = k64[i];
          w[m] = b;
          m += static_cast<uint64_t>(b - w_lo) < width ? 1 : 0;
          w_above += b >= w_end ? 1 : 0;
        }
      }
      window = buf.narrow(0, 0, m).clone();
      head[6] = w_above;
      head[7] = w_above + m < n_r ? w_lo : 0;
      head[8] = w_above ? w_end : f.top + 1;
      head[9] = m;
    }
  }
  return {at::tensor(head, i64.device(at::kCPU)).to(dev), hist.to(dev), window.to(dev), inside};
}

}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("topk_slice", &prunopt::topk_slice);
}
