"""prunAdag ops: the global top-T threshold ``topk_threshold`` (eq. 2.6) and
the fused step ``prunadag_step_`` (called by :class:`prunopt.optim.PrunAdag`);
``topk_bracket`` and ``topk_slice``, the local passes of the sharded threshold
(:mod:`prunopt.distributed`).

``torch.ops.prunopt.prunadag_step_(params, opt_sums, dec_sums, grads, hyper,
relevant, version, found_nonfinite=None, selection=None)`` updates one
selection scope in place. ``hyper`` is float64 ``(len(params), 6)``: per tensor
``[lr_k, lr_k / (k+1), weight_decay, eps, maximize, prune]``; ``relevant`` is
the resolved ``T``; ``version`` 1-4, or 0 for "relevant_only". With
``selection`` (float64 ``[tau, r]`` on the params' device) the relevant set is
``{|g| >= tau}`` and the ratio of Table 1 is ``r`` as given (``relevant`` is
not used): the step of one process's shards of a scope whose threshold and
ratio were agreed over several processes (see :mod:`prunopt.optim._sharded`).
Kernels: ``csrc/cpu/prunadag.cpp``, ``csrc/cuda/prunadag.cu``; reference:
:mod:`prunopt.reference.prunadag`."""
from __future__ import annotations

import math
from typing import List

import torch
from torch import Tensor

from prunopt._extension import extension_available
from prunopt.ops import _fake_checks as _fc
from prunopt.ops._registry import TensorOrList, _kernel_devices
from prunopt.reference.prunadag import topk_threshold_reference as _topk_threshold_reference
from prunopt.validation import check_int

__all__ = ["topk_threshold", "topk_bracket", "topk_slice", "prunadag_norms", "prunadag_bracket", "prunadag_slice",
           "PRUNADAG_DEVICES"]

PRUNADAG_DEVICES = _kernel_devices("prunadag_step_")
_THRESHOLD_DEVICES = _kernel_devices("topk_threshold")


def topk_threshold(values: TensorOrList, k: int) -> Tensor:
    r"""The ``k``-th largest :math:`|v|` over a tensor or a list of tensors
    (prunAdag eq. 2.6, the threshold :math:`\tau` of the relevant set
    :math:`\mathcal R = \{i : |g_i| \ge \tau\}`; also the LMO of eq. 1.2).

    Equals ``torch.kthvalue(cat(|v|), n - k + 1).values`` (ties included) but the
    kernel never concatenates: it is an exact radix select on the bit patterns of
    :math:`|v|` with per-chunk histograms (deterministic, nothing of size n).

    Args:
        values: a tensor or a list of tensors of one real floating dtype and device.
        k: ``1 <= k <= n`` (``n`` = total number of elements).

    Returns:
        A 0-dim tensor of the values' dtype.

    Raises:
        TypeError: not tensors, ``k`` not an int.
        ValueError: ``k`` out of range, mixed dtypes/devices, non-finite values.
    """
    if isinstance(values, Tensor):
        vals = [values]
    elif isinstance(values, (list, tuple)) and all(isinstance(v, Tensor) for v in values):
        vals = list(values)
    else:
        raise TypeError(f"values must be a Tensor or a list/tuple of Tensors, got {type(values).__name__}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    n = sum(v.numel() for v in vals)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    for i, v in enumerate(vals):
        if not v.is_floating_point():
            raise ValueError(f"values[{i}] must be a real floating tensor, got {v.dtype}")
        if v.dtype != vals[0].dtype or v.device != vals[0].device:
            raise ValueError(f"values[{i}] must have the dtype and device of values[0]")
    if vals[0].device.type in _THRESHOLD_DEVICES and vals[0].dtype in (torch.float32, torch.float64):
        return torch.ops.prunopt.topk_threshold(vals, k)
    for i, v in enumerate(vals):
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"values[{i}] contains a non-finite value")
    return _topk_threshold_reference(vals, k)


def _value_list(values) -> List[Tensor]:
    """``values`` of the bracket ops as a list: a tensor, or a non-empty list
    or tuple of tensors (``TypeError`` otherwise)."""
    if isinstance(values, Tensor):
        return [values]
    if isinstance(values, (list, tuple)) and values and all(isinstance(v, Tensor) for v in values):
        return list(values)
    raise TypeError("values must be a Tensor or a non-empty list/tuple of Tensors")


def _check_bounds(lo, hi) -> None:
    """``lo`` and ``hi`` real numbers within the float range."""
    for name, b in (("lo", lo), ("hi", hi)):
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise TypeError(f"{name} must be a real number, got {type(b).__name__}")
        try:
            float(b)
        except OverflowError:  # an int beyond the float range
            raise ValueError(f"{name} must be a float, got an integer beyond the float range") from None


def topk_bracket(values: TensorOrList, lo: float, hi: float):
    r"""One pass over :math:`|v|` for a bracket ``[lo, hi]`` of a top-k
    threshold: ``(above, candidates)``, the number of :math:`|v| > hi` (an
    int64 0-dim tensor) and the :math:`|v|` with ``lo <= |v| <= hi`` in index
    order. The ``k``-th largest then is the ``(k - above)``-th largest
    candidate whenever ``above < k <= above + len(candidates)``: the sharded
    threshold of :func:`prunopt.distributed.topk_threshold` selects among the
    candidates of every rank instead of all elements.

    Args:
        values: a tensor or a list of tensors, float32 or float64, one device.
        lo, hi: ``0 <= lo <= hi`` (``hi`` may be ``inf``), values of that dtype.

    Raises:
        TypeError: not tensors, bounds not real numbers.
        ValueError: bad bounds, mixed dtypes or devices, non-finite values.
    """
    from prunopt.reference.prunadag import topk_bracket_reference

    vals = _value_list(values)
    _check_bounds(lo, hi)
    if not (0.0 <= lo <= hi):
        raise ValueError(f"the bracket must satisfy 0 <= lo <= hi, got lo={lo}, hi={hi}")
    for i, v in enumerate(vals):
        if v.dtype not in (torch.float32, torch.float64) or v.dtype != vals[0].dtype or v.device != vals[0].device:
            raise ValueError(f"values[{i}] must be float32 or float64, of the dtype and device of values[0]")
    if vals[0].device.type in _BRACKET_DEVICES:
        return torch.ops.prunopt.topk_bracket(vals, float(lo), float(hi))
    return topk_bracket_reference(vals, lo, hi)


_BRACKET_DEVICES = _kernel_devices("topk_bracket")


def _check_sample(sample) -> List[int]:
    """``(min, max, block)`` of a slice op's sample, checked."""
    if not isinstance(sample, (list, tuple)) or len(sample) != 3:
        raise TypeError(f"sample must be a (min, max, block) tuple of ints, got {sample!r}")
    lo, hi, block = (check_int(v, "sample") for v in sample)
    if not (1 <= lo <= hi and 1 <= block <= 4096):
        raise ValueError(f"sample must be (min, max, block) with 1 <= min <= max and 1 <= block <= 4096, got {sample}")
    return [lo, hi, block]


def topk_slice(values: TensorOrList, share: int, buckets: int, cap: int, sample=(1 << 15, 1 << 20, 128)):
    r"""One rank's slice of the sharded top-k threshold, in one call: the
    first round of :func:`prunopt.distributed.topk_threshold` on this rank's
    values (prunAdag eq. 2.6 over values spread across ranks).

    From a fixed strided sample of :math:`|v|` (about :math:`(6n)^{2/3}`
    values in blocks of 128) the call brackets the ``share``-th largest
    :math:`|v|`, widens the bracket to a grid of at most ``buckets`` buckets
    of :math:`2^j` ulps aligned at multiples of :math:`2^j`, and reads the
    values once (:func:`topk_bracket`): the count above the grid, the
    candidates inside it, the finiteness check. The candidates' histogram on
    the grid is the rank's *slice* (from every rank's slice, bounds on the
    global count of :math:`|v| \ge t` for any ``t``); the candidates in the
    grid buckets around the share, at most ``cap`` of them, are its
    *window* (when ``tau`` lies inside every rank's window, the pooled
    windows give it exactly). The full definition, step by step, is
    :func:`prunopt.reference.prunadag.topk_slice_reference`, which the
    compiled op equals bit for bit.

    Args:
        values: a tensor or a list of tensors, float32 or float64, one device
            (an empty tensor stands for a rank without values).
        share: the rank of the order statistic to bracket, from the largest
            (``ceil(k / world)``; out of ``[1, n]``: every value is a candidate).
        buckets: ``>= 1``, the most grid buckets.
        cap: ``>= 0``, the most values in the window (0: no window).
        sample: ``(min, max, block)``: the sample's size, about
            :math:`(6n)^{2/3}` clamped to ``[min, max]``, and its blocks of
            ``block`` contiguous values (``1 <= min <= max``,
            ``1 <= block <= 4096``).

    Returns:
        ``(head, hist, window, inside)``: int64 ``head = [n, above, start, j,
        nb, bad, w_above, w_lo, w_end, w_m, scan_start, scan_stop]`` (bit
        patterns of magnitudes: ``start``, ``w_lo``, ``w_end``, ``scan_*``;
        ``bad = 1`` on a non-finite value, then no candidates and no window;
        ``w_m = -1`` without a window), the int64 histogram of ``nb``
        buckets, the window's bit patterns (int32 for float32, int64 for
        float64) in index order and the candidates' :math:`|v|` in index
        order. On CUDA the small steps between the two device ops run on the
        host (the sharded select brackets on the CPU).

    Raises:
        TypeError: ``values`` not tensors, ``share``, ``buckets``, ``cap``
            or ``sample``'s entries not ints.
        ValueError: an empty list, mixed dtypes or devices, a dtype other
            than float32 or float64, ``buckets < 1``, ``cap < 0``, a bad
            ``sample``.
    """
    from prunopt.reference.prunadag import topk_slice_reference

    vals = _value_list(values)
    share, buckets, cap = check_int(share, "share"), check_int(buckets, "buckets", 1), check_int(cap, "cap", 0)
    sample = _check_sample(sample)
    for i, v in enumerate(vals):
        if v.dtype not in (torch.float32, torch.float64) or v.dtype != vals[0].dtype or v.device != vals[0].device:
            raise ValueError(f"values[{i}] must be float32 or float64, of the dtype and device of values[0]")
    if vals[0].device.type in _SLICE_DEVICES:
        return torch.ops.prunopt.topk_slice(vals, share, buckets, cap, sample)
    out = topk_slice_reference(vals, share, buckets, cap, sample)
    return tuple(t.to(vals[0].device) for t in out)


_SLICE_DEVICES = _kernel_devices("topk_slice")


def prunadag_norms(params: List[Tensor], grads: List[Tensor], hyper: Tensor, tau: Tensor) -> Tensor:
    r"""This process's share of the squared norms of prunAdag's ratio
    (Table 1) for a given threshold: float64 ``[||g||_R^2, ||x||_M^2, bad]``
    with :math:`R = \{|g| \ge \tau\}`, :math:`M = \{i \notin R : x_i g_i > 0\}`
    over the pruned tensors (effective gradients), and ``bad = 1`` if an
    effective gradient of any tensor is not finite (reported, not raised, so
    that several processes can agree on it first). Summed over the processes
    that share a scope, ``r = sqrt(g_r2) / sqrt(x_m2)``.

    Args:
        params, grads: lists of one dtype and device, grads shaped like params.
        hyper: float64 ``(len(params), 6)``, the rows of ``prunadag_step_``
            (weight decay, maximize and the prune flag are used).
        tau: a one-element float64 tensor on the params' device, a value of
            their dtype, finite and >= 0 (0: every element relevant).

    Returns:
        A float64 tensor of 3 elements on the params' device (CPU for an empty list).
    """
    from prunopt.reference.prunadag import TensorHyper, prunadag_norms_reference

    if not isinstance(tau, Tensor) or tau.dtype != torch.float64 or tau.numel() != 1:
        raise TypeError("tau must be a one-element float64 tensor")
    for name, lst in (("params", params), ("grads", grads)):
        if not isinstance(lst, (list, tuple)) or not all(isinstance(t, Tensor) for t in lst):
            raise TypeError(f"{name} must be a list of tensors, got {type(lst).__name__}")
    if not isinstance(hyper, Tensor):
        raise TypeError(f"hyper must be a float64 tensor, got {type(hyper).__name__}")
    # (every other check is the op's: the compiled kernel makes it, and the
    # reference path the same checks in Python, _fake_checks.check_prunadag_norms)
    if params and isinstance(params[0], Tensor) and params[0].device.type in _NORMS_DEVICES:
        return torch.ops.prunopt.prunadag_norms(params, grads, hyper, tau)
    _fc.check_prunadag_norms(list(params), list(grads), hyper, tau)
    rows = hyper.detach().cpu().tolist()
    hypers = [TensorHyper(lr=r[0], weight_decay=r[2], maximize=bool(r[4]), prune=bool(r[5])) for r in rows]
    out = prunadag_norms_reference(params, grads, hypers, tau)
    return out.to(params[0].device) if params else out


_NORMS_DEVICES = _kernel_devices("prunadag_norms")


def prunadag_bracket(params: List[Tensor], grads: List[Tensor], hyper: Tensor, lo: float, hi: float):
    r"""prunAdag's bracket pass over this process's part of one selection
    scope: one read of ``params`` and ``grads`` that gives what the sharded
    step needs to select ``tau`` in ``[lo, hi]`` and to complete the ratio's
    norms (Table 1) without reading them again.

    With the effective gradients ``ge`` of the pruned tensors it returns
    ``(summary, keys, m)``: ``summary`` float64
    ``[a, G, X, bad]`` with ``a`` the number of :math:`|ge| > hi`,
    :math:`G = \sum_{|ge| > hi} ge^2`, :math:`X = \sum x^2` over
    :math:`|ge| < lo,\ x\,ge > 0`, ``bad = 1`` if an effective gradient of
    any tensor (pruned or not) is not finite (reported, not raised: then
    ``a = G = X = 0`` and no candidates); ``keys`` the :math:`|ge|` of the
    candidates :math:`lo \le |ge| \le hi` in index order (the params'
    dtype) and ``m`` their :math:`x^2` where :math:`x\,ge > 0`, else 0
    (float64). For ``tau`` in ``[lo, hi]``:
    :math:`\|g\|_R^2 = G + \sum_{c \ge \tau} c^2`,
    :math:`\|x\|_M^2 = X + \sum_{c < \tau} m_c`. ``G`` is summed in short
    float blocks and ``X`` leaves squares below ``2^-120`` (float32;
    ``2^-1000`` float64) out, as the one-process fused step does.

    Args:
        params, grads: lists of one dtype (float32 or float64) and device,
            grads shaped like params.
        hyper: float64 ``(len(params), 6)``, the rows of ``prunadag_step_``
            (weight decay, maximize and the prune flag are used).
        lo, hi: ``0 <= lo <= hi`` (``hi`` may be ``inf``), values of the dtype.

    Returns:
        ``(summary, keys, m)`` on the params' device.
    """
    from prunopt.reference.prunadag import TensorHyper, prunadag_bracket_reference

    for name, lst in (("params", params), ("grads", grads)):
        if not isinstance(lst, (list, tuple)) or not all(isinstance(t, Tensor) for t in lst):
            raise TypeError(f"{name} must be a list of tensors, got {type(lst).__name__}")
    if not isinstance(hyper, Tensor):
        raise TypeError(f"hyper must be a float64 tensor, got {type(hyper).__name__}")
    _check_bounds(lo, hi)
    lo, hi = float(lo), float(hi)
    if params and params[0].device.type in _PRUNADAG_BRACKET_DEVICES:
        return torch.ops.prunopt.prunadag_bracket(list(params), list(grads), hyper, lo, hi)
    _fc.check_prunadag_bracket(list(params), list(grads), hyper, lo, hi)
    rows = hyper.detach().cpu().tolist()
    hypers = [TensorHyper(lr=r[0], weight_decay=r[2], maximize=bool(r[4]), prune=bool(r[5])) for r in rows]
    out = prunadag_bracket_reference(params, grads, hypers, lo, hi)
    return tuple(t.to(params[0].device) for t in out) if params else out


_PRUNADAG_BRACKET_DEVICES = _kernel_devices("prunadag_bracket")


def prunadag_slice(params: List[Tensor], grads: List[Tensor], hyper: Tensor, share: int, buckets: int, cap: int,
                   sample=(1 << 15, 1 << 20, 128)):
    r"""prunAdag's form of :func:`topk_slice`: one rank's first round of the
    sharded PrunAdag select (the global top-``T`` threshold of eq. 2.6 and
    the ratio's norms of Table 1 over parameters sharded across ranks), in
    one call.

    The sample is of the effective gradients
    :math:`g_e = \pm g + \lambda x` of the pruned tensors (weight decay's
    product rounded before the sum, as the fused kernels compute it), the
    pass is :func:`prunadag_bracket` over every tensor (one read of ``x``
    and ``g``: the count and :math:`\sum g_e^2` above the bracket, the
    sign-matched :math:`x^2` below it, the candidates with their ``m``, the
    finiteness of every effective gradient, also on a rank without pruned
    elements). The full definition is
    :func:`prunopt.reference.prunadag.prunadag_slice_reference`.

    Args:
        params, grads: non-empty lists of one dtype (float32 or float64) and
            device, ``grads[i]`` shaped like ``params[i]``.
        hyper: float64 ``(len(params), 6)`` on the params' device, the rows of
            ``prunadag_step_`` (weight decay, maximize and the prune flag are
            used).
        share, buckets, cap, sample: as in :func:`topk_slice`.

    Returns:
        ``(head, sums, hist, window_bits, window_m, keys, m)``: ``head`` and
        ``hist`` as :func:`topk_slice`'s; float64 ``sums = [G, X, G_w,
        X_w]`` (the pass's sums outside the bracket; ``G_w`` adds the
        candidates' :math:`c^2` at or above the window, ``X_w`` their ``m``
        below it, so that for any ``t`` in the window this rank's
        :math:`\|g\|_R^2` part is ``G_w`` plus the window's :math:`c^2 \ge t`
        and its :math:`\|x\|_M^2` part ``X_w`` plus the window's ``m`` below
        ``t``); the window's bit patterns and ``m``; the candidates
        :math:`|g_e|` and their ``m``, in index order. Sums in float64, in
        index order (the reference's differ by rounding).

    Raises:
        TypeError: lists not of tensors, ``hyper`` not a tensor, an integer
            argument not an int.
        ValueError: the checks of :func:`prunadag_bracket` (an empty
            ``params`` too), ``buckets < 1``, ``cap < 0``, a bad ``sample``.
    """
    from prunopt.reference.prunadag import TensorHyper, prunadag_slice_reference

    for name, lst in (("params", params), ("grads", grads)):
        if not isinstance(lst, (list, tuple)) or not all(isinstance(t, Tensor) for t in lst):
            raise TypeError(f"{name} must be a list of tensors, got {type(lst).__name__}")
    if not isinstance(hyper, Tensor):
        raise TypeError(f"hyper must be a float64 tensor, got {type(hyper).__name__}")
    share, buckets, cap = check_int(share, "share"), check_int(buckets, "buckets"), check_int(cap, "cap")
    sample = _check_sample(sample)
    if params and params[0].device.type in _PRUNADAG_SLICE_DEVICES:
        return torch.ops.prunopt.prunadag_slice(list(params), list(grads), hyper, share, buckets, cap, sample)
    if not params:
        raise ValueError("params must not be empty")
    _fc.check_prunadag_bracket(list(params), list(grads), hyper, 0.0, 0.0, "prunadag_slice")
    _fc.check_slice_args(buckets, cap, sample, "prunadag_slice")
    rows = hyper.detach().cpu().tolist()
    hypers = [TensorHyper(lr=r[0], weight_decay=r[2], maximize=bool(r[4]), prune=bool(r[5])) for r in rows]
    out = prunadag_slice_reference(params, grads, hypers, share, buckets, cap, sample)
    return tuple(t.to(params[0].device) for t in out)


_PRUNADAG_SLICE_DEVICES = _kernel_devices("prunadag_slice")


if extension_available():

    # (each fake runs the real kernel's argument checks on the metadata first:
    # prunopt/ops/_fake_checks.py)
    @torch.library.register_fake("prunopt::topk_bracket")
    def _topk_bracket_fake(values, lo, hi):
        _fc.check_topk_values(values, "topk_bracket")
        if not (math.isfinite(lo) and lo >= 0.0):
            raise ValueError(f"topk_bracket: lo must be finite and >= 0, got {lo}")
        if not hi >= lo:
            raise ValueError(f"topk_bracket: hi must be >= lo (inf allowed), got lo={lo}, hi={hi}")
        dtype = values[0].dtype
        if not (_fc.representable(lo, dtype) and _fc.representable(hi, dtype)):
            raise ValueError(f"topk_bracket: lo and hi must be values of the values' dtype, got lo={lo}, hi={hi}")
        n = torch.library.get_ctx().new_dynamic_size()
        return values[0].new_empty((), dtype=torch.int64), values[0].new_empty(n)

    @torch.library.register_fake("prunopt::topk_slice")
    def _topk_slice_fake(values, share, buckets, cap, sample):
        _fc.check_topk_values(values, "topk_slice")
        _fc.check_slice_args(buckets, cap, sample, "topk_slice")
        ctx = torch.library.get_ctx()
        v0 = values[0]
        int_dtype = torch.int32 if v0.dtype == torch.float32 else torch.int64
        return (v0.new_empty(12, dtype=torch.int64), v0.new_empty(ctx.new_dynamic_size(), dtype=torch.int64),
                v0.new_empty(ctx.new_dynamic_size(), dtype=int_dtype), v0.new_empty(ctx.new_dynamic_size()))

    @torch.library.register_fake("prunopt::prunadag_slice")
    def _prunadag_slice_fake(params, grads, hyper, share, buckets, cap, sample):
        _fc.check_prunadag_bracket(params, grads, hyper, 0.0, 0.0, "prunadag_slice")
        if not params:
            raise ValueError("prunadag_slice: params must not be empty")
        _fc.check_slice_args(buckets, cap, sample, "prunadag_slice")
        ctx = torch.library.get_ctx()
        p0 = params[0]
        int_dtype = torch.int32 if p0.dtype == torch.float32 else torch.int64
        w, c = ctx.new_dynamic_size(), ctx.new_dynamic_size()
        return (p0.new_empty(12, dtype=torch.int64), hyper.new_empty(4),
                p0.new_empty(ctx.new_dynamic_size(), dtype=torch.int64), p0.new_empty(w, dtype=int_dtype),
                hyper.new_empty(w), p0.new_empty(c), hyper.new_empty(c))

    @torch.library.register_fake("prunopt::prunadag_norms")
    def _prunadag_norms_fake(params, grads, hyper, tau):
        _fc.check_prunadag_norms(params, grads, hyper, tau)
        return hyper.new_empty(3)

    @torch.library.register_fake("prunopt::prunadag_bracket")
    def _prunadag_bracket_fake(params, grads, hyper, lo, hi):
        _fc.check_prunadag_bracket(params, grads, hyper, lo, hi)
        n = torch.library.get_ctx().new_dynamic_size()
        like = params[0] if params else hyper.new_empty(0, dtype=torch.float32)
        return hyper.new_empty(4), like.new_empty(n), hyper.new_empty(n)

    @torch.library.register_fake("prunopt::topk_threshold")
    def _topk_threshold_fake(values, k):
        _fc.check_topk_values(values, "topk_threshold")
        n = sum(v.numel() for v in values)
        if not 1 <= k <= n:
            raise ValueError(f"topk_threshold: k must be in [1, n={n}], got {k}")
        return values[0].new_empty(())

    @torch.library.register_fake("prunopt::prunadag_step_")
    def _prunadag_step_fake(params, opt_sums, dec_sums, grads, hyper, relevant, version, found_nonfinite=None,
                            selection=None):
        _fc.check_prunadag_step(params, opt_sums, dec_sums, grads, hyper, version, found_nonfinite, selection)
        return None
