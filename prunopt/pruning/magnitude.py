"""A posteriori magnitude pruning and the prunAdag paper's robustness measures
(section 3, eq. 3.1; Porcelli et al.)."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from prunopt.pruning import _dist
from prunopt.validation import check_list

__all__ = ["magnitude_prune_", "magnitude_masks", "rho_omega", "sparsity"]


def _as_list(params) -> List[Tensor]:
    if isinstance(params, Tensor):
        return [params]
    if isinstance(params, (list, tuple)) and all(isinstance(p, Tensor) for p in params):
        return list(params)
    raise TypeError(f"params must be a Tensor or a list/tuple of Tensors, got {type(params).__name__}")


def magnitude_masks(params, sigma: Optional[float] = None, delta: Optional[float] = None) -> List[Tensor]:
    """Keep-masks (True = kept) of global magnitude pruning over all ``params``.

    Exactly one of:
      * ``sigma`` in [0, 1]: remove the ``round(sigma * n)`` elements of smallest
        ``|x|`` (ties broken by position, so the count is exact);
      * ``delta >= 0``: remove every element with ``|x| < delta``.

    DTensor ``params`` (FSDP2 shards) give DTensor masks of the same layout:
    the ``sigma`` selection is exact over the global tensors, with ties broken
    by global position (the earlier entry is removed first, as here), so the
    masks equal the one-process masks on any number of ranks; no parameter is
    gathered.
    """
    ps = _as_list(params)
    if (sigma is None) == (delta is None):
        raise ValueError("give exactly one of sigma (a fraction) or delta (a threshold)")
    if sigma is not None:
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0.0 <= sigma <= 1.0:
            raise ValueError(f"sigma must be a fraction in [0, 1], got {sigma}")
        n = sum(p.numel() for p in ps)
        count = int(round(sigma * n))
        if any(_dist.is_dtensor(p) for p in ps):
            removed = _dist.top_k_masks([_dist.like(_dist.local(p).detach().abs(), p) for p in ps], count,
                                        largest=False)
            return [_dist.like(~_dist.local(r), r) for r in removed]
        flat = torch.cat([p.detach().reshape(-1).abs() for p in ps]) if ps else torch.zeros(0)
        keep = torch.ones(n, dtype=torch.bool, device=flat.device)
        if count > 0:
            order = torch.sort(flat, stable=True).indices
            keep[order[:count]] = False
        return [m.view_as(p) for m, p in zip(keep.split([p.numel() for p in ps]), ps)]
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not delta >= 0 or math.isinf(delta):
        raise ValueError(f"delta must be a finite number >= 0, got {delta}")
    return [p.detach().abs() >= delta for p in ps]


@torch.no_grad()
def magnitude_prune_(params, sigma: Optional[float] = None, delta: Optional[float] = None) -> List[Tensor]:
    """Zeroes the pruned elements in place (see :func:`magnitude_masks`) and
    returns the keep-masks."""
    ps = _as_list(params)
    masks = magnitude_masks(ps, sigma=sigma, delta=delta)
    for p, m in zip(ps, masks):
        _dist.local(p).mul_(_dist.local(m))  # a shard by its block of the mask under FSDP2
    return masks


def sparsity(params) -> float:
    """Fraction of exactly-zero elements over all ``params`` (over the global
    tensors for DTensor shards)."""
    ps = _as_list(params)
    n = sum(p.numel() for p in ps)
    return _dist.global_count(ps, lambda t: t == 0) / n if n else 0.0


def rho_omega(f: Callable[[Sequence[Tensor]], Tensor], x: Sequence[Tensor], x_pruned: Sequence[Tensor]) -> Tuple[float, float]:
    r"""The paper's measures (eq. 3.1) of how much pruning perturbs a solution:

    .. math:: \rho = \|\nabla f(\bar x)\|, \qquad \omega = \sqrt{|f(\bar x) - f(x)|}

    ``f`` maps a list of tensors to a scalar tensor; gradients are taken with
    autograd at the pruned point ``x_pruned`` (in float64 when given float64).
    """
    x, x_pruned = check_list(x, "x", torch.Tensor, "tensors"), check_list(x_pruned, "x_pruned", torch.Tensor, "tensors")
    for name, v in (("x", x), ("x_pruned", x_pruned)):
        for i, t in enumerate(v):
            if not t.is_floating_point():
                raise TypeError(f"{name}[{i}] must be a floating-point tensor, got {t.dtype}")
    if len(x) != len(x_pruned) or not len(x):
        raise ValueError(f"x and x_pruned must be non-empty lists of the same length, got {len(x)} and "
                         f"{len(x_pruned)} tensors")
    xs = [t.detach().clone().requires_grad_(True) for t in x_pruned]
    with torch.enable_grad():
        fp = f(xs)
        grads = torch.autograd.grad(fp, xs, allow_unused=True)
    rho = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    with torch.no_grad():
        f0 = float(f([t.detach() for t in x]))
    return rho, math.sqrt(abs(float(fp.detach()) - f0))
