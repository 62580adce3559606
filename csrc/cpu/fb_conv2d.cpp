// Filter-basis 2D convolution on the CPU (Wimmer et al.; interspace
// pruning eq. 6, 8 and Alg. 1).
//
// Sparse path, for masked coefficients in CSR form (row o, column i*N + n):
//   1. basis maps  Z[b, c, n, p] = (g[n] * X[b, c])[p]  (Alg. 1 l. 7-8): for
//      stride 1 a K-term sum of shifted rows of a zero-padded copy of X[b, c],
//      otherwise im2col followed by the K^2 x N transform. Only the maps (c, n)
//      that some non-zero coefficient uses are computed (when the scan for them
//      is cheaper than computing all). Z is stored tile-major,
//      [b][tile of the mix][c][n][tile width], so the slice one output tile
//      reads is contiguous (no 4 KiB-strided rows aliasing in L1/L2).
//   2. mix  Y[b, o, p] = bias[o] + sum_{e in row o} val[e] * Z[b, g(o), col[e], p]
//      (eq. 8, Alg. 1 l. 9-10): a CSR x dense product. Tasks are (batch, tile of
//      P, output channel) with the channel innermost, so one tile of Z stays in
//      cache while every output channel reads it.
// Both steps run under at::parallel_for and accumulate in the input dtype, as
// conv2d does (each output is a sum of ||row o||_0 products).
//
// fb_conv2d counts the non-zeros of lam * mu (one parallel pass); if the density
// exceeds max_density it reconstructs the filters and calls conv2d (the dense
// path), else it builds the CSR in a second pass and runs the sparse path.
// fb_conv2d_csr runs the sparse path on a CSR built once (FBConv2d caches it).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "prunopt/fb_checks.h"
#include "prunopt/fb_conv.h"

namespace prunopt {
namespace cpu {
namespace {

using fb::Geometry;

// dst[0:n] = src[0:n] for the short rows of small images: a library memmove
// call per row of 2 or 4 values cost more than the maps themselves (about half
// of a 512-channel 2x2 layer's time); fixed-size copies compile to moves.
template <typename T>
__attribute__((always_inline)) inline void copy_row(const T* src, int64_t n, T* dst) {
  switch (n) {
    case 1: std::memcpy(dst, src, 1 * sizeof(T)); return;
    case 2: std::memcpy(dst, src, 2 * sizeof(T)); return;
    case 3: std::memcpy(dst, src, 3 * sizeof(T)); return;
    case 4: std::memcpy(dst, src, 4 * sizeof(T)); return;
    case 5: std::memcpy(dst, src, 5 * sizeof(T)); return;
    case 6: std::memcpy(dst, src, 6 * sizeof(T)); return;
    case 7: std::memcpy(dst, src, 7 * sizeof(T)); return;
    case 8: std::memcpy(dst, src, 8 * sizeof(T)); return;
    default: if (n > 0) std::memmove(dst, src, n * sizeof(T));
  }
}

// Where kernel tap k = (ky, kx) reads: outputs [ylo, yhi) x [xlo, xhi) read the
// input at (oy*sh + offy, ox*sw + offx); the others read zero padding.
struct TapGeometry {
  int64_t ylo, yhi, xlo, xhi, offy, offx;
};

std::vector<TapGeometry> tap_geometry(const Geometry& G) {
  std::vector<TapGeometry> taps;
  for (int64_t ky = 0; ky < G.kh; ++ky) {
    for (int64_t kx = 0; kx < G.kw; ++kx) {
      TapGeometry t;
      t.offy = ky * G.dh - G.ph;
      t.offx = kx * G.dw - G.pw;
      fb::valid_range(G.h, G.ho, G.sh, t.offy, &t.ylo, &t.yhi);
      fb::valid_range(G.w, G.wo, G.sw, t.offx, &t.xlo, &t.xhi);
      taps.push_back(t);
    }
  }
  return taps;
}

// im2col of one input channel: col[k, p] = X[c] at tap k for output p (0 in the padding).
template <typename scalar_t>
void im2col_channel(const scalar_t* xc, const Geometry& G, const std::vector<TapGeometry>& taps, scalar_t* col) {
  const int64_t P = G.p();
  for (size_t k = 0; k < taps.size(); ++k) {
    const TapGeometry& t = taps[k];
    scalar_t* ck = col + k * P;
    const bool full = t.ylo == 0 && t.yhi == G.ho && t.xlo == 0 && t.xhi == G.wo;
    if (!full) std::fill(ck, ck + P, scalar_t(0));
    for (int64_t oy = t.ylo; oy < t.yhi; ++oy) {
      const scalar_t* xr = xc + (oy * G.sh + t.offy) * G.w + t.offx;
      scalar_t* cr = ck + oy * G.wo;
      if (G.sw == 1) {
        copy_row(xr + t.xlo, t.xhi - t.xlo, cr + t.xlo);
      } else {
        for (int64_t ox = t.xlo; ox < t.xhi; ++ox) cr[ox] = xr[ox * G.sw];
      }
    }
  }
}

constexpr int64_t kTile = 64;  // outputs per register tile
// outputs per tile of the mix: the Z slice of a tile (C_in N kMixTile values) is
// re-read by every output channel and must stay in L2
constexpr int64_t kMixTile = 32;

// The hot loops are compiled twice, for the baseline ISA of the build and for
// AVX2+FMA, and picked at run time (the extension is built for generic x86-64).
#if defined(__GNUC__) && defined(__x86_64__)
#define PRUNOPT_X86_DISPATCH 1
inline bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
// and a third time for AVX-512 (64-byte vectors: half the loads and FMAs per
// row of the mix), unless PRUNOPT_NO_AVX512 is set (tests compare the two)
inline bool use_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && use_avx2();
  return ok && std::getenv("PRUNOPT_NO_AVX512") == nullptr;
}
#endif

// A tile of W outputs is summed in GCC vector registers (kMaxBytes = 32: one
// AVX register or two SSE registers, 16 bytes for 4 floats; 64 in the AVX-512
// clone), so the partial sums stay in registers whatever the compiler's loop
// transformations. Each output is summed in the same order whatever the
// vector width (U is that of 32-byte vectors), so the clones agree bit for bit. Rows are
// read W wide: the buffers they come from are padded by kTile elements, and
// only the valid outputs are stored. Half and BFloat16 take a scalar loop.
template <typename scalar_t>
constexpr bool kVectorised = std::is_same<scalar_t, float>::value || std::is_same<scalar_t, double>::value;

// out[0:W] = b0 + sum_{e < count} w(e) * row(e)[0:W]: the inner product of eq. 8
// (and of the K^2 x N transform) for one tile. Always inlined, so it is
// compiled for the ISA of its caller (AVX-512 or AVX2+FMA clone, or baseline).
template <typename scalar_t, int W, int kMaxBytes = 32, typename WFn, typename RowFn>
__attribute__((always_inline)) inline void tile_sum(int64_t count, scalar_t b0, WFn w, RowFn row, scalar_t* out) {
  if constexpr (kVectorised<scalar_t>) {
    constexpr int kBytes = W * sizeof(scalar_t) < kMaxBytes ? W * sizeof(scalar_t) : kMaxBytes;
    typedef scalar_t V __attribute__((vector_size(kBytes), aligned(sizeof(scalar_t)), __may_alias__));
    constexpr int kVecs = W * sizeof(scalar_t) / kBytes;
    // narrow tiles (few vectors) keep U independent sums so that the FMA
    // latency, not the throughput, is not what bounds a long row (counted in
    // 32-byte vectors for every clone: the same order of sums)
    constexpr int kVecs32 = W * sizeof(scalar_t) < 32 ? 1 : W * sizeof(scalar_t) / 32;
    constexpr int U = kVecs32 >= 8 ? 1 : (8 / kVecs32 < 4 ? 8 / kVecs32 : 4);
    V acc[U][kVecs];
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < kVecs; ++i) acc[u][i] = V{};
    int64_t e = 0;
    for (; e + U <= count; e += U) {
      for (int u = 0; u < U; ++u) {
        const scalar_t vw = w(e + u);
        const V* r = reinterpret_cast<const V*>(row(e + u));
        for (int i = 0; i < kVecs; ++i) acc[u][i] += r[i] * vw;
      }
    }
    for (; e < count; ++e) {
      const scalar_t vw = w(e);
      const V* r = reinterpret_cast<const V*>(row(e));
      for (int i = 0; i < kVecs; ++i) acc[0][i] += r[i] * vw;
    }
    V* o = reinterpret_cast<V*>(out);
    for (int i = 0; i < kVecs; ++i) {
      V sum = V{} + b0;
      for (int u = 0; u < U; ++u) sum += acc[u][i];
      o[i] = sum;
    }
  } else {
    float acc[W];
    for (int p = 0; p < W; ++p) acc[p] = static_cast<float>(b0);
    for (int64_t e = 0; e < count; ++e) {
      const float vw = static_cast<float>(w(e));
      const scalar_t* r = row(e);
      for (int p = 0; p < W; ++p) acc[p] += vw * static_cast<float>(r[p]);
    }
    for (int p = 0; p < W; ++p) out[p] = static_cast<scalar_t>(acc[p]);
  }
}

// Tile width for P outputs per channel: kTile, or the power of two >= P.
inline int tile_width(int64_t P, int64_t max_width = kTile) {
  int w = 4;
  while (w < max_width && w < P) w *= 2;
  return w;
}

// Calls F<W>() for the runtime width w.
#define PRUNOPT_DISPATCH_WIDTH(w, ...)            \
  switch (w) {                                      \
    case 4: { constexpr int W = 4; __VA_ARGS__; break; }   \
    case 8: { constexpr int W = 8; __VA_ARGS__; break; }   \
    case 16: { constexpr int W = 16; __VA_ARGS__; break; } \
    case 32: { constexpr int W = 32; __VA_ARGS__; break; } \
    default: { constexpr int W = kTile; __VA_ARGS__; break; } \
  }

template <typename scalar_t>
struct MapsArgs {
  const scalar_t* x;
  const Geometry* G;
  const scalar_t* gs;
  bool identity;
  const uint8_t* used;
  const std::vector<TapGeometry>* taps;
  scalar_t* z;
};

// Stride 1 (any dilation, any basis): the taps of a zero-padded copy xp of
// the channel are shifts of one flat array (offsets off[k]), so Z[c, n] at the
// outputs (oy, ox .. ox + len) is a K-term sum of shifted rows of xp. A chunk
// of up to W outputs of one output row, inside one tile of Z, is computed in
// registers and stored straight into its tile slot (the earlier version
// summed over the padded rows and copied twice, into a row and then into the
// tiles: those copies were 3/4 of the maps' time at 32x32). The used maps of
// the channel go in groups of up to kMaxGroup, one sum each (kG independent
// FMA chains that share each tap's load; one chain alone waited on its
// latency).
constexpr int kMaxGroup = 5;

// Lane masks of the flat layout (below): all bits set where a tap reads the
// image, 0 where it reads across a row's edge.
template <typename scalar_t>
using MaskInt = typename std::conditional<sizeof(scalar_t) == 8, int64_t, int32_t>::type;

template <typename scalar_t, int W, int kMaxBytes, int kG, typename KT>
__attribute__((always_inline)) inline void maps_direct_group(const scalar_t* src, const int64_t* off, KT K,
    const scalar_t* gs, const int32_t* un, int64_t len, scalar_t* dst, int64_t Wz,
    const MaskInt<scalar_t>* const* mk = nullptr) {
  constexpr int kBytes = W * sizeof(scalar_t) < kMaxBytes ? W * sizeof(scalar_t) : kMaxBytes;
  typedef scalar_t V __attribute__((vector_size(kBytes), aligned(sizeof(scalar_t)), __may_alias__));
  typedef MaskInt<scalar_t> VI __attribute__((vector_size(kBytes), aligned(sizeof(scalar_t)), __may_alias__));
  constexpr int kL = kBytes / sizeof(scalar_t), kVecs = W / kL;
  // from zero, so that every add has one product (with contraction each is
  // then one FMA, alike in every clone: s0 g0 + s1 g1 could fuse either product)
  V acc[kG][kVecs];
  for (int q = 0; q < kG; ++q)
    for (int i = 0; i < kVecs; ++i) acc[q][i] = V{};
  auto tap = [&](int64_t k) __attribute__((always_inline)) {
    for (int i = 0; i < kVecs; ++i) {
      V s = *reinterpret_cast<const V*>(src + off[k] + i * kL);
      if (mk && mk[k]) s = (V)((VI)s & *reinterpret_cast<const VI*>(mk[k] + i * kL));
      for (int q = 0; q < kG; ++q) acc[q][i] += s * gs[un[q] * K + k];
    }
  };
  if constexpr (std::is_integral<KT>::value) {
    for (int64_t k = 0; k < K; ++k) tap(k);
  } else {  // a constant K: unrolled by the fold (GCC kept a 9-trip loop, and the sums on the stack)
    // (always_inline: a lambda does not inherit its function's target
    // attribute, so one left out of line is compiled without FMA or AVX)
    [&]<int64_t... ks>(std::integer_sequence<int64_t, ks...>) __attribute__((always_inline)) { (tap(ks), ...); }(
        std::make_integer_sequence<int64_t, KT::value>{});
  }
  for (int q = 0; q < kG; ++q) {
    scalar_t* d = dst + un[q] * Wz;
    if (len == W) {
      for (int i = 0; i < kVecs; ++i) *reinterpret_cast<V*>(d + i * kL) = acc[q][i];
    } else {
      scalar_t tmp[W];
      for (int i = 0; i < kVecs; ++i) *reinterpret_cast<V*>(tmp + i * kL) = acc[q][i];
      copy_row(tmp, len, d);
    }
  }
}

// One group of kG maps; 3x3 kernels with the tap count a constant (fully
// unrolled: a run-time trip count left accumulators on the stack).
template <typename scalar_t, int W, int kMaxBytes, int kG>
__attribute__((always_inline)) inline void maps_direct_group_k(const scalar_t* src, const int64_t* off, int64_t K,
    const scalar_t* gs, const int32_t* un, int64_t len, scalar_t* dst, int64_t Wz,
    const MaskInt<scalar_t>* const* mk = nullptr) {
  if (K == 9) {
    maps_direct_group<scalar_t, W, kMaxBytes, kG>(src, off, std::integral_constant<int64_t, 9>{}, gs, un, len, dst, Wz,
        mk);
  } else {
    maps_direct_group<scalar_t, W, kMaxBytes, kG>(src, off, K, gs, un, len, dst, Wz, mk);
  }
}

// The groups of the used maps un[0:nu] at one chunk (near-equal sizes: 9 maps
// are 5 + 4).
template <typename scalar_t, int W, int kMaxBytes>
__attribute__((always_inline)) inline void maps_direct_groups(const scalar_t* src, const int64_t* off, int64_t K,
    const scalar_t* gs, const int32_t* un, int64_t nu, int64_t len, scalar_t* dst, int64_t Wz,
    const MaskInt<scalar_t>* const* mk = nullptr) {
  const int64_t groups = (nu + kMaxGroup - 1) / kMaxGroup;
  for (int64_t gi = 0, u = 0; gi < groups; ++gi) {
    const int64_t size = (nu - u) / (groups - gi);
    switch (size) {
      case 1: maps_direct_group_k<scalar_t, W, kMaxBytes, 1>(src, off, K, gs, un + u, len, dst, Wz, mk); break;
      case 2: maps_direct_group_k<scalar_t, W, kMaxBytes, 2>(src, off, K, gs, un + u, len, dst, Wz, mk); break;
      case 3: maps_direct_group_k<scalar_t, W, kMaxBytes, 3>(src, off, K, gs, un + u, len, dst, Wz, mk); break;
      case 4: maps_direct_group_k<scalar_t, W, kMaxBytes, 4>(src, off, K, gs, un + u, len, dst, Wz, mk); break;
      default: maps_direct_group_k<scalar_t, W, kMaxBytes, kMaxGroup>(src, off, K, gs, un + u, len, dst, Wz, mk);
    }
    u += size;
  }
}

template <typename scalar_t, int W, int kMaxBytes>
__attribute__((always_inline)) inline void maps_direct_channel(const scalar_t* xp, const int64_t* off, int64_t K,
    const scalar_t* gs, bool identity, const int32_t* un, int64_t nu, const Geometry& G, int64_t Wp, int64_t Wz,
    int lwz, scalar_t* zc) {
  const int64_t wo = G.wo, stride_tile = G.c_in * G.n * Wz;
  for (int64_t oy = 0; oy < G.ho; ++oy) {
    for (int64_t ox = 0, len = 0; ox < wo; ox += len) {
      const int64_t p = oy * wo + ox, tl = p >> lwz, j = p - (tl << lwz);
      len = std::min<int64_t>({W, wo - ox, Wz - j});
      const scalar_t* src = xp + oy * Wp + ox;
      scalar_t* dst = zc + tl * stride_tile + j;
      if constexpr (!kVectorised<scalar_t>) {  // Half, BFloat16: float sums, as tile_sum
        for (int64_t u = 0; u < nu; ++u) {
          const int64_t n = un[u];
          for (int64_t q = 0; q < len; ++q) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; ++k) {
              const float v = static_cast<float>(src[off[k] + q]);
              acc += identity ? (k == n ? v : 0.f) : static_cast<float>(gs[n * K + k]) * v;
            }
            dst[n * Wz + q] = static_cast<scalar_t>(acc);
          }
        }
      } else if (identity) {  // the standard basis: Z[c, n] is tap n itself
        for (int64_t u = 0; u < nu; ++u) copy_row(src + off[un[u]], len, dst + un[u] * Wz);
      } else {
        maps_direct_groups<scalar_t, W, kMaxBytes>(src, off, K, gs, un, nu, len, dst, Wz);
      }
    }
  }
}

// Stride 1 with as many output columns as input columns (a "same" width, e.g.
// 3x3 with padding 1): tap k at output p = oy * W + ox reads the flat image at
// p + shift[k] (a zero margin above and below, set once), except where the
// column ox + kx dw - pw leaves the row: those lanes are cleared by the tap's
// mask mk[k] (null where none does). Chunks then run over p across rows, so a
// small image fills whole vectors (4x4: one 16-lane chunk where the row chunks
// above were four of 4 lanes). The sums are those of the row chunks, bit for
// bit (a cleared lane is the same +0 the padded copy holds).
template <typename scalar_t, int W, int kMaxBytes>
__attribute__((always_inline)) inline void maps_flat_channel(const scalar_t* xf, const int64_t* shift, int64_t K,
    const scalar_t* gs, bool identity, const int32_t* un, int64_t nu, const Geometry& G,
    const MaskInt<scalar_t>* const* masks, int64_t Wz, int lwz, scalar_t* zc) {
  if constexpr (kVectorised<scalar_t>) {
    constexpr int kBytes = W * sizeof(scalar_t) < kMaxBytes ? W * sizeof(scalar_t) : kMaxBytes;
    typedef scalar_t V __attribute__((vector_size(kBytes), aligned(sizeof(scalar_t)), __may_alias__));
    typedef MaskInt<scalar_t> VI __attribute__((vector_size(kBytes), aligned(sizeof(scalar_t)), __may_alias__));
    constexpr int kL = kBytes / sizeof(scalar_t), kVecs = W / kL;
    const int64_t P = G.p(), stride_tile = G.c_in * G.n * Wz;
    const MaskInt<scalar_t>* mk[256];
    for (int64_t p0 = 0; p0 < P; p0 += W) {
      const int64_t len = std::min<int64_t>(W, P - p0), tl = p0 >> lwz, j = p0 - (tl << lwz);
      scalar_t* dst = zc + tl * stride_tile + j;
      for (int64_t k = 0; k < K; ++k) mk[k] = masks[k] ? masks[k] + p0 : nullptr;
      if (identity) {  // the standard basis: Z[c, n] is tap n itself
        for (int64_t u = 0; u < nu; ++u) {
          const int64_t n = un[u];
          scalar_t tmp[W];
          scalar_t* d = len == W ? dst + n * Wz : tmp;
          for (int i = 0; i < kVecs; ++i) {
            V v = *reinterpret_cast<const V*>(xf + p0 + shift[n] + i * kL);
            if (mk[n]) v = (V)((VI)v & *reinterpret_cast<const VI*>(mk[n] + i * kL));
            *reinterpret_cast<V*>(d + i * kL) = v;
          }
          if (len != W) copy_row(tmp, len, dst + n * Wz);
        }
      } else {
        maps_direct_groups<scalar_t, W, kMaxBytes>(xf + p0, shift, K, gs, un, nu, len, dst, Wz, mk);
      }
    }
  }
}

// The flat layout for stride 1 and a "same" width narrower than 16 outputs
// (its row chunks would leave most of a vector's lanes idle; on wider rows the
// masks cost more than they save: 32x32, p = 0.99, 203 -> 228 us).
// Stride-1 maps as shifted rows (N <= 256: the used-map list of a channel).
inline bool use_direct_maps(const Geometry& G) {
  return G.sh == 1 && G.sw == 1 && G.n <= 256;
}
template <typename scalar_t>
bool use_flat_layout(const Geometry& G) {
  return kVectorised<scalar_t> && use_direct_maps(G) && G.kh * G.kw <= 256 && G.wo == G.w && G.wo < 16;
}

// One channel's direct maps as its own function per clone: inlined into the
// large maps loop, GCC kept the group's accumulators on the stack (a store and
// a load per FMA).
template <typename scalar_t>
struct DirectChannel {
  const scalar_t* xp;
  const int64_t* off;
  int64_t K;
  const scalar_t* gs;
  bool identity;
  const int32_t* un;
  int64_t nu;
  const Geometry* G;
  int64_t Wp, Wz;
  int lwz;
  scalar_t* zc;
  const MaskInt<scalar_t>* const* masks;  // non-null: the flat layout (xp, off = the flat image, shifts)
};

// The flat layout with P = 4 outputs (a 2x2 image), float, 3x3 taps, N <= 16,
// AVX-512: a 4-lane chunk per map left 3/4 of each vector idle and cost a
// group dispatch per 4 outputs. Here one 16-lane vector holds 4 maps x 4
// outputs, which is exactly Z[c, 4q .. 4q + 3, 0 .. 3] (Wz = 4, one tile, so
// channel c's maps are at z + 4 N c): tap k of the channel, 4 values read
// from the input itself with a zeroing masked load (the lanes outside the
// image or across a row's edge are 0, as the padded copy holds; the copy is
// skipped: loads that straddle its fresh stores waited on store forwarding),
// is repeated 4 times and multiplied by g4[q, k] = (g[4q, k] x4,
// g[4q+1, k] x4, ...), summed from zero in tap order as in maps_direct_group,
// so with the same bits. Each sum is a chain of 9 dependent FMAs, so CH = 4
// channels go side by side (one channel per call waited on that latency:
// 512 channels, 1 thread, perf: 9.4 -> 5.1 us). Every map of every channel is
// written (Z has their room; the mix reads only the used ones).
constexpr int kP4MaxBlocks = 4;  // N <= 16
#ifdef PRUNOPT_X86_DISPATCH
template <int NB, int CH>
__attribute__((always_inline, target("avx512f,avx2,fma"))) inline void maps_p4_channels(
    const float* x, int64_t xs, float* z, int64_t N, const float* g4, const int64_t* off, const uint16_t* pm) {
  constexpr int64_t K = 9;
  __m512 acc[CH][NB];  // constant counts: the sums stay in registers
  for (int ch = 0; ch < CH; ++ch)
    for (int q = 0; q < NB; ++q) acc[ch][q] = _mm512_setzero_ps();
  // (no lambda here: a lambda does not inherit the target attribute)
#pragma GCC unroll 9
  for (int64_t k = 0; k < K; ++k) {
    const __mmask16 m = pm[k];
    __m512 sb[CH];
    for (int ch = 0; ch < CH; ++ch) {
      const __m512 v = _mm512_maskz_loadu_ps(m, x + xs * ch + off[k]);
      sb[ch] = _mm512_maskz_shuffle_f32x4(0xFFFF, v, v, 0);  // lanes 0-3 four times
    }
    for (int q = 0; q < NB; ++q) {
      const __m512 gv = _mm512_loadu_ps(g4 + (q * K + k) * 16);
      for (int ch = 0; ch < CH; ++ch) acc[ch][q] = _mm512_fmadd_ps(sb[ch], gv, acc[ch][q]);
    }
  }
  for (int ch = 0; ch < CH; ++ch)
    for (int q = 0; q < NB; ++q) {
      const int64_t m = std::min<int64_t>(4, N - 4 * q);  // maps in this block
      _mm512_mask_storeu_ps(z + 4 * N * ch + 16 * q, static_cast<__mmask16>((1u << (4 * m)) - 1), acc[ch][q]);
    }
}
template <int NB>
__attribute__((noinline, target("avx512f,avx2,fma"))) void maps_p4_range_nb(
    const float* x, int64_t xs, float* z, int64_t count, int64_t N, const float* g4, const int64_t* off, const uint16_t* pm) {
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) maps_p4_channels<NB, 4>(x + xs * i, xs, z + 4 * N * i, N, g4, off, pm);
  for (; i < count; ++i) maps_p4_channels<NB, 1>(x + xs * i, xs, z + 4 * N * i, N, g4, off, pm);
}
// channels [0, count) of x (xs = H W values each) into z (4 N values each)
inline void maps_p4_range(
    const float* x, int64_t xs, float* z, int64_t count, int64_t N, const float* g4, const int64_t* off, const uint16_t* pm) {
  switch ((N + 3) / 4) {
    case 1: maps_p4_range_nb<1>(x, xs, z, count, N, g4, off, pm); break;
    case 2: maps_p4_range_nb<2>(x, xs, z, count, N, g4, off, pm); break;
    case 3: maps_p4_range_nb<3>(x, xs, z, count, N, g4, off, pm); break;
    default: maps_p4_range_nb<kP4MaxBlocks>(x, xs, z, count, N, g4, off, pm); break;
  }
}
#endif
template <typename scalar_t>
bool use_maps_p4(const Geometry& G, bool identity) {
  return std::is_same<scalar_t, float>::value && use_flat_layout<scalar_t>(G) && G.p() == 4 && !identity &&
      G.kh * G.kw == 9 && G.n <= 4 * kP4MaxBlocks;
}
template <typename scalar_t, int W, int kMaxBytes>
__attribute__((always_inline)) inline void maps_direct_any(const DirectChannel<scalar_t>& a) {
  if (a.masks) {
    maps_flat_channel<scalar_t, W, kMaxBytes>(a.xp, a.off, a.K, a.gs, a.identity, a.un, a.nu, *a.G, a.masks, a.Wz,
        a.lwz, a.zc);
  } else {
    maps_direct_channel<scalar_t, W, kMaxBytes>(a.xp, a.off, a.K, a.gs, a.identity, a.un, a.nu, *a.G, a.Wp, a.Wz,
        a.lwz, a.zc);
  }
}
template <typename scalar_t, int W>
__attribute__((noinline)) void maps_direct_base(const DirectChannel<scalar_t>& a) {
  maps_direct_any<scalar_t, W, 32>(a);
}
#ifdef PRUNOPT_X86_DISPATCH
template <typename scalar_t, int W>
__attribute__((noinline, target("avx2,fma"), optimize("fp-contract=fast"))) void maps_direct_avx2(
    const DirectChannel<scalar_t>& a) {
  maps_direct_any<scalar_t, W, 32>(a);
}
template <typename scalar_t, int W>
__attribute__((noinline, target("avx512f,avx2,fma"), optimize("fp-contract=fast"))) void maps_direct_avx512(
    const DirectChannel<scalar_t>& a) {
  maps_direct_any<scalar_t, W, 64>(a);
}
#endif

template <typename scalar_t, int W, int kMaxBytes = 32, int kIsa = 0>
__attribute__((always_inline)) inline void maps_body(const MapsArgs<scalar_t>& A, int64_t t0, int64_t t1) {
  const Geometry& G = *A.G;
  const int64_t P = G.p(), K = G.kh * G.kw, N = G.n;
  const bool identity = A.identity;
  const auto& taps = *A.taps;
  const scalar_t* x = A.x;
  scalar_t* z = A.z;
  const scalar_t* gs = A.gs;
  const uint8_t* used = A.used;
  const bool direct = use_direct_maps(G);
  const bool flat = use_flat_layout<scalar_t>(G);
  const int64_t Hp = G.h + 2 * G.ph, Wp = G.w + 2 * G.pw;
  std::vector<int64_t> offs(K);
  // flat: the image at xf = colbuf + front, zero margins; tap k at p reads xf[p + offs[k]]
  int64_t front = 0, flat_size = 0;
  std::vector<MaskInt<scalar_t>> mask_store;
  std::vector<const MaskInt<scalar_t>*> masks;
  if (flat) {
    int64_t smin = 0, smax = 0;
    for (int64_t ky = 0; ky < G.kh; ++ky) {
      for (int64_t kx = 0; kx < G.kw; ++kx) {
        const int64_t sh = (ky * G.dh - G.ph) * G.w + (kx * G.dw - G.pw);
        offs[ky * G.kw + kx] = sh;
        smin = std::min(smin, sh);
        smax = std::max(smax, sh);
      }
    }
    front = -smin;
    flat_size = front + std::max(G.h * G.w, P + kTile + smax) + kTile;
    // per kernel column, the lanes p in [0, P + kTile) whose column stays in the row
    mask_store.assign(G.kw * (P + kTile), 0);
    masks.assign(K, nullptr);
    for (int64_t kx = 0; kx < G.kw; ++kx) {
      const int64_t dx = kx * G.dw - G.pw;
      const bool needed = dx < 0 || G.wo - 1 + dx >= G.w;
      MaskInt<scalar_t>* m = mask_store.data() + kx * (P + kTile);
      for (int64_t p = 0; p < P; ++p) {
        const int64_t cx = p % G.wo + dx;
        m[p] = cx >= 0 && cx < G.w ? MaskInt<scalar_t>(-1) : MaskInt<scalar_t>(0);
      }
      for (int64_t ky = 0; ky < G.kh; ++ky) masks[ky * G.kw + kx] = needed ? m : nullptr;
    }
  } else {
    for (int64_t ky = 0; ky < G.kh; ++ky)
      for (int64_t kx = 0; kx < G.kw; ++kx) offs[ky * G.kw + kx] = ky * G.dh * Wp + kx * G.dw;
  }
  // direct: xp (Hp x Wp, zero border set once) and W values of slack for the
  // full-width loads of a row's last chunk (their extra lanes are not stored)
  std::vector<scalar_t> colbuf(flat ? flat_size : direct ? Hp * Wp + 2 * kTile : K * P + kTile);
  if (direct) std::fill(colbuf.begin(), colbuf.end(), scalar_t(0));
  // Z is tile-major: [b][tile of Wz outputs][c][n][Wz], so the slice of Z that
  // one output tile of the mix reads is contiguous (C_in N Wz values)
  const int64_t Wz = tile_width(P, kMixTile), T = (P + Wz - 1) / Wz;
  int lwz = 0;
  while ((int64_t(1) << lwz) < Wz) ++lwz;
  std::vector<scalar_t> rowbuf(P + kTile);
  std::vector<scalar_t> g4;  // maps_p4's coefficient vectors and tap lanes (AVX-512 clone only)
  std::vector<uint16_t> p4mask;
  if (kIsa == 2 && direct && use_maps_p4<scalar_t>(G, identity) && Wz == 4 && T == 1) {
    const int64_t nb = (N + 3) / 4;
    g4.assign(nb * K * 16, scalar_t(0));
    for (int64_t q = 0; q < nb; ++q)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t m = 0; m < 4 && 4 * q + m < N; ++m)
          for (int64_t j = 0; j < 4; ++j) g4[(q * K + k) * 16 + m * 4 + j] = gs[(4 * q + m) * K + k];
    p4mask.assign(K, 0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t q = 0; q < 4; ++q) {
        const int64_t src = q + offs[k];
        if (src >= 0 && src < G.h * G.w && (masks[k] == nullptr || masks[k][q] != 0))
          p4mask[k] |= static_cast<uint16_t>(1u << q);
      }
  }
#ifdef PRUNOPT_X86_DISPATCH
  if constexpr (std::is_same<scalar_t, float>::value) {
    if (!g4.empty()) {  // Z[bc] = z + 4 N bc: the range is one run of channels
      maps_p4_range(x + t0 * G.h * G.w, G.h * G.w, z + t0 * N * 4, t1 - t0, N, g4.data(), offs.data(), p4mask.data());
      return;
    }
  }
#endif
  auto store = [&](int64_t b, int64_t c, int64_t n, const scalar_t* row) __attribute__((always_inline)) {
    for (int64_t tl = 0; tl < T; ++tl) {
      const int64_t p0 = tl * Wz, len = std::min<int64_t>(Wz, P - p0);
      copy_row(row + p0, len, z + (((b * T + tl) * G.c_in + c) * N + n) * Wz);
    }
  };
  for (int64_t bc = t0, c = t0 % G.c_in, b = t0 / G.c_in; bc < t1; ++bc, c = c + 1 == G.c_in ? (++b, 0) : c + 1) {
    const uint8_t* uc = used + c * N;
    bool any = false;
    for (int64_t n = 0; n < N; ++n) any |= uc[n] != 0;
    const scalar_t* xc = x + bc * G.h * G.w;
    // unused maps are never read: the mix reads only stored columns, within their tile slot
    if (!any) continue;
    if (direct) {
      scalar_t* xp = colbuf.data();
      if (flat) {
        xp += front;
        std::memcpy(xp, xc, G.h * G.w * sizeof(scalar_t));
      } else {
        for (int64_t y = 0; y < G.h; ++y) copy_row(xc + y * G.w, G.w, xp + (y + G.ph) * Wp + G.pw);
      }
      int32_t un[256];  // the used maps (N <= 256 when direct)
      int64_t nu = 0;
      for (int64_t n = 0; n < N; ++n)
        if (uc[n]) un[nu++] = static_cast<int32_t>(n);
      const DirectChannel<scalar_t> dc{xp, offs.data(), K, gs, identity, un, nu, &G, Wp, Wz, lwz,
          z + ((b * T * G.c_in + c) * N) * Wz, flat ? masks.data() : nullptr};
#ifdef PRUNOPT_X86_DISPATCH
      if constexpr (kIsa == 2) {
        maps_direct_avx512<scalar_t, W>(dc);
      } else if constexpr (kIsa == 1) {
        maps_direct_avx2<scalar_t, W>(dc);
      } else {
        maps_direct_base<scalar_t, W>(dc);
      }
#else
      maps_direct_base<scalar_t, W>(dc);
#endif
      continue;
    }
    if (identity) {  // Z[c] is the im2col of X[c]
      scalar_t* col = colbuf.data();
      im2col_channel(xc, G, taps, col);
      for (int64_t n = 0; n < N; ++n)
        if (uc[n]) store(b, c, n, col + n * P);
      continue;
    }
    scalar_t* row = rowbuf.data();
    scalar_t* col = colbuf.data();
    im2col_channel(xc, G, taps, col);
    for (int64_t n = 0; n < N; ++n) {
      if (!uc[n]) continue;
      const scalar_t* gn = gs + n * K;
      for (int64_t p0 = 0; p0 < P; p0 += W) {
        const int64_t len = std::min<int64_t>(W, P - p0);
        scalar_t out[W];
        tile_sum<scalar_t, W, kMaxBytes>(K, scalar_t(0), [&](int64_t k) { return gn[k]; },
            [&](int64_t k) -> const scalar_t* { return col + k * P + p0; }, out);
        copy_row(out, len, row + p0);
      }
      store(b, c, n, row);
    }
  }
}

// Tile width of the maps: a chunk of one output row (stride 1), or over P outputs.
template <typename scalar_t>
int maps_width(const MapsArgs<scalar_t>& a) {
  const Geometry& G = *a.G;
  const bool direct = use_direct_maps(G);
  const bool flat = use_flat_layout<scalar_t>(G);
  return flat ? tile_width(G.p(), 16) : direct ? tile_width(G.wo, 16) : tile_width(G.p());
}
template <typename scalar_t>
void maps_default(const MapsArgs<scalar_t>& a, int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_WIDTH(maps_width(a), maps_body<scalar_t, W>(a, t0, t1))
}
#ifdef PRUNOPT_X86_DISPATCH
template <typename scalar_t>
__attribute__((target("avx2,fma"), optimize("fp-contract=fast"))) void maps_avx2(const MapsArgs<scalar_t>& a, int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_WIDTH(maps_width(a), (maps_body<scalar_t, W, 32, 1>(a, t0, t1)))
}
template <typename scalar_t>
__attribute__((target("avx512f,avx2,fma"), optimize("fp-contract=fast"))) void maps_avx512(const MapsArgs<scalar_t>& a, int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_WIDTH(maps_width(a), (maps_body<scalar_t, W, 64, 2>(a, t0, t1)))
}
#endif

// Step 1: Z[b, c, n, :] = sum_k g[n, k] col_c[k, :] for every used (c, n): a
// K^2 x N transform of the channel's im2col (the im2col itself for the
// standard basis).
template <typename scalar_t>
void basis_maps(const scalar_t* x, const Geometry& G, const double* g, bool identity,
                const std::vector<uint8_t>& used, scalar_t* z) {
  const int64_t P = G.p(), K = G.kh * G.kw, N = G.n;
  const auto taps = tap_geometry(G);
  std::vector<scalar_t> gs(N * K);
  for (int64_t i = 0; i < N * K; ++i) gs[i] = static_cast<scalar_t>(g[i]);
  at::parallel_for(0, G.batch * G.c_in, std::max<int64_t>(1, 4096 / (N * P + 1)), [&](int64_t t0, int64_t t1) {
    MapsArgs<scalar_t> a{x, &G, gs.data(), identity, used.data(), &taps, z};
#ifdef PRUNOPT_X86_DISPATCH
    if (use_avx512()) return maps_avx512<scalar_t>(a, t0, t1);
    if (use_avx2()) return maps_avx2<scalar_t>(a, t0, t1);
#endif
    maps_default<scalar_t>(a, t0, t1);
  });
}

template <typename scalar_t>
struct MixArgs {
  const scalar_t* z;
  const Geometry* G;
  const int32_t* crow;
  const int32_t* col;
  const scalar_t* val;
  const scalar_t* bias;
  scalar_t* y;
  bool o_outer;  // tasks (b, o, tile): the tiles of one output channel in a row
};

template <typename scalar_t, int W, int kMaxBytes = 32>
__attribute__((always_inline)) inline void mix_body(const MixArgs<scalar_t>& A, int64_t t0, int64_t t1) {
  const Geometry& G = *A.G;
  const int64_t P = G.p();
  const int64_t tiles = (P + W - 1) / W;
  const int64_t c_out_g = G.c_out / G.groups;
  const scalar_t* z = A.z;
  const int32_t* crow = A.crow;
  const int32_t* col = A.col;
  const scalar_t* val = A.val;
  const scalar_t* bias = A.bias;
  scalar_t* y = A.y;
  // task t = (b * tiles + tl) * C_out + o (or, o_outer, (b * C_out + o) *
  // tiles + tl), the indices stepped rather than divided out per task (64-bit
  // divisions were most of a sparse layer's time)
  const bool o_outer = A.o_outer;
  int64_t o, tl, b;
  if (o_outer) {
    tl = t0 % tiles, o = (t0 / tiles) % G.c_out, b = t0 / tiles / G.c_out;
  } else {
    o = t0 % G.c_out, tl = (t0 / G.c_out) % tiles, b = t0 / G.c_out / tiles;
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t p0 = tl * W, len = std::min<int64_t>(W, P - p0);
    const scalar_t b0 = bias ? bias[o] : scalar_t(0);
    const int64_t grp = G.groups == 1 ? 0 : o / c_out_g;
    const scalar_t* zg = z + ((b * tiles + tl) * G.c_in + grp * G.c_in_g()) * G.n * W;
    const int32_t e0 = crow[o];
    scalar_t* yo = y + (b * G.c_out + o) * P + p0;
    scalar_t out[W];
    tile_sum<scalar_t, W, kMaxBytes>(crow[o + 1] - e0, b0, [&](int64_t e) { return val[e0 + e]; },
        [&](int64_t e) -> const scalar_t* { return zg + static_cast<int64_t>(col[e0 + e]) * W; },
        len == W ? yo : out);  // a whole tile straight into y
    if (len != W) copy_row(out, len, yo);
    if (o_outer) {
      if (++tl == tiles) {
        tl = 0;
        if (++o == G.c_out) {
          o = 0;
          ++b;
        }
      }
    } else if (++o == G.c_out) {
      o = 0;
      if (++tl == tiles) {
        tl = 0;
        ++b;
      }
    }
  }
}

template <typename scalar_t>
void mix_default(const MixArgs<scalar_t>& a, int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_WIDTH(tile_width(a.G->p(), kMixTile), mix_body<scalar_t, W>(a, t0, t1))
}
#ifdef PRUNOPT_X86_DISPATCH
template <typename scalar_t>
__attribute__((target("avx2,fma"), optimize("fp-contract=fast"))) void mix_avx2(const MixArgs<scalar_t>& a, int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_WIDTH(tile_width(a.G->p(), kMixTile), mix_body<scalar_t, W>(a, t0, t1))
}
template <typename scalar_t>
__attribute__((target("avx512f,avx2,fma"), optimize("fp-contract=fast"))) void mix_avx512(const MixArgs<scalar_t>& a, int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_WIDTH(tile_width(a.G->p(), kMixTile), (mix_body<scalar_t, W, 64>(a, t0, t1)))
}
#endif

// Step 2: the CSR x dense mix of eq. 8. A task is (batch, tile of kTile
// outputs, output channel); channels are innermost so the Z tile stays in cache.
template <typename scalar_t>
void csr_mix(const scalar_t* z, const Geometry& G, const int32_t* crow, const int32_t* col, const scalar_t* val,
             const scalar_t* bias, scalar_t* y) {
  const int64_t P = G.p();
  const int64_t tiles = (P + tile_width(P, kMixTile) - 1) / tile_width(P, kMixTile);
  const int64_t tasks = G.batch * tiles * G.c_out;
  const int64_t nnz = crow[G.c_out];
  const int64_t work_per_task = std::max<int64_t>(1, (nnz / std::max<int64_t>(1, G.c_out) + 1) * std::min(P, kTile));
  const int64_t grain = std::max<int64_t>(1, 16384 / work_per_task);
  // Channels innermost keep one tile's slice of Z in cache while every output
  // channel reads it, but write each channel's rows P apart (4 KiB at 32x32:
  // the same L1 set for every channel). When one image's Z fits in L2 anyway,
  // the tiles go innermost and y is written in order (3->64 @32x32, density
  // 0.1, one thread: 78 -> 45 us).
  const int64_t z_bytes = tiles * tile_width(P, kMixTile) * G.c_in * G.n * static_cast<int64_t>(sizeof(scalar_t));
  const bool o_outer = z_bytes <= (int64_t(256) << 10);
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    MixArgs<scalar_t> a{z, &G, crow, col, val, bias, y, o_outer};
#ifdef PRUNOPT_X86_DISPATCH
    if (use_avx512()) return mix_avx512<scalar_t>(a, t0, t1);
    if (use_avx2()) return mix_avx2<scalar_t>(a, t0, t1);
#endif
    mix_default<scalar_t>(a, t0, t1);
  });
}

// The sparse path on a validated CSR (int32 crow/col, contiguous values).
at::Tensor sparse_forward(const at::Tensor& input, const at::Tensor& crow, const at::Tensor& col,
    const at::Tensor& values, const at::Tensor& basis, const c10::optional<at::Tensor>& bias, const Geometry& G) {
  auto y = at::empty({G.batch, G.c_out, G.ho, G.wo}, input.options());
  auto x = input.contiguous();
  // the basis in double: a few hundred values, converted here rather than by
  // basis.to(kDouble) (an allocation and a dispatched copy: ~2 us of a small
  // layer's ~40 us)
  std::vector<double> gd(static_cast<size_t>(basis.numel()));
  {
    const auto bc = basis.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bc.scalar_type(), "fb_conv2d_basis", [&] {
      const scalar_t* s = bc.data_ptr<scalar_t>();
      for (size_t i = 0; i < gd.size(); ++i) gd[i] = static_cast<double>(s[i]);
    });
  }
  const double* gp = gd.data();
  // the standard basis (Alg. A1) in its natural order: Z is the im2col itself
  bool identity = G.n == G.kh * G.kw;
  for (int64_t n = 0; identity && n < G.n; ++n)
    for (int64_t k = 0; k < G.n; ++k) identity = identity && gp[n * G.n + k] == (n == k ? 1.0 : 0.0);
  // the column indices are checked first (a malformed CSR is an error, never
  // an out-of-bounds access): a max over them, which vectorises
  const int32_t* cp = col.data_ptr<int32_t>();
  const int32_t* rp = crow.data_ptr<int32_t>();
  const int64_t nnz = col.numel();
  const int64_t c_out_g = G.c_out / G.groups, c_in_g = G.c_in_g();
  const int64_t row_len = c_in_g * G.n;
  // (an or of signed compares: it vectorises with the baseline SSE2, where an
  // unsigned max does not; at 236K non-zeros the scalar max was 18% of a
  // 512-channel 2x2 layer's time)
  const int32_t rl = static_cast<int32_t>(std::min<int64_t>(row_len, std::numeric_limits<int32_t>::max()));
  std::atomic<bool> bad_col{false};
  at::parallel_for(0, nnz, 1 << 16, [&](int64_t e0, int64_t e1) {
    int32_t bad = 0;
    for (int64_t e = e0; e < e1; ++e) bad |= static_cast<int32_t>(cp[e] < 0) | static_cast<int32_t>(cp[e] >= rl);
    if (bad) bad_col = true;
  });
  TORCH_CHECK_VALUE(!bad_col.load(),
      "fb_conv2d_csr: col_indices must lie in [0, C_in/groups * N) = [0, ", row_len, ")");
  // maps (c, n) used by some non-zero coefficient. The scan costs about as
  // much per non-zero as a small image's mix, so when computing every map is
  // cheaper than scanning (small images, many non-zeros) all are marked used;
  // so they are when, at this density d, a map is unused with probability
  // (1 - d)^(C_out/groups) < 5% (512 output channels at d = 0.01: 0.6%).
  const double density = static_cast<double>(nnz) / static_cast<double>(std::max<int64_t>(1, G.c_out * row_len));
  const bool scan = G.c_in * G.n * G.kh * G.kw * G.p() * G.batch > 4 * nnz &&
                    std::pow(1.0 - density, static_cast<double>(c_out_g)) >= 0.05;
  std::vector<uint8_t> used(G.c_in * G.n, scan ? 0 : 1);
  if (scan) {
    uint8_t* __restrict u = used.data();
    for (int64_t o = 0; o < G.c_out; ++o) {
      uint8_t* __restrict ug = u + (o / c_out_g) * c_in_g * G.n;
      const int32_t e0 = rp[o], e1 = rp[o + 1];
      for (int32_t e = e0; e < e1; ++e) ug[cp[e]] = 1;
    }
  }
  if (y.numel() == 0) return y;
  // tile-major (see maps_body): whole tiles of the mix width
  const int64_t wz = tile_width(G.p(), kMixTile);
  auto z = at::empty({G.batch * ((G.p() + wz - 1) / wz) * wz * G.c_in * G.n}, input.options());
  auto b = bias.has_value() ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "fb_conv2d", [&] {
    basis_maps<scalar_t>(x.data_ptr<scalar_t>(), G, gp, identity, used, z.data_ptr<scalar_t>());
    csr_mix<scalar_t>(z.data_ptr<scalar_t>(), G, rp, cp, values.data_ptr<scalar_t>(),
        b.defined() ? b.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>());
  });
  return y;
}

at::Tensor fb_conv2d_cpu(const at::Tensor& input, const at::Tensor& coefficients, const at::Tensor& basis,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, double max_density) {
  const char* op = "fb_conv2d";
  check_fb_reconstruct_args(coefficients, basis, mask, op);
  TORCH_CHECK_VALUE(!std::isnan(max_density), op, ": max_density must be a number, got nan");
  const int64_t c_out = coefficients.size(0), c_in_g = coefficients.size(1), n = coefficients.size(2);
  const auto out = check_fb_conv_args(input, c_out, c_in_g, basis, bias, stride, padding, dilation, groups, op);
  const int64_t row_len = c_in_g * n;
  TORCH_CHECK_VALUE(row_len < (int64_t(1) << 31) && coefficients.numel() < (int64_t(1) << 31), op,
      ": coefficients too large for int32 CSR indices");
  auto lam = coefficients.contiguous();
  auto mu = mask.has_value() ? mask->contiguous() : at::Tensor();
  // pass 1: non-zeros of lam * mu per row
  std::vector<int32_t> crow(c_out + 1, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lam.scalar_type(), "fb_conv2d_count", [&] {
    const scalar_t* lp = lam.data_ptr<scalar_t>();
    const scalar_t* mp = mu.defined() ? mu.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, c_out, std::max<int64_t>(1, 4096 / (row_len + 1)), [&](int64_t o0, int64_t o1) {
      for (int64_t o = o0; o < o1; ++o) {
        int32_t cnt = 0;
        for (int64_t j = o * row_len; j < (o + 1) * row_len; ++j) {
          const scalar_t v = mp ? lp[j] * mp[j] : lp[j];
          cnt += static_cast<int32_t>(v != scalar_t(0));
        }
        crow[o + 1] = cnt;
      }
    });
  });
  for (int64_t o = 0; o < c_out; ++o) crow[o + 1] += crow[o];
  const int64_t nnz = crow[c_out];
  const double density = coefficients.numel() ? static_cast<double>(nnz) / coefficients.numel() : 0.0;
  if (density > max_density) {  // dense path: reconstruct (eq. 4) + conv2d (eq. 6)
    return at::conv2d(input, reconstruct(coefficients, basis, mask), bias, stride, padding, dilation, groups)
        .contiguous();
  }
  // pass 2: the CSR of lam * mu
  auto crow_t = at::from_blob(crow.data(), {c_out + 1}, at::kInt).clone();
  auto col_t = at::empty({nnz}, at::kInt);
  auto val_t = at::empty({nnz}, lam.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lam.scalar_type(), "fb_conv2d_csr_build", [&] {
    const scalar_t* lp = lam.data_ptr<scalar_t>();
    const scalar_t* mp = mu.defined() ? mu.data_ptr<scalar_t>() : nullptr;
    int32_t* cp = col_t.data_ptr<int32_t>();
    scalar_t* vp = val_t.data_ptr<scalar_t>();
    at::parallel_for(0, c_out, std::max<int64_t>(1, 4096 / (row_len + 1)), [&](int64_t o0, int64_t o1) {
      for (int64_t o = o0; o < o1; ++o) {
        int64_t e = crow[o];
        for (int64_t j = 0; j < row_len; ++j) {
          const scalar_t v = mp ? lp[o * row_len + j] * mp[o * row_len + j] : lp[o * row_len + j];
          if (v != scalar_t(0)) {
            cp[e] = static_cast<int32_t>(j);
            vp[e] = v;
            ++e;
          }
        }
      }
    });
  });
  const Geometry G = fb_geometry(input, basis, c_out, stride, padding, dilation, groups, out);
  return sparse_forward(input, crow_t, col_t, val_t, basis, bias, G);
}

at::Tensor fb_conv2d_csr_cpu(const at::Tensor& input, const at::Tensor& crow_indices, const at::Tensor& col_indices,
    const at::Tensor& values, const at::Tensor& basis, const c10::optional<at::Tensor>& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  const char* op = "fb_conv2d_csr";
  check_defined(basis, "basis", op);
  check_defined(input, "input", op);
  TORCH_CHECK_VALUE(basis.dim() == 3, op, ": basis must have shape (N, kh, kw), got ", basis.sizes());
  check_fb_csr_args(crow_indices, col_indices, values, basis, op);
  const int64_t c_out = crow_indices.numel() - 1;
  TORCH_CHECK_VALUE(input.dim() == 4, op, ": input must have shape (B, C_in, H, W), got ", input.sizes());
  TORCH_CHECK_VALUE(groups >= 1 && input.size(1) % groups == 0, op, ": groups must divide C_in = ", input.size(1));
  const int64_t c_in_g = input.size(1) / groups;
  const auto out = check_fb_conv_args(input, c_out, c_in_g, basis, bias, stride, padding, dilation, groups, op);
  auto crow = crow_indices.contiguous();
  auto col = col_indices.contiguous();
  // a malformed CSR must be an error, never an out-of-bounds read
  const int32_t* rp = crow.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(rp[0] == 0 && rp[c_out] == col.numel(), op,
      ": crow_indices must start at 0 and end at nnz = ", col.numel());
  for (int64_t o = 0; o < c_out; ++o) {
    TORCH_CHECK_VALUE(rp[o] <= rp[o + 1], op, ": crow_indices must be non-decreasing");
  }
  const Geometry G = fb_geometry(input, basis, c_out, stride, padding, dilation, groups, out);
  return sparse_forward(input, crow, col, values.contiguous(), basis, bias, G);
}

}  // namespace
}  // namespace cpu
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CPU, m) {
  m.impl("fb_conv2d", &prunopt::cpu::fb_conv2d_cpu);
  m.impl("fb_conv2d_csr", &prunopt::cpu::fb_conv2d_csr_cpu);
}
