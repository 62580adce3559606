"""Refusing model transformations that must come before a distributed wrapper.

Registering a parametrization (``Masker``, ``apply_probmask``) or swapping
layers (``to_interspace``) after ``DistributedDataParallel`` or ``fully_shard``
breaks the wrapper: ``register_parametrization`` re-sets the weight tensor
(``Tensor.set_``), which gives it a new gradient accumulator, so DDP's
gradient hooks, registered on the old one, never fire (PyTorch then reports
"Expected to have finished reduction in the prior iteration"); swapped layers
hold Parameters the wrapper does not know; FSDP2 tracks each parameter by its
module and attribute name, which a parametrization moves (and after
``fully_shard`` the layers are no longer of their original type).
"""
from __future__ import annotations

import gc
from typing import Optional

import torch
from torch import nn

__all__ = ["check_not_wrapped"]


def _wrapper_classes() -> tuple:
    """``(DDP, FSDP1, FSDP2 module)`` classes that this torch build provides."""
    if not torch.distributed.is_available():
        return ()
    out = []
    try:
        from torch.nn.parallel import DistributedDataParallel

        out.append(DistributedDataParallel)
    except ImportError:  # pragma: no cover - every distributed build has DDP
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        out.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        out.append(FSDPModule)
    except ImportError:  # pragma: no cover - torch < 2.6
        pass
    return tuple(out)


def _is_dtensor(t) -> bool:
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _wrapping_ddp(model: nn.Module, wrappers: tuple) -> Optional[nn.Module]:
    """A ``DistributedDataParallel`` whose ``module`` is ``model`` or contains it.

    The inner module carries no mark of its wrapper, so the live DDP objects
    are looked up once through the garbage collector's object list; DDP needs
    an initialised process group, so single-process programs never pay for it."""
    ddp = next((w for w in wrappers if w.__name__ == "DistributedDataParallel"), None)
    if ddp is None or not torch.distributed.is_initialized():
        return None
    for obj in gc.get_objects():
        if isinstance(obj, ddp) and any(m is model for m in obj.module.modules()):
            return obj
    return None


def check_not_wrapped(model: nn.Module, what: str) -> None:
    """``ValueError`` when ``model`` is, contains, or is held by a distributed
    wrapper (``DistributedDataParallel``, ``FullyShardedDataParallel``, a
    ``fully_shard`` module or DTensor parameters): ``what`` (e.g. ``"Masker"``)
    must be applied to the plain model before wrapping it."""
    wrappers = _wrapper_classes()
    found = None
    for name, m in model.named_modules():
        if wrappers and isinstance(m, wrappers):
            found = f"{'the model' if not name else repr(name)} is a {type(m).__name__}"
            break
    if found is None:
        for name, p in model.named_parameters():
            if _is_dtensor(p):
                found = f"parameter {name!r} is a DTensor (sharded by fully_shard or tensor parallelism)"
                break
    if found is None and _wrapping_ddp(model, wrappers) is not None:
        found = "the model is already wrapped in DistributedDataParallel"
    if found is not None:
        raise ValueError(
            f"{what} must be applied to the model before wrapping it in DistributedDataParallel or "
            f"fully_shard/FSDP ({found}): build the masks on the plain model on every rank, then wrap it")
