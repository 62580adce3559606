"""Reference prunAdag step, top-T threshold and Frank-Wolfe LMO (Porcelli et al.;
Porcelli, Seraghiti, Toint, "prunAdag", Algorithm 2.1).

Written for reading, not for speed: the relevant set is found with
``torch.kthvalue`` on the concatenated ``|g|`` and every set of the algorithm is
a boolean tensor. The element arithmetic is done in the parameter's dtype, in
the same order as the fused kernels (so float32 results agree to rounding);
the two norms of the ratio ``r`` are reduced in float64.

One *selection scope* is a list of tensors that share the relevant set ``R``
(one global top-T) and the ratio ``r``. Per tensor, a :class:`TensorHyper` holds
the hyper-parameters of its param group and its step counter ``k``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "TensorHyper",
    "VERSIONS",
    "resolve_relevant",
    "step_lr",
    "topk_threshold_reference",
    "topk_bracket_reference",
    "topk_slice_reference",
    "prunadag_slice_reference",
    "effective_grad",
    "prunadag_norms_reference",
    "prunadag_bracket_reference",
    "prunadag_step_reference",
    "support_norm_lmo_reference",
]

#: Accepted values of ``version``: Table 1's four rules and the paper's
#: "Relevant only" ablation (section 3.1.1, ``O = R``).
VERSIONS = (1, 2, 3, 4, "relevant_only")


def step_lr(lr, lr_decay, k):
    """``lr_k = lr / (1 + k * lr_decay)`` (Algorithm 2.1 step 1, Porcelli et al.), for floats or
    tensors alike."""
    return lr / (1.0 + k * lr_decay)


@dataclass
class TensorHyper:
    """Hyper-parameters of one tensor's param group and its step counter ``k``
    (0 on the first step). ``lr`` may be a one-element tensor (a tensor
    learning rate, as ``torch.optim`` accepts); ``lr_k`` is then a tensor."""

    lr: float
    k: float = 0.0
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    eps: float = 1e-10
    maximize: bool = False
    prune: bool = True

    @property
    def lr_k(self) -> float:
        """``lr_k = lr / (1 + k * lr_decay)`` (Algorithm 2.1 step 1, Porcelli et al.)."""
        return step_lr(self.lr, self.lr_decay, self.k)


def resolve_relevant(relevant, n: int, name: str = "relevant") -> int:
    """The target ``T`` of eq. 2.6: ``relevant`` itself if it is an int
    (``1 <= T <= n``), ``ceil(relevant * n)`` if it is a float in ``(0, 1]``.

    The product is taken exactly from the float ``relevant`` (integer
    arithmetic), and a value within ``n * 2**-50`` above an integer (float
    noise: ``0.07`` is stored as ``0.07000000000000000666...``, so the float
    product ``0.07 * 100`` is ``7.000000000000001``) counts as that integer:
    ``relevant=0.07, n=100`` gives 7, not 8, as :func:`prunopt.pruning.kept_count`
    does for its floor. A real excess (e.g. ``0.5`` of ``2_000_000_001``) still
    rounds up."""
    if isinstance(relevant, bool) or not isinstance(relevant, (int, float)):
        raise TypeError(f"{name} must be an int >= 1 or a float in (0, 1], got {type(relevant).__name__}")
    if isinstance(relevant, int):
        if relevant < 1:
            raise ValueError(f"{name} must be >= 1 when it is an int, got {relevant}")
        if relevant > n:
            raise ValueError(f"{name}={relevant} exceeds the number of elements that take part (n={n})")
        return relevant
    if not (0.0 < relevant <= 1.0) or math.isnan(relevant):
        raise ValueError(f"{name} must be in (0, 1] when it is a float, got {relevant}")
    if n <= 0:
        return 0
    num, den = float(relevant).as_integer_ratio()  # relevant = num / den exactly, den a power of two
    # ceil((num n - n den 2^-50) / den), all in integers
    t = -((n * den - num * n * (1 << 50)) // (den << 50))
    return max(1, min(n, t))


def topk_threshold_reference(values: Sequence[Tensor], k: int) -> Tensor:
    """``tau`` = the ``k``-th largest ``|v|`` over all tensors (eq. 2.6): the value
    ``torch.kthvalue`` gives on the concatenation at rank ``n - k + 1``."""
    flat = torch.cat([v.detach().reshape(-1).abs() for v in values])
    n = flat.numel()
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    return torch.kthvalue(flat, n - k + 1).values


def topk_bracket_reference(values: Sequence[Tensor], lo: float, hi: float) -> Tuple[Tensor, Tensor]:
    """For a bracket ``[lo, hi]`` of a top-k threshold: the number of ``|v| > hi``
    (int64, 0-dim) and the candidates ``|v|`` with ``lo <= |v| <= hi`` in index
    order over the concatenation (the oracle of the ``topk_bracket`` op)."""
    flat = torch.cat([v.detach().reshape(-1) for v in values]).abs()
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("values contain a non-finite value")
    return (flat > hi).sum().to(torch.int64), flat[(flat >= lo) & (flat <= hi)]


# topk_slice's fixed sample: about (6 n)^(2/3) values within [min, max], in
# blocks of `block` contiguous values at a fixed stride (``sample = (min, max,
# block)``, by default the sharded selects' (2^15, 2^20, 128)); the bracket
# spans the sample's order statistics 5 binomial standard deviations (plus 8
# ranks) either side of the share.
SLICE_SAMPLE = (1 << 15, 1 << 20, 128)
_SLICE_SAMPLE_SCALE, _SLICE_SAMPLE_SIGMAS = 6.0, 5.0
_SLICE_FORMATS = {torch.float32: (torch.int32, 0x7F7FFFFF), torch.float64: (torch.int64, 0x7FEFFFFFFFFFFFFF)}


def _slice_sample_views(flat: List[Tensor], n: int, sample: Sequence[int]) -> List[Tensor]:
    """Views of topk_slice's fixed sample of the flat tensors ``flat`` (``n``
    values in all; the tensors themselves when they are few), one per tensor."""
    lo, hi, block = sample
    size = min(max(int((_SLICE_SAMPLE_SCALE * n) ** (2 / 3)), lo), hi)
    if n <= size:
        return list(flat)
    every = n // size  # one block (or one value) in `every`
    views = []
    for v in flat:
        nb = v.numel() // block
        if nb >= every:
            views.append(v[:nb * block].view(nb, block)[every // 2::every].reshape(-1))
        else:
            views.append(v[every // 2::every])
    return views


def _slice_sample(flat: List[Tensor], n: int, sample: Sequence[int]) -> Tensor:
    """``|v|`` of topk_slice's fixed sample of the flat tensors ``flat``."""
    return torch.cat(_slice_sample_views(flat, n, sample)).abs()


def _slice_bracket(sample: Tensor, share: int, n: int, spread: int, kth=None) -> Tuple[float, float]:
    """``(lo, hi)`` from the sample's order statistics around the share (all
    values: exact), at least ``spread`` values either side; ``(0, inf)`` from
    an empty or non-finite sample."""
    ns = sample.numel()
    if ns == 0 or not bool(torch.isfinite(sample).all()):
        return 0.0, math.inf
    q = share / n
    p = q * ns
    margin = 0.0 if ns == n else _SLICE_SAMPLE_SIGMAS * math.sqrt(max(p * (1 - q), 1.0)) + 8
    margin = max(margin, spread * ns / n)
    top, bottom = math.floor(p - margin), math.ceil(p + margin)  # ranks from the largest (1)
    kth = topk_threshold_reference if kth is None else kth
    hi = math.inf if top < 1 else float(kth([sample], top))
    lo = 0.0 if bottom > ns else float(kth([sample], bottom))
    return lo, hi


def _slice_grid(first: int, end: int, buckets: int) -> Tuple[int, int, int]:
    """``(j, start, stop)``: buckets of ``2**j`` bit patterns aligned at
    multiples of ``2**j``, at most ``buckets`` of them, covering ``[first, end)``."""
    j = max(0, ((end - first - 1) // buckets).bit_length() - 1)
    while -(-end >> j) - (first >> j) > buckets:
        j += 1
    return j, (first >> j) << j, -(-end >> j) << j


def topk_slice_reference(values: Sequence[Tensor], share: int, buckets: int, cap: int,
                         sample: Sequence[int] = SLICE_SAMPLE) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""One rank's slice of the sharded top-k threshold (the oracle of the
    ``topk_slice`` op; :func:`prunopt.distributed.topk_threshold`, step 1 of
    its bracketed select). With :math:`n` values and bit patterns ``b(x)`` of
    :math:`|x|` (int32 for float32, int64 for float64; their order is the
    order of the magnitudes):

    1. the sample, ``sample = (lo, hi, b)``: ``s = clamp(int((6 n)^{2/3}), lo,
       hi)`` values; all of them when ``n <= s``, else, with ``e = n // s``, in
       each tensor the blocks of ``b`` contiguous values numbered ``e//2,
       e//2 + e, ...`` (the single values ``e//2, e//2 + e, ...`` of a tensor
       with fewer than ``e`` blocks);
    2. the bracket ``[lo, hi]`` of the ``share``-th largest: with ``q =
       share / n``, ``p = q s``, ``margin = 5 sqrt(max(p (1 - q), 1)) + 8``
       (0 when the sample is every value) and at least ``(cap // 2) s / n``,
       ``hi`` the ``floor(p - margin)``-th largest of the sample (``inf`` below
       rank 1), ``lo`` the ``ceil(p + margin)``-th (0 beyond the sample);
       ``[0, inf]`` when ``share`` is not in ``[1, n]`` or the sample is not
       finite;
    3. the grid: buckets of ``2^j`` bit patterns aligned at multiples of
       ``2^j``, at most ``buckets``, from ``b(lo)`` to ``min(b(hi), top)``
       (``top`` the largest finite); one read gives ``above``, the count of
       ``|v|`` beyond the grid, and the candidates inside it (a non-finite
       value: ``bad = 1``, ``above = 0``, no candidates); a bracket open above
       then ends its grid at the largest candidate;
    4. ``hist``: the candidates per grid bucket;
    5. the window (``cap > 0``): the grid buckets around the one where the
       count of values ``>=`` its start first reaches ``share``, as many
       either side as hold at most ``cap`` candidates (none when that bucket
       alone holds more: ``w_m = -1``): ``w_above`` values at or above its end
       ``w_end``, its candidates' bit patterns in index order, ``w_lo = 0``
       when nothing lies below it and ``w_end = top + 1`` when nothing lies
       above.

    Returns ``(head, hist, window, inside)``: int64 ``head = [n, above,
    start, j, nb, bad, w_above, w_lo, w_end, w_m, scan_start, scan_stop]``
    (``scan_*``: the bit patterns that were read, ``[scan_start,
    scan_stop)``, before a bracket open above was narrowed), int64 ``hist``
    of ``nb`` buckets, the window's bit patterns and the candidates' ``|v|``
    (index order)."""
    dtype = values[0].dtype
    int_dtype = _SLICE_FORMATS[dtype][0]
    flat = [v.detach().reshape(-1) for v in values if v.numel()]
    n = sum(v.numel() for v in flat)

    def scan(lo: float, hi: float):
        if not flat:  # (a rank without values reads nothing)
            return False, 0, torch.empty(0, dtype=dtype), None
        try:
            above, inside = topk_bracket_reference(flat, lo, hi)
        except ValueError:  # a non-finite value
            return True, 0, torch.empty(0, dtype=dtype), None
        return False, int(above), inside, None

    head, hist, inside, _, window = _slice_rounds(dtype, n, share, buckets, cap,
                                                  lambda: _slice_sample(flat, n, sample), scan)
    keys = inside.view(int_dtype).long()
    bits = keys[(keys >= window[0]) & (keys < window[1])] if window else keys[:0]
    return torch.tensor(head, dtype=torch.int64), hist, bits.to(int_dtype), inside


def _slice_rounds(dtype: torch.dtype, n: int, share: int, buckets: int, cap: int, sample, scan, kth=None):
    """Steps 2-5 of :func:`topk_slice_reference` (and of
    :func:`prunadag_slice_reference`) for ``n`` values: ``sample()`` gives the
    sample's magnitudes, ``scan(lo, hi)`` reads the values for a bracket and
    gives ``(bad, above, candidates, extra)``, ``kth(values, r)`` is the
    ``r``-th largest magnitude (default :func:`topk_threshold_reference`).
    Returns ``(head, hist, candidates, extra, window)``, ``window = (w_lo,
    w_end)`` or ``None``."""
    int_dtype, top = _SLICE_FORMATS[dtype]
    head = [0] * 12
    if n == 0:
        head[8] = top + 1
        bad, _, inside, extra = scan(0.0, 0.0)  # (a scan that checks more than the values still runs)
        head[5] = int(bad)
        return head, torch.zeros(0, dtype=torch.int64), torch.empty(0, dtype=dtype), extra, None

    def bits(x: float) -> int:  # (x >= 0)
        return int(torch.tensor(x, dtype=dtype).view(int_dtype))

    def value(b: int) -> float:
        return float(torch.tensor(b, dtype=int_dtype).view(dtype))

    lo, hi = _slice_bracket(sample(), share, n, cap // 2, kth) if 1 <= share <= n else (0.0, math.inf)
    first, end = bits(lo), min(top + 1 if hi == math.inf else bits(hi), top) + 1
    j, start, stop = _slice_grid(first, end, buckets)
    scanned = (start, min(stop, top + 1))  # (the grid's end may pass the largest finite: what was read ends there)
    bad, above, inside, extra = scan(value(start), value(scanned[1] - 1))
    keys = inside.view(int_dtype).to(torch.int64)
    if hi == math.inf and keys.numel() and not bad:
        j, start, stop = _slice_grid(start, int(keys.max()) + 1, buckets)
    nb = (stop - start) >> j
    hist = torch.bincount((keys - start) >> j, minlength=nb) if keys.numel() else torch.zeros(nb, dtype=torch.int64)
    head[:6] = [n, above, start, j, nb, int(bad)]
    head[9] = -1
    head[10:12] = scanned
    if cap == 0 or bad:
        return head, hist, inside, extra, None
    ge = (hist.flip(0).cumsum(0).flip(0) + above).tolist() + [above]  # ge[i]: values >= start + i 2^j
    centre = max(sum(1 for i in range(nb) if ge[i] >= share) - 1, 0)
    radius = -1
    for r in range(nb + 1):  # the widest radius whose buckets hold at most cap candidates
        if ge[max(centre - r, 0)] - ge[min(centre + 1 + r, nb)] > cap:
            break
        radius = r
    if radius < 0:
        return head, hist, inside, extra, None
    w_lo = start + (max(centre - radius, 0) << j)
    w_end = min(start + (min(centre + 1 + radius, nb) << j), top + 1)
    w_above = above + int((keys >= w_end).sum())
    m = int(((keys >= w_lo) & (keys < w_end)).sum())
    head[6:10] = [w_above, w_lo if w_above + m < n else 0, w_end if w_above else top + 1, m]
    return head, hist, inside, extra, (w_lo, w_end)


def prunadag_slice_reference(params: List[Tensor], grads: List[Tensor], hypers: List[TensorHyper], share: int,
                             buckets: int, cap: int, sample: Sequence[int] = SLICE_SAMPLE):
    r"""prunAdag's form of :func:`topk_slice_reference` (the oracle of the
    ``prunadag_slice`` op): one rank's first round of the sharded PrunAdag
    select over the effective gradients :math:`g_e = \pm g + \lambda x`
    (weight decay's product rounded before the sum, as the fused kernels
    compute it) of the pruned tensors with elements.

    The sample is of :math:`|g_e|` (of :math:`|g|` where no weight decay
    changes it), at topk_slice's positions over the pruned tensors; the pass
    is :func:`prunadag_bracket_reference` over every tensor (the finiteness
    of the others is checked too, also on a rank without pruned elements,
    where it reads ``[0, 0]``). Returns ``(head, sums, hist, window_bits,
    window_m, keys, m)``: topk_slice's ``head`` and ``hist``; float64
    ``sums = [G, X, G_w, X_w]``, with ``G`` and ``X`` the pass's sums outside
    the bracket (:math:`\sum g_e^2` over :math:`|g_e|` above it, the
    sign-matched :math:`x^2` below it), :math:`G_w = G + \sum c^2` over the
    candidates ``c`` at or above the window and :math:`X_w = X + \sum m`
    over those below it (so that for any ``t`` in the window, this rank's
    :math:`\|g\|^2` over :math:`|g_e| \ge t` is ``G_w`` plus the window's
    :math:`c^2` at or above ``t``, and its :math:`\|x\|_M^2` below ``t`` is
    ``X_w`` plus the window's ``m`` below ``t``); the window's bit patterns
    and ``m``; the candidates :math:`c = |g_e|` and their ``m``, in index
    order. A non-finite effective gradient: ``bad = 1``, zero sums, no
    candidates, no window."""
    dtype = params[0].dtype
    int_dtype = _SLICE_FORMATS[dtype][0]
    pruned = [i for i, h in enumerate(hypers) if h.prune and params[i].numel()]
    n = sum(params[i].numel() for i in pruned)
    any_wd = any(hypers[i].weight_decay != 0 for i in pruned)

    def draw():  # (ge at the sample's positions only)
        gv = _slice_sample_views([grads[i].detach().reshape(-1) for i in pruned], n, sample)
        xv = _slice_sample_views([params[i].detach().reshape(-1) for i in pruned], n, sample)
        parts = []
        for i, g, x in zip(pruned, gv, xv):
            h = hypers[i]
            parts.append((-g if h.maximize else g) + x * h.weight_decay if any_wd and h.weight_decay != 0 else g)
        return torch.cat(parts).abs()

    def scan(lo: float, hi: float):
        summary, keys, m = prunadag_bracket_reference(params, grads, hypers, lo, hi)
        if summary[3] != 0:
            return True, 0, keys, (0.0, 0.0, m)
        return False, int(summary[0]), keys, (float(summary[1]), float(summary[2]), m)

    head, hist, keys, (G, X, m), window = _slice_rounds(dtype, n, share, buckets, cap, draw, scan)
    bits = keys.view(int_dtype).long()
    sums = [G, X, 0.0, 0.0]
    if window:
        w_lo, w_end = window
        inw = (bits >= w_lo) & (bits < w_end)
        sums[2] = G + float(keys.double().square()[bits >= w_end].sum())
        sums[3] = X + float(m[bits < w_lo].sum())
        w_bits, w_m = bits[inw].to(int_dtype), m[inw]
    else:
        w_bits, w_m = bits[:0].to(int_dtype), m[:0]
    if head[0] == 0:  # (no values here: no sums either)
        keys, m = torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.float64)
    return (torch.tensor(head, dtype=torch.int64), torch.tensor(sums, dtype=torch.float64), hist, w_bits, w_m,
            keys, m)


def prunadag_bracket_reference(params: List[Tensor], grads: List[Tensor], hypers: List[TensorHyper],
                               lo: float, hi: float) -> Tuple[Tensor, Tensor, Tensor]:
    r"""prunAdag's bracket pass over one process's part of a scope (the oracle
    of the ``prunadag_bracket`` op). With the effective gradients ``ge``
    (:func:`effective_grad`, ``weight_decay * x`` rounded before the sum) of
    the pruned tensors and a bracket ``[lo, hi]`` of ``|ge|``:

    * ``summary``, float64 ``[a, G, X, bad]``: ``a`` the number of
      :math:`|ge| > hi`, :math:`G = \sum_{|ge| > hi} ge^2`,
      :math:`X = \sum x^2` over :math:`|ge| < lo` with :math:`x\,ge > 0`,
      and ``bad = 1`` if an effective gradient of any tensor (pruned or not)
      is not finite (then ``a = G = X = 0`` and no candidates);
    * the candidates :math:`lo \le |ge| \le hi` in index order over the
      concatenation: their ``|ge|`` (the params' dtype) and ``m = x^2`` where
      :math:`x\,ge > 0`, else 0 (float64).

    For any threshold ``tau`` in ``[lo, hi]``, Table 1's squared norms are
    :math:`\|g\|_R^2 = G + \sum_{c \ge \tau} c^2` and
    :math:`\|x\|_M^2 = X + \sum_{c < \tau} m_c` over the candidates ``c``
    (sums in float64; the compiled kernel sums ``G`` in short float blocks and
    leaves squares below ``2^-120`` (float32) out of ``X``)."""
    g_above = x_below = 0.0
    above, bad = 0, False
    keys, ms = [], []
    dtype = params[0].dtype if params else torch.float32
    with torch.no_grad():
        for x, g, hp in zip(params, grads, hypers):
            # the effective gradient with the product rounded before the sum, as
            # the fused kernels compute it (effective_grad's add may fuse them)
            xf = x.reshape(-1)
            ge = -g.reshape(-1) if hp.maximize else g.reshape(-1)
            if hp.weight_decay != 0:
                ge = ge + xf * hp.weight_decay
            bad |= not bool(torch.isfinite(ge).all())
            if not hp.prune or x.numel() == 0:
                continue
            a = ge.abs()
            up = a > hi
            above += int(up.sum())
            g_above += float((ge.double().pow(2) * up).sum())
            x_below += float((xf.double().pow(2) * ((a < lo) & (xf * ge > 0))).sum())
            inside = (a >= lo) & (a <= hi)
            keys.append(a[inside])
            ms.append((xf.double().pow(2) * (xf * ge > 0))[inside])
    none = (torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.float64))
    if bad:
        return (torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64),) + none
    summary = torch.tensor([float(above), g_above, x_below, 0.0], dtype=torch.float64)
    if not keys:
        return (summary,) + none
    return summary, torch.cat(keys), torch.cat(ms)


_SQRT_IS_IEEE: dict = {}


def _torch_sqrt_is_ieee(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.sqrt`` gives the correctly rounded result on this device
    and dtype: probed once on 4096 values against the float64 route (the AVX2
    routine misses on ~16% of floats, so it cannot pass by chance)."""
    key = (device.type, dtype)
    ok = _SQRT_IS_IEEE.get(key)
    if ok is None:
        probe = torch.linspace(0.01, 100.0, 4096, dtype=torch.float64).to(device=device, dtype=dtype)
        ok = bool(torch.equal(probe.sqrt(), probe.double().sqrt_().to(dtype)))
        _SQRT_IS_IEEE[key] = ok
    return ok


def ieee_sqrt(t: Tensor) -> Tensor:
    """``sqrt`` correctly rounded for float32/16 inputs (IEEE 754, as the
    kernels' ``sqrtps``). ``torch.sqrt`` on a CPU whose vector unit is AVX2 uses
    a 0.5001-ulp Sleef routine that is off by one ulp for ~16% of float inputs,
    and prunAdag's decrease step ``x - lr |x| / sqrt(w^D)`` can cancel to a few
    hundred times that; there (found by a one-time probe) the root is taken in
    float64 and rounded once, elsewhere ``torch.sqrt`` is used as is. (The
    float64 square root of a float is within one float64 ulp of the true
    value, which is never that close to a float midpoint, so the one rounding
    is exact.)"""
    if t.dtype == torch.float64 or _torch_sqrt_is_ieee(t.device, t.dtype):
        return t.sqrt()
    return t.double().sqrt_().to(t.dtype)


def effective_grad(x: Tensor, g: Tensor, hp: TensorHyper) -> Tensor:
    """Step 1, in the order of ``torch.optim.Adagrad``: ``g <- -g`` if
    maximize, then ``g <- g + weight_decay * x`` (so that weight decay shrinks
    ``x`` whether minimising or maximising)."""
    d = -g if hp.maximize else g
    return d if hp.weight_decay == 0 else d.add(x, alpha=hp.weight_decay)


def prunadag_norms_reference(params: List[Tensor], grads: List[Tensor], hypers: List[TensorHyper],
                             tau) -> Tensor:
    r"""The squared norms of Table 1's ratio for a given threshold, over the
    pruned tensors of one scope: :math:`\|g\|_R^2` over
    :math:`R = \{|g| \ge \tau\}` and :math:`\|x\|_M^2` over the sign-matched
    irrelevant set :math:`M = \{i \notin R : x_i g_i > 0\}` (effective
    gradients; float64 sums), and whether an effective gradient of any tensor
    (pruned or not) is not finite. ``tau`` is a number or a one-element tensor;
    ``None`` or 0 means every element is relevant.

    Returns a float64 tensor ``[||g||_R^2, ||x||_M^2, 1.0 if non-finite else 0.0]``.
    Summed over the parts of a scope split between processes, the first two
    give the ratio :math:`r = \|g\|_R / \|x\|_M` of the whole scope (the
    oracle of the ``prunadag_norms`` op)."""
    if isinstance(tau, Tensor):
        tau = float(tau.reshape(()))
    g_r = x_m = 0.0
    bad = False
    with torch.no_grad():
        for x, g, hp in zip(params, grads, hypers):
            ge = effective_grad(x, g, hp)
            bad |= not bool(torch.isfinite(ge).all())
            if not hp.prune or x.numel() == 0:
                continue
            rel = torch.ones_like(ge, dtype=torch.bool) if not tau else ge.abs() >= tau
            m = (~rel) & (x * ge > 0)
            g_r += (ge.double().pow(2) * rel).sum().item()
            x_m += (x.double().pow(2) * m).sum().item()
    return torch.tensor([g_r, x_m, 1.0 if bad else 0.0], dtype=torch.float64)


def prunadag_step_reference(
    params: List[Tensor],
    grads: List[Tensor],
    opt_sums: List[Tensor],
    dec_sums: List[Tensor],
    hypers: List[TensorHyper],
    T: int,
    version,
    selection: Optional[Tuple[float, float]] = None,
) -> None:
    """One prunAdag step (Algorithm 2.1) on one selection scope, in place.

    ``opt_sums`` holds ``(w^O)^2`` and ``dec_sums`` holds ``(w^D)^2`` (eq. 2.15).
    Tensors whose ``hyper.prune`` is False take the plain Adagrad step (they are
    always optimisable and do not count in ``n``, ``T``, ``r``). ``T`` is the
    resolved target of eq. 2.6 (``1 <= T <= n`` when ``n > 0``). Raises
    ``ValueError`` before writing anything if an effective gradient is not finite.

    ``selection=(tau, r)`` gives the threshold of eq. 2.6 and the ratio of
    Table 1 instead of computing them from ``T`` (which is then not used):
    the relevant set is ``{|g| >= tau}`` (``tau = 0``: every element). This is
    the step of one process's part of a scope whose elements are spread over
    several processes, with ``tau`` and ``r`` agreed over all of them.
    """
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    with torch.no_grad():
        gs = [effective_grad(x, g, hp) for x, g, hp in zip(params, grads, hypers)]
        for i, g in enumerate(gs):
            if not bool(torch.isfinite(g).all()):
                raise ValueError(f"grads[{i}] has a non-finite value; the step is skipped (nothing was updated)")
        pruned = [i for i, hp in enumerate(hypers) if hp.prune and gs[i].numel() > 0]
        n = sum(gs[i].numel() for i in pruned)
        if selection is not None:
            tau, ratio = selection
            tau = tau if tau > 0 else None
        else:
            # Step 1, eq. 2.6: R = {|g| >= tau}, tau the T-th largest |g| (ties all relevant)
            tau = topk_threshold_reference([gs[i] for i in pruned], T) if n > 0 and T < n else None
            # Table 1 ratio r = ||g||_R / ||x||_M (float64; prunopt reads the paper's S as M)
            g_r, x_m, _ = prunadag_norms_reference(params, grads, hypers, tau).tolist()
            ratio = math.sqrt(g_r) / math.sqrt(x_m) if x_m > 0 else 0.0
        rel = []
        for i, g in enumerate(gs):
            if i in pruned and tau is not None:
                rel.append(g.abs() >= tau)
            else:
                rel.append(torch.ones_like(g, dtype=torch.bool))
        # Step 4: sign-matched irrelevant set M = {i not in R : x_i g_i > 0}
        match = [(~r) & (x * g > 0) for x, g, r in zip(params, gs, rel)]
        for x, g, so, sd, r, m, hp in zip(params, gs, opt_sums, dec_sums, rel, match, hypers):
            lr_k = hp.lr_k
            if isinstance(lr_k, Tensor):  # a tensor lr of any one-element shape
                lr_k = lr_k.reshape(())
            # Step 3, eq. 2.7: tentative (w^O)^2 and the Adagrad step of eq. 2.9
            so_new = so.addcmul(g, g, value=1)
            std = ieee_sqrt(so_new).add_(hp.eps)
            s_opt = torch.zeros_like(x).addcdiv_(g, std, value=-lr_k)
            # Table 1 bounds (lr_k makes a and b bound the real step; lr = 1 is the paper)
            scale = lr_k / (hp.k + 1.0) * (1.0 if version in (2, 4) else ratio)
            ax = x.abs()
            a = ax * scale
            if version == "relevant_only":
                acc = torch.zeros_like(m)  # section 3.1.1: O = R
            else:
                # eq. 2.8: acceptable A = {i in M : a_i <= |s_i| <= b_i}
                acc = m & (a <= s_opt.abs())
                if version in (3, 4):
                    acc &= s_opt.abs() <= ax
            opt = r | acc  # eq. 2.4: O = R u A;  D = complement
            # Step 6, eq. 2.10: (w^D)^2 grows by x^2 on D, s^L = -x / w^D
            sd_new = sd.addcmul(x, x, value=1)
            s_l = (ax * lr_k) / (ieee_sqrt(sd_new).add_(hp.eps))
            # eq. 2.16: on D ∩ M shrink by min(a, |s^L|) towards 0, else no step
            dec = torch.where(m, torch.minimum(a, s_l), torch.zeros_like(a))
            x_dec = x - torch.sign(x) * dec
            # Step 7 and eq. 2.11
            x.copy_(torch.where(opt, x + s_opt, x_dec))
            so.copy_(torch.where(opt, so_new, so))
            sd.copy_(torch.where(opt, sd, sd_new))


def support_norm_lmo_reference(grads: List[Tensor], T: int, radius: float):
    """LMO of the T-support-norm ball (eq. 1.2): ``v_i = -radius g_i / ||g||_R`` on
    the top-T set ``R`` of ``|g|``, 0 elsewhere. Returns ``(v_list, ||g||_R)``."""
    n = sum(g.numel() for g in grads)
    tau = topk_threshold_reference(grads, T) if n > 0 else None
    rel = [g.abs() >= tau for g in grads] if tau is not None else [torch.zeros_like(g, dtype=torch.bool) for g in grads]
    g_r = math.sqrt(sum((g.double().pow(2) * r).sum().item() for g, r in zip(grads, rel)))
    if g_r == 0:
        return [torch.zeros_like(g) for g in grads], 0.0
    return [torch.where(r, -radius * g / g_r, torch.zeros_like(g)) for g, r in zip(grads, rel)], g_r
