"""prunAdag ops: the global top-T threshold ``topk_threshold`` (eq. 2.6) and
the fused step ``prunadag_step_`` (called by :class:`prunopt.optim.PrunAdag`).

``torch.ops.prunopt.prunadag_step_(params, opt_sums, dec_sums, grads, hyper,
relevant, version, found_nonfinite=None, selection=None)`` updates one
selection scope in place. ``hyper`` is float64 ``(len(params), 6)``: per tensor
``[lr_k, lr_k / (k+1), weight_decay, eps, maximize, prune]``; ``relevant`` is
the resolved ``T``; ``version`` 1-4, or 0 for "relevant_only". With
``selection`` (float64 ``[tau, r]`` on the params' device) the relevant set is
``{|g| >= tau}`` and the ratio of Table 1 is ``r`` as given (``relevant`` is
not used): the step of one process's shards of a scope whose threshold and
ratio were agreed over several processes (see :mod:`prunopt.optim._sharded`).
Kernels: ``csrc/cpu/prunadag.cpp``, ``csrc/cuda/prunadag.cu``; reference:
:mod:`prunopt.reference.prunadag`."""
from __future__ import annotations

import torch
from torch import Tensor

from prunopt._extension import extension_available
from prunopt.ops._registry import TensorOrList, _kernel_devices
from prunopt.reference.prunadag import topk_threshold_reference as _topk_threshold_reference

__all__ = ["topk_threshold", "PRUNADAG_DEVICES"]

PRUNADAG_DEVICES = _kernel_devices("prunadag_step_")
_THRESHOLD_DEVICES = _kernel_devices("topk_threshold")


def topk_threshold(values: TensorOrList, k: int) -> Tensor:
    r"""The ``k``-th largest :math:`|v|` over a tensor or a list of tensors
    (prunAdag eq. 2.6, the threshold :math:`\tau` of the relevant set
    :math:`\mathcal R = \{i : |g_i| \ge \tau\}`; also the LMO of eq. 1.2).

    Equals ``torch.kthvalue(cat(|v|), n - k + 1).values`` (ties included) but the
    kernel never concatenates: it is an exact radix select on the bit patterns of
    :math:`|v|` with per-chunk histograms (deterministic, nothing of size n).

    Args:
        values: a tensor or a list of tensors of one real floating dtype and device.
        k: ``1 <= k <= n`` (``n`` = total number of elements).

    Returns:
        A 0-dim tensor of the values' dtype.

    Raises:
        TypeError: not tensors, ``k`` not an int.
        ValueError: ``k`` out of range, mixed dtypes/devices, non-finite values.
    """
    if isinstance(values, Tensor):
        vals = [values]
    elif isinstance(values, (list, tuple)) and all(isinstance(v, Tensor) for v in values):
        vals = list(values)
    else:
        raise TypeError(f"values must be a Tensor or a list/tuple of Tensors, got {type(values).__name__}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    n = sum(v.numel() for v in vals)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    for i, v in enumerate(vals):
        if not v.is_floating_point():
            raise ValueError(f"values[{i}] must be a real floating tensor, got {v.dtype}")
        if v.dtype != vals[0].dtype or v.device != vals[0].device:
            raise ValueError(f"values[{i}] must have the dtype and device of values[0]")
    if vals[0].device.type in _THRESHOLD_DEVICES and vals[0].dtype in (torch.float32, torch.float64):
        return torch.ops.prunopt.topk_threshold(vals, k)
    for i, v in enumerate(vals):
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"values[{i}] contains a non-finite value")
    return _topk_threshold_reference(vals, k)


if extension_available():

    @torch.library.register_fake("prunopt::topk_threshold")
    def _topk_threshold_fake(values, k):
        return values[0].new_empty(())

    @torch.library.register_fake("prunopt::prunadag_step_")
    def _prunadag_step_fake(params, opt_sums, dec_sums, grads, hyper, relevant, version, found_nonfinite=None,
                            selection=None):
        if selection is not None and (selection.dtype != torch.float64 or selection.numel() != 2):
            raise ValueError("prunadag_step_: selection must be a float64 tensor of 2 elements [tau, r], got "
                             f"{selection.dtype} of shape {tuple(selection.shape)}")
        return None
