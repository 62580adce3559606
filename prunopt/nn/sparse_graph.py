"""Differentiable sparsification of graphs (Lee, "other uses").

* :class:`SparseEdges` — the edges of a neural graph (DNW, Wortsman et al. 2019)
  parameterised by the signed gates of eq. 12, so that edges become exact zeros
  under an l1 penalty (DS section "Connection to DNW", Table 6).
* :class:`SparseAdjacency` — a learned non-negative adjacency matrix whose rows
  and columns are competition groups (DS section "Learning Sparse Affinity
  Matrix"), followed by :func:`balanced_normalize`, and its row/column lp
  penalty :func:`adjacency_regularizer`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prunopt.nn._jit import script_unsupported
from prunopt.nn.sparsification import _safe_pow
from prunopt.ops import rgf_relu, sparse_gate
from prunopt.validation import SIZE_MAX, check_real

__all__ = ["SparseEdges", "SparseAdjacency", "balanced_normalize", "adjacency_regularizer"]


def _check_count(v, name: str, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be at most {hi}, got {v}")
    return v


def _check_rgf_alpha(rgf_alpha) -> float:
    if isinstance(rgf_alpha, bool) or not isinstance(rgf_alpha, (int, float)):
        raise ValueError(f"rgf_alpha must be a finite number >= 0, got {rgf_alpha!r}")
    return check_real(rgf_alpha, "rgf_alpha", 0.0)  # (an int beyond the float range: ValueError too)


def _paper_threshold_logit(n: int) -> float:
    # sigma(beta) = 1 / (n^2 + n), the paper's initial threshold fraction
    return -math.log(n * n + n - 1)


def _inv_sqrt(s: Tensor) -> Tensor:
    """s^{-1/2} for s > 0 and 0 for s == 0, with a finite gradient everywhere."""
    pos = s > 0
    return torch.where(pos, torch.rsqrt(torch.where(pos, s, torch.ones_like(s))), torch.zeros_like(s))


def balanced_normalize(A: Tensor, iters: int = 20, allow_empty: bool = False) -> Tensor:
    r"""Iterated balanced normalisation of a non-negative square matrix (DS,
    "Learning Sparse Affinity Matrix", the equation after eq. 17's section):

    .. math:: A \leftarrow D_r^{-1/2} A D_c^{-1/2},\qquad [D_r]_i = \sum_j A_{ij},\ [D_c]_j = \sum_i A_{ij}

    applied ``iters`` times starting from ``A``. It is a Sinkhorn-type scaling
    (Ruiz's 1-norm equilibration of the bipartite matrix ``[[0, A], [A^T, 0]]``);
    for a matrix with total support (e.g. every entry positive) row and column
    sums converge to 1, i.e. the result approaches a doubly-stochastic matrix.
    Zeros stay exact zeros (the scaling is multiplicative), so a sparse adjacency
    stays sparse. Differentiable (autograd through the iterations); row and column
    sums are accumulated in float64.

    Args:
        A: ``(..., N, N)`` floating tensor with non-negative entries (batched over
            leading dimensions).
        iters: number of iterations, >= 1.
        allow_empty: an all-zero row or column has no defined scaling. With
            ``False`` (default) it raises; with ``True`` it is left at zero (an
            isolated node) and only the other rows/columns are balanced.

    Raises:
        TypeError: ``A`` not a floating tensor; ``iters`` not an int.
        ValueError: fewer than 2 dimensions, non-square, ``iters < 1``, negative
            or non-finite entries, an empty row/column without ``allow_empty``.
            The value checks are skipped while ``torch.compile`` traces (they
            would need a device sync).
    """
    if not isinstance(A, Tensor):
        raise TypeError(f"A must be a tensor, got {type(A).__name__}")
    if not A.is_floating_point():
        raise TypeError(f"A must be a floating tensor, got {A.dtype}")
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"A must be a square matrix (..., N, N), got shape {tuple(A.shape)}")
    iters = _check_count(iters, "iters", 1)
    if not isinstance(allow_empty, bool):
        raise TypeError("allow_empty must be a bool")
    if A.numel() == 0:
        raise ValueError("A is empty (N = 0)")
    if not torch.compiler.is_compiling():
        with torch.no_grad():
            if not bool(torch.isfinite(A).all()):
                raise ValueError("A has non-finite entries")
            if bool((A < 0).any()):
                raise ValueError("A must be non-negative (balanced normalisation of a signed matrix is undefined)")
            if not allow_empty and (bool((A.sum(-1) == 0).any()) or bool((A.sum(-2) == 0).any())):
                raise ValueError("A has an all-zero row or column; its scaling is undefined "
                                 "(pass allow_empty=True to keep it at zero)")
    for _ in range(iters):
        r = A.sum(-1, keepdim=True, dtype=torch.float64)
        c = A.sum(-2, keepdim=True, dtype=torch.float64)
        A = A * _inv_sqrt(r).to(A.dtype) * _inv_sqrt(c).to(A.dtype)
    return A


def adjacency_regularizer(A: Tensor, p: float = 0.5) -> Tensor:
    r"""Row and column lp penalty of a (normalised) adjacency (DS, the objective
    of "Learning Sparse Affinity Matrix" with eq. 14):

    .. math:: \frac{1}{2}\sum_{i=1}^{N}\left\{ \mathcal{R}(A_{i,:}) + \mathcal{R}(A_{:,i}) \right\},\qquad
              \mathcal{R}(v) = \Big(\sum_j |v_j|^p\Big)^{1/p},\ 0 < p < 1

    (multiply by lambda yourself). l1 would be useless here: after balanced
    normalisation every row and column sums to 1. Gradients are 0, not NaN, at
    zero entries and zero rows; a NaN entry gives a NaN result. Batched over
    leading dimensions (summed).
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p < 1.0:  # (exact for any int)
        raise ValueError(f"adjacency_regularizer needs 0 < p < 1 (eq. 14), got p={p!r}")
    if not isinstance(A, Tensor) or not A.is_floating_point():
        raise TypeError("A must be a floating tensor")
    if A.dim() < 2 or A.shape[-1] != A.shape[-2] or A.numel() == 0:
        raise ValueError(f"A must be a non-empty square matrix (..., N, N), got shape {tuple(A.shape)}")
    powed = _safe_pow(A.abs(), p)
    return 0.5 * (_safe_pow(powed.sum(-1), 1.0 / p).sum() + _safe_pow(powed.sum(-2), 1.0 / p).sum())


class SparseEdges(nn.Module):
    r"""DNW-style sparse edges of a neural graph, parameterised by DS gates.

    A layer of ``out_nodes`` nodes, each fed by every one of ``in_nodes`` nodes
    (DNW's ``y_v = \sum_{(u,v) \in E} w_{uv} x_u``). The edge weights *are* the
    signed architecture parameters of eq. 12, one competition group per
    receiving node (the row of its incoming edges):

    .. math:: w_{vu} = \mathrm{sign}(\alpha_{vu})\,\big(|\alpha_{vu}| - \sigma(\beta_v)\,\|\alpha_{v,:}\|_1\big)_+

    with the rectified gradient flow of eq. 15 (``rgf=True``): pruned edges
    (exact zeros) pass no signal forward but keep receiving a gradient, the
    "gradient flows to hallucinated edges but not through them" rule of DNW,
    without DNW's top-k bookkeeping. Train with an l1 penalty on
    :attr:`weight` (``lambda * l1_regularizer(edges.weight)``) to prune edges;
    the density is set by lambda, not by a k.

    Input ``(B, in_nodes, *)`` (node states along dim 1, e.g. channels of a
    feature map, so this is a 1x1 convolution with gated weights); output
    ``(B, out_nodes, *)``.

    Initialisation: ``alpha`` as ``nn.Linear``'s weight (uniform, bound
    ``1/sqrt(in_nodes)``), ``sigma(beta) = 1/(n^2+n)`` (the paper's initial
    threshold, ``n = in_nodes``), so only edges with
    ``|alpha| < mean|alpha|/(n+1)`` start at zero.
    """

    __prepare_scriptable__ = script_unsupported  # torch.jit.script: a clear error (prunopt.nn._jit)

    def __init__(self, in_nodes: int, out_nodes: int, bias: bool = False, rgf: bool = True,
                 rgf_alpha: float = 0.1, device=None, dtype=None):
        super().__init__()
        self.in_nodes = _check_count(in_nodes, "in_nodes", 1, SIZE_MAX)
        self.out_nodes = _check_count(out_nodes, "out_nodes", 1, SIZE_MAX)
        if not isinstance(bias, bool) or not isinstance(rgf, bool):
            raise TypeError("bias and rgf must be bools")
        self.rgf, self.rgf_alpha = rgf, _check_rgf_alpha(rgf_alpha)
        kw = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        self.alpha = nn.Parameter(torch.empty(out_nodes, in_nodes, **kw))
        self.beta = nn.Parameter(torch.empty(out_nodes, **kw))
        self.bias = nn.Parameter(torch.empty(out_nodes, **kw)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_nodes)
        self.alpha.uniform_(-bound, bound)
        self.beta.fill_(_paper_threshold_logit(self.in_nodes) if self.in_nodes > 1 else -math.log(3.0))
        if self.bias is not None:
            self.bias.uniform_(-bound, bound)

    @property
    def weight(self) -> Tensor:
        """The edge weights ``(out_nodes, in_nodes)`` (eq. 12), differentiable."""
        return sparse_gate(self.alpha, self.beta, signed=True, rgf=self.rgf, rgf_alpha=self.rgf_alpha, dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2 or x.shape[1] != self.in_nodes:
            raise ValueError(f"SparseEdges expects input (B, {self.in_nodes}, ...), got shape {tuple(x.shape)}")
        w = self.weight
        if x.dim() == 2:
            return F.linear(x, w, self.bias)
        return F.linear(x.movedim(1, -1), w, self.bias).movedim(-1, 1)

    @torch.no_grad()
    def edge_density(self) -> float:
        """Fraction of edges that are not exactly zero."""
        return float((self.weight != 0).double().mean())

    def extra_repr(self) -> str:
        return f"in_nodes={self.in_nodes}, out_nodes={self.out_nodes}, bias={self.bias is not None}, rgf={self.rgf}"


class SparseAdjacency(nn.Module):
    r"""A learned sparse adjacency of ``num_nodes`` nodes (DS, "Learning Sparse
    Affinity Matrix"; shared by the blocks :math:`H^{l+1} = F(A H^l W^l)` of a GCN).

    Every row (incoming edges) and every column (outgoing edges) is a
    competition group with its own threshold (the eq. 10 form with two
    thresholds):

    .. math:: \tilde A_{ij} = \big(\gamma_{ij} - \sigma(\beta^r_i)\|\gamma_{i,:}\|_1 - \sigma(\beta^c_j)\|\gamma_{:,j}\|_1\big)_+,
              \qquad \gamma_{ij} = e^{\alpha_{ij}}

    (thresholding with the rectified gradient flow of eq. 15 when ``rgf``), and
    the result is :func:`balanced_normalize` (``iters`` iterations) of
    :math:`\tilde A`, approximately doubly stochastic. Calling the module returns
    that ``A``. Penalise it with :func:`adjacency_regularizer` (lp, p = 0.5 in
    the paper) to make it sparse; entries become exact zeros through the
    thresholds. A row or column that is thresholded away entirely is an
    isolated node and stays zero (``allow_empty=True``).

    Initialisation: ``alpha = 0`` (every :math:`\gamma = 1`) and
    ``sigma(beta) = 1/(N^2+N)``, so :math:`\tilde A_{ij} = (N-1)/(N+1)` and ``A``
    starts uniform, ``1/N``. ``mask`` (optional, ``(N, N)`` bool) fixes the
    support: entries outside it are 0 (the paper's Baseline I, known road
    connectivity).
    """

    __prepare_scriptable__ = script_unsupported  # torch.jit.script: a clear error (prunopt.nn._jit)

    def __init__(self, num_nodes: int, iters: int = 20, rgf: bool = True, rgf_alpha: float = 0.1,
                 mask: Optional[Tensor] = None, device=None, dtype=None):
        super().__init__()
        self.num_nodes = _check_count(num_nodes, "num_nodes", 2, SIZE_MAX)
        self.iters = _check_count(iters, "iters", 1)
        if not isinstance(rgf, bool):
            raise TypeError("rgf must be a bool")
        self.rgf, self.rgf_alpha = rgf, _check_rgf_alpha(rgf_alpha)
        n = num_nodes
        kw = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        self.alpha = nn.Parameter(torch.zeros(n, n, **kw))
        self.beta_row = nn.Parameter(torch.full((n,), _paper_threshold_logit(n), **kw))
        self.beta_col = nn.Parameter(torch.full((n,), _paper_threshold_logit(n), **kw))
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (n, n):
                raise ValueError(f"mask must be a bool tensor of shape ({n}, {n})")
            self.register_buffer("mask", mask.to(device=self.alpha.device))
        else:
            self.register_buffer("mask", None)

    def unnormalized(self) -> Tensor:
        r""":math:`\tilde A` before the balanced normalisation (exact zeros where thresholded)."""
        gamma = torch.exp(self.alpha)
        if self.mask is not None:
            gamma = gamma * self.mask.to(gamma.dtype)
        u = gamma - torch.sigmoid(self.beta_row)[:, None] * gamma.sum(1, keepdim=True) \
            - torch.sigmoid(self.beta_col)[None, :] * gamma.sum(0, keepdim=True)
        # masked entries have gamma = 0 < threshold: exact zeros, and no gradient reaches their alpha
        return rgf_relu(u, self.rgf_alpha) if self.rgf else torch.relu(u)

    def forward(self) -> Tensor:
        return balanced_normalize(self.unnormalized(), self.iters, allow_empty=True)

    @torch.no_grad()
    def density(self) -> float:
        """Fraction of entries of ``A`` that are not exactly zero."""
        return float((self.unnormalized() != 0).double().mean())

    def extra_repr(self) -> str:
        return f"num_nodes={self.num_nodes}, iters={self.iters}, rgf={self.rgf}, masked={self.mask is not None}"
