"""Build prunopt and its C++/CUDA extension ``prunopt._C``.

Environment switches:

* ``PRUNOPT_NO_EXT=1``   build no extension (pure-PyTorch reference only).
* ``PRUNOPT_NO_CUDA=1``  never compile the CUDA sources.
* ``PRUNOPT_FORCE_CUDA=1`` compile the CUDA sources even if torch reports no GPU
  (torch must still be a CUDA build and nvcc must be found).
* ``MAX_JOBS``           parallel compile jobs (ninja), as in torch.utils.cpp_extension.
"""
import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def extensions():
    if _flag("PRUNOPT_NO_EXT"):
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = ["csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp")) + sorted(glob.glob("csrc/autograd/*.cpp"))
    # -ffp-contract=off: GCC fuses a * b + c into one FMA in C++ even with
    # -std=c++20, so the kernels would not compute the operations they are
    # written with (and the fused and reference paths would round apart).
    # Wanted FMAs are written as intrinsics.
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off"]
    use_cuda = (
        not _flag("PRUNOPT_NO_CUDA")
        and torch.version.cuda is not None
        and CUDA_HOME is not None
        and (torch.cuda.is_available() or _flag("PRUNOPT_FORCE_CUDA"))
    )
    kwargs = dict(
        name="prunopt._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc", "include")],
        extra_compile_args={"cxx": cxx},
        extra_link_args=["-fopenmp"],
        py_limited_api=True,
    )
    if use_cuda:
        kwargs["sources"] = sources + sorted(glob.glob("csrc/cuda/*.cu"))
        kwargs["extra_compile_args"]["nvcc"] = ["-O3", "-std=c++20", "--expt-relaxed-constexpr"]
        kwargs["define_macros"] = [("PRUNOPT_WITH_CUDA", None)]
        ext = CUDAExtension(**kwargs)
    else:
        ext = CppExtension(**kwargs)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp39"}} if ext_modules else {},
)
