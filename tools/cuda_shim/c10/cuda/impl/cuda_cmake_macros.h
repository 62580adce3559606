#pragma once
// Stand-in for the header CMake generates in CUDA builds of PyTorch; the CPU
// wheel used for the compile check (tools/check_cuda.sh) does not ship it.
// Only used for compile checks: real builds (setup.py against a CUDA torch)
// use torch's own copy.
#define C10_CUDA_BUILD_SHARED_LIBS
