// The kernel templates of the filter-basis convolution's sparse path
// (fb_conv2d_kernels.h), included only by the per-ISA kernel objects
// csrc/cpu/fb_conv2d_kernels_*.cpp. Everything here is internal to the object
// that includes it: each instantiates it for its own instruction set.
#pragma once

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "prunopt/fb_conv2d_kernels.h"

namespace prunopt {
namespace cpu {
namespace fbconv {
namespace {

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

// A tile of W outputs is summed in GCC vector registers (kMaxBytes = 32: one
// AVX register or two SSE registers, 16 bytes for 4 floats; 64 in the AVX-512
// clone), so the partial sums stay in registers whatever the compiler's loop
// transformations. Each output is summed in the same order whatever the
// vector width (U is that of 32-byte vectors), so the clones agree bit for bit. Rows are
// read W wide: the buffers they come from are padded by kTile elements, and
// only the valid outputs are stored. The kernels exist for float and double
// (float16 and bfloat16 inputs are computed in float32 by fb_conv2d.cpp).
template <typename scalar_t>
constexpr bool kKernelType = std::is_same<scalar_t, float>::value || std::is_same<scalar_t, double>::value;

// out[0:W] = b0 + sum_{e < count} w(e) * row(e)[0:W]: the inner product of eq. 8
// (and of the K^2 x N transform) for one tile. Always inlined, so it is
// compiled for the ISA of its caller (AVX-512 or AVX2+FMA clone, or baseline).
template <typename scalar_t, int W, int kMaxBytes = 32, typename WFn, typename RowFn>
__attribute__((always_inline)) inline void tile_sum(int64_t count, scalar_t b0, WFn w, RowFn row, scalar_t* out) {
  static_assert(kKernelType<scalar_t>, "float or double");
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
// ... for the widths of the mix, tile_width(P, kMixTile) <= 32 (no kTile case:
// it was never reached)
#define PRUNOPT_DISPATCH_MIX_WIDTH(w, ...)          \
  switch (w) {                                        \
    case 4: { constexpr int W = 4; __VA_ARGS__; break; }   \
    case 8: { constexpr int W = 8; __VA_ARGS__; break; }   \
    case 16: { constexpr int W = 16; __VA_ARGS__; break; } \
    default: { constexpr int W = kMixTile; __VA_ARGS__; break; } \
  }
static_assert(kMixTile == 32, "PRUNOPT_DISPATCH_MIX_WIDTH covers the widths 4 .. 32");

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
      if (identity) {  // the standard basis: Z[c, n] is tap n itself
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

// The flat layout for stride 1 and a "same" width narrower than 16 outputs
// (its row chunks would leave most of a vector's lanes idle; on wider rows the
// masks cost more than they save: 32x32, p = 0.99, 203 -> 228 us).
// Stride-1 maps as shifted rows (N <= 256: the used-map list of a channel).
// Their chunks are at most kDirectMaxWidth outputs wide (maps_width), so the
// direct maps are compiled for W <= kDirectMaxWidth only.
constexpr int kDirectMaxWidth = 16;
inline bool use_direct_maps(const Geometry& G) {
  return G.sh == 1 && G.sw == 1 && G.n <= 256;
}
template <typename scalar_t>
bool use_flat_layout(const Geometry& G) {
  return use_direct_maps(G) && G.kh * G.kw <= 256 && G.wo == G.w && G.wo < 16;
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
// The flat layout (kFlat, a.masks set) and the row chunks are separate
// functions: in one, GCC's RTL passes (PRE, load CSE after reload) took twice
// their time on the two (the baseline clone: 94 s of compile against 43 + 21 s).
template <typename scalar_t, int W, int kMaxBytes, bool kFlat>
__attribute__((always_inline)) inline void maps_direct_any(const DirectChannel<scalar_t>& a) {
  if constexpr (kFlat) {
    maps_flat_channel<scalar_t, W, kMaxBytes>(a.xp, a.off, a.K, a.gs, a.identity, a.un, a.nu, *a.G, a.masks, a.Wz,
        a.lwz, a.zc);
  } else {
    maps_direct_channel<scalar_t, W, kMaxBytes>(a.xp, a.off, a.K, a.gs, a.identity, a.un, a.nu, *a.G, a.Wp, a.Wz,
        a.lwz, a.zc);
  }
}
template <typename scalar_t, int W, bool kFlat>
__attribute__((noinline)) void maps_direct_base(const DirectChannel<scalar_t>& a) {
  maps_direct_any<scalar_t, W, 32, kFlat>(a);
}
#ifdef PRUNOPT_X86_DISPATCH
template <typename scalar_t, int W, bool kFlat>
__attribute__((noinline, target("avx2,fma"), optimize("fp-contract=fast"))) void maps_direct_avx2(
    const DirectChannel<scalar_t>& a) {
  maps_direct_any<scalar_t, W, 32, kFlat>(a);
}
template <typename scalar_t, int W, bool kFlat>
__attribute__((noinline, target("avx512f,avx2,fma"), optimize("fp-contract=fast"))) void maps_direct_avx512(
    const DirectChannel<scalar_t>& a) {
  maps_direct_any<scalar_t, W, 64, kFlat>(a);
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
  if constexpr (kIsa == 2 && std::is_same<scalar_t, float>::value) {  // (g4 is empty in the other clones)
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
      // (direct: W <= kDirectMaxWidth by maps_width; the wider W never get here)
      if constexpr (W <= kDirectMaxWidth) {
#ifdef PRUNOPT_X86_DISPATCH
        if constexpr (kIsa == 2) {
          flat ? maps_direct_avx512<scalar_t, W, true>(dc) : maps_direct_avx512<scalar_t, W, false>(dc);
        } else if constexpr (kIsa == 1) {
          flat ? maps_direct_avx2<scalar_t, W, true>(dc) : maps_direct_avx2<scalar_t, W, false>(dc);
        } else {
          flat ? maps_direct_base<scalar_t, W, true>(dc) : maps_direct_base<scalar_t, W, false>(dc);
        }
#else
        flat ? maps_direct_base<scalar_t, W, true>(dc) : maps_direct_base<scalar_t, W, false>(dc);
#endif
      }
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
  return flat ? tile_width(G.p(), kDirectMaxWidth) : direct ? tile_width(G.wo, kDirectMaxWidth) : tile_width(G.p());
}

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

}  // namespace
}  // namespace fbconv
}  // namespace cpu
}  // namespace prunopt
