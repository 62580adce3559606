"""Differentiable architecture pruning with two-temperature masks (Colombo & Gao).

:class:`TwoTemperatureMask` wraps an ``nn.Linear`` or ``nn.Conv2d`` and multiplies
its weight by the relaxed mask ``v = sigmoid(t_l w)`` whose backward pass uses the
softer temperature ``t_s`` (eq. 6-7). Helpers: the regulariser
:func:`mask_regularizer` (``gamma ||v||^2``), the target-sparsity stop
:func:`stop_at_sparsity`, layerwise densities and the random re-draw
(:func:`layer_densities`, :func:`reshuffle_masks`), and transfer of a selected
architecture to a fresh model (:func:`extract_architecture`, :func:`apply_architecture`).
"""
from __future__ import annotations

import math
import numbers
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prunopt.nn._jit import script_unsupported
from prunopt.ops import two_temperature_sigmoid
from prunopt.validation import check_list, check_module, check_real

__all__ = [
    "TwoTemperatureMask",
    "wrap_two_temperature_masks",
    "two_temperature_masks",
    "mask_regularizer",
    "mask_density",
    "stop_at_sparsity",
    "layer_densities",
    "reshuffle_masks",
    "extract_architecture",
    "apply_architecture",
]


def _check_mask_args(t_l, t_s, init_scale) -> None:
    for name, v in (("t_l", t_l), ("t_s", t_s), ("init_scale", init_scale)):
        if v is None and name == "t_s":
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {type(v).__name__}")
        check_real(v, name)  # (an int beyond the float range is a ValueError)
    t_s = t_l / 100.0 if t_s is None else t_s
    for name, v in (("t_l", t_l), ("t_s", t_s)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite temperature > 0, got {v}")
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"init_scale must be a finite number > 0, got {init_scale}")


class TwoTemperatureMask(nn.Module):
    r"""A weight mask learnt with two temperatures (AP eq. 6-7).

    The wrapped layer computes with :math:`\tilde\theta = v \odot \theta`,
    :math:`v = \sigma(t_l w)` forward and
    :math:`\partial v/\partial w := t_s\sigma(t_s w)(1-\sigma(t_s w))` backward
    (``t_l = 1000``, ``t_s = t_l/100`` by default, the paper's best). The mask
    logits start small and positive, :math:`w_0 \sim |N(0, \epsilon_w)|`
    (``init_scale`` = :math:`\epsilon_w`), i.e. every weight on.

    Once :attr:`frozen` (target sparsity reached, or :meth:`finalize`) the layer
    uses the final binary mask :math:`\mathbf 1[w > 0]` and ``w`` gets no
    gradient (``w.requires_grad`` is False). The ``frozen`` buffer is saved in
    the state dict, and :meth:`load_state_dict` sets ``w.requires_grad`` to
    match the loaded value (a frozen checkpoint loads frozen, an unfrozen one
    makes ``w`` trainable again).

    On the meta device, where the buffer holds no value, the mask reads the
    frozen state from ``w.requires_grad`` (kept in step by :meth:`freeze` and
    :meth:`load_state_dict`), so a meta model runs for shapes.

    :attr:`weight` and :attr:`bias` are read-only views for modules that read
    a child layer's parameters directly (e.g. ``nn.TransformerEncoderLayer``'s
    inference fast path): the masked weight and the layer's bias. The layer's
    own weight is ``layer.weight``.
    """

    __prepare_scriptable__ = script_unsupported  # torch.jit.script: a clear error (prunopt.nn._jit)

    def __init__(self, layer: nn.Module, t_l: float = 1000.0, t_s: Optional[float] = None, init_scale: float = 1e-2,
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        if not isinstance(layer, (nn.Linear, nn.Conv2d)):
            raise TypeError(f"layer must be an nn.Linear or nn.Conv2d (TwoTemperatureMask wraps one), got "
                            f"{type(layer).__name__}")
        _check_mask_args(t_l, t_s, init_scale)
        self.layer = layer
        self.t_l = float(t_l)
        self.t_s = float(t_l / 100.0 if t_s is None else t_s)
        w = layer.weight
        if w.is_meta:  # no values to draw (and nothing to allocate)
            w0 = torch.empty(w.shape, dtype=w.dtype, device=w.device)
        else:  # drawn on the CPU in float64, so a generator gives the same w0 on every device and dtype
            w0 = (torch.randn(w.shape, generator=generator, dtype=torch.float64, device="cpu") * init_scale).abs()
        self.w = nn.Parameter(w0.to(dtype=w.dtype, device=w.device))
        self.register_buffer("frozen", torch.zeros((), dtype=torch.bool, device=w.device))

    def _is_frozen(self) -> bool:
        if self.frozen.is_meta:  # no value to read: freeze() and loading keep requires_grad in step
            return not self.w.requires_grad
        return bool(self.frozen)

    def relaxed_mask(self) -> Tensor:
        """v = sigmoid(t_l w) with the t_s backward (eq. 6-7). (For logits
        sharded by FSDP2, outside the forward pass, :func:`mask_regularizer`
        works on the local shards.)"""
        return two_temperature_sigmoid(self.w, self.t_l, self.t_s)

    def binary_mask(self) -> Tensor:
        """The final mask 1[w > 0] (in the weight's dtype)."""
        return (self.w.detach() > 0).to(self.w.dtype)

    def mask(self) -> Tensor:
        """The mask in use: :meth:`binary_mask` once frozen, else :meth:`relaxed_mask`."""
        if torch.compiler.is_compiling() and not self.frozen.is_meta:
            # chosen on the device (reading the flag on the host would break the graph); the frozen
            # branch is the detached binary mask, so gradients flow only while the mask is live
            return torch.where(self.frozen, self.binary_mask(), self.relaxed_mask())
        if self._is_frozen():
            return self.binary_mask()
        return self.relaxed_mask()

    def freeze(self) -> None:
        """Stop updating w: from now on the binary mask is used."""
        self.frozen.fill_(True)
        self.w.requires_grad_(False)

    finalize = freeze

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        n_errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + "frozen"
        if key not in state_dict or len(error_msgs) > n_errors:
            return  # nothing (valid) was loaded for the flag: the state is as it was
        src = self.frozen if not self.frozen.is_meta else state_dict[key]
        if isinstance(src, Tensor) and not src.is_meta:
            # w gets a gradient exactly when the loaded mask is not frozen
            self.w.requires_grad_(not bool(src))

    def masked_weight(self) -> Tensor:
        return self.layer.weight * self.mask()

    @property
    def weight(self) -> Tensor:
        """The masked weight ``layer.weight * mask()`` (read-only, recomputed on each access)."""
        return self.masked_weight()

    @property
    def bias(self) -> Optional[Tensor]:
        """The wrapped layer's bias (read-only)."""
        return self.layer.bias

    # the wrapped layer's hyper-parameters, for code that reads them from the layer it called
    # (e.g. transformers' MobileNetV2 computes its TF-style padding from the conv's stride and kernel)
    _LAYER_ATTRS = frozenset({"in_features", "out_features", "in_channels", "out_channels", "kernel_size", "stride",
                              "padding", "dilation", "groups", "padding_mode", "transposed", "output_padding"})

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in TwoTemperatureMask._LAYER_ATTRS and "layer" in self._modules:
                return getattr(self._modules["layer"], name)
            raise

    def forward(self, x: Tensor) -> Tensor:
        weight = self.masked_weight()
        if isinstance(self.layer, nn.Linear):
            return F.linear(x, weight, self.layer.bias)
        return self.layer._conv_forward(x, weight, self.layer.bias)

    def extra_repr(self) -> str:
        return f"t_l={self.t_l}, t_s={self.t_s}"


_WRAPPED_TYPES = (nn.Linear, nn.Conv2d)


def wrap_two_temperature_masks(model: nn.Module, t_l: float = 1000.0, t_s: Optional[float] = None,
                               init_scale: float = 1e-2, generator: Optional[torch.Generator] = None) -> nn.Module:
    """Wraps every ``nn.Linear`` / ``nn.Conv2d`` of ``model`` (in place) in a
    :class:`TwoTemperatureMask` and returns ``model``; when ``model`` itself is
    an ``nn.Linear`` / ``nn.Conv2d``, returns its wrapper (``model`` becomes the
    wrapper's ``layer``), so use the return value.

    * Only modules whose type is exactly ``nn.Linear`` or ``nn.Conv2d`` are
      wrapped; subclasses (e.g. ``nn.MultiheadAttention``'s ``out_proj``, a
      ``NonDynamicallyQuantizableLinear`` whose weight the attention reads
      directly) are left as they are, as :func:`prunopt.nn.to_interspace`
      converts exact ``nn.Conv2d`` only.
    * A layer registered under several names (tied) gets one wrapper, used
      under every name, so every use is masked with the same ``w``; a layer
      that is already wrapped is not wrapped again (a bare use of it elsewhere
      gets its existing wrapper).
    * The mask logits are drawn from ``generator`` in ``model.modules()`` order.
    * The arguments are checked before anything is changed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_mask_args(t_l, t_s, init_scale)
    existing = {}  # id(layer) -> a wrapper that already holds it
    for m in model.modules():
        if isinstance(m, TwoTemperatureMask):
            existing.setdefault(id(m.layer), m)
    new = {}
    for m in model.modules():  # each module once, however many names it has
        if type(m) in _WRAPPED_TYPES and id(m) not in new:
            new[id(m)] = existing[id(m)] if id(m) in existing else \
                TwoTemperatureMask(m, t_l, t_s, init_scale, generator)
    if id(model) in new:
        return new[id(model)]
    for parent in list(model.modules()):
        if isinstance(parent, TwoTemperatureMask):
            continue  # its layer is the wrapped module itself
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in new:
                parent._modules[name] = new[id(child)]
    return model


def two_temperature_masks(model: nn.Module) -> List[TwoTemperatureMask]:
    """Every :class:`TwoTemperatureMask` of ``model``, in module order."""
    check_module(model, "model")
    return [m for m in model.modules() if isinstance(m, TwoTemperatureMask)]


def mask_regularizer(masks: Sequence[TwoTemperatureMask], gamma: float) -> Tensor:
    r""":math:`\gamma \sum_l \|v_l\|_2^2` over the relaxed masks (AP eq. 13's penalty),
    through the two-temperature backward. Frozen masks contribute nothing.

    Mask logits sharded by FSDP2 (DTensors, as they are outside the forward
    pass) are summed over the whole tensors: each rank squares its shard's
    relaxed mask and the partial sums are added over the ranks
    (:func:`prunopt.distributed.sum_over_shards`), so every rank gets the
    same penalty and each shard the gradient of the global one."""
    from prunopt.distributed import is_distributed_tensor, local_tensor, sum_over_shards

    masks = _masks(masks)
    gamma = check_real(gamma, "gamma", 0.0)
    live = [m for m in masks if not m._is_frozen()]
    if not live:
        return torch.zeros(())
    terms = []
    for m in live:
        if is_distributed_tensor(m.w):
            v = two_temperature_sigmoid(local_tensor(m.w), m.t_l, m.t_s)
            terms.append(sum_over_shards((v ** 2).sum(), m.w))
        else:
            terms.append((m.relaxed_mask() ** 2).sum())
    return gamma * sum(terms)


def _kept_counts(masks: Sequence[TwoTemperatureMask]) -> List[int]:
    """Per layer, the number of entries with ``w > 0`` in the whole tensor:
    for FSDP2 shards (DTensors) the local counts summed over the ranks in one
    ``all_reduce``; a plain tensor among DTensors is taken as replicated and
    counted once."""
    from prunopt.distributed import all_reduce_sum, counts_locally, is_distributed_tensor, local_tensor, \
        process_group_of

    ws = [m.w.detach() for m in masks]
    sharded = [w for w in ws if is_distributed_tensor(w)]
    if not sharded:
        return [int((w > 0).sum()) for w in ws]
    first = all(c == 0 for c in sharded[0].device_mesh.get_coordinate())
    local = [int((local_tensor(w) > 0).sum()) if (counts_locally(w) if is_distributed_tensor(w) else first) else 0
             for w in ws]
    return [int(v) for v in all_reduce_sum(local, group=process_group_of(sharded)).tolist()]


@torch.no_grad()
def mask_density(masks: Sequence[TwoTemperatureMask]) -> float:
    """Fraction of ones in the final masks 1[w > 0] over all layers (over the
    whole tensors for FSDP2 shards: the same value on every rank)."""
    masks = _masks(masks)
    total = sum(m.w.numel() for m in masks)
    return sum(_kept_counts(masks)) / max(total, 1)


def stop_at_sparsity(masks: Sequence[TwoTemperatureMask], target_sparsity: float) -> bool:
    """Freezes every mask once the global sparsity of 1[w > 0] reaches
    ``target_sparsity`` (AP footnote 10); returns True when frozen."""
    masks = _masks(masks)
    target_sparsity = check_real(target_sparsity, "target_sparsity", 0.0, 1.0)
    if 1.0 - mask_density(masks) >= target_sparsity:
        for m in masks:
            m.freeze()
        return True
    return False


@torch.no_grad()
def layer_densities(masks: Sequence[TwoTemperatureMask]) -> List[float]:
    """Density of 1[w > 0] per layer (the paper's Table 1 layerwise profile);
    NaN for a layer without weights (0 elements), whose density is undefined.
    Over the whole tensors for FSDP2 shards."""
    masks = _masks(masks)
    return [k / m.w.numel() if m.w.numel() else math.nan for k, m in zip(_kept_counts(masks), masks)]


@torch.no_grad()
def _masks(masks) -> List["TwoTemperatureMask"]:
    """``masks`` as a list of TwoTemperatureMask (TypeError naming ``masks``)."""
    return check_list(masks, "masks", TwoTemperatureMask, "TwoTemperatureMask modules")


@torch.no_grad()
def _set_from_mask(m: TwoTemperatureMask, keep: Tensor) -> None:
    # w = +1 where kept, -1 elsewhere: sigmoid(t_l w) is then binary as well
    m.w.copy_(torch.where(keep, torch.ones_like(m.w), -torch.ones_like(m.w)))
    m.freeze()


@torch.no_grad()
def reshuffle_masks(masks: Sequence[TwoTemperatureMask], densities: Optional[Sequence[float]] = None,
                    generator: Optional[torch.Generator] = None) -> None:
    """Random re-draw with the same layerwise densities (the reshuffle
    experiment): each layer keeps round(d * size) weights chosen uniformly at
    random; the masks are frozen. Every density is checked (a real number in
    [0, 1]; for a layer without weights, which has nothing to draw, NaN as
    :func:`layer_densities` gives is accepted too) before any mask is changed."""
    masks = _masks(masks)
    densities = layer_densities(masks) if densities is None else check_list(densities, "densities", item="numbers")
    if len(densities) != len(masks):
        raise ValueError(f"densities has {len(densities)} entries for {len(masks)} masks")
    for i, (m, d) in enumerate(zip(masks, densities)):
        if isinstance(d, bool) or not isinstance(d, numbers.Real):
            raise TypeError(f"densities must be real numbers, got {type(d).__name__}")
        if m.w.numel() == 0 and math.isnan(d):
            continue  # an empty layer: its density is undefined and unused
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"densities must be in [0, 1], got {d} (entry {i})")
    for m, d in zip(masks, densities):
        n = m.w.numel()
        k = int(round(d * n)) if n else 0
        perm = torch.randperm(n, generator=generator)[:k].to(m.w.device)
        keep = torch.zeros(n, dtype=torch.bool, device=m.w.device)
        keep[perm] = True
        _set_from_mask(m, keep.view_as(m.w))


@torch.no_grad()
def extract_architecture(masks: Sequence[TwoTemperatureMask]) -> List[Tensor]:
    """The selected sub-architecture: the boolean masks 1[w > 0] per layer."""
    masks = _masks(masks)
    return [(m.w > 0).clone() for m in masks]


@torch.no_grad()
def apply_architecture(masks: Sequence[TwoTemperatureMask], architecture: Sequence[Tensor]) -> None:
    """Transfer: fixes the masks of (another) model to a selected architecture
    (e.g. selected on one task, retrained on another); the masks are frozen.

    Each entry of ``architecture`` is a tensor of its weight's shape, boolean or
    with values 0/1 only; all are checked before any mask is changed."""
    masks = _masks(masks)
    architecture = check_list(architecture, "architecture", item="tensors")
    if len(architecture) != len(masks):
        raise ValueError(f"architecture has {len(architecture)} masks for {len(masks)} layers")
    for m, a in zip(masks, architecture):
        if not isinstance(a, Tensor):
            raise TypeError(f"architecture masks must be tensors, got {type(a).__name__}")
        if a.shape != m.w.shape:
            raise ValueError(f"architecture mask of shape {tuple(a.shape)} does not fit a weight of shape {tuple(m.w.shape)}")
        if a.dtype != torch.bool and not bool(((a == 0) | (a == 1)).all()):
            raise ValueError("architecture masks must be boolean or hold only the values 0 and 1")
    for m, a in zip(masks, architecture):
        _set_from_mask(m, a.to(device=m.w.device, dtype=torch.bool))
