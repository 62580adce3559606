r"""Stochastic Frank-Wolfe on the T-support-norm ball, as in Zimmer, Spiegel,
Pokutta, "Compression-aware Training of Neural Networks using Frank-Wolfe"
(arXiv 2205.11921) and Pokutta, Spiegel, Zimmer, "Deep Neural Network Training
with Frank-Wolfe" (arXiv 2010.07243); the FW baselines of the prunAdag paper
(Porcelli, Seraghiti, Toint, eq. 1.2-1.3) are two of its step-size rules.

.. math::
    \mathcal C_T(\tau) = \mathrm{conv}\{x : \|x\|_0 \le T, \|x\|_2 \le \tau\}, \qquad
    v_i = -\tau\, d_i / \|d\|_{\mathcal R} \ (i \in \mathcal R),\ 0 \text{ otherwise} \quad (1.2) \\
    x \leftarrow x + \eta\,(v - x) \quad (1.3), \qquad \eta = \min(\max(lr \cdot c, 0), 1)

``d`` is the gradient (negated under ``maximize``), or its momentum average;
``R`` is the top-T set of ``|d|`` over all parameters (the global top-T
threshold of :func:`prunopt.ops.topk_threshold`; ties at the threshold are all
in ``R``); the factor ``c`` is set by ``rescale``.
"""
from __future__ import annotations

import math
import numbers
from typing import List, Optional

import torch
from torch import Tensor

from prunopt.optim._sharded import sharded_view
from prunopt.reference.prunadag import resolve_relevant

__all__ = ["SFW"]

#: Accepted values of ``rescale`` (see :class:`SFW`).
RESCALES = ("diameter", "gradient", None, "fw1", "fw2")
STEP_RULES = ("fw1", "fw2")
# keys that must agree across param groups (the LMO is global)
_GLOBAL_KEYS = ("radius", "relevant")


class SFW(torch.optim.Optimizer):
    r"""Stochastic Frank-Wolfe with the T-support-norm LMO (eq. 1.2) and the
    update of eq. 1.3, driven by a learning rate as in Zimmer et al.

    The step size is :math:`\eta = \mathrm{clamp}(lr \cdot c, 0, 1)` with the
    factor ``c`` of ``rescale``:

    * ``"diameter"`` (default, Zimmer et al.): ``c = 1 / D``, ``D = 2 radius``
      the L2 diameter of the ball;
    * ``"gradient"`` (Zimmer et al.; Pokutta et al.): ``c = ||d||_2 / ||x - v||_2``;
    * ``None``: ``c = 1`` (``lr`` is the step size itself);
    * ``"fw1"``: ``c = 1 / (k + 1)`` — with ``lr = 1`` the prunAdag paper's FW1,
      ``eta_k = 1 / (k + 1)`` (``rescale=None`` with
      ``LambdaLR(opt, lambda k: 1 / (k + 1))`` is the same rule);
    * ``"fw2"``: ``c = ||d||_R / ||x - v||_2`` — with ``lr = beta`` the prunAdag
      paper's FW2, ``eta_k = min(beta ||g||_R / ||v - x||, 1)``.

    ``k`` counts the optimizer's steps (kept in every parameter's state as
    ``step``: the number of steps taken when it last had a gradient; ``k`` is
    the largest of them, so parameters that miss a step do not restart the
    schedule). ``lr`` lives in the param groups, so LR schedulers (``StepLR``,
    ``OneCycleLR``, ``ReduceLROnPlateau``, ...) drive the step size.

    Distributed: under FSDP2 (DTensor parameters) the LMO's top-``T`` set and
    every norm are taken over the logical parameters of all ranks (the exact
    sharded threshold of :func:`prunopt.distributed.topk_threshold`, norms
    summed with ``all_reduce``), and each rank updates its shards: the
    one-process step to the rounding of those sums. Momentum buffers are
    sharded like the parameters.

    Args:
        params: parameters or param groups. The LMO is global: the top-T set
            and ``||d||_R`` span every parameter of every group, so ``radius``
            and ``relevant`` must agree across groups; ``lr``, ``rescale``,
            ``momentum`` and ``maximize`` may differ (the factors ``c`` are
            global quantities, applied with each group's ``lr``).
        lr: learning rate, a float ``>= 0`` or a one-element tensor (default
            0.1; 1.0 with ``step_rule="fw1"``, ``beta`` with ``step_rule="fw2"``).
        rescale: one of ``"diameter"``, ``"gradient"``, ``None``, ``"fw1"``, ``"fw2"``.
        momentum: in [0, 1); ``d <- momentum d + (1 - momentum) g`` with the
            buffer starting at the first gradient (Zimmer et al.'s form).
        radius: ``tau``, the radius of the T-support-norm ball (> 0), keyword-only.
        relevant: ``T``, keyword-only: an int ``>= 1`` or a float in (0, 1]
            (``ceil(relevant * n)``).
        maximize: use ``-g`` (maximise the objective), keyword-only.
        step_rule, beta: the prunAdag paper's notation, keyword-only:
            ``step_rule="fw1"`` is ``rescale="fw1"`` (``lr`` 1 unless given; FW1
            has no ``beta`` and ignores one) and ``step_rule="fw2", beta=b`` is
            ``rescale="fw2", lr=b`` (``beta`` defaults to 0.001).

    A zero direction (``||d||_R = 0``, e.g. all gradients zero) leaves the
    parameters unchanged: every point of the ball then minimises the linear
    model ``<d, v>``, and SFW takes ``v = x`` (the Frank-Wolfe gap is 0), not
    ``v = 0``, which would shrink ``x`` towards the origin for no reason.
    Otherwise parameters outside ``R`` move towards 0 (``v_i = 0``): that is
    Frank-Wolfe's pull into the ball, not a decay of its own.

    Parameters may have different dtypes (the top-T threshold is then taken in
    float64, which holds every value exactly) but must share one device. A
    non-finite gradient raises ``ValueError`` before anything is updated
    (parameters, momentum buffers and step counters alike); so does an int
    ``relevant`` larger than the number of elements with a gradient.
    """

    def __init__(self, params, lr=None, rescale="diameter", momentum: float = 0.0, *, radius: float = 10.0,
                 relevant=0.1, maximize: bool = False, step_rule: Optional[str] = None, beta=None):
        if step_rule is not None:
            if step_rule not in STEP_RULES:
                raise ValueError(f"step_rule must be one of {STEP_RULES} or None, got {step_rule!r}")
            if rescale != "diameter":  # the default: any other value was given explicitly
                raise ValueError("give either step_rule or rescale, not both (step_rule='fw1' is rescale='fw1', "
                                 "step_rule='fw2' is rescale='fw2' with lr=beta)")
            if step_rule == "fw2":
                if beta is not None and lr is not None:
                    raise ValueError("with step_rule='fw2', give beta or lr (beta is FW2's lr), not both")
                lr = lr if lr is not None else (beta if beta is not None else 0.001)
            else:
                lr = lr if lr is not None else 1.0
            rescale = step_rule
        if beta is not None:
            # beta is FW2's factor (FW1 has none and ignores it, as the paper's
            # notation does); without a step rule it has no meaning
            if step_rule is None:
                raise ValueError("beta is FW2's factor: it needs step_rule='fw2' (or use rescale='fw2' with lr=beta)")
            _real("beta", beta)
        if lr is None:
            lr = 0.1
        defaults = _check_sfw_hyper(dict(lr=lr, rescale=rescale, momentum=momentum, radius=radius,
                                         relevant=relevant, maximize=maximize))
        super().__init__(params, defaults)
        self._check_groups_agree()

    def _check_groups_agree(self) -> None:
        for key in _GLOBAL_KEYS:
            vals = {repr(g[key]) for g in self.param_groups}
            if len(vals) > 1:
                raise ValueError(f"{key} must be the same in every param group (the LMO is global), got {sorted(vals)}")

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; the group's values are
        validated and its ``radius`` and ``relevant`` must equal the other
        groups' (``ValueError`` otherwise, and the group is not added)."""
        if isinstance(param_group, dict):
            given = {k: param_group[k] for k in self.defaults if k in param_group}
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
        """Loads a pickled optimizer or a state dict; groups of the earlier
        form (``step_rule``, ``beta``, no ``lr``) are converted: FW1 is
        ``rescale="fw1", lr=1`` and FW2 ``rescale="fw2", lr=beta``. Step
        counts that are not finite and >= 0 (FW1 divides by ``k + 1``) raise
        ``ValueError`` before anything is loaded."""
        from prunopt.optim.prunadag import _check_steps

        steps = [s["step"] for s in (state.get("state") or {}).values() if isinstance(s, dict) and "step" in s]
        _check_steps([st if torch.is_tensor(st) else torch.tensor(float(st)) for st in steps], name="state 'step'")
        super().__setstate__(state)
        for g in self.param_groups:
            rule = g.pop("step_rule", None)
            beta = g.pop("beta", None)
            if "lr" not in g:
                g["lr"] = (beta if beta is not None else 0.001) if rule == "fw2" else 1.0
                g.setdefault("rescale", rule if rule in STEP_RULES else "fw1")
            g.setdefault("rescale", "diameter")
            g.setdefault("momentum", 0.0)
            g.setdefault("maximize", False)
        for st in self.state.values():
            if "step" in st and not torch.is_tensor(st["step"]):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        """One Frank-Wolfe step (eq. 1.2-1.3) over all parameters with a gradient."""
        from prunopt.ops import topk_threshold

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not items:
            return loss
        params: List[Tensor] = [p for p, _ in items]
        groups = [g for _, g in items]
        # --- validation: everything is checked before anything is written
        for p in params:
            if p.grad.is_sparse or p.grad.layout != torch.strided or torch.is_complex(p.grad) or torch.is_complex(p):
                raise TypeError("SFW does not support sparse or complex gradients or parameters")
            if p.grad.shape != p.shape:
                raise ValueError(f"grad of shape {tuple(p.grad.shape)} does not match its parameter {tuple(p.shape)}")
            if not p.is_contiguous() and any(st == 0 and sz > 1 for sz, st in zip(p.shape, p.stride())):
                raise RuntimeError(
                    f"SFW: a parameter of shape {tuple(p.shape)} has more than one element referring to a single "
                    f"memory location (stride {tuple(p.stride())}, e.g. an expand()-ed tensor), so it cannot be "
                    "updated in place; clone() it. Nothing was updated")
        # FSDP2 (DTensor parameters): the LMO selects over the logical tensors
        # of every rank; each rank updates its own shards
        view = sharded_view(params)
        local = view.local if view is not None else (lambda t: t)
        counted = [view.counts(p) for p in params] if view is not None else [True] * len(params)

        def total(parts: List[Tensor]) -> Tensor:
            """The sum of 0-dim float64 local contributions (over every rank when sharded)."""
            t = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)
            return view.sum([t])[0] if view is not None else t

        devices = {local(p).device for p in params}
        if len(devices) > 1:
            raise ValueError(f"SFW needs all parameters on one device (the LMO is global), got {sorted(map(str, devices))}")
        if view is not None:
            bad = total([(~torch.isfinite(local(p.grad))).sum().double() for p in params])
            finite = bool(bad.item() == 0)
        else:
            finite = bool(torch.stack([torch.isfinite(p.grad).all() for p in params]).all())
        if not finite:
            raise ValueError("SFW: grads contain a non-finite value; the step was skipped (nothing was updated)")
        n = sum(p.numel() for p in params)
        if n == 0:
            return loss
        group0 = self.param_groups[0]
        T = resolve_relevant(group0["relevant"], n)  # ValueError for an int T > n, before any write
        radius = group0["radius"]
        # --- directions d (maximize, momentum), computed out of place
        dirs = []
        for p, group in items:
            d = -p.grad if group["maximize"] else p.grad
            mu = group["momentum"]
            if mu > 0:
                buf = self.state[p].get("momentum_buffer")
                d = d.clone() if buf is None else torch.add(buf.to(d.dtype) * mu, d, alpha=1 - mu)
            dirs.append(d)
        # --- eq. 1.2: LMO on the T-support-norm ball (mixed dtypes: the
        # threshold in float64, which holds every float16/bfloat16/float32 value exactly)
        ldirs = [local(d) for d in dirs]
        lparams = [local(p) for p in params]
        if view is not None:
            sel = ldirs
            if len({d.dtype for d in sel}) > 1:
                sel = [d.double() for d in sel]
            tau = view.threshold(sel, counted, T)
            if tau is None:  # a rank's gradient turned non-finite after the check: nothing written yet
                raise ValueError("SFW: grads contain a non-finite value; the step was skipped (nothing was updated)")
        else:
            sel = [d for d in dirs if d.numel() > 0]
            if len({d.dtype for d in sel}) > 1:
                sel = [d.double() for d in sel]
            tau = topk_threshold(sel, T)
        rel = [(d.abs() if d.dtype == tau.dtype else d.abs().to(tau.dtype)) >= tau for d in ldirs]  # exact
        g_r = total([(d.double().pow(2) * r).sum() for d, r, c in zip(ldirs, rel, counted) if c]).sqrt()
        nonzero = g_r > 0
        # v = -radius d / ||d||_R on R, 0 elsewhere; v = x for a zero direction (no move)
        scale = torch.where(nonzero, -radius / g_r, torch.zeros_like(g_r))
        vs = [torch.where(nonzero, torch.where(r, d * scale.to(d.dtype), torch.zeros_like(d)), p)
              for p, d, r in zip(lparams, ldirs, rel)]
        # --- step sizes: eta = clamp(lr * c, 0, 1) per group, c global
        factors = {}
        rescales = {g["rescale"] for g in groups}
        if rescales & {"gradient", "fw2"}:
            dist = total([(v.double() - p.double()).pow(2).sum()
                          for v, p, c in zip(vs, lparams, counted) if c]).sqrt()
            safe = torch.where(dist > 0, dist, torch.ones_like(dist))
            if "gradient" in rescales:
                d_norm = total([d.double().pow(2).sum() for d, c in zip(ldirs, counted) if c]).sqrt()
                factors["gradient"] = torch.where(dist > 0, d_norm / safe, torch.zeros_like(dist))
            if "fw2" in rescales:
                factors["fw2"] = torch.where(dist > 0, g_r / safe, torch.zeros_like(dist))
        steps = [st["step"] for st in self.state.values() if "step" in st]
        k = torch.stack([st.reshape(()).to(torch.float64) for st in steps]).max() if steps else None
        if "fw1" in rescales:
            factors["fw1"] = 1.0 / (k + 1.0) if k is not None else 1.0
        factors["diameter"] = 1.0 / (2.0 * radius)
        factors[None] = 1.0
        etas = {}
        for group in self.param_groups:
            if id(group) in etas or group["rescale"] not in factors:
                continue
            lr = group["lr"]
            lr = lr.reshape(()).to(torch.float64) if isinstance(lr, Tensor) else lr
            eta = lr * factors[group["rescale"]]
            etas[id(group)] = (torch.clamp(eta, 0.0, 1.0) if isinstance(eta, Tensor)
                               else min(max(float(eta), 0.0), 1.0))
        # --- eq. 1.3, then the state (momentum buffers, step counters)
        k_next = (k + 1.0).to(torch.float32) if k is not None else torch.tensor(1.0)
        for p, lp, group, v, d in zip(params, lparams, groups, vs, dirs):
            eta = etas[id(group)]
            if isinstance(eta, Tensor):
                lp.add_((v - lp) * eta.to(device=lp.device, dtype=lp.dtype))
            else:
                lp.add_(v - lp, alpha=eta)
            state = self.state[p]
            if group["momentum"] > 0:
                state["momentum_buffer"] = d
            state["step"] = k_next.clone()
        return loss


def _real(key, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{key} must be a real number, got {type(v).__name__}")
    try:
        return float(v)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        raise ValueError(f"{key} must be a finite number, got an integer beyond the float range") from None


def _check_sfw_hyper(h: dict) -> dict:
    """Validates SFW's hyper-parameters (numpy and other ``numbers`` scalars
    are accepted); returns them as Python numbers (``lr`` may stay a tensor)."""
    lr = h["lr"]
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr.is_floating_point():
            raise TypeError(f"a Tensor lr must have a floating dtype, got {lr.dtype}")
        lr_value = lr.item()
    else:
        lr = lr_value = _real("lr", lr)
    if not (lr_value >= 0) or math.isinf(lr_value):
        raise ValueError(f"Invalid learning rate: {lr_value} (lr must be a finite number >= 0)")
    radius, momentum = _real("radius", h["radius"]), _real("momentum", h["momentum"])
    if not (radius > 0) or math.isinf(radius):
        raise ValueError(f"radius must be a finite number > 0, got {radius}")
    if h["rescale"] not in RESCALES:
        raise ValueError(f"rescale must be one of {RESCALES}, got {h['rescale']!r}")
    if not (0.0 <= momentum < 1.0):
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not isinstance(h["maximize"], bool):
        raise TypeError(f"maximize must be a bool, got {type(h['maximize']).__name__}")
    relevant = h["relevant"]
    if isinstance(relevant, bool) or not isinstance(relevant, numbers.Real):
        raise TypeError(f"relevant must be an int >= 1 or a float in (0, 1], got {type(relevant).__name__}")
    relevant = int(relevant) if isinstance(relevant, numbers.Integral) else float(relevant)
    if (isinstance(relevant, int) and relevant < 1) or (isinstance(relevant, float) and not 0.0 < relevant <= 1.0):
        raise ValueError(f"relevant must be an int >= 1 or a float in (0, 1], got {relevant}")
    return dict(lr=lr, rescale=h["rescale"], momentum=momentum, radius=radius, relevant=relevant,
                maximize=h["maximize"])
