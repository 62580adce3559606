"""Differentiable sparsification layers (Lee).

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
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prunopt.nn._jit import script_unsupported
from prunopt.nn._swap import swap_modules
from prunopt.ops import sparse_gate
from prunopt.validation import check_bool, check_module, check_real, check_size

__all__ = [
    "SparseGate",
    "SparseBatchNorm2d",
    "SyncSparseBatchNorm2d",
    "convert_to_sparse_batchnorm",
    "convert_sync_batchnorm",
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


_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}


def _float_key(x: float, dtype: torch.dtype) -> int:
    """The rank of ``x`` rounded to ``dtype`` among that dtype's values: consecutive
    representable numbers have consecutive keys (ulp steps are integer steps)."""
    bits = int(torch.tensor(x, dtype=dtype).view(_INT_VIEW[dtype]).item())
    width = torch.finfo(dtype).bits
    sign = 1 << (width - 1)
    bits &= (1 << width) - 1
    return -(bits ^ sign) if bits & sign else bits


def _key_float(key: int, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`_float_key`: a 0-d tensor of ``dtype``."""
    width = torch.finfo(dtype).bits
    sign = 1 << (width - 1)
    bits = key if key >= 0 else (-key) | sign
    if bits & sign:  # as the signed integer of the same bits
        bits -= 1 << width
    return torch.tensor(bits, dtype=_INT_VIEW[dtype]).view(dtype)


def _solve_half_gates(n: int, dtype: torch.dtype, device) -> Tuple[Tensor, Tensor]:
    """``(a, beta)`` (0-d ``dtype`` tensors) such that the signed gates of
    ``alpha = [a] * n`` are exactly 0.5 when evaluated by :func:`sparse_gate` on
    ``device``, ``beta`` the nearest such value to the paper's; see
    :meth:`SparseGate.reset_parameters`. O(n) memory: one candidate is
    evaluated at a time (a few dozen evaluations at most)."""
    alpha = torch.empty(n, dtype=dtype, device=device)
    best = [math.inf, None, None]  # error, alpha key, beta key

    def status(a_key: int, key: int, cache: dict):
        """0: every gate 0.5; +1: gates above 0.5 (beta must grow); -1: below;
        None: mixed, or beta not finite."""
        if key not in cache:
            beta = _key_float(key, dtype)
            if not bool(torch.isfinite(beta)):
                cache[key] = None
                return None
            alpha.fill_(_key_float(a_key, dtype).item())
            out = sparse_gate(alpha, beta.to(device), rgf=False)
            lo, hi = out.min().item(), out.max().item()
            err = max(abs(lo - 0.5), abs(hi - 0.5))
            if err < best[0]:
                best[:] = [err, a_key, key]
            cache[key] = 0 if err == 0 else 1 if lo >= 0.5 else -1 if hi <= 0.5 else None
        return cache[key]

    paper_key = _float_key(_paper_beta(n), dtype)
    a0_key, half_key = _float_key(0.5 * (n + 1) / n, dtype), _float_key(0.5, dtype)
    for da in (0, 1, -1, 2, -2, 3, -3, 4, -4):
        a_key = a0_key + da
        if a_key <= half_key:  # a <= 0.5 leaves no positive threshold
            continue
        cache: dict = {}
        st = status(a_key, paper_key, cache)
        if st == 0:
            return _key_float(a_key, dtype), _key_float(paper_key, dtype)
        # the solution of a - s n a = 0.5 with the exact sum n a (the op sums in
        # double, exact for n < 2^29 below float64), then beyond it until the
        # status changes: the gates fall as beta grows, so the values giving
        # exactly 0.5 are one run of keys, found nearest the paper's by bisection
        af = _key_float(a_key, dtype).item()
        sol = (af - 0.5) / (n * af)
        far = _float_key(math.log(sol) - math.log1p(-sol), dtype)
        if st is None:
            if status(a_key, far, cache) == 0:
                return _key_float(a_key, dtype), _key_float(far, dtype)
            continue
        step = 1
        while status(a_key, far, cache) == st and step < 1 << 62:
            far, step = far + st * step, step * 2
        lo, hi = paper_key, far  # status(lo) == st != status(hi)
        while abs(hi - lo) > 1:
            mid = (lo + hi) // 2
            if status(a_key, mid, cache) == st:
                lo = mid
            else:
                hi = mid
        if status(a_key, hi, cache) == 0:
            return _key_float(a_key, dtype), _key_float(hi, dtype)
    _, a_key, key = best  # no exact pair: the nearest (the paper's if none is finite)
    if a_key is None:
        return torch.tensor(0.5 * (n + 1) / n, dtype=dtype), torch.tensor(_paper_beta(n), dtype=dtype)
    return _key_float(a_key, dtype), _key_float(key, dtype)


def _whole(t: Tensor) -> Tensor:
    """``t.full_tensor()`` for a DTensor (differentiable: each shard gets its
    block of the gradient), else ``t``."""
    from prunopt.distributed import is_distributed_tensor

    return t.full_tensor() if is_distributed_tensor(t) else t


class SparseGate(nn.Module):
    r"""Gates :math:`a \in \mathbb{R}^n` of one competition group (DS eq. 9-12).

    signed (default, eq. 12):
    :math:`a_i = \mathrm{sign}(\alpha_i)(|\alpha_i| - \sigma(\beta)\|\alpha\|_1)_+`,
    initialised with the paper's :math:`\alpha_i = 0.5 (n+1)/n`,
    :math:`\beta = -\log(n^2+n-1)`, for which every gate is 0.5; the stored pair
    is the one nearest these values (``alpha`` within 4 ulps, ``beta`` as
    needed) for which this module's forward gives every gate exactly 0.5 in
    the parameters' dtype on the device they had at construction (see
    :meth:`reset_parameters`; after ``.to()`` another dtype or device, call it
    again to re-solve).

    non-negative (``signed=False``, eq. 9-11): :math:`\gamma = e^\alpha`,
    :math:`a = (\gamma - \sigma(\beta)\|\gamma\|_1)_+ / \sum(\cdot)`. These gates
    sum to 1, so with :math:`\alpha = 0` (same :math:`\beta`) they start equal,
    at :math:`1/n` up to a few ulps of rounding.

    ``rgf=True`` uses the elu(``rgf_alpha``) surrogate gradient of eq. 15 so
    that dropped components keep learning. Calling the module returns ``a``.

    Called outside an FSDP2 forward, where ``alpha`` is a DTensor shard (a
    regulariser, :func:`gate_density`), the gate gathers ``alpha`` whole
    (``full_tensor``, one value per gate; differentiable) and returns a plain
    tensor, the same on every rank. ``beta`` is 0-dim, which ``fully_shard``
    does not shard: leave it out (``ignored_params``) and average its
    gradient over the ranks, as ``prunopt train --fsdp`` does.
    """

    __prepare_scriptable__ = script_unsupported  # torch.jit.script: a clear error (prunopt.nn._jit)

    def __init__(self, num_gates: int, signed: bool = True, rgf: bool = True, rgf_alpha: float = 0.1,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        if isinstance(num_gates, bool) or not isinstance(num_gates, int):
            raise TypeError(f"num_gates must be an int, got {type(num_gates).__name__}")
        if num_gates < 1:
            raise ValueError(f"num_gates must be >= 1 (an empty group has no gates), got {num_gates}")
        check_size(num_gates, "num_gates")
        if not isinstance(signed, bool) or not isinstance(rgf, bool):
            raise TypeError("signed and rgf must be bools")
        if isinstance(rgf_alpha, bool) or not isinstance(rgf_alpha, (int, float)):
            raise ValueError(f"rgf_alpha must be a finite number >= 0, got {rgf_alpha!r}")
        rgf_alpha = check_real(rgf_alpha, "rgf_alpha", 0.0)
        self.num_gates, self.signed, self.rgf, self.rgf_alpha = num_gates, signed, rgf, float(rgf_alpha)
        dtype = dtype or torch.get_default_dtype()
        self.alpha = nn.Parameter(torch.zeros(num_gates, dtype=dtype, device=device))
        self.beta = nn.Parameter(torch.zeros((), dtype=dtype, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The paper's initialisation, solved so that the gates are exactly 0.5.

        Non-negative gates: ``alpha = 0``, ``beta = -log(n^2+n-1)`` (gates 1/n up
        to rounding). Signed gates: every ``alpha_i`` is one value ``a`` and the
        gates are ``a - sigma(beta) n a`` after the op's own rounding, so the pair
        is chosen by evaluating the gates (this module's forward, on the
        parameters' device and dtype; memory ``2n`` values, a few evaluations):
        ``a`` is the paper's ``0.5 (n+1)/n`` rounded to the dtype (or, when no
        ``beta`` works for it, the next value above or below, at most 4 ulps
        away and always ``> 0.5``); ``beta`` is the value of the dtype nearest
        the paper's ``-log(n^2+n-1)`` for which every gate equals 0.5, found by
        bisection between the paper's value and the solution of
        ``a - sigma(beta) n a = 0.5`` (they differ because ``a`` is rounded: by
        up to a few units in float16/bfloat16 at large ``n``). If no such pair
        exists, the pair whose gates are nearest 0.5 is kept: with the compiled
        op none was missing for any tested ``n`` up to 10^6 in float16,
        bfloat16, float32 and float64; the pure-PyTorch fallback (no extension)
        computes in the dtype, where float16 cannot hold the threshold from
        ``n`` about 10^5.
        """
        n = self.num_gates
        if not self.signed:
            self.alpha.zero_()
            self.beta.fill_(_paper_beta(n))
            return
        if self.alpha.device.type == "meta":  # no data to evaluate: the paper's values
            self.alpha.fill_(0.5 * (n + 1) / n)
            self.beta.fill_(_paper_beta(n))
            return
        a, b = _solve_half_gates(n, self.alpha.dtype, self.alpha.device)
        self.alpha.fill_(a.item())
        self.beta.fill_(b.item())

    def forward(self) -> Tensor:
        alpha, beta = self.alpha, self.beta
        # Outside an FSDP2 forward the parameters are DTensor shards: every gate depends on the
        # whole ||alpha||_1, so the (one value per channel) vector is gathered, differentiably
        alpha = _whole(alpha)
        beta = _whole(beta)
        return sparse_gate(alpha, beta, signed=self.signed, rgf=self.rgf, rgf_alpha=self.rgf_alpha)

    def extra_repr(self) -> str:
        return f"{self.num_gates}, signed={self.signed}, rgf={self.rgf}"


_NO_AFFINE = (
    "{cls} has no affine weight or bias: its scale is the sparse gate (.gate, eq. 12) and its shift "
    ".shift (eq. 17). Code that rebuilds a batch norm from weight and bias would drop them: "
    "nn.SyncBatchNorm.convert_sync_batchnorm (use prunopt.nn.convert_sync_batchnorm, which gives a "
    "SyncSparseBatchNorm2d), or conv-BN fusion (use prunopt.nn.remove_channels, whose plain BatchNorm2d has them)"
)


class SparseBatchNorm2d(nn.BatchNorm2d):
    r"""Sparse batch normalisation (DS eq. 17), a drop-in for ``nn.BatchNorm2d``:

    .. math:: y_c = a_c\,(\hat x_c + b_c),\qquad \hat x_c = \frac{x_c - \mu_c}{\sqrt{\sigma_c^2 + \epsilon}}

    with :math:`a` a :class:`SparseGate` over the channels (eq. 12) and a learnt
    shift ``b`` (``self.shift``). A zero gate makes the channel's output exactly
    0, so it can be removed (:func:`remove_channels`). With :math:`a = 1` this is
    ``BatchNorm2d`` with weight 1 and bias ``b``. Running statistics behave as in
    ``BatchNorm2d``; ``affine`` is not accepted (the gate is the affine part).

    The module has no ``weight`` or ``bias`` attribute (``affine`` is False):
    reading them is an ``AttributeError`` that says where the scale and shift
    are, so code that rebuilds a batch norm from them fails instead of silently
    dropping the gates. ``nn.SyncBatchNorm.convert_sync_batchnorm`` is such
    code: use :func:`convert_sync_batchnorm`, which turns this layer into a
    :class:`SyncSparseBatchNorm2d`.
    """

    __prepare_scriptable__ = script_unsupported  # torch.jit.script: a clear error (prunopt.nn._jit)

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 track_running_stats: bool = True, signed: bool = True, rgf: bool = True, rgf_alpha: float = 0.1,
                 device=None, dtype=None):
        # (checked before BatchNorm2d allocates its statistics)
        check_size(num_features, "num_features")
        check_bool(track_running_stats, "track_running_stats")
        super().__init__(num_features, eps=eps, momentum=momentum, affine=False,
                         track_running_stats=track_running_stats, device=device, dtype=dtype)
        # no weight/bias entries at all (affine=False registers them as None): see __getattr__
        del self._parameters["weight"], self._parameters["bias"]
        self.gate = SparseGate(num_features, signed=signed, rgf=rgf, rgf_alpha=rgf_alpha, dtype=dtype, device=device)
        self.shift = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype or torch.get_default_dtype()))

    def reset_parameters(self) -> None:
        """Running statistics as in ``BatchNorm2d``, the gate at the paper's
        initialisation (every gate 0.5, :meth:`SparseGate.reset_parameters`)
        and the shift ``b`` at 0."""
        super().reset_parameters()  # the running statistics (no affine part)
        if "gate" in self._modules:  # BatchNorm2d.__init__ calls this before gate and shift exist
            self.gate.reset_parameters()
            with torch.no_grad():
                self.shift.zero_()

    def __getattr__(self, name: str):
        if name in ("weight", "bias"):
            raise AttributeError(_NO_AFFINE.format(cls=type(self).__name__))
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"track_running_stats={self.track_running_stats}")

    def _normalize(self, x: Tensor) -> Tensor:
        """``x_hat`` with the statistics of ``BatchNorm2d`` (batch statistics in
        training, running ones in eval; the running ones updated as there)."""
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        return F.batch_norm(x, self.running_mean if track else None, self.running_var if track else None,
                            None, None, batch_stats, factor, self.eps)

    def forward(self, x: Tensor) -> Tensor:
        xhat = self._normalize(x)
        a = self.gate()
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return a.view(shape) * (xhat + self.shift.view(shape))

    def gates(self) -> Tensor:
        """The current gate vector a (eq. 12)."""
        return self.gate()


def _sync_group(process_group):
    """The group to synchronise over (``None`` -> the default group), or
    ``None`` when there is no other process to synchronise with."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


class SyncSparseBatchNorm2d(SparseBatchNorm2d):
    r""":class:`SparseBatchNorm2d` whose training statistics are those of the
    batch over all processes of ``process_group`` (default: the default
    group), as ``nn.SyncBatchNorm`` does for ``BatchNorm2d``, on every device
    and backend (CPU with gloo included):

    .. math:: \mu_c = \frac{1}{n}\sum_{r,i} x_{r,i,c}, \qquad
              \sigma_c^2 = \frac{1}{n}\sum_{r,i} (x_{r,i,c} - \mu_c)^2

    over the ``n`` values of channel ``c`` on all ranks ``r``; the running
    statistics are updated with these (the variance unbiased, ``n / (n - 1)``),
    so they are the same on every rank and equal to those of one process on the
    concatenated batch. Two differentiable ``all_reduce`` calls per forward in
    training (per-channel sums and count in float64, then the per-channel sums
    of squared deviations: ``8 (C + 1)`` and ``8 C`` bytes), two more in
    backward; in eval mode, or without an initialised process group of more
    than one process, it is exactly :class:`SparseBatchNorm2d`. Gradients are
    those of the sum of all ranks' losses, as with ``nn.SyncBatchNorm``.

    Build it with :func:`convert_sync_batchnorm` (or
    :func:`convert_to_sparse_batchnorm` of a model with ``nn.SyncBatchNorm``).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 track_running_stats: bool = True, signed: bool = True, rgf: bool = True, rgf_alpha: float = 0.1,
                 process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps=eps, momentum=momentum, track_running_stats=track_running_stats,
                         signed=signed, rgf=rgf, rgf_alpha=rgf_alpha, device=device, dtype=dtype)
        self.process_group = process_group

    def _normalize(self, x: Tensor) -> Tensor:
        group = _sync_group(self.process_group) if self.training else None
        if group is None:
            return super()._normalize(x)
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return _sync_batch_norm(x, self.running_mean if self.track_running_stats else None,
                                self.running_var if self.track_running_stats else None, factor, self.eps, group)


def _sync_batch_norm(x: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor], factor: float,
                     eps: float, group) -> Tensor:
    """``(x - mu) / sqrt(var + eps)`` with the per-channel mean and (biased)
    variance of ``x`` over every rank of ``group``, in two passes (the mean,
    then the squared deviations from it: no cancellation), through the
    differentiable ``torch.distributed.nn.functional.all_reduce``."""
    from torch.distributed.nn.functional import all_reduce

    c = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    shape = (1, c) + (1,) * (x.dim() - 2)
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    count = torch.tensor([x.numel() // max(c, 1)], dtype=torch.float64, device=x.device)
    totals = all_reduce(torch.cat([xa.sum(dims).double(), count]), group=group)
    n = totals[-1].detach()
    mean = (totals[:-1] / n).to(acc)
    dev = xa - mean.view(shape)
    m2 = all_reduce((dev * dev).sum(dims).double(), group=group)
    var = (m2 / n).to(acc)
    if running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1.0 - factor).add_(mean.detach().to(running_mean.dtype), alpha=factor)
            unbiased = (m2.detach() / (n - 1).clamp_min(1)).to(running_var.dtype)
            running_var.mul_(1.0 - factor).add_(unbiased, alpha=factor)
    return (dev * torch.rsqrt(var + eps).view(shape)).to(x.dtype)


@torch.no_grad()
def _load_from_batchnorm(sbn: SparseBatchNorm2d, bn: nn.BatchNorm2d, preserve: bool) -> None:
    if bn.track_running_stats and bn.running_mean is not None:
        sbn.running_mean.copy_(bn.running_mean)
        sbn.running_var.copy_(bn.running_var)
        sbn.num_batches_tracked.copy_(bn.num_batches_tracked)
    if not preserve:
        return
    n = bn.num_features
    if bn.affine:
        w, b = bn.weight.detach().double(), bn.bias.detach().double()
    else:  # y = x_hat: a = 1, b = 0
        w = torch.ones(n, dtype=torch.float64, device=sbn.gate.alpha.device)
        b = torch.zeros_like(w)
    s0 = 1.0 / (n * n + n)  # the paper's initial threshold fraction
    # a_i = sign(w_i)(|alpha_i| - s0 L) = w_i with |alpha_i| = |w_i| + s0 L for the m
    # non-zero weights (alpha_i = 0 where w_i = 0), so L = ||alpha||_1 = ||w||_1 + m s0 L,
    # i.e. L = ||w||_1 / (1 - m s0)  (m <= n, so 1 - m s0 >= n / (n + 1) > 0)
    nz = w != 0
    m = int(nz.sum())
    L = w.abs().sum() / (1 - m * s0)
    alpha = torch.where(nz, torch.sign(w) * (w.abs() + s0 * L), torch.zeros_like(w))
    sbn.gate.alpha.copy_(alpha)
    sbn.gate.beta.fill_(math.log(s0 / (1 - s0)))
    sbn.shift.copy_(torch.where(nz, b / torch.where(nz, w, torch.ones_like(w)), torch.zeros_like(b)))


def convert_to_sparse_batchnorm(model: nn.Module, preserve: bool = True, signed: bool = True, rgf: bool = True,
                                rgf_alpha: float = 0.1) -> nn.Module:
    r"""Replaces every ``nn.BatchNorm2d`` of ``model`` (in place) by a
    :class:`SparseBatchNorm2d`, and every ``nn.SyncBatchNorm`` by a
    :class:`SyncSparseBatchNorm2d` with its ``process_group`` (it then expects
    4-d input, as ``SparseBatchNorm2d`` does), and returns ``model``; when
    ``model`` itself is one of them, returns its replacement (``model`` is left
    as it is, as ``nn.SyncBatchNorm.convert_sync_batchnorm`` does), so use the
    return value. A batch norm registered under several names gets one replacement.
    Each replacement takes the dtype and device of its BatchNorm2d's tensors; one
    that holds none (``affine=False, track_running_stats=False``) takes those of
    the first floating-point parameter or buffer of ``model``, or the defaults
    (``torch.get_default_dtype()``, default device) when ``model`` has none.

    ``preserve=True`` keeps the function of a trained model: running statistics
    are copied and the gate is solved for :math:`a = w` (the BN weight) at the
    paper's initial threshold :math:`\sigma(\beta) = 1/(n^2+n)`, with
    :math:`b = \mathrm{bias}/w` (channels with :math:`w = 0` become zero gates and
    lose their constant bias); a BatchNorm2d with ``affine=False`` gets
    :math:`a = 1`, :math:`b = 0`. ``preserve=False`` uses the paper's
    initialisation (every gate 0.5) with statistics copied.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    preserve, signed, rgf = check_bool(preserve, "preserve"), check_bool(signed, "signed"), check_bool(rgf, "rgf")
    if isinstance(rgf_alpha, bool) or not isinstance(rgf_alpha, (int, float)):
        raise ValueError(f"rgf_alpha must be a finite number >= 0, got {rgf_alpha!r}")
    check_real(rgf_alpha, "rgf_alpha", 0.0)
    if signed is False and preserve:
        raise ValueError("preserve=True needs signed gates (non-negative gates sum to 1 and cannot equal BN weights)")

    # a BatchNorm2d without tensors follows the model's (a neighbouring) tensors
    neighbour = next((t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()), None)

    def convert(child: nn.Module) -> "SparseBatchNorm2d":
        p = child.running_mean if child.running_mean is not None else child.weight
        p = p if p is not None else neighbour
        options = dict(eps=child.eps, momentum=child.momentum, track_running_stats=child.track_running_stats,
                       signed=signed, rgf=rgf, rgf_alpha=rgf_alpha, device=p.device if p is not None else None,
                       dtype=p.dtype if p is not None else None)
        if isinstance(child, nn.SyncBatchNorm):
            sbn = SyncSparseBatchNorm2d(child.num_features, process_group=child.process_group, **options)
        else:
            sbn = SparseBatchNorm2d(child.num_features, **options)
        _load_from_batchnorm(sbn, child, preserve)
        sbn.train(child.training)
        return sbn

    def is_target(m: nn.Module) -> bool:
        return isinstance(m, (nn.BatchNorm2d, nn.SyncBatchNorm)) and not isinstance(m, SparseBatchNorm2d)

    # build every replacement first (a BatchNorm2d under several names gets one
    # SparseBatchNorm2d, so the tying is kept), then swap them in
    new: Dict[int, nn.Module] = {}
    for m in model.modules():
        if is_target(m) and id(m) not in new:
            new[id(m)] = convert(m)
    return swap_modules(model, new)


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    r"""``nn.SyncBatchNorm.convert_sync_batchnorm`` that keeps sparse batch norms:
    every :class:`SparseBatchNorm2d` becomes a :class:`SyncSparseBatchNorm2d`
    (same gate, shift and running statistics, the very same tensors), every
    other ``BatchNorm*d`` an ``nn.SyncBatchNorm`` (torch's conversion);
    existing synchronised layers are kept. Returns ``module`` (converted in
    place), or the replacement when ``module`` itself is a batch norm, as
    torch's function does; a layer registered under several names gets one
    replacement.

    torch's own function cannot keep the gates (it rebuilds every batch norm
    from ``weight`` and ``bias``); on a model with a ``SparseBatchNorm2d`` it
    raises an ``AttributeError`` naming this function. Note that
    ``nn.SyncBatchNorm`` itself supports only accelerator inputs in training
    (a ``ValueError`` on CPU), while ``SyncSparseBatchNorm2d`` synchronises on
    any device and backend.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    new: Dict[int, nn.Module] = {}
    for m in module.modules():
        if id(m) in new or isinstance(m, (SyncSparseBatchNorm2d, nn.SyncBatchNorm)):
            continue
        if isinstance(m, SparseBatchNorm2d):
            new[id(m)] = _to_sync_sparse(m, process_group)
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            new[id(m)] = nn.SyncBatchNorm.convert_sync_batchnorm(m, process_group)
    return swap_modules(module, new)


def _to_sync_sparse(m: SparseBatchNorm2d, process_group) -> SyncSparseBatchNorm2d:
    """A :class:`SyncSparseBatchNorm2d` holding ``m``'s gate, shift and buffers
    (the same tensors, so optimizers and references stay valid)."""
    sync = SyncSparseBatchNorm2d(m.num_features, eps=m.eps, momentum=m.momentum,
                                 track_running_stats=m.track_running_stats, signed=m.gate.signed, rgf=m.gate.rgf,
                                 rgf_alpha=m.gate.rgf_alpha, process_group=process_group, device="meta",
                                 dtype=m.shift.dtype)
    sync.gate = m.gate
    sync.shift = m.shift
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        setattr(sync, name, getattr(m, name))
    sync.train(m.training)
    return sync


def sparse_gates(model: nn.Module) -> List[Tensor]:
    """The gate vectors of every :class:`SparseGate` in ``model`` (differentiable)."""
    check_module(model, "model")
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
    if any(g.numel() == 0 for g in gs):
        raise ValueError("l1_regularizer: empty group (a tensor of gates has 0 entries)")
    return sum(g.abs().sum() for g in gs)


def _safe_l2(v: Tensor, dim: int = -1) -> Tensor:
    # ||v||_2 whose gradient at v = 0 is 0 instead of NaN (the paper's safe_l2_norm);
    # only exact zeros take the safe branch, so a NaN entry gives a NaN norm
    sq = (v * v).sum(dim)
    zero = sq == 0
    return torch.where(zero, torch.zeros_like(sq), torch.sqrt(torch.where(zero, torch.ones_like(sq), sq)))


def _safe_pow(x: Tensor, p: float) -> Tensor:
    # x ** p for x >= 0 (or NaN) with value and gradient 0 at exact zeros (x ** p has an
    # infinite slope there for p < 1); NaN stays NaN
    zero = x == 0
    return torch.where(zero, torch.zeros_like(x), torch.where(zero, torch.ones_like(x), x) ** p)


def group_l21_regularizer(gates: TensorOrList, group_size: Optional[int] = None) -> Tensor:
    r""":math:`\sum_g \|a_g\|_2` (DS eq. 4): removes whole groups together.

    Each tensor is split along its last dimension into consecutive groups of
    ``group_size`` gates. The default ``group_size`` is the length of the last
    dimension: a 1-D tensor is one group, and each row of a 2-D tensor (each
    slice ``g[..., :]`` of a tensor ``(..., n)``) is its own group; a 0-d
    tensor is one group of one gate. A list holds tensors grouped separately.
    The norm's gradient is 0, not NaN, at a zero group; a NaN gate gives a NaN
    result (as ``torch.linalg.vector_norm``).
    """
    gs = _as_list(gates)
    if not gs:
        raise ValueError("gates is empty")
    total = 0
    for g in gs:
        n = g.shape[-1] if g.dim() else 1
        if g.numel() == 0:
            raise ValueError("group_l21_regularizer: empty group (a tensor of gates has 0 entries)")
        size = n if group_size is None else group_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"group_size must be a positive int (an empty group is not allowed), got {group_size!r}")
        if n % size:
            raise ValueError(f"group_size {size} does not divide the number of gates {n}")
        total = total + _safe_l2(g.reshape(*g.shape[:-1], n // size, size) if g.dim() else g.reshape(1, 1)).sum()
    return total


def lp_regularizer(gates: TensorOrList, p: float = 0.5) -> Tensor:
    r""":math:`(\sum_i |a_i|^p)^{1/p}` with :math:`0 < p < 1` (DS eq. 14), summed
    over the tensors (each tensor, whatever its shape, is one group; for
    normalised non-negative gates the l1 norm is constant, so p < 1 is needed).
    The gradient is 0 at zero gates and at an all-zero group; a NaN gate gives a
    NaN result."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise ValueError(f"p must be a finite number in (0, 1), got {p!r}")
    p = check_real(p, "p")  # (finite; an int beyond the float range is a ValueError)
    if not 0.0 < p < 1.0:
        raise ValueError(f"lp_regularizer needs 0 < p < 1 (p >= 1 is not the sparsifying lp of eq. 14), got p={p}")
    gs = _as_list(gates)
    if not gs:
        raise ValueError("gates is empty")
    total = 0
    for g in gs:
        if g.numel() == 0:
            raise ValueError("lp_regularizer: empty group (a tensor of gates has 0 entries)")
        total = total + _safe_pow(_safe_pow(g.abs(), p).sum(), 1.0 / p)
    return total


def cubic_strength(t: float, lam_i: float, lam_f: float, t0: float, n: float) -> float:
    r"""Gradual regularisation strength (DS appendix eq. 1):

    .. math:: \lambda_t = \lambda_f + (\lambda_i - \lambda_f)\left(1 - \frac{t - t_0}{n}\right)^3

    for :math:`t_0 \le t \le t_0 + n`, :math:`\lambda_i` before and :math:`\lambda_f` after."""
    for name, v in (("t", t), ("lam_i", lam_i), ("lam_f", lam_f), ("t0", t0), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
        check_real(v, name)
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
def _to_plain_bn(m: nn.Module, keep: Optional[Tensor]) -> nn.BatchNorm2d:
    """Inference BatchNorm2d equal to the sparse BN ``m`` (weight a, bias a b), restricted to ``keep``."""
    a = m.gate().detach()
    keep = torch.arange(a.numel(), device=a.device) if keep is None else keep.to(a.device)
    bn = nn.BatchNorm2d(keep.numel(), eps=m.eps, momentum=m.momentum, affine=True,
                        track_running_stats=m.track_running_stats, device=a.device, dtype=a.dtype)
    if m.running_mean is not None:
        bn.running_mean.copy_(m.running_mean[keep])
        bn.running_var.copy_(m.running_var[keep])
        bn.num_batches_tracked.copy_(m.num_batches_tracked)
    bn.weight.copy_(a[keep])
    bn.bias.copy_(a[keep] * m.shift[keep])
    return bn.eval()


@torch.no_grad()
def remove_channels(model: nn.Module, example_input=None, atol: float = 1e-5) -> nn.Module:
    r"""A physically smaller copy of ``model`` for inference, with every channel
    that a zero sparse-BN gate makes exactly 0 removed (DS eq. 17: :math:`y_c = a_c(\hat x_c + b_c) = 0`).

    The channels are followed through the model's traced graph
    (:mod:`prunopt.nn.channel_graph`, the dependency graph of Torch-Pruning):
    ``torch.export`` on ``example_input`` when it is given (any exportable
    model, e.g. transformers' ResNet and MobileNetV2, which return a
    ``ModelOutput``), else ``torch.fx.symbolic_trace``. Channels joined by
    residual additions, products, concatenations, depthwise convolutions,
    BatchNorm, activations, pooling and flatten are removed together, and a
    group goes only when every convolution or linear layer that reads it sees
    an exact zero there: in a residual stream a channel is removed only if it
    is zero in **every** branch that adds into it. A convolution or linear
    layer loses the output channels it would write only as zeros (weights and
    bias zero), its readers the matching input channels; a feature map keeps
    at least one channel (torch has no 0-channel convolution).

    Channels stay where removal cannot be proven exact: the model's inputs and
    outputs, grouped (not depthwise) convolutions, constants combined with the
    channels. Where an operation the analysis does not know is all that keeps
    a zero channel, or the model cannot be traced, ``ChannelGraphError`` (a
    ``RuntimeError``) names the module; a layer that would lose channels while
    its tensors are parametrized (a ``Masker``'s masks) is one too.

    Every SparseBN becomes a plain ``BatchNorm2d`` (eval statistics, weight
    ``a``, bias ``a b``). With ``example_input`` (a tensor or a tuple of
    positional inputs) the outputs of the copy are checked against the
    original (``RuntimeError`` on mismatch), both in eval mode. ``model`` is not
    changed: every module's own ``training`` flag is restored, also on error.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if example_input is not None and not isinstance(example_input, (Tensor, tuple)):
        raise TypeError(f"example_input must be a Tensor or a tuple of inputs, got {type(example_input).__name__}")
    atol = check_real(atol, "atol", 0.0)
    modes = [(m, m.training) for m in model.modules()]  # each module's own flag, restored at the end
    model.eval()
    try:
        return _remove_channels(model, example_input, atol)
    finally:
        for m, training in modes:
            m.training = training


def _remove_channels(model: nn.Module, example_input, atol: float) -> nn.Module:
    from torch.utils._pytree import tree_leaves

    from prunopt.nn.channel_graph import ChannelGraph, shrink_layers

    new = copy.deepcopy(model)
    bns = shrink_layers(ChannelGraph(new, example_input))
    plain: Dict[int, nn.Module] = {}
    for m, keep in bns.values():
        if isinstance(m, SparseBatchNorm2d):
            plain[id(m)] = _to_plain_bn(m, keep)
    for m in new.modules():
        if isinstance(m, SparseBatchNorm2d) and id(m) not in plain:
            plain[id(m)] = _to_plain_bn(m, None)
    new = swap_modules(new, plain)
    new.eval()
    if example_input is not None:
        args = example_input if isinstance(example_input, tuple) else (example_input,)
        ref = tree_leaves(model(*args))
        try:
            out = tree_leaves(new(*args))
        except RuntimeError as e:
            raise RuntimeError(f"remove_channels: the exported model does not run on example_input ({e})") from e
        for r, o in zip(ref, out):
            if isinstance(r, Tensor) and (not isinstance(o, Tensor) or r.shape != o.shape or
                                          not torch.allclose(r, o, atol=atol, rtol=1e-5)):
                diff = (r - o).abs().max().item() if isinstance(o, Tensor) and r.shape == o.shape else "shape"
                raise RuntimeError("remove_channels: the exported model does not reproduce the original outputs "
                                   f"(max diff {diff})")
        if len(ref) != len(out):
            raise RuntimeError("remove_channels: the exported model returns another number of outputs")
    return new
