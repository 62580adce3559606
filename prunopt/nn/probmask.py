"""Probabilistic masks: ProbMask (weights) and ProM (inputs), SPEC.md §1.

A score ``theta`` in [0, 1] is the probability that a mask entry is 1. During
training the mask is a relaxed Bernoulli (Gumbel-sigmoid) sample

.. math::
    y = \\sigma\\!\\left(\\frac{\\operatorname{logit}(\\theta) + \\log u - \\log(1-u)}{\\tau}\\right),
    \\qquad u \\sim U(0, 1),

optionally hard (``1[y > 0.5]``) with a straight-through gradient
(``hard - y.detach() + y``); ``tau`` is annealed. At evaluation the mask is
deterministic: ``theta > 0.5``, or exactly the ``k`` largest scores. The scores
are kept in the budget by :class:`prunopt.optim.BudgetProjection`.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, List, Optional, Sequence, Tuple, Type

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

__all__ = [
    "gumbel_sigmoid",
    "ProbMask",
    "ProbMaskInput",
    "apply_probmask",
    "probmask_modules",
    "probmask_scores",
    "set_temperature",
    "finalize_probmask",
    "remove_probmask",
    "probmask_density",
]

_EPS = 1e-6


def _real(value, name: str) -> float:
    """``value`` as a float: ``TypeError`` naming ``name`` unless a real number
    (int, float, numpy scalar, one-element tensor; not a bool)."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def gumbel_sigmoid(theta: Tensor, tau: float, hard: bool = False, generator: Optional[torch.Generator] = None) -> Tensor:
    r"""Relaxed Bernoulli sample with probabilities ``theta`` at temperature ``tau``.

    ``y = sigmoid((logit(theta) + log u - log(1 - u)) / tau)``; with ``hard=True``
    the forward value is ``1[y > 0.5]`` and the gradient is that of ``y``
    (straight-through). ``theta`` is clamped to ``[1e-6, 1 - 1e-6]`` for the logit;
    a NaN score gives a NaN sample, as ``torch.sigmoid`` does (no host sync to check).
    """
    if not isinstance(theta, Tensor):
        raise TypeError(f"theta must be a tensor, got {type(theta).__name__}")
    tau = _real(tau, "tau")
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite number > 0, got {tau}")
    p = theta.clamp(_EPS, 1 - _EPS)
    u = torch.rand(p.shape, dtype=p.dtype, device=p.device, generator=generator).clamp(_EPS, 1 - _EPS)
    y = torch.sigmoid((torch.log(p) - torch.log1p(-p) + torch.log(u) - torch.log1p(-u)) / tau)
    if hard:
        return (y > 0.5).to(y.dtype) - y.detach() + y
    return y


class ProbMask(nn.Module):
    r"""A parametrization ``W -> W * m`` with ``m`` a probabilistic mask of the
    weight's shape (ProbMask; SPEC.md §1).

    Register it with :func:`apply_probmask` (or
    ``torch.nn.utils.parametrize.register_parametrization(module, "weight", ProbMask(shape))``).
    In training mode ``m`` is a Gumbel-sigmoid sample of the scores; in eval
    mode it is deterministic: the fixed binary mask if one was set with
    :meth:`fix` (used in training mode as well), else ``scores > 0.5``.

    The state dict holds the scores and the fixed mask (an empty ``fixed``
    buffer when none is set); it loads into any ProbMask of the same shape,
    fixed or not, and the loaded mask is then fixed exactly when the saved one was.

    Args:
        shape: the shape of the masked tensor.
        init: initial score (probability) of every entry, in [0, 1].
        tau: initial temperature.
        hard: straight-through hard samples instead of soft ones.
    """

    def __init__(self, shape: Sequence[int], init: float = 1.0, tau: float = 1.0, hard: bool = False,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        init, tau = _real(init, "init"), _real(tau, "tau")
        if not (0.0 <= init <= 1.0):
            raise ValueError(f"init must be in [0, 1], got {init}")
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"tau must be a finite number > 0, got {tau}")
        self.scores = nn.Parameter(torch.full(tuple(shape), float(init), dtype=dtype, device=device))
        self.tau = float(tau)
        self.hard = bool(hard)
        self.register_buffer("fixed", torch.zeros(0, dtype=torch.bool, device=device), persistent=True)

    def mask(self) -> Tensor:
        if self.fixed.numel():
            return self.fixed.to(self.scores.dtype)
        if self.training:
            return gumbel_sigmoid(self.scores, self.tau, self.hard)
        return (self.scores > 0.5).to(self.scores.dtype)

    def forward(self, weight: Tensor) -> Tensor:
        return weight * self.mask()

    def fix(self, mask: Tensor) -> None:
        """Freezes the mask to a binary tensor (used by :func:`finalize_probmask`)."""
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a tensor, got {type(mask).__name__}")
        if mask.shape != self.scores.shape:
            raise ValueError(f"mask must have shape {tuple(self.scores.shape)}, got {tuple(mask.shape)}")
        self.fixed = mask.detach().to(device=self.scores.device, dtype=torch.bool).clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # ``fixed`` is empty until :meth:`fix` and has the scores' shape after it, so
        # a state dict of a finalized mask must load into a fresh one and back: take
        # the loaded buffer's shape when it is one of the two valid ones (any other
        # shape is left to the usual size-mismatch error).
        loaded = state_dict.get(prefix + "fixed")
        if isinstance(loaded, Tensor) and loaded.shape != self.fixed.shape:
            shape = tuple(self.scores.shape)
            scores = state_dict.get(prefix + "scores")
            scores_ok = not isinstance(scores, Tensor) or tuple(scores.shape) == shape
            if scores_ok and tuple(loaded.shape) in ((0,), shape):
                self.fixed = torch.zeros(loaded.shape, dtype=torch.bool, device=self.fixed.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def deterministic_mask(self, k: Optional[int] = None) -> Tensor:
        """``scores > 0.5``, or the ``k`` largest scores (exactly ``k`` ones;
        ties go to the lower flat index)."""
        if k is None:
            return self.scores.detach() > 0.5
        return _topk_mask([self.scores.detach()], k)[0]

    def extra_repr(self) -> str:
        return f"shape={tuple(self.scores.shape)}, tau={self.tau}, hard={self.hard}, fixed={bool(self.fixed.numel())}"


class ProbMaskInput(nn.Module):
    r"""ProM: a learned probabilistic mask on an input tensor (e.g. an MRI
    k-space sampling pattern), ``x -> x * m`` with ``m`` broadcast over the
    leading dimensions. Training samples the Gumbel-sigmoid mask; evaluation
    uses the fixed mask or ``scores > 0.5``.

    Args:
        shape: the mask shape (the trailing dimensions of the input).
        init, tau, hard: as in :class:`ProbMask`.
    """

    def __init__(self, shape: Sequence[int], init: float = 0.5, tau: float = 1.0, hard: bool = True):
        super().__init__()
        self.mask_module = ProbMask(shape, init=init, tau=tau, hard=hard)

    @property
    def scores(self) -> nn.Parameter:
        return self.mask_module.scores

    def forward(self, x: Tensor) -> Tensor:
        shape = tuple(self.mask_module.scores.shape)
        if tuple(x.shape[x.dim() - len(shape):]) != shape:
            raise ValueError(f"input's trailing dimensions must be {shape}, got {tuple(x.shape)}")
        return x * self.mask_module.mask()


def _topk_mask(scores: List[Tensor], k: int) -> List[Tensor]:
    """Exactly ``k`` ones over all tensors jointly: the ``k`` largest scores,
    ties broken towards the lower index of the concatenation."""
    flat = torch.cat([s.detach().reshape(-1).double() for s in scores])
    if not (0 <= k <= flat.numel()):
        raise ValueError(f"k must be in [0, {flat.numel()}], got {k}")
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if k:
        # stable descending sort: equal scores keep their index order
        order = torch.sort(flat, descending=True, stable=True).indices[:k]
        keep[order] = True
    out, start = [], 0
    for s in scores:
        out.append(keep[start:start + s.numel()].reshape(s.shape))
        start += s.numel()
    return out


def apply_probmask(model: nn.Module, layer_types: Tuple[Type[nn.Module], ...] = (nn.Linear, nn.Conv2d),
                   init: float = 1.0, tau: float = 1.0, hard: bool = False,
                   exclude: Iterable[str] = ()) -> List[Tuple[str, ProbMask]]:
    """Wraps the ``weight`` of every module of ``layer_types`` (except the
    qualified names in ``exclude``) with a :class:`ProbMask` parametrization.
    Returns ``[(qualified_name, mask), ...]``."""
    if isinstance(layer_types, type):
        layer_types = (layer_types,)
    if not isinstance(layer_types, tuple) or not layer_types or not all(isinstance(t, type) for t in layer_types):
        raise TypeError(f"layer_types must be a module class or a non-empty tuple of them, got {layer_types!r}")
    exclude = set(exclude)
    known = {name for name, _ in model.named_modules()}
    unknown = exclude - known
    if unknown:
        raise ValueError(f"exclude names modules the model does not have: {sorted(unknown)}")
    out = []
    for name, module in list(model.named_modules()):
        if name in exclude or not isinstance(module, layer_types) or parametrize.is_parametrized(module, "weight"):
            continue
        w = module.weight
        pm = ProbMask(w.shape, init=init, tau=tau, hard=hard, dtype=w.dtype, device=w.device)
        parametrize.register_parametrization(module, "weight", pm)
        out.append((name, pm))
    if not out:
        raise ValueError("the model has no layer of the requested types to mask")
    return out


def probmask_modules(model: nn.Module) -> List[Tuple[str, ProbMask]]:
    """``[(qualified module name, ProbMask), ...]`` of a model."""
    out = []
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module, "weight"):
            for p in module.parametrizations["weight"]:
                if isinstance(p, ProbMask):
                    out.append((name, p))
    return out


def probmask_scores(model: nn.Module) -> List[nn.Parameter]:
    """The score parameters of every ProbMask in the model (to optimize and to
    keep in budget with :class:`prunopt.optim.BudgetProjection`)."""
    return [pm.scores for _, pm in probmask_modules(model)]


def set_temperature(model: nn.Module, tau: float) -> None:
    """Sets the Gumbel-sigmoid temperature of every mask in the model."""
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite number > 0, got {tau}")
    for _, pm in probmask_modules(model):
        pm.tau = float(tau)


def finalize_probmask(model: nn.Module, density: float) -> int:
    """Fixes every mask to the deterministic global top-``k`` scores with
    ``k = round(density * D)`` (D = number of masked weights): exactly the
    budgeted number of ones. Returns ``k``."""
    density = _real(density, "density")
    if not (0.0 <= density <= 1.0):
        raise ValueError(f"density must be in [0, 1], got {density}")
    masks = probmask_modules(model)
    if not masks:
        raise ValueError("the model has no ProbMask to finalize")
    total = sum(pm.scores.numel() for _, pm in masks)
    k = int(round(density * total))
    for (_, pm), m in zip(masks, _topk_mask([pm.scores for _, pm in masks], k)):
        pm.fix(m)
    return k


def remove_probmask(model: nn.Module) -> None:
    """Bakes the (fixed or deterministic) masks into the weights and removes the
    parametrizations, leaving a plain model."""
    for name, pm in probmask_modules(model):
        module = model.get_submodule(name)
        was_training = pm.training
        pm.eval()
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        pm.train(was_training)


def probmask_density(model: nn.Module) -> float:
    """Fraction of masked weights whose (fixed or deterministic) mask is 1."""
    masks = probmask_modules(model)
    if not masks:
        raise ValueError("the model has no ProbMask")
    ones = 0
    total = 0
    for _, pm in masks:
        m = pm.fixed if pm.fixed.numel() else pm.deterministic_mask()
        ones += int(m.sum().item())
        total += m.numel()
    return ones / total
