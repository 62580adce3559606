"""prunopt: pruning-aware optimizers, masks and sparse layers for PyTorch.

Submodules: :mod:`prunopt.ops` (fused custom ops), :mod:`prunopt.reference`
(pure-PyTorch oracles), :mod:`prunopt.optim` (optimizers and projections),
:mod:`prunopt.nn` (layers and masks), :mod:`prunopt.pruning` (masks, scores and
methods), :mod:`prunopt.schedules`.
"""
from prunopt._extension import cuda_kernels_available, extension_available
from prunopt import ops, reference  # noqa: E402
from prunopt import nn, optim, pruning  # noqa: E402

__version__ = "0.1.0"

__all__ = ["extension_available", "cuda_kernels_available", "ops", "reference", "nn", "optim", "pruning", "__version__"]
