"""Probabilistic masks: ProbMask (weights) and ProM (inputs), ProM supplement A.2.

A score ``theta`` in [0, 1] is the probability that a mask entry is 1. During
training the mask is a relaxed Bernoulli (Gumbel-sigmoid) sample

.. math::
    y = \\sigma\\!\\left(\\frac{\\operatorname{logit}(\\theta) + \\log u - \\log(1-u)}{\\tau}\\right),
    \\qquad u \\sim U(0, 1),

optionally hard (``1[y > 0.5]``) with a straight-through gradient
(``hard - y.detach() + y``); ``tau`` is annealed. At evaluation the mask is
deterministic: ``theta > 0.5``, or exactly the ``k`` largest scores. The scores
are kept in the budget by :class:`prunopt.optim.BudgetProjection`.

The logit is taken of ``theta`` clamped to ``[1e-6, 1 - 1e-6]`` with a
straight-through gradient: a score the projection puts at exactly 0 or 1 still
gets the gradient of the logit at the clamp point, so it can move again.

The model-level helpers (:func:`probmask_modules`, :func:`probmask_scores`,
:func:`set_temperature`, :func:`finalize_probmask`, :func:`probmask_density`)
cover every mask of a model: the weight masks of :func:`apply_probmask` and the
input masks of :class:`ProbMaskInput` layers. Tied weights (layers holding the
same ``Parameter``) share one :class:`ProbMask`, counted once.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Sequence, Tuple, Type

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from prunopt.nn._jit import script_unsupported
from prunopt.nn._wrapping import check_not_wrapped
from prunopt.schedules import _real
from prunopt.validation import check_bool, check_shape

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


def gumbel_sigmoid(theta: Tensor, tau: float, hard: bool = False, generator: Optional[torch.Generator] = None) -> Tensor:
    r"""Relaxed Bernoulli sample with probabilities ``theta`` at temperature ``tau``.

    ``y = sigmoid((logit(theta) + log u - log(1 - u)) / tau)``; with ``hard=True``
    the forward value is ``1[y > 0.5]`` and the gradient is that of ``y``
    (straight-through).

    ``theta`` is clamped to ``[1e-6, 1 - 1e-6]`` for the logit (in float16 and
    bfloat16, where ``1 - 1e-6`` rounds to 1, the upper bound is the largest
    value below 1), with a straight-through gradient: the forward value is that
    of the clamped score, and ``d y / d theta`` is the logit's derivative at
    the clamp point for every score, so a score at exactly 0 or 1 (where the
    budget projection puts many) keeps a non-zero, finite gradient and can move
    again (ProbMask's code keeps one too, with ``log(theta + eps)``). Inside the
    clamp range values and gradients are those of the plain formula. Like any
    sigmoid, a sample that saturates in its dtype (very low ``tau``) has a
    vanishing gradient. A NaN score gives a NaN sample, as ``torch.sigmoid``
    does (no host sync to check).
    """
    if not isinstance(theta, Tensor):
        raise TypeError(f"theta must be a tensor, got {type(theta).__name__}")
    tau = _real(tau, "tau")
    hard = check_bool(hard, "hard")
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite number > 0, got {tau}")
    if not theta.is_floating_point():
        raise TypeError(f"theta must be a floating-point tensor, got {theta.dtype}")
    # 1 - 1e-6 rounds to 1 in float16/bfloat16 (logit +inf, NaN gradient): there
    # the upper bound is the largest value below 1, 1 - eps/2
    hi = min(1 - _EPS, 1 - torch.finfo(theta.dtype).eps / 2)
    p = theta.detach().clamp(_EPS, hi)
    if theta.requires_grad:
        # straight-through clamp: forward value p exactly, gradient 1 to theta
        # everywhere (a plain clamp has gradient 0 outside (eps, 1 - eps), so a
        # projected score at 0 or 1 could never move again). nan_to_num keeps
        # an infinite score at the clamped value, as the plain clamp did.
        p = p + (theta - theta.detach()).nan_to_num(0.0, 0.0, 0.0)
    u = torch.rand(p.shape, dtype=p.dtype, device=p.device, generator=generator).clamp(_EPS, hi)
    y = torch.sigmoid((torch.log(p) - torch.log1p(-p) + torch.log(u) - torch.log1p(-u)) / tau)
    if hard:
        return (y > 0.5).to(y.dtype) - y.detach() + y
    return y


class ProbMask(nn.Module):
    r"""A parametrization ``W -> W * m`` with ``m`` a probabilistic mask of the
    weight's shape (ProbMask; ProM supplement A.2).

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

    __prepare_scriptable__ = script_unsupported  # torch.jit.script: a clear error (prunopt.nn._jit)

    def __init__(self, shape: Sequence[int], init: float = 1.0, tau: float = 1.0, hard: bool = False,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        init, tau = _real(init, "init"), _real(tau, "tau")
        if not (0.0 <= init <= 1.0):
            raise ValueError(f"init must be in [0, 1], got {init}")
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"tau must be a finite number > 0, got {tau}")
        shape, hard = check_shape(shape), check_bool(hard, "hard")
        self.scores = nn.Parameter(torch.full(shape, float(init), dtype=dtype, device=device))
        self.tau = float(tau)
        self.hard = hard
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
        """Freezes the mask to a binary tensor (used by :func:`finalize_probmask`):
        a bool tensor, or a real one holding only 0 and 1, of the scores' shape.
        Any other value (e.g. 0.3, NaN) is a ``ValueError``; a complex tensor a
        ``TypeError``. Nothing changes when it raises."""
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a tensor, got {type(mask).__name__}")
        if mask.is_complex():
            raise TypeError(f"mask must be a bool or real tensor of 0s and 1s, got {mask.dtype}")
        mask = _full(mask)  # a sharded mask (FSDP2): ``fixed`` is a replicated buffer
        if mask.shape != self.scores.shape:
            raise ValueError(f"mask must have shape {tuple(self.scores.shape)}, got {tuple(mask.shape)}")
        mask = mask.detach()
        if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("mask must be binary (bool, or only 0s and 1s); it holds other values")
        self.fixed = mask.to(device=self.scores.device, dtype=torch.bool).clone()

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

    The model-level helpers (:func:`probmask_scores`, :func:`set_temperature`,
    :func:`finalize_probmask`, :func:`probmask_density`) include its mask, on
    the model that holds it or on the layer alone (``finalize_probmask(layer,
    d)`` gives it its own budget); :func:`remove_probmask` leaves the layer in
    place (it is a layer of the model, not a weight parametrization).

    Args:
        shape: the mask shape (the trailing dimensions of the input).
        init, tau, hard: as in :class:`ProbMask`.
    """

    __prepare_scriptable__ = script_unsupported  # torch.jit.script: a clear error (prunopt.nn._jit)

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
    ties broken towards the lower index of the concatenation.  DTensor scores
    (FSDP2 shards) give DTensor masks, selected exactly over the global
    tensors with the same tie rule (by global index; no score is gathered)."""
    if any(_is_dtensor(s) for s in scores):
        total = sum(s.numel() for s in scores)
        if not (0 <= k <= total):
            raise ValueError(f"k must be in [0, {total}], got {k}")
        from prunopt.pruning import _dist

        return _dist.top_k_masks([s.detach() for s in scores], k)
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


def _is_dtensor(t) -> bool:
    from prunopt.distributed import is_distributed_tensor

    return is_distributed_tensor(t)


def _full(mask: Tensor) -> Tensor:
    """A DTensor mask gathered whole (``fixed`` is a replicated buffer), else ``mask``."""
    from prunopt.pruning import _dist

    return _dist.full_tensor(mask)


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")


def _weight_state(name: str, module: nn.Module) -> Tuple[Optional[ProbMask], nn.Parameter]:
    """``(existing ProbMask or None, the weight Parameter)`` of a layer to mask;
    ``ValueError`` naming the layer when its weight cannot carry a ProbMask."""
    label = repr(name) if name else "'' (the model itself)"
    if parametrize.is_parametrized(module, "weight"):
        plist = list(module.parametrizations.weight)
        if len(plist) == 1 and isinstance(plist[0], ProbMask):
            return plist[0], module.parametrizations.weight.original
        kinds = [type(p).__name__ for p in plist]
        raise ValueError(
            f"layer {label} has a weight already parametrized by {kinds} (e.g. "
            "torch.nn.utils.parametrizations.weight_norm); apply_probmask masks plain weights only: remove that "
            "parametrization first or exclude the layer")
    p = module._parameters.get("weight")
    if p is None:
        if isinstance(getattr(module, "weight", None), Tensor):
            raise ValueError(
                f"layer {label} has a weight that is not a Parameter of the layer but computed by a forward "
                "pre-hook (torch.nn.utils.prune, torch.nn.utils.weight_norm or spectral_norm): remove it first "
                "(e.g. torch.nn.utils.prune.remove) or exclude the layer")
        raise ValueError(f"layer {label} ({type(module).__name__}) has no weight to mask (e.g. a norm layer with "
                         "affine=False): exclude it or leave its type out of layer_types")
    if nn.parameter.is_lazy(p):
        raise ValueError(f"layer {label} is uninitialized (a lazy module): run a forward pass before "
                         "apply_probmask, or exclude the layer")
    if not p.is_floating_point():
        raise ValueError(f"layer {label} has a {p.dtype} weight; a ProbMask needs a floating-point weight")
    return None, p


def _parameter_holders(model: nn.Module) -> dict:
    """``id(Parameter) -> [(layer name, attribute), ...]``: every place of the
    model that holds each Parameter (a parametrized tensor's ``original`` is
    attributed to its layer and tensor name)."""
    holders: dict = {}
    for mname, m in model.named_modules():
        for pname, p in m._parameters.items():
            if p is None:
                continue
            owner, attr = mname, pname
            if isinstance(m, parametrize.ParametrizationList) and ".parametrizations." in "." + mname:
                owner, _, attr = ("." + mname).rpartition(".parametrizations.")
                owner = owner[1:]
            holders.setdefault(id(p), []).append((owner, attr))
    return holders


def apply_probmask(model: nn.Module, layer_types: Tuple[Type[nn.Module], ...] = (nn.Linear, nn.Conv2d),
                   init: float = 1.0, tau: float = 1.0, hard: bool = False,
                   exclude: Iterable[str] = ()) -> List[Tuple[str, ProbMask]]:
    """Wraps the ``weight`` of every module of ``layer_types`` (except the
    qualified names in ``exclude``) with a :class:`ProbMask` parametrization.

    Layers whose weight already carries a ProbMask (an earlier call) are
    skipped; when every selected layer is, it is a ``ValueError`` saying so.

    **Tied weights.** Layers that hold the same weight ``Parameter`` (e.g.
    ``b.weight = a.weight``) get one shared ProbMask: one set of scores,
    counted once by the model-level helpers, and :func:`remove_probmask` bakes
    it once and keeps the tie. In eval mode (or once fixed) every use computes
    with the same mask; in training mode every use draws its own
    Gumbel-sigmoid sample from the shared scores, as one layer called twice
    does. Every holder of a tied Parameter must be masked: a tie with a layer
    that is excluded, not of ``layer_types`` or holds it under another name is
    a ``ValueError`` naming both (masking one use would change the other when
    the mask is baked in).

    **Errors.** Every selected layer is checked before any is changed: a
    weight that is missing (``BatchNorm1d(affine=False)``), uninitialized
    (lazy modules), computed by a hook (``torch.nn.utils.prune``, the old
    ``weight_norm``) or already parametrized by anything but a ProbMask
    (``torch.nn.utils.parametrizations.weight_norm``) is a ``ValueError``
    naming the layer, and the model is left as it was. So is a model wrapped
    in ``DistributedDataParallel`` or ``fully_shard`` (or the module inside a
    live DDP): apply the masks first, then wrap (a parametrization registered
    after DDP re-sets the weight, whose new gradient accumulator DDP's hooks
    never see).

    Returns ``[(qualified_name, mask), ...]``: one entry per ProbMask this
    call registered, under the first (in module order) of the layers that
    share it.
    """
    _check_model(model)
    if isinstance(layer_types, type):
        layer_types = (layer_types,)
    if not isinstance(layer_types, tuple) or not layer_types or not all(isinstance(t, type) for t in layer_types):
        raise TypeError(f"layer_types must be a module class or a non-empty tuple of them, got {layer_types!r}")
    init, tau = _real(init, "init"), _real(tau, "tau")
    if not (0.0 <= init <= 1.0):
        raise ValueError(f"init must be in [0, 1], got {init}")
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite number > 0, got {tau}")
    hard = check_bool(hard, "hard")
    if isinstance(exclude, str):
        raise TypeError(f"exclude must be an iterable of module names, not a string ({exclude!r}); "
                        f"write [{exclude!r}]")
    exclude = set(exclude)
    known = {name for name, _ in model.named_modules()}
    unknown = exclude - known
    if unknown:
        raise ValueError(f"exclude names modules the model does not have: {sorted(unknown)}")

    check_not_wrapped(model, "apply_probmask")  # its parametrizations must come before DDP/FSDP

    # 1. check every selected layer; group them by weight Parameter (ties)
    groups: "dict[int, list]" = {}
    for name, module in model.named_modules():
        if name in exclude or not isinstance(module, layer_types):
            continue
        pm, param = _weight_state(name, module)
        groups.setdefault(id(param), []).append((name, module, pm, param))
    if not groups:
        raise ValueError("the model has no layer of the requested types to mask")
    holders = _parameter_holders(model)
    plan, already = [], []
    for group in groups.values():
        plain = [(name, module) for name, module, pm, _ in group if pm is None]
        if not plain:
            already.extend(name for name, *_ in group)
            continue
        names = [name for name, *_ in group]
        param = group[0][3]
        others = [h for h in holders.get(id(param), []) if not (h[1] == "weight" and h[0] in names)]
        if others:
            where = ", ".join(repr(f"{n}.{a}" if n else a) for n, a in others)
            raise ValueError(
                f"the weight of layer {names[0]!r} is tied to {where}, which would not be masked (excluded, not of "
                "layer_types, or held under another name): a tied weight has one mask, so mask all its uses "
                "or exclude them all")
        existing = list({id(pm): pm for _, _, pm, _ in group if pm is not None}.values())
        if len(existing) > 1:
            raise ValueError(f"tied layers {names} share one weight but carry different ProbMasks: call "
                             "remove_probmask(model) first")
        pm = existing[0] if existing else None
        plan.append((names[0], pm, param, plain))
    if not plan:
        raise ValueError(f"the layers of the requested types are already masked by a ProbMask: {already}")

    # 2. register; an error undoes what was done
    out, done = [], []
    try:
        for first, pm, param, plain in plan:
            if pm is None:
                pm = ProbMask(param.shape, init=init, tau=tau, hard=hard, dtype=param.dtype, device=param.device)
            for _, module in plain:
                parametrize.register_parametrization(module, "weight", pm)
                done.append(module)
            out.append((first, pm))
    except BaseException:
        for module in reversed(done):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        raise
    return out


def _weight_uses(model: nn.Module) -> List[Tuple[str, nn.Module, ProbMask]]:
    """``(layer name, layer, ProbMask)`` for every layer whose weight carries a
    ProbMask, in module order (tied layers each listed, with the shared mask)."""
    out = []
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module, "weight"):
            for p in module.parametrizations["weight"]:
                if isinstance(p, ProbMask):
                    out.append((name, module, p))
    return out


def probmask_modules(model: nn.Module) -> List[Tuple[str, ProbMask]]:
    """``[(qualified module name, ProbMask), ...]``: every distinct mask of the
    model in module order, the weight masks (under the layer's name) and the
    masks of :class:`ProbMaskInput` layers (under that layer's name). A
    ProbMask shared by tied layers is listed once, under the first of them."""
    _check_model(model)
    out, seen = [], set()
    for name, module in model.named_modules():
        if isinstance(module, ProbMaskInput):
            found = [module.mask_module]
        elif parametrize.is_parametrized(module, "weight"):
            found = [p for p in module.parametrizations["weight"] if isinstance(p, ProbMask)]
        else:
            continue
        for pm in found:
            if id(pm) not in seen:
                seen.add(id(pm))
                out.append((name, pm))
    return out


def probmask_scores(model: nn.Module) -> List[nn.Parameter]:
    """The score parameters of every mask in the model (weight masks and
    :class:`ProbMaskInput` masks, each once; see :func:`probmask_modules`), to
    optimize and to keep in budget with :class:`prunopt.optim.BudgetProjection`."""
    return [pm.scores for _, pm in probmask_modules(model)]


def set_temperature(model: nn.Module, tau: float) -> None:
    """Sets the Gumbel-sigmoid temperature of every mask in the model (weight
    masks and :class:`ProbMaskInput` masks)."""
    tau = _real(tau, "tau")
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite number > 0, got {tau}")
    for _, pm in probmask_modules(model):
        pm.tau = tau


def finalize_probmask(model: nn.Module, density: float) -> int:
    """Fixes every mask of the model (weight masks and :class:`ProbMaskInput`
    masks, see :func:`probmask_modules`) to the deterministic global top-``k``
    scores with ``k = round(density * D)`` (D = number of scores, a tied
    weight's counted once): exactly the budgeted number of ones over all masks
    jointly. For separate budgets call it on submodules, or use
    ``pm.fix(pm.deterministic_mask(k))`` on one mask. Returns ``k``.

    Under FSDP2 (DTensor scores) the selection is exact over the global
    scores with the same tie rule, and every rank fixes the same mask; under
    DDP the scores, hence the masks, are the same on every rank."""
    density = _real(density, "density")
    if not (0.0 <= density <= 1.0):
        raise ValueError(f"density must be in [0, 1], got {density}")
    masks = probmask_modules(model)
    if not masks:
        raise ValueError("the model has no ProbMask to finalize")
    total = sum(pm.scores.numel() for _, pm in masks)
    k = int(round(density * total))
    for (_, pm), m in zip(masks, _topk_mask([pm.scores for _, pm in masks], k)):
        pm.fix(_full(m))
    return k


def remove_probmask(model: nn.Module) -> None:
    """Bakes the (fixed or deterministic) weight masks into the weights and
    removes the parametrizations, leaving a plain model; the weights stay the
    same ``Parameter`` objects (optimizers stay valid). A mask shared by tied
    layers is baked once and the layers still share their Parameter after.
    :class:`ProbMaskInput` layers are left in place. A weight that carries a
    ProbMask and another parametrization is a ``ValueError`` naming the layer,
    raised before any layer is changed; so is a DDP- or FSDP-wrapped model
    (bake the masks into an unwrapped model, e.g. one loaded from the full
    state dict)."""
    _check_model(model)
    uses = _weight_uses(model)
    if uses:  # removing a parametrization re-sets the weight: a DDP/FSDP wrapper would lose it
        check_not_wrapped(model, "remove_probmask")
    for name, module, _ in uses:
        kinds = [type(p).__name__ for p in module.parametrizations["weight"]]
        if len(kinds) != 1:
            raise ValueError(f"layer {name!r} has parametrizations {kinds} besides its ProbMask; remove the others "
                             "first")
    baked = set()
    for _, module, pm in uses:
        if id(pm) in baked:  # a tied layer: its shared Parameter already holds the masked weight
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            continue
        was_training = pm.training
        pm.eval()
        try:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        finally:
            pm.train(was_training)
        baked.add(id(pm))


def probmask_density(model: nn.Module) -> float:
    """Fraction of mask entries (weight masks and :class:`ProbMaskInput`
    masks, a tied weight's counted once) whose fixed or deterministic mask is 1."""
    masks = probmask_modules(model)
    if not masks:
        raise ValueError("the model has no ProbMask")
    from prunopt.pruning import _dist

    ones = 0
    total = 0
    for _, pm in masks:
        m = pm.fixed if pm.fixed.numel() else pm.deterministic_mask()
        ones += _dist.global_count([m], lambda t: t)  # over the global scores under FSDP2
        total += m.numel()
    if total == 0:
        raise ValueError("the model's masks have no entries: the density is undefined")
    return ones / total
