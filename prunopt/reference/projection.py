"""Reference budget projection (ProM supplement A.2).

Solves, for scores ``t``, positive costs ``c`` and a budget ``S >= 0``::

    theta* = argmin ||theta - t||^2  s.t.  0 <= theta_i <= 1,  sum_i c_i theta_i <= S
           = clamp(t - lam* c, 0, 1),   lam* = max(0, lam1),   phi(lam1) = 0       (eq. 15-17)
    phi(lam) = sum_i c_i clamp(t_i - lam c_i, 0, 1) - S                             (eq. 14)

Two independent solvers live here:

* :func:`project_budget_reference`: bisection on ``phi`` with, at every step, the
  exact root of the linear piece that contains the midpoint; it stops as soon as
  that root lies on the same piece (the free set is stable). Readable, float64,
  one host synchronisation per iteration. It is the fallback when the extension
  is missing.
* :func:`project_budget_sort`: sorts all ``2n`` breakpoints, finds the piece that
  holds the root by bisection over them (``phi`` evaluated directly at each) and
  solves that linear piece; the "exact" solution the kernels are tested against.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from prunopt.validation import validate_projection_args

TensorOrList = Union[Tensor, Sequence[Tensor]]

__all__ = ["project_budget_reference", "project_budget_sort", "projection_phi", "project_budget_bracket_reference",
           "project_budget_apply_reference"]


def _flatten(thetas: List[Tensor], costs: Optional[List[Tensor]]) -> Tuple[Tensor, Tensor]:
    device = thetas[0].device if thetas else torch.device("cpu")
    t = torch.cat([x.detach().reshape(-1).double() for x in thetas]) if thetas else torch.zeros(0, dtype=torch.float64)
    if costs is None:
        c = torch.ones_like(t)
    else:
        c = torch.cat([x.detach().reshape(-1).double() for x in costs])
    if not bool(torch.isfinite(t).all()):
        raise ValueError("project_budget: theta contains a non-finite value")
    if c.numel() and not bool(((c > 0) & torch.isfinite(c)).all()):
        raise ValueError("project_budget: cost must be positive and finite everywhere")
    return t.to(device), c.to(device)


def projection_phi(t: Tensor, c: Tensor, lam: float, budget: float) -> Tensor:
    """phi(lam) = sum_i c_i clamp(t_i - lam c_i, 0, 1) - S (supplement eq. 14)."""
    return (c * (t - lam * c).clamp(0, 1)).sum() - budget


def _piece(t: Tensor, c: Tensor, lam: float) -> Tuple[Tensor, Tensor]:
    v = t - lam * c
    upper = v >= 1
    free = (v > 0) & (v < 1)
    return upper, free


def _piece_root(t: Tensor, c: Tensor, upper: Tensor, free: Tensor, budget: float) -> float:
    # phi is linear on a piece: sum_U c + sum_F c t - lam sum_F c^2 - S = 0
    denom = (c[free] ** 2).sum().item()
    if denom <= 0:
        return math.nan
    return ((c[upper].sum() + (c[free] * t[free]).sum()).item() - budget) / denom


def _solve_lambda_bisection(t: Tensor, c: Tensor, budget: float) -> float:
    if t.numel() == 0 or projection_phi(t, c, 0.0, budget).item() <= 0:
        return 0.0  # slack budget
    if budget == 0:
        return math.inf  # every score goes to zero
    lo, hi = 0.0, (t / c).max().item()  # phi(lo) > 0 >= phi(hi) = -S
    while True:
        lam = 0.5 * (lo + hi)
        if not (lo < lam < hi):  # the bracket is down to adjacent doubles
            return hi
        upper, free = _piece(t, c, lam)
        root = _piece_root(t, c, upper, free, budget)
        if lo <= root <= hi:
            upper_r, free_r = _piece(t, c, root)
            if torch.equal(upper, upper_r) and torch.equal(free, free_r):
                return root  # the free set is stable: exact root
        if projection_phi(t, c, lam, budget).item() > 0:
            lo = lam
        else:
            hi = lam


def _solve_lambda_sort(t: Tensor, c: Tensor, budget: float) -> float:
    if t.numel() == 0 or projection_phi(t, c, 0.0, budget).item() <= 0:
        return 0.0
    if budget == 0:
        return math.inf
    # The breakpoints: crossing (t-1)/c upwards moves i from U to F, crossing
    # t/c moves it from F to L; phi is linear between two of them and does not
    # increase. The piece holding the root is found by bisecting over the
    # sorted breakpoints with phi evaluated directly at each (a sum of terms in
    # [0, c_i], so no cancellation): running sums of the per-breakpoint changes
    # cancel catastrophically when the scores span many orders of magnitude
    # (1e36 next to 3 returned a point over the budget).
    keys = torch.unique(torch.cat([(t - 1) / c, t / c]))  # sorted
    keys = keys[keys > 0]
    lo_i, hi_i = -1, keys.numel() - 1  # phi(keys[hi_i]) <= 0: the largest key is max(t/c)
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        if projection_phi(t, c, keys[mid].item(), budget).item() > 0:
            lo_i = mid
        else:
            hi_i = mid
    lo = keys[lo_i].item() if lo_i >= 0 else 0.0
    hi = keys[hi_i].item()
    if not hi > lo:
        return hi
    # phi(lo) > 0 >= phi(hi) and phi is linear on (lo, hi): the root of that
    # piece, from sums taken directly over its sets
    upper, free = _piece(t, c, 0.5 * (lo + hi))
    lam = _piece_root(t, c, upper, free, budget)
    if math.isnan(lam):  # no free element: the breakpoints are adjacent in floating point
        return hi
    return min(max(lam, lo), hi)


def _finish(thetas, costs, lam, single):
    outs = []
    for i, x in enumerate(thetas):
        cx = 1.0 if costs is None else costs[i].double()
        y = (x.detach().double() - lam * cx).clamp(0, 1) if math.isfinite(lam) else torch.zeros_like(x, dtype=torch.float64)
        outs.append(y.to(x.dtype))
    return outs[0] if single else outs


def project_budget_reference(theta: TensorOrList, budget, cost: Optional[TensorOrList] = None):
    """Exact projection onto ``{0 <= theta <= 1, sum(cost * theta) <= budget}``.

    Bisection with a linear solve on the free set (ProM supplement A.2). Accepts a
    tensor or a list projected jointly under one budget; returns the same kind.
    Computes in float64 and returns the input dtype.
    """
    thetas, costs, budget, single = validate_projection_args(theta, budget, cost)
    t, c = _flatten(thetas, costs)
    return _finish(thetas, costs, _solve_lambda_bisection(t, c, budget), single)


def project_budget_sort(theta: TensorOrList, budget, cost: Optional[TensorOrList] = None):
    """Exact projection by sorting all breakpoints (the test oracle; float64)."""
    thetas, costs, budget, single = validate_projection_args(theta, budget, cost)
    t, c = _flatten(thetas, costs)
    return _finish(thetas, costs, _solve_lambda_sort(t, c, budget), single)


def project_budget_bracket_reference(thetas: List[Tensor], costs: Optional[List[Tensor]], lo: float, hi: float):
    r"""The bracket pass of the budget projection for ``0 <= lo <= hi``
    (``hi`` may be ``inf``), in float64 (the oracle of the
    ``project_budget_bracket`` op). An element's breakpoints are
    :math:`k_2 = (t - 1)/c` and :math:`k_1 = t/c` (eq. 14: it is 1 for
    :math:`\lambda \le k_2`, free for :math:`k_2 \le \lambda \le k_1`, 0 after).
    The elements with a breakpoint strictly inside ``(lo, hi)`` are *kept*;
    every other element has one class on all of ``[lo, hi]``: U
    (:math:`k_2 \ge hi`), F (:math:`k_2 \le lo,\ k_1 \ge hi`) or L, so
    there :math:`\phi(\lambda) = \sum_U c + \sum_F c t - \lambda \sum_F c^2
    + \sum_{kept} c\,\mathrm{clamp}(t - \lambda c, 0, 1) - S`.

    Returns ``(summary, theta_kept, cost_kept)``: ``summary`` float64
    ``[sum_U c, sum_F c t, sum_F c^2, bad_theta, bad_cost]`` (a flag is 1 when
    a score is not finite, or a cost not positive and finite; then the sums
    are 0 and nothing is kept), the kept elements' scores and costs in index
    order (dtype of ``thetas``; ``cost_kept`` is empty without costs)."""
    dev = thetas[0].device
    dtype = thetas[0].dtype
    t_raw = torch.cat([x.detach().reshape(-1) for x in thetas])
    t = t_raw.double()
    c_raw = torch.cat([x.detach().reshape(-1) for x in costs]) if costs is not None else None
    c = c_raw.double() if c_raw is not None else torch.ones_like(t)
    summary = torch.zeros(5, dtype=torch.float64, device=dev)
    empty = torch.empty(0, dtype=dtype, device=dev)
    bad_t = not bool(torch.isfinite(t).all())
    bad_c = c_raw is not None and not bool((torch.isfinite(c) & (c > 0)).all())
    if bad_t or bad_c:
        summary[3], summary[4] = float(bad_t), float(bad_c)
        return summary, empty, empty
    k1, k2 = t / c, (t - 1.0) / c
    kept = ((k1 > lo) & (k1 < hi)) | ((k2 > lo) & (k2 < hi))
    up = ~kept & (k2 >= hi)
    free = ~kept & (k2 <= lo) & (k1 >= hi)
    summary[0] = c[up].sum()
    summary[1] = (c * t)[free].sum()
    summary[2] = (c * c)[free].sum()
    return summary, t_raw[kept], (c_raw[kept] if c_raw is not None else empty)


def project_budget_apply_reference(thetas: List[Tensor], costs: Optional[List[Tensor]], lam: float) -> List[Tensor]:
    r"""The projection for a given multiplier (eq. 15):
    :math:`\mathrm{clamp}(\theta - \lambda c, 0, 1)` computed in float64 and
    rounded once to ``theta``'s dtype (the oracle of the
    ``project_budget_apply_`` op; ``lam = inf`` gives zeros)."""
    outs = []
    for i, t in enumerate(thetas):
        x = t.detach().double()
        if math.isinf(lam):
            x = torch.zeros_like(x)
        else:
            x = x - lam * (costs[i].detach().double() if costs is not None else 1.0)
        outs.append(x.clamp(0.0, 1.0).to(t.dtype))
    return outs
