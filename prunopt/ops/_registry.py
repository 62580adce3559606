"""Which devices have a compiled kernel for an op of ``torch.ops.prunopt``."""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from prunopt._extension import extension_available

TensorOrList = Union[Tensor, Sequence[Tensor]]


def _kernel_devices(op: str, meta: bool = True) -> frozenset:
    """Device types with a compiled kernel for ``prunopt::op`` (fixed at import,
    so the check is a constant under torch.compile). ``meta`` counts the fake
    kernel as one (the op then traces meta tensors); an extension built before
    ``op`` existed has none (the reference runs)."""
    if not extension_available():
        return frozenset()
    keys = {"cpu": "CPU", "cuda": "CUDA"}
    try:
        found = {d for d, k in keys.items() if torch._C._dispatch_has_kernel_for_dispatch_key(f"prunopt::{op}", k)}
    except RuntimeError:
        return frozenset()
    return frozenset(found | ({"meta"} if meta else set()))
