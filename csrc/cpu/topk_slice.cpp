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
#include <optional>
#include <utility>
#include <vector>

namespace prunopt {
namespace {

// The sample: about (6 n_r)^(2/3) values within [min, max], in blocks of
// `block` contiguous values at a fixed stride; the bracket spans the sample's
// order statistics 5 standard deviations of a binomial count (plus 8 ranks)
// either side of the share (and at least cap / 2 values of the rank).
// (the sizes come with each call, `sample` = [min, max, block]; the
// sharded selects pass 2^15, 2^20, 128)
struct SampleShape {
  int64_t min, max, block;
};

SampleShape sample_shape(at::IntArrayRef sample, const char* op) {
  TORCH_CHECK_VALUE(sample.size() == 3 && sample[0] >= 1 && sample[1] >= sample[0] && sample[2] >= 1 &&
      sample[2] <= 4096, op, ": sample must be [min, max, block] with 1 <= min <= max and 1 <= block <= 4096, got ",
      sample);
  return {sample[0], sample[1], sample[2]};
}
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

// v where keep, else +0.0, without a branch (the candidates fall on either
// side of a window at random: a branch would mispredict on about every other
// one; a product by 0 would turn an overflowed inf square into NaN)
inline double kept(bool keep, double v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  u &= -static_cast<uint64_t>(keep);
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

// The checks of a list against its first tensor (the messages of
// topk_bracket's and prunadag_bracket's checks).
void check_like(at::TensorList ts, const at::Tensor& ref, const char* op, const char* name) {
  for (size_t i = 0; i < ts.size(); ++i) {
    TORCH_CHECK_VALUE(ts[i].scalar_type() == ref.scalar_type(), op, ": ", name, "[", i, "] must have dtype ",
        ref.scalar_type(), ", got ", ts[i].scalar_type());
    TORCH_CHECK_VALUE(ts[i].device() == ref.device(), op, ": ", name, "[", i, "] must be on ", ref.device());
    TORCH_CHECK_VALUE(ts[i].layout() == at::kStrided, op, ": ", name, "[", i, "] must be a dense (strided) tensor");
  }
}

// The slice ops' common arguments, checked; the format of a float32 or
// float64 dtype.
SampleShape slice_args(int64_t buckets, int64_t cap, at::IntArrayRef sample, const char* op) {
  TORCH_CHECK_VALUE(buckets >= 1, op, ": buckets must be >= 1, got ", buckets);
  TORCH_CHECK_VALUE(cap >= 0, op, ": cap must be >= 0, got ", cap);
  return sample_shape(sample, op);
}

Fmt fmt_of(at::ScalarType t) {
  return t == at::kFloat ? Fmt{true, int64_t{0x7f7fffff}} : Fmt{false, int64_t{0x7fefffffffffffff}};
}

// The grid of a bracket (lo, hi) of values (hi may be inf: up to the largest
// finite), and the end (exclusive) of the bit patterns a pass over it reads.
Grid grid_of_bracket(const std::pair<double, double>& br, int64_t buckets, const Fmt& f) {
  const int64_t first = value_bits(br.first, f);
  const int64_t end = std::min(std::isinf(br.second) ? f.top + 1 : value_bits(br.second, f), f.top) + 1;
  return make_grid(first, end, buckets);
}

int64_t scan_end(const Grid& g, const Fmt& f) {
  return static_cast<int64_t>(std::min<uint64_t>(g.stop, static_cast<uint64_t>(f.top + 1)));
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

// The sample's size for n_r values: about (6 n_r)^(2/3) within [min, max].
int64_t sample_size(int64_t n_r, const SampleShape& sh) {
  return std::min(
      std::max(static_cast<int64_t>(std::pow(kSampleScale * static_cast<double>(n_r), 2.0 / 3.0)), sh.min), sh.max);
}

// The fixed sample of n_r values in tensors of `sizes` elements (all of them
// when they are few), written by fill(t, begin, count, out) (the magnitudes
// of `count` values of tensor t from `begin`) into a buffer of this thread
// that later calls reuse (a fresh allocation of the sample's size costs its
// page faults at every call; the tensor is valid until this thread's next
// call). ahead(t, begin) is told of the block a few strides ahead.
template <typename scalar_t, typename Fill, typename Ahead>
at::Tensor sample_with(const std::vector<int64_t>& sizes, int64_t n_r, const SampleShape& sh, Fill&& fill,
    Ahead&& ahead) {
  const int64_t size = sample_size(n_r, sh);
  const int64_t kSampleBlock = sh.block;
  const bool all = n_r <= size;
  const int64_t every = all ? 1 : n_r / size;
  int64_t count = 0;  // the sample's size
  for (const int64_t n : sizes) {
    const int64_t nb = n / kSampleBlock;
    count += all ? n : nb >= every ? (nb > every / 2 ? (nb - every / 2 + every - 1) / every * kSampleBlock : 0)
                                   : (n > every / 2 ? (n - every / 2 + every - 1) / every : 0);
  }
  thread_local std::vector<scalar_t> buf;
  if (static_cast<int64_t>(buf.size()) < count) {
    buf.resize(count);
  }
  scalar_t* out = buf.data();
  for (size_t t = 0; t < sizes.size(); ++t) {
    const int64_t n = sizes[t], nb = n / kSampleBlock;
    if (all) {
      fill(t, 0, n, out);
      out += n;
    } else if (nb >= every) {  // blocks every/2, every/2 + every, ... of kSampleBlock values
      // (blocks far apart: each is a few cache lines the hardware prefetcher
      // does not foresee, so the blocks a few strides ahead are requested now)
      constexpr int64_t kAhead = 4;
      for (int64_t b = every / 2; b < nb; b += every) {
        if (b + kAhead * every < nb) {
          ahead(t, (b + kAhead * every) * kSampleBlock);
        }
        fill(t, b * kSampleBlock, kSampleBlock, out);
        out += kSampleBlock;
      }
    } else {  // single values every/2, every/2 + every, ...
      for (int64_t i = every / 2; i < n; i += every) {
        fill(t, i, 1, out++);
      }
    }
  }
  TORCH_INTERNAL_ASSERT(out == buf.data() + count);
  return at::from_blob(buf.data(), {count},
      at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value));
}

// Requests the cache lines of one sample block.
template <typename scalar_t>
void prefetch_block(const scalar_t* p, int64_t block) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t line = 0; line < block * static_cast<int64_t>(sizeof(scalar_t)); line += 64) {
    __builtin_prefetch(c + line);
  }
}

// |v| of the fixed sample of the flat (contiguous) values.
template <typename scalar_t>
at::Tensor sample_of(const std::vector<at::Tensor>& flat, int64_t n_r, const SampleShape& sh) {
  std::vector<int64_t> sizes;
  std::vector<const scalar_t*> ptrs;
  for (const auto& v : flat) {
    sizes.push_back(v.numel());
    ptrs.push_back(v.data_ptr<scalar_t>());
  }
  return sample_with<scalar_t>(sizes, n_r, sh,
      [&](size_t t, int64_t begin, int64_t count, scalar_t* out) {
        const scalar_t* q = ptrs[t] + begin;
        for (int64_t i = 0; i < count; ++i) {
          out[i] = std::abs(q[i]);
        }
      },
      [&](size_t t, int64_t begin) { prefetch_block(ptrs[t] + begin, sh.block); });
}

// The same sample on another device (ATen ops on the values' device).
at::Tensor sample_on_device(const std::vector<at::Tensor>& flat, int64_t n_r, const SampleShape& sh) {
  const int64_t size = sample_size(n_r, sh);
  const int64_t kSampleBlock = sh.block;
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

// The window's bit patterns [w_lo, w_end): whole grid buckets around the
// bucket where the count of values >= its start first reaches `share`, as
// many either side as hold at most `cap` candidates in all; none when that
// bucket alone holds more. h: the candidates per bucket (nb of them), above:
// the count beyond the grid.
std::optional<std::pair<int64_t, int64_t>> window_range(const int64_t* h, int64_t nb, int64_t above, int64_t share,
    int64_t cap, const Grid& g, const Fmt& f) {
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
  auto fits = [&](int64_t r) { return ge[span_a(r)] - ge[span_b(r)] <= cap; };
  if (!fits(0)) {
    return std::nullopt;
  }
  int64_t lo_r = 0, hi_r = nb;  // the widest radius that fits
  while (lo_r < hi_r) {
    const int64_t mid = (lo_r + hi_r + 1) / 2;
    if (fits(mid)) {
      lo_r = mid;
    } else {
      hi_r = mid - 1;
    }
  }
  // (a window's end may pass the largest finite only where the grid does: capped at top + 1)
  const uint64_t end = static_cast<uint64_t>(g.start) + (static_cast<uint64_t>(span_b(lo_r)) << g.j);
  return std::make_pair(g.start + (span_a(lo_r) << g.j),
      static_cast<int64_t>(std::min<uint64_t>(end, static_cast<uint64_t>(f.top + 1))));
}

// The candidates' magnitude bit patterns (on the host), by index; masked to
// the magnitude: the passes write |v|, never -0.0, and a sign bit here would
// index out of the grid.
struct Keys {
  const int32_t* k32 = nullptr;
  const int64_t* k64 = nullptr;
  int64_t n = 0;

  Keys(const at::Tensor& bits, bool f32) : n(bits.numel()) {
    if (n) {
      if (f32) {
        k32 = bits.data_ptr<int32_t>();
      } else {
        k64 = bits.data_ptr<int64_t>();
      }
    }
  }

  int64_t operator()(int64_t i) const {
    return k32 ? static_cast<int64_t>(k32[i] & 0x7fffffff) : (k64[i] & int64_t{0x7fffffffffffffff});
  }
};

// After the pass (both slice ops): a bracket open above ends its grid at the
// largest candidate; the candidates' histogram on the grid; the slice's head
// fields (head[9] = -1 until a window is taken). Returns the histogram (on
// the host) and the window's range (none without a window).
std::pair<at::Tensor, std::optional<std::pair<int64_t, int64_t>>> finish_slice(const Keys& key, Grid& g,
    bool open_above, int64_t buckets, int64_t n_r, int64_t above, bool bad, int64_t scan_start, int64_t scan_stop,
    int64_t share, int64_t cap, const Fmt& f, std::vector<int64_t>& head) {
  if (open_above && key.n && !bad) {
    int64_t mx = 0;
    for (int64_t i = 0; i < key.n; ++i) {
      mx = std::max(mx, key(i));
    }
    g = make_grid(g.start, mx + 1, buckets);
  }
  const int64_t nb = static_cast<int64_t>((g.stop - static_cast<uint64_t>(g.start)) >> g.j);
  at::Tensor hist = at::zeros({nb}, at::TensorOptions().dtype(at::kLong));
  int64_t* h = hist.data_ptr<int64_t>();
  for (int64_t i = 0; i < key.n; ++i) {
    ++h[(key(i) - g.start) >> g.j];
  }
  head[0] = n_r;
  head[1] = above;
  head[2] = g.start;
  head[3] = g.j;
  head[4] = nb;
  head[5] = bad ? 1 : 0;
  head[9] = -1;
  head[10] = scan_start;
  head[11] = scan_stop;
  if (bad || cap == 0) {
    return {hist, std::nullopt};
  }
  return {hist, window_range(h, nb, above, share, cap, g, f)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_slice(at::TensorList values, int64_t share,
    int64_t buckets, int64_t cap, at::IntArrayRef sample) {
  const char* op = "topk_slice";
  TORCH_CHECK_VALUE(!values.empty(), op, ": values must not be empty");
  const auto& v0 = values[0];
  TORCH_CHECK_VALUE(v0.scalar_type() == at::kFloat || v0.scalar_type() == at::kDouble, op,
      ": values must be float32 or float64, got ", v0.scalar_type());
  check_like(values, v0, op, "values");
  const SampleShape sh = slice_args(buckets, cap, sample, op);
  const Fmt f = fmt_of(v0.scalar_type());
  const auto int_type = f.f32 ? at::kInt : at::kLong;
  const auto dev = v0.device();
  const auto i64 = v0.options().dtype(at::kLong);

  std::vector<at::Tensor> flat;
  int64_t n_r = 0;
  for (const auto& v : values) {
    if (v.numel()) {
      flat.push_back(v.reshape(-1).contiguous());
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
      AT_DISPATCH_FLOATING_TYPES(v0.scalar_type(), "topk_slice", [&] { smp = sample_of<scalar_t>(flat, n_r, sh); });
    } else {
      smp = sample_on_device(flat, n_r, sh);
    }
    br = bracket_of_sample(smp, share, n_r, cap / 2);
  }
  Grid g = grid_of_bracket(br, buckets, f);
  const int64_t scan_start = g.start, scan_stop = scan_end(g, f);
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
  const Keys key(bits, f.f32);
  const bool k32 = f.f32;
  const auto [hist, range] = finish_slice(key, g, br.second == inf, buckets, n_r, above, bad, scan_start, scan_stop,
      share, cap, f, head);
  // the window: whole grid buckets around the share's, at most cap candidates
  at::Tensor window = at::empty({0}, bits.options());
  if (range) {
    const auto [w_lo, w_end] = *range;
    // two branch-free passes (the candidates fall in and out of the window at
    // random: branches would mispredict): the window's count and the count
    // at or above its end, then the window's bit patterns in index order into
    // a tensor of the exact size (an over-sized one costs fresh pages)
    const uint64_t width = static_cast<uint64_t>(w_end - w_lo);
    int64_t w_above = above, m = 0;
    for (int64_t i = 0; i < nc; ++i) {
      const int64_t b = key(i);
      m += static_cast<uint64_t>(b - w_lo) < width ? 1 : 0;
      w_above += b >= w_end ? 1 : 0;
    }
    at::Tensor buf = at::empty({m + 1}, bits.options());
    int64_t at_ = 0;
    if (k32) {
      int32_t* w = buf.data_ptr<int32_t>();
      for (int64_t i = 0; i < nc; ++i) {
        const int64_t b = key(i);
        w[at_] = static_cast<int32_t>(b);
        at_ += static_cast<uint64_t>(b - w_lo) < width ? 1 : 0;
      }
    } else {
      int64_t* w = buf.data_ptr<int64_t>();
      for (int64_t i = 0; i < nc; ++i) {
        const int64_t b = key(i);
        w[at_] = b;
        at_ += static_cast<uint64_t>(b - w_lo) < width ? 1 : 0;
      }
    }
    window = buf.narrow(0, 0, m);
    head[6] = w_above;
    head[7] = w_above + m < n_r ? w_lo : 0;
    head[8] = w_above ? w_end : f.top + 1;
    head[9] = m;
  }
  return {at::tensor(head, i64.device(at::kCPU)).to(dev), hist.to(dev), window.to(dev), inside};
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> prunadag_bracket_pass(at::TensorList params, at::TensorList grads,
    const at::Tensor& hyper, double lo, double hi) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("prunopt::prunadag_bracket", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(at::TensorList, at::TensorList,
                           const at::Tensor&, double, double)>();
  return op.call(params, grads, hyper, lo, hi);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prunadag_slice(
    at::TensorList params, at::TensorList grads, const at::Tensor& hyper, int64_t share, int64_t buckets,
    int64_t cap, at::IntArrayRef sample) {
  const char* op = "prunadag_slice";
  // (the checks and messages of prunadag_bracket, in its order)
  const size_t nt = params.size();
  TORCH_CHECK_VALUE(grads.size() == nt, op, ": grads must have ", nt, " tensors, got ", grads.size());
  TORCH_CHECK_VALUE(hyper.scalar_type() == at::kDouble && hyper.dim() == 2 && hyper.size(0) == (int64_t)nt &&
      hyper.size(1) == 6, op, ": hyper must be a float64 tensor of shape (", nt, ", 6), got ", hyper.scalar_type(),
      " ", hyper.sizes());
  TORCH_CHECK_VALUE(nt > 0, op, ": params must not be empty");
  const auto& p0 = params[0];
  TORCH_CHECK_VALUE(p0.scalar_type() == at::kFloat || p0.scalar_type() == at::kDouble, op,
      ": params must be float32 or float64, got ", p0.scalar_type());
  check_like(params, p0, op, "params");
  check_like(grads, p0, op, "grads");
  for (size_t i = 0; i < nt; ++i) {
    TORCH_CHECK_VALUE(grads[i].sizes() == params[i].sizes(), op, ": grads[", i, "] must have the shape of params[",
        i, "] ", params[i].sizes());
  }
  TORCH_CHECK_VALUE(hyper.device() == p0.device(), op, ": hyper must be on ", p0.device(), ", got ", hyper.device());
  const SampleShape sh = slice_args(buckets, cap, sample, op);
  const Fmt f = fmt_of(p0.scalar_type());
  const auto int_type = f.f32 ? at::kInt : at::kLong;
  const auto dev = p0.device();
  const auto i64 = p0.options().dtype(at::kLong);
  const auto f64 = p0.options().dtype(at::kDouble);
  const at::Tensor rows_t = hyper.to(at::kCPU).contiguous();
  const double* rows = rows_t.data_ptr<double>();

  // the pruned tensors with elements (the values of the selection), flat
  std::vector<size_t> pruned;
  std::vector<at::Tensor> gs, xs;
  int64_t n_r = 0;
  bool any_wd = false;
  for (size_t i = 0; i < nt; ++i) {
    if (rows[i * 6 + 5] != 0.0 && params[i].numel()) {
      pruned.push_back(i);
      gs.push_back(grads[i].reshape(-1).contiguous());
      xs.push_back(params[i].detach().reshape(-1).contiguous());
      n_r += params[i].numel();
      any_wd = any_wd || rows[i * 6 + 2] != 0.0;
    }
  }
  std::vector<int64_t> head(kSliceHeadSize, 0);
  std::vector<double> sums(4, 0.0);
  auto empty_of = [&](at::ScalarType t) { return at::empty({0}, p0.options().dtype(t)); };
  if (n_r == 0) {
    // no values here, but the pass over [0, 0] still checks every tensor's finiteness
    const auto got = prunadag_bracket_pass(params, grads, hyper, 0.0, 0.0);
    head[5] = std::get<0>(got).to(at::kCPU)[3].item<double>() != 0.0 ? 1 : 0;
    head[8] = f.top + 1;  // an empty window over [0, top + 1)
    return {at::tensor(head, i64.device(at::kCPU)).to(dev), at::tensor(sums, f64.device(at::kCPU)).to(dev),
        at::zeros({0}, i64), empty_of(int_type), empty_of(at::kDouble), empty_of(p0.scalar_type()),
        empty_of(at::kDouble)};
  }
  // the bracket from a sample of the effective gradients ge = +-g + wd x (the
  // product rounded before the sum, as the kernels compute it), |g| where no
  // weight decay changes them
  const double inf = std::numeric_limits<double>::infinity();
  std::pair<double, double> br{0.0, inf};
  if (share >= 1 && share <= n_r) {
    at::Tensor smp;
    if (dev.is_cpu()) {
      AT_DISPATCH_FLOATING_TYPES(p0.scalar_type(), "prunadag_slice", [&] {
        std::vector<int64_t> sizes;
        std::vector<const scalar_t*> gp, xp;
        std::vector<scalar_t> wd;
        std::vector<bool> mx;
        for (size_t t = 0; t < pruned.size(); ++t) {
          const size_t i = pruned[t];
          sizes.push_back(gs[t].numel());
          gp.push_back(gs[t].data_ptr<scalar_t>());
          xp.push_back(xs[t].data_ptr<scalar_t>());
          wd.push_back(any_wd ? static_cast<scalar_t>(rows[i * 6 + 2]) : scalar_t(0));
          mx.push_back(rows[i * 6 + 4] != 0.0);
        }
        smp = sample_with<scalar_t>(sizes, n_r, sh,
            [&](size_t t, int64_t begin, int64_t count, scalar_t* out) {
              const scalar_t* g = gp[t] + begin;
              if (wd[t] == scalar_t(0)) {
                for (int64_t k = 0; k < count; ++k) {
                  out[k] = std::abs(g[k]);
                }
              } else {
                const scalar_t* x = xp[t] + begin;
                const scalar_t w = wd[t];
                const bool neg = mx[t];
                for (int64_t k = 0; k < count; ++k) {
                  const scalar_t d = x[k] * w;  // (rounded before the sum: -ffp-contract=off)
                  out[k] = std::abs((neg ? -g[k] : g[k]) + d);
                }
              }
            },
            [&](size_t t, int64_t begin) {
              prefetch_block(gp[t] + begin, sh.block);
              if (wd[t] != scalar_t(0)) {
                prefetch_block(xp[t] + begin, sh.block);
              }
            });
      });
    } else {
      std::vector<at::Tensor> parts;
      for (size_t t = 0; t < pruned.size(); ++t) {
        const size_t i = pruned[t];
        const double w = rows[i * 6 + 2];
        parts.push_back(w == 0.0 ? gs[t] : (rows[i * 6 + 4] != 0.0 ? -gs[t] : gs[t]) + xs[t] * w);
      }
      // (the same positions as the CPU sample: the views of sample_on_device over the effective gradients)
      smp = sample_on_device(parts, n_r, sh);
    }
    br = bracket_of_sample(smp, share, n_r, cap / 2);
  }
  Grid g = grid_of_bracket(br, buckets, f);
  const int64_t scan_start = g.start, scan_stop = scan_end(g, f);
  const auto got = prunadag_bracket_pass(params, grads, hyper, bits_value(g.start, f), bits_value(scan_stop - 1, f));
  const at::Tensor summary = std::get<0>(got).to(at::kCPU);
  const double* sm = summary.data_ptr<double>();
  const bool bad = sm[3] != 0.0;
  int64_t above = 0;
  at::Tensor inside = empty_of(p0.scalar_type()), inside_m = empty_of(at::kDouble);
  if (!bad) {
    above = static_cast<int64_t>(sm[0]);
    sums[0] = sm[1];
    sums[1] = sm[2];
    inside = std::get<1>(got);
    inside_m = std::get<2>(got);
  }
  const at::Tensor bits = inside.view(int_type).to(at::kCPU);
  const at::Tensor mh = inside_m.to(at::kCPU).contiguous();
  const int64_t nc = bits.numel();
  const double* mp = nc ? mh.data_ptr<double>() : nullptr;
  const Keys key(bits, f.f32);
  const bool k32 = f.f32;
  const auto [hist, range] = finish_slice(key, g, br.second == inf, buckets, n_r, above, bad, scan_start, scan_stop,
      share, cap, f, head);
  at::Tensor wbits = at::empty({0}, bits.options()), wm = at::empty({0}, mh.options());
  if (range) {
    const auto [w_lo, w_end] = *range;
    const uint64_t width = static_cast<uint64_t>(w_end - w_lo);
    const at::Tensor ch = inside.to(at::kCPU).contiguous();
    const float* c32 = f.f32 && nc ? ch.data_ptr<float>() : nullptr;
    const double* c64 = !f.f32 && nc ? ch.data_ptr<double>() : nullptr;
    // two branch-free passes: the window's count, the count and the squares
    // above it and the m below it; then the window in index order into
    // tensors of the exact size (over-sized ones cost fresh pages)
    int64_t w_above = above, m = 0;
    double g_up = 0.0, x_down = 0.0;
    for (int64_t i = 0; i < nc; ++i) {
      const int64_t b = key(i);
      const bool up = b >= w_end;
      m += static_cast<uint64_t>(b - w_lo) < width ? 1 : 0;
      w_above += up ? 1 : 0;
      const double c = c32 ? static_cast<double>(c32[i]) : c64[i];
      g_up += kept(up, c * c);
      x_down += kept(b < w_lo, mp[i]);
    }
    at::Tensor bbuf = at::empty({m + 1}, bits.options());
    at::Tensor mbuf = at::empty({m + 1}, mh.options());
    int32_t* w32 = k32 ? bbuf.data_ptr<int32_t>() : nullptr;
    int64_t* w64 = k32 ? nullptr : bbuf.data_ptr<int64_t>();
    double* wmp = mbuf.data_ptr<double>();
    int64_t at_ = 0;
    for (int64_t i = 0; i < nc; ++i) {
      const int64_t b = key(i);
      if (w32) {
        w32[at_] = static_cast<int32_t>(b);
      } else {
        w64[at_] = b;
      }
      wmp[at_] = mp[i];
      at_ += static_cast<uint64_t>(b - w_lo) < width ? 1 : 0;
    }
    wbits = bbuf.narrow(0, 0, m);
    wm = mbuf.narrow(0, 0, m);
    head[6] = w_above;
    head[7] = w_above + m < n_r ? w_lo : 0;
    head[8] = w_above ? w_end : f.top + 1;
    head[9] = m;
    sums[2] = sums[0] + g_up;
    sums[3] = sums[1] + x_down;
  }
  return {at::tensor(head, i64.device(at::kCPU)).to(dev), at::tensor(sums, f64.device(at::kCPU)).to(dev),
      hist.to(dev), wbits.to(dev), wm.to(dev), inside, inside_m};
}

}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("topk_slice", &prunopt::topk_slice);
  m.impl("prunadag_slice", &prunopt::prunadag_slice);
}
