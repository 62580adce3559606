"""Pruning scores (paper App. F, Wimmer et al.) for spatial weights (SP) and
filter-basis coefficients (IP) alike.

Every score function takes a *target* — a :class:`~prunopt.pruning.Masker` or a
plain ``nn.Module`` (then every Conv2d/Linear weight and FBConv2d coefficient
tensor is scored) — and returns ``OrderedDict[tensor FQN, Tensor]`` with the
shape of each prunable tensor.  The higher the score, the more important the
entry (A.40).  Scores are computed with respect to the *effective* tensor
``w * mu`` (``lam * mu`` for IP), so already-pruned entries score 0 (SNIP,
magnitude, SynFlow).  No ``.grad`` field, mode flag or buffer of the model is
changed by a score function: BatchNorm running statistics updated by the
train-mode passes of SNIP/GraSP are restored afterwards.  The gradient-based
scores (SNIP, GraSP, SynFlow) enable autograd for their own passes, so they
also work when called under ``torch.no_grad()``.  A model may return its logits
or a mapping holding them under ``"logits"`` (transformers' ``ModelOutput``).
Tied layers (one Parameter held by several layers) are one tensor, scored under
its first name, as in :class:`~prunopt.pruning.Masker`.

**Distributed.**  Under DDP every rank passes its own batches (the same
number on every rank) to the unwrapped model or the masker: the gradients
(SNIP; GraSP's gradient and Hessian-vector product) are averaged over the
masker's process group (the default group for a plain module), so the scores
are those of one process given every rank's batches, the same on every rank.
SynFlow uses no data; random scores need a generator in the same state on
every rank (the methods keep one).  Under FSDP2 the scores are DTensors laid
out as the parameters: the gradients come from ``backward()``, which FSDP2
averages over the ranks; random scores draw the whole tensor and keep the
rank's block, so they equal the one-process draw.  GraSP needs a double
backward, which FSDP2 does not provide: it raises ``NotImplementedError``
there (score before ``fully_shard``, or under DDP).
"""
from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from typing import Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prunopt.pruning import _dist
from prunopt.pruning.masks import Masker, PrunableTensor, _backward_gradients, _distinct_tensors, prunable_tensors

__all__ = [
    "random_scores",
    "magnitude_scores",
    "snip_scores",
    "grasp_scores",
    "synflow_scores",
    "SCORES",
]

Target = Union[Masker, nn.Module]
Batches = Iterable[Tuple[Tensor, Tensor]]


def _resolve(target: Target) -> Tuple[nn.Module, "OrderedDict[str, PrunableTensor]"]:
    if isinstance(target, Masker):
        return target.model, target.tensors
    if isinstance(target, nn.Module):
        tensors = _distinct_tensors(prunable_tensors(target))
        if not tensors:
            raise ValueError("target has no prunable tensors")
        return target, tensors
    raise TypeError(f"target must be a Masker or an nn.Module, got {type(target).__name__}")


def _group(target: Target):
    """The group DDP gradients are averaged over: the masker's, else the default one."""
    return target.group() if isinstance(target, Masker) else _dist.resolve_group(None)


def _sharded(params: List[Tensor]) -> bool:
    return any(_dist.is_dtensor(p) for p in params)


@contextlib.contextmanager
def _preserved(model: nn.Module, train: bool):
    """Run in train/eval mode; restore every module's mode and every buffer."""
    modes = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    model.train(train)
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, t in modes.items():
            m.training = t


def _batches(batches: Batches) -> List[Tuple[Tensor, Tensor]]:
    if isinstance(batches, tuple) and len(batches) == 2 and isinstance(batches[0], Tensor):
        batches = [batches]
    if isinstance(batches, (str, bytes, Tensor)) or not hasattr(batches, "__iter__"):
        raise TypeError(f"batches must be an iterable of (inputs, targets) pairs, got {type(batches).__name__}")
    out = list(batches)
    if not out:
        raise ValueError("batches must contain at least one (inputs, targets) pair")
    for i, b in enumerate(out):
        if not (isinstance(b, (tuple, list)) and len(b) == 2):
            raise TypeError(f"batches[{i}] must be an (inputs, targets) pair")
    return out


def random_scores(target: Target, generator: Optional[torch.Generator] = None) -> "OrderedDict[str, Tensor]":
    """Random scores ``S_j ~ N(0, 1)`` i.i.d. (App. F.2)."""
    _, tensors = _resolve(target)
    out = OrderedDict()
    for n, pt in tensors.items():
        p = pt.parameter
        s = torch.randn(p.shape, generator=generator, dtype=torch.float32)  # the whole tensor, also when sharded
        out[n] = _dist.like(_dist.local_part(s, p).to(_dist.local(p).device), p)
    return out


def magnitude_scores(target: Target) -> "OrderedDict[str, Tensor]":
    """Magnitude ``S = |phi|`` for SP (A.41), ``S = |lam|`` for IP (A.42)."""
    _, tensors = _resolve(target)
    with torch.no_grad():
        return OrderedDict((n, pt.effective().detach().abs()) for n, pt in tensors.items())


def _logits(out) -> Tensor:
    """The model's output tensor: the output itself, or the ``logits`` of a
    mapping such as transformers' ``ModelOutput``."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("logits"), Tensor):
        return out["logits"]
    raise TypeError(f"the model returned a {type(out).__name__}; the scores need a tensor of logits (or a mapping "
                    "with a 'logits' tensor, e.g. transformers' ModelOutput): wrap the model so that it returns one")


def _mean_grads(model, params, batches, loss_fn, temperature=1.0, group=None):
    """Mean gradient over the batches (and, under DDP, over the ranks of
    ``group``; under FSDP2 ``backward()`` averages over the ranks)."""
    acc = [torch.zeros_like(p) for p in params]
    for x, y in batches:
        if _sharded(params):
            gs = _backward_gradients(model, params, lambda: loss_fn(_logits(model(x)) / temperature, y))
        else:
            loss = loss_fn(_logits(model(x)) / temperature, y)
            gs = torch.autograd.grad(loss, params, allow_unused=True)
        for a, g in zip(acc, gs):
            if g is not None:
                a.add_(g.detach())
    out = [a / len(batches) for a in acc]
    if not _sharded(params):
        _dist.all_reduce_mean_(out, group)
    return out


def snip_scores(
    target: Target, batches: Batches, loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy
) -> "OrderedDict[str, Tensor]":
    """SNIP saliency ``S = |g * w|`` (A.54-A.57) with ``g = dL/dw`` averaged over
    the ``b`` given batches, BatchNorm in train mode (App. G.4).  ``w`` is the
    spatial weight (SP) or the FB coefficient ``lam`` (IP)."""
    model, tensors = _resolve(target)
    batches = _batches(batches)
    params = [pt.parameter for pt in tensors.values()]
    with _preserved(model, train=True), torch.enable_grad():
        grads = _mean_grads(model, params, batches, loss_fn, group=_group(target))
    with torch.no_grad():
        return OrderedDict((n, (g * pt.effective()).abs().detach()) for (n, pt), g in zip(tensors.items(), grads))


def grasp_scores(
    target: Target,
    batches: Batches,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    temperature: float = 1.0,
) -> "OrderedDict[str, Tensor]":
    """GraSP score ``S = -(H g) * w`` (A.61 for SP, A.62 for IP) with ``g`` the
    gradient and ``H`` the Hessian of the loss with respect to the prunable
    tensors, both averaged over the batches (BatchNorm in train mode).  ``H g``
    is a Hessian-vector product (A.78-A.80): with the gradient ``g_v`` held
    fixed, ``H g_v = d <dL/dw, g_v> / dw`` (three backward passes per batch).

    ``temperature`` divides the logits (GraSP's original code uses 200; the
    paper does not state one, 1 is the default here).

    Note on the sign: A.40 keeps the largest scores, but GraSP [82] (and its
    code, which the paper used) *removes* the entries with the largest
    ``-(H g) w``.  :class:`~prunopt.pruning.PruningAtInit` therefore ranks GraSP
    by ``-S`` (docs/pruning.md); this function returns ``S`` exactly as A.61/A.62
    define it."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or isinstance(temperature, int) \
            and temperature > 2**1023 or not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    model, tensors = _resolve(target)
    batches = _batches(batches)
    params = [pt.parameter for pt in tensors.values()]
    if _sharded(params):
        raise NotImplementedError(
            "GraSP needs a Hessian-vector product (a double backward), which FSDP2's sharded parameters do not "
            "support: compute GraSP scores before fully_shard (e.g. on every rank, or under DDP) and pass the "
            "masks on")
    group = _group(target)
    with _preserved(model, train=True), torch.enable_grad():
        g_fixed = _mean_grads(model, params, batches, loss_fn, temperature, group)  # first backward: g_v
        hg = [torch.zeros_like(p) for p in params]
        for x, y in batches:
            loss = loss_fn(_logits(model(x)) / temperature, y)
            gs = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)  # second
            z = sum((g * v).sum() for g, v in zip(gs, g_fixed) if g is not None)
            if not isinstance(z, Tensor) or not z.requires_grad:
                continue
            try:
                hvs = torch.autograd.grad(z, params, allow_unused=True)  # third: H g_v (A.80)
            except RuntimeError as e:
                if "derivative for" not in str(e):
                    raise
                raise RuntimeError(
                    "grasp_scores needs second derivatives (the Hessian-vector product of A.78-A.80), but an "
                    f"operation of the model has no double backward ({e}). For transformers models pick an "
                    "attention implementation that has one: model.set_attn_implementation('eager')") from e
            for a, h in zip(hg, hvs):
                if h is not None:
                    a.add_(h.detach())
        _dist.all_reduce_mean_(hg, group)  # the sum over the rank's batches, averaged over the ranks
    with torch.no_grad():
        return OrderedDict(
            (n, (-(h / len(batches)) * pt.effective()).detach()) for (n, pt), h in zip(tensors.items(), hg)
        )


def synflow_scores(target: Target, example_input: Union[Tensor, Sequence[int]]) -> "OrderedDict[str, Tensor]":
    """SynFlow ``S = (dR/dw) * w`` (A.44, A.47) with ``R`` the L1 path norm (A.45):
    every parameter and floating-point buffer is replaced by its absolute value,
    the network (BatchNorm in eval mode) is applied to an all-ones input and
    ``R = 1^T f(1)``.  All values are restored exactly afterwards.

    ``example_input`` is an input batch (only its shape, dtype and device are
    used; one sample is fed) or the shape of one sample, e.g. ``(3, 32, 32)``."""
    model, tensors = _resolve(target)
    params = [pt.parameter for pt in tensors.values()]
    if isinstance(example_input, Tensor):
        if example_input.dim() == 0:
            raise ValueError("example_input must be a batch of inputs (at least 1-d)")
        # (any dtype the model takes: token ids for a language model, where the
        # all-ones input is token 1 everywhere; a model that cannot take it is a
        # RuntimeError naming example_input, see _run_on)
        ones = torch.ones_like(example_input[:1])
    elif isinstance(example_input, (tuple, list, torch.Size)) and len(example_input) > 0 and all(
            isinstance(s, int) and not isinstance(s, bool) and 0 < s < 2**63 for s in example_input):
        p0 = params[0]
        ones = torch.ones((1, *example_input), dtype=p0.dtype, device=p0.device)
    else:
        raise TypeError("example_input must be an input tensor or a shape (sequence of positive ints)")
    values = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    saved = [t.detach().clone() for t in values]
    with _preserved(model, train=False):
        try:
            with torch.no_grad():
                for t in values:
                    t.abs_()
            with torch.enable_grad():
                if _sharded(params):  # FSDP2: backward() (every rank computes the same R; averaged)
                    grads = _backward_gradients(model, params, lambda: _logits(_run_on(model, ones)).sum())
                else:
                    grads = torch.autograd.grad(_logits(_run_on(model, ones)).sum(), params, allow_unused=True)
            with torch.no_grad():
                out = OrderedDict(
                    (n, torch.zeros_like(pt.parameter) if g is None else (g * pt.effective()).detach())
                    for (n, pt), g in zip(tensors.items(), grads)
                )
        finally:
            with torch.no_grad():
                for t, s in zip(values, saved):
                    t.copy_(s)
    return out


def _run_on(model: nn.Module, ones: Tensor):
    """``model(ones)``; an input the model cannot take is a RuntimeError naming
    ``example_input`` (the model's parameters are restored by the caller)."""
    try:
        return model(ones)
    except (RuntimeError, ValueError, TypeError) as e:
        raise RuntimeError(f"synflow: the model does not run on an input shaped like example_input "
                           f"{tuple(ones.shape[1:])}: {e}") from e


SCORES = {
    "random": random_scores,
    "magnitude": magnitude_scores,
    "snip": snip_scores,
    "grasp": grasp_scores,
    "synflow": synflow_scores,
}
