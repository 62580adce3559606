"""Filter-basis convolution ops of interspace pruning (Wimmer et al., paper eq. 4-8,
Alg. 1). Re-exported by :mod:`prunopt.ops`; see ``docs/interspace.md``.

Three custom ops (schemas in ``csrc/ops.cpp``):

* ``prunopt::fb_reconstruct(coefficients, basis, mask)``: the fused
  reconstruction ``h = (lam * mu) @ basis`` (eq. 4), the training path's only
  extra work before ``conv2d``.
* ``prunopt::fb_reconstruct_backward(grad_h, coefficients, basis, mask,
  output_mask)``: its gradients (eq. 7, A.13, A.14) in one fused pass.
* ``prunopt::fb_conv2d(input, coefficients, basis, mask, bias, stride, padding,
  dilation, groups, max_density)``: eq. 6/8. If the mask density is at most
  ``max_density`` the kernel computes eq. 8 over the non-zero coefficients
  (im2col, a K²×N transform per input channel, a CSR × dense product);
  otherwise it reconstructs and calls ``conv2d``.
* ``prunopt::fb_conv2d_csr(input, crow, col, values, basis, bias, ...)``: the
  sparse path on coefficients already compressed by :func:`fb_compress` (what
  ``FBConv2d`` caches in inference), so the CSR is not rebuilt per call.

All of them have autograd (eq. 7, A.12-A.14), fake kernels and a pure-PyTorch
fallback (``prunopt.reference.interspace``) when the extension is missing. Under
a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...) or a forward-mode
AD level (``torch.autograd.forward_ad.dual_level``) the wrappers below compute
with that pure-PyTorch reference, which every transform supports (the autograd of
``prunopt::fb_reconstruct`` is a C++ ``torch::autograd::Function``, which
functorch rejects, and the sparse ops have no forward-mode formulas).
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad as _fwad

from prunopt._extension import extension_available
from prunopt.ops import _fake_checks as _fc
from prunopt.ops._registry import _kernel_devices
from prunopt.validation import validate_fb_args
from prunopt.reference.interspace import (
    fb_coefficient_grads_reference,
    fb_conv2d_sparse_reference,
    fb_reconstruct_reference,
)

__all__ = ["fb_reconstruct", "fb_reconstruct_backward", "fb_conv2d", "fb_compress", "fb_conv2d_compressed", "FBCompressed", "sparse_is_faster",
           "auto_max_density", "cost_constants"]

# -- the cost model of path="auto" (docs/interspace.md, "Choosing the path") --------------------
# Time of one call in units of one multiply-add of the dense conv2d (oneDNN) at
# large images, least-squares fitted to single-thread timings of both paths on
# the VGG16-CIFAR layers (3x3, orthonormal basis, batch 1; tools/fit_fb_cost_model.py):
#   dense  = W (P + dense_small_image / P_image) + dense_fixed         W = C_out C_in/g K
#   sparse = per_mac nnz P + per_nnz nnz + maps_per_mac C_in N K P + fixed
# with P the output positions (batch x Ho x Wo) and P_image = Ho x Wo. The
# dense small-image term is conv2d's poor efficiency on 4x4 and 2x2 images
# (on the AVX2 host); the sparse per-nnz term the CSR walk, the fixed term
# allocation and dispatch. The constants depend on the machine, above all on
# how fast oneDNN's conv2d is there, so there is one set per CPU capability
# (torch.backends.cpu.get_cpu_capability()):
#   "default" (AVX2; AMD EPYC, densities 0.03-0.7: the faster path in 41 of 45
#   cases, the other 4 within 8%). Its fixed term was fitted as 2.1e6 and
#   lowered to 1.5e6 after the per-call cost fell by about 20-30 us (FBConv2d's
#   eval call below autograd, no used-map scan when every map is used): the
#   3->64 layer at density 0.01 then takes the sparse path, 54 us against
#   conv2d's 63 us at 2 threads.
#   "AVX512" (Intel Xeon with AVX-512): oneDNN's conv2d is about twice
#   as fast per multiply-add there and keeps its speed on small images, so the
#   AVX2 set chose the sparse path for the 2x2 layers at density 0.5 (0.99 ms
#   against conv2d's 0.37 ms).
#
# Without a cached CSR (the functional op; FBConv2d's eval path caches it) both
# paths also pay for work on every coefficient, W N / K = C_out C_in/g N
# entries: the dense path reconstructs the filters (eq. 4, a pass that reads
# lam and mu and writes h: "reconstruct" per coefficient), the sparse path
# counts the non-zeros of lam * mu ("csr_count" per coefficient, paid by every
# call of the kernel, which counts before it chooses) and writes their CSR
# ("csr_build" per coefficient and "csr_per_nnz" per stored entry). These are
# memory passes, not multiply-adds: on a batch-1 layer with small images they
# dominate (512->512 at 4x4: counting and building the CSR took two to three
# times the whole dense path), so they are set on the safe side of what was
# measured on a shared Xeon host (the count and build of a 2.4M-coefficient
# layer ~1.4 + 7.5 d reconstructions, d the density; taken as 3.5 + 20 d). The
# AVX2 set takes the same passes at half the units (its conv2d does half the
# multiply-adds per second); not fitted on an AVX2 host.
COST_CONSTANTS = {
    "default": dict(per_mac=2.2, per_nnz=29.0, maps_per_mac=0.36, fixed=1.5e6, dense_small_image=160.0,
                    dense_fixed=0.0, reconstruct=12.0, csr_count=6.0, csr_build=37.0, csr_per_nnz=250.0),
    # tools/fit_fb_cost_model.py on the Xeon host (refitted after the used-map and
    # mix changes; 14 layer shapes, densities 0.01-0.7): the faster path in 76 of 84 cases (misses
    # up to 1.22x, near density 0.3 and on the 3->64 layer); the previous fit picked it in 68 of 84
    # after those changes (misses up to 3.4x: the sparse path had become faster than it predicts)
    "AVX512": dict(per_mac=2.12, per_nnz=38.4, maps_per_mac=1.48, fixed=1.44e6, dense_small_image=60.0,
                   dense_fixed=7.17e5, reconstruct=25.0, csr_count=12.0, csr_build=75.0, csr_per_nnz=500.0),
}
# a kernel call counts before it chooses: when that count would cost more than this share of the
# dense path, path="auto" first estimates the density from a sample of the mask
_COUNT_SHARE = 0.02
_SAMPLE = 1024


def cost_constants(capability: Optional[str] = None) -> dict:
    """The constants of the path cost model for ``capability`` (default: this
    CPU's, ``torch.backends.cpu.get_cpu_capability()``): the ``AVX512`` set
    there, the ``default`` (AVX2) set everywhere else. In units of one dense
    multiply-add, with ``W = C_out C_in/g K``, ``P`` output positions,
    ``P_img = Ho Wo`` and ``E = C_out C_in/g N`` coefficients, the dense path
    (conv2d, eq. 6, with the filters of eq. 4) costs
    ``W (P + dense_small_image / P_img) + dense_fixed`` and the sparse path
    (eq. 8 / Alg. 1: basis maps, then the CSR mix) costs
    ``per_mac nnz P + per_nnz nnz + maps_per_mac C_in N K P + fixed``
    (App. D counts the same multiply-adds). When nothing is cached the dense
    path adds ``reconstruct E`` (eq. 4) and the sparse path
    ``(csr_count + csr_build) E + csr_per_nnz nnz`` (the CSR of ``lam * mu``).
    The returned dict is the module's own: copy it before changing it."""
    if capability is None:
        capability = _cpu_capability()
    return COST_CONSTANTS.get(capability, COST_CONSTANTS["default"])


@functools.lru_cache(maxsize=1)
def _cpu_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - older torch
        return "default"


def _costs(c_out: int, c_in: int, c_in_g: int, n: int, k: int, positions: int, image_positions: int,
           consts: Optional[dict] = None, csr_cached: bool = True):
    """``(dense, per_nnz, fixed)``: the dense path's cost and the sparse path's
    ``nnz * per_nnz + fixed``; without a cache both include their passes over
    the coefficients (the reconstruction; the CSR count and build)."""
    c = consts if consts is not None else cost_constants()
    dense = c_out * c_in_g * k * (positions + c["dense_small_image"] / max(1, image_positions)) + c["dense_fixed"]
    per_nnz = c["per_mac"] * positions + c["per_nnz"]
    fixed = c["maps_per_mac"] * c_in * n * k * positions + c["fixed"]
    if not csr_cached:
        coefficients = c_out * c_in_g * n
        dense += c.get("reconstruct", 0.0) * coefficients
        per_nnz += c.get("csr_per_nnz", 0.0)
        fixed += (c.get("csr_count", 0.0) + c.get("csr_build", 0.0)) * coefficients
    return dense, per_nnz, fixed


def sparse_is_faster(nnz: int, c_out: int, c_in: int, c_in_g: int, n: int, k: int, positions: int,
                     image_positions: Optional[int] = None, *, constants: Optional[dict] = None,
                     csr_cached: bool = True) -> bool:
    """The cost model of ``path="auto"``: True when eq. 8 over ``nnz`` stored
    coefficients is predicted to beat ``conv2d`` with the filters of eq. 4 for
    ``positions`` output positions (batch x Ho x Wo; ``image_positions`` = Ho x
    Wo, default ``positions``). ``csr_cached=True`` (the default) compares the
    two paths on cached data (the CSR of ``lam * mu`` and the reconstructed
    filters, as ``FBConv2d`` in ``eval()`` holds them); ``csr_cached=False``
    adds what a call without a cache pays: the CSR's count and build on the
    sparse side, the reconstruction on the dense side (what
    :func:`fb_conv2d` faces). ``constants``: a set like
    :func:`cost_constants`'s (default: this CPU's)."""
    dense, per_nnz, fixed = _costs(c_out, c_in, c_in_g, n, k, positions, image_positions or positions, constants,
                                   csr_cached)
    return nnz * per_nnz + fixed < dense


def auto_max_density(c_out: int, c_in: int, c_in_g: int, n: int, k: int, positions: int,
                     image_positions: Optional[int] = None, *, constants: Optional[dict] = None,
                     csr_cached: bool = True) -> float:
    """The largest density ``nnz / (C_out C_in/g N)`` for which
    :func:`sparse_is_faster` (with the same ``csr_cached``) holds; negative
    when the sparse path never wins. :func:`fb_conv2d` with ``path="auto"``
    passes it, with ``csr_cached=False``, to the kernel as ``max_density``."""
    total = c_out * c_in_g * n
    if total == 0:
        return 1.0
    dense, per_nnz, fixed = _costs(c_out, c_in, c_in_g, n, k, positions, image_positions or positions, constants,
                                   csr_cached)
    return (dense - fixed) / per_nnz / total


def _count_is_costly(c_out: int, c_in_g: int, n: int, dense: float, constants: Optional[dict] = None) -> bool:
    """Whether the kernel's count of the non-zeros (paid before it chooses a
    path) would cost more than ``_COUNT_SHARE`` of the dense path."""
    c = constants if constants is not None else cost_constants()
    return c.get("csr_count", 0.0) * c_out * c_in_g * n > _COUNT_SHARE * dense


_SAMPLE_INDEX: "dict" = {}
# sampled densities of tensor objects seen before: id -> (weak reference,
# state when sampled, density); see _sampled_density
_DENSITY: "dict" = {}


def _tensor_state(t: Tensor):
    """``(version, data_ptr, shape, strides, dtype)`` of ``t``: what changes when
    its contents may have (an in-place write bumps the version; ``.data =``
    moves the pointer), or ``None`` where that is not available (fake, meta
    or inference tensors, tracing by ``torch.compile``)."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return None
    try:
        return (t._version, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
    except (RuntimeError, NotImplementedError):  # inference or fake tensors: no version counter / no data
        return None


def _sampled_density(coefficients: Tensor, mask: Optional[Tensor]) -> float:
    """The density of the mask (of the coefficients without one) estimated from
    ``_SAMPLE`` fixed pseudo-random entries (standard error below 0.016):
    enough to tell a density far above the sparse path's threshold from one
    near it, at the cost of a small gather (the mask's density bounds that of
    ``lam * mu`` from above).

    Remembered per tensor object (held by a weak reference, so a new tensor,
    even in the memory of a freed one, is sampled afresh) until it is written
    in place: a layer called again with the same mask, as in inference, skips
    the gather (20-80 us on a 2-vCPU host, against kernels of 0.2-1 ms)."""
    t = coefficients if mask is None else mask
    state = _tensor_state(t)
    if state is not None:
        hit = _DENSITY.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == state:
            return hit[2]
    d = _sample_density(t)
    if state is not None:
        if len(_DENSITY) >= 256:
            _DENSITY.clear()
        _DENSITY[id(t)] = (weakref.ref(t), state, d)
    return d


def _sample_density(t: Tensor) -> float:
    numel = t.numel()
    if numel <= _SAMPLE:
        return int(torch.count_nonzero(t)) / max(1, numel)
    key = (numel, t.device)
    idx = _SAMPLE_INDEX.get(key)
    if idx is None:
        g = torch.Generator().manual_seed(numel)
        idx = torch.randint(0, numel, (_SAMPLE,), generator=g).to(t.device)
        if len(_SAMPLE_INDEX) > 64:
            _SAMPLE_INDEX.clear()
        _SAMPLE_INDEX[key] = idx
    return int(torch.count_nonzero(torch.take(t, idx))) / _SAMPLE


# meta tensors take the reference path here (it computes their shapes)
_RECON_DEVICES = _kernel_devices("fb_reconstruct", meta=False)
_RECON_BWD_DEVICES = _kernel_devices("fb_reconstruct_backward", meta=False)
_CONV_DEVICES = _kernel_devices("fb_conv2d", meta=False)
_CSR_DEVICES = _kernel_devices("fb_conv2d_csr", meta=False)


def has_csr_kernel(input: Tensor) -> bool:
    """Whether ``prunopt::fb_conv2d_csr`` has a kernel for ``input``'s device."""
    return input.device.type in _CSR_DEVICES


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
if _functorch_active is None:  # pragma: no cover - older torch
    def _functorch_active() -> bool:
        return torch._C._functorch.peek_interpreter_stack() is not None


def _transforms_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...) or a
    forward-mode AD level is active: the FB ops then compute with the pure-PyTorch
    reference (the C++ autograd of ``fb_reconstruct`` does not support functorch,
    the sparse ops have no forward-mode formulas). ~50 ns."""
    return _functorch_active() or _fwad._current_level >= 0


_NO_AUTOCAST = set()  # device types torch.is_autocast_enabled rejects (e.g. "meta")


def _autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for device types that
    have no autocast (``"meta"``), where torch raises."""
    if device_type in _NO_AUTOCAST:
        return False
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # "unknown device type for autocast"
        _NO_AUTOCAST.add(device_type)
        return False


def _mask_like(mask: Optional[Tensor], coefficients: Tensor) -> Optional[Tensor]:
    if mask is None or mask.dtype == coefficients.dtype:
        return mask
    return mask.to(coefficients.dtype)


def fb_reconstruct(coefficients: Tensor, basis: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    r"""Masked spatial filters of a filter-basis convolution (eq. 4, A.16).

    .. math:: h^{(o,i)} = \sum_{n=1}^{N} \lambda_n^{(o,i)} \mu_n^{(o,i)} g^{(n)}

    Args:
        coefficients: ``lam`` of shape ``(C_out, C_in/groups, N)``.
        basis: ``(N, kh, kw)``, the filter basis/dictionary ``g^(1..N)``.
        mask: optional ``mu`` with the shape of ``coefficients`` (0/1, any dtype).

    Returns:
        ``h`` of shape ``(C_out, C_in/groups, kh, kw)``. Differentiable in
        ``coefficients`` (gradient masked, eq. 7/A.13) and ``basis`` (eq. A.14).
    """
    validate_fb_args(None, coefficients, basis, mask)
    mask = _mask_like(mask, coefficients)
    if coefficients.device.type in _RECON_DEVICES and not _transforms_active():
        return torch.ops.prunopt.fb_reconstruct(coefficients, basis, mask)
    return fb_reconstruct_reference(coefficients, basis, mask)


def fb_reconstruct_backward(grad_h: Tensor, coefficients: Tensor, basis: Tensor, mask: Optional[Tensor] = None,
                            output_mask=(True, True)):
    r"""Gradients of :func:`fb_reconstruct` from ``dL/dh`` (eq. 7, A.13, A.14), fused.

    .. math::
        \frac{\partial L}{\partial \lambda_n^{(o,i)}} = \mu_n^{(o,i)} \langle g^{(n)},
            \tfrac{\partial L}{\partial h^{(o,i)}} \rangle, \qquad
        \frac{\partial L}{\partial g^{(n)}} = \sum_{o,i} \lambda_n^{(o,i)} \mu_n^{(o,i)}
            \tfrac{\partial L}{\partial h^{(o,i)}}

    One pass over ``dL/dh``, ``lam`` and ``mu``; the basis gradient is summed in
    short float blocks added in double.

    Args:
        grad_h: ``(C_out, C_in/groups, kh, kw)``, the gradient of the filters.
        coefficients, basis, mask: as :func:`fb_reconstruct`.
        output_mask: which of ``(dL/dlam, dL/dbasis)`` to compute; the others are ``None``.

    Returns:
        ``(dL/dlam, dL/dbasis)`` of the shapes of ``coefficients`` and ``basis``.
    """
    validate_fb_args(None, coefficients, basis, mask)
    if not isinstance(grad_h, Tensor):
        raise TypeError(f"grad_h must be a Tensor, got {type(grad_h).__name__}")
    filters = (coefficients.shape[0], coefficients.shape[1], basis.shape[1], basis.shape[2])
    if tuple(grad_h.shape) != filters:
        raise ValueError(f"grad_h must have the shape of the filters {filters}, got {tuple(grad_h.shape)}")
    if grad_h.dtype != coefficients.dtype or grad_h.device != coefficients.device:
        raise ValueError(f"grad_h must have the dtype and device of coefficients ({coefficients.dtype}, "
                         f"{coefficients.device}), got {grad_h.dtype}, {grad_h.device}")
    if not isinstance(output_mask, (tuple, list)) or len(output_mask) != 2 or \
            not all(isinstance(b, bool) for b in output_mask):
        raise TypeError(f"output_mask must be two bools, got {output_mask!r}")
    return _reconstruct_grads(grad_h, coefficients, basis, _mask_like(mask, coefficients), *output_mask)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def fb_conv2d(
    input: Tensor,
    coefficients: Tensor,
    basis: Tensor,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
    *,
    path: str = "auto",
) -> Tensor:
    r"""Filter-basis 2D convolution (eq. 6, 8; Alg. 1).

    .. math::
        Y^{(o)} = \sum_{i} \sum_{n:\, \mu_n^{(o,i)} = 1} \lambda_n^{(o,i)}
                  \bigl(g^{(n)} \star X^{(i)}\bigr) + b_o

    with stride, padding (zeros), dilation and groups as in ``F.conv2d``.

    Args:
        input: ``(B, C_in, H, W)`` or ``(C_in, H, W)``; any memory format.
        coefficients: ``(C_out, C_in/groups, N)``.
        basis: ``(N, kh, kw)``; ``N`` need not be ``kh*kw`` (a dictionary).
        mask: optional, shape of ``coefficients``; ``None`` means dense.
        bias: optional ``(C_out,)``.
        path: ``"dense"`` reconstructs the filters with the fused kernel and
            calls ``conv2d`` (the training path); ``"sparse"`` computes eq. 8
            over the non-zero coefficients only (im2col, a K²×N transform per
            input channel, a CSR × dense product); ``"auto"`` (default) takes
            the dense path when a gradient is needed and otherwise the path
            the cost model :func:`sparse_is_faster` predicts to be faster
            *for this call*, which has no cached CSR: the sparse path must
            count the non-zeros and build their CSR first
            (``csr_cached=False``), which on small images costs more than the
            whole dense path, so there it is never taken. Where it may win,
            the kernel counts and takes it when the density is at most
            :func:`auto_max_density`; where that count alone is not
            negligible, a sample of the mask (of the coefficients without
            one) first rules out densities far above the threshold. All paths agree to rounding
            and are differentiable (eq. 7, A.12-A.14).

    **Reusing the CSR.** A module that calls the op repeatedly with the same
    masked coefficients (inference) should build the CSR once and keep it, as
    ``FBConv2d`` does in ``eval()``::

        comp = fb_compress(coefficients, mask)           # once, after the last change of lam or mu
        y = fb_conv2d_compressed(x, comp, basis, bias, stride, padding, dilation, groups)

    and choose between that and ``conv2d`` with cached filters with
    ``sparse_is_faster(comp.values.numel(), ...)`` (``csr_cached=True``).

    Under ``torch.autocast`` the input may have the autocast dtype: ``"auto"``
    then takes the dense path, whose ``conv2d`` runs in the autocast dtype as
    ``F.conv2d`` does (the filters are reconstructed in the coefficients'
    dtype); ``"sparse"`` casts the input to the coefficients' dtype.

    Under a ``torch.func`` transform or a forward-mode AD level every path is
    computed by the pure-PyTorch reference (``"sparse"``: eq. 8 as einsums).
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a Tensor, got {type(input).__name__}")
    autocast = _autocast_enabled(input.device.type)
    stride, padding, dilation, groups = validate_fb_args(input, coefficients, basis, mask, bias, stride, padding, dilation,
                                                         groups, check_input_dtype=not autocast)
    if path not in ("auto", "dense", "sparse"):
        raise ValueError(f"path must be 'auto', 'dense' or 'sparse', got {path!r}")
    mask = _mask_like(mask, coefficients)
    if _transforms_active():
        if path == "sparse":
            x = input.to(coefficients.dtype) if autocast else input
            return fb_conv2d_sparse_reference(x, coefficients, basis, mask, bias, stride, padding, dilation, groups)
        h = fb_reconstruct_reference(coefficients, basis, mask)
        return F.conv2d(input, h, bias, stride, padding, dilation, groups)
    if path == "dense" or (path == "auto" and (autocast or _needs_grad(input, coefficients, basis, bias))):
        return F.conv2d(input, fb_reconstruct(coefficients, basis, mask), bias, stride, padding, dilation, groups)
    if autocast:  # "sparse" asked for under autocast: computed in the coefficients' dtype
        input = input.to(coefficients.dtype)
    if path == "sparse":
        max_density = 1.0
    else:
        max_density = _uncached_max_density(input, coefficients, basis, mask, stride, padding, dilation, groups)
        if max_density is None:  # the dense path: no count, no CSR
            return F.conv2d(input, fb_reconstruct(coefficients, basis, mask), bias, stride, padding, dilation, groups)
    if input.device.type in _CONV_DEVICES:
        batched = input.dim() == 4
        x = input if batched else input.unsqueeze(0)
        y = torch.ops.prunopt.fb_conv2d(x, coefficients, basis, mask, bias, stride, padding, dilation, groups, max_density)
        return y if batched else y.squeeze(0)
    return fb_conv2d_sparse_reference(input, coefficients, basis, mask, bias, stride, padding, dilation, groups)


def _uncached_max_density(input, coefficients, basis, mask, stride, padding, dilation, groups) -> Optional[float]:
    """``max_density`` for the kernel under ``path="auto"`` (no cached CSR), or
    ``None`` when the dense path is predicted faster whatever the kernel's
    count would find, or (when that count is not negligible) at the density a
    sample of the mask shows; ``1.0`` (no count in the kernel) when the sample
    shows a density clearly below the threshold."""
    kh, kw = basis.shape[1], basis.shape[2]
    ho = (input.shape[-2] + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (input.shape[-1] + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    batch = input.shape[0] if input.dim() == 4 else 1
    c_out, c_in_g, n = coefficients.shape
    max_density, costly = _auto_plan((c_out, c_in_g * groups, c_in_g, n, kh * kw, batch * ho * wo, ho * wo),
                                     _cpu_capability())
    if max_density < 0:
        return None
    if costly and coefficients.device.type != "meta":
        d = _sampled_density(coefficients, mask)
        if d > max_density:
            return None
        # clearly below the threshold (by four standard errors of the sample): the
        # kernel's own exact count, paid before it builds the CSR, would only confirm it
        if d + 4.0 * math.sqrt(d * (1.0 - d) / _SAMPLE) <= max_density:
            return 1.0
    return max_density


@functools.lru_cache(maxsize=1024)
def _auto_plan(dims: tuple, capability: str):
    """``(max_density, count_is_costly)`` of a layer and input shape without a
    cached CSR (cached per shape: the cost model is pure arithmetic, but a
    call of the op on a small layer takes only tens of microseconds)."""
    consts = cost_constants(capability)
    max_density = auto_max_density(*dims, constants=consts, csr_cached=False)
    dense = _costs(*dims, consts, csr_cached=False)[0]
    return max_density, max_density < 1 and _count_is_costly(dims[0], dims[2], dims[3], dense, consts)


class FBCompressed(NamedTuple):
    """Masked coefficients in CSR form (App. C): row ``o`` holds the non-zero
    ``lam[o,i,n] * mu[o,i,n]`` at columns ``i*N + n`` (int32 indices)."""

    crow_indices: Tensor
    col_indices: Tensor
    values: Tensor
    shape: tuple  # (C_out, C_in/groups, N)


def fb_compress(coefficients: Tensor, mask: Optional[Tensor] = None) -> FBCompressed:
    """CSR of the masked coefficients ``lam * mu`` (zeros dropped), for
    :func:`fb_conv2d_compressed`. Not differentiable (an inference cache).
    Needs the values: not available for tensors on the ``meta`` device.

    Building it is a pass over every coefficient (the part of the sparse path
    that does not depend on the input): call it once and keep the result for
    as long as ``lam`` and ``mu`` do not change, as ``FBConv2d`` does in
    ``eval()``; :func:`fb_conv2d` without a cache builds it on every call."""
    if not isinstance(coefficients, Tensor):
        raise TypeError(f"coefficients must be a Tensor, got {type(coefficients).__name__}")
    if coefficients.dim() != 3:
        raise ValueError(f"coefficients must have shape (C_out, C_in/groups, N), got {tuple(coefficients.shape)}")
    validate_fb_args(None, coefficients, coefficients.new_empty(coefficients.shape[2], 1, 1), mask)
    if coefficients.device.type == "meta":
        raise ValueError("coefficients are on the meta device, which holds no values to compress")
    with torch.no_grad():
        lam = coefficients if mask is None else coefficients * _mask_like(mask, coefficients)
        rows = lam.reshape(lam.shape[0], -1)
        nz = rows != 0
        counts = nz.sum(dim=1)
        crow = torch.zeros(rows.shape[0] + 1, dtype=torch.int64, device=rows.device)
        crow[1:] = torch.cumsum(counts, 0)
        idx = nz.nonzero()
        col = idx[:, 1].to(torch.int32)
        values = rows[idx[:, 0], idx[:, 1]].contiguous()
    return FBCompressed(crow.to(torch.int32), col, values, tuple(coefficients.shape))


def fb_conv2d_compressed(
    input: Tensor,
    compressed: FBCompressed,
    basis: Tensor,
    bias: Optional[Tensor] = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
) -> Tensor:
    """Eq. 8 with coefficients already compressed by :func:`fb_compress` (the
    inference cache of ``FBConv2d``). Same result as :func:`fb_conv2d`.

    The way to run the sparse path in one's own module without rebuilding the
    CSR on every call::

        class MyFBConv(nn.Module):
            def forward(self, x):
                if self.training or torch.is_grad_enabled():
                    return fb_conv2d(x, self.lam, self.basis, self.mu, padding=1)
                if self._csr is None:                         # drop it whenever lam or mu change
                    self._csr = fb_compress(self.lam.detach(), self.mu)
                return fb_conv2d_compressed(x, self._csr, self.basis, padding=1)

    Differentiable in ``input``, the stored values and ``basis`` (the CSR's
    structure is fixed)."""
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a Tensor, got {type(input).__name__}")
    if not isinstance(compressed, FBCompressed):
        raise TypeError(f"compressed must be an FBCompressed (from fb_compress), got {type(compressed).__name__}")
    c_out, c_in_g, n = compressed.shape
    if not isinstance(basis, Tensor) or basis.dim() != 3 or basis.shape[0] != n:
        raise ValueError(f"basis must have shape ({n}, kh, kw) to match the compressed coefficients {compressed.shape}")
    if compressed.values.dtype != basis.dtype or compressed.values.device != basis.device:
        raise ValueError(
            f"compressed values must have the dtype and device of basis ({basis.dtype}, {basis.device}), "
            f"got {compressed.values.dtype}, {compressed.values.device}"
        )
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a Tensor or None, got {type(bias).__name__}")
    if isinstance(bias, Tensor) and (bias.dtype != basis.dtype or bias.device != basis.device):
        raise ValueError(f"bias must have the dtype and device of basis ({basis.dtype}, {basis.device}), "
                         f"got {bias.dtype}, {bias.device}")
    # shapes, conv arguments and input are checked against a meta stand-in of the coefficients
    meta = torch.empty(compressed.shape, dtype=basis.dtype, device="meta")
    validate_fb_args(None, meta, basis.to("meta"), None, None if bias is None else bias.to("meta"))
    stride, padding, dilation, groups = validate_fb_args(
        input.to("meta"), meta, basis.to("meta"), None, None, stride, padding, dilation, groups,
    )
    if input.device != basis.device:
        raise ValueError(f"input must be on the device of basis ({basis.device}), got {input.device}")
    if input.device.type in _CSR_DEVICES and not _transforms_active():
        batched = input.dim() == 4
        x = input if batched else input.unsqueeze(0)
        y = torch.ops.prunopt.fb_conv2d_csr(
            x, compressed.crow_indices, compressed.col_indices, compressed.values, basis, bias,
            stride, padding, dilation, groups,
        )
        return y if batched else y.squeeze(0)
    coeff = _decompress(compressed)
    return fb_conv2d_sparse_reference(input, coeff, basis, None, bias, stride, padding, dilation, groups)


def _decompress(compressed: FBCompressed) -> Tensor:
    c_out, c_in_g, n = compressed.shape
    crow = compressed.crow_indices.long()
    rows = torch.repeat_interleave(torch.arange(c_out, device=crow.device), crow[1:] - crow[:-1])
    dense = compressed.values.new_zeros(c_out, c_in_g * n)
    dense.index_put_((rows, compressed.col_indices.long()), compressed.values)
    return dense.reshape(c_out, c_in_g, n)


def fb_conv_out_shape(input: Tensor, c_out, basis: Tensor, stride, padding, dilation):
    """``(B, C_out, Ho, Wo)`` of a 4-D input, as ``conv2d``."""
    ho = (input.shape[2] + 2 * padding[0] - dilation[0] * (basis.shape[1] - 1) - 1) // stride[0] + 1
    wo = (input.shape[3] + 2 * padding[1] - dilation[1] * (basis.shape[2] - 1) - 1) // stride[1] + 1
    return (input.shape[0], c_out, ho, wo)


# -- autograd (eq. 7, A.12-A.14) ---------------------------------------------------------------

def _reconstruct_grads(grad_h: Tensor, coefficients: Tensor, basis: Tensor, mask: Optional[Tensor], need_lam: bool,
                       need_basis: bool):
    """``dL/dlam = <g^(n), dL/dh> * mu`` (eq. 7, A.13) and ``dL/dg^(n) = sum lam mu dL/dh`` (A.14).

    One fused pass over ``dL/dh``, ``lam`` and ``mu`` (``prunopt::fb_reconstruct_backward``);
    the outputs not needed are ``None`` and not computed.
    """
    if not (need_lam or need_basis):
        return None, None
    if grad_h.device.type in _RECON_BWD_DEVICES and not _transforms_active():
        g_lam, g_basis = torch.ops.prunopt.fb_reconstruct_backward(grad_h, coefficients, basis, mask,
                                                                   [need_lam, need_basis])
        return (g_lam if need_lam else None), (g_basis if need_basis else None)
    g_lam, g_basis = fb_coefficient_grads_reference(grad_h, coefficients, basis, mask)
    return (g_lam if need_lam else None), (g_basis if need_basis else None)


def _conv_backward(grad: Tensor, input: Tensor, h: Tensor, has_bias: bool, stride, padding, dilation, groups, needs):
    """``dL/dX``, ``dL/dh`` (= dL/dY * X, eq. A.11) and ``dL/db`` of ``conv2d``."""
    return torch.ops.aten.convolution_backward(
        grad, input, h, [h.shape[0]] if has_bias else None, list(stride), list(padding), list(dilation),
        False, [0, 0], groups, [needs[0], needs[1], needs[2] and has_bias],
    )


def _fb_reconstruct_backward_setup(ctx, inputs, output):
    grad_h, coefficients, basis, mask, output_mask = inputs
    ctx.save_for_backward(grad_h, coefficients, basis, mask)
    ctx.output_mask = tuple(output_mask)


def _fb_reconstruct_backward_backward(ctx, gg_lam, gg_basis):
    """Double backward: both outputs are bilinear in ``dL/dh`` and ``(lam, g)``,
    so their gradients are the two FB ops again (with the upstream gradient in
    the place of the coefficients or of the basis)."""
    grad_h, coefficients, basis, mask = ctx.saved_tensors
    need = ctx.needs_input_grad
    a = gg_lam if ctx.output_mask[0] and gg_lam is not None else None  # upstream of dL/dlam
    bb = gg_basis if ctx.output_mask[1] and gg_basis is not None else None  # upstream of dL/dg
    op = torch.ops.prunopt
    d_gh = d_lam = d_basis = None
    if need[0]:
        d_gh = torch.zeros_like(grad_h)
        if a is not None:
            d_gh = d_gh + op.fb_reconstruct(a, basis, mask)
        if bb is not None:
            d_gh = d_gh + op.fb_reconstruct(coefficients, bb, mask)
    if need[1] and bb is not None:
        d_lam = op.fb_reconstruct_backward(grad_h, coefficients, bb, mask, [True, False])[0]
    if need[2] and a is not None:
        d_basis = op.fb_reconstruct_backward(grad_h, a, basis, mask, [False, True])[1]
    return d_gh, d_lam, d_basis, None, None


def _fb_conv2d_setup(ctx, inputs, output):
    input, coefficients, basis, mask, bias, stride, padding, dilation, groups, _ = inputs
    ctx.save_for_backward(input, coefficients, basis, mask)
    ctx.conv = (bias is not None, stride, padding, dilation, groups)


def _fb_conv2d_backward(ctx, grad):
    input, coefficients, basis, mask = ctx.saved_tensors
    has_bias, stride, padding, dilation, groups = ctx.conv
    need = ctx.needs_input_grad
    h = torch.ops.prunopt.fb_reconstruct(coefficients, basis, mask)
    g_in, g_h, g_b = _conv_backward(grad.contiguous(), input, h, has_bias, stride, padding, dilation, groups,
                                    (need[0], need[1] or need[2], need[4]))
    g_lam, g_basis = _reconstruct_grads(g_h, coefficients, basis, mask, need[1], need[2])
    return g_in, g_lam, g_basis, None, g_b, None, None, None, None, None


def _csr_rows(crow: Tensor) -> Tensor:
    c_out = crow.shape[0] - 1
    return torch.repeat_interleave(torch.arange(c_out, device=crow.device), (crow[1:] - crow[:-1]).long())


def _fb_conv2d_csr_setup(ctx, inputs, output):
    input, crow, col, values, basis, bias, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(input, crow, col, values, basis)
    ctx.conv = (bias is not None, stride, padding, dilation, groups)


def _fb_conv2d_csr_backward(ctx, grad):
    input, crow, col, values, basis = ctx.saved_tensors
    has_bias, stride, padding, dilation, groups = ctx.conv
    need = ctx.needs_input_grad
    c_out, n = crow.shape[0] - 1, basis.shape[0]
    c_in_g = input.shape[1] // groups
    rows, cols = _csr_rows(crow), col.long()
    lam = values.new_zeros(c_out, c_in_g * n).index_put((rows, cols), values).reshape(c_out, c_in_g, n)
    h = torch.ops.prunopt.fb_reconstruct(lam, basis, None)
    g_in, g_h, g_b = _conv_backward(grad.contiguous(), input, h, has_bias, stride, padding, dilation, groups,
                                    (need[0], need[3] or need[4], need[5]))
    g_vals = g_basis = None
    if need[3] or need[4]:
        g_lam, g_basis = _reconstruct_grads(g_h, lam, basis, None, need[3], need[4])
        if need[3]:
            g_vals = g_lam.reshape(c_out, -1)[rows, cols]  # only the stored non-zeros train
    return g_in, None, None, g_vals, g_basis, g_b, None, None, None, None


def register_fb_autograd() -> None:
    """Registers the backward formulas above for three FB ops. ``prunopt::fb_reconstruct``,
    the op of the training path, has its autograd in C++
    (``csrc/autograd/fb_reconstruct.cpp``: the same formulas, eq. 7, A.13, A.14, with
    no Python on the host's path); its double backward is the autograd of
    ``prunopt::fb_reconstruct_backward`` registered here."""
    if hasattr(torch.ops.prunopt, "fb_reconstruct_backward"):
        torch.library.register_autograd("prunopt::fb_reconstruct_backward", _fb_reconstruct_backward_backward,
                                        setup_context=_fb_reconstruct_backward_setup)
    torch.library.register_autograd("prunopt::fb_conv2d", _fb_conv2d_backward, setup_context=_fb_conv2d_setup)
    torch.library.register_autograd("prunopt::fb_conv2d_csr", _fb_conv2d_csr_backward, setup_context=_fb_conv2d_csr_setup)


# fake kernels (torch.compile, meta tensors) and the Python autograd formulas
if extension_available() and hasattr(torch.ops.prunopt, "fb_conv2d"):
    # (each fake runs the real kernel's argument checks on the metadata first:
    # prunopt/ops/_fake_checks.py)
    @torch.library.register_fake("prunopt::fb_reconstruct")
    def _fb_reconstruct_fake(coefficients, basis, mask):
        _fc.check_fb_reconstruct(coefficients, basis, mask, "fb_reconstruct")
        return coefficients.new_empty(coefficients.shape[0], coefficients.shape[1], basis.shape[1], basis.shape[2])

    if hasattr(torch.ops.prunopt, "fb_reconstruct_backward"):  # absent from extensions built before it

        @torch.library.register_fake("prunopt::fb_reconstruct_backward")
        def _fb_reconstruct_backward_fake(grad_h, coefficients, basis, mask, output_mask):
            _fc.check_fb_reconstruct(coefficients, basis, mask, "fb_reconstruct_backward")
            _fc.check_fb_grad_h(grad_h, coefficients, basis, "fb_reconstruct_backward")
            return (coefficients.new_empty(coefficients.shape if output_mask[0] else (0,)),
                    basis.new_empty(basis.shape if output_mask[1] else (0,)))

    @torch.library.register_fake("prunopt::fb_conv2d")
    def _fb_conv2d_fake(input, coefficients, basis, mask, bias, stride, padding, dilation, groups, max_density):
        op = "fb_conv2d"
        _fc.check_fb_reconstruct(coefficients, basis, mask, op)
        if isinstance(max_density, float) and max_density != max_density:
            raise ValueError(f"{op}: max_density must be a number, got nan")
        c_out, c_in_g = coefficients.shape[0], coefficients.shape[1]
        shape = _fc.check_fb_conv(input, c_out, c_in_g, basis, bias, stride, padding, dilation, groups, op)
        return input.new_empty(shape)

    @torch.library.register_fake("prunopt::fb_conv2d_csr")
    def _fb_conv2d_csr_fake(input, crow_indices, col_indices, values, basis, bias, stride, padding, dilation, groups):
        op = "fb_conv2d_csr"
        _fc.check_fb_csr(crow_indices, col_indices, values, basis, op)
        c_out = crow_indices.shape[0] - 1
        if not isinstance(input, Tensor):
            raise ValueError(f"{op}: input must be a tensor, got {type(input).__name__}")
        if input.dim() != 4:
            raise ValueError(f"{op}: input must have shape (B, C_in, H, W), got {list(input.shape)}")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or input.shape[1] % groups != 0:
            raise ValueError(f"{op}: groups must divide C_in = {input.shape[1]}")
        c_in_g = input.shape[1] // groups
        shape = _fc.check_fb_conv(input, c_out, c_in_g, basis, bias, stride, padding, dilation, groups, op)
        return input.new_empty(shape)

    register_fb_autograd()
