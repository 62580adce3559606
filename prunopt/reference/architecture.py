"""Readable reference of the two-temperature sigmoid of differentiable
architecture pruning (Colombo & Gao, SPEC.md §5, eq. 6-7)."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "two_temperature_sigmoid_reference",
    "two_temperature_sigmoid_backward_reference",
    "two_temperature_sigmoid_composed",
]


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
