// The sparse path's kernels of fb_conv2d (fb_conv2d_kernels.h) for the
// build's baseline instruction set (SSE2 on x86-64): the fallback of CPUs
// without AVX2 + FMA, and of other architectures.
#include "prunopt/fb_conv2d_impl.h"

namespace prunopt {
namespace cpu {
namespace fbconv {

template <typename scalar_t>
void maps_default(const MapsArgs<scalar_t>& a, int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_WIDTH(maps_width(a), maps_body<scalar_t, W>(a, t0, t1))
}
template <typename scalar_t>
void mix_default(const MixArgs<scalar_t>& a, int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_MIX_WIDTH(tile_width(a.G->p(), kMixTile), mix_body<scalar_t, W>(a, t0, t1))
}

#define PRUNOPT_INSTANTIATE(T)                                               \
  template void maps_default<T>(const MapsArgs<T>&, int64_t, int64_t); \
  template void mix_default<T>(const MixArgs<T>&, int64_t, int64_t);
PRUNOPT_INSTANTIATE(float)
PRUNOPT_INSTANTIATE(double)

}  // namespace fbconv
}  // namespace cpu
}  // namespace prunopt
