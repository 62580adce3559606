"""Readable references of the gate ops: differentiable sparsification (Lee,
Lee: ``rgf_relu``, ``sparse_gate``) and the two-temperature sigmoid of
differentiable architecture pruning (Colombo & Gao, eq. 6-7).

Two kinds of function live here:

* ``*_reference`` forwards and ``*_backward_reference`` backward formulas, written
  straight from the paper's equations in float64: the oracles the fused kernels
  are tested against.
* ``*_composed`` versions built from plain PyTorch ops whose autograd gives the
  custom gradient (the straight-through trick ``relu(x) + elu(x) - elu(x).detach()``
  is relu forward and elu backward). They are the fallback when the extension is
  missing, an independent check of the hand-derived backward formulas, and the
  baseline of ``prunopt/bench/bench_gates.py``.

Shapes: gates act on the last dimension of ``alpha`` (``(..., n)``), with one
threshold ``beta`` per group (shape ``alpha.shape[:-1]``).
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "rgf_relu_reference",
    "rgf_relu_backward_reference",
    "rgf_relu_composed",
    "sparse_gate_reference",
    "sparse_gate_backward_reference",
    "sparse_gate_composed",
    "two_temperature_sigmoid_reference",
    "two_temperature_sigmoid_backward_reference",
    "two_temperature_sigmoid_composed",
]


def rgf_relu_reference(x: Tensor, alpha: float = 0.1) -> Tensor:
    """Forward of the rectified gradient flow: ``relu(x)`` (DS eq. 15)."""
    return torch.relu(x)


def rgf_relu_backward_reference(grad: Tensor, x: Tensor, alpha: float = 0.1) -> Tensor:
    r"""The eq. 15 surrogate gradient: ``grad * elu'(x; alpha)``,
    :math:`elu'(x) = 1` for :math:`x > 0` and :math:`\alpha e^x` for :math:`x \le 0`
    (``alpha = 0`` is the relu derivative). Computed in float64."""
    xd = x.double()
    slope = torch.where(xd > 0, torch.ones_like(xd), alpha * torch.exp(torch.clamp(xd, max=0.0)))
    return (grad.double() * slope).to(x.dtype)


def rgf_relu_composed(x: Tensor, alpha: float = 0.1) -> Tensor:
    """relu forward, elu(alpha) backward, from plain PyTorch ops (straight-through)."""
    if alpha == 0:
        return torch.relu(x)
    e = F.elu(x, alpha=alpha)
    return torch.relu(x).detach() + (e - e.detach())


def _threshold_input(alpha: Tensor, beta: Tensor, signed: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(u, s, norm): the argument of the thresholding relu, sigmoid(beta) and the
    l1 norm of the group (eq. 10 / 12)."""
    s = torch.sigmoid(beta).unsqueeze(-1)
    if signed:
        norm = alpha.abs().sum(-1, keepdim=True)
        return alpha.abs() - s * norm, s, norm
    gamma = torch.exp(alpha)  # eq. 9
    norm = gamma.sum(-1, keepdim=True)
    return gamma - s * norm, s, norm


def sparse_gate_reference(alpha: Tensor, beta: Tensor, signed: bool = True) -> Tensor:
    r"""Gates of one or many competition groups (float64 inside).

    signed (eq. 12): :math:`a_i = \mathrm{sign}(\alpha_i)\,
    (|\alpha_i| - \sigma(\beta)\|\alpha\|_1)_+`;
    non-negative (eq. 9-11): :math:`\gamma = e^\alpha`,
    :math:`\tilde\gamma_i = (\gamma_i - \sigma(\beta)\|\gamma\|_1)_+`,
    :math:`a = \tilde\gamma / \sum_j \tilde\gamma_j` (``a = 0`` if every
    :math:`\tilde\gamma_j = 0`)."""
    al, be = alpha.double(), beta.double()
    u, _, _ = _threshold_input(al, be, signed)
    if signed:
        a = torch.sign(al) * torch.relu(u)
    else:
        gt = torch.relu(u)
        total = gt.sum(-1, keepdim=True)
        a = gt / torch.where(total > 0, total, torch.ones_like(total))
    return a.to(alpha.dtype)


def sparse_gate_backward_reference(
    grad: Tensor, alpha: Tensor, beta: Tensor, signed: bool = True, rgf_alpha: float = 0.1
) -> Tuple[Tensor, Tensor]:
    r"""Closed-form gradients of :func:`sparse_gate_reference` with the
    thresholding relu's slope replaced by :math:`d(u) = 1\,(u>0)`,
    :math:`\alpha_{rgf} e^u\,(u \le 0)` (eq. 15). With :math:`s = \sigma(\beta)`:

    signed: :math:`P = \sum_i g_i\,\mathrm{sign}(\alpha_i) d(z_i)`,
    :math:`\partial\alpha_k = g_k d(z_k)\,\mathrm{sign}(\alpha_k)^2 - s\,\mathrm{sign}(\alpha_k) P`,
    :math:`\partial\beta = -s(1-s)\|\alpha\|_1 P`.

    non-negative: :math:`h = (g - \langle g, a\rangle)/T`, :math:`q = h\,d(u)`,
    :math:`\partial\alpha_k = \gamma_k (q_k - s\sum_j q_j)`,
    :math:`\partial\beta = -s(1-s)\|\gamma\|_1 \sum_j q_j`."""
    g, al, be = grad.double(), alpha.double(), beta.double()
    u, s, norm = _threshold_input(al, be, signed)
    d = torch.where(u > 0, torch.ones_like(u), rgf_alpha * torch.exp(torch.clamp(u, max=0.0)))
    ds = (torch.sigmoid(be) * (1 - torch.sigmoid(be))).unsqueeze(-1)
    if signed:
        sg = torch.sign(al)
        P = (g * sg * d).sum(-1, keepdim=True)
        galpha = g * d * sg * sg - s * sg * P
        gbeta = -ds * norm * P
    else:
        gamma = torch.exp(al)
        gt = torch.relu(u)
        total = gt.sum(-1, keepdim=True)
        T = torch.where(total > 0, total, torch.ones_like(total))
        a = gt / T
        h = (g - (g * a).sum(-1, keepdim=True)) / T
        q = h * d
        Q = q.sum(-1, keepdim=True)
        galpha = gamma * (q - s * Q)
        gbeta = -ds * norm * Q
    return galpha.to(alpha.dtype), gbeta.squeeze(-1).to(beta.dtype)


def sparse_gate_composed(alpha: Tensor, beta: Tensor, signed: bool = True, rgf_alpha: float = 0.1) -> Tensor:
    """The gates from plain PyTorch ops; autograd gives the eq. 15 gradient
    (``rgf_alpha = 0``: the exact relu gradient)."""
    u, _, _ = _threshold_input(alpha, beta, signed)
    r = rgf_relu_composed(u, rgf_alpha)
    if signed:
        return torch.sign(alpha) * r
    total = r.sum(-1, keepdim=True)
    return r / torch.where(total > 0, total, torch.ones_like(total))


# --- two-temperature sigmoid (architecture pruning, eq. 6-7) ---
def two_temperature_sigmoid_reference(w: Tensor, t_l: float, t_s: float) -> Tensor:
    r"""Forward of the relaxed mask, eq. 6: :math:`v = \sigma(t_l w)` (float64 inside)."""
    return torch.sigmoid(t_l * w.double()).to(w.dtype)


def two_temperature_sigmoid_backward_reference(grad: Tensor, w: Tensor, t_s: float) -> Tensor:
    r"""The eq. 7 surrogate gradient :math:`g\, t_s \sigma(t_s w)(1 - \sigma(t_s w))` (float64)."""
    sw = torch.sigmoid(t_s * w.double())
    return (grad.double() * t_s * sw * (1 - sw)).to(w.dtype)


def two_temperature_sigmoid_composed(w: Tensor, t_l: float, t_s: float) -> Tensor:
    """sigmoid(t_l w) forward, the t_s sigmoid's derivative backward, from plain
    PyTorch ops (straight-through): the fallback and the benchmark baseline."""
    if t_l == t_s:
        return torch.sigmoid(t_l * w)
    soft = torch.sigmoid(t_s * w)
    return torch.sigmoid(t_l * w).detach() + (soft - soft.detach())
