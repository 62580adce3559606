"""Typed Python wrappers over ``torch.ops.prunopt.*``.

Each wrapper validates its arguments (``TypeError``/``ValueError`` naming the
argument), then calls the fused kernel of the extension when it is loaded and
the pure-PyTorch reference (``prunopt.reference``) otherwise. Fake (meta)
kernels are registered here so that every op traces under ``torch.compile``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from prunopt._extension import extension_available
from prunopt.reference.projection import project_budget_reference, validate_projection_args

TensorOrList = Union[Tensor, Sequence[Tensor]]

__all__ = ["project_budget", "project_budget_"]


def _kernel_devices(op: str) -> frozenset:
    """Device types with a compiled kernel for ``prunopt::op`` (fixed at import,
    so the check is a constant under torch.compile)."""
    if not extension_available():
        return frozenset()
    keys = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}
    return frozenset(
        d for d, k in keys.items() if d == "meta" or torch._C._dispatch_has_kernel_for_dispatch_key(f"prunopt::{op}", k)
    )


_PROJECTION_DEVICES = _kernel_devices("project_budget")


def _use_kernel(tensors: List[Tensor], devices: frozenset = _PROJECTION_DEVICES) -> bool:
    return bool(tensors) and tensors[0].device.type in devices


def project_budget(theta: TensorOrList, budget: float, cost: Optional[TensorOrList] = None):
    r"""Exact Euclidean projection onto the budget set (SPEC.md §1, ProM supplement eq. 9-17).

    .. math::
        \theta^* = \arg\min_x \|x - \theta\|^2 \;\; \text{s.t.}\;\; 0 \le x_i \le 1,\;
        \textstyle\sum_i c_i x_i \le S, \qquad
        \theta^* = \mathrm{clamp}(\theta - \lambda^* c, 0, 1)

    with :math:`\lambda^* = \max(0, \lambda_1)` the root of the non-increasing
    :math:`\phi(\lambda) = \sum_i c_i\,\mathrm{clamp}(\theta_i - \lambda c_i, 0, 1) - S`
    (eq. 14). The result is exact to rounding (not a bisection approximation).

    Args:
        theta: a tensor of any shape, or a list of tensors projected jointly under
            one budget (no concatenated copy is made). float32/float64; float16 and
            bfloat16 are computed in double and rounded back.
        budget: ``S >= 0``. ``S = 0`` gives all zeros.
        cost: optional positive costs ``c`` with the shape(s) of ``theta``
            (default all ones, so the budget counts elements).

    Returns:
        A new tensor (or list) with the projected values.

    Raises:
        TypeError: ``theta``/``cost`` not tensors, ``budget`` not a number.
        ValueError: negative or non-finite budget, non-finite scores, non-positive
            costs, mismatched shapes, dtypes or devices.
    """
    thetas, costs, budget, single = validate_projection_args(theta, budget, cost)
    if _use_kernel(thetas):
        out = torch.ops.prunopt.project_budget(thetas, costs, budget)
        return out[0] if single else list(out)
    return project_budget_reference(thetas[0] if single else thetas, budget, costs[0] if (single and costs) else costs)


def project_budget_(theta: TensorOrList, budget: float, cost: Optional[TensorOrList] = None):
    r"""In-place :func:`project_budget`: overwrites ``theta`` with its projection.

    Validation (including finiteness of the data) happens before anything is
    written, so on error ``theta`` is unchanged. Returns ``theta``.
    """
    thetas, costs, budget, single = validate_projection_args(theta, budget, cost)
    if _use_kernel(thetas):
        torch.ops.prunopt.project_budget_(thetas, costs, budget)
    else:
        outs = project_budget_reference(thetas, budget, costs)
        with torch.no_grad():
            for t, o in zip(thetas, outs):
                t.copy_(o)
    return theta


if extension_available():

    @torch.library.register_fake("prunopt::project_budget")
    def _project_budget_fake(theta, cost, budget):
        return [torch.empty_like(t) for t in theta]

    @torch.library.register_fake("prunopt::project_budget_")
    def _project_budget_inplace_fake(theta, cost, budget):
        return None


# ---------------------------------------------------------------------------
# Interspace pruning: filter-basis convolution (SPEC.md §3, issue 4).
# Ops: fb_reconstruct (fused eq. 4), fb_conv2d (eq. 6/8, dense or sparse path
# chosen by density inside the kernel), fb_conv2d_csr (eq. 8 on a cached CSR).
# ---------------------------------------------------------------------------
from prunopt.ops_interspace import (  # noqa: E402
    FBCompressed,
    fb_compress,
    fb_conv2d,
    fb_conv2d_compressed,
    fb_reconstruct,
)

__all__ += ["fb_reconstruct", "fb_conv2d", "fb_compress", "fb_conv2d_compressed", "FBCompressed"]

if extension_available() and hasattr(torch.ops.prunopt, "fb_conv2d"):
    from prunopt.ops_interspace import fb_conv_out_shape as _fb_conv_out_shape  # noqa: E402
    from prunopt.ops_interspace import register_fb_autograd as _register_fb_autograd  # noqa: E402

    @torch.library.register_fake("prunopt::fb_reconstruct")
    def _fb_reconstruct_fake(coefficients, basis, mask):
        return coefficients.new_empty(coefficients.shape[0], coefficients.shape[1], basis.shape[1], basis.shape[2])

    @torch.library.register_fake("prunopt::fb_conv2d")
    def _fb_conv2d_fake(input, coefficients, basis, mask, bias, stride, padding, dilation, groups, max_density):
        return input.new_empty(_fb_conv_out_shape(input, coefficients.shape[0], basis, stride, padding, dilation))

    @torch.library.register_fake("prunopt::fb_conv2d_csr")
    def _fb_conv2d_csr_fake(input, crow_indices, col_indices, values, basis, bias, stride, padding, dilation, groups):
        c_out = crow_indices.shape[0] - 1
        return input.new_empty(_fb_conv_out_shape(input, c_out, basis, stride, padding, dilation))

    _register_fb_autograd()

# prunAdag (SPEC.md section 2): global top-T threshold and the fused step.
# ---------------------------------------------------------------------------
from prunopt.reference.prunadag import topk_threshold_reference as _topk_threshold_reference  # noqa: E402

__all__ += ["topk_threshold", "PRUNADAG_DEVICES"]

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
    def _prunadag_step_fake(params, opt_sums, dec_sums, grads, hyper, relevant, version):
        return None
