"""Differentiable sparsification layers (Lee, SPEC.md §4).

* :class:`SparseGate` — the gate vector ``a`` of one competition group (eq. 9-12,
  rectified gradient flow eq. 15).
* :class:`SparseBatchNorm2d` — batch norm whose scale is a sparse gate (eq. 17),
  :func:`convert_to_sparse_batchnorm` for existing models.
* Regularisers :func:`l1_regularizer` (eq. 2), :func:`group_l21_regularizer` (eq. 4),
  :func:`lp_regularizer` (eq. 14) and the cubic strength schedule
  :func:`cubic_strength` (appendix eq. 1).
* :func:`remove_channels` — export with zero-gated channels physically removed.
"""
from __future__ import annotations

import copy
import math
from typing import Iterable, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prunopt.ops import sparse_gate

__all__ = [
    "SparseGate",
    "SparseBatchNorm2d",
    "convert_to_sparse_batchnorm",
    "sparse_gates",
    "l1_regularizer",
    "group_l21_regularizer",
    "lp_regularizer",
    "cubic_strength",
    "remove_channels",
    "gate_density",
]

TensorOrList = Union[Tensor, Sequence[Tensor]]


def _paper_beta(n: int) -> float:
    # sigma(beta) = 1 / (n^2 + n)  <=>  beta = -log(n^2 + n - 1)
    return -math.log(n * n + n - 1) if n > 1 else 0.0


def _ulp_neighbours(x: Tensor, k: int) -> Tensor:
    """x and its k nearest representable neighbours on each side, ascending."""
    down, up, cur_d, cur_u = [], [], x, x
    for _ in range(k):
        cur_d = torch.nextafter(cur_d, torch.tensor(-math.inf, dtype=x.dtype))
        cur_u = torch.nextafter(cur_u, torch.tensor(math.inf, dtype=x.dtype))
        down.append(cur_d)
        up.append(cur_u)
    return torch.stack(down[::-1] + [x] + up)


class SparseGate(nn.Module):
    r"""Gates :math:`a \in \mathbb{R}^n` of one competition group (DS eq. 9-12).

    signed (default, eq. 12):
    :math:`a_i = \mathrm{sign}(\alpha_i)(|\alpha_i| - \sigma(\beta)\|\alpha\|_1)_+`,
    initialised with the paper's :math:`\alpha_i = 0.5 (n+1)/n`,
    :math:`\beta = -\log(n^2+n-1)` so that every gate is exactly 0.5.

    non-negative (``signed=False``, eq. 9-11): :math:`\gamma = e^\alpha`,
    :math:`a = (\gamma - \sigma(\beta)\|\gamma\|_1)_+ / \sum(\cdot)`. These gates
    sum to 1, so they start at exactly :math:`1/n` (:math:`\alpha = 0`, same
    :math:`\beta`).

    ``rgf=True`` uses the elu(``rgf_alpha``) surrogate gradient of eq. 15 so
    that dropped components keep learning. Calling the module returns ``a``.
    """

    def __init__(self, num_gates: int, signed: bool = True, rgf: bool = True, rgf_alpha: float = 0.1,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        if isinstance(num_gates, bool) or not isinstance(num_gates, int):
            raise TypeError(f"num_gates must be an int, got {type(num_gates).__name__}")
        if num_gates < 1:
            raise ValueError(f"num_gates must be >= 1 (an empty group has no gates), got {num_gates}")
        if not isinstance(signed, bool) or not isinstance(rgf, bool):
            raise TypeError("signed and rgf must be bools")
        if not (isinstance(rgf_alpha, (int, float)) and math.isfinite(rgf_alpha) and rgf_alpha >= 0):
            raise ValueError(f"rgf_alpha must be a finite number >= 0, got {rgf_alpha!r}")
        self.num_gates, self.signed, self.rgf, self.rgf_alpha = num_gates, signed, rgf, float(rgf_alpha)
        dtype = dtype or torch.get_default_dtype()
        self.alpha = nn.Parameter(torch.zeros(num_gates, dtype=dtype, device=device))
        self.beta = nn.Parameter(torch.zeros((), dtype=dtype, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The paper's initialisation (a_i = 0.5 signed, 1/n non-negative). In
        low precision the stored alpha/beta are nudged by a few ulps (the nearest
        pair found) so that the gates are exactly 0.5 after rounding."""
        n = self.num_gates
        if not self.signed:
            self.alpha.zero_()
            self.beta.fill_(_paper_beta(n))
            return
        a0 = torch.tensor(0.5 * (n + 1) / n, dtype=torch.float64).to(self.alpha.dtype)
        b0 = torch.tensor(_paper_beta(n), dtype=torch.float64).to(self.beta.dtype)
        # candidates a few ulps around the paper's values, evaluated in one batch
        a_c = _ulp_neighbours(a0, 4)
        b_c = _ulp_neighbours(b0, 32)
        al = a_c.repeat_interleave(len(b_c)).unsqueeze(1).expand(-1, n)
        be = b_c.repeat(len(a_c))
        out = sparse_gate(al.to(self.alpha.device), be.to(self.beta.device))
        exact = (out == 0.5).all(1).cpu()
        dist = ((torch.arange(len(a_c)) - 4).abs().repeat_interleave(len(b_c)) * 8
                + (torch.arange(len(b_c)) - 32).abs().repeat(len(a_c)))
        dist = torch.where(exact, dist, torch.full_like(dist, 1 << 30))
        k = int(dist.argmin()) if bool(exact.any()) else 4 * len(b_c) + 32
        self.alpha.fill_(al[k, 0].item())
        self.beta.fill_(be[k].item())

    def forward(self) -> Tensor:
        return sparse_gate(self.alpha, self.beta, signed=self.signed, rgf=self.rgf, rgf_alpha=self.rgf_alpha)

    def extra_repr(self) -> str:
        return f"{self.num_gates}, signed={self.signed}, rgf={self.rgf}"


class SparseBatchNorm2d(nn.BatchNorm2d):
    r"""Sparse batch normalisation (DS eq. 17), a drop-in for ``nn.BatchNorm2d``:

    .. math:: y_c = a_c\,(\hat x_c + b_c),\qquad \hat x_c = \frac{x_c - \mu_c}{\sqrt{\sigma_c^2 + \epsilon}}

    with :math:`a` a :class:`SparseGate` over the channels (eq. 12) and a learnt
    shift ``b`` (``self.shift``). A zero gate makes the channel's output exactly
    0, so it can be removed (:func:`remove_channels`). With :math:`a = 1` this is
    ``BatchNorm2d`` with weight 1 and bias ``b``. Running statistics behave as in
    ``BatchNorm2d``; ``affine`` is not accepted (the gate is the affine part).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 track_running_stats: bool = True, signed: bool = True, rgf: bool = True, rgf_alpha: float = 0.1,
                 device=None, dtype=None):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=False,
                         track_running_stats=track_running_stats, device=device, dtype=dtype)
        self.gate = SparseGate(num_features, signed=signed, rgf=rgf, rgf_alpha=rgf_alpha, dtype=dtype, device=device)
        self.shift = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype or torch.get_default_dtype()))

    def forward(self, x: Tensor) -> Tensor:
        xhat = super().forward(x)
        a = self.gate()
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return a.view(shape) * (xhat + self.shift.view(shape))

    def gates(self) -> Tensor:
        """The current gate vector a (eq. 12)."""
        return self.gate()


@torch.no_grad()
def _load_from_batchnorm(sbn: SparseBatchNorm2d, bn: nn.BatchNorm2d, preserve: bool) -> None:
    if bn.track_running_stats and bn.running_mean is not None:
        sbn.running_mean.copy_(bn.running_mean)
        sbn.running_var.copy_(bn.running_var)
        sbn.num_batches_tracked.copy_(bn.num_batches_tracked)
    if not (preserve and bn.affine):
        return
    w, b = bn.weight.detach().double(), bn.bias.detach().double()
    n = w.numel()
    s0 = 1.0 / (n * n + n)  # the paper's initial threshold fraction
    # a_i = sign(w_i)(|w_i| + s0 L) - ... = w_i  with  L = ||alpha||_1 = ||w||_1 / (1 - n s0)
    L = w.abs().sum() / (1 - n * s0)
    alpha = torch.sign(w) * (w.abs() + s0 * L)
    alpha = torch.where(w == 0, torch.zeros_like(w), alpha)
    sbn.gate.alpha.copy_(alpha)
    sbn.gate.beta.fill_(math.log(s0 / (1 - s0)))
    sbn.shift.copy_(torch.where(w != 0, b / torch.where(w != 0, w, torch.ones_like(w)), torch.zeros_like(b)))


def convert_to_sparse_batchnorm(model: nn.Module, preserve: bool = True, signed: bool = True, rgf: bool = True,
                                rgf_alpha: float = 0.1) -> nn.Module:
    r"""Replaces every ``nn.BatchNorm2d`` of ``model`` (in place) by a
    :class:`SparseBatchNorm2d` and returns ``model``.

    ``preserve=True`` keeps the function of a trained model: running statistics
    are copied and the gate is solved for :math:`a = w` (the BN weight) at the
    paper's initial threshold :math:`\sigma(\beta) = 1/(n^2+n)`, with
    :math:`b = \mathrm{bias}/w` (channels with :math:`w = 0` become zero gates and
    lose their constant bias). ``preserve=False`` uses the paper's
    initialisation (every gate 0.5) with statistics copied.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if signed is False and preserve:
        raise ValueError("preserve=True needs signed gates (non-negative gates sum to 1 and cannot equal BN weights)")
    for name, child in list(model.named_children()):
        if isinstance(child, nn.BatchNorm2d) and not isinstance(child, SparseBatchNorm2d):
            p = child.running_mean if child.running_mean is not None else child.weight
            sbn = SparseBatchNorm2d(child.num_features, eps=child.eps, momentum=child.momentum,
                                    track_running_stats=child.track_running_stats, signed=signed, rgf=rgf,
                                    rgf_alpha=rgf_alpha, device=p.device if p is not None else None,
                                    dtype=p.dtype if p is not None else None)
            _load_from_batchnorm(sbn, child, preserve)
            sbn.train(child.training)
            setattr(model, name, sbn)
        else:
            convert_to_sparse_batchnorm(child, preserve, signed, rgf, rgf_alpha)
    return model


def sparse_gates(model: nn.Module) -> List[Tensor]:
    """The gate vectors of every :class:`SparseGate` in ``model`` (differentiable)."""
    return [m() for m in model.modules() if isinstance(m, SparseGate)]


def _as_list(gates: TensorOrList, name: str = "gates") -> List[Tensor]:
    if isinstance(gates, Tensor):
        return [gates]
    if isinstance(gates, (list, tuple)) and all(isinstance(g, Tensor) for g in gates):
        return list(gates)
    raise TypeError(f"{name} must be a tensor or a list of tensors")


def l1_regularizer(gates: TensorOrList) -> Tensor:
    r""":math:`\sum_i |a_i|` over all gates (DS eq. 2): removes individual components."""
    gs = _as_list(gates)
    if not gs:
        raise ValueError("gates is empty")
    return sum(g.abs().sum() for g in gs)


def _safe_l2(v: Tensor, dim: int = -1) -> Tensor:
    # ||v||_2 whose gradient at v = 0 is 0 instead of NaN (the paper's safe_l2_norm)
    sq = (v * v).sum(dim)
    pos = sq > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, sq, torch.ones_like(sq))), torch.zeros_like(sq))


def group_l21_regularizer(gates: TensorOrList, group_size: Optional[int] = None) -> Tensor:
    r""":math:`\sum_g \|a_g\|_2` (DS eq. 4): removes whole groups together.

    Each tensor is split along its last dimension into consecutive groups of
    ``group_size`` gates (default: the whole tensor is one group). The norm's
    gradient is 0, not NaN, at a zero group.
    """
    gs = _as_list(gates)
    if not gs:
        raise ValueError("gates is empty")
    total = 0
    for g in gs:
        n = g.shape[-1] if g.dim() else 1
        size = n if group_size is None else group_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"group_size must be a positive int (an empty group is not allowed), got {group_size!r}")
        if n == 0:
            raise ValueError("group_l21_regularizer: empty group (a gate tensor has 0 entries)")
        if n % size:
            raise ValueError(f"group_size {size} does not divide the number of gates {n}")
        total = total + _safe_l2(g.reshape(*g.shape[:-1], n // size, size) if g.dim() else g.reshape(1, 1)).sum()
    return total


def lp_regularizer(gates: TensorOrList, p: float = 0.5) -> Tensor:
    r""":math:`(\sum_i |a_i|^p)^{1/p}` with :math:`0 < p < 1` (DS eq. 14), summed
    over the tensors (each tensor is one group; for normalised non-negative gates
    the l1 norm is constant, so p < 1 is needed). The gradient is 0 at zero gates."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p):
        raise ValueError(f"p must be a finite number in (0, 1), got {p!r}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"lp_regularizer needs 0 < p < 1 (p >= 1 is not the sparsifying lp of eq. 14), got p={p}")
    gs = _as_list(gates)
    if not gs:
        raise ValueError("gates is empty")
    total = 0
    for g in gs:
        if g.numel() == 0:
            raise ValueError("lp_regularizer: empty group (a gate tensor has 0 entries)")
        mag = g.abs()
        nz = mag > 0
        powed = torch.where(nz, torch.where(nz, mag, torch.ones_like(mag)) ** p, torch.zeros_like(mag)).sum()
        pos = powed > 0
        total = total + torch.where(pos, torch.where(pos, powed, torch.ones_like(powed)) ** (1.0 / p),
                                    torch.zeros_like(powed))
    return total


def cubic_strength(t: float, lam_i: float, lam_f: float, t0: float, n: float) -> float:
    r"""Gradual regularisation strength (DS appendix eq. 1):

    .. math:: \lambda_t = \lambda_f + (\lambda_i - \lambda_f)\left(1 - \frac{t - t_0}{n}\right)^3

    for :math:`t_0 \le t \le t_0 + n`, :math:`\lambda_i` before and :math:`\lambda_f` after."""
    for name, v in (("t", t), ("lam_i", lam_i), ("lam_f", lam_f), ("t0", t0), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if n <= 0:
        raise ValueError(f"n (the ramp length) must be > 0, got {n}")
    frac = min(max((t - t0) / n, 0.0), 1.0)
    return lam_f + (lam_i - lam_f) * (1.0 - frac) ** 3


@torch.no_grad()
def gate_density(model: nn.Module) -> float:
    """Fraction of non-zero gates over every SparseGate of ``model``."""
    gs = sparse_gates(model)
    total = sum(g.numel() for g in gs)
    return sum(int((g != 0).sum()) for g in gs) / max(total, 1)


# ----------------------------------------------------------------- channel removal
_PASS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
         nn.Dropout, nn.Dropout2d, nn.Identity)


def _leaves(model: nn.Module) -> List[tuple]:
    out = []
    for name, m in model.named_modules():
        if isinstance(m, SparseBatchNorm2d):
            out.append((name, m))
        elif len(list(m.children())) == 0 and not isinstance(m, SparseGate):
            out.append((name, m))
    return out


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _flatten_keeps_channels(prev: Optional[nn.Module]) -> bool:
    if isinstance(prev, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
        o = prev.output_size
        return o == 1 or tuple(o) == (1, 1) if not isinstance(o, int) else o == 1
    return False


@torch.no_grad()
def remove_channels(model: nn.Module, example_input: Optional[Tensor] = None, atol: float = 1e-5) -> nn.Module:
    r"""A physically smaller copy of ``model`` for inference, with every channel
    whose sparse-BN gate is exactly 0 removed (DS eq. 17: :math:`y_c = 0`).

    The model must run its leaf modules in registration order (``nn.Sequential``
    nets such as :class:`prunopt.train.models.SmallCNN`). For each conv → SparseBN
    → (ReLU, pooling, dropout)* → conv/linear chain, the producer conv loses the
    output channels, the consumer the input channels; every SparseBN becomes a
    plain ``BatchNorm2d`` (eval statistics, weight ``a``, bias ``a b``). A channel
    is kept where removal cannot be proven exact (no producing conv, no consumer,
    a non-zero-preserving module in between). With ``example_input`` the outputs
    of the copy are checked against the original (``RuntimeError`` on mismatch).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    was_training = model.training
    model.eval()
    new = copy.deepcopy(model)
    leaves = _leaves(new)
    for idx, (name, m) in enumerate(leaves):
        if not isinstance(m, SparseBatchNorm2d):
            continue
        a = m.gate().detach()
        keep = torch.nonzero(a != 0).flatten()
        producer = leaves[idx - 1][1] if idx > 0 else None
        consumer, ok, prev = None, True, m
        for _, nxt in leaves[idx + 1:]:
            if isinstance(nxt, _PASS):
                prev = nxt
                continue
            if isinstance(nxt, nn.Flatten) and _flatten_keeps_channels(prev):
                prev = nxt
                continue
            if (isinstance(nxt, nn.Conv2d) and nxt.groups == 1) or isinstance(nxt, nn.Linear):
                consumer = nxt
            ok = consumer is not None
            break
        removable = ok and isinstance(producer, nn.Conv2d) and producer.groups == 1 and keep.numel() < a.numel()
        if not removable:
            keep = torch.arange(a.numel(), device=a.device)
        elif keep.numel() == 0:
            keep = torch.zeros(1, dtype=torch.long, device=a.device)  # torch has no 0-channel conv; its output is 0
        bn = nn.BatchNorm2d(keep.numel(), eps=m.eps, momentum=m.momentum, affine=True,
                            track_running_stats=m.track_running_stats, device=a.device, dtype=a.dtype)
        if m.running_mean is not None:
            bn.running_mean.copy_(m.running_mean[keep])
            bn.running_var.copy_(m.running_var[keep])
            bn.num_batches_tracked.copy_(m.num_batches_tracked)
        bn.weight.copy_(a[keep])
        bn.bias.copy_(a[keep] * m.shift[keep])
        bn.eval()
        _set(new, name, bn)
        if removable:
            producer.weight = nn.Parameter(producer.weight[keep].clone())
            if producer.bias is not None:
                producer.bias = nn.Parameter(producer.bias[keep].clone())
            producer.out_channels = keep.numel()
            consumer.weight = nn.Parameter(consumer.weight[:, keep].clone())
            if isinstance(consumer, nn.Conv2d):
                consumer.in_channels = keep.numel()
            else:
                consumer.in_features = keep.numel()
    new.eval()
    if example_input is not None:
        ref, out = model(example_input), new(example_input)
        if ref.shape != out.shape or not torch.allclose(ref, out, atol=atol, rtol=1e-5):
            model.train(was_training)
            raise RuntimeError("remove_channels: the exported model does not reproduce the original outputs "
                               f"(max diff {(ref - out).abs().max().item() if ref.shape == out.shape else 'shape'}); "
                               "is the model's forward a sequential pass over its modules?")
    model.train(was_training)
    return new
