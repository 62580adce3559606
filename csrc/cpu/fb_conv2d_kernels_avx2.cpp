// The sparse path's kernels of fb_conv2d (fb_conv2d_kernels.h) for AVX2 + FMA
// (32-byte vectors; x86-64 only, picked at run time).
#include "prunopt/fb_conv2d_impl.h"

#ifdef PRUNOPT_X86_DISPATCH
namespace prunopt {
namespace cpu {
namespace fbconv {

template <typename scalar_t>
__attribute__((target("avx2,fma"), optimize("fp-contract=fast"))) void maps_avx2(const MapsArgs<scalar_t>& a,
    int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_WIDTH(maps_width(a), (maps_body<scalar_t, W, 32, 1>(a, t0, t1)))
}
template <typename scalar_t>
__attribute__((target("avx2,fma"), optimize("fp-contract=fast"))) void mix_avx2(const MixArgs<scalar_t>& a,
    int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_MIX_WIDTH(tile_width(a.G->p(), kMixTile), mix_body<scalar_t, W>(a, t0, t1))
}

#define PRUNOPT_INSTANTIATE(T)                                            \
  template void maps_avx2<T>(const MapsArgs<T>&, int64_t, int64_t); \
  template void mix_avx2<T>(const MixArgs<T>&, int64_t, int64_t);
PRUNOPT_INSTANTIATE(float)
PRUNOPT_INSTANTIATE(double)

}  // namespace fbconv
}  // namespace cpu
}  // namespace prunopt
#endif
