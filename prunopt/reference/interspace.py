"""Reference filter-basis (FB) convolution for interspace pruning (SPEC.md §3;
Wimmer et al., "Interspace Pruning", CVPR 2022).

A K×K convolution's filters are written in a filter basis / dictionary
``basis = {g^(1), ..., g^(N)}`` of shape ``(N, kh, kw)`` (``N = kh*kw`` for a basis):

    h[o, i] = sum_n lam[o, i, n] * mu[o, i, n] * g^(n)                       (eq. 4)
    Y[o]    = sum_i sum_n lam[o,i,n] mu[o,i,n] (g^(n) * X[i])              (eq. 6, 8)

Two equal ways of computing the forward pass live here:

* :func:`fb_conv2d_reference` reconstructs the masked filters (eq. 4) and calls
  ``F.conv2d`` (eq. 6): the training path.
* :func:`fb_conv2d_sparse_reference` follows Alg. 1 / eq. 8: convolve every
  input channel with every basis element (im2col followed by a K²×N transform),
  then mix the ``C_in*N`` maps with the masked coefficients.

Written for reading, not speed; float64-safe. The kernels in ``csrc/`` are
tested against these functions.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "fb_reconstruct_reference",
    "fb_conv2d_reference",
    "fb_conv2d_sparse_reference",
    "fb_coefficient_grads_reference",
    "validate_fb_args",
    "validate_fb_input",
    "basis_matrix",
]

IntPair = Union[int, Sequence[int]]


def _pair(value, name: str) -> Tuple[int, int]:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got bool")
    if isinstance(value, numbers.Integral):
        return int(value), int(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value
    ):
        return int(value[0]), int(value[1])
    if isinstance(value, (tuple, list)) and len(value) == 1 and isinstance(value[0], numbers.Integral):
        return int(value[0]), int(value[0])
    raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")


def validate_fb_args(
    input: Optional[Tensor],
    coefficients: Tensor,
    basis: Tensor,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    stride: IntPair = 1,
    padding: IntPair = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    check_input_dtype: bool = True,
):
    """Checks the arguments of the FB ops and normalises the conv arguments.

    Shapes: ``input (B, C_in, H, W)`` (or ``(C_in, H, W)``), ``coefficients
    (C_out, C_in/groups, N)``, ``basis (N, kh, kw)`` with ``kh, kw >= 1``, ``mask`` like
    ``coefficients``, ``bias (C_out,)``. Type problems raise ``TypeError``, bad
    values or shapes ``ValueError``; both name the argument.

    Returns ``(stride, padding, dilation, groups)`` as pairs/int.
    """
    for name, t in (("coefficients", coefficients), ("basis", basis)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a real floating tensor, got {t.dtype}")
    if coefficients.dim() != 3:
        raise ValueError(f"coefficients must have shape (C_out, C_in/groups, N), got {tuple(coefficients.shape)}")
    if basis.dim() != 3:
        raise ValueError(f"basis must have shape (N, kh, kw), got {tuple(basis.shape)}")
    if basis.shape[1] < 1 or basis.shape[2] < 1:
        raise ValueError(f"basis must have a non-empty kernel (kh, kw >= 1), got shape {tuple(basis.shape)}")
    if basis.shape[0] != coefficients.shape[2]:
        raise ValueError(
            f"basis has {basis.shape[0]} elements but coefficients have N = {coefficients.shape[2]} "
            f"(coefficients {tuple(coefficients.shape)}, basis {tuple(basis.shape)})"
        )
    if basis.dtype != coefficients.dtype:
        raise ValueError(f"basis must have the dtype of coefficients ({coefficients.dtype}), got {basis.dtype}")
    if basis.device != coefficients.device:
        raise ValueError(f"basis must be on the device of coefficients ({coefficients.device}), got {basis.device}")
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a Tensor or None, got {type(mask).__name__}")
        if mask.shape != coefficients.shape:
            raise ValueError(f"mask must have the shape of coefficients {tuple(coefficients.shape)}, got {tuple(mask.shape)}")
        if mask.device != coefficients.device:
            raise ValueError(f"mask must be on the device of coefficients ({coefficients.device}), got {mask.device}")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias must be a Tensor or None, got {type(bias).__name__}")
        if bias.shape != (coefficients.shape[0],):
            raise ValueError(f"bias must have shape ({coefficients.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != coefficients.dtype or bias.device != coefficients.device:
            raise ValueError(
                f"bias must have the dtype and device of coefficients ({coefficients.dtype}, "
                f"{coefficients.device}), got {bias.dtype}, {bias.device}"
            )
    stride, padding, dilation = _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
    if min(stride) < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if min(padding) < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    if min(dilation) < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    if isinstance(groups, bool) or not isinstance(groups, numbers.Integral):
        raise TypeError(f"groups must be an int, got {type(groups).__name__}")
    groups = int(groups)
    if groups < 1 or coefficients.shape[0] % groups != 0:
        raise ValueError(f"groups must be >= 1 and divide C_out = {coefficients.shape[0]}, got {groups}")
    if input is not None:
        validate_fb_input(input, coefficients, basis, padding, dilation, groups, check_input_dtype)
    return stride, padding, dilation, groups


def validate_fb_input(input: Tensor, coefficients: Tensor, basis: Tensor, padding: Tuple[int, int],
                      dilation: Tuple[int, int], groups: int, check_dtype: bool = True) -> None:
    """Checks the ``input`` of an FB convolution against checked ``coefficients`` and
    ``basis`` and normalised conv arguments (the input part of
    :func:`validate_fb_args`, which the training path of ``FBConv2d`` calls alone).
    ``check_dtype=False`` under autocast, where ``conv2d`` casts input and filters."""
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a Tensor, got {type(input).__name__}")
    if input.dim() not in (3, 4):
        raise ValueError(f"input must have shape (B, C_in, H, W) or (C_in, H, W), got {tuple(input.shape)}")
    if check_dtype and input.dtype != coefficients.dtype:
        raise ValueError(f"input must have the dtype of coefficients ({coefficients.dtype}), got {input.dtype}")
    if input.device != coefficients.device:
        raise ValueError(f"input must be on the device of coefficients ({coefficients.device}), got {input.device}")
    c_in = input.shape[-3]
    if c_in != coefficients.shape[1] * groups:
        raise ValueError(
            f"input has {c_in} channels but coefficients {tuple(coefficients.shape)} with groups={groups} "
            f"expect C_in = {coefficients.shape[1] * groups}"
        )
    for d, (size, k) in enumerate(zip(input.shape[-2:], basis.shape[1:])):
        if size + 2 * padding[d] < dilation[d] * (k - 1) + 1:
            raise ValueError(
                f"input spatial size {tuple(input.shape[-2:])} (padded by {padding}) is smaller than the "
                f"dilated kernel {tuple(basis.shape[1:])} (dilation {dilation})"
            )


def basis_matrix(basis: Tensor) -> Tensor:
    """The flattened basis ``(N, kh*kw)``: row n is ``g^(n)``. Its transpose is the
    change-of-basis matrix ``Psi`` of eq. A.19, ``phi = Psi @ lam``."""
    return basis.reshape(basis.shape[0], -1)


def fb_reconstruct_reference(coefficients: Tensor, basis: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """Masked spatial filters ``h = einsum("oin,nkl->oikl", lam * mu, basis)`` (eq. 4, A.16)."""
    lam = coefficients if mask is None else coefficients * mask.to(coefficients.dtype)
    return torch.einsum("oin,nkl->oikl", lam, basis)


def fb_conv2d_reference(input, coefficients, basis, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """Training path: reconstruct (eq. 4) and convolve (eq. 6)."""
    stride, padding, dilation, groups = validate_fb_args(input, coefficients, basis, mask, bias, stride, padding, dilation, groups)
    h = fb_reconstruct_reference(coefficients, basis, mask)
    return F.conv2d(input, h, bias, stride, padding, dilation, groups)


def fb_basis_maps_reference(input: Tensor, basis: Tensor, stride, padding, dilation) -> Tensor:
    """``Z[b, c, n, p] = (g^(n) * X[b, c])[p]`` for every input channel and basis
    element (Alg. 1, l. 7-8): im2col of the input, then the K²×N transform."""
    b, c = input.shape[:2]
    n, kh, kw = basis.shape
    cols = F.unfold(input, (kh, kw), dilation=dilation, padding=padding, stride=stride)  # (B, C*K², P)
    cols = cols.reshape(b, c, kh * kw, -1)
    return torch.einsum("nk,bckp->bcnp", basis_matrix(basis), cols)


def fb_conv2d_sparse_reference(input, coefficients, basis, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """Inference path of eq. 8 / Alg. 1: basis maps of every input channel, then
    ``Y[o] = sum_{(i, n): mu[o,i,n] = 1} lam[o,i,n] Z[i, n]`` per group.

    The mix is written as a dense contraction with the masked coefficients (the
    masked-out terms are zeros); the kernel skips them.
    """
    stride, padding, dilation, groups = validate_fb_args(input, coefficients, basis, mask, bias, stride, padding, dilation, groups)
    batched = input.dim() == 4
    x = input if batched else input.unsqueeze(0)
    kh, kw = basis.shape[1:]
    h_out = (x.shape[2] + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    w_out = (x.shape[3] + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    z = fb_basis_maps_reference(x, basis, stride, padding, dilation)  # (B, C_in, N, P)
    lam = coefficients if mask is None else coefficients * mask.to(coefficients.dtype)
    c_out, c_in_g, n = lam.shape
    z = z.reshape(x.shape[0], groups, c_in_g, n, -1)
    lam = lam.reshape(groups, c_out // groups, c_in_g, n)
    y = torch.einsum("goin,bginp->bgop", lam, z).reshape(x.shape[0], c_out, h_out, w_out)  # eq. 8
    if bias is not None:
        y = y + bias.reshape(1, -1, 1, 1)
    return y if batched else y.squeeze(0)


def fb_coefficient_grads_reference(grad_h: Tensor, coefficients: Tensor, basis: Tensor, mask: Optional[Tensor] = None):
    """Gradients of the reconstruction from ``dL/dh`` (eq. 7, A.13, A.14):

        dL/dlam[o,i,n] = <g^(n), dL/dh[o,i]> * mu[o,i,n]
        dL/dg^(n)      = sum_{o,i} lam[o,i,n] mu[o,i,n] dL/dh[o,i]
    """
    lam = coefficients if mask is None else coefficients * mask.to(coefficients.dtype)
    g_lam = torch.einsum("oikl,nkl->oin", grad_h, basis)
    if mask is not None:
        g_lam = g_lam * mask.to(g_lam.dtype)
    g_basis = torch.einsum("oin,oikl->nkl", lam, grad_h)
    return g_lam, g_basis
