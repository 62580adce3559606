"""Pruning rates (eq. 9) and storage of sparse weights: CSR with its byte size
and the entropy-coded bound (paper App. C, eq. A.2)."""
from __future__ import annotations

import math
import numbers
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Mapping, Union

import torch
from torch import Tensor, nn

from prunopt.pruning import _dist
from prunopt.pruning.masks import Masker, _distinct_tensors, prunable_tensors
from prunopt.validation import SIZE_MAX

__all__ = [
    "pruning_rates",
    "CSRTensor",
    "to_csr",
    "from_csr",
    "export_csr",
    "entropy_bound",
    "mask_entropy_bits",
]


def _tensors(target):
    """The prunable tensors of ``target`` (tied layers once); ``ValueError`` when
    there are none, or when none has an entry (every rate would be 0/0)."""
    if isinstance(target, Masker):
        tensors = target.tensors
    elif isinstance(target, nn.Module):
        tensors = _distinct_tensors(prunable_tensors(target))
    else:
        raise TypeError(f"target must be a Masker or an nn.Module, got {type(target).__name__}")
    if not tensors:
        raise ValueError("target has no prunable tensors")
    if all(pt.parameter.numel() == 0 for pt in tensors.values()):
        raise ValueError(f"target has no prunable entries: its prunable tensors {list(tensors)} are all empty")
    return tensors


def pruning_rates(target: Union[Masker, nn.Module]) -> Dict[str, float]:
    """Pruning rates of eq. 9:
    ``p_SP = 1 - ||Lambda||_0 / D`` and
    ``p_IP = 1 - (||Lambda||_0 + sum_j ||F_j||_0) / D``,
    with ``Lambda`` the effective prunable tensors (spatial weights or FB
    coefficients, times their masks), ``F_j`` the distinct filter bases (a
    shared basis counts once) and ``D`` the number of prunable weights of the
    equivalent standard network (``C_out C_in/groups kh kw`` for an FB layer,
    whatever its dictionary size ``N``; a tied tensor counts once).  For a model
    without FB layers ``p_IP = p_SP``.  Counts run over the global tensors for
    FSDP2 shards (local counts summed over the ranks: a collective).  Returns
    ``{"p_sp", "p_ip", "D", "nonzero", "basis_nonzero"}``.  A target without
    prunable tensors, or whose prunable tensors are all empty, is a
    ``ValueError``."""
    tensors = _tensors(target)
    with torch.no_grad():
        # over the global tensors for FSDP2 shards (a DTensor's count_nonzero would be this rank's part)
        nnz = _dist.global_count([pt.effective() for pt in tensors.values()], _nonzero)
        D = sum(pt.spatial_numel for pt in tensors.values())
        bases = {}
        for pt in tensors.values():
            if pt.interspace:
                b = pt.module.basis.weight
                bases[id(b)] = b
        fb = _dist.global_count(list(bases.values()), _nonzero)
    return {"p_sp": 1.0 - nnz / D, "p_ip": 1.0 - (nnz + fb) / D, "D": D, "nonzero": nnz, "basis_nonzero": fb}


def _nonzero(t: Tensor) -> Tensor:
    return t != 0


def _index_dtype(max_value: int) -> torch.dtype:
    """Smallest signed integer type holding ``max_value`` (App. C: indices need
    not be stored in 32-bit)."""
    for dt, lim in ((torch.int8, 127), (torch.int16, 32767), (torch.int32, 2**31 - 1)):
        if max_value <= lim:
            return dt
    return torch.int64


@dataclass
class CSRTensor:
    """A weight stored in compressed sparse row format.  The tensor is viewed as
    a matrix ``(shape[0], prod(shape[1:]))`` (a Linear weight is itself; a conv
    weight or FB coefficient tensor has one row per output channel).
    ``crow_indices`` and ``col_indices`` use the smallest integer type that
    holds their values."""

    shape: torch.Size
    values: Tensor
    crow_indices: Tensor
    col_indices: Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of values + column indices + row pointers."""
        return sum(t.numel() * t.element_size() for t in (self.values, self.crow_indices, self.col_indices))

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the dense tensor (``numel * element_size``)."""
        return math.prod(self.shape) * self.values.element_size()

    def to_dense(self) -> Tensor:
        """The dense tensor (:func:`from_csr`)."""
        return from_csr(self)


def to_csr(weight: Tensor) -> CSRTensor:
    """CSR of ``weight`` (its exact zeros are dropped).  Any tensor with at least
    one dimension, including ones with no entries (e.g. ``(0, 5)``: a matrix
    with no rows)."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a tensor, got {type(weight).__name__}")
    if weight.dim() < 1:
        raise ValueError("weight must have at least one dimension")
    w = weight.detach()
    # explicit sizes: reshape(rows, -1) is ambiguous for a tensor with no entries
    rows, cols = (w.shape[0], math.prod(w.shape[1:])) if w.dim() > 1 else (1, w.shape[0])
    mat = w.reshape(rows, cols)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        csr = mat.to_sparse_csr()
    crow, col = csr.crow_indices(), csr.col_indices()
    return CSRTensor(
        shape=w.shape,
        values=csr.values().clone(),
        crow_indices=crow.to(_index_dtype(int(crow[-1]) if crow.numel() else 0)),
        col_indices=col.to(_index_dtype(max(mat.shape[1] - 1, 0))),
    )


def from_csr(c: CSRTensor) -> Tensor:
    """The dense tensor of a :class:`CSRTensor` (exact round trip of ``to_csr``)."""
    if not isinstance(c, CSRTensor):
        raise TypeError(f"c must be a CSRTensor, got {type(c).__name__}")
    rows, cols = (c.shape[0], math.prod(c.shape[1:])) if len(c.shape) > 1 else (1, math.prod(c.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        mat = torch.sparse_csr_tensor(c.crow_indices.long(), c.col_indices.long(), c.values, size=(rows, cols))
    return mat.to_dense().reshape(c.shape)


def mask_entropy_bits(p: float) -> float:
    """``S = -p log2 p - (1 - p) log2 (1 - p)`` bits per mask entry (eq. A.2)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"p must be a real number in [0, 1], got {type(p).__name__}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    p = float(p)
    return sum(-q * math.log2(q) for q in (p, 1.0 - p) if q > 0.0)


def entropy_bound(p: float, value_bits: int = 32) -> float:
    """Fraction of the dense size needed with an entropy-coded mask plus the
    non-zero values in full precision: ``S / value_bits + (1 - p)`` (App. C,
    eq. A.2; ``value_bits = 32`` for float32).  ``value_bits`` is an int >= 1."""
    if isinstance(value_bits, bool) or not isinstance(value_bits, numbers.Integral):
        raise TypeError(f"value_bits must be an int, got {type(value_bits).__name__}")
    if not 1 <= value_bits <= SIZE_MAX:
        raise ValueError(f"value_bits must be in [1, {SIZE_MAX}], got {value_bits}")
    return mask_entropy_bits(p) / value_bits + (1.0 - p)


def export_csr(target: Union[Masker, nn.Module]) -> Dict[str, object]:
    """CSR export of every effective prunable tensor.  Returns ``{"tensors":
    {FQN: CSRTensor}, "csr_bytes", "dense_bytes", "csr_fraction",
    "entropy_bytes", "entropy_fraction", "sparsity"}`` where the entropy figures
    are the App. C bound ``d (S + (1-p) 32) / 8`` bytes (A.2).  A target
    without prunable tensors, or whose prunable tensors are all empty, is a
    ``ValueError``.  Tensors sharded by FSDP2 are gathered whole, one at a
    time (a collective: every rank calls this and gets the whole export)."""
    tensors = _tensors(target)
    out: Dict[str, CSRTensor] = OrderedDict()
    with torch.no_grad():
        for n, pt in tensors.items():
            out[n] = to_csr(_dist.full_tensor(pt.effective()))
    csr_bytes = sum(c.nbytes for c in out.values())
    dense_bytes = sum(c.dense_nbytes for c in out.values())
    d = sum(math.prod(c.shape) for c in out.values())
    nnz = sum(c.values.numel() for c in out.values())
    p = 1.0 - nnz / d
    value_bits = 8 * next(iter(out.values())).values.element_size()
    entropy_bytes = d * (mask_entropy_bits(p) + (1.0 - p) * value_bits) / 8.0
    return {
        "tensors": out,
        "csr_bytes": csr_bytes,
        "dense_bytes": dense_bytes,
        "csr_fraction": csr_bytes / dense_bytes,
        "entropy_bytes": entropy_bytes,
        "entropy_fraction": entropy_bytes / dense_bytes,
        "sparsity": p,
    }
