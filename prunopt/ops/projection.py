"""Budget projection ops (ProM / ProbMask): ``project_budget`` and its in-place
form, fake kernels and the autograd registration. Kernels:
``csrc/cpu/project_budget.cpp``, ``csrc/cuda/project_budget.cu``; reference:
:mod:`prunopt.reference.projection`."""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from prunopt._extension import extension_available
from prunopt.ops import _fake_checks as _fc
from prunopt.ops._registry import TensorOrList, _kernel_devices
from prunopt.reference.projection import (project_budget_apply_reference, project_budget_bracket_reference,
                                         project_budget_reference)
from prunopt.validation import validate_projection_args

__all__ = ["project_budget", "project_budget_", "project_budget_bracket", "project_budget_apply_"]

_PROJECTION_DEVICES = _kernel_devices("project_budget")
_BRACKET_DEVICES = _kernel_devices("project_budget_bracket")
_APPLY_DEVICES = _kernel_devices("project_budget_apply_")


def _use_kernel(tensors: List[Tensor]) -> bool:
    # len(), not bool(): dynamo in torch 2.11 cannot trace bool() of a list
    # (test_project_budget.py::test_torch_compile failed there, seen on the H100)
    # (the module global is read at call time, so a test can switch the path)
    return len(tensors) > 0 and tensors[0].device.type in _PROJECTION_DEVICES


def project_budget(theta: TensorOrList, budget: float, cost: Optional[TensorOrList] = None):
    r"""Exact Euclidean projection onto the budget set (ProM supplement A.2, eq. 9-17).

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
        A new tensor (or list) with the projected values. It does not require
        grad, whatever ``theta`` does: the projection is an optimisation step
        (like ``torch.argmax``), not a differentiable layer, so no gradient flows
        back through it (the compiled op has a non-differentiable Autograd
        kernel; the pure-PyTorch fallback computes on detached data).

    Raises:
        TypeError: ``theta``/``cost`` not tensors, ``budget`` not a real number
            (Python, NumPy or one-element tensor).
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
    written, so on error ``theta`` is unchanged. The tensors of ``theta`` must
    not share memory with each other (the same tensor twice, overlapping
    views) or within themselves (e.g. an ``expand()``-ed tensor): that is a
    ``ValueError`` (checked in eager mode). As for PyTorch's own in-place
    ops, a tensor that requires grad (a leaf such as a parameter, a view of
    one, or part of a graph) can only be written with grad mode off (under
    ``torch.no_grad()``, as optimizer steps run): otherwise ``RuntimeError``,
    before anything is written. Returns ``theta``.
    """
    thetas, costs, budget, single = validate_projection_args(theta, budget, cost)
    if not torch.compiler.is_compiling():
        _check_grad_writes(thetas)
        _check_no_overlap(thetas)
    if _use_kernel(thetas):
        torch.ops.prunopt.project_budget_(thetas, costs, budget)
    else:
        outs = project_budget_reference(thetas, budget, costs)
        with torch.no_grad():
            for t, o in zip(thetas, outs):
                t.copy_(o)
    return theta


def project_budget_bracket(theta: TensorOrList, lo: float, hi: float, cost: Optional[TensorOrList] = None):
    r"""One pass of the budget projection over ``theta`` for a bracket
    ``[lo, hi]`` of the multiplier :math:`\lambda` (ProM supplement A.2,
    eq. 14): what a caller needs to solve :math:`\phi(\lambda) = 0` on the
    bracket from a small set, without reading ``theta`` again.

    Each element has the breakpoints :math:`k_2 = (t-1)/c` and :math:`k_1 =
    t/c`: :math:`\mathrm{clamp}(t - \lambda c, 0, 1)` is 1 for :math:`\lambda
    \le k_2`, :math:`t - \lambda c` between them and 0 after :math:`k_1`. An
    element with a breakpoint strictly inside ``(lo, hi)`` is *kept*; every
    other one keeps one form on all of ``[lo, hi]``, so that there

    .. math::
        \phi(\lambda) = U + F_{ct} - \lambda F_{cc}
        + \textstyle\sum_{kept} c\,\mathrm{clamp}(t - \lambda c, 0, 1) - S

    with :math:`U = \sum c` over :math:`k_2 \ge hi`, and :math:`F_{ct} =
    \sum c t`, :math:`F_{cc} = \sum c^2` over :math:`k_2 \le lo,\ k_1 \ge
    hi`. The sharded projection (:func:`prunopt.distributed.project_budget`)
    sums these over the processes.

    Args:
        theta: a tensor or a list of tensors of one floating dtype and device.
        lo, hi: ``0 <= lo <= hi`` (``hi`` may be ``inf``).
        cost: optional costs shaped like ``theta`` (default all ones).

    Returns:
        ``(summary, theta_kept, cost_kept)``: ``summary`` float64
        ``[U, F_ct, F_cc, bad_theta, bad_cost]`` (a flag is 1 when a score is
        not finite, or a cost not positive and finite: reported, not raised,
        so that several processes can agree on it first; then the sums are 0
        and nothing is kept), and the kept elements' scores and costs in index
        order, in ``theta``'s dtype (``cost_kept`` empty without costs).

    Raises:
        TypeError / ValueError: ``theta`` or ``cost`` not tensors of one dtype
            and device, mismatched shapes, ``lo``/``hi`` not numbers with
            ``0 <= lo <= hi``.
    """
    thetas = _tensors(theta, "theta")
    if not thetas:
        raise TypeError("theta must be a tensor or a non-empty list of tensors, got an empty list")
    costs = _tensors(cost, "cost") if cost is not None else None
    lo, hi = _bracket_ends(lo, hi)
    if thetas[0].device.type in _BRACKET_DEVICES:
        return tuple(torch.ops.prunopt.project_budget_bracket(thetas, costs, lo, hi))
    _fc.check_projection(thetas, costs, 0.0, "project_budget_bracket")
    return project_budget_bracket_reference(thetas, costs, lo, hi)


def project_budget_apply_(out: TensorOrList, theta: TensorOrList, lam: float, cost: Optional[TensorOrList] = None):
    r"""The projection for a given multiplier, written into ``out``:
    :math:`out_i = \mathrm{clamp}(\theta_i - \lambda c_i, 0, 1)` (eq. 15),
    computed in float64 and rounded once to ``theta``'s dtype, as the last
    pass of :func:`project_budget` (which finds :math:`\lambda^*` first;
    :func:`prunopt.distributed.project_budget` finds it over several
    processes and writes with this op). ``out`` may be ``theta`` itself (in
    place). ``theta`` is not checked for finiteness here (the pass that found
    ``lam`` did that).

    Args:
        out: tensors (or one tensor) shaped, typed and placed like ``theta``,
            not sharing memory with each other.
        theta: a tensor or a list of tensors of one floating dtype and device.
        lam: ``lam >= 0`` (``inf`` gives zeros).
        cost: optional positive costs shaped like ``theta`` (default all ones).

    Returns:
        ``out``.
    """
    outs, thetas = _tensors(out, "out"), _tensors(theta, "theta")
    costs = _tensors(cost, "cost") if cost is not None else None
    lam = _lam_arg(lam)
    if not thetas:
        _fc.check_projection_apply(outs, thetas, costs, lam)
        return out
    if thetas[0].device.type in _APPLY_DEVICES:
        torch.ops.prunopt.project_budget_apply_(outs, thetas, costs, lam)
        return out
    _fc.check_projection_apply(outs, thetas, costs, lam)
    _check_no_overlap(outs, "out")
    results = project_budget_apply_reference(thetas, costs, lam)
    with torch.no_grad():
        for o, r in zip(outs, results):
            o.copy_(r)
    return out


def _lam_arg(lam, op: str = "project_budget_apply_") -> float:
    lam = _real(lam, "lam", op)
    if not lam >= 0.0:
        raise ValueError(f"{op}: lam must be >= 0 (inf allowed), got {lam}")
    return lam


def _tensors(x, name: str) -> List[Tensor]:
    """A tensor or a list (tuple) of tensors as a list: TypeError naming ``name`` otherwise."""
    xs = [x] if isinstance(x, Tensor) else list(x) if isinstance(x, (list, tuple)) else None
    if xs is None or not all(isinstance(t, Tensor) for t in xs):
        raise TypeError(f"{name} must be a tensor or a list of tensors, got {type(x).__name__}")
    return xs


def _real(v, name: str, op: str) -> float:
    """``v`` (a Python real number) as a float: TypeError / ValueError naming it."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{op}: {name} must be a real number, got {type(v).__name__}")
    try:
        return float(v)
    except OverflowError:  # an int beyond the float range
        raise ValueError(f"{op}: {name} must be a float, got an integer beyond the float range") from None


def _bracket_ends(lo, hi, op: str = "project_budget_bracket"):
    lo, hi = _real(lo, "lo", op), _real(hi, "hi", op)
    if not (math.isfinite(lo) and lo >= 0.0):
        raise ValueError(f"{op}: lo must be finite and >= 0, got {lo}")
    if not hi >= lo:
        raise ValueError(f"{op}: hi must be >= lo (inf allowed), got lo={lo}, hi={hi}")
    return lo, hi


def _check_grad_writes(thetas: List[Tensor], name: str = "theta", op: str = "project_budget_",
                       grad_enabled: Optional[bool] = None) -> None:
    """RuntimeError, as ATen's in-place ops give, for a tensor that requires
    grad written with grad mode on (the projection is not differentiable, so a
    write into a graph would be ignored by its gradient). The compiled op's
    Autograd kernel checks the same (csrc/autograd/inplace_version.cpp).
    ``grad_enabled``: the grad mode of the caller (default: the current one)."""
    if not (torch.is_grad_enabled() if grad_enabled is None else grad_enabled):
        return
    for i, t in enumerate(thetas):
        if not t.requires_grad:
            continue
        if t.is_leaf:
            raise RuntimeError(f"{op}: {name}[{i}]: a leaf Variable that requires grad is being used in an in-place "
                               "operation.")
        if t._base is not None and t._base.is_leaf:
            raise RuntimeError(f"{op}: {name}[{i}]: a view of a leaf Variable that requires grad is being used in an "
                               "in-place operation.")
        raise RuntimeError(f"{op}: {name}[{i}] requires grad, but the op writes it in place and is not "
                           "differentiable: call it under torch.no_grad() or on a detached tensor")


def _element_offsets(t: Tensor) -> Tensor:
    """Offsets (in elements of ``t``'s dtype, from the start of its storage) of
    every element of ``t``; ``numel`` int64 values."""
    off = torch.full((), t.storage_offset(), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        off = off.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return off.reshape(-1)


def _has_internal_overlap(t: Tensor) -> bool:
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    reach = 0  # largest offset reachable with the dimensions of smaller stride
    for stride, size in dims:
        if stride <= reach:  # not provably free of overlap: count the distinct offsets
            return int(torch.unique(_element_offsets(t)).numel()) < t.numel()
        reach += stride * (size - 1)
    return False


def _check_no_overlap(thetas: List[Tensor], name: str = "theta") -> None:
    """ValueError if a tensor written in place overlaps itself or another one:
    the projection treats every element as a separate score, so aliased memory
    would be counted twice against the budget and written twice. ``name`` is
    the argument the tensors came in (``theta[i]``, or ``params[i]`` for
    :class:`prunopt.optim.BudgetProjection`)."""
    by_storage = {}
    for i, t in enumerate(thetas):
        if t.numel() == 0 or t.device.type == "meta":
            continue
        if _has_internal_overlap(t):
            raise ValueError(f"{name}[{i}] has elements sharing one memory location (e.g. an expand()-ed tensor); "
                             "clone() it before projecting in place")
        by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(i)
    for idx in by_storage.values():
        for a in range(len(idx)):
            for b in range(a + 1, len(idx)):
                i, j = idx[a], idx[b]
                ti, tj = thetas[i], thetas[j]
                lo_i, lo_j = ti.storage_offset(), tj.storage_offset()
                hi_i = lo_i + sum((n - 1) * st for n, st in zip(ti.shape, ti.stride()))
                hi_j = lo_j + sum((n - 1) * st for n, st in zip(tj.shape, tj.stride()))
                if hi_i < lo_j or hi_j < lo_i:
                    continue  # disjoint ranges of one storage
                if ti is tj or bool(torch.isin(_element_offsets(ti), _element_offsets(tj)).any()):
                    raise ValueError(f"{name}[{i}] and {name}[{j}] share memory (the same tensor twice or overlapping "
                                     "views): their elements would count twice against the budget; pass each "
                                     "tensor once (or clone() one)")

if extension_available():

    # (the real kernel's argument checks on the metadata: prunopt/ops/_fake_checks.py)
    @torch.library.register_fake("prunopt::project_budget")
    def _project_budget_fake(theta, cost, budget):
        _fc.check_projection(theta, cost, budget, "project_budget")
        return [torch.empty_like(t) for t in theta]

    @torch.library.register_fake("prunopt::project_budget_bracket")
    def _project_budget_bracket_fake(theta, cost, lo, hi):
        if not theta:
            raise ValueError("project_budget_bracket: theta must not be empty (a list of tensors)")
        _fc.check_projection(theta, cost, 0.0, "project_budget_bracket")
        _bracket_ends(lo, hi)
        n = torch.library.get_ctx().new_dynamic_size()
        return (theta[0].new_empty(5, dtype=torch.float64), theta[0].new_empty(n),
                theta[0].new_empty(n if cost is not None else 0))

    @torch.library.register_fake("prunopt::project_budget_apply_")
    def _project_budget_apply_fake(out, theta, cost, lam):
        _fc.check_projection_apply(out, theta, cost, lam)
        _fc.check_disjoint_writes([(f"out[{i}]", t) for i, t in enumerate(out)], "project_budget_apply_")
        return None

    @torch.library.register_fake("prunopt::project_budget_")
    def _project_budget_inplace_fake(theta, cost, budget):
        _fc.check_projection(theta, cost, budget, "project_budget_")
        _fc.check_disjoint_writes([(f"theta[{i}]", t) for i, t in enumerate(theta)], "project_budget_")
        return None

    # The projection is not differentiable (a step, not a layer): its Autograd
    # kernel runs the op below autograd, so the outputs never require grad (as the
    # fallback's, which computes on detached data) instead of carrying autograd's
    # "not implemented" node, whose backward only warns and leaves grad None.
    _PROJECTION_LIB = torch.library.Library("prunopt", "IMPL")

    def _project_budget_autograd(theta, cost, budget):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.prunopt.project_budget.default(theta, cost, budget)

    _PROJECTION_LIB.impl("project_budget", _project_budget_autograd, "Autograd")
