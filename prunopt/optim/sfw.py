r"""Stochastic Frank-Wolfe on the T-support-norm ball (Zimmer, Spiegel, Pokutta;
the FW baselines of the prunAdag paper, Porcelli et al.).

.. math::
    \mathcal C_T(\tau) = \mathrm{conv}\{x : \|x\|_0 \le T, \|x\|_2 \le \tau\}, \qquad
    v_i = -\tau\, g_i / \|g\|_{\mathcal R} \ (i \in \mathcal R),\ 0 \text{ otherwise} \quad (1.2) \\
    x \leftarrow x + \eta_k (v - x) \quad (1.3), \qquad
    \eta_k = 1/(k+1)\ (\text{FW1}) \ \text{ or }\ \min(\beta \|g\|_{\mathcal R} / \|v - x\|, 1)\ (\text{FW2})

``R`` is the top-T set of ``|g|`` over all parameters (the global top-T
threshold of :func:`prunopt.ops.topk_threshold`; ties at the threshold are all
in ``R``).
"""
from __future__ import annotations

import math
import numbers
from typing import List

import torch
from torch import Tensor

from prunopt.reference.prunadag import resolve_relevant

__all__ = ["SFW"]

STEP_RULES = ("fw1", "fw2")


class SFW(torch.optim.Optimizer):
    r"""Frank-Wolfe with the LMO of eq. 1.2 and the update of eq. 1.3.

    Args:
        params: parameters or param groups. The LMO is global: the top-T set and
            ``||g||_R`` span every parameter of every group, so ``radius``,
            ``relevant``, ``step_rule``, ``beta`` and ``momentum`` must agree
            across groups.
        radius: ``tau``, the radius of the T-support-norm ball (> 0).
        relevant: ``T``: an int ``>= 1`` or a float in (0, 1] (``ceil(relevant * n)``).
        step_rule: ``"fw1"`` (``eta_k = 1/(k+1)``) or ``"fw2"`` (gradient
            rescaled, ``eta_k = min(beta ||g||_R / ||v - x||, 1)``).
        beta: FW2's factor in (0, 1].
        momentum: in [0, 1); the direction is ``m <- momentum m + (1 - momentum) g``.

    ``k`` in FW1's ``eta_k`` counts the optimizer's steps (kept in every
    parameter's state as ``step``: the number of steps taken when it last had a
    gradient; ``k`` is the largest of them), so parameters that miss a step do
    not restart the schedule. Parameters may have different dtypes (the top-T
    threshold is then taken in float64, which holds every value exactly).

    A non-finite gradient raises ``ValueError`` before anything is updated
    (parameters and momentum buffers alike).
    """

    def __init__(self, params, radius: float = 10.0, relevant=0.1, step_rule: str = "fw1", beta: float = 0.001,
                 momentum: float = 0.0):
        defaults = _check_sfw_hyper(dict(radius=radius, relevant=relevant, step_rule=step_rule, beta=beta,
                                         momentum=momentum))
        super().__init__(params, defaults)
        self._check_groups_agree()

    def _check_groups_agree(self) -> None:
        for key in self.defaults:
            vals = {repr(g[key]) for g in self.param_groups}
            if len(vals) > 1:
                raise ValueError(f"{key} must be the same in every param group (the LMO is global), got {sorted(vals)}")

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; the group's ``radius``,
        ``relevant``, ``step_rule``, ``beta`` and ``momentum`` must equal the
        other groups' (``ValueError`` otherwise, and the group is not added)."""
        if isinstance(param_group, dict):
            given = {k: param_group[k] for k in ("radius", "relevant", "step_rule", "beta", "momentum")
                     if k in param_group}
            if given:  # validated (and numpy scalars made Python numbers) before the group is added
                filled = _check_sfw_hyper({**self.defaults, **given})
                param_group = {**param_group, **{k: filled[k] for k in given}}
        super().add_param_group(param_group)
        if len(self.param_groups) > 1:
            try:
                self._check_groups_agree()
            except ValueError:
                self.param_groups.pop()
                raise

    def __setstate__(self, state):
        super().__setstate__(state)
        for g in self.param_groups:
            g.setdefault("momentum", 0.0)
            g.setdefault("beta", 0.001)
            g.setdefault("step_rule", "fw1")

    @torch.no_grad()
    def step(self, closure=None):
        """One Frank-Wolfe step (eq. 1.2-1.3) over all parameters with a gradient."""
        from prunopt.ops import topk_threshold

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params: List[Tensor] = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return loss
        group = self.param_groups[0]
        for p in params:
            if p.grad.is_sparse or torch.is_complex(p.grad):
                raise TypeError("SFW does not support sparse or complex gradients")
            if not bool(torch.isfinite(p.grad).all()):
                raise ValueError("SFW: grads contain a non-finite value; the step was skipped (nothing was updated)")
            if p.grad.shape != p.shape:
                raise ValueError(f"grad of shape {tuple(p.grad.shape)} does not match its parameter {tuple(p.shape)}")
        n = sum(p.numel() for p in params)
        if n == 0:
            return loss
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"SFW needs all parameters on one device (the LMO is global), got {sorted(map(str, devices))}")
        T = resolve_relevant(group["relevant"], n)
        mu = group["momentum"]
        # Everything is computed before anything is written: the new momentum
        # buffers out of place, committed with the parameters at the end.
        dirs = []
        for p in params:
            buf = self.state[p].get("momentum_buffer") if mu > 0 else None
            if mu > 0:
                dirs.append(torch.add(buf * mu, p.grad, alpha=1 - mu) if buf is not None else p.grad * (1 - mu))
            else:
                dirs.append(p.grad)
        # eq. 1.2: LMO on the T-support-norm ball (mixed dtypes: the threshold in
        # float64, which holds every float16/bfloat16/float32 value exactly)
        sel = [d for d in dirs if d.numel() > 0]
        if len({d.dtype for d in sel}) > 1:
            sel = [d.double() for d in sel]
        tau = topk_threshold(sel, T)
        rel = [d.abs() >= tau for d in dirs]
        g_r = math.sqrt(sum(float((d.double().pow(2) * r).sum()) for d, r in zip(dirs, rel)))
        if g_r > 0:
            vs = [torch.where(r, d * (-group["radius"] / g_r), torch.zeros_like(d)) for d, r in zip(dirs, rel)]
        else:
            vs = [torch.zeros_like(d) for d in dirs]
        k = max((float(st["step"]) for st in self.state.values() if "step" in st), default=0.0)
        if group["step_rule"] == "fw1":
            eta = 1.0 / (k + 1.0)
        else:
            dist = math.sqrt(sum(float((v.double() - p.double()).pow(2).sum()) for v, p in zip(vs, params)))
            eta = min(group["beta"] * g_r / dist, 1.0) if dist > 0 else 0.0
        for p, v, d in zip(params, vs, dirs):
            p.add_(v - p, alpha=eta)  # eq. 1.3
            state = self.state[p]
            if mu > 0:
                state["momentum_buffer"] = d
            state["step"] = torch.tensor(k + 1.0)
        return loss


def _check_sfw_hyper(h: dict) -> dict:
    """Validates SFW's hyper-parameters (numpy and other ``numbers`` scalars
    are accepted); returns them as Python numbers."""
    radius, beta, momentum, relevant = h["radius"], h["beta"], h["momentum"], h["relevant"]
    for key, v in (("radius", radius), ("beta", beta), ("momentum", momentum)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{key} must be a real number, got {type(v).__name__}")
    radius, beta, momentum = float(radius), float(beta), float(momentum)
    if not (radius > 0) or math.isinf(radius):
        raise ValueError(f"radius must be a finite number > 0, got {radius}")
    if h["step_rule"] not in STEP_RULES:
        raise ValueError(f"step_rule must be one of {STEP_RULES}, got {h['step_rule']!r}")
    if not (0.0 < beta <= 1.0):
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    if not (0.0 <= momentum < 1.0):
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if isinstance(relevant, bool) or not isinstance(relevant, numbers.Real):
        raise TypeError(f"relevant must be an int >= 1 or a float in (0, 1], got {type(relevant).__name__}")
    relevant = int(relevant) if isinstance(relevant, numbers.Integral) else float(relevant)
    if (isinstance(relevant, int) and relevant < 1) or (isinstance(relevant, float) and not 0.0 < relevant <= 1.0):
        raise ValueError(f"relevant must be an int >= 1 or a float in (0, 1], got {relevant}")
    return dict(radius=radius, relevant=relevant, step_rule=h["step_rule"], beta=beta, momentum=momentum)
