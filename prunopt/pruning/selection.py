"""Turning scores into masks: global (A.39-A.40) and layerwise selection, and
Erdős–Rényi-kernel layer densities (A.76).

**Tie rule.** Scores are ranked by a *stable* descending sort of the scores
concatenated in the order of the mapping (tensor after tensor, each flattened
in row-major order).  Among equal scores the entry that comes first in this
order is kept.  Hence exactly ``k`` entries are kept, deterministically, for
any scores (including all-equal ones).  ``-inf`` is allowed (such an entry is
kept only when ``k`` exceeds the number of finite scores); NaN is rejected.

**Sharded scores.**  Scores that are DTensors (FSDP2: each rank holds a block
of rows) give DTensor masks of the same layout, selected exactly over the
global tensors with the same tie rule: the position of an entry is its global
position, so the masks equal the one-process masks of the full tensors on any
number of ranks (``prunopt.pruning._dist``; no score tensor is gathered).
"""
from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from typing import Dict, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from prunopt.pruning import _dist
from prunopt.validation import check_str_list

__all__ = [
    "check_sparsity",
    "kept_count",
    "global_masks",
    "layerwise_masks",
    "erk_densities",
    "erk_counts",
]


def check_sparsity(p, name: str = "sparsity") -> float:
    """Validate a pruning rate ``p`` in ``[0, 1]`` (a real number, not a bool)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(p).__name__}")
    try:
        p = float(p)
    except OverflowError:  # an int beyond the float range
        raise ValueError(f"{name} must be in [0, 1], got an integer beyond the float range") from None
    if not (0.0 <= p <= 1.0) or math.isnan(p):
        raise ValueError(f"{name} must be in [0, 1], got {p}")
    return p


def _check_layer_keys(given: Mapping, expected, name: str, what: str) -> None:
    """``ValueError`` naming ``name`` unless ``given`` has exactly the layer names of ``expected``."""
    unknown = [k for k in given if k not in expected]
    missing = [k for k in expected if k not in given]
    if unknown:
        raise ValueError(f"{name}: unknown layer name(s) {unknown}")
    if missing:
        raise ValueError(f"{name}: no {what} for layer(s) {missing}")


def kept_count(sparsity: float, d: int) -> int:
    """``k = floor((1 - p) * d)`` (eq. A.39), clamped to ``[0, d]``.

    The product is computed exactly from the float ``p`` (integer arithmetic),
    and a value within ``d * 2**-50`` below an integer (float noise: a few ulps
    of ``p``, e.g. ``1 - 0.9`` is ``0.09999999999999998``) counts as that
    integer, so ``p = 0.9, d = 10`` gives 1 and not 0, while e.g.
    ``p = 0.5, d = 2_000_000_001`` gives exactly 1_000_000_000 (the guard stays
    below one unit for ``d < 2**50``, far beyond any tensor).

    Raises:
        TypeError / ValueError: ``sparsity`` not a real number in [0, 1], or
            ``d`` not an int >= 0.
    """
    p = check_sparsity(sparsity)
    if isinstance(d, bool) or not isinstance(d, numbers.Integral):
        raise TypeError(f"d must be an int, got {type(d).__name__}")
    d = int(d)
    if d < 0:
        raise ValueError(f"d must be >= 0, got {d}")
    num, den = p.as_integer_ratio()  # p = num / den exactly, den a power of two
    # floor(((den - num) d + d den 2^-50) / den), all in integers
    k = ((den - num) * d * (1 << 50) + d * den) // (den << 50)
    return max(0, min(d, k))


def _check_scores(scores: Mapping[str, Tensor]) -> bool:
    """Validate ``scores``; True when any is a DTensor (the sharded path)."""
    if not isinstance(scores, Mapping) or not scores:
        raise ValueError("scores must be a non-empty mapping of tensor names to score tensors")
    for n, s in scores.items():
        if not isinstance(s, Tensor):
            raise TypeError(f"scores[{n!r}] must be a tensor, got {type(s).__name__}")
        if not s.is_floating_point():
            raise TypeError(f"scores[{n!r}] must be floating point, got {s.dtype}")
    sharded = any(_dist.is_dtensor(s) for s in scores.values())
    group = _dist.shard_group(list(scores.values())) if sharded else None
    # a NaN in one rank's shard is an error on every rank (none is left waiting in a collective)
    nan = _dist.any_rank_each([bool(torch.isnan(_dist.local(s)).any()) for s in scores.values()], group)
    for n, bad in zip(scores, nan):
        if bad:
            raise ValueError(f"scores[{n!r}] contains NaN")
    return sharded


def _top_k_mask(flat: Tensor, k: int) -> Tensor:
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if k > 0:
        order = torch.sort(flat.double(), descending=True, stable=True).indices
        keep[order[:k]] = True
    return keep


def global_masks(scores: Mapping[str, Tensor], sparsity: float) -> "OrderedDict[str, Tensor]":
    """Global selection (eqs. A.39-A.40): with ``d`` the total number of entries,
    keep the ``k = floor((1 - p) d)`` largest scores over all tensors together,
    ``mu_j = 1`` iff ``S_j`` is among them (ties: module docstring).

    Returns boolean masks of the scores' shapes, keyed like ``scores``
    (DTensors laid out as the scores for DTensor scores: module docstring)."""
    p = check_sparsity(sparsity)
    if _check_scores(scores):
        k = kept_count(p, sum(s.numel() for s in scores.values()))
        return OrderedDict(zip(scores, _dist.top_k_masks(list(scores.values()), k)))
    flat = torch.cat([s.detach().reshape(-1).to("cpu", torch.float64) for s in scores.values()])
    keep = _top_k_mask(flat, kept_count(p, flat.numel()))
    out, i = OrderedDict(), 0
    for n, s in scores.items():
        out[n] = keep[i : i + s.numel()].reshape(s.shape).to(s.device)
        i += s.numel()
    return out


def layerwise_masks(
    scores: Mapping[str, Tensor], sparsity: Union[float, Mapping[str, float]]
) -> "OrderedDict[str, Tensor]":
    """Layerwise selection: layer ``l`` keeps its ``floor((1 - p_l) d_l)``
    largest scores (A.39 per layer; paper App. F.1, used by DST).  ``sparsity``
    is one rate for all layers or a mapping tensor name -> ``p_l`` covering every
    scored tensor."""
    sharded = _check_scores(scores)
    if isinstance(sparsity, Mapping):
        _check_layer_keys(sparsity, scores, "sparsity", "rate")
        rates = {n: check_sparsity(sparsity[n], f"sparsity[{n!r}]") for n in scores}
    else:
        p = check_sparsity(sparsity)
        rates = {n: p for n in scores}
    out = OrderedDict()
    for n, s in scores.items():
        if sharded:
            out[n] = _dist.top_k_masks([s], kept_count(rates[n], s.numel()))[0]
            continue
        flat = s.detach().reshape(-1).to("cpu", torch.float64)
        out[n] = _top_k_mask(flat, kept_count(rates[n], flat.numel())).reshape(s.shape).to(s.device)
    return out


def _check_shape(shape, name: str) -> tuple:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, torch.Size)):
        raise TypeError(f"shapes[{name!r}] must be a sequence of ints, got {type(shape).__name__}")
    dims = tuple(shape)
    if not dims or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0 for x in dims):
        raise ValueError(f"shapes[{name!r}] must be a non-empty sequence of ints >= 0, got {shape!r}")
    return tuple(int(x) for x in dims)


def _check_numels(shapes: Mapping[str, Sequence[int]], numels: Optional[Mapping[str, int]]) -> Dict[str, int]:
    """Entries of the masked tensor of every layer: ``numels[name]`` or ``prod(shape)``."""
    n = {k: math.prod(_check_shape(s, k)) for k, s in shapes.items()}
    if numels is None:
        return n
    if not isinstance(numels, Mapping):
        raise TypeError(f"numels must be a mapping of layer names to ints, got {type(numels).__name__}")
    _check_layer_keys(numels, shapes, "numels", "entry count")
    for k in shapes:
        v = numels[k]
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"numels[{k!r}] must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"numels[{k!r}] must be >= 0, got {v}")
    return {k: int(numels[k]) for k in shapes}


def erk_densities(
    shapes: Mapping[str, Sequence[int]],
    density: float,
    dense: Optional[Sequence[str]] = None,
    numels: Optional[Mapping[str, int]] = None,
) -> "OrderedDict[str, float]":
    """Erdős–Rényi-kernel layer densities (eq. A.76, RigL [17]).

    Layer ``l`` with weight shape ``(c_out, c_in, K, K)`` (or ``(c_out, c_in)``)
    gets density ``eps * sum(shape) / prod(shape)``, i.e. sparsity
    ``1 - eps (c_out + c_in + 2K) / (c_out c_in K^2)``, with the global ``eps``
    chosen so that ``sum_l density_l n_l = density * sum_l n_l``.  A.76 as printed
    has ``K`` instead of ``K^2`` in the denominator; we follow RigL's definition
    (sum of dimensions over their product), which A.76 cites.  Layers whose
    density would exceed 1 are made dense and ``eps`` is re-solved for the rest
    (RigL's procedure); names in ``dense`` are dense from the start, and so are
    layers with no entries (nothing to prune).

    ``numels`` (default ``prod(shape)``) gives the number of entries of the
    tensor that is actually masked, when it differs from the shape the ERK
    score is taken of: an FB layer with a dictionary of ``N != kh kw`` elements
    has the ERK score of its spatial weight ``(C_out, C_in, kh, kw)`` but masks
    ``C_out C_in N`` coefficients.  ``n_l`` above is then ``numels[l]``, so the
    budget ``density * sum_l n_l`` refers to the masked tensors."""
    d = check_sparsity(density, "density")
    if not isinstance(shapes, Mapping) or not shapes:
        raise ValueError("shapes must be a non-empty mapping of tensor names to shapes")
    dense = set(check_str_list(dense, "dense") or [])
    unknown = dense - set(shapes)
    if unknown:
        raise ValueError(f"dense: unknown layer name(s) {sorted(unknown)}")
    n = _check_numels(shapes, numels)
    # an empty layer has nothing to prune: dense (it takes no budget)
    raw = {}
    for k, s in shapes.items():
        spatial = math.prod(int(x) for x in s)
        raw[k] = sum(int(x) for x in s) / spatial if n[k] and spatial else 0.0
    total = sum(n.values())
    budget = d * total
    is_dense = {k: (k in dense or n[k] == 0) for k in shapes}
    if sum(n[k] for k in shapes if is_dense[k]) > budget + 1e-9:
        raise ValueError(f"density {d} is too small for the layers required to stay dense")
    while True:
        rest_budget = budget - sum(n[k] for k in shapes if is_dense[k])
        denom = sum(raw[k] * n[k] for k in shapes if not is_dense[k])
        eps = rest_budget / denom if denom > 0 else 0.0
        over = [k for k in shapes if not is_dense[k] and eps * raw[k] > 1.0]
        if not over:
            break
        for k in over:
            is_dense[k] = True
    return OrderedDict((k, 1.0 if is_dense[k] else eps * raw[k]) for k in shapes)


def erk_counts(
    shapes: Mapping[str, Sequence[int]],
    density: float,
    dense: Optional[Sequence[str]] = None,
    numels: Optional[Mapping[str, int]] = None,
) -> "OrderedDict[str, int]":
    """Integer kept counts per layer from :func:`erk_densities`, summing exactly
    to ``floor(density * sum_l n_l)`` (largest-remainder rounding, never above
    ``n_l``; ties to the earlier layer).  ``n_l`` is ``numels[l]`` when given
    (the entries of the masked tensor), else ``prod(shapes[l])``."""
    dens = erk_densities(shapes, density, dense, numels)
    n = _check_numels(shapes, numels)
    total = sum(n.values())
    target = kept_count(1.0 - float(density), total)
    exact = {k: dens[k] * n[k] for k in shapes}
    counts = {k: min(n[k], math.floor(exact[k] + 1e-9)) for k in shapes}
    short = target - sum(counts.values())
    order = sorted(shapes, key=lambda k: -(exact[k] - math.floor(exact[k] + 1e-9)))
    i = 0
    while short > 0 and i < 10 * len(order) + total:
        k = order[i % len(order)]
        if counts[k] < n[k]:
            counts[k] += 1
            short -= 1
        i += 1
    while short < 0:  # only through the 1e-9 guard
        k = max(counts, key=lambda j: counts[j])
        counts[k] -= 1
        short += 1
    return OrderedDict((k, counts[k]) for k in shapes)
