// The sparse path of the filter-basis convolution on the CPU (interspace
// pruning, Wimmer et al.; csrc/cpu/fb_conv2d.cpp): the arguments and entry
// points of its two kernels, basis maps and CSR mix. Torch-free, so that the
// kernel objects compile without the ATen headers.
//
// Each kernel is compiled once per instruction set, in an object of its own
// (so the three compile in parallel): csrc/cpu/fb_conv2d_kernels_base.cpp
// (the build's baseline ISA), _avx2.cpp (AVX2 + FMA) and _avx512.cpp
// (AVX-512F), all from the templates of fb_conv2d_impl.h; fb_conv2d.cpp picks
// one at run time.
#pragma once

#include <cstdint>
#include <vector>

#include "prunopt/fb_conv.h"

// The x86-64 clones exist where GCC's target attributes do.
#if defined(__GNUC__) && defined(__x86_64__)
#define PRUNOPT_X86_DISPATCH 1
#endif

namespace prunopt {
namespace cpu {
namespace fbconv {

using fb::Geometry;

// Where kernel tap k = (ky, kx) reads: outputs [ylo, yhi) x [xlo, xhi) read the
// input at (oy*sh + offy, ox*sw + offx); the others read zero padding.
struct TapGeometry {
  int64_t ylo, yhi, xlo, xhi, offy, offx;
};

inline std::vector<TapGeometry> tap_geometry(const Geometry& G) {
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

constexpr int64_t kTile = 64;  // outputs per register tile
// outputs per tile of the mix: the Z slice of a tile (C_in N kMixTile values) is
// re-read by every output channel and must stay in L2
constexpr int64_t kMixTile = 32;

// Tile width for P outputs per channel: kTile, or the power of two >= P.
inline int tile_width(int64_t P, int64_t max_width = kTile) {
  int w = 4;
  while (w < max_width && w < P) w *= 2;
  return w;
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

// The kernels over tasks [t0, t1) of their at::parallel_for: maps over (batch,
// input channel), mix over (batch, tile, output channel) (see fb_conv2d.cpp).
// Instantiated for float and double (fb_conv2d.cpp computes float16 and
// bfloat16 in float32).
template <typename scalar_t>
void maps_default(const MapsArgs<scalar_t>& a, int64_t t0, int64_t t1);
template <typename scalar_t>
void mix_default(const MixArgs<scalar_t>& a, int64_t t0, int64_t t1);
#ifdef PRUNOPT_X86_DISPATCH
// (fp-contract=fast: the clones' FMAs; the attributes match the definitions)
template <typename scalar_t>
__attribute__((target("avx2,fma"), optimize("fp-contract=fast"))) void maps_avx2(const MapsArgs<scalar_t>& a,
    int64_t t0, int64_t t1);
template <typename scalar_t>
__attribute__((target("avx2,fma"), optimize("fp-contract=fast"))) void mix_avx2(const MixArgs<scalar_t>& a,
    int64_t t0, int64_t t1);
template <typename scalar_t>
__attribute__((target("avx512f,avx2,fma"), optimize("fp-contract=fast"))) void maps_avx512(
    const MapsArgs<scalar_t>& a, int64_t t0, int64_t t1);
template <typename scalar_t>
__attribute__((target("avx512f,avx2,fma"), optimize("fp-contract=fast"))) void mix_avx512(
    const MixArgs<scalar_t>& a, int64_t t0, int64_t t1);
#endif

}  // namespace fbconv
}  // namespace cpu
}  // namespace prunopt
