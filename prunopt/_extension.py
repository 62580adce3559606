"""Loading of the compiled extension ``prunopt._C``.

Importing prunopt never fails: if the extension is missing (``PRUNOPT_NO_EXT=1``
at build time, or a failed build) a single warning is issued and every op runs
its pure-PyTorch reference instead. Set ``PRUNOPT_REQUIRE_EXTENSION=1`` to make a
missing extension an ``ImportError`` (CI does).
"""
import os
import warnings

import torch  # noqa: F401  (loads libtorch/libc10, which prunopt._C links against)

_AVAILABLE = False
_ERROR = None

try:
    from prunopt import _C  # noqa: F401  (registers torch.ops.prunopt.*)

    _AVAILABLE = True
except ImportError as exc:  # pragma: no cover - exercised only without the build
    _ERROR = exc
    if os.environ.get("PRUNOPT_REQUIRE_EXTENSION", "0") not in ("", "0"):
        raise ImportError(
            "prunopt: PRUNOPT_REQUIRE_EXTENSION is set but the compiled extension "
            f"prunopt._C could not be imported: {exc}"
        ) from exc
    warnings.warn(
        f"prunopt: compiled extension not available ({exc}); using the pure-PyTorch "
        "reference implementations. Reinstall with `pip install --no-build-isolation -e .` "
        "to build it.",
        RuntimeWarning,
        stacklevel=2,
    )


def extension_available() -> bool:
    """True if the fused C++ (and, when built, CUDA) kernels are loaded."""
    return _AVAILABLE


def cuda_kernels_available() -> bool:
    """True if the extension was compiled with its CUDA kernels."""
    if not _AVAILABLE:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("prunopt::project_budget", "CUDA")
    except Exception:  # pragma: no cover
        return False
