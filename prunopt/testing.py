"""Shared test helpers: devices, dtypes, tolerances and hypothesis strategies.

One source of truth for what every test runs on, so a new device or dtype is
added in one place.
"""
from __future__ import annotations

import os

import torch

from prunopt._extension import cuda_kernels_available, extension_available

__all__ = ["devices", "float_dtypes", "tolerance", "extension_available", "cuda_kernels_available", "avx512_cpu",
           "simd_clones", "kernels_optimised"]


def devices():
    """Devices the tests run on: cpu, plus cuda when a GPU and the CUDA kernels exist."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


def float_dtypes(low_precision: bool = False):
    dts = [torch.float32, torch.float64]
    if low_precision:
        dts += [torch.bfloat16, torch.float16]
    return dts


_TOL = {
    torch.float64: dict(atol=1e-12, rtol=0.0),
    torch.float32: dict(atol=1e-5, rtol=0.0),
    torch.bfloat16: dict(atol=1e-2, rtol=0.0),
    torch.float16: dict(atol=1e-3, rtol=0.0),
}


def tolerance(dtype: torch.dtype) -> dict:
    """Absolute tolerance of a kernel in ``dtype`` against a float64 reference
    (the projection's accuracy bound: 1e-12 in float64, 1e-5 in float32, relative to 1)."""
    return dict(_TOL[dtype])


def avx512_cpu() -> bool:
    """Whether this CPU runs the kernels' AVX-512 clones (torch's AVX512
    capability: F, BW, VL and DQ)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def simd_clones(monkeypatch, default: bool = False):
    """Yields ``"avx512"`` and then ``"avx2"``, with ``PRUNOPT_NO_AVX512`` unset
    and then set through pytest's ``monkeypatch``: the CPU kernels that have an
    AVX-512 clone run it, then their AVX2 loops (the tests compare the two).
    With ``default=True`` it then yields ``"default"`` with ``PRUNOPT_NO_SIMD=1``
    set: the kernels dispatched through ``prunopt/vec_capability.h`` run their
    DEFAULT capability (what a CPU without AVX2 runs)."""
    monkeypatch.delenv("PRUNOPT_NO_SIMD", raising=False)
    for isa in ("avx512", "avx2") + (("default",) if default else ()):
        if isa == "avx2":
            monkeypatch.setenv("PRUNOPT_NO_AVX512", "1")
        elif isa == "default":
            monkeypatch.setenv("PRUNOPT_NO_SIMD", "1")
        else:
            monkeypatch.delenv("PRUNOPT_NO_AVX512", raising=False)
        yield isa


def kernels_optimised() -> bool:
    """Whether the loaded kernels were compiled with optimisation (-O2 and
    above: setup.py and CMake's Release build use -O3); false when
    ``PRUNOPT_KERNELS_UNOPTIMISED=1`` (``tools/sanitize.sh`` sets it for its
    -O0 AddressSanitizer build). The FB sparse path's AVX2 clone fuses its
    multiply-adds only where the compiler contracts them (an
    ``optimize("fp-contract=fast")`` attribute: GCC contracts at -O2 and
    above), while its AVX-512 clone's 4-output maps use the FMA intrinsic; so
    the two agree bit for bit in optimised builds only, and the tests compare
    them to a stated tolerance otherwise."""
    return os.environ.get("PRUNOPT_KERNELS_UNOPTIMISED", "") not in ("1", "true", "yes")
