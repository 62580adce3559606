r"""prunAdag: pruning-aware Adagrad with a global top-T relevant set (Porcelli et al.;
Porcelli, Seraghiti, Toint 2025, Algorithm 2.1).

Per step, over the ``n`` elements that take part (the pruned parameters of a
selection scope):

.. math::
    g &\leftarrow \pm g + \lambda x, \qquad lr_k = lr / (1 + k\,\mathrm{lr\_decay}) \\
    \mathcal R &= \{i : |g_i| \ge \tau\},\ \tau = T\text{-th largest } |g| \quad (2.6) \\
    (w^O_i)^2 &\leftarrow (w^O_i)^2 + g_i^2,\quad s_i = -lr_k\, g_i / (w^O_i + \epsilon) \quad (2.7, 2.9) \\
    \mathcal M &= \{i \notin \mathcal R : x_i g_i > 0\},\quad
    \mathcal A = \{i \in \mathcal M : a_i \le |s_i| \le b_i\} \quad (2.8,\ \text{Table 1}) \\
    \mathcal O &= \mathcal R \cup \mathcal A: x_i \mathrel{+}= s_i;\qquad
    \mathcal D = \mathcal O^C: (w^D_i)^2 \mathrel{+}= x_i^2,\ x_i \mathrel{-}= \mathrm{sign}(x_i)\min(a_i, |s^L_i|)\ [i \in \mathcal M] \quad (2.10, 2.16)

with ``a_i = lr_k |x_i| / (k+1) * r`` (versions 1, 3; ``r = ||g||_R / ||x||_M``)
or without ``r`` (versions 2, 4), and ``b_i = |x_i|`` (versions 3, 4) or infinity.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from prunopt._extension import extension_available
from prunopt.optim._sharded import sharded_view
from prunopt.reference.prunadag import (VERSIONS, TensorHyper, effective_grad, prunadag_step_reference, resolve_relevant,
                                        step_lr)

__all__ = ["PrunAdag", "prunadag"]

SCOPES = ("global", "group", "tensor")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _version_code(version) -> int:
    return 0 if version == "relevant_only" else int(version)


def _normalize_relevant(relevant):
    """``relevant`` as a Python int or float (numpy and other ``numbers``
    scalars keep their int/float meaning); anything else is returned as is
    for :func:`_check_relevant` to reject."""
    if isinstance(relevant, bool) or isinstance(relevant, (int, float)):
        return relevant
    if isinstance(relevant, numbers.Integral):
        return int(relevant)
    if isinstance(relevant, numbers.Real):
        return float(relevant)
    return relevant


def _check_relevant(relevant, name="relevant"):
    if isinstance(relevant, bool) or not isinstance(relevant, (int, float)):
        raise TypeError(f"{name} must be an int >= 1 or a float in (0, 1], got {type(relevant).__name__}")
    if isinstance(relevant, int):
        if relevant < 1:
            raise ValueError(f"{name} must be >= 1 when it is an int, got {relevant}")
    elif not (0.0 < relevant <= 1.0):
        raise ValueError(f"{name} must be in (0, 1] when it is a float, got {relevant}")


# torch.optim.Adagrad's wording of its range errors (one message per key)
_HYPER_LABELS = {"lr": "learning rate", "lr_decay": "lr_decay value", "weight_decay": "weight_decay value",
                 "initial_accumulator_value": "initial_accumulator_value value", "eps": "epsilon value"}


def _check_hyper(group: dict) -> None:
    """Validates one param group (the constructor's defaults too). Types and
    ranges raise ``TypeError`` / ``ValueError`` naming the argument, flag
    combinations raise ``RuntimeError`` with ``torch.optim``'s messages."""
    for key, label in _HYPER_LABELS.items():
        v = group[key]
        if isinstance(v, Tensor):
            if key != "lr":
                raise TypeError(f"{key} must be a real number, got a Tensor (only lr may be a Tensor)")
            if v.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
            if not v.is_floating_point():
                raise TypeError(f"a Tensor lr must have a floating dtype, got {v.dtype}")
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{key} must be a real number, got {type(v).__name__}")
        try:
            v = float(v)
        except OverflowError:  # an int beyond the float range, e.g. 10**400
            raise ValueError(f"Invalid {label}: an integer beyond the float range ({key} must be a finite number "
                             ">= 0)") from None
        if not (v >= 0.0) or math.isinf(v):
            raise ValueError(f"Invalid {label}: {v} ({key} must be a finite number >= 0)")
    _check_relevant(group["relevant"])
    version = group["version"]
    if not isinstance(version, (str, numbers.Integral)) or isinstance(version, bool) or version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {group['version']!r}")
    if group["scope"] not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {group['scope']!r}")
    for key in ("prune", "maximize", "differentiable"):
        if not isinstance(group[key], bool):
            raise TypeError(f"{key} must be a bool, got {type(group[key]).__name__}")
    for key in ("foreach", "fused"):
        if group[key] is not None and not isinstance(group[key], bool):
            raise TypeError(f"{key} must be None or a bool, got {type(group[key]).__name__}")
    if group["differentiable"]:
        raise ValueError("differentiable=True is not supported by PrunAdag (the relevant set of eq. 2.6 and the "
                         "sets A, D are chosen by comparisons, not differentiable operations); use "
                         "differentiable=False")
    if group["foreach"] and group["fused"]:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if group["fused"] and not extension_available():
        raise RuntimeError("`fused=True` needs the compiled extension prunopt._C, which is not loaded")


def _writes_overlap(t: Tensor) -> bool:
    """Whether an in-place write to ``t`` would hit one memory location twice
    (a stride-0 dimension of size > 1, e.g. an ``expand``-ed tensor): the
    case in which PyTorch's in-place ops raise. Metadata only."""
    if t.is_contiguous():
        return False
    return any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride()))


def _check_steps(steps: List[Tensor], name: str = "state_steps") -> None:
    """Step counters ``k`` must be finite and >= 0 (``lr_k / (k + 1)`` of
    Table 1 divides by ``k + 1``): ``ValueError`` otherwise. Reads them on the
    host (one read)."""
    steps = [st for st in steps if st.numel() == 1 and not st.is_meta]  # other shapes: _check_grads
    if not steps:
        return
    devs = {st.device for st in steps}
    if devs == {torch.device("cpu")} and len({st.dtype for st in steps}) == 1:
        # (on the CPU a read is free: one stack and one list, no per-counter ops)
        ks = torch.stack([st.detach().reshape(()) for st in steps]).tolist()
        ok = all(math.isfinite(v) and v >= 0 for v in ks)
    elif len(devs) == 1:
        k = torch.stack([st.detach().reshape(()).to(torch.float64) for st in steps])
        ok = bool((torch.isfinite(k) & (k >= 0)).all())
    else:
        ok = all(math.isfinite(v) and v >= 0 for v in (float(st) for st in steps))
    if not ok:
        bad = next(float(st) for st in steps if not (math.isfinite(float(st)) and float(st) >= 0))
        raise ValueError(f"{name}: step counts must be finite and >= 0, got {bad}; nothing was updated")


def _fused_supported(tensors: List[Tensor]) -> bool:
    if not extension_available() or not tensors:
        return False
    from prunopt.ops import PRUNADAG_DEVICES

    t0 = tensors[0]
    return (
        t0.device.type in PRUNADAG_DEVICES
        and t0.dtype in _FUSED_DTYPES
        and all(t.device == t0.device and t.dtype == t0.dtype for t in tensors)
    )


class _Scope:
    """The tensors of one selection scope and their per-tensor hyper-parameters."""

    def __init__(self):
        self.params: List[Tensor] = []
        self.grads: List[Tensor] = []
        self.opt_sums: List[Tensor] = []
        self.dec_sums: List[Tensor] = []
        self.steps: List[Tensor] = []
        self.hypers: List[TensorHyper] = []
        self.relevant = 1.0
        self.version = 3
        # the fused op's rows (_hyper_tensor) once a step has built them (a scope
        # lives for one step: its counters and hyper-parameters do not change)
        self.hyper: Optional[Tensor] = None

    def n(self) -> int:
        return sum(p.numel() for p, h in zip(self.params, self.hypers) if h.prune)

    def target(self) -> int:
        n = self.n()
        return resolve_relevant(self.relevant, n) if n > 0 else 0


def _check_grads(scopes: List[_Scope]) -> None:
    """Gradients and state against their parameters, before anything is
    written: a state of another shape, dtype or device (e.g. a state dict
    loaded into an optimizer whose parameters come in another order) raises
    ValueError here instead of failing half-way through the step, and so does
    a tensor the step would write in place whose elements share memory (an
    ``expand``-ed parameter: RuntimeError, as PyTorch's in-place ops raise)."""
    strided = torch.strided
    for s in scopes:
        for i, (p, g, so, sd, st) in enumerate(zip(s.params, s.grads, s.opt_sums, s.dec_sums, s.steps)):
            # one cheap test per tensor (attributes only); the messages below
            shape, dtype, dev = p.shape, p.dtype, p.device
            if (g.layout is strided and not g.dtype.is_complex and not dtype.is_complex and g.shape == shape
                    and so.shape == shape and sd.shape == shape and so.dtype == dtype and sd.dtype == dtype
                    and so.device == dev and sd.device == dev and st.numel() == 1
                    and not (_writes_overlap(p) or _writes_overlap(so) or _writes_overlap(sd))):
                continue
            for name, t in (("parameter", p), ("state 'sum'", so), ("state 'decrease_sum'", sd)):
                if _writes_overlap(t):
                    raise RuntimeError(
                        f"PrunAdag: a {name} of shape {tuple(t.shape)} has more than one element referring to a "
                        f"single memory location (stride {tuple(t.stride())}, e.g. an expand()-ed tensor), so it "
                        "cannot be updated in place; clone() it. Nothing was updated")
            if g.is_sparse or g.layout != strided:
                raise TypeError("PrunAdag does not support sparse gradients")
            if torch.is_complex(p) or torch.is_complex(g):
                raise TypeError("PrunAdag does not support complex parameters or gradients")
            if g.shape != shape:
                raise ValueError(f"grad of shape {tuple(g.shape)} does not match its parameter {tuple(shape)}")
            for name, t in (("sum", so), ("decrease_sum", sd)):
                if t.shape != shape or t.dtype != dtype or t.device != dev:
                    raise ValueError(
                        f"state {name!r} (opt_sums / dec_sums) of shape {tuple(t.shape)}, {t.dtype} on {t.device} does "
                        f"not match its parameter ({tuple(shape)}, {dtype} on {dev}); was a state dict loaded into an "
                        "optimizer whose parameters come in another order? Nothing was updated")
            raise ValueError(f"state 'step' (state_steps) must be a one-element tensor, got shape {tuple(st.shape)}")


def _check_finite(scopes: List[_Scope]) -> None:
    """Non-finite gradients (documented behaviour): the whole step is rejected
    with ValueError before anything is written."""
    for s in scopes:
        for p, g, h in zip(s.params, s.grads, s.hypers):
            if not bool(torch.isfinite(effective_grad(p, g, h)).all()):
                raise ValueError("PrunAdag: grads contain a non-finite value; the step was skipped (nothing was updated)")


def _single_tensor_scope(s: _Scope, T: int, selection: Optional[tuple] = None) -> None:
    hypers = [TensorHyper(**{**h.__dict__, "k": float(st.item())}) for h, st in zip(s.hypers, s.steps)]
    if selection is not None:
        tau, ratio = selection
        selection = (0.0 if tau is None else float(tau), float(ratio))
    prunadag_step_reference(s.params, s.grads, s.opt_sums, s.dec_sums, hypers, T, s.version, selection)


def _foreach_scope(s: _Scope, T: int, flag: Optional[Tensor] = None, selection: Optional[tuple] = None) -> None:
    """Batched path: one flat buffer per role, whole-vector ops, then copy back.

    No host synchronisation and no host read (so no graph break under
    ``torch.compile``): the per-tensor scalars come from :func:`_hyper_tensor`,
    the threshold and the ratio ``r`` stay tensors. With ``flag`` (a
    one-element float32 tensor, 1 if the step must be skipped) every write
    keeps the old values where the flag is set. ``selection=(tau, r)`` (0-dim
    tensors; ``tau=None``: every element relevant) gives the threshold and
    the ratio instead of computing them from ``T`` (a scope sharded over
    several processes)."""
    if not s.params:
        return
    dtypes = {p.dtype for p in s.params}
    if len(dtypes) > 1 or len({p.device for p in s.params}) > 1:
        if flag is not None and bool(flag.item() != 0):
            return
        return _single_tensor_scope(s, T, selection)  # a flat buffer needs one dtype and device
    with torch.no_grad():
        sizes = [p.numel() for p in s.params]
        total = sum(sizes)
        dt = s.params[0].dtype
        hyper = _hyper_tensor(s)
        x = torch.cat([p.reshape(-1) for p in s.params])
        g = torch.cat([effective_grad(p, gr, h).reshape(-1) for p, gr, h in zip(s.params, s.grads, s.hypers)])
        so = torch.cat([t.reshape(-1) for t in s.opt_sums])
        sd = torch.cat([t.reshape(-1) for t in s.dec_sums])
        def per_elem(col: Tensor) -> Tensor:
            # one value per tensor (float64): a 0-dim tensor for one tensor,
            # else repeated to one per element (expanded views, one cat: on
            # the CPU torch.repeat_interleave costs ~20 ms here), in the params' dtype
            col = col.to(dt) if col.dtype != torch.bool else col
            if len(sizes) == 1:
                return col[0]
            return torch.cat([c.expand(n) for c, n in zip(col.unbind(), sizes)])

        all_pruned = all(h.prune for h in s.hypers)
        prune = None if all_pruned else per_elem(hyper[:, 5] != 0)
        n = sum(sz_ for sz_, h in zip(sizes, s.hypers) if h.prune)
        ag = g.abs()
        if selection is not None:
            tau = selection[0]
            rel = torch.ones_like(ag, dtype=torch.bool) if tau is None else ag >= tau.to(ag.dtype)
            if not all_pruned and tau is not None:
                rel |= ~prune
        elif n > 0 and T < n:
            # the T-th largest |g| of the pruned elements: the others rank below
            # every |g| >= 0 as -1 (no boolean indexing: static shapes)
            tau = torch.kthvalue(ag if all_pruned else torch.where(prune, ag, -1.0), total - T + 1).values
            rel = ag >= tau
            if not all_pruned:
                rel |= ~prune
        else:
            rel = torch.ones_like(ag, dtype=torch.bool)
        m = (~rel) & (x * g > 0)
        g_r = (g.double().pow(2) * (rel if all_pruned else rel & prune)).sum()
        x_m = (x.double().pow(2) * m).sum()
        lr_k = per_elem(hyper[:, 0])
        eps = per_elem(hyper[:, 3])
        if s.version in (2, 4):
            scale = per_elem(hyper[:, 1])
        else:
            if selection is not None:
                ratio = selection[1].to(device=x_m.device, dtype=torch.float64)
            else:
                ratio = torch.where(x_m > 0, g_r.sqrt() / x_m.sqrt(), torch.zeros_like(x_m))
            scale = per_elem(hyper[:, 1] * ratio)
        so_new = so + g * g
        s_opt = (g * -lr_k) / (so_new.sqrt() + eps)
        ax = x.abs()
        a = ax * scale
        if s.version == "relevant_only":
            acc = torch.zeros_like(m)
        else:
            acc = m & (a <= s_opt.abs())
            if s.version in (3, 4):
                acc &= s_opt.abs() <= ax
        opt = rel | acc
        sd_new = sd + x * x
        s_l = (ax * lr_k) / (sd_new.sqrt() + eps)
        dec = torch.where(m, torch.minimum(a, s_l), torch.zeros_like(a))
        x_new = torch.where(opt, x + s_opt, x - torch.sign(x) * dec)
        so_out = torch.where(opt, so_new, so)
        sd_out = torch.where(opt, sd, sd_new)
        if flag is not None:
            skip = flag.reshape(()) != 0
            x_new, so_out, sd_out = (torch.where(skip, old, new) for old, new in
                                     ((x, x_new), (so, so_out), (sd, sd_out)))
        for dst, src in ((s.params, x_new), (s.opt_sums, so_out), (s.dec_sums, sd_out)):
            torch._foreach_copy_(dst, [c.view_as(d) for c, d in zip(src.split(sizes), dst)])


def _hyper_tensor(s: _Scope) -> Tensor:
    """Per-tensor scalars for the fused op (float64, on the params' device):
    columns ``[lr_k, lr_k / (k+1), weight_decay, eps, maximize, prune]``.

    Built with tensor ops from the step counters, so it needs no host
    synchronisation on CUDA and no host read under ``torch.compile`` (a float
    ``lr`` that a scheduler changes becomes a graph input there, a tensor
    ``lr`` is one already). In eager mode on the CPU, with float learning
    rates, the counters are read on the host instead: the same float64
    operations, ~10 tensor ops fewer."""
    dev = s.params[0].device
    tensor_lr = any(isinstance(h.lr, Tensor) for h in s.hypers)
    if (dev.type == "cpu" and not tensor_lr and not torch.compiler.is_compiling()
            and all(not st.is_cuda for st in s.steps)):
        ks = (torch.stack(s.steps).tolist() if all(st.dim() == 0 for st in s.steps)
              else [float(st.item()) for st in s.steps])
        rows = []
        for h, k in zip(s.hypers, ks):
            lr_k = step_lr(h.lr, h.lr_decay, k)
            rows.append([lr_k, lr_k / (k + 1.0), h.weight_decay, h.eps, float(h.maximize), float(h.prune)])
        return torch.tensor(rows, dtype=torch.float64)
    if all(st.dim() == 0 and st.device == dev for st in s.steps):
        k = torch.stack(s.steps).to(torch.float64)  # one op, not one per tensor
    else:
        k = torch.stack([st.reshape(()).to(device=dev, dtype=torch.float64) for st in s.steps])
    # lr_k per run of tensors that share one hyper-parameter set (a param
    # group): a float, SymFloat or tensor lr enters through tensor arithmetic
    lr_k_parts, start = [], 0
    for i in range(1, len(s.hypers) + 1):
        if i == len(s.hypers) or s.hypers[i] is not s.hypers[start]:
            h = s.hypers[start]
            lr = h.lr.to(device=dev, dtype=torch.float64).reshape(()) if isinstance(h.lr, Tensor) else h.lr
            lr_k_parts.append(step_lr(lr, h.lr_decay, k[start:i]))
            start = i
    lr_k = lr_k_parts[0] if len(lr_k_parts) == 1 else torch.cat(lr_k_parts)
    consts = torch.tensor([[h.weight_decay, h.eps, float(h.maximize), float(h.prune)] for h in s.hypers],
                          dtype=torch.float64)
    if dev.type == "cuda" and not torch.compiler.is_compiling():
        # a copy from pageable host memory would synchronise with the device
        # (the host would wait for the previous step's kernels): pinned + async
        consts = consts.pin_memory().to(dev, non_blocking=True)
    else:
        consts = consts.to(dev)
    return torch.cat([torch.stack([lr_k, lr_k / (k + 1.0)], dim=1), consts], dim=1)


def _fused_scope(s: _Scope, T: int, found_nonfinite: Optional[Tensor] = None,
                 selection: Optional[tuple] = None) -> None:
    if not s.params:
        return
    sel = None
    if selection is not None:
        # (tau, r) or (tau, r, checked): checked = every gradient of the scope is
        # known to be finite (the kernel then skips its own check)
        tau, ratio = selection[:2]
        dev = s.params[0].device
        checked = len(selection) > 2 and selection[2]
        if dev.type == "cuda":  # (on the device: no host read)
            tau = torch.zeros((), dtype=torch.float64, device=dev) if tau is None else tau.to(dev, torch.float64)
            parts = [tau.reshape(()), ratio.to(dev, torch.float64).reshape(())]
            if checked:
                parts.append(torch.ones((), dtype=torch.float64, device=dev))
            sel = torch.stack(parts)
        else:  # (the kernels take it on the host: one small tensor)
            sel = torch.tensor([0.0 if tau is None else float(tau), float(ratio)] + ([1.0] if checked else []),
                               dtype=torch.float64)
    hyper = s.hyper if s.hyper is not None else _hyper_tensor(s)
    torch.ops.prunopt.prunadag_step_(
        s.params, s.opt_sums, s.dec_sums, s.grads, hyper, T,  # the kernels make grads contiguous
        _version_code(s.version), found_nonfinite, sel,
    )


def _flag_nonfinite(scopes: List[_Scope], flag: Tensor) -> None:
    """``flag = 1`` if an effective gradient of any scope is not finite, with
    tensor ops only (no host synchronisation on CUDA)."""
    for s in scopes:
        for p, g, h in zip(s.params, s.grads, s.hypers):
            bad = (~torch.isfinite(effective_grad(p, g, h))).any().to(device=flag.device, dtype=flag.dtype)
            flag.copy_(torch.maximum(flag, bad.reshape(flag.shape)))


def _run_scopes(scopes: List[_Scope], impl: str, found_nonfinite: Optional[Tensor] = None) -> None:
    """One step over the scopes. Non-finite effective gradients: without
    ``found_nonfinite`` the step raises ValueError and changes nothing; with it
    (a one-element float32 tensor) nothing changes either, ``found_nonfinite``
    is set to 1, and step counters on its device do not advance — all without
    a host synchronisation on the fused path (used by PrunAdag on CUDA).
    The callers have run :func:`_check_grads` (before choosing the path)."""
    targets = [s.target() for s in scopes]  # validates int T <= n before any write
    flag = found_nonfinite
    if flag is not None:
        if flag.dtype != torch.float32 or flag.numel() != 1:
            raise ValueError("found_nonfinite must be a one-element float32 tensor")
        if impl != "fused" or len(scopes) > 1:
            _flag_nonfinite(scopes, flag)  # one fused call checks its own scope before writing
        if impl == "single" and bool(flag.item() != 0):
            return  # reference path: nothing written, counters unchanged
        for s, T in zip(scopes, targets):
            if impl == "fused":
                _fused_scope(s, T, flag)  # writes nothing once the flag is set
            elif impl == "foreach":
                _foreach_scope(s, T, flag)  # keeps the old values where the flag is set (no host read)
            else:
                _single_tensor_scope(s, T)
        steps = [st for s in scopes for st in s.steps]
        on_flag_device = [st for st in steps if st.device == flag.device]
        if on_flag_device:  # one foreach launch, the increment computed once
            # a list of tensors, not one tensor as the scalar: the latter reads it
            # on the host (a synchronisation, seen in torch 2.11 on CUDA)
            inc = 1.0 - flag.reshape(())
            torch._foreach_add_(on_flag_device, [inc] * len(on_flag_device))
        host = [st for st in steps if st.device != flag.device]
        if host:  # host counters for device params: advancing them conditionally would sync
            torch._foreach_add_(host, 1)
        return
    if impl == "fused":
        # One kernel call is atomic (it validates before writing); with several
        # calls the finiteness check runs first so that nothing is half-updated.
        if len(scopes) > 1:
            _check_finite(scopes)
        fn = _fused_scope
    else:
        _check_finite(scopes)
        fn = _foreach_scope if impl == "foreach" else _single_tensor_scope
    for s, T in zip(scopes, targets):
        fn(s, T)
    steps = [st for s in scopes for st in s.steps]
    if steps:
        torch._foreach_add_(steps, 1)


def _local_scope(s: _Scope, view) -> _Scope:
    """The part of a scope this rank holds (views of the local shards)."""
    loc = _Scope()
    loc.params = [view.local(t) for t in s.params]
    loc.grads = [view.local(t) for t in s.grads]
    loc.opt_sums = [view.local(t) for t in s.opt_sums]
    loc.dec_sums = [view.local(t) for t in s.dec_sums]
    loc.steps, loc.hypers, loc.relevant, loc.version = list(s.steps), list(s.hypers), s.relevant, s.version
    return loc


def _selection_keys(loc: _Scope, counted: List[bool]):
    """The pruned local ``|g|`` keys of a scope for the threshold (effective
    gradients: the raw ones when no weight decay changes them; one dtype,
    float64 if the scope mixes dtypes), with whether each one is counted here."""
    keys, flags = [], []
    for p, g, h, c in zip(loc.params, loc.grads, loc.hypers, counted):
        if h.prune:
            keys.append(g if h.weight_decay == 0 else effective_grad(p, g, h))
            flags.append(c)
    if len({k.dtype for k in keys}) > 1:
        keys = [k.double() for k in keys]
    return keys, flags


def _local_hyper(loc: _Scope, counted: List[bool]) -> Tensor:
    """The fused op's rows for this rank's part of a scope, with the prune flag
    cleared on tensors counted on another rank (replicas take no part)."""
    if loc.hyper is None:
        loc.hyper = _hyper_tensor(loc)
    if all(counted):
        return loc.hyper
    hyper = loc.hyper.clone()
    hyper[:, 5] *= torch.tensor([float(c) for c in counted], dtype=torch.float64, device=hyper.device)
    return hyper


def _local_norms(loc: _Scope, counted: List[bool], tau: Optional[Tensor]) -> Tensor:
    """This rank's share of ``||g||_R^2`` and ``||x||_M^2`` (Table 1) and
    whether an effective gradient here is not finite: float64 ``[g, x, bad]``
    on the params' device (the ``prunadag_norms`` op: one pass, no host read;
    the reference when the scope mixes dtypes or devices). Tensors counted on
    another rank (replicas) take no part in the norms."""
    from prunopt.ops.prunadag import prunadag_norms
    from prunopt.reference.prunadag import prunadag_norms_reference

    dev = loc.params[0].device
    t = torch.zeros((), dtype=torch.float64, device=dev) if tau is None else tau.to(dev, torch.float64)
    if len({p.dtype for p in loc.params}) == 1 and len({p.device for p in loc.params}) == 1:
        return prunadag_norms(loc.params, loc.grads, _local_hyper(loc, counted), t.reshape(1))
    hypers = [TensorHyper(**{**h.__dict__, "prune": h.prune and c}) for h, c in zip(loc.hypers, counted)]
    return prunadag_norms_reference(loc.params, loc.grads, hypers, t).to(dev)


# The fused select's answer when an effective gradient on some rank is not finite
_NONFINITE = object()
# ||x||^2 leaves out squares below this (per dtype) in the fused scan, ||g||^2
# sums float32 squares in short float blocks: below these fractions of n the
# norms are taken again in double (as the one-process fused step does)
_XMIN = {torch.float32: 2.0 ** -60, torch.float64: 2.0 ** -500}


def _masked_sums(c: np.ndarray, up: np.ndarray, m: np.ndarray, down: np.ndarray) -> Tuple[float, float]:
    """``(sum c^2 where up, sum m where down)`` in float64 (numpy's pairwise
    sums: one order on every rank and run). The sums multiply by the masks
    instead of selecting with them: the masked values lie in no order, so a
    selection mispredicts a branch per value (2.5-4x slower); an overflowed
    square (inf) times a 0 of its mask is NaN, and then they select."""
    with np.errstate(over="ignore", invalid="ignore"):
        c2 = np.square(c.astype(np.float64, copy=False))
        a, b = float(np.multiply(c2, up).sum()), float(np.multiply(m, down).sum())
    if not math.isfinite(a + b):
        a, b = float(np.where(up, c2, 0.0).sum()), float(np.where(down, m, 0.0).sum())
    return a, b


def _window_entries(dtype: torch.dtype, slots: int) -> int:
    """The candidates a rank's window of ``slots`` int64 slots holds (see
    :meth:`_FusedShare.window`): two slots for the sums, then one per float32
    candidate (packed with its ``sqrt(m)``), two per float64 one."""
    return slots - 2 if dtype == torch.float32 else (slots - 2) // 2


class _FusedShare:
    """This rank's part of the fused select (:func:`_fused_select`) with its
    collectives left to the caller (the tests run several ranks in one process
    with it):

    * round 1 (the constructor): this rank's bracket of its share
      ``ceil(T / W)`` of the top-``T``, from a fixed sample of its effective
      gradients ``ge`` (the kernels' formula), widened to a grid of ``2**j``
      ulps as :class:`prunopt.distributed._OwnSlice` does, and one
      ``prunadag_bracket`` pass with that grid bracket ``[lo_r, hi_r]``:
      ``a`` (the count of ``|ge| > hi_r``), ``G`` (their ``ge^2``), ``X``
      (the sign-matched ``x^2`` of ``|ge| < lo_r``), the candidates
      ``c = |ge|`` inside with their sign-matched ``x^2`` ``m``, and whether an
      effective gradient (pruned or not) is not finite. ``own`` is the slice
      the first collective carries (the candidates' histogram on the grid);
    * round 2 (:meth:`candidates`): for the bracket ``[L, H]`` every rank
      derives from all slices, this rank's candidates in it with their
      weights ``(c^2, m)`` and the sums outside it."""

    def __init__(self, loc: _Scope, counted: List[bool], T: int, world: int):
        from prunopt import distributed as D

        self.loc, self.dtype = loc, loc.params[0].dtype
        self.hyper = _local_hyper(loc, counted)
        # round 1 and the window in one call of the fused op (the window holds
        # at most the candidates that fit in a rank's slots after the sums)
        cap = _window_entries(self.dtype, D._window_slots(world)) if D._window_area(world) else 0
        with torch.no_grad():
            head, sums, hist, w_bits, w_m, keys, m = torch.ops.prunopt.prunadag_slice(
                loc.params, loc.grads, self.hyper, -(-T // world), D._rank_buckets(world), cap, D._sample_shape())
        h, (G, X, G_w, X_w) = head.tolist(), sums.tolist()
        self.own = D._OwnSlice(h, hist, keys, self.dtype, (G, X, m))
        self._window = (h[6:10], (G_w, X_w), w_bits, w_m)
        self.reread = False

    def _scan(self, lo: float, hi: float):
        """One ``prunadag_bracket`` pass for ``[lo, hi]``: ``(a, keys, G, X,
        m)``; ``ValueError`` when an effective gradient is not finite."""
        from prunopt.ops.prunadag import prunadag_bracket

        with torch.no_grad():
            summary, keys, m = prunadag_bracket(self.loc.params, self.loc.grads, self.hyper, lo, hi)
        a, G, X, bad = summary.tolist()
        if bad:
            raise ValueError("PrunAdag: an effective gradient is not finite")
        return int(a), keys, G, X, m

    def window(self, share: int, slots: int):
        """Round 1's window for the one-collective select (the prunAdag form
        of the plain select's window, from ``prunopt.ops.prunadag_slice``,
        read back by :func:`_window_select`): the candidates of whole grid
        buckets ``[lo, end)`` around this rank's share ``ceil(T / W)``, each
        with its sign-matched ``x^2`` ``m``, as many as fit in ``slots`` after
        two for the sums (float32: one slot each, float64: two). Returns
        ``(head, slots)``: ``head = [a, lo, end, count]`` (``count = -1``
        when they do not fit) and int64 slots holding the bit patterns of
        ``G_w = G + sum_{c >= end} c^2`` and ``X_w = X + sum_{c < lo} m``
        (float64), then the candidates: float32, each slot a candidate's bit
        pattern in its low 32 bits and ``sqrt(m)``'s (``|x|`` or 0, exact: the
        square of a float32 is exact in float64) in its high 32; float64, a
        candidate's bit pattern, then ``m``'s. For any ``t`` in ``[lo, end)``
        this rank's ``||g||^2`` over ``|ge| >= t`` is ``G_w + sum_{window c
        >= t} c^2`` and its ``x^2`` over ``|ge| < t`` is ``X_w + sum_{window c
        < t} m``. (``share`` and ``slots`` are the ones the op was given.)"""
        from prunopt import distributed as D

        if not self.own.n_r:  # (no pruned values here: no sums either)
            return [0, 0, D._max_finite_bits(self.dtype) + 1, 0], torch.zeros(2, dtype=torch.int64)
        head, sums, bits, m = self._window
        if head[3] < 0:
            return [0, 0, 0, -1], None
        cb, cm = bits.numpy().astype(np.int64), m.numpy()
        packed = self.dtype == torch.float32
        out = np.empty(2 + (1 if packed else 2) * cb.size, dtype=np.int64)
        out[:2] = np.array(sums, dtype=np.float64).view(np.int64)
        if packed:
            out[2:] = (np.sqrt(cm).astype(np.float32).view(np.int32).astype(np.int64) << 32) | cb
        else:
            out[2::2] = cb
            out[3::2] = cm.view(np.int64)
        return head, torch.from_numpy(out)

    def _split(self, lo: int, end: int):
        """Round 1's candidates split at the bit patterns ``lo`` and ``end``:
        ``(n_up, g_up, x_down, bits, m, inside)``, the count and the summed
        ``c^2`` of the candidates ``>= end``, the summed ``m`` of those
        ``< lo`` (float64, numpy's pairwise sums: one order on every run),
        the candidates' bit patterns (of ``|ge|``: ``-0.0`` is ``0.0``) and
        ``m`` as numpy arrays, and the indices of those in ``[lo, end)``.
        (The sums: :func:`_masked_sums`.)"""
        from prunopt import distributed as D

        keys, m = self.own.inside.numpy(), self.own.more[2].numpy()
        spec = D._RADIX[self.dtype]
        bits = keys.view(np.int32 if self.dtype == torch.float32 else np.int64) & ((1 << spec.nbits) - 1)
        up, down = bits >= end, bits < lo
        g_up, x_down = _masked_sums(keys, up, m, down)
        return int(np.count_nonzero(up)), g_up, x_down, bits, m, np.flatnonzero(~(up | down))

    def candidates(self, lo_bits: int, hi_bits: int):
        """Round 2 for ``[L, H]`` (bit patterns): ``(cands, above, (c2, m),
        (G2, X2))``, this rank's ``|ge|`` in ``[L, H]``, its count of
        ``|ge| > H``, the candidates' ``c^2`` and ``m`` (float64), and
        ``G2 = sum ge^2`` over ``|ge| > H``, ``X2`` the sign-matched ``x^2``
        over ``|ge| < L``. From round 1's candidates when its bracket covers
        ``[L, H]``: ``G2 = G + sum_{c > H} c^2``, ``X2 = X + sum_{c < L} m``,
        ``above = a + #{c > H}``; else from another pass with ``[L, H]``
        (``reread`` is then set)."""
        from prunopt import distributed as D

        own, dtype = self.own, self.dtype
        if not own.n_r:
            none = torch.zeros(0, dtype=torch.float64)
            return own.inside, 0, (none, none), (0.0, 0.0)
        if own.covers(lo_bits, hi_bits):
            n_up, g_up, x_down, _, m, inside = self._split(lo_bits, hi_bits + 1)
            keys = own.inside[torch.from_numpy(inside)]  # (inside: indices)
            G, X = own.more[0], own.more[1]
            c2 = keys.double().square()
            return keys, own.above + n_up, (c2, torch.from_numpy(m[inside])), (G + g_up, X + x_down)
        self.reread = True  # (round 1 found every effective gradient here finite: no ValueError)
        a, keys, G, X, m = self._scan(D._bits_value(lo_bits, dtype), D._bits_value(hi_bits, dtype))
        return keys, a, (keys.double().square(), m), (G, X)


def _window_select(vec: Tensor, world: int, T: int, dtype: torch.dtype):
    """``(tau, g_r2, x_m2)`` from every rank's :meth:`_FusedShare.window`
    in the summed first collective ``vec``, or ``None`` when the windows do
    not show ``tau`` (the same on every rank): ``tau`` as in
    :func:`prunopt.distributed._pooled_kth`, then ``||g||_R^2`` the ranks'
    ``G_w`` and the pooled ``c^2`` of ``c >= tau``, ``||x||_M^2`` the ranks'
    ``X_w`` and the pooled ``m`` of ``c < tau`` (float64 sums in one order on
    every rank)."""
    from prunopt import distributed as D

    got = D._windows_of(vec, world)
    if got is None:
        return None
    heads, rows = got  # (per rank: the two sums, then the candidates: see _FusedShare.window)
    sums = rows[:, :2].view(np.float64)
    if dtype == torch.float32:  # (c's bits low, sqrt(m)'s high)
        slots = np.concatenate([rows[r, 2:2 + int(m)] for r, m in enumerate(heads[:, 3])])
        c = slots & 0xFFFFFFFF
        mm = np.square((slots >> 32).astype(np.int32).view(np.float32).astype(np.float64))
    else:
        c = np.concatenate([rows[r, 2:2 + 2 * int(m):2] for r, m in enumerate(heads[:, 3])])
        mm = np.concatenate([rows[r, 3:3 + 2 * int(m):2] for r, m in enumerate(heads[:, 3])]).view(np.float64)
    t = D._pooled_kth(c, heads, T)
    if t is None:
        return None
    cv = c.astype(np.int32).view(np.float32).astype(np.float64) if dtype == torch.float32 else c.view(np.float64)
    ge = c >= t
    above, below = _masked_sums(cv, ge, mm, ~ge)
    g_r2 = math.fsum(sums[:, 0].tolist()) + above
    x_m2 = math.fsum(sums[:, 1].tolist()) + below
    return torch.tensor(t, dtype=D._RADIX[dtype].int_dtype).view(dtype), g_r2, x_m2


def _fused_select(loc: _Scope, counted: List[bool], T: int, group=None):
    """The threshold of one scope over every rank and the ratio's norms from
    the same pass (the sharded form of the one-process fused scan), in the two
    rounds of :func:`prunopt.distributed._bracket_select`:

    1. each rank brackets its share ``ceil(T / W)`` of the top-``T`` from a
       fixed sample of its effective gradients ``ge``, widens the bracket to
       a grid of ``2**j`` ulps aligned at multiples of ``2**j`` and reads
       ``x`` and ``g`` once (``prunadag_bracket``): the count ``a`` of
       ``|ge|`` above the bracket, ``G = sum ge^2`` over them, ``X`` the
       sign-matched ``x^2`` below it, the candidates inside with their
       sign-matched ``x^2`` (:class:`_FusedShare`);
    2. the first collective (the layout of every select's first collective,
       :func:`prunopt.distributed._first_size`) sums ``n``, the agreement on
       ``T`` and the dtype, and lays every rank's slice side by side (its
       ``n_r``, ``a``, grid, non-finite flag and the candidates' histogram on
       its grid), from which every rank computes the same exact bracket
       ``[L, H]`` of ``tau`` (:func:`prunopt.distributed._bracket_of_slices`);
    3. each rank takes its candidates in ``[L, H]`` and corrects its sums:
       ``a2 = a + #{c > H}``, ``G2 = G + sum_{c > H} c^2``,
       ``X2 = X + sum_{c < L} m_c`` (another ``prunadag_bracket`` pass with
       ``[L, H]`` only on a rank whose own bracket does not cover it), and
       radix passes over the candidates select ``tau``, carrying per bucket
       the candidates' ``c^2`` and ``m`` with their counts, and ``a2``,
       ``G2``, ``X2`` in the first of them, so that
       ``||g||_R^2 = G2 + sum_{c >= tau} c^2`` and
       ``||x||_M^2 = X2 + sum_{c < tau} m_c`` come out of the same
       collectives: one pass when the ranks' values are alike (at most 4
       collectives for float32, 7 for float64); no norms pass, no norms
       collective.

    Up to ``_WINDOW_WORLD`` ranks the first collective also carries every
    rank's window (:meth:`_FusedShare.window`: its candidates around its
    share with their ``m``, and the sums outside it), and when ``tau`` lies
    inside every window (alike ranks, FSDP2's shards of the same layers) the
    pooled windows give ``tau`` and both norms at once
    (:func:`_window_select`): 1 collective in all, steps 2-3 skipped.

    Exact whatever the samples: a poor bracket widens ``[L, H]`` or costs a
    second read, never the answer.

    Returns ``(tau, (g_r2, x_m2))`` (global; ``(tau, None)`` when the sums are
    small enough that the one-process step would take them again in double),
    ``_NONFINITE`` on every rank when an effective gradient on some rank is
    not finite, or ``None`` where this path does not apply (another dtype or
    device, a scope of mixed dtypes or devices: the caller selects as before;
    every rank decides alike). ``group``: what the sums run over (see
    :mod:`prunopt.distributed`; ``None`` without a process group is one
    process)."""
    from prunopt import distributed as D

    if not loc.params or not extension_available():
        return None
    dtype, device = loc.params[0].dtype, loc.params[0].device
    if (dtype not in _XMIN or device.type not in D._BRACKET_DEVICES
            or any(p.dtype != dtype or p.device != device for p in loc.params)):
        return None
    plan = D._plan(loc.params, group, "params")
    world = plan.world
    share = _FusedShare(loc, counted, T, world)
    windows = D._window_area(world) > 0
    window = share.window(-(-T // world), D._window_slots(world)) if windows else None
    n, vec = D._first_collective(share.own, T, plan, window)
    if D._any_bad(vec, world):
        return _NONFINITE
    if not 1 <= T <= n:
        raise ValueError(f"k must be in [1, n={n}], got {T}")
    got = _window_select(vec, world, T, dtype) if windows else None
    if got is not None:
        tau, g_r2, x_m2 = got
    else:
        slices = D._slices(vec, world, D._rank_buckets(world))
        lo_bits, hi_bits = D._bracket_of_slices(slices, T, n, D._max_finite_bits(dtype))
        cands, above, weights, extra = share.candidates(lo_bits, hi_bits)
        got = D._select_in_bracket(cands, plan.groups, T, above, False, D._bits_value(lo_bits, dtype),
                                   D._bits_value(hi_bits, dtype), True, weights=weights, extra=extra)
        if got is D._MISSED:  # unreachable: [L, H] holds tau by construction (kept as a safe answer)
            return None
        tau, s_ge, s_lt, (G, X) = got
        g_r2, x_m2 = G + s_ge, X + s_lt
    xmin = _XMIN[dtype]
    small = x_m2 < n * xmin * xmin * (2.0 ** 24 if dtype == torch.float32 else 2.0 ** 53)
    if (dtype == torch.float32 and g_r2 < n * 2.0 ** -102) or small:
        return tau, None
    return tau, (g_r2, x_m2)


def _run_scopes_sharded(scopes: List[_Scope], locs: List[_Scope], impl: str, view,
                        found_nonfinite: Optional[Tensor] = None) -> None:
    """One step over scopes whose parameters are sharded (FSDP2 DTensors): the
    threshold ``tau`` of each scope is selected over its logical tensors on
    every rank (exact, as :func:`prunopt.distributed.topk_threshold`), the
    norms of the ratio ``r`` are summed over the ranks (float32/float64 on the
    CPU: from the selection's own pass and collectives, :func:`_fused_select`;
    otherwise with a non-finite flag in one ``all_reduce`` for all scopes),
    and each rank runs the element pass of the chosen path on its local
    shards with that ``tau`` and ``r``: the step of one process on the whole
    parameters, to the rounding of the norms' sums.

    Non-finite gradients on any rank: every rank raises ``ValueError`` (or,
    with ``found_nonfinite``, sets it to 1) before anything is written.
    ``locs``: the scopes' :func:`_local_scope`."""
    counted = [[view.counts(p) for p in s.params] for s in scopes]

    def nonfinite() -> None:
        if found_nonfinite is not None:
            found_nonfinite.fill_(1.0)
            return
        raise ValueError("PrunAdag: grads contain a non-finite value (on at least one rank); the step was skipped "
                         "(nothing was updated)")

    # 1) the threshold of each scope over its logical tensors (T of the global n),
    #    with the ratio's norms from the same pass where the fused select applies;
    #    a non-finite key on any rank is known to every rank here
    taus, targets, norms = [], [], []
    for s, loc, cnt in zip(scopes, locs, counted):
        n, T = s.n(), s.target()
        targets.append(T)
        tau, nrm = None, None  # T >= n: every element is relevant
        if n > 0 and T < n:
            # (the fused select's keys are the fused kernel's effective gradients:
            # weight decay's product rounded before the sum; the other paths'
            # element passes take torch's, so they select with those)
            same_keys = impl == "fused" or all(h.weight_decay == 0 for h in loc.hypers)
            got = _fused_select(loc, cnt, T, view.group) if same_keys else None
            if got is _NONFINITE:
                return nonfinite()
            if got is not None:
                tau, nrm = got
            else:
                keys, flags = _selection_keys(loc, cnt)
                tau = view.threshold(keys, flags, T)
                if tau is None:
                    return nonfinite()
        taus.append(tau)
        norms.append(nrm)
    # 2) the other scopes' norms and the finiteness of every tensor, summed over
    #    the ranks in one all_reduce
    rest = [i for i, nrm in enumerate(norms) if nrm is None]
    if rest:
        parts = [_local_norms(locs[i], counted[i], taus[i]) if locs[i].params
                 else torch.zeros(3, dtype=torch.float64, device=view.device) for i in rest]
        sums = view.sum([v for part in parts for v in part.unbind()]).view(-1, 3)
        if bool(sums[:, 2].sum().item() != 0):
            return nonfinite()
        for i, (g_r, x_m) in zip(rest, sums[:, :2].tolist()):
            norms[i] = (g_r, x_m)
    ratios = [torch.tensor(math.sqrt(g_r) / math.sqrt(x_m) if x_m > 0 else 0.0, dtype=torch.float64)
              for g_r, x_m in norms]
    # 3) the element pass on the local shards
    for loc, T, tau, r in zip(locs, targets, taus, ratios):
        if impl == "fused":  # (every gradient was checked finite on every rank above)
            _fused_scope(loc, T, found_nonfinite, (tau, r, True))
        elif impl == "foreach":
            _foreach_scope(loc, T, None, (tau, r))
        else:
            _single_tensor_scope(loc, T, (tau, r))
    steps = [st for s in scopes for st in s.steps]
    if steps:
        torch._foreach_add_(steps, 1)


def prunadag(
    params: List[Tensor],
    grads: List[Tensor],
    opt_sums: List[Tensor],
    dec_sums: List[Tensor],
    state_steps: List[Tensor],
    *,
    lr: float = 1e-2,
    relevant=0.1,
    version=3,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
    foreach: Optional[bool] = None,
    fused: Optional[bool] = None,
    found_nonfinite: Optional[Tensor] = None,
) -> None:
    r"""Functional prunAdag (Algorithm 2.1): one step over ``params`` as a single
    selection scope (one global top-T set and one ratio ``r``), in place.

    ``opt_sums`` are :math:`(w^O)^2` and ``dec_sums`` :math:`(w^D)^2` (eq. 2.15);
    ``state_steps`` are the step counters ``k`` (tensors, incremented here).
    See :class:`PrunAdag` for the hyper-parameters.

    Non-finite gradients: by default the step raises ``ValueError`` and changes
    nothing. With ``found_nonfinite`` (a one-element float32 tensor, e.g. on the
    params' device) it changes nothing either but sets ``found_nonfinite`` to 1
    instead of raising, and the step counters on that device do not advance;
    the fused kernel does this without a host synchronisation. The flag is an
    input too: pass it as 0. A flag that is already 1 (e.g. set by an earlier
    call and not reset) makes the call a no-op, so one flag can guard several
    calls that must all be skipped together; reset it (``flag.zero_()``)
    before the next step.

    All lists must have one entry per parameter, and each accumulator the
    shape, dtype and device of its parameter (``ValueError`` otherwise, before
    anything is written). The step counters must be finite and >= 0
    (``ValueError``, nothing written; checked on the host, except for counters
    on a CUDA device with ``found_nonfinite``, where reading them would
    synchronise, and under ``torch.compile``). ``lr`` may be a one-element
    tensor.
    """
    relevant = _normalize_relevant(relevant)
    group = dict(lr=lr, relevant=relevant, version=version, scope="global", lr_decay=lr_decay,
                 weight_decay=weight_decay, initial_accumulator_value=0.0, eps=eps, maximize=maximize,
                 foreach=foreach, fused=fused, differentiable=False, prune=True)
    _check_hyper(group)
    s = _Scope()
    s.params, s.grads, s.opt_sums, s.dec_sums, s.steps = list(params), list(grads), list(opt_sums), list(dec_sums), list(state_steps)
    for name, lst in (("grads", s.grads), ("opt_sums", s.opt_sums), ("dec_sums", s.dec_sums),
                      ("state_steps", s.steps)):
        if len(lst) != len(s.params):
            raise ValueError(f"{name} must have one tensor per parameter ({len(s.params)}), got {len(lst)}")
        for i, t in enumerate(lst):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}[{i}] must be a Tensor, got {type(t).__name__}")
    hyper = TensorHyper(lr=lr if isinstance(lr, Tensor) else float(lr), lr_decay=lr_decay,
                        weight_decay=weight_decay, eps=eps, maximize=maximize)
    s.hypers = [hyper] * len(s.params)
    s.relevant, s.version = relevant, version
    _check_grads([s])  # sparse / complex / mismatched state: TypeError / ValueError before the path is chosen
    if not torch.compiler.is_compiling() and not (found_nonfinite is not None and any(st.is_cuda for st in s.steps)):
        _check_steps(s.steps)
    _run_scopes([s], _choose_impl(s.params + s.grads, foreach, fused), found_nonfinite)


def _choose_impl(tensors: List[Tensor], foreach, fused) -> str:
    if fused:
        # as torch.optim: fused=True needs real values (meta tensors only go
        # through the fake kernel on the default path)
        if not _fused_supported(tensors) or tensors[0].is_meta:
            from prunopt.ops import PRUNADAG_DEVICES

            bad = next((t for t in tensors if t.dtype not in _FUSED_DTYPES or t.is_meta
                        or t.device.type not in PRUNADAG_DEVICES), None)
            what = (f"{bad.dtype} and {bad.device.type}" if bad is not None
                    else f"tensors on {sorted({str(t.device) for t in tensors})} and of {sorted({str(t.dtype) for t in tensors})}")
            raise RuntimeError(
                "`fused=True` requires all the params to be floating point Tensors of supported devices: "
                f"{sorted(PRUNADAG_DEVICES - {'meta'})}, of one dtype and on one device, but {what}")
        return "fused"
    if foreach is False:
        return "single"
    if foreach is None and fused is None and _fused_supported(tensors):
        return "fused"
    if foreach is None and not all(t.device.type == "cuda" for t in tensors):
        # as torch.optim does: the whole-vector foreach path pays off on CUDA
        # (one kernel per op); on the CPU the per-tensor loop is faster (no
        # concatenated copies of x, g and both accumulators)
        return "single"
    return "foreach"


class PrunAdag(torch.optim.Optimizer):
    r"""prunAdag (Porcelli, Seraghiti, Toint, "prunAdag: an adaptive
    pruning-aware gradient method", Algorithm 2.1).

    Adagrad on the *optimisable* elements ``O = R ∪ A`` (eq. 2.4, 2.9) and an
    Adagrad-like trust-region shrink of the *decreasable* ones ``D`` (eq. 2.10,
    2.16), so that the solution is robust to a posteriori magnitude pruning.

    A drop-in for :class:`torch.optim.Adagrad`: the same positional parameters,
    defaults and flags, and with ``relevant=1.0`` (``T = n``, every element
    relevant) and everything else as given to ``Adagrad`` it *is* Adagrad,
    step for step, on every path (fused, foreach, single-tensor), including
    ``maximize``, ``weight_decay``, ``lr_decay`` and a tensor ``lr``. The
    prunAdag arguments are keyword-only.

    The paper's experiments use ``lr=1, eps=0, initial_accumulator_value=0.01``
    (:math:`\varsigma = 1/100`, eq. 2.15), which differ from Adagrad's
    defaults: pass them explicitly, e.g.
    ``PrunAdag(params, lr=1.0, eps=0.0, initial_accumulator_value=0.01, relevant=0.1, version=3)``.

    Args:
        params: parameters or param groups. A group key ``prune`` (default True)
            set to False makes that group take the plain Adagrad step (biases,
            norms) and keeps it out of ``n``, ``T`` and ``r``.
        lr: learning rate, a float or a one-element tensor (default 1e-2; the
            paper uses 1).
        lr_decay: ``lr_k = lr / (1 + k lr_decay)``.
        weight_decay: ``g <- g + weight_decay * x``, applied after ``maximize``
            (torch.optim's order: the decay shrinks ``x`` when maximising too).
        initial_accumulator_value: ``ς``, the start of both :math:`(w^O)^2` and
            :math:`(w^D)^2` (eq. 2.15; default 0 as in Adagrad, the paper uses 0.01).
        eps: added to :math:`w^O` and :math:`w^D` in the denominators (paper: 0).
        foreach, fused: choose the implementation; by default the fused kernel
            when the extension has one for the device and dtype, else (as in
            ``torch.optim``) foreach on CUDA and the single-tensor loop on the
            CPU. ``foreach=False`` runs the readable single-tensor reference.
            ``fused=True`` takes float16/bfloat16 parameters as
            ``torch.optim.Adagrad(fused=True)`` does: computed in float32,
            parameters and state stored in the parameters' dtype.
        maximize: maximise the objective (``g <- -g`` first).
        differentiable: must be False (the sets R, A and D are chosen by
            comparisons; ``True`` raises ``ValueError``).
        relevant: ``T`` of eq. 2.6, keyword-only: an int (``1 <= T <= n``) or a
            float in (0, 1] giving ``T = ceil(relevant * n)`` (of the decimal
            fraction: ``0.07`` of 100 is 7; see
            :func:`prunopt.reference.resolve_relevant`). ``relevant=1.0`` is Adagrad.
        version: keyword-only; 1, 2, 3, 4 (Table 1) or ``"relevant_only"``
            (``O = R``, the paper's ablation of section 3.1.1; its shrink uses
            version 3's ``a``).
        scope: keyword-only; ``"global"`` (one top-T set and ratio over all
            pruned groups, the paper's reading), ``"group"`` (per param group)
            or ``"tensor"``.

    State per parameter: ``step`` (tensor), ``sum`` (:math:`(w^O)^2`, the
    Adagrad accumulator) and ``decrease_sum`` (:math:`(w^D)^2`). The state
    follows its parameter: after ``model.double()`` or ``model.to(device)``
    the accumulators are cast to the parameter's dtype and device at the next
    step (as ``load_state_dict`` casts them).

    Non-finite gradients: a step whose (effective) gradient has a NaN or inf
    anywhere changes nothing (no parameter, no accumulator of any scope). On
    the CPU it raises ``ValueError`` (and no step counter advances). On CUDA
    raising would need a host synchronisation, and under ``torch.compile`` a
    graph break, so there the step is skipped instead: the step counters (kept
    on the device for CUDA params, as in ``torch.optim.Adagrad(fused=True)``)
    do not advance, and :attr:`found_nonfinite` (a one-element float32 tensor
    on the params' device, reset by every such step) is 1 after a skipped step
    and 0 otherwise — read it when convenient (e.g. with the loss); in raising
    mode it stays 0.

    ``torch.compile(optimizer.step)``: the fused and foreach paths read nothing
    on the host (no graph break), a tensor ``lr`` changed by a scheduler needs
    no recompilation and a float one one (as for ``torch.optim.Adagrad``).

    Distributed: under DDP every rank holds the whole (replicated) parameters
    and the averaged gradient, so every rank takes the one-process step. Under
    FSDP2 (``fully_shard``: DTensor parameters, each rank a shard) the step
    selects over the *logical* parameters: each scope's threshold is the exact
    top-``T`` over every rank's shards (:func:`prunopt.distributed.topk_threshold`,
    bit-identical to one process), its ratio ``r`` sums the norms over the
    ranks, and each rank runs the chosen path (fused, foreach, single-tensor)
    on its shards with that threshold and ratio: the one-process step on the
    full parameters, to the rounding of the norms' sums. Scope ``"tensor"``
    selects over each logical tensor, never per shard. The state
    (``sum``, ``decrease_sum``) is sharded like the parameters (DTensors), so
    ``torch.distributed.checkpoint`` saves and loads it like torch's
    optimizers' state. Per step and scope, float32/float64 on the CPU, the
    selection's collectives carry the norms and the finiteness too: 2
    ``all_reduce`` when the shards' values are alike (the threshold's two
    rounds; 66 KB per rank on 2 ranks), at most 4 for float32 and 7 for
    float64. Elsewhere each scope costs the threshold's collectives (see
    :func:`prunopt.distributed.topk_threshold`) and all scopes together one
    ``all_reduce`` of the norms and the finiteness. The sharded step is not
    traced by ``torch.compile`` (its collectives and host reads break the
    graph).

    Long runs: the decreasable weights decay geometrically towards 0 (eq. 2.16)
    and in float32 reach the denormals after ~10^3 steps of a consistent sign;
    x86 CPUs compute on denormals with microcode assists (the step, exact to the
    bit, then takes ~1.5x as long). ``torch.set_flush_denormal(True)`` avoids
    it; the fused kernel then flushes as PyTorch's own ops do.
    """

    def __init__(
        self,
        params,
        lr=1e-2,
        lr_decay: float = 0,
        weight_decay: float = 0,
        initial_accumulator_value: float = 0,
        eps: float = 1e-10,
        foreach: Optional[bool] = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        relevant=0.1,
        version=3,
        scope: str = "global",
    ):
        defaults = dict(
            lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, foreach=foreach, maximize=maximize,
            differentiable=differentiable, fused=fused, relevant=_normalize_relevant(relevant), version=version,
            scope=scope, prune=True,
        )
        _check_hyper(dict(defaults))
        super().__init__(params, defaults)
        self.found_nonfinite: Optional[Tensor] = self._new_flag()
        self._check_consistency()
        total = sum(p.numel() for g in self.param_groups if g["prune"] for p in g["params"])
        for g in self.param_groups:
            if g["prune"] and isinstance(g["relevant"], int) and g["relevant"] > total:
                raise ValueError(f"relevant={g['relevant']} exceeds the number of pruned elements (n={total})")
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)

    def _init_state(self, p: Tensor, group: dict) -> dict:
        """The state of ``p``: created on first use (both accumulators at the
        group's ``initial_accumulator_value``, eq. 2.15; ``step`` 0), and made
        to follow ``p`` when its dtype or device changed since (a model cast
        after the optimizer was built): the accumulators are cast, as
        ``load_state_dict`` does; a state left on the meta device (a model
        materialised with ``to_empty``) holds no values and starts afresh."""
        state = self.state[p]
        if len(state) == 0:
            v = group["initial_accumulator_value"]
            # (full_like's overflow error would not name the argument)
            if p.is_floating_point() and abs(float(v)) > torch.finfo(p.dtype).max:
                raise ValueError(f"initial_accumulator_value must be at most {torch.finfo(p.dtype).max:g} for "
                                 f"{p.dtype} parameters (the accumulators have their dtype), got {v:g}")
            # on the device for CUDA params, so that a skipped step needs no sync
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device if p.is_cuda else None)
            state["sum"] = torch.full_like(p, v, memory_format=torch.preserve_format)
            state["decrease_sum"] = torch.full_like(p, v, memory_format=torch.preserve_format)
            return state
        dtype, dev = p.dtype, p.device
        for key in ("sum", "decrease_sum"):
            t = state.get(key)
            if isinstance(t, Tensor) and (t.dtype != dtype or t.device != dev) and t.shape == p.shape:
                if t.is_meta and not p.is_meta:
                    state[key] = torch.full_like(p, group["initial_accumulator_value"],
                                                 memory_format=torch.preserve_format)
                else:
                    state[key] = t.to(dtype=dtype, device=dev)
        st = state.get("step")
        if isinstance(st, Tensor) and st.device != dev and (p.is_cuda or st.is_meta):
            state["step"] = (torch.zeros((), dtype=torch.float32, device=dev if p.is_cuda else None) if st.is_meta
                             else st.to(dev if p.is_cuda else "cpu"))
        return state

    def _new_flag(self, device=None) -> Tensor:
        """A zero :attr:`found_nonfinite` on ``device`` (default: the first
        parameter's): created eagerly, so that a compiled step only writes into
        it (an attribute set inside a compiled region would not persist)."""
        if device is None:
            first = next((p for g in self.param_groups for p in g["params"]), None)
            device = first.device if first is not None else None
        return torch.zeros(1, dtype=torch.float32, device=device)

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; the group is validated
        like the constructor's arguments (and, with ``scope="global"``, must
        agree with the others on ``relevant`` and ``version``) and is not added
        when it fails."""
        if isinstance(param_group, dict) and "relevant" in param_group:
            param_group = {**param_group, "relevant": _normalize_relevant(param_group["relevant"])}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_hyper(group)
        except (ValueError, TypeError, RuntimeError):
            self.param_groups.pop()
            raise
        if hasattr(self, "state") and self.state is not None and len(self.param_groups) > 1:
            try:
                self._check_consistency()
            except ValueError:
                self.param_groups.pop()
                raise
            for p in group["params"]:
                self._init_state(p, group)

    def _check_consistency(self) -> None:
        scopes = {g["scope"] for g in self.param_groups}
        if len(scopes) > 1:
            raise ValueError(f"scope must be the same in every param group, got {sorted(scopes)}")
        if scopes == {"global"}:
            pruned = [g for g in self.param_groups if g["prune"]]
            for key in ("relevant", "version"):
                vals = {repr(g[key]) for g in pruned}
                if len(vals) > 1:
                    raise ValueError(f"with scope='global', {key} must be the same in every pruned param group, got {sorted(vals)}")

    # group keys a state dict of an older PrunAdag (or of torch.optim.Adagrad)
    # may lack, with the value they take when the optimizer's defaults lack them too
    _GROUP_DEFAULTS = dict(lr_decay=0, weight_decay=0, eps=1e-10, initial_accumulator_value=0, foreach=None,
                           maximize=False, differentiable=False, fused=None, relevant=0.1, version=3,
                           scope="global", prune=True)

    def __setstate__(self, state: dict) -> None:
        """Loads a pickled optimizer or (through ``load_state_dict``) a state
        dict. Group keys missing from older state dicts take the optimizer's
        defaults (``prune``: True); a state without ``decrease_sum`` (e.g. a
        ``torch.optim.Adagrad`` one) gets it at the group's
        ``initial_accumulator_value``; a non-tensor ``step`` becomes a tensor.
        Step counts that are not finite and >= 0 raise ``ValueError`` before
        anything is loaded."""
        steps = [s["step"] for s in (state.get("state") or {}).values() if isinstance(s, dict) and "step" in s]
        _check_steps([st if torch.is_tensor(st) else torch.tensor(float(st)) for st in steps], name="state 'step'")
        super().__setstate__(state)
        defaults = getattr(self, "defaults", None) or {}
        for group in self.param_groups:
            for key, value in self._GROUP_DEFAULTS.items():
                group.setdefault(key, True if key == "prune" else defaults.get(key, value))
        if self.__dict__.get("found_nonfinite") is None:  # not pickled by Optimizer.__getstate__
            self.found_nonfinite = self._new_flag()
        for group in self.param_groups:
            for p in group["params"]:
                s = self.state.get(p)
                if not s:
                    continue
                if "step" in s and not torch.is_tensor(s["step"]):
                    s["step"] = torch.tensor(float(s["step"]), dtype=torch.float32,
                                             device=p.device if p.is_cuda else None)
                # the decrease accumulator starts where the group's accumulators start (eq. 2.15)
                if "sum" in s and "decrease_sum" not in s:
                    s["decrease_sum"] = torch.full_like(s["sum"], group["initial_accumulator_value"])

    def _scopes(self) -> List[_Scope]:
        scope_kind = self.param_groups[0]["scope"] if self.param_groups else "global"
        out: List[_Scope] = []
        shared: Dict[str, _Scope] = {}
        for gi, group in enumerate(self.param_groups):
            # per group: the scope key and the hyper-parameters (shared by its tensors)
            # a tensor lr stays a tensor (no host read; under torch.compile a graph input)
            hyper = TensorHyper(lr=group["lr"], lr_decay=group["lr_decay"], weight_decay=group["weight_decay"],
                                eps=group["eps"], maximize=group["maximize"], prune=group["prune"])
            if not group["prune"]:
                group_key = "adagrad"
            else:
                group_key = "g" if scope_kind == "global" else (f"group{gi}" if scope_kind == "group" else None)
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self._init_state(p, group)  # created, or cast to follow p
                key = group_key if group_key is not None else f"t{id(p)}"
                s = shared.get(key)
                if s is None:
                    s = shared[key] = _Scope()
                    s.relevant, s.version = group["relevant"], group["version"]
                    out.append(s)
                s.params.append(p)
                s.grads.append(g)
                s.opt_sums.append(state["sum"])
                s.dec_sums.append(state["decrease_sum"])
                s.steps.append(state["step"])
                s.hypers.append(hyper)
        # With global scope the Adagrad-only tensors ride along in the single
        # fused call (they are always optimisable and excluded from n, T, r).
        if scope_kind == "global" and "adagrad" in shared and "g" in shared:
            g, a = shared["g"], shared["adagrad"]
            for attr in ("params", "grads", "opt_sums", "dec_sums", "steps", "hypers"):
                getattr(g, attr).extend(getattr(a, attr))
            out.remove(a)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one prunAdag step (Algorithm 2.1) and returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scopes = self._scopes()
        if not scopes:
            return loss
        group0 = self.param_groups[0]
        # the accumulators follow their params (state is created like them and
        # load_state_dict casts it); the kernels check them again
        tensors = [t for s in scopes for t in s.params + s.grads]
        _check_grads(scopes)  # sparse / complex: TypeError before the path is chosen (fused=True)
        view = sharded_view([p for s in scopes for p in s.params])
        if view is not None:
            # FSDP2: the selection spans every rank's shards (no torch.compile
            # graph: the collectives and the threshold's host reads break it)
            locs = [_local_scope(s, view) for s in scopes]
            local = [t for loc in locs for t in loc.params + loc.grads]  # (the order of tensors)
            impl = _choose_impl(local, group0["foreach"], group0["fused"])
            _check_steps([st for s in scopes for st in s.steps])
            flag = None
            if impl == "fused" and local[0].is_cuda:
                flag = self.found_nonfinite
                if flag is None or flag.device != local[0].device:
                    flag = self.found_nonfinite = self._new_flag(local[0].device)
                else:
                    flag.zero_()
            _run_scopes_sharded(scopes, locs, impl, view, flag)
            return loss
        impl = _choose_impl(tensors, group0["foreach"], group0["fused"])
        flag = None
        if (impl == "fused" and tensors[0].is_cuda) or torch.compiler.is_compiling():
            # skip instead of raising: raising would need a host synchronisation
            # (CUDA) or a graph break (torch.compile)
            flag = self.found_nonfinite
            if flag is None or flag.device != tensors[0].device:
                flag = self.found_nonfinite = self._new_flag(tensors[0].device)
            else:
                flag.zero_()
        _run_scopes(scopes, impl, flag)
        return loss
