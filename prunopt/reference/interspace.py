"""Reference filter-basis (FB) convolution for interspace pruning (Wimmer et al.;
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

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from prunopt.validation import validate_fb_args

__all__ = [
    "fb_reconstruct_reference",
    "fb_conv2d_reference",
    "fb_conv2d_sparse_reference",
    "fb_coefficient_grads_reference",
    "basis_matrix",
]

IntPair = Union[int, Sequence[int]]


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
