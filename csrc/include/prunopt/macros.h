// Portable qualifiers for math shared by the CPU and CUDA kernels.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PRUNOPT_HD __host__ __device__ __forceinline__
#else
#define PRUNOPT_HD inline
#endif
