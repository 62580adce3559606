// The sparse path's kernels of fb_conv2d (fb_conv2d_kernels.h) for AVX-512F
// (64-byte vectors: half the loads and FMAs per row of the mix; x86-64 only,
// picked at run time unless PRUNOPT_NO_AVX512 is set).
#include "prunopt/fb_conv2d_impl.h"

#ifdef PRUNOPT_X86_DISPATCH
namespace prunopt {
namespace cpu {
namespace fbconv {

template <typename scalar_t>
__attribute__((target("avx512f,avx2,fma"), optimize("fp-contract=fast"))) void maps_avx512(
    const MapsArgs<scalar_t>& a, int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_WIDTH(maps_width(a), (maps_body<scalar_t, W, 64, 2>(a, t0, t1)))
}
template <typename scalar_t>
__attribute__((target("avx512f,avx2,fma"), optimize("fp-contract=fast"))) void mix_avx512(
    const MixArgs<scalar_t>& a, int64_t t0, int64_t t1) {
  PRUNOPT_DISPATCH_MIX_WIDTH(tile_width(a.G->p(), kMixTile), (mix_body<scalar_t, W, 64>(a, t0, t1)))
}

#define PRUNOPT_INSTANTIATE(T)                                              \
  template void maps_avx512<T>(const MapsArgs<T>&, int64_t, int64_t); \
  template void mix_avx512<T>(const MixArgs<T>&, int64_t, int64_t);
PRUNOPT_INSTANTIATE(float)
PRUNOPT_INSTANTIATE(double)

}  // namespace fbconv
}  // namespace cpu
}  // namespace prunopt
#endif
