"""Loading of the compiled extension ``prunopt._C``.

Importing prunopt never fails: if the extension is missing (``PRUNOPT_NO_EXT=1``
at build time, or a failed build) a single warning is issued and every op runs
its pure-PyTorch reference instead. Set ``PRUNOPT_REQUIRE_EXTENSION=1`` to make a
missing extension an ``ImportError`` (CI does).

``PRUNOPT_EXTENSION_LIBRARY=/path/to/libprunopt_ops.so`` loads the kernels from
that shared library (``torch.ops.load_library``) instead of ``prunopt._C``:
``tools/sanitize.sh`` runs the op tests this way against its AddressSanitizer
build (CMakeLists.txt, ``-DPRUNOPT_SANITIZE=ON``), which lives in its own build
directory beside the normal extension.
"""
import os
import warnings

import torch  # noqa: F401  (loads libtorch/libc10, which prunopt._C links against)

_AVAILABLE = False
_ERROR = None

_LIBRARY = os.environ.get("PRUNOPT_EXTENSION_LIBRARY", "")


def _load() -> None:
    if _LIBRARY:
        if not os.path.isfile(_LIBRARY):
            raise ImportError(f"PRUNOPT_EXTENSION_LIBRARY={_LIBRARY!r} is not a file")
        try:
            torch.ops.load_library(_LIBRARY)  # registers torch.ops.prunopt.*
        except OSError as exc:
            raise ImportError(f"PRUNOPT_EXTENSION_LIBRARY={_LIBRARY!r} could not be loaded: {exc}") from exc
    else:
        from prunopt import _C  # noqa: F401  (registers torch.ops.prunopt.*)


try:
    _load()
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
