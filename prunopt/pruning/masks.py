"""Pruning masks for standard weights (``Conv2d``/``Linear``) and interspace
coefficients (``FBConv2d``) alike, kept consistent with the optimizer state.

A *prunable tensor* is a (module, parameter) pair named by its fully-qualified
name (FQN), e.g. ``"features.0.weight"`` or ``"features.3.coefficients"``:

* ``nn.Conv2d`` / ``nn.Linear`` / transformers' ``Conv1D`` (GPT-2): the
  ``weight``.  The mask is installed as a ``torch.nn.utils.parametrize`` parametrization :class:`WeightMask`, so the
  module computes with ``weight = original * mask`` (the convention of
  ``torch.ao.pruning``); the state dict holds
  ``<module>.parametrizations.weight.original`` and
  ``<module>.parametrizations.weight.0.mask``.
* ``prunopt.nn.FBConv2d``: the ``coefficients`` ``lam``; the layer already
  computes with ``lam * mu`` using its own ``mask`` buffer ``mu`` (Wimmer et al.,
  paper Sec. 4.4), which the masker writes.

Bases (``FilterBasis.weight``), biases and normalisation parameters are never
prunable (Wimmer et al., paper Sec. 4.4).

**Invariant.** For every pruned entry ``(mu = 0)`` the stored parameter, its
gradient and every per-element optimizer state tensor (momentum buffers,
Adam's ``exp_avg``/``exp_avg_sq``, Adagrad's ``sum``, PrunAdag accumulators,
any state tensor with the parameter's shape) are exactly zero after
:meth:`Masker.step`.  The gradient is masked by autograd through the product
``w * mu``; the parameter and the state are multiplied by ``mu`` after every
optimizer step, so the invariant holds for optimizers that would otherwise move
a zero-gradient entry (weight decay, Adam's bias correction, unknown
accumulators).
"""
from __future__ import annotations

import contextlib
import math
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from prunopt.nn._jit import script_unsupported
from prunopt.pruning import _dist
from prunopt.validation import check_bool, check_str_list

__all__ = [
    "WeightMask",
    "PrunableTensor",
    "prunable_tensors",
    "is_fb_conv",
    "is_hf_conv1d",
    "Masker",
    "remove_masks",
]


def is_hf_conv1d(module: nn.Module) -> bool:
    """True for ``transformers.pytorch_utils.Conv1D`` (GPT-2's linear layers,
    ``y = x @ weight + bias`` with ``weight`` of shape ``(in, out)``): its
    ``weight`` is prunable like an ``nn.Linear``'s. transformers is not
    imported for this (a model holding a Conv1D has imported it)."""
    mod = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(mod, "Conv1D", None) if mod is not None else None
    return conv1d is not None and isinstance(module, conv1d)


def is_fb_conv(module: nn.Module) -> bool:
    """True for ``prunopt.nn.FBConv2d`` (an interspace convolution whose
    coefficients ``lam`` (paper eq. 6) are the prunable tensor)."""
    try:
        from prunopt.nn import FBConv2d  # type: ignore[attr-defined]
    except ImportError:  # the interspace layers are not available
        return False
    return isinstance(module, FBConv2d)


class WeightMask(nn.Module):
    """Parametrization ``w -> w * mu`` with a binary mask buffer ``mu`` of the
    weight's shape and dtype (paper Sec. 4.4: ``h * mu_bar`` for SP).

    The product masks the gradient, ``dL/dw = mu * dL/d(w * mu)``, so pruned
    entries receive a zero gradient.  The product has the weight's dtype
    (FSDP2's mixed precision casts the weight, not the buffer)."""

    __prepare_scriptable__ = script_unsupported  # torch.jit.script: a clear error (prunopt.nn._jit)

    def __init__(self, mask: Tensor):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.mask.to(x.dtype)


@dataclass
class PrunableTensor:
    """One prunable tensor: ``name`` (tensor FQN), the owning ``module`` and its
    FQN ``module_name``, and ``attr`` (``"weight"`` or ``"coefficients"``)."""

    name: str
    module_name: str
    module: nn.Module
    attr: str

    @property
    def interspace(self) -> bool:
        """True for FB coefficients ``lam`` (IP), False for spatial weights (SP)."""
        return self.attr == "coefficients"

    @property
    def parameter(self) -> nn.Parameter:
        """The trainable tensor the optimizer updates (the parametrization's
        ``original`` for a masked Conv2d/Linear)."""
        m = self.module
        if self.attr == "weight" and parametrize.is_parametrized(m, "weight"):
            return m.parametrizations.weight.original
        return getattr(m, self.attr)

    @property
    def mask(self) -> Optional[Tensor]:
        """The mask buffer (``None`` for an unmasked Conv2d/Linear)."""
        m = self.module
        if self.interspace:
            return m.mask
        if parametrize.is_parametrized(m, "weight"):
            for p in m.parametrizations.weight:
                if isinstance(p, WeightMask):
                    return p.mask
        return None

    def effective(self) -> Tensor:
        """The weight the layer computes with: ``w * mu`` (or ``lam * mu``).
        Under FSDP2 a DTensor laid out as the parameter (each rank's shard
        times its block of the replicated mask)."""
        mask = self.mask
        p = self.parameter
        if mask is None:
            return p
        return _dist.like(_dist.local(p) * _dist.local_part(mask, p).to(p.dtype), p)

    @property
    def spatial_numel(self) -> int:
        """Number of weights of the equivalent standard layer, ``D_l`` in eq. 9:
        ``C_out * C_in/groups * kh * kw`` for an FB layer (whatever its
        dictionary size ``N``), ``numel`` otherwise."""
        return math.prod(self.spatial_shape)

    @property
    def spatial_shape(self) -> tuple:
        """Shape of the equivalent standard weight, ``(C_out, C_in/groups, kh, kw)``
        for an FB layer (the basis elements are ``kh x kw``, also for
        non-square kernels), the parameter's shape otherwise (used by ERK,
        eq. A.76)."""
        p = self.parameter
        if not self.interspace:
            return tuple(p.shape)
        kh, kw = self.module.basis.weight.shape[-2:]
        return (p.shape[0], p.shape[1], int(kh), int(kw))


def _names_match(pt: PrunableTensor, names: Iterable[str]) -> bool:
    return any(n in (pt.name, pt.module_name) for n in names)


def check_optimizers(optimizers) -> List[torch.optim.Optimizer]:
    """One optimizer or an iterable of them, as a list (TypeError naming ``optimizers``)."""
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    if isinstance(optimizers, (str, bytes, torch.Tensor)) or not hasattr(optimizers, "__iter__"):
        raise TypeError(f"optimizers must be a torch.optim.Optimizer or a sequence of them, got "
                        f"{type(optimizers).__name__}")
    out = list(optimizers)
    for o in out:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizers must be torch.optim.Optimizer instances, got {type(o).__name__}")
    return out


def prunable_tensors(
    model: nn.Module,
    include: Optional[Sequence[str]] = None,
    exclude: Optional[Sequence[str]] = None,
) -> "OrderedDict[str, PrunableTensor]":
    """The prunable tensors of ``model`` in module order, keyed by tensor FQN.

    ``Conv2d``/``Linear`` (and transformers' ``Conv1D``, :func:`is_hf_conv1d`)
    contribute ``weight``; ``FBConv2d`` contributes
    ``coefficients`` (its basis is not prunable; the FB layer's submodules are
    not visited).  ``include``/``exclude`` take module or tensor FQNs; a name
    that matches nothing raises ``ValueError`` naming it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    found: "OrderedDict[str, PrunableTensor]" = OrderedDict()
    skip_prefixes: List[str] = []
    for mname, m in model.named_modules():
        if any(mname.startswith(p) for p in skip_prefixes):
            continue
        if is_fb_conv(m):
            found[_join(mname, "coefficients")] = PrunableTensor(_join(mname, "coefficients"), mname, m, "coefficients")
            skip_prefixes.append(mname + "." if mname else "")
        elif isinstance(m, (nn.Conv2d, nn.Linear)) or is_hf_conv1d(m):
            found[_join(mname, "weight")] = PrunableTensor(_join(mname, "weight"), mname, m, "weight")
    for argname, names in (("include", include), ("exclude", exclude)):
        if names is None:
            continue
        if isinstance(names, str):
            raise TypeError(f"{argname} must be a sequence of layer names, not a string")
        names = check_str_list(names, argname)
        if argname == "include":
            include = names
        else:
            exclude = names
        unknown = [n for n in names if not any(_names_match(pt, [n]) for pt in found.values())]
        if unknown:
            raise ValueError(
                f"{argname}: unknown layer name(s) {unknown}; prunable layers are {[pt.module_name for pt in found.values()]}"
            )
    if include is not None:
        found = OrderedDict((k, v) for k, v in found.items() if _names_match(v, include))
    if exclude is not None:
        found = OrderedDict((k, v) for k, v in found.items() if not _names_match(v, exclude))
    return found


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class Masker:
    """Masks for the prunable tensors of a model, consistent with its optimizers.

    ``Masker(model, optimizers)`` installs an all-ones mask on every prunable
    tensor (selected with ``include``/``exclude``); pruning methods call
    :meth:`set_masks`.  Call :meth:`step` after every ``optimizer.step()``: it
    multiplies each prunable parameter and every per-element optimizer state
    tensor by its mask, so for a pruned entry ``w_j = 0`` and all its state is 0
    (the masked gradient ``mu * g`` is produced by autograd).

    Example::

        masker = Masker(model, optimizer)
        masker.set_masks(global_masks(magnitude_scores(masker), sparsity=0.9))
        for x, y in data:
            optimizer.zero_grad(); loss_fn(model(x), y).backward()
            optimizer.step(); masker.step()
        masker.remove()       # plain model with zeros

    ``state_dict()`` holds the masks keyed by tensor FQN (no module references).

    **Tied weights.**  Layers that hold the same ``Parameter`` (e.g.
    ``b.weight = a.weight``) get one mask: the tensor is listed once, under the
    first name in module order, and the later names (``aliases``, alias ->
    first name) share its mask buffer (the same :class:`WeightMask` for
    Conv2d/Linear, the same ``mask`` buffer for FBConv2d).  Scores, counts,
    :meth:`sparsity`, the methods and :meth:`remove` therefore see one tensor;
    an alias name is accepted wherever a layer name is, and means the tied
    tensor.  Tied layers that already carry different masks are a
    ``ValueError``.

    **Errors.**  Every selected layer is checked before any is changed: a
    weight that is uninitialized (lazy modules), computed by a hook
    (``torch.nn.utils.prune``, the old ``weight_norm``/``spectral_norm``) or
    already parametrized by anything but a :class:`WeightMask` (e.g.
    ``torch.nn.utils.parametrizations.weight_norm``) is a ``ValueError`` naming
    the layer, and the model is left untouched.

    **Distributed training.**  Build the masker on the plain model on every
    rank, *then* wrap the model (``DistributedDataParallel(model)`` or
    ``fully_shard``): a masker that would register its parametrization on a
    wrapped model (or on the module inside a DDP) is a ``ValueError`` saying
    so.  The masks stay identical on every rank: under DDP the parameters are
    identical and the methods average what differs (gradients of the local
    batches) over ``process_group`` (default: the default group, once
    initialised; resolved at each use) and draw random choices from a
    generator shared by all ranks; under FSDP2 the parameters, scores and
    gradients are DTensor shards, the masks are replicated buffers (FSDP2
    does not shard buffers), each rank applies its block of them to its
    shard, and selections are exact over the global tensors
    (``docs/distributed.md``).  :meth:`set_masks` takes plain or DTensor masks.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]] = None,
        include: Optional[Sequence[str]] = None,
        exclude: Optional[Sequence[str]] = None,
        zero_state_every_step: bool = True,
        process_group=None,
    ):
        self.model = model
        if process_group is not None and not (torch.distributed.is_available()
                                              and isinstance(process_group, torch.distributed.ProcessGroup)):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got "
                            f"{type(process_group).__name__}")
        #: the group the methods average over under DDP (``None``: the default group)
        self.process_group = process_group
        found = prunable_tensors(model, include, exclude)
        if not found:
            if include is not None or exclude is not None:
                raise ValueError("include/exclude leave no prunable tensor of the model")
            raise ValueError("model has no prunable tensors (Conv2d/Linear weights or FBConv2d coefficients)")
        self.optimizers: List[torch.optim.Optimizer] = []
        if optimizers is not None:
            self.attach(optimizers)
        self.zero_state_every_step = check_bool(zero_state_every_step, "zero_state_every_step")
        # everything is checked before any layer is changed: an error leaves the model as it was
        for pt in found.values():
            _check_maskable(pt)
        groups = _tie_groups(found)
        for group in groups:
            _check_tie(group)
        if any(not pt.interspace and not _weight_masks(pt.module) for g in groups for pt in g):
            # a new parametrization re-sets the weight (a new gradient accumulator): before DDP/FSDP only
            from prunopt.nn._wrapping import check_not_wrapped

            check_not_wrapped(model, "Masker")
        self.tensors: "OrderedDict[str, PrunableTensor]" = OrderedDict((g[0].name, g[0]) for g in groups)
        #: alias tensor FQN -> FQN of the tied tensor whose mask it shares
        self.aliases: "OrderedDict[str, str]" = OrderedDict((a.name, g[0].name) for g in groups for a in g[1:])
        self._alias_tensors: "OrderedDict[str, PrunableTensor]" = OrderedDict(
            (a.name, a) for g in groups for a in g[1:]
        )
        _install_masks(groups)

    # ----------------------------------------------------------------- access
    def attach(self, optimizers) -> None:
        """Also keep the state of ``optimizers`` masked (one or a sequence)."""
        optimizers = check_optimizers(optimizers)
        for o in optimizers:
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(f"optimizers must be torch.optim.Optimizer instances, got {type(o).__name__}")
            if o not in self.optimizers:
                self.optimizers.append(o)

    def names(self) -> List[str]:
        """Tensor FQNs of the masked tensors, in module order."""
        return list(self.tensors)

    def __getitem__(self, name: str) -> PrunableTensor:
        """The :class:`PrunableTensor` of a tensor or module FQN (``ValueError`` if unknown)."""
        return self.tensors[self._check_name(name)]

    def _check_name(self, name: str) -> str:
        if name in self.tensors:
            return name
        if name in self.aliases:
            return self.aliases[name]
        for pt in self.tensors.values():
            if pt.module_name == name:
                return pt.name
        for alias, pt in self._alias_tensors.items():
            if pt.module_name == name:
                return self.aliases[alias]
        raise ValueError(f"unknown layer name {name!r}; masked tensors are {list(self.tensors)}")

    def parameters(self) -> List[Tensor]:
        """The trainable prunable tensors (``original`` weights / coefficients)."""
        return [pt.parameter for pt in self.tensors.values()]

    def masks(self) -> "OrderedDict[str, Tensor]":
        """Boolean copies of the masks, keyed by tensor FQN."""
        return OrderedDict((n, pt.mask.detach().bool().clone()) for n, pt in self.tensors.items())

    def counts(self) -> "OrderedDict[str, int]":
        """Kept (unpruned) entries per tensor."""
        return OrderedDict((n, int(pt.mask.count_nonzero())) for n, pt in self.tensors.items())

    def density(self) -> float:
        """Fraction of prunable entries that are kept, ``||mu||_0 / d`` (a tied
        tensor counts once).  ``ValueError`` when the masked tensors have no
        entries (``d = 0``, e.g. only ``nn.Linear(0, 4)``): the rate is undefined."""
        total = sum(pt.parameter.numel() for pt in self.tensors.values())
        if total == 0:
            raise ValueError(f"the masked tensors {list(self.tensors)} have no prunable entries (d = 0): "
                             "density and sparsity are undefined")
        return sum(self.counts().values()) / total

    def sparsity(self) -> float:
        """Pruning rate ``p = 1 - ||mu||_0 / d`` over the masked tensors
        (``ValueError`` when ``d = 0``, see :meth:`density`)."""
        return 1.0 - self.density()

    # --------------------------------------------------------------- updating
    def set_masks(self, masks: Mapping[str, Tensor], zero_state: bool = True) -> None:
        """Replace the masks named in ``masks`` (tensor or module FQN -> 0/1 or
        bool tensor of the parameter's shape); others are unchanged.

        Everything is validated before anything changes.  Then pruned entries
        of the parameters (and, with ``zero_state``, of every per-element
        optimizer state tensor) are zeroed.  Entries that become unpruned keep
        their current value, which is 0 (regrowth starts at zero, paper App.
        G.3).  Naming one tensor twice (e.g. its module and tensor FQN, or two
        tied layers) is a ``ValueError``."""
        if not isinstance(masks, Mapping):
            raise TypeError(f"masks must be a mapping of tensor names to tensors, got {type(masks).__name__}")
        staged = []
        named: Dict[str, str] = {}
        for name, m in masks.items():
            key = self._check_name(name)
            if key in named:
                raise ValueError(f"masks names {named[key]!r} and {name!r}, which are the same tensor {key!r} "
                                 "(tied layers share one mask): give it once")
            named[key] = name
            pt = self.tensors[key]
            if not isinstance(m, Tensor):
                raise TypeError(f"masks[{name!r}] must be a tensor, got {type(m).__name__}")
            m = _dist.full_tensor(m)  # a sharded mask (FSDP2 selections): the replicated buffer needs all of it
            if tuple(m.shape) != tuple(pt.parameter.shape):
                raise ValueError(f"masks[{name!r}] has shape {tuple(m.shape)}, expected {tuple(pt.parameter.shape)}")
            if m.dtype != torch.bool:
                if m.is_floating_point() or m.is_complex() or m.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
                    if not bool(((m == 0) | (m == 1)).all()):
                        raise ValueError(f"masks[{name!r}] must be binary (0/1 or bool)")
                else:
                    raise TypeError(f"masks[{name!r}] has unsupported dtype {m.dtype}")
            staged.append((pt, m.detach().to(device=pt.parameter.device).bool()))
        with torch.no_grad():
            for pt, m in staged:
                buf = pt.mask
                buf.copy_(m.to(buf.dtype))
            self._apply([pt for pt, _ in staged], zero_state)

    @torch.no_grad()
    def step(self) -> None:
        """Re-impose the masks after an optimizer step: ``w <- w * mu`` and, unless
        ``zero_state_every_step=False``, ``s <- s * mu`` for every optimizer state
        tensor ``s`` of the parameter's shape."""
        self._apply(list(self.tensors.values()), self.zero_state_every_step)

    apply = step

    def group(self):
        """The resolved process group the masks are kept identical over under
        DDP (``None`` in a single process; see the class docstring)."""
        return _dist.resolve_group(self.process_group)

    def _float_mask(self, pt: PrunableTensor, p: Tensor) -> Tensor:
        """The mask in ``p``'s dtype, restricted to ``p``'s local shard under FSDP2."""
        m = _dist.local_part(pt.mask, p)
        return m if m.dtype == p.dtype else m.to(p.dtype)

    def _apply(self, pts: List[PrunableTensor], zero_state: bool) -> None:
        if not pts:
            return
        params = [pt.parameter for pt in pts]
        masks = [self._float_mask(pt, p) for pt, p in zip(pts, params)]
        with torch.no_grad():
            # in place on the Parameters (their local shards under FSDP2): bumps their version counters
            torch._foreach_mul_([_dist.local(p) for p in params], masks)
            if not zero_state:
                return
            states, smasks = [], []
            for opt in self.optimizers:
                for p, m in zip(params, masks):
                    st = opt.state.get(p)
                    if not st:
                        continue
                    for v in st.values():
                        if isinstance(v, Tensor) and v.shape == p.shape and v is not p:
                            states.append(_dist.local(v))
                            smasks.append(m if v.dtype == m.dtype else m.to(v.dtype))
            if states:
                torch._foreach_mul_(states, smasks)

    # ------------------------------------------------------------- gradients
    def dense_gradients(self, closure) -> "OrderedDict[str, Tensor]":
        """Gradients of the loss returned by ``closure()`` with respect to the
        *effective* weights ``w * mu``, including pruned entries (RigL's growth
        criterion, paper App. G.3).

        Because pruned entries are exactly zero, setting every mask to one does
        not change the forward pass; the closure runs (forward only; this method
        back-propagates) with all-ones masks, the masks are restored after.
        Existing ``.grad`` fields are left untouched.

        **Distributed.**  Under DDP (plain parameters) the gradients are taken
        with ``torch.autograd.grad`` on the rank's batch and then averaged over
        :meth:`group` (one all-reduce of the masked tensors' gradients), so every
        rank gets the gradient of the global batch.  The closure may call the
        DDP-wrapped model: during it DDP does not arm its gradient hooks (as
        under ``ddp.no_sync()``).  Under FSDP2 (DTensor parameters) the loss is
        back-propagated with ``backward()``, which FSDP2 reduce-scatters and
        averages into sharded gradients (DTensors, returned as such); the
        model's ``.grad`` fields are saved and restored around it."""
        saved = {n: pt.mask.detach().clone() for n, pt in self.tensors.items()}
        params = self.parameters()
        sharded = any(_dist.is_dtensor(p) for p in params)
        try:
            with torch.no_grad():
                for pt in self.tensors.values():
                    pt.mask.fill_(1)
            with torch.enable_grad():
                if sharded:
                    grads = _backward_gradients(self.model, params, closure)
                else:
                    with _ddp_no_sync():
                        loss = _check_loss(closure())
                    grads = list(torch.autograd.grad(loss, params, allow_unused=True))
        finally:
            with torch.no_grad():
                for n, pt in self.tensors.items():
                    pt.mask.copy_(saved[n])
        out = OrderedDict(
            (n, torch.zeros_like(p) if g is None else g.detach()) for n, p, g in zip(self.tensors, params, grads)
        )
        if not sharded:
            _dist.all_reduce_mean_(list(out.values()), self.group())
        return out

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> Dict[str, object]:
        """``{"masks": {tensor FQN: bool mask}, "zero_state_every_step": bool}``."""
        return {"masks": dict(self.masks()), "zero_state_every_step": self.zero_state_every_step}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore masks saved by :meth:`state_dict` (all tensors must be present)."""
        if "masks" not in state:
            raise ValueError("state dict has no 'masks' entry")
        masks = state["masks"]
        missing = [n for n in self.tensors if n not in masks]
        if missing:
            raise ValueError(f"state dict lacks masks for {missing}")
        self.set_masks(masks)
        self.zero_state_every_step = bool(state.get("zero_state_every_step", True))

    # ---------------------------------------------------------------- export
    def remove(self, to_conv2d: bool = False) -> nn.Module:
        """Bake this masker's masks in and leave a plain model (see
        :func:`remove_masks`).  Only the masker's own tensors are touched
        (``to_conv2d`` replaces only its ``FBConv2d`` layers); every layer is
        checked before any is changed.  Tied layers (:attr:`aliases`) are baked
        too and still share their Parameter after (with ``to_conv2d`` each tied
        FBConv2d becomes its own ``nn.Conv2d``).  Returns the model.  On a
        DDP- or FSDP-wrapped model removing a parametrization (or swapping
        layers) is a ``ValueError``: bake the masks into an unwrapped model
        (e.g. one loaded from the full state dict)."""
        return _bake_masks(self.model, list(self.tensors.values()) + list(self._alias_tensors.values()), to_conv2d)


def _check_loss(loss) -> Tensor:
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise TypeError("closure must return a scalar loss tensor")
    return loss


@contextlib.contextmanager
def _ddp_no_sync():
    """While active, a ``DistributedDataParallel`` forward does not arm its
    gradient hooks (``ddp.no_sync()`` for every DDP module that runs): the
    gradients are taken with ``autograd.grad``, which never fires them, and an
    armed reducer would fail the next forward ("Expected to have finished
    reduction in the prior iteration")."""
    if not _dist.initialized():
        yield
        return
    from torch.nn.parallel import DistributedDataParallel

    paused = []

    def pause(module, args):
        if isinstance(module, DistributedDataParallel) and module.require_backward_grad_sync:
            module.require_backward_grad_sync = False
            paused.append(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pause)
    try:
        yield
    finally:
        handle.remove()
        for module in paused:
            module.require_backward_grad_sync = True


def _backward_gradients(model: nn.Module, params: List[Tensor], closure) -> List[Optional[Tensor]]:
    """``d closure() / d params`` through ``backward()`` (what FSDP2 reduces
    into sharded gradients), leaving every ``.grad`` of ``model`` as it was."""
    everything = list({id(p): p for p in list(model.parameters()) + list(params)}.values())
    before = [p.grad for p in everything]
    try:
        for p in everything:
            p.grad = None
        _check_loss(closure()).backward()
        return [p.grad for p in params]
    finally:
        for p, g in zip(everything, before):
            p.grad = g


def _weight_masks(module: nn.Module) -> List[WeightMask]:
    """The :class:`WeightMask` parametrizations of ``module.weight``."""
    if not parametrize.is_parametrized(module, "weight"):
        return []
    return [p for p in module.parametrizations.weight if isinstance(p, WeightMask)]


def _check_maskable(pt: PrunableTensor) -> None:
    """``ValueError`` naming the layer when ``pt`` cannot carry a prunopt mask."""
    m, attr = pt.module, pt.attr
    if parametrize.is_parametrized(m, attr):
        plist = list(getattr(m.parametrizations, attr))
        if pt.interspace or len(plist) != 1 or not isinstance(plist[0], WeightMask):
            kinds = [type(p).__name__ for p in plist]
            raise ValueError(
                f"layer {pt.name!r} is already parametrized by {kinds} (e.g. "
                "torch.nn.utils.parametrizations.weight_norm); a Masker masks plain tensors only: remove the "
                "parametrization first or exclude the layer"
            )
        return  # a WeightMask of an earlier Masker: reused
    p = m._parameters.get(attr)
    if not isinstance(p, nn.Parameter):
        raise ValueError(
            f"layer {pt.name!r} is not a Parameter of its module but computed by a forward pre-hook "
            "(torch.nn.utils.prune, torch.nn.utils.weight_norm or spectral_norm): remove it first (e.g. "
            "torch.nn.utils.prune.remove) or exclude the layer"
        )
    if nn.parameter.is_lazy(p):
        raise ValueError(f"layer {pt.name!r} is uninitialized (a lazy module): run a forward pass before "
                         "building the Masker, or exclude the layer")


def _tie_groups(found: Mapping[str, PrunableTensor]) -> List[List[PrunableTensor]]:
    """Group the tensors by Parameter identity, in module order: the first
    tensor of a group owns the mask, the others (tied weights) share it."""
    groups: Dict[int, List[PrunableTensor]] = OrderedDict()
    for pt in found.values():
        groups.setdefault(id(pt.parameter), []).append(pt)
    return list(groups.values())


def _check_tie(group: List[PrunableTensor]) -> None:
    """``ValueError`` when tied layers cannot share one mask."""
    if len(group) == 1:
        return
    names = [pt.name for pt in group]
    if len({pt.interspace for pt in group}) != 1:
        raise ValueError(f"tied layers {names} mix FB coefficients and spatial weights")
    first = group[0]
    if first.interspace:
        for pt in group[1:]:
            a, b = first.module.mask, pt.module.mask
            same = a is b or (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
            if not same:
                raise ValueError(f"tied layers {first.name!r} and {pt.name!r} share their coefficients but have "
                                 "different masks; a tied tensor has one mask: make the masks equal first")
    else:
        existing = {id(wm) for pt in group for wm in _weight_masks(pt.module)}
        if len(existing) > 1:
            raise ValueError(f"tied layers {names} share one Parameter but carry different WeightMasks (from earlier "
                             "maskers): call remove_masks(model) first")


def _install_masks(groups: List[List[PrunableTensor]]) -> None:
    """Give every group one mask (all ones unless one exists); undone on an error."""
    done = []
    try:
        for group in groups:
            first = group[0]
            if first.interspace:  # FBConv2d computes with its own mask buffer: share the first's
                for pt in group[1:]:
                    if pt.module.mask is not first.module.mask:
                        done.append((pt.module, pt.module.mask))
                        pt.module.mask = first.module.mask
                continue
            wms = [wm for pt in group for wm in _weight_masks(pt.module)]
            wm = wms[0] if wms else WeightMask(torch.ones_like(first.parameter))
            for pt in group:
                if not _weight_masks(pt.module):
                    parametrize.register_parametrization(pt.module, "weight", wm, unsafe=True)
                    done.append((pt.module, None))
    except BaseException:
        for module, old_mask in reversed(done):
            if old_mask is None:
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            else:
                module.mask = old_mask
        raise


def _distinct_tensors(tensors: Mapping[str, PrunableTensor]) -> "OrderedDict[str, PrunableTensor]":
    """``tensors`` with tied duplicates dropped: one entry per distinct
    Parameter, under its first name (the :class:`Masker`'s convention)."""
    return OrderedDict((g[0].name, g[0]) for g in _tie_groups(tensors))


def remove_masks(model: nn.Module, to_conv2d: bool = False) -> nn.Module:
    """Bake every mask into its tensor and leave a plain model.

    Conv2d/Linear: the :class:`WeightMask` parametrization is removed and
    ``weight`` becomes a plain ``Parameter`` equal to ``w * mu`` (the same
    Parameter object, so optimizers stay valid); layers whose weight has no
    :class:`WeightMask` (unmasked, or parametrized by something else) are left
    alone.  FBConv2d: ``lam <- lam * mu``; with ``to_conv2d=True`` the layer is
    replaced by the equivalent ``nn.Conv2d`` (``FBConv2d.to_conv2d()``, paper
    App. E).  A weight with a :class:`WeightMask` and another parametrization is
    a ``ValueError``, raised before any layer is changed.  Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    to_conv2d = check_bool(to_conv2d, "to_conv2d")
    return _bake_masks(model, list(prunable_tensors(model).values()), to_conv2d)


def _bake_masks(model: nn.Module, pts: List[PrunableTensor], to_conv2d: bool) -> nn.Module:
    plan = []
    for pt in pts:  # check every layer first: nothing changes on an error
        m = pt.module
        if pt.interspace:
            plan.append(pt)
        elif parametrize.is_parametrized(m, "weight"):
            plist = list(m.parametrizations.weight)
            if not any(isinstance(p, WeightMask) for p in plist):
                continue  # not a prunopt mask
            if not all(isinstance(p, WeightMask) for p in plist):
                raise ValueError(f"{pt.name} has parametrizations other than WeightMask; remove them first")
            plan.append(pt)
    if to_conv2d or any(not pt.interspace for pt in plan):
        # removing a parametrization re-sets the weight, to_conv2d swaps layers: a wrapper would lose them
        from prunopt.nn._wrapping import check_not_wrapped

        check_not_wrapped(model, "Baking the masks in (remove_masks, Masker.remove)")
    with torch.no_grad():
        for pt in plan:
            m = pt.module
            if pt.interspace:
                lam = _dist.local(m.coefficients)  # the local shard under FSDP2
                lam.mul_(_dist.local_part(m.mask, m.coefficients).to(lam.dtype))
            else:
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
        if to_conv2d:
            for pt in plan:
                if pt.interspace:
                    _replace(model, pt.module_name, pt.module.to_conv2d())
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
