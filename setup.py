"""Build prunopt and its C++/CUDA extension ``prunopt._C``.

Environment switches:

* ``PRUNOPT_NO_EXT=1``   build no extension (pure-PyTorch reference only).
* ``PRUNOPT_NO_CUDA=1``  never compile the CUDA sources.
* ``PRUNOPT_FORCE_CUDA=1`` compile the CUDA sources even if torch reports no GPU
  (torch must still be a CUDA build and nvcc must be found).
* ``PRUNOPT_DEBUG=1``    keep debug information in the objects (``-g``; the default
  ``-g0`` drops it: it doubled the compile time and the size of the objects).
* ``PRUNOPT_BUILD_DIR``  where the objects go (default ``build/temp.<platform>-<python>``
  in the checkout, also for ``pip install -e .``, whose own build folder is a
  fresh temporary one each time: a second install recompiles only what changed).
* ``MAX_JOBS``           parallel compile jobs (ninja), as in torch.utils.cpp_extension.

The build prints one line per compiled file (ninja's ``[done/total, seconds]``);
pip shows it with ``-v``.
"""
import glob
import os
import sys

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
    # -g0 (after Python's -g): the debug information of the torch headers and
    # of the unrolled kernels was half of the compile time.
    # -Wno-unknown-pragmas: ATen's vec headers (the per-capability gate kernels,
    # csrc/cpu/gates_*.cpp) write `#pragma unroll`, which GCC < 13 reports and
    # cannot be told to ignore from inside the file (GCC PR 53431).
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off", "-Wno-unknown-pragmas",
           "-g" if _flag("PRUNOPT_DEBUG") else "-g0"]
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

    class build_ext(BuildExtension):
        """torch's BuildExtension (ninja) with its objects in a persistent folder."""

        def finalize_options(self):
            super().finalize_options()
            # pip's editable install points build_temp at a new temporary
            # folder, so ninja would find no objects to reuse
            self.build_temp = os.environ.get("PRUNOPT_BUILD_DIR") or os.path.join(
                ROOT, "build", f"temp.{self.plat_name}-{sys.implementation.cache_tag}")

        def build_extensions(self):
            # one line per file with its elapsed seconds (pip -v shows it)
            os.environ.setdefault("NINJA_STATUS", "[%f/%t, %es] ")
            super().build_extensions()

    return [ext], {"build_ext": build_ext.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp39"}} if ext_modules else {},
)
