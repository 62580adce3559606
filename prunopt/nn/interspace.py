"""Filter-basis convolution layers for interspace pruning (Wimmer
et al., "Interspace Pruning", CVPR 2022). See ``docs/interspace.md``.

* :class:`FilterBasis` holds ``N`` filters ``g^(1..N)`` of size ``kh × kw``
  (a basis when ``N = kh*kw``, a dictionary otherwise), shareable by layers.
* :class:`FBConv2d` is a drop-in ``nn.Conv2d`` whose filters are
  ``h[o,i] = sum_n lam[o,i,n] mu[o,i,n] g^(n)`` (eq. 4) with coefficients
  ``lam``, a 0/1 mask ``mu`` (interspace pruning masks ``lam``) and a basis.
* :func:`to_interspace` converts a model in place (fine / coarse / custom
  sharing, Sec. 4.3; 1×1 convolutions stay standard, App. H).
* :func:`interspace_param_groups`, :func:`pruning_rates` (eq. 9),
  :func:`interspace_flops` (App. D), :func:`sparse_storage` (App. C, eq. A.2)
  and :func:`interspace_report`.
"""
from __future__ import annotations

import math
import numbers
import weakref
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _reverse_repeat_tuple

from prunopt.nn._jit import script_unsupported
from prunopt import ops
from prunopt.ops import interspace as ops_interspace
from prunopt.nn._swap import swap_modules
from prunopt.nn._wrapping import check_not_wrapped
from prunopt.reference.interspace import fb_reconstruct_reference
from prunopt.validation import pair as _checked_pair
from prunopt.validation import SIZE_MAX, check_bool, check_int, check_module
from prunopt.validation import validate_fb_args, validate_fb_input

__all__ = [
    "FilterBasis",
    "FBConv2d",
    "to_interspace",
    "interspace_param_groups",
    "pruning_rates",
    "interspace_flops",
    "sparse_storage",
    "interspace_report",
]

_INITS = ("standard", "orthonormal", "random")


def _kernel_pair(kernel_size) -> Tuple[int, int]:
    """``kernel_size`` as ``(kh, kw)``: TypeError unless an int or a pair of ints,
    ValueError unless both are positive."""
    kh, kw = _checked_pair(kernel_size, "kernel_size")
    if kh < 1 or kw < 1 or max(kh, kw) > SIZE_MAX:
        raise ValueError(f"kernel_size must be positive (and at most {SIZE_MAX}), got {(kh, kw)}")
    return kh, kw


def _same_device(requested, actual: torch.device) -> bool:
    """Whether the ``device`` argument ``requested`` names ``actual`` (``"cuda"``
    means the current CUDA device)."""
    d = torch.device(requested)
    if d.type != actual.type:
        return False
    if d.index is None and d.type not in ("cpu", "meta"):
        d = torch.empty(0, device=d).device
    return d.index == actual.index or (d.index is None and actual.index is None)


# FilterBasis -> (error_msgs of the load_state_dict call, key, tensor) of the
# last prefix a shared basis was loaded from (see FilterBasis._load_from_state_dict)
_BASIS_LOADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class FilterBasis(nn.Module):
    r"""A filter basis (``N = kh*kw``) or dictionary (any ``N``) ``{g^(1), ..., g^(N)}``
    of ``kh × kw`` filters (Sec. 4.2, App. G), held in the Parameter ``weight``
    of shape ``(N, kh, kw)``. One instance may be shared by many
    :class:`FBConv2d` layers (Sec. 4.3).

    Initialisations (App. G):

    * ``"standard"`` (Alg. A1): ``g^(n) = e^(n)``, the standard basis, so an
      FB layer is an ordinary convolution at initialisation. Needs ``N = kh*kw``.
    * ``"orthonormal"`` (Alg. A2): Gram-Schmidt (QR) of a Gaussian matrix, a random
      orthonormal basis. Needs ``N = kh*kw``.
    * ``"random"`` (Alg. A3): Gaussian dictionary rescaled to pixelwise mean
      ``1/N`` and variance ``1/N - 1/N^2`` (eq. A.68-A.74), so kaiming-normal
      coefficients give kaiming-normal spatial weights in distribution.

    Args:
        kernel_size: ``K`` or ``(kh, kw)`` (positive ints).
        size: ``N`` (default ``kh*kw``).
        init: one of ``"standard"``, ``"orthonormal"``, ``"random"``.
        generator: optional ``torch.Generator`` for the random inits.
    """

    __prepare_scriptable__ = script_unsupported  # torch.jit.script: a clear error (prunopt.nn._jit)

    def __init__(self, kernel_size, size: Optional[int] = None, init: str = "standard", *,
                 generator: Optional[torch.Generator] = None, device=None, dtype=None):
        super().__init__()
        kh, kw = _kernel_pair(kernel_size)
        n = kh * kw if size is None else size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n > SIZE_MAX:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if init not in _INITS:
            raise ValueError(f"init must be one of {_INITS}, got {init!r}")
        if init in ("standard", "orthonormal") and n != kh * kw:
            raise ValueError(f"init={init!r} needs size == kh*kw = {kh * kw}, got {n}; use init='random' for a dictionary")
        self.kernel_size = (kh, kw)
        self.init = init
        self.weight = nn.Parameter(torch.empty(n, kh, kw, device=device, dtype=dtype))
        self.reset_parameters(generator)

    @property
    def size(self) -> int:
        """``N``, the number of basis elements."""
        return self.weight.shape[0]

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Redraws ``weight`` by the basis's ``init`` (Alg. A1-A3), in float64 and
        rounded once to the weight's dtype."""
        n, (kh, kw) = self.size, self.kernel_size
        m = kh * kw
        if self.init == "standard":  # Alg. A1, l. 3
            w = torch.eye(m, dtype=torch.float64)
        elif self.init == "orthonormal":  # Alg. A2, l. 3-4 (QR = Gram-Schmidt)
            q, r = torch.linalg.qr(torch.randn(m, m, generator=generator, dtype=torch.float64))
            w = (q * torch.sign(torch.diagonal(r))).T  # rows are the orthonormal g^(n)
        else:  # Alg. A3, l. 3-5
            g = torch.randn(n, m, generator=generator, dtype=torch.float64)
            mean, std = g.mean(0, keepdim=True), g.std(0, unbiased=False, keepdim=True)
            if n > 1:
                w = math.sqrt(1.0 / n - 1.0 / n**2) * (g - mean) / std + 1.0 / n
            else:
                w = torch.ones(1, m, dtype=torch.float64)  # N = 1: mean 1, variance 0
        self.weight.copy_(w.reshape(n, kh, kw).to(self.weight.dtype))

    def matrix(self) -> Tensor:
        """``Psi`` of eq. A.19 as ``(kh*kw, N)``: spatial coefficients ``phi = Psi @ lam``."""
        return self.weight.reshape(self.size, -1).T

    def forward(self) -> Tensor:  # pragma: no cover - a container, not a layer
        """The basis ``weight`` (``FilterBasis`` is a container, not a layer)."""
        return self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A shared basis is visited once per layer prefix by load_state_dict. If
        # two prefixes carry different values (a state dict of a model with
        # finer sharing), the last would silently win: report it as a load
        # error instead. ``error_msgs`` is one list per load_state_dict call,
        # which scopes the record to that call.
        key = prefix + "weight"
        incoming = state_dict.get(key)
        if isinstance(incoming, Tensor):
            prev = _BASIS_LOADS.get(self)
            if prev is not None and prev[0] is error_msgs and prev[2] is not incoming and (
                    prev[2].shape != incoming.shape or not torch.equal(prev[2].to(incoming.device), incoming)):
                error_msgs.append(
                    f"{key}: this FilterBasis is shared with {prev[1]!r}, which the state dict gives other values; "
                    f"load into a model built with the same sharing (to_interspace's sharing=)")
            _BASIS_LOADS[self] = (error_msgs, key, incoming)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return f"size={self.size}, kernel_size={self.kernel_size}, init={self.init!r}"


class FBConv2d(nn.Module):
    r"""2D convolution in filter-basis (interspace) form (eq. 4, 6, 8; Alg. 1).

    .. math::
        h^{(o,i)} = \sum_{n=1}^{N} \lambda_n^{(o,i)} \mu_n^{(o,i)} g^{(n)}, \qquad
        Y^{(o)} = \sum_i h^{(o,i)} \star X^{(i)} + b_o

    Same call signature and output as ``nn.Conv2d`` (stride, padding including
    ``"same"``/``"valid"``, dilation, groups, bias, padding_mode).

    Attributes:
        coefficients: Parameter ``lam`` of shape ``(C_out, C_in/groups, N)``,
            kaiming-normal ``N(0, 2/(C_in/groups * kh*kw))`` by default (Alg. A1;
            Alg. A2 maps spatial kaiming weights by ``lam = Psi^T phi``; Alg. A3
            draws ``lam`` directly).
        basis: the :class:`FilterBasis` (possibly shared with other layers).
        mask: buffer ``mu`` (float 0/1, shape of ``coefficients``): interspace
            pruning masks coefficients, not spatial weights (Sec. 4.4).
        bias: optional Parameter ``(C_out,)``.

    In training (or whenever a gradient is needed) the forward pass reconstructs
    the masked filters with a fused kernel and calls ``conv2d``. In ``eval()``
    without gradients it caches the CSR of ``lam * mu`` (rebuilt when
    ``coefficients``, ``mask`` or the basis are updated in place or replaced) and
    runs eq. 8 on it when the cost model
    :func:`prunopt.ops.interspace.sparse_is_faster` predicts that it beats
    ``conv2d``, else ``conv2d`` with the cached reconstructed filters. Writes
    through ``.data`` bypass the version counters the cache is keyed by: call
    ``train()`` or ``eval()`` (on the layer or any module holding it; both drop
    the cache) after such writes.

    A ``basis`` passed in is shared, not copied: it must already have the
    layer's ``dtype`` and ``device`` (``None`` takes the basis's), else
    ``ValueError``. ``init`` (default ``"standard"``) initialises a new basis;
    with a ``basis`` it must be ``None`` or the basis's own ``init``.

    ``torch.func`` transforms (``grad``, ``vmap``, ``jvp``, ``jacrev``, ...) and
    forward-mode AD (``torch.autograd.forward_ad``) work: under them the layer
    reconstructs the filters with the pure-PyTorch reference (einsum) instead of
    the fused kernel, whose autograd is a C++ ``torch::autograd::Function``
    (which functorch rejects), and never takes the sparse eval path.
    """

    __prepare_scriptable__ = script_unsupported  # torch.jit.script: a clear error (prunopt.nn._jit)

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", basis: Optional[FilterBasis] = None,
                 *, init: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        for name, v in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v > SIZE_MAX:
                raise ValueError(f"{name} must be a positive int (at most {SIZE_MAX}), got {v!r}")
        bias = check_bool(bias, "bias")
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"groups={groups} must divide in_channels={in_channels} and out_channels={out_channels}")
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"padding_mode must be 'zeros', 'reflect', 'replicate' or 'circular', got {padding_mode!r}")
        kernel_size = _kernel_pair(kernel_size)
        stride, dilation = _checked_pair(stride, "stride"), _checked_pair(dilation, "dilation")
        if min(stride) < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        if min(dilation) < 1:
            raise ValueError(f"dilation must be >= 1, got {dilation}")
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"padding must be an int, a pair, 'same' or 'valid', got {padding!r}")
            if padding == "same" and stride != (1, 1):
                raise ValueError("padding='same' is not supported for strided convolutions")
        else:
            padding = _checked_pair(padding, "padding")
            if min(padding) < 0:
                raise ValueError(f"padding must be >= 0, got {padding}")
        if init is not None and init not in _INITS:
            raise ValueError(f"init must be one of {_INITS}, got {init!r}")
        if basis is None:
            basis = FilterBasis(kernel_size, init=init or "standard", device=device, dtype=dtype)
        elif not isinstance(basis, FilterBasis):
            raise TypeError(f"basis must be a FilterBasis or None, got {type(basis).__name__}")
        elif tuple(basis.kernel_size) != kernel_size:
            raise ValueError(f"basis has kernel_size {basis.kernel_size} but the layer has {kernel_size}")
        else:  # a basis passed in is shared: converting it would break the sharing
            if init is not None and init != basis.init:
                raise ValueError(f"init={init!r} applies to a new basis, but basis (init={basis.init!r}) was given: "
                                 f"pass one of them")
            bw = basis.weight
            if dtype is not None and dtype != bw.dtype:
                raise ValueError(f"basis has dtype {bw.dtype} but the layer was asked for dtype={dtype}; a basis is "
                                 f"shared, not converted: build it with dtype={dtype} (or pass dtype=None)")
            if device is not None and not _same_device(device, bw.device):
                raise ValueError(f"basis is on device {bw.device} but the layer was asked for device={device}; a "
                                 f"basis is shared, not moved: build it on that device (or pass device=None)")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = kernel_size
        self.stride, self.dilation, self.padding = stride, dilation, padding
        self.groups, self.padding_mode = groups, padding_mode
        self.basis = basis
        factory = dict(device=basis.weight.device, dtype=basis.weight.dtype)
        self.coefficients = nn.Parameter(torch.empty(out_channels, in_channels // groups, basis.size, **factory))
        self.register_buffer("mask", torch.ones(out_channels, in_channels // groups, basis.size, **factory))
        self.bias = nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        self._compressed = None
        self._compressed_key = None
        self._compressed_refs = None  # (lam, mu, g) of the cache and aliases of their storages
        self._eval_fast = None  # see _fast_eval
        self.reset_parameters()

    # -- the eval caches ----------------------------------------------------------------
    def _drop_inference_caches(self) -> None:
        """Forgets the eval caches (CSR, filters, path plans, the fast-path state)."""
        self._compressed = None
        self._compressed_key = None
        self._compressed_refs = None
        self._eval_fast = None

    def train(self, mode: bool = True) -> "FBConv2d":
        """As ``nn.Module.train`` (``eval()`` calls it with ``False``); also drops
        the eval caches, so that ``train()``/``eval()`` after writes through
        ``.data`` (which bypass the version counters the caches are keyed by)
        make the next eval call rebuild them."""
        out = super().train(mode)
        self._drop_inference_caches()
        return out

    def _apply(self, fn, *args, **kwargs):
        """As ``nn.Module._apply`` (``to``, ``double``, ``cuda``, ...), dropping the
        eval caches first: they hold tensors of the old dtype or device."""
        self._drop_inference_caches()
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        """Pickling and ``copy.deepcopy`` leave the eval caches behind (they hold
        raw data pointers of this process's tensors)."""
        state = super().__getstate__()
        state["_compressed"] = state["_compressed_key"] = state["_compressed_refs"] = state["_eval_fast"] = None
        return state

    def __setstate__(self, state):
        """As ``nn.Module.__setstate__``, with empty eval caches (also for layers
        pickled by older versions, whose caches had another layout)."""
        super().__setstate__(state)
        self._drop_inference_caches()

    # -- initialisation -----------------------------------------------------------------
    def _fan_in(self) -> int:
        return (self.in_channels // self.groups) * self.kernel_size[0] * self.kernel_size[1]

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Kaiming-normal interspace initialisation (App. G, Alg. A1-A3)."""
        std = math.sqrt(2.0 / self._fan_in())  # eq. A.67
        n, m = self.basis.size, self.kernel_size[0] * self.kernel_size[1]
        shape = self.coefficients.shape
        if self.basis.init == "orthonormal" and n == m:  # Alg. A2, l. 5-7: lam = Psi^T phi
            phi = torch.randn(shape[0] * shape[1], m, generator=generator, dtype=torch.float64) * std
            lam = phi @ self.basis.matrix().detach().double()
            self.coefficients.copy_(lam.reshape(shape))
        else:  # Alg. A1 / A3: lam ~ N(0, sigma_h^2)
            self.coefficients.copy_(torch.randn(shape, generator=generator, dtype=torch.float64) * std)
        if self.bias is not None:  # as nn.Conv2d
            bound = 1.0 / math.sqrt(self._fan_in())
            self.bias.uniform_(-bound, bound, generator=generator)

    # -- forward ------------------------------------------------------------------------
    def reconstruct(self) -> Tensor:
        """Masked spatial filters ``(C_out, C_in/groups, kh, kw)`` (eq. 4), differentiable."""
        return ops.fb_reconstruct(self.coefficients, self.basis.weight, self.mask)

    def _explicit_padding(self) -> Optional[Tuple[int, int, int, int]]:
        """Padding for ``F.pad`` (left, right, top, bottom) when it is not the
        symmetric zero padding that conv2d does itself; None otherwise."""
        if self.padding == "valid":
            return None
        if self.padding == "same":
            pads = []
            for d, k in zip(reversed(self.dilation), reversed(self.kernel_size)):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            if self.padding_mode == "zeros" and all(pads[i] == pads[i + 1] for i in (0, 2)):
                return None
            return tuple(pads)
        if self.padding_mode == "zeros":
            return None
        return tuple(_reverse_repeat_tuple(self.padding, 2))

    def _conv_padding(self) -> Tuple[int, int]:
        if self.padding == "valid" or self._explicit_padding() is not None:
            return (0, 0)
        if self.padding == "same":
            return tuple(d * (k - 1) // 2 for d, k in zip(self.dilation, self.kernel_size))
        return self.padding

    def _fb_tensors(self) -> Tuple[Tensor, Tensor, Tensor]:
        """``(coefficients, mask, basis.weight)``. The registries are read directly
        (``nn.Module.__getattr__`` would cost more than the rest of a small layer's
        Python frame), falling back to attributes when a tool such as
        ``torch.nn.utils.prune`` replaced them."""
        lam = self._parameters.get("coefficients")
        lam = self.coefficients if lam is None else lam
        mu = self._buffers.get("mask")
        mu = self.mask if mu is None else mu
        g = self.basis._parameters.get("weight")
        g = self.basis.weight if g is None else g
        return lam, mu, g

    def _inference_cache(self) -> dict:
        """The eval-mode cache: the CSR of ``lam * mu`` and, when the dense path is
        taken, the reconstructed filters. Keyed by coefficients, mask and basis
        weight by identity (the key holds them, so a replaced tensor is never
        mistaken for a new one that reuses its address), their versions (in-place
        updates: optimizer steps, pruning) and data pointers (``.data =``; the
        key holds aliases of the storages, so a pointer cannot be reused while
        it is compared). Never used when a gradient is needed; ``train()`` and
        ``eval()`` drop it (for writes through ``.data``)."""
        lam, mu, g = self._fb_tensors()
        key = (lam._version, mu._version, g._version, lam.data_ptr(), mu.data_ptr(), g.data_ptr(), lam.device,
               lam.dtype, g.dtype)
        refs = self._compressed_refs
        if self._compressed_key != key or refs is None or refs[0] is not lam or refs[1] is not mu or refs[2] is not g:
            self._compressed = {}
            self._compressed_key = key
            self._compressed_refs = (lam, mu, g, lam.detach(), mu.detach(), g.detach())  # storage aliases: see above
        return self._compressed

    def _compressed_coefficients(self) -> "ops_interspace.FBCompressed":
        cache = self._inference_cache()
        if "csr" not in cache:
            cache["csr"] = ops.fb_compress(self.coefficients.detach(), self.mask)
        return cache["csr"]

    def _inference_forward(self, input: Tensor, padding, dense_only: bool = False) -> Tensor:
        """Eval without gradients: eq. 8 on the cached CSR when the cost model
        (:func:`prunopt.ops.interspace.sparse_is_faster`) says it beats
        ``conv2d``, else ``conv2d`` with the cached reconstructed filters. The
        choice is cached per input shape with the CSR (a small layer's whole
        call is ~20 us, so its Python frame is kept short)."""
        cache = self._inference_cache()
        if dense_only:
            sparse = False
        else:
            plan_key = ("plan", input.shape, padding)
            sparse = cache.get(plan_key)
            if sparse is None:
                # once per input shape and layer state (the cache is dropped when
                # a tensor is replaced or written): the CSR op cannot know the
                # layer's C_in or N (it takes C_in from the input), so a wrong
                # input or a basis of another size is caught here
                lam, mu, g = self._fb_tensors()
                validate_fb_args(None, lam, g, mu)
                validate_fb_input(input, lam, g, padding, self.dilation, self.groups)
                sparse = self._inference_plan(input, padding, cache)
                if len(cache) < 256:  # bounded for inputs of many sizes
                    cache[plan_key] = sparse
        lam, mu, g = self._fb_tensors()
        if not sparse:
            validate_fb_input(input, lam, g, padding, self.dilation, self.groups, check_dtype=not dense_only)
            filters = cache.get("filters")
            if filters is None:
                filters = cache["filters"] = ops.fb_reconstruct(lam.detach(), g.detach(), mu)
            if not dense_only:
                self._remember_fast_eval(input, ("conv2d", filters, padding))
            return F.conv2d(input, filters, self.bias, self.stride, padding, self.dilation, self.groups)
        comp = cache["csr"]
        batched = input.dim() == 4
        if input.dim() in (3, 4) and ops_interspace.has_csr_kernel(input):
            # the raw op checks every argument itself (ValueError naming it). No
            # gradient is needed here (the caller checked), so the call skips the
            # op's Python autograd kernel, which would only redispatch below
            # autograd itself (about 9 us of a small layer's 20 us).
            with torch._C._AutoDispatchBelowAutograd():
                y = torch.ops.prunopt.fb_conv2d_csr.default(
                    input if batched else input.unsqueeze(0), comp.crow_indices, comp.col_indices, comp.values, g,
                    self.bias, self.stride, padding, self.dilation, self.groups)
            self._remember_fast_eval(input, ("csr", comp, padding))
            return y if batched else y.squeeze(0)
        return ops.fb_conv2d_compressed(input, comp, g, self.bias, self.stride, padding, self.dilation, self.groups)

    # The eval fast path. A pruned network at batch 1 spends much of a small
    # layer's time in Python: the checks of forward and _inference_forward
    # (version key, plan lookup, attribute reads) cost ~14 us against ~9 us
    # for the op (16->16 at 2x2; VGG16-CIFAR at p = 0.99 has 13 such calls in
    # ~1.2 ms). After a call of _inference_forward, the state it depended on
    # is kept in a flat tuple (tensors by identity, their versions and data
    # pointers, the layer's arguments, the input's shape, dtype and device);
    # forward without gradients checks those with plain compares and calls the
    # same op (or conv2d with the same cached filters) directly. Anything that
    # differs (training, grad mode, autocast, compiling, an in-place update,
    # a replaced tensor or argument, another input shape) goes the full way,
    # which rebuilds the state.
    def _remember_fast_eval(self, input: Tensor, call) -> None:
        if self._explicit_padding() is not None:
            return
        lam, mu, g = self._fb_tensors()
        if self._parameters.get("coefficients") is not lam or self._buffers.get("mask") is not mu:
            return
        basis = self._modules.get("basis")
        if basis is None or basis._parameters.get("weight") is not g:
            return
        self._eval_fast = (
            input.shape, input.dtype, input.device,
            lam, lam._version, lam.data_ptr(), mu, mu._version, mu.data_ptr(), basis, g, g._version, g.data_ptr(),
            self._parameters.get("bias"), (self.stride, self.padding, self.dilation, self.groups, self.padding_mode),
            call, self._compressed_refs,  # the storage aliases keep the data pointers from being reused
        )

    def _fast_eval(self, fast, input) -> Optional[Tensor]:
        """The call of :meth:`_remember_fast_eval`'s state, or None when it does
        not apply to this call."""
        (shape, dtype, device, lam, lam_v, lam_p, mu, mu_v, mu_p, basis, g, g_v, g_p, bias, conf, call, _keep) = fast
        if (not isinstance(input, Tensor) or input.shape != shape or input.dtype != dtype or input.device != device
                or self._parameters.get("coefficients") is not lam or lam._version != lam_v or lam.data_ptr() != lam_p
                or self._buffers.get("mask") is not mu or mu._version != mu_v or mu.data_ptr() != mu_p
                or self._modules.get("basis") is not basis or basis._parameters.get("weight") is not g
                or g._version != g_v or g.data_ptr() != g_p or self._parameters.get("bias") is not bias
                or (self.stride, self.padding, self.dilation, self.groups, self.padding_mode) != conf
                or torch.is_autocast_enabled(device.type) or torch.compiler.is_compiling()
                or ops_interspace._transforms_active()):
            return None
        kind, what, padding = call
        if kind == "csr":
            batched = len(shape) == 4
            with torch._C._AutoDispatchBelowAutograd():
                y = torch.ops.prunopt.fb_conv2d_csr.default(
                    input if batched else input.unsqueeze(0), what.crow_indices, what.col_indices, what.values, g,
                    bias, self.stride, padding, self.dilation, self.groups)
            return y if batched else y.squeeze(0)
        return F.conv2d(input, what, bias, self.stride, padding, self.dilation, self.groups)

    def _inference_plan(self, input: Tensor, padding, cache: dict) -> bool:
        """Whether the eval call on inputs of this shape takes the sparse path
        (builds the CSR into ``cache``)."""
        if "csr" not in cache:
            cache["csr"] = ops.fb_compress(self.coefficients.detach(), self.mask)
        comp = cache["csr"]
        c_out, c_in_g, n = comp.shape
        kh, kw = self.kernel_size
        if input.dim() not in (3, 4):
            return True  # a bad input: let the op raise its error
        hw = input.shape[-2:]
        ho = (hw[0] + 2 * padding[0] - self.dilation[0] * (kh - 1) - 1) // self.stride[0] + 1
        wo = (hw[1] + 2 * padding[1] - self.dilation[1] * (kw - 1) - 1) // self.stride[1] + 1
        image = max(ho, 0) * max(wo, 0)
        batch = input.shape[0] if input.dim() == 4 else 1
        return ops_interspace.sparse_is_faster(comp.values.numel(), c_out, c_in_g * self.groups, c_in_g, n,
                                               kh * kw, batch * image, image)

    def density(self) -> float:
        """Fraction of non-zero masked coefficients ``||lam * mu||_0 / numel``."""
        with torch.no_grad():
            return float(((self.coefficients * self.mask) != 0).sum()) / max(1, self.coefficients.numel())

    def forward(self, input: Tensor) -> Tensor:
        """``conv2d`` of ``input`` (``(B, C_in, H, W)`` or ``(C_in, H, W)``) with the
        masked filters (eq. 6/8), as ``nn.Conv2d``; see the class docstring for
        the training, eval and ``torch.func`` paths."""
        fast = self.__dict__.get("_eval_fast")
        if fast is not None and not self.training and not torch.is_grad_enabled():
            y = self._fast_eval(fast, input)
            if y is not None:
                return y
        if not isinstance(input, Tensor):
            raise TypeError(f"input must be a Tensor, got {type(input).__name__}")
        pad = self._explicit_padding()
        if pad is not None:
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            input = F.pad(input, pad, mode=mode)
        padding = self._conv_padding()
        lam, mu, g = self._fb_tensors()
        bias = self.bias
        # Under autocast the filters are reconstructed in the coefficients' dtype
        # and conv2d runs in the autocast dtype, as nn.Conv2d does (so the input
        # may have that dtype); the sparse path, which computes in the
        # coefficients' dtype, is not taken. "meta" has no autocast (torch raises).
        device_type = input.device.type
        autocast = ops_interspace._autocast_enabled(device_type)
        compiling = torch.compiler.is_compiling()
        if not compiling and ops_interspace._transforms_active():
            # torch.func transforms and forward-mode AD: the pure-PyTorch
            # reconstruction (the fused kernel's autograd is a C++ Function, which
            # functorch rejects; the sparse ops have no forward-mode formulas)
            validate_fb_args(None, lam, g, mu)
            validate_fb_input(input, lam, g, padding, self.dilation, self.groups, check_dtype=not autocast)
            h = fb_reconstruct_reference(lam, g, mu)
            return F.conv2d(input, h, bias, self.stride, padding, self.dilation, self.groups)
        needs_grad = torch.is_grad_enabled() and (
            input.requires_grad or lam.requires_grad or g.requires_grad or (bias is not None and bias.requires_grad)
        )
        # the eval caches need values: a layer on the meta device (shapes only)
        # takes the reconstruct + conv2d path, which has meta kernels
        if not needs_grad and not self.training and not compiling and device_type != "meta":
            return self._inference_forward(input, padding, dense_only=autocast)
        # The training path (eq. 6): the fused reconstruction, whose autograd is
        # in C++ (eq. 7, A.13, A.14), then conv2d. The layer's own arguments were
        # checked when it was built; the op checks lam, mu and g (ValueError
        # naming them) and only the input is checked here.
        validate_fb_input(input, lam, g, padding, self.dilation, self.groups, check_dtype=not autocast)
        if mu.dtype == lam.dtype and lam.device.type in ops_interspace._RECON_DEVICES:
            h = torch.ops.prunopt.fb_reconstruct.default(lam, g, mu)
        else:
            h = ops.fb_reconstruct(lam, g, mu)
        return F.conv2d(input, h, bias, self.stride, padding, self.dilation, self.groups)

    # -- conversions (App. E) -------------------------------------------------------------
    def _conv_kwargs(self) -> dict:
        return dict(kernel_size=self.kernel_size, stride=self.stride, padding=self.padding, dilation=self.dilation,
                    groups=self.groups, bias=self.bias is not None, padding_mode=self.padding_mode)

    @torch.no_grad()
    def to_conv2d(self) -> nn.Conv2d:
        """An ``nn.Conv2d`` with the same function: ``phi = Psi (lam * mu)`` (eq. A.19),
        computed in float64 and rounded once. The sparsity of ``lam`` is lost
        (App. D: converting a pruned FB layer is not advisable for speed)."""
        conv = nn.Conv2d(self.in_channels, self.out_channels, device=self.coefficients.device,
                         dtype=self.coefficients.dtype, **self._conv_kwargs())
        h = torch.einsum("oin,nkl->oikl", (self.coefficients * self.mask).double(), self.basis.weight.double())
        conv.weight.copy_(h)
        if self.bias is not None:
            conv.bias.copy_(self.bias)
        return conv

    @classmethod
    @torch.no_grad()
    def from_conv2d(cls, conv: nn.Conv2d, basis: Optional[FilterBasis] = None) -> "FBConv2d":
        """An FB layer with the function of ``conv`` in the basis ``basis`` (App. E):
        ``lam = Psi^{-1} phi`` (eq. A.20), or the Moore-Penrose pseudo-inverse for a
        dictionary (exact when the dictionary spans ``R^{kh x kw}``, a least-squares
        fit otherwise). Computed in float64; the mask is all ones. ``basis=None``
        uses a new standard basis (then ``lam = phi`` exactly); a ``basis`` passed
        in is shared, so it must have ``conv.weight``'s dtype and device
        (``ValueError`` naming ``basis`` otherwise)."""
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"conv must be an nn.Conv2d, got {type(conv).__name__}")
        w = conv.weight
        if basis is None:
            basis = FilterBasis(conv.kernel_size, device=w.device, dtype=w.dtype)
        layer = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                    conv.groups, conv.bias is not None, conv.padding_mode, basis=basis, device=w.device, dtype=w.dtype)
        phi = w.detach().double().reshape(w.shape[0] * w.shape[1], -1)  # rows: spatial coefficients
        psi = basis.matrix().detach().double()  # (kh*kw, N)
        if basis.init == "standard" and torch.equal(psi, torch.eye(psi.shape[0], dtype=psi.dtype, device=psi.device)):
            lam = phi
        elif psi.shape[0] == psi.shape[1]:
            lam = torch.linalg.solve(psi, phi.T).T  # eq. A.20
        else:
            lam = (torch.linalg.pinv(psi) @ phi.T).T  # App. E.1, pseudo inverse
        layer.coefficients.copy_(lam.reshape(layer.coefficients.shape))
        if conv.bias is not None:
            layer.bias.copy_(conv.bias)
        return layer

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
             f"padding={self.padding}, N={self.basis.size}")
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode!r}"
        return s


# -- model conversion (Sec. 4.3, App. H) ------------------------------------------------------------

SharingFn = Callable[[str, nn.Conv2d], Optional[Hashable]]


def to_interspace(model: nn.Module, sharing: Union[str, SharingFn] = "fine", init: str = "standard",
                  size: Optional[int] = None, generator: Optional[torch.Generator] = None) -> nn.Module:
    """Converts every ``nn.Conv2d`` with a kernel larger than 1×1 of ``model`` into an
    :class:`FBConv2d` in place, with the same function (App. E); 1×1 convolutions
    stay standard (Sec. 4.3, App. H).

    Only modules whose type is exactly ``nn.Conv2d`` are converted: a subclass
    (its own ``forward``, extra state) is left as it is. A convolution registered
    under several names (``self.b = self.a``) is replaced by one
    :class:`FBConv2d` under every name, so the tying is kept; its sharing key is
    computed from its first name in ``model.named_modules()``. Hooks on the old
    convolutions are not carried over. Every new layer and basis is built (and
    every argument checked) before the first one is swapped in: on an error
    ``model`` is unchanged.

    Returns ``model``; when ``model`` itself is an ``nn.Conv2d`` it converts, the
    new :class:`FBConv2d` (``model`` is left unchanged, as
    ``nn.SyncBatchNorm.convert_sync_batchnorm`` does), so use the return value:
    ``model = to_interspace(model)``. Convert before wrapping the model in
    ``DistributedDataParallel`` or ``fully_shard``: a wrapped model (or the
    module inside a live DDP) is a ``ValueError``.

    Args:
        sharing: ``"fine"`` one basis per layer; ``"coarse"`` one basis per kernel
            size for the whole model; or a callable ``(name, conv) -> key`` whose
            equal (hashable) keys share a basis ("medium" sharing, e.g. per ResNet
            stage) and ``None`` leaves that convolution standard. A basis is only
            shared by layers of one dtype and device: layers with another dtype or
            device get their own basis.
        init: basis initialisation (App. G): ``"standard"`` (Alg. A1),
            ``"orthonormal"`` (Alg. A2) or ``"random"`` (Alg. A3). The
            coefficients are the exact change of basis of the current weights.
        size: dictionary size ``N`` for ``init="random"`` (default ``kh*kw``;
            with ``N < kh*kw`` the conversion is a least-squares fit, not exact).
        generator: optional ``torch.Generator`` for the random inits.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(sharing, str):
        if sharing not in ("fine", "coarse"):
            raise ValueError(f"sharing must be 'fine', 'coarse' or a callable, got {sharing!r}")
    elif not callable(sharing):
        raise TypeError(f"sharing must be 'fine', 'coarse' or a callable, got {type(sharing).__name__}")
    if init not in _INITS:
        raise ValueError(f"init must be one of {_INITS}, got {init!r}")
    # new Parameters a DDP/FSDP wrapper would not know (and fully_shard's layers are no longer of type
    # nn.Conv2d): convert before wrapping
    check_not_wrapped(model, "to_interspace")
    # 1. build every basis and layer (named_modules lists a tied conv once)
    bases: Dict[Hashable, FilterBasis] = {}
    new: Dict[int, FBConv2d] = {}  # id(old conv) -> its replacement
    for name, conv in model.named_modules():
        if type(conv) is not nn.Conv2d or max(conv.kernel_size) <= 1:
            continue
        where = (conv.weight.device, conv.weight.dtype)  # a shared basis has the layers' dtype and device
        if sharing == "fine":
            key = ("fine", name)
        elif sharing == "coarse":
            key = ("coarse", tuple(conv.kernel_size), where)
        else:
            user_key = sharing(name, conv)
            if user_key is None:
                continue
            try:
                hash(user_key)
            except TypeError:
                raise TypeError(f"sharing must return a hashable key or None, got {type(user_key).__name__} "
                                f"for {name!r}") from None
            key = ("custom", user_key, tuple(conv.kernel_size), where)
        if key not in bases:
            bases[key] = FilterBasis(conv.kernel_size, size=size, init=init, generator=generator,
                                     device=conv.weight.device, dtype=conv.weight.dtype)
        layer = FBConv2d.from_conv2d(conv, bases[key])
        layer.train(conv.training)
        new[id(conv)] = layer
    # 2. swap them in, under every name
    return swap_modules(model, new)


def interspace_param_groups(model: nn.Module, weight_decay: float, **options) -> List[dict]:
    """Optimizer param groups with ``weight_decay`` on everything but the filter bases,
    which get none (App. B.3; Wimmer et al.). Shared bases appear once. ``options``
    (``lr``, ``momentum``, ...) go into both groups; they may not contain
    ``params`` or ``weight_decay``.

    >>> opt = torch.optim.SGD(interspace_param_groups(model, 5e-4), lr=0.1, momentum=0.9)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, numbers.Real):
        raise TypeError(f"weight_decay must be a real number, got {type(weight_decay).__name__}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    clash = sorted({"params", "weight_decay"} & set(options))
    if clash:
        raise ValueError(f"options may not set {clash}: interspace_param_groups sets them per group")
    basis_ids = {id(m.weight) for m in model.modules() if isinstance(m, FilterBasis)}
    decay, no_decay = [], []
    for p in model.parameters():  # deduplicated by torch
        (no_decay if id(p) in basis_ids else decay).append(p)
    groups = [dict(params=decay, weight_decay=weight_decay, **options)]
    if no_decay:
        groups.append(dict(params=no_decay, weight_decay=0.0, **options))
    return groups


# -- counts: eq. 9, App. C, App. D -----------------------------------------------------------------

def _prunable(model: nn.Module):
    """(name, effective prunable tensor, dense count) for every prunable tensor:
    masked FB coefficients, conv weights and linear weights (Sec. 4.4). The dense
    count is the weights of the layer in the standard network (Wimmer et al., the
    ``D`` of eq. 9): ``C_out C_in/groups kh kw`` for an FB layer, whatever its
    dictionary size ``N``."""
    for name, m in model.named_modules():
        if isinstance(m, FBConv2d):
            dense = m.out_channels * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
            yield name, (m.coefficients * m.mask).detach(), dense
        elif isinstance(m, (nn.Conv2d, nn.Linear)):
            w = m.weight.detach()
            mask = getattr(m, "weight_mask", None)  # torch.nn.utils.prune
            yield name, (w if mask is None else w * mask), w.numel()


def pruning_rates(model: nn.Module) -> Dict[str, float]:
    """Pruning rates of eq. 9.

    ``p_SP = 1 - ||Lambda||_0 / D`` and ``p_IP = 1 - (||Lambda||_0 + sum_j ||F_j||_0) / D``
    with ``Lambda`` the prunable weights (FB coefficients, conv and linear
    weights; not bases, biases or norms) and ``D`` their number in the standard
    network (``C_out C_in/groups kh kw`` for an FB layer, also when its
    dictionary has ``N != kh kw`` elements). Every distinct basis counts once.
    """
    check_module(model, "model")
    nonzero = total = 0
    for _, w, n in _prunable(model):
        nonzero += int((w != 0).sum())
        total += n
    basis_nnz = sum(int((m.weight != 0).sum()) for m in {id(b): b for b in model.modules() if isinstance(b, FilterBasis)}.values())
    if total == 0:
        return dict(p_SP=0.0, p_IP=0.0, D=0, nonzero=0, basis_nonzero=basis_nnz)
    return dict(p_SP=1.0 - nonzero / total, p_IP=1.0 - (nonzero + basis_nnz) / total, D=total, nonzero=nonzero,
                basis_nonzero=basis_nnz)


def interspace_flops(model: nn.Module, example_input: Tensor) -> Dict[str, float]:
    """Forward FLOPs of App. D for one call of ``model(example_input)``.

    FB layer (eq. A.8 with groups and a dictionary of N elements):
    ``2 nnz(lam*mu) d1 d2 + 2 C_in kh kw N d1 d2``; standard conv (eq. A.7):
    ``2 nnz(w) d1 d2``; linear ``2 nnz(W)`` per row of the input. ``dense`` is
    the standard dense network (``2 C_out C_in/groups kh kw d1 d2``).

    Inference FLOPs, without side effects: the call runs under
    ``torch.no_grad()`` with every submodule's ``training`` flag set to False
    (BatchNorm running statistics are not updated, dropout draws nothing), and
    each flag is restored afterwards as it was (set directly, without calling
    ``train()``), also on an error.
    """
    check_module(model, "model")
    if not isinstance(example_input, Tensor):
        raise TypeError(f"example_input must be a Tensor, got {type(example_input).__name__}")
    out = dict(dense=0.0, sparse=0.0, basis_overhead=0.0)
    hooks = []

    def conv_hook(m, inp, y):
        d = y.shape[-1] * y.shape[-2] * (y.shape[0] if y.dim() == 4 else 1)
        kk = m.kernel_size[0] * m.kernel_size[1]
        out["dense"] += 2.0 * m.out_channels * (m.in_channels // m.groups) * kk * d
        if isinstance(m, FBConv2d):
            nnz = int(((m.coefficients * m.mask) != 0).sum())
            over = 2.0 * m.in_channels * kk * m.basis.size * d  # Alg. 1, l. 7-8
            out["sparse"] += 2.0 * nnz * d + over
            out["basis_overhead"] += over
        else:
            out["sparse"] += 2.0 * int((m.weight != 0).sum()) * d

    def linear_hook(m, inp, y):
        rows = y.numel() // m.out_features
        out["dense"] += 2.0 * m.weight.numel() * rows
        out["sparse"] += 2.0 * int((m.weight != 0).sum()) * rows

    modes = [(m, m.training) for m in model.modules()]
    try:
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, FBConv2d)):
                hooks.append(m.register_forward_hook(conv_hook))
            elif isinstance(m, nn.Linear):
                hooks.append(m.register_forward_hook(linear_hook))
        for m, _ in modes:
            m.training = False
        with torch.no_grad():
            model(example_input)
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes:
            m.training = training
            if training and isinstance(m, FBConv2d):
                m._drop_inference_caches()  # built by this call only
    out["ratio"] = out["sparse"] / out["dense"] if out["dense"] else float("nan")
    return out


def sparse_storage(numel: int, nonzero: int, value_bits: int = 32, index_bits: int = 32, rows: int = 1) -> Dict[str, float]:
    """Bytes to store ``numel`` weights with ``nonzero`` non-zeros (App. C):

    * ``dense``: ``numel * value_bits / 8``;
    * ``csr``: values + column indices + ``rows + 1`` row pointers;
    * ``entropy``: the ideal mask code of eq. A.2,
      ``numel (H(p) + (1-p) value_bits) / 8`` with ``H(p) = -p log2 p - (1-p) log2(1-p)``,
      i.e. ``H(p)/32 + (1-p)`` of the dense size for 32-bit values.
    """
    numel = check_int(numel, "numel", None, SIZE_MAX)
    nonzero = check_int(nonzero, "nonzero", 0, SIZE_MAX)
    value_bits = check_int(value_bits, "value_bits", 1, 1 << 16)
    index_bits = check_int(index_bits, "index_bits", 1, 1 << 16)
    rows = check_int(rows, "rows", 0, SIZE_MAX)
    if numel > 0 and nonzero > numel:
        raise ValueError(f"nonzero must be at most numel = {numel}, got {nonzero}")
    if numel <= 0:
        return dict(dense=0.0, csr=0.0, entropy=0.0)
    p = 1.0 - nonzero / numel
    h = 0.0 if p in (0.0, 1.0) else -p * math.log2(p) - (1 - p) * math.log2(1 - p)  # eq. A.2
    return dict(
        dense=numel * value_bits / 8,
        csr=(nonzero * (value_bits + index_bits) + (rows + 1) * index_bits) / 8,
        entropy=numel * (h + (1 - p) * value_bits) / 8,
    )


def interspace_report(model: nn.Module, example_input: Optional[Tensor] = None) -> Dict[str, object]:
    """Pruning rates (eq. 9), storage (App. C; bases stored densely on top) and,
    with ``example_input``, forward FLOPs (App. D, :func:`interspace_flops`:
    run in eval mode without side effects) of ``model``.

    ``storage_bytes``: ``dense`` the standard network's ``D`` weights in 32 bits
    (``C_out C_in/groups kh kw`` per FB layer); ``csr`` and ``entropy`` the
    stored pruned tensors (an FB layer's ``C_out C_in/groups N`` masked
    coefficients); ``bases`` every distinct basis once, dense."""
    check_module(model, "model")
    if example_input is not None and not isinstance(example_input, Tensor):
        raise TypeError(f"example_input must be a Tensor or None, got {type(example_input).__name__}")
    rates = pruning_rates(model)
    storage = dict(dense=0.0, csr=0.0, entropy=0.0)
    for _, w, n in _prunable(model):
        s = sparse_storage(w.numel(), int((w != 0).sum()), rows=w.shape[0])
        storage["dense"] += sparse_storage(n, n)["dense"]
        storage["csr"] += s["csr"]
        storage["entropy"] += s["entropy"]
    basis_bytes = 4.0 * sum(b.weight.numel() for b in {id(b): b for b in model.modules() if isinstance(b, FilterBasis)}.values())
    storage["bases"] = basis_bytes
    report: Dict[str, object] = dict(rates)
    report["storage_bytes"] = storage
    if example_input is not None:
        report["flops"] = interspace_flops(model, example_input)
    return report
