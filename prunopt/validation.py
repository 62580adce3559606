"""Argument validation shared by the ops (:mod:`prunopt.ops`), the references
(:mod:`prunopt.reference`), the layers and the optimizers.

Every check raises ``TypeError`` for a wrong type and ``ValueError`` for a
wrong value or shape, with a message that names the argument. This module
imports nothing of prunopt's, so that :mod:`prunopt.reference` can depend on
it alone.
"""
from __future__ import annotations

import math
import numbers
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

TensorOrList = Union[Tensor, Sequence[Tensor]]
IntPair = Union[int, Sequence[int]]

__all__ = ["as_tensor_list", "validate_projection_args", "pair", "validate_fb_args", "validate_fb_input",
           "check_float_tensor", "check_number"]


def as_tensor_list(theta: TensorOrList, name: str = "theta") -> Tuple[List[Tensor], bool]:
    """``(list of tensors, was_a_single_tensor)`` for an argument that takes a
    tensor or a list/tuple of tensors; ``TypeError`` naming ``name`` otherwise."""
    if isinstance(theta, Tensor):
        return [theta], True
    if isinstance(theta, (list, tuple)) and all(isinstance(t, Tensor) for t in theta):
        return list(theta), False
    raise TypeError(f"{name} must be a Tensor or a list/tuple of Tensors, got {type(theta).__name__}")


def validate_projection_args(theta: TensorOrList, budget, cost: Optional[TensorOrList]):
    """Checks and normalises the arguments of the projection ops.

    Returns ``(theta_list, cost_list_or_None, budget_float, theta_was_tensor)``.
    Type problems raise ``TypeError``; bad values raise ``ValueError``. Both name
    the argument. Value checks that need the data (finiteness, positive costs)
    are done by the solvers, before anything is written.
    """
    thetas, single = as_tensor_list(theta, "theta")
    if isinstance(budget, Tensor):
        if budget.numel() != 1:
            raise ValueError(f"budget must be a number or a one-element tensor, got shape {tuple(budget.shape)}")
        budget = budget.item()
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):  # NumPy scalars too
        raise TypeError(f"budget must be a real number, got {type(budget).__name__}")
    try:
        budget = float(budget)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        raise ValueError(f"budget must be a finite number >= 0, got an int of {int(budget).bit_length()} bits") from None
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"budget must be a finite number >= 0, got {budget}")
    costs = None
    if cost is not None:
        costs, _ = as_tensor_list(cost, "cost")
        if len(costs) != len(thetas):
            raise ValueError(f"cost must have as many tensors as theta ({len(thetas)}), got {len(costs)}")
    for i, t in enumerate(thetas):
        if not t.is_floating_point() or t.is_complex():
            raise ValueError(f"theta[{i}] must be a real floating tensor, got {t.dtype}")
        if t.dtype != thetas[0].dtype:
            raise ValueError(f"all theta tensors must share one dtype, theta[{i}] is {t.dtype} but theta[0] is {thetas[0].dtype}")
        if t.device != thetas[0].device:
            raise ValueError(f"all theta tensors must be on one device, theta[{i}] is on {t.device} but theta[0] is on {thetas[0].device}")
        if costs is not None:
            c = costs[i]
            if c.shape != t.shape:
                raise ValueError(f"cost[{i}] must have the shape of theta[{i}] {tuple(t.shape)}, got {tuple(c.shape)}")
            if c.dtype != t.dtype:
                raise ValueError(f"cost[{i}] must have the dtype of theta ({t.dtype}), got {c.dtype}")
            if c.device != t.device:
                raise ValueError(f"cost[{i}] must be on the device of theta ({t.device}), got {c.device}")
    return thetas, costs, budget, single


#: Largest stride, padding or dilation the FB ops accept (int32's largest
#: value: any larger one overflowed the kernels' 64-bit index arithmetic).
CONV_ARG_MAX = 2**31 - 1


def pair(value, name: str) -> Tuple[int, int]:
    """``(int, int)`` from an int or a pair of ints (a conv argument such as
    ``stride``); ``TypeError`` naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got bool")
    if isinstance(value, numbers.Integral):
        return int(value), int(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value
    ):
        return int(value[0]), int(value[1])
    if isinstance(value, (tuple, list)) and len(value) == 1 and isinstance(value[0], numbers.Integral):
        return int(value[0]), int(value[0])
    raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")


def validate_fb_args(
    input: Optional[Tensor],
    coefficients: Tensor,
    basis: Tensor,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    stride: IntPair = 1,
    padding: IntPair = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    check_input_dtype: bool = True,
):
    """Checks the arguments of the FB ops and normalises the conv arguments.

    Shapes: ``input (B, C_in, H, W)`` (or ``(C_in, H, W)``), ``coefficients
    (C_out, C_in/groups, N)``, ``basis (N, kh, kw)`` with ``kh, kw >= 1``, ``mask`` like
    ``coefficients``, ``bias (C_out,)``. Type problems raise ``TypeError``, bad
    values or shapes ``ValueError``; both name the argument.

    Returns ``(stride, padding, dilation, groups)`` as pairs/int.
    """
    for name, t in (("coefficients", coefficients), ("basis", basis)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a real floating tensor, got {t.dtype}")
    if coefficients.dim() != 3:
        raise ValueError(f"coefficients must have shape (C_out, C_in/groups, N), got {tuple(coefficients.shape)}")
    if basis.dim() != 3:
        raise ValueError(f"basis must have shape (N, kh, kw), got {tuple(basis.shape)}")
    if basis.shape[1] < 1 or basis.shape[2] < 1:
        raise ValueError(f"basis must have a non-empty kernel (kh, kw >= 1), got shape {tuple(basis.shape)}")
    if basis.shape[0] != coefficients.shape[2]:
        raise ValueError(
            f"basis has {basis.shape[0]} elements but coefficients have N = {coefficients.shape[2]} "
            f"(coefficients {tuple(coefficients.shape)}, basis {tuple(basis.shape)})"
        )
    if basis.dtype != coefficients.dtype:
        raise ValueError(f"basis must have the dtype of coefficients ({coefficients.dtype}), got {basis.dtype}")
    if basis.device != coefficients.device:
        raise ValueError(f"basis must be on the device of coefficients ({coefficients.device}), got {basis.device}")
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a Tensor or None, got {type(mask).__name__}")
        if mask.shape != coefficients.shape:
            raise ValueError(f"mask must have the shape of coefficients {tuple(coefficients.shape)}, got {tuple(mask.shape)}")
        if mask.device != coefficients.device:
            raise ValueError(f"mask must be on the device of coefficients ({coefficients.device}), got {mask.device}")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias must be a Tensor or None, got {type(bias).__name__}")
        if bias.shape != (coefficients.shape[0],):
            raise ValueError(f"bias must have shape ({coefficients.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != coefficients.dtype or bias.device != coefficients.device:
            raise ValueError(
                f"bias must have the dtype and device of coefficients ({coefficients.dtype}, "
                f"{coefficients.device}), got {bias.dtype}, {bias.device}"
            )
    stride, padding, dilation = pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")
    if min(stride) < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if min(padding) < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    if min(dilation) < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    for name, v in (("stride", stride), ("padding", padding), ("dilation", dilation)):
        if max(v) > CONV_ARG_MAX:  # the kernels' index arithmetic stays within int64
            raise ValueError(f"{name} must be at most {CONV_ARG_MAX}, got {v}")
    if isinstance(groups, bool) or not isinstance(groups, numbers.Integral):
        raise TypeError(f"groups must be an int, got {type(groups).__name__}")
    groups = int(groups)
    if groups < 1 or coefficients.shape[0] % groups != 0:
        raise ValueError(f"groups must be >= 1 and divide C_out = {coefficients.shape[0]}, got {groups}")
    if input is not None:
        validate_fb_input(input, coefficients, basis, padding, dilation, groups, check_input_dtype)
    return stride, padding, dilation, groups


def validate_fb_input(input: Tensor, coefficients: Tensor, basis: Tensor, padding: Tuple[int, int],
                      dilation: Tuple[int, int], groups: int, check_dtype: bool = True) -> None:
    """Checks the ``input`` of an FB convolution against checked ``coefficients`` and
    ``basis`` and normalised conv arguments (the input part of
    :func:`validate_fb_args`, which the training path of ``FBConv2d`` calls alone).
    ``check_dtype=False`` under autocast, where ``conv2d`` casts input and filters."""
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a Tensor, got {type(input).__name__}")
    if input.dim() not in (3, 4):
        raise ValueError(f"input must have shape (B, C_in, H, W) or (C_in, H, W), got {tuple(input.shape)}")
    if check_dtype and input.dtype != coefficients.dtype:
        raise ValueError(f"input must have the dtype of coefficients ({coefficients.dtype}), got {input.dtype}")
    if input.device != coefficients.device:
        raise ValueError(f"input must be on the device of coefficients ({coefficients.device}), got {input.device}")
    c_in = input.shape[-3]
    if c_in != coefficients.shape[1] * groups:
        raise ValueError(
            f"input has {c_in} channels but coefficients {tuple(coefficients.shape)} with groups={groups} "
            f"expect C_in = {coefficients.shape[1] * groups}"
        )
    if min(input.shape[-2:]) < 1:  # (as conv2d: padding alone is no image)
        raise ValueError(f"input must have an image of at least 1 x 1, got spatial size {tuple(input.shape[-2:])}")
    for d, (size, k) in enumerate(zip(input.shape[-2:], basis.shape[1:])):
        if size + 2 * padding[d] < dilation[d] * (k - 1) + 1:
            raise ValueError(
                f"input spatial size {tuple(input.shape[-2:])} (padded by {padding}) is smaller than the "
                f"dilated kernel {tuple(basis.shape[1:])} (dilation {dilation})"
            )


def check_float_tensor(t, name: str) -> None:
    """``t`` must be a real floating tensor."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a real floating tensor, got {t.dtype}")


def check_number(v, name: str, low: float, low_inclusive: bool) -> float:
    """``v`` as a float, which must be a finite real number above ``low``
    (or at least ``low`` when ``low_inclusive``)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    bound = f"{'>=' if low_inclusive else '>'} {low}"
    try:
        v = float(v)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        raise ValueError(f"{name} must be a finite number {bound}, got an integer beyond the float range") from None
    ok = math.isfinite(v) and (v >= low if low_inclusive else v > low)
    if not ok:
        raise ValueError(f"{name} must be a finite number {bound}, got {v}")
    return v


def check_opmath_range(v: float, name: str, dtype: torch.dtype) -> float:
    """``v`` (already a finite float) must be finite in the type the kernels
    compute in for ``dtype`` tensors: float64 for float64, float32 otherwise
    (float16 and bfloat16 compute in float32). A larger value would be inf
    there, and inf times a zero a NaN where the float64 reference is finite."""
    limit = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    if abs(v) > limit:
        raise ValueError(f"{name} must be at most {limit:g} (the largest finite value the kernels compute with "
                         f"for {dtype} tensors), got {v:g}")
    return v


# -- generic argument checks of the public API ------------------------------------------------
# (each raises TypeError for a wrong type and ValueError for a wrong value, naming the argument)

def check_module(m, name: str = "model"):
    """``m`` must be a ``torch.nn.Module``."""
    import torch.nn as nn

    if not isinstance(m, nn.Module):
        raise TypeError(f"{name} must be an nn.Module, got {type(m).__name__}")
    return m


def check_bool(v, name: str) -> bool:
    """``v`` must be a bool (a Python or NumPy bool; not a tensor, whose truth
    value is ambiguous, nor a number)."""
    if not isinstance(v, bool) and type(v).__name__ != "bool_":
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return bool(v)


def check_shape(v, name: str = "shape") -> tuple:
    """A tensor shape: a sequence of ints >= 0 (each at most 2**63 - 1)."""
    if isinstance(v, (str, bytes, torch.Tensor)) or not hasattr(v, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(v).__name__}")
    return tuple(check_int(d, f"{name}[{i}]", 0, SIZE_MAX) for i, d in enumerate(v))


def check_int(v, name: str, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """``v`` must be an int (not a bool) in ``[low, high]``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if (low is not None and v < low) or (high is not None and v > high):
        rng = f"in [{low}, {high}]" if low is not None and high is not None else (
            f">= {low}" if low is not None else f"<= {high}")
        raise ValueError(f"{name} must be {rng}, got {v}")
    return v


#: the largest size of a tensor dimension (an int64): larger sizes cannot be allocated
SIZE_MAX = 2**63 - 1


def check_size(v, name: str, low: int = 1) -> int:
    """A tensor dimension: an int in ``[low, 2**63 - 1]``."""
    return check_int(v, name, low, SIZE_MAX)


def check_real(v, name: str, low: Optional[float] = None, high: Optional[float] = None,
               low_inclusive: bool = True, high_inclusive: bool = True) -> float:
    """``v`` as a float: a finite real number (not a bool, not an int beyond
    the float range) within the given bounds."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got an integer beyond the float range") from None
    bad = not math.isfinite(f)
    if low is not None:
        bad = bad or (f < low if low_inclusive else f <= low)
    if high is not None:
        bad = bad or (f > high if high_inclusive else f >= high)
    if bad:
        lo = "" if low is None else f"{'>=' if low_inclusive else '>'} {low}"
        hi = "" if high is None else f"{'<=' if high_inclusive else '<'} {high}"
        rng = " and ".join(s for s in (lo, hi) if s)
        raise ValueError(f"{name} must be a finite number{' ' + rng if rng else ''}, got {f}")
    return f


def check_str_list(v, name: str) -> Optional[list]:
    """None, or an iterable of strings (not a single string) as a list."""
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or isinstance(v, torch.Tensor) or not hasattr(v, "__iter__"):
        raise TypeError(f"{name} must be None or an iterable of names, got {type(v).__name__}")
    out = list(v)
    for x in out:
        if not isinstance(x, str):
            raise TypeError(f"{name} must hold names (str), got {type(x).__name__}")
    return out


def check_list(v, name: str, item_type=None, item: str = "items") -> list:
    """An iterable (not a string or a tensor) as a list, each element an
    instance of ``item_type`` when given."""
    if isinstance(v, (str, bytes, torch.Tensor)) or not hasattr(v, "__iter__"):
        raise TypeError(f"{name} must be a list of {item}, got {type(v).__name__}")
    out = list(v)
    if item_type is not None:
        for i, x in enumerate(out):
            if not isinstance(x, item_type):
                raise TypeError(f"{name}[{i}] must be {item}, got {type(x).__name__}")
    return out
