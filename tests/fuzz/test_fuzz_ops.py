"""Fuzzing every registered op, ``torch.ops.prunopt.*`` (the schemas of
csrc/ops.cpp), called directly as ``torch.compile`` and other callers reach
them, without the Python wrappers' checks.

For each op a hypothesis draw builds a valid call (shapes, dtypes, values with
zeros, subnormals and large magnitudes), which must agree with the op's
reference (``prunopt.reference.REFERENCE_FOR_OP``) and whose fake kernel must
give the outputs' shapes and dtypes; then one argument is spoiled (None, a
wrong dtype, shape or device, a value out of range, aliasing, NaN), and the op
must raise ValueError, TypeError or RuntimeError with a message naming the
argument, write nothing (every tensor argument is compared bit for bit before
and after), and its fake kernel must fail cleanly as well (unless the fault is
in the data, which a fake kernel never reads).

Budget: ``PRUNOPT_FUZZ_EXAMPLES`` examples per op (default 25, fixed seeds:
the default run takes seconds); ``PRUNOPT_FUZZ_EXAMPLES=5000 pytest
tests/fuzz`` is a long run with fresh random examples. tools/sanitize.sh also
runs this file against the AddressSanitizer build of the kernels.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable, List, Sequence

import pytest
import torch
from hypothesis import given, strategies as st

import prunopt
from prunopt.reference import (REFERENCE_FOR_OP, TensorHyper, project_budget_apply_reference,
                               project_budget_bracket_reference, fb_coefficient_grads_reference, fb_conv2d_reference,
                               fb_reconstruct_reference, prunadag_bracket_reference, prunadag_norms_reference,
                               prunadag_step_reference, project_budget_sort, rgf_relu_backward_reference,
                               rgf_relu_reference, sparse_gate_backward_reference, sparse_gate_reference,
                               prunadag_slice_reference, topk_bracket_reference, topk_slice_reference,
                               topk_threshold_reference,
                               two_temperature_sigmoid_backward_reference, two_temperature_sigmoid_reference)
from prunopt.testing import tolerance

from _fuzz import (assert_clean_error, assert_unchanged, call, call_fake, fuzz_settings, metadata, same_bits,
                   same_metadata, snapshot, tensor)

pytestmark = pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16
SEEDS = st.integers(0, 2**31 - 1)


@dataclass
class Fault:
    """One spoiled argument: ``apply(args)`` returns the spoiled argument list;
    the error must name one of ``names``. ``data``: the fault is in the values
    (a fake kernel, which never reads them, cannot see it)."""
    label: str
    apply: Callable[[list], list]
    names: Sequence[str]
    data: bool = False


@dataclass
class Case:
    op: Callable
    args: list
    check: Callable[[object, list], None]  # (output, args after the call) -> asserts agreement
    faults: List[Fault] = field(default_factory=list)


def _with(args: list, i, value) -> list:
    """A copy of ``args`` (lists copied, tensors shared) with position ``i``
    (or ``(i, j)``: element j of the list at i) replaced."""
    out = [list(a) if isinstance(a, list) else a for a in args]
    if isinstance(i, tuple):
        out[i[0]][i[1]] = value
    else:
        out[i] = value
    return out


def _fresh(args: list) -> list:
    """Clones of the tensors (in-place ops write their arguments)."""
    def c(o):
        if isinstance(o, torch.Tensor):
            return o.clone()
        if isinstance(o, list):
            return [c(x) for x in o]
        return o
    return [c(a) for a in args]


def _close(out, ref, dtype, scale=1.0, what=""):
    tol = tolerance(dtype)["atol"] * max(1.0, scale)
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=0.0, equal_nan=True, msg=what or None)


def _mx(t: torch.Tensor) -> float:
    """max of |t| over its finite entries (0 for none)."""
    t = t.detach().double().abs()
    t = t[torch.isfinite(t)]
    return float(t.max()) if t.numel() else 0.0


def _int_like(t):
    return torch.zeros(t.shape, dtype=torch.int64)


# ------------------------------------------------------------------ projection

def _projection(d, inplace: bool) -> Case:
    dtype, theta, cost = _projection_lists(d)
    n = sum(t.numel() for t in theta) if cost is None else sum(float(c.double().sum()) for c in cost)
    budget = d.draw(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.5]), label="budget fraction") * n
    op = torch.ops.prunopt.project_budget_ if inplace else torch.ops.prunopt.project_budget
    args = [theta, cost, budget]

    def check(out, after):
        res = after[0] if inplace else out
        ref = project_budget_sort([t.double() for t in theta], budget,
                                  None if cost is None else [c.double() for c in cost])
        for i, (r, e) in enumerate(zip(res, ref)):
            assert r.dtype == dtype and r.shape == theta[i].shape
            # the kernel computes in float64 and rounds once; the budget's
            # rounding in low precision moves lam* by about eps * scale
            _close(r, e, dtype, scale=1.0, what=f"theta[{i}]")

    a = theta[0]
    faults = [
        Fault("nan budget", lambda x: _with(x, 2, math.nan), ["budget"]),
        Fault("negative budget", lambda x: _with(x, 2, -1.0), ["budget"]),
        Fault("inf budget", lambda x: _with(x, 2, math.inf), ["budget"]),
        Fault("str budget", lambda x: _with(x, 2, "1"), ["budget"]),
    ] + _list_faults(dtype, a, 0, 1)
    if a.numel():
        faults += [
            Fault("nan theta", lambda x: _with(x, (0, 0), _spoil(x[0][0], math.nan)), ["theta"], data=True),
            Fault("inf theta", lambda x: _with(x, (0, 0), _spoil(x[0][0], -math.inf)), ["theta"], data=True),
            Fault("zero cost", lambda x: _with(x, 1, [_spoil(torch.ones_like(t), 0.0) if i == 0 else torch.ones_like(t)
                                                      for i, t in enumerate(x[0])]), ["cost"], data=True),
            Fault("negative cost", lambda x: _with(x, 1, [_spoil(torch.ones_like(t), -2.0) if i == 0
                                                          else torch.ones_like(t) for i, t in enumerate(x[0])]),
                  ["cost"], data=True),
        ]
    if inplace and a.numel():
        faults += [
            Fault("aliased", lambda x: _with(x, 0, [x[0][0], x[0][0]]), ["theta"]),
            Fault("overlapping views", lambda x: _with(x, 0, _overlapping(x[0][0])), ["theta"]),
            Fault("stride 0", lambda x: _with(x, 0, x[0] + [torch.full((1,), 0.5, dtype=dtype).expand(4)]),
                  ["theta"]),
            Fault("leaf requiring grad", lambda x: _with(x, 0, x[0] + [torch.rand(3, dtype=dtype).requires_grad_()]),
                  ["theta"]),
        ]
    return Case(op, args, check, faults)


def _projection_lists(d):
    """1-3 score tensors of one dtype (zeros, subnormals, large values drawn)
    and, half the time, positive costs shaped like them."""
    dtype = d.draw(st.sampled_from([F32, F64, F16, BF16]), label="dtype")
    k = d.draw(st.integers(1, 3), label="tensors")
    shapes = [tuple(d.draw(st.lists(st.integers(0, 6), max_size=3), label="shape")) for _ in range(k)]
    seed = d.draw(SEEDS, label="seed")
    special = d.draw(st.sampled_from(["none", "zeros", "tiny"]), label="special")
    scale = d.draw(st.sampled_from([0.5, 1.0, 4.0, 1e3]), label="scale")
    theta = [tensor(s, dtype, seed + i, scale, special) for i, s in enumerate(shapes)]
    cost = None
    if d.draw(st.booleans(), label="cost"):
        cscale = d.draw(st.sampled_from([1.0, 10.0, 1e3]), label="cost scale")
        cost = [tensor(s, dtype, seed + 50 + i, cscale, low=0.05) for i, s in enumerate(shapes)]
    return dtype, theta, cost


def _list_faults(dtype, a, at: int, cost_at: int) -> List[Fault]:
    """Faults of a projection op's theta list (at ``at``) and cost list (at ``cost_at``)."""
    return [
        Fault("None theta", lambda x: _with(x, (at, 0), None), ["theta"]),
        Fault("int theta", lambda x: _with(x, (at, 0), _int_like(a)), ["theta"]),
        Fault("other dtype", lambda x: _with(x, at, x[at] + [torch.zeros(2, dtype=F64 if dtype != F64 else F32)]),
              ["theta"]),
        Fault("meta theta", lambda x: _with(x, at, x[at] + [torch.zeros(2, dtype=dtype, device="meta")]),
              ["theta"]),
        Fault("cost count", lambda x: _with(x, cost_at, [torch.ones_like(t) for t in x[at]]
                                            + [torch.ones(1, dtype=dtype)]), ["cost"]),
        Fault("cost shape", lambda x: _with(x, cost_at, [torch.ones(t.numel() + 1, dtype=dtype) for t in x[at]]),
              ["cost"]),
        Fault("cost dtype", lambda x: _with(x, cost_at, [torch.ones(t.shape, dtype=F64 if dtype != F64 else F32)
                                                         for t in x[at]]), ["cost"]),
    ]


def _projection_bracket(d) -> Case:
    dtype, theta, cost = _projection_lists(d)
    lo = d.draw(st.sampled_from([0.0, 0.25, 0.5, 2.0]), label="lo")
    hi = lo + d.draw(st.sampled_from([0.0, 1e-3, 0.5, 3.0, math.inf]), label="width")
    args = [theta, cost, lo, hi]

    def check(out, after):
        summary, kt, kc = project_budget_bracket_reference(theta, cost, lo, hi)
        torch.testing.assert_close(out[0], summary, atol=1e-9, rtol=1e-12)
        assert same_bits(out[1], kt) and same_bits(out[2], kc)

    faults = [Fault("negative lo", lambda x: _with(x, 2, -1.0), ["lo"]),
              Fault("nan lo", lambda x: _with(x, 2, math.nan), ["lo"]),
              Fault("inf lo", lambda x: _with(x, 2, math.inf), ["lo"]),
              Fault("hi < lo", lambda x: _with(x, 3, x[2] - 0.5), ["hi"]),
              Fault("empty theta", lambda x: _with(x, 0, []), ["theta"])]
    faults += _list_faults(dtype, theta[0], 0, 1)
    return Case(torch.ops.prunopt.project_budget_bracket, args, check, faults)


def _projection_apply(d) -> Case:
    dtype, theta, cost = _projection_lists(d)
    lam = d.draw(st.sampled_from([0.0, 1 / 3, 0.5, 7.0, math.inf]), label="lam")
    inplace = d.draw(st.booleans(), label="in place")
    out = [t.clone() for t in theta] if inplace else [torch.full_like(t, -7.0) for t in theta]
    args = [out, theta, cost, lam]

    def check(res, after):
        want = project_budget_apply_reference(theta, cost, lam)
        for i, (o, w) in enumerate(zip(after[0], want)):  # (a -0.0 may come out as 0.0)
            assert o.dtype == w.dtype and torch.equal(o, w), f"out[{i}]"

    a = theta[0]
    faults = [Fault("negative lam", lambda x: _with(x, 3, -1.0), ["lam"]),
              Fault("nan lam", lambda x: _with(x, 3, math.nan), ["lam"]),
              Fault("out count", lambda x: _with(x, 0, x[0] + [torch.zeros(1, dtype=dtype)]), ["out"]),
              Fault("out shape", lambda x: _with(x, (0, 0), torch.zeros(a.numel() + 1, dtype=dtype)), ["out"]),
              Fault("out dtype", lambda x: _with(x, (0, 0), torch.zeros(a.shape, dtype=F64 if dtype != F64 else F32)),
                    ["out"]),
              Fault("out leaf requiring grad", lambda x: _with(x, (0, 0), torch.zeros(a.shape, dtype=dtype)
                                                                .requires_grad_()), ["out"])]
    faults += [f for f in _list_faults(dtype, a, 1, 2) if f.label not in ("other dtype", "meta theta")]
    if a.numel() > 1:  # an out tensor whose elements share one memory location
        faults.append(Fault("stride 0 out", lambda x: _with(x, (0, 0), torch.full((1,), 0.5, dtype=dtype)
                                                             .expand(a.shape)), ["out"]))
    return Case(torch.ops.prunopt.project_budget_apply_, args, check, faults)


def _spoil(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 2] = value
    return t


def _overlapping(t: torch.Tensor) -> list:
    base = torch.rand(t.numel() + 2, dtype=t.dtype)
    return [base[: t.numel() + 1], base[1:]]


# ------------------------------------------------------------------- prunAdag

def _selection_values(d):
    """A dtype and one to three small tensors of it (some empty) for the selection ops."""
    dtype = d.draw(st.sampled_from([F32, F64]), label="dtype")
    shapes = d.draw(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 3)), min_size=1, max_size=3), label="shapes")
    seed = d.draw(SEEDS, label="seed")
    special = d.draw(st.sampled_from(["none", "zeros", "tiny", "extreme"]), label="special")
    return dtype, [tensor(s, dtype, seed + i, 1.0, special) for i, s in enumerate(shapes)]


def _topk(d) -> Case:
    dtype, values = _selection_values(d)
    if d.draw(st.booleans(), label="ties"):
        values = [v.round() for v in values]
    n = sum(v.numel() for v in values)
    faults = [Fault("k = 0", lambda x: _with(x, 1, 0), ["k"]), Fault("k > n", lambda x: _with(x, 1, n + 1), ["k"]),
              Fault("k float", lambda x: _with(x, 1, 1.5), ["k"]),
              Fault("int values", lambda x: _with(x, (0, 0), _int_like(x[0][0])), ["values"]),
              Fault("None values", lambda x: _with(x, (0, 0), None), ["values"])]
    if n == 0:
        return Case(torch.ops.prunopt.topk_threshold, [values, 1], None, faults)
    k = d.draw(st.integers(1, n), label="k")
    if any(v.numel() for v in values):
        faults.append(Fault("nan values", lambda x: _with(x, 0, [_spoil(v, math.nan) if v.numel() else v
                                                                 for v in x[0]]), ["values"], data=True))

    def check(out, after):
        assert same_bits(out.reshape(()), topk_threshold_reference(values, k).reshape(()).to(out.dtype))

    return Case(torch.ops.prunopt.topk_threshold, [values, k], check, faults)


def _hyper(hypers) -> torch.Tensor:
    rows = [[h.lr_k, h.lr_k / (h.k + 1), h.weight_decay, h.eps, float(h.maximize), float(h.prune)] for h in hypers]
    return torch.tensor(rows, dtype=torch.float64).reshape(len(hypers), 6)


def _prunadag(d) -> Case:
    dtype = d.draw(st.sampled_from([F32, F64]), label="dtype")
    shapes = d.draw(st.lists(st.integers(1, 50), min_size=1, max_size=3), label="sizes")
    seed = d.draw(SEEDS, label="seed")
    version = d.draw(st.sampled_from([0, 1, 2, 3, 4]), label="version")
    xs = [tensor((s,), dtype, seed + i) for i, s in enumerate(shapes)]
    gs = [tensor((s,), dtype, seed + 10 + i, d.draw(st.sampled_from([1e-3, 1.0, 30.0]), label="grad scale"))
          for i, s in enumerate(shapes)]
    so = [tensor((s,), dtype, seed + 20 + i, 2.0, low=0.0) for i, s in enumerate(shapes)]
    sd = [tensor((s,), dtype, seed + 30 + i, 2.0, low=0.01) for i, s in enumerate(shapes)]
    hypers = [TensorHyper(lr=d.draw(st.sampled_from([0.01, 0.3]), label="lr"), k=float(d.draw(st.integers(0, 5))),
                          lr_decay=0.1, weight_decay=d.draw(st.sampled_from([0.0, 0.01])), eps=1e-8,
                          maximize=d.draw(st.booleans())) for _ in shapes]
    n = sum(shapes)
    T = d.draw(st.integers(1, n), label="T")
    args = [xs, so, sd, gs, _hyper(hypers), T, version]

    def check(out, after):
        ref = [[t.clone() for t in lst] for lst in (xs, so, sd)]
        prunadag_step_reference(ref[0], gs, ref[1], ref[2], hypers, T, "relevant_only" if version == 0 else version)
        tol = dict(atol=1e-6, rtol=1e-5) if dtype == F32 else dict(atol=1e-13, rtol=1e-12)
        for lo, lr in zip(after[:3], ref):
            for a, b in zip(lo, lr):
                torch.testing.assert_close(a, b, **tol)

    faults = [
        Fault("version 5", lambda x: _with(x, 6, 5), ["version"]),
        # (the range of T depends on the prune flags in hyper: data to a fake kernel)
        Fault("T = 0", lambda x: _with(x, 5, 0), ["relevant"], data=True),
        Fault("T > n", lambda x: _with(x, 5, n + 1), ["relevant"], data=True),
        Fault("hyper rows", lambda x: _with(x, 4, x[4][:0]), ["hyper"]),
        Fault("hyper dtype", lambda x: _with(x, 4, x[4].float()), ["hyper"]),
        Fault("opt_sums shape", lambda x: _with(x, (1, 0), torch.zeros(shapes[0] + 1, dtype=dtype)), ["opt_sums"]),
        Fault("dec_sums dtype", lambda x: _with(x, (2, 0), x[2][0].to(F64 if dtype == F32 else F32)), ["dec_sums"]),
        Fault("grads count", lambda x: _with(x, 3, x[3][:-1]), ["grads"]),
        Fault("params int", lambda x: _with(x, (0, 0), _int_like(x[0][0])), ["params"]),
        Fault("param as its own accumulator", lambda x: _with(x, (1, 0), x[0][0]), ["params", "opt_sums"]),
        Fault("nan grad", lambda x: _with(x, (3, 0), _spoil(x[3][0], math.nan)), ["grad"], data=True),
        Fault("selection shape", lambda x: x + [None, torch.zeros(4, dtype=F64)], ["selection"]),
        Fault("selection checked flag", lambda x: x + [None, torch.tensor([0.0, 0.0, 0.5], dtype=F64)],
              ["selection"], data=True),
        Fault("nan selection", lambda x: x + [None, torch.tensor([math.nan, 0.0], dtype=F64)], ["selection"],
              data=True),
        Fault("found_nonfinite dtype", lambda x: x + [torch.zeros(1, dtype=F64)], ["found_nonfinite"]),
        Fault("leaf requiring grad", lambda x: _with(x, (0, 0), x[0][0].clone().requires_grad_()), ["params"]),
    ]
    # (a stride-0 tensor of one element shares no memory location: no fault)
    if shapes[0] > 1:
        faults.append(Fault("stride-0 param", lambda x: _with(x, (0, 0), torch.zeros(1, dtype=dtype)
                                                               .expand(shapes[0])), ["params"]))
    if shapes[-1] > 1:
        faults.append(Fault("stride-0 dec_sums", lambda x: _with(x, (2, len(shapes) - 1), torch.ones(1, dtype=dtype)
                                                                  .expand(shapes[-1])), ["dec_sums"]))
    return Case(torch.ops.prunopt.prunadag_step_, args, check, faults)


def _topk_bracket(d) -> Case:
    dtype, values = _selection_values(d)
    lo = d.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]), label="lo")
    hi = lo + d.draw(st.sampled_from([0.0, 0.5, 2.0, math.inf]), label="width")

    def check(out, after):
        above, cands = topk_bracket_reference(values, lo, hi)
        assert same_bits(out[0], above) and same_bits(out[1], cands)

    faults = [Fault("negative lo", lambda x: _with(x, 1, -1.0), ["lo"]),
              Fault("nan lo", lambda x: _with(x, 1, math.nan), ["lo"]),
              Fault("hi < lo", lambda x: _with(x, 2, x[1] - 0.5), ["hi"]),
              Fault("empty values", lambda x: _with(x, 0, []), ["values"]),
              Fault("int values", lambda x: _with(x, (0, 0), _int_like(x[0][0])), ["values"]),
              Fault("mixed dtypes", lambda x: _with(x, 0, x[0] + [torch.zeros(2, dtype=F64 if dtype == F32 else F32)]),
                    ["values"])]
    if dtype == F32:
        faults.append(Fault("lo not a float", lambda x: _with(x, 1, 0.1), ["lo"]))
    if any(v.numel() for v in values):
        faults.append(Fault("nan values", lambda x: _with(x, 0, [_spoil(v, math.nan) if v.numel() else v
                                                                 for v in x[0]]), ["values"], data=True))
    return Case(torch.ops.prunopt.topk_bracket, [values, lo, hi], check, faults)


def _topk_slice(d) -> Case:
    dtype, values = _selection_values(d)
    n = sum(v.numel() for v in values)
    share = d.draw(st.integers(-1, n + 1), label="share")
    buckets = d.draw(st.sampled_from([1, 3, 64, 2042]), label="buckets")
    cap = d.draw(st.sampled_from([0, 1, 16, 8184]), label="cap")

    sample = d.draw(st.sampled_from([[32768, 1 << 20, 128], [8, 8, 2], [4, 40, 1]]), label="sample")

    def check(out, after):
        want = topk_slice_reference(values, share, buckets, cap, sample)
        assert all(same_bits(o, w) for o, w in zip(out, want))

    faults = [Fault("buckets = 0", lambda x: _with(x, 2, 0), ["buckets"]),
              Fault("negative cap", lambda x: _with(x, 3, -1), ["cap"]),
              Fault("share float", lambda x: _with(x, 1, 1.5), ["share"]),
              Fault("sample max < min", lambda x: _with(x, 4, [8, 4, 2]), ["sample"]),
              Fault("sample of two", lambda x: _with(x, 4, [8, 8]), ["sample"]),
              Fault("empty values", lambda x: _with(x, 0, []), ["values"]),
              Fault("int values", lambda x: _with(x, (0, 0), _int_like(x[0][0])), ["values"]),
              Fault("None values", lambda x: _with(x, (0, 0), None), ["values"]),
              Fault("mixed dtypes", lambda x: _with(x, 0, x[0] + [torch.zeros(2, dtype=F64 if dtype == F32 else F32)]),
                    ["values"])]
    return Case(torch.ops.prunopt.topk_slice, [values, share, buckets, cap, sample], check, faults)


def _prunadag_lists(d, dtype):
    """Up to 3 flat parameters, their gradients and hyper rows (weight decay,
    maximize and the prune flag drawn), as prunadag_norms and
    prunadag_bracket take them."""
    shapes = d.draw(st.lists(st.integers(0, 50), min_size=0, max_size=3), label="sizes")
    seed = d.draw(SEEDS, label="seed")
    xs = [tensor((s,), dtype, seed + i) for i, s in enumerate(shapes)]
    gs = [tensor((s,), dtype, seed + 10 + i, d.draw(st.sampled_from([1e-3, 1.0, 30.0]), label="grad scale"))
          for i, s in enumerate(shapes)]
    hypers = [TensorHyper(lr=0.1, k=0.0, lr_decay=0.0, weight_decay=d.draw(st.sampled_from([0.0, 0.01])), eps=1e-8,
                          maximize=d.draw(st.booleans()), prune=d.draw(st.booleans())) for _ in shapes]
    return shapes, xs, gs, hypers


def _prunadag_norms(d) -> Case:
    dtype = d.draw(st.sampled_from([F32, F64, F16, BF16]), label="dtype")
    shapes, xs, gs, hypers = _prunadag_lists(d, dtype)
    tau_value = d.draw(st.sampled_from([0.0, 0.5, 2.0]), label="tau")
    tau = torch.tensor(tau_value, dtype=F64)
    args = [xs, gs, _hyper(hypers), tau]

    def check(out, after):
        ref = prunadag_norms_reference([x.float() if x.dtype in (F16, BF16) else x for x in xs],
                                       [g.float() if g.dtype in (F16, BF16) else g for g in gs], hypers, tau)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5 if dtype != F64 else 1e-12)

    faults = [Fault("grads count", lambda x: _with(x, 1, x[1] + [torch.zeros(1, dtype=dtype)]), ["grads"]),
              Fault("hyper dtype", lambda x: _with(x, 2, x[2].float()), ["hyper"]),
              Fault("hyper rows", lambda x: _with(x, 2, torch.zeros(len(shapes) + 1, 6, dtype=F64)), ["hyper"]),
              Fault("tau dtype", lambda x: _with(x, 3, x[3].float()), ["tau"]),
              Fault("negative tau", lambda x: _with(x, 3, torch.tensor(-1.0, dtype=F64)), ["tau"], data=True),
              Fault("nan tau", lambda x: _with(x, 3, torch.tensor(math.nan, dtype=F64)), ["tau"], data=True)]
    if shapes:
        faults += [Fault("grads shape", lambda x: _with(x, (1, 0), torch.zeros(shapes[0] + 1, dtype=dtype)),
                         ["grads"]),
                   Fault("grads dtype", lambda x: _with(x, (1, 0), x[1][0].to(F64 if dtype != F64 else F32)),
                         ["grads"]),
                   Fault("int params", lambda x: _with(x, (0, 0), _int_like(x[0][0])), ["params"])]
        if dtype == F32:
            faults.append(Fault("tau not a float", lambda x: _with(x, 3, torch.tensor(0.1, dtype=F64)), ["tau"],
                                data=True))
    return Case(torch.ops.prunopt.prunadag_norms, args, check, faults)


def _prunadag_bracket(d) -> Case:
    dtype = d.draw(st.sampled_from([F32, F64]), label="dtype")
    shapes, xs, gs, hypers = _prunadag_lists(d, dtype)
    lo = d.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]), label="lo")
    hi = lo + d.draw(st.sampled_from([0.0, 0.5, 2.0, math.inf]), label="width")
    args = [xs, gs, _hyper(hypers), lo, hi]

    def check(out, after):
        summary, keys, m = prunadag_bracket_reference(xs, gs, hypers, lo, hi)
        torch.testing.assert_close(out[0], summary, atol=1e-6, rtol=1e-5 if dtype != F64 else 1e-12)
        assert same_bits(out[1], keys) and same_bits(out[2], m)

    faults = [Fault("grads count", lambda x: _with(x, 1, x[1] + [torch.zeros(1, dtype=dtype)]), ["grads"]),
              Fault("hyper dtype", lambda x: _with(x, 2, x[2].float()), ["hyper"]),
              Fault("hyper rows", lambda x: _with(x, 2, torch.zeros(len(shapes) + 1, 6, dtype=F64)), ["hyper"]),
              Fault("negative lo", lambda x: _with(x, 3, -1.0), ["lo"]),
              Fault("nan lo", lambda x: _with(x, 3, math.nan), ["lo"]),
              Fault("hi < lo", lambda x: _with(x, 4, x[3] - 0.5), ["hi"])]
    if shapes:
        faults += [Fault("grads shape", lambda x: _with(x, (1, 0), torch.zeros(shapes[0] + 1, dtype=dtype)),
                         ["grads"]),
                   Fault("grads dtype", lambda x: _with(x, (1, 0), x[1][0].to(F64 if dtype != F64 else F32)),
                         ["grads"]),
                   Fault("int params", lambda x: _with(x, (0, 0), _int_like(x[0][0])), ["params"]),
                   Fault("half params", lambda x: _with(x, 0, [t.half() for t in x[0]]), ["params"])]
        if dtype == F32:
            faults.append(Fault("lo not a float", lambda x: _with(x, 3, 0.1), ["lo"]))
    return Case(torch.ops.prunopt.prunadag_bracket, args, check, faults)


def _prunadag_slice(d) -> Case:
    dtype = d.draw(st.sampled_from([F32, F64]), label="dtype")
    shapes, xs, gs, hypers = _prunadag_lists(d, dtype)
    if not shapes:  # (the op needs one tensor for its dtype: an empty one)
        shapes, xs, gs = [0], [torch.zeros(0, dtype=dtype)], [torch.zeros(0, dtype=dtype)]
        hypers = [TensorHyper(lr=0.1, eps=1e-8)]
    n = sum(s for s, h in zip(shapes, hypers) if h.prune)
    share = d.draw(st.integers(-1, n + 1), label="share")
    buckets = d.draw(st.sampled_from([1, 64, 2042]), label="buckets")
    cap = d.draw(st.sampled_from([0, 4, 4094]), label="cap")
    sample = d.draw(st.sampled_from([[32768, 1 << 20, 128], [8, 8, 2]]), label="sample")
    args = [xs, gs, _hyper(hypers), share, buckets, cap, sample]

    def check(out, after):
        want = prunadag_slice_reference(xs, gs, hypers, share, buckets, cap, sample)
        for i in (0, 2, 3, 4, 5, 6):
            assert same_bits(out[i], want[i]), i
        torch.testing.assert_close(out[1], want[1], atol=1e-6, rtol=1e-5 if dtype != F64 else 1e-12)

    faults = [Fault("grads count", lambda x: _with(x, 1, x[1] + [torch.zeros(1, dtype=dtype)]), ["grads"]),
              Fault("hyper dtype", lambda x: _with(x, 2, x[2].float()), ["hyper"]),
              Fault("hyper rows", lambda x: _with(x, 2, torch.zeros(len(shapes) + 1, 6, dtype=F64)), ["hyper"]),
              Fault("empty params", lambda x: _with(_with(_with(x, 0, []), 1, []), 2, torch.zeros(0, 6, dtype=F64)),
                    ["params"]),
              Fault("buckets = 0", lambda x: _with(x, 4, 0), ["buckets"]),
              Fault("negative cap", lambda x: _with(x, 5, -1), ["cap"]),
              Fault("sample max < min", lambda x: _with(x, 6, [8, 4, 2]), ["sample"]),
              Fault("grads shape", lambda x: _with(x, (1, 0), torch.zeros(shapes[0] + 1, dtype=dtype)), ["grads"]),
              Fault("grads dtype", lambda x: _with(x, (1, 0), x[1][0].to(F64 if dtype != F64 else F32)), ["grads"]),
              Fault("int params", lambda x: _with(x, (0, 0), _int_like(x[0][0])), ["params"]),
              Fault("half params", lambda x: _with(x, 0, [t.half() for t in x[0]]), ["params"])]
    return Case(torch.ops.prunopt.prunadag_slice, args, check, faults)


# ----------------------------------------------------------- interspace (FB)

def _fb_shapes(d):
    dtype = d.draw(st.sampled_from([F32, F64]), label="dtype")
    c_out = d.draw(st.integers(1, 6), label="c_out")
    c_in_g = d.draw(st.integers(1, 4), label="c_in_g")
    n = d.draw(st.integers(1, 9), label="n")
    kh, kw = d.draw(st.sampled_from([(1, 1), (3, 3), (2, 3), (5, 5)]), label="kernel")
    seed = d.draw(SEEDS, label="seed")
    coeff = tensor((c_out, c_in_g, n), dtype, seed)
    basis = tensor((n, kh, kw), dtype, seed + 1)
    mask = None
    if d.draw(st.booleans(), label="mask"):
        mask = (tensor((c_out, c_in_g, n), F64, seed + 2) > d.draw(st.sampled_from([-9.0, 0.0, 1.0]))).to(dtype)
    return dtype, coeff, basis, mask, seed


def _fb_faults(coeff, basis, ci=0, bi=1, mi=2):
    dtype = coeff.dtype
    other = F64 if dtype == F32 else F32
    return [
        Fault("2-D coefficients", lambda x: _with(x, ci, x[ci].reshape(x[ci].shape[0], -1)), ["coefficients"]),
        Fault("int coefficients", lambda x: _with(x, ci, _int_like(x[ci])), ["coefficients"]),
        Fault("basis N", lambda x: _with(x, bi, torch.zeros(basis.shape[0] + 1, *basis.shape[1:], dtype=dtype)),
              ["basis", "N ="]),
        Fault("basis dtype", lambda x: _with(x, bi, x[bi].to(other)), ["basis"]),
        Fault("basis 2-D", lambda x: _with(x, bi, x[bi].reshape(x[bi].shape[0], -1)), ["basis"]),
        Fault("mask shape", lambda x: _with(x, mi, torch.ones(coeff.shape[0], coeff.shape[1], coeff.shape[2] + 1,
                                                               dtype=dtype)), ["mask"]),
        Fault("mask dtype", lambda x: _with(x, mi, torch.ones(coeff.shape, dtype=other)), ["mask"]),
        Fault("None basis", lambda x: _with(x, bi, None), ["basis"]),
    ]


def _fb_reconstruct(d) -> Case:
    dtype, coeff, basis, mask, _ = _fb_shapes(d)
    scale = _mx(coeff.abs().sum(-1)) * _mx(basis)

    def check(out, after):
        _close(out, fb_reconstruct_reference(coeff.double(), basis.double(), None if mask is None else mask.double()),
               dtype, scale)

    return Case(torch.ops.prunopt.fb_reconstruct, [coeff, basis, mask], check, _fb_faults(coeff, basis))


def _fb_reconstruct_backward(d) -> Case:
    dtype, coeff, basis, mask, seed = _fb_shapes(d)
    gh = tensor((coeff.shape[0], coeff.shape[1], basis.shape[1], basis.shape[2]), dtype, seed + 3)
    output_mask = d.draw(st.sampled_from([[True, True], [True, False], [False, True]]), label="output_mask")

    def check(out, after):
        g_lam, g_basis = fb_coefficient_grads_reference(gh.double(), coeff.double(), basis.double(),
                                                        None if mask is None else mask.double())
        if output_mask[0]:
            _close(out[0], g_lam, dtype, _mx(gh.abs().sum((-1, -2))) * _mx(basis))
        else:
            assert out[0].numel() == 0
        if output_mask[1]:
            _close(out[1], g_basis, dtype, _mx(coeff.abs().sum()) * _mx(gh))
        else:
            assert out[1].numel() == 0

    faults = [Fault(f.label, (lambda f: lambda x: [x[0]] + f.apply(x[1:4]) + [x[4]])(f), f.names)
              for f in _fb_faults(coeff, basis)]
    faults += [Fault("grad_h shape", lambda x: _with(x, 0, x[0][..., :-1]), ["grad_h"]),
               Fault("grad_h dtype", lambda x: _with(x, 0, x[0].to(F64 if dtype == F32 else F32)), ["grad_h"])]
    # (an output_mask of the wrong length is refused by torch's argument parser
    # for bool[2], whose message does not name the argument)
    return Case(torch.ops.prunopt.fb_reconstruct_backward, [gh, coeff, basis, mask, output_mask], check, faults)


def _conv_geometry(d, basis, c_in):
    stride = d.draw(st.sampled_from([[1, 1], [2, 2], [1, 2]]), label="stride")
    padding = d.draw(st.sampled_from([[0, 0], [1, 1], [2, 0]]), label="padding")
    dilation = d.draw(st.sampled_from([[1, 1], [2, 1]]), label="dilation")
    kh, kw = basis.shape[1:]
    h = d.draw(st.integers(max(1, dilation[0] * (kh - 1) + 1 - 2 * padding[0]), 9), label="h")
    w = d.draw(st.integers(max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1]), 9), label="w")
    return stride, padding, dilation, h, w


def _conv_faults(ii, si, pi, di, gi, biasi, c_out, csr=False):
    faults = [
        Fault("stride 0", lambda x: _with(x, si, [0, 1]), ["stride"]),
        Fault("stride one entry", lambda x: _with(x, si, [1]), ["stride"]),
        Fault("negative padding", lambda x: _with(x, pi, [-1, 0]), ["padding"]),
        Fault("huge padding", lambda x: _with(x, pi, [2**62, 0]), ["padding"]),
        Fault("dilation 0", lambda x: _with(x, di, [1, 0]), ["dilation"]),
        Fault("huge stride", lambda x: _with(x, si, [2**62, 1]), ["stride"]),
        Fault("groups 0", lambda x: _with(x, gi, 0), ["groups"]),
        Fault("groups not dividing", lambda x: _with(x, gi, c_out + 1), ["groups"]),
        Fault("3-D input", lambda x: _with(x, ii, x[ii][0]), ["input"]),
        Fault("input dtype", lambda x: _with(x, ii, x[ii].to(F64 if x[ii].dtype == F32 else F32)), ["input"]),
        Fault("small input", lambda x: _with(x, ii, x[ii][..., :0, :]), ["input"]),
        Fault("bias shape", lambda x: _with(x, biasi, torch.zeros(c_out + 1, dtype=x[ii].dtype)), ["bias"]),
        Fault("None input", lambda x: _with(x, ii, None), ["input"]),
    ]
    if not csr:  # (a CSR does not know C_in: any input whose channels groups divides fits it)
        faults.append(Fault("input channels", lambda x: _with(x, ii, torch.cat([x[ii], x[ii]], 1)),
                            ["input", "channels"]))
    return faults


def _fb_conv2d(d) -> Case:
    dtype, coeff, basis, mask, seed = _fb_shapes(d)
    groups = d.draw(st.sampled_from([g for g in (1, 2, 3) if coeff.shape[0] % g == 0]), label="groups")
    c_in = coeff.shape[1] * groups
    stride, padding, dilation, h, w = _conv_geometry(d, basis, c_in)
    x = tensor((d.draw(st.integers(1, 2), label="batch"), c_in, h, w), dtype, seed + 4)
    bias = tensor((coeff.shape[0],), dtype, seed + 5) if d.draw(st.booleans(), label="bias") else None
    max_density = d.draw(st.sampled_from([-1.0, 0.0, 0.5, 1.0]), label="max_density")
    args = [x, coeff, basis, mask, bias, stride, padding, dilation, groups, max_density]

    def check(out, after):
        ref = fb_conv2d_reference(x.double(), coeff.double(), basis.double(), None if mask is None else mask.double(),
                                  None if bias is None else bias.double(), stride, padding, dilation, groups)
        scale = _mx(x) * _mx(coeff.abs().sum((1, 2))) * _mx(basis.abs().sum((1, 2))) + 1
        _close(out, ref, dtype, scale)

    faults = _fb_faults(coeff, basis, 1, 2, 3) + _conv_faults(0, 5, 6, 7, 8, 4, coeff.shape[0])
    faults.append(Fault("nan max_density", lambda a: _with(a, 9, math.nan), ["max_density"]))
    return Case(torch.ops.prunopt.fb_conv2d, args, check, faults)


def _fb_conv2d_csr(d) -> Case:
    dtype, coeff, basis, mask, seed = _fb_shapes(d)
    groups = d.draw(st.sampled_from([g for g in (1, 2, 3) if coeff.shape[0] % g == 0]), label="groups")
    c_out, c_in_g, n = coeff.shape
    stride, padding, dilation, h, w = _conv_geometry(d, basis, c_in_g * groups)
    x = tensor((d.draw(st.integers(1, 2), label="batch"), c_in_g * groups, h, w), dtype, seed + 4)
    bias = tensor((c_out,), dtype, seed + 5) if d.draw(st.booleans(), label="bias") else None
    lam = coeff if mask is None else coeff * mask
    nz = (lam != 0).reshape(c_out, -1)
    crow = torch.cat([torch.zeros(1, dtype=torch.int64), nz.sum(1).cumsum(0)]).to(torch.int32)
    col = nz.nonzero()[:, 1].to(torch.int32)
    vals = lam.reshape(c_out, -1)[nz]
    args = [x, crow, col, vals, basis, bias, stride, padding, dilation, groups]

    def check(out, after):
        ref = fb_conv2d_reference(x.double(), lam.double(), basis.double(), None, None if bias is None else
                                  bias.double(), stride, padding, dilation, groups)
        scale = _mx(x) * _mx(lam.abs().sum((1, 2))) * _mx(basis.abs().sum((1, 2))) + 1
        _close(out, ref, dtype, scale)

    faults = _conv_faults(0, 6, 7, 8, 9, 5, c_out, csr=True)
    faults += [
        Fault("crow int64", lambda a: _with(a, 1, a[1].long()), ["crow_indices"]),
        Fault("crow short", lambda a: _with(a, 1, a[1][:1]), ["crow_indices"]),
        Fault("col int64", lambda a: _with(a, 2, a[2].long()), ["col_indices"]),
        Fault("values length", lambda a: _with(a, 3, torch.cat([a[3], a[3][:1] + 1, torch.ones(1, dtype=dtype)])),
              ["values"]),
        Fault("values dtype", lambda a: _with(a, 3, a[3].to(F64 if dtype == F32 else F32)), ["values"]),
        Fault("basis 2-D", lambda a: _with(a, 4, a[4].reshape(a[4].shape[0], -1)), ["basis"]),
        Fault("crow decreasing", lambda a: _with(a, 1, _bad_crow(a[1])), ["crow_indices"], data=True),
        Fault("crow end", lambda a: _with(a, 1, _crow_end(a[1])), ["crow_indices"], data=True),
    ]
    if col.numel():
        faults.append(Fault("col out of range", lambda a: _with(a, 2, _spoil_int(a[2], c_in_g * n)),
                            ["col_indices"], data=True))
        faults.append(Fault("negative col", lambda a: _with(a, 2, _spoil_int(a[2], -1)), ["col_indices"], data=True))
    return Case(torch.ops.prunopt.fb_conv2d_csr, args, check, faults)


def _bad_crow(crow):
    c = crow.clone()
    c[0] = 0
    if c.numel() > 2:
        c[1] = c[-1] + 1
    else:
        c[-1] = c[-1] + 1
    return c


def _crow_end(crow):
    c = crow.clone()
    c[-1] = c[-1] + 1
    return c


def _spoil_int(t, value):
    t = t.clone()
    t[t.numel() // 2] = value
    return t


# ---------------------------------------------------------------------- gates

def _gate_dtype(d):
    return d.draw(st.sampled_from([F32, F64, F16, BF16]), label="dtype")


def _values(d, shape, dtype, seed):
    special = d.draw(st.sampled_from(["none", "zeros", "tiny", "inf"]), label="special")
    return tensor(shape, dtype, seed, d.draw(st.sampled_from([0.1, 1.0, 3.0, 30.0]), label="scale"), special)


def _shape(d):
    return tuple(d.draw(st.lists(st.integers(0, 9), max_size=3), label="shape"))


def _scalar_faults(i, name, nonneg=False, dtype=F32):
    fs = [Fault(f"nan {name}", lambda a: _with(a, i, math.nan), [name]),
          Fault(f"inf {name}", lambda a: _with(a, i, math.inf), [name]),
          Fault(f"negative {name}", lambda a: _with(a, i, -1.0), [name]),
          Fault(f"str {name}", lambda a: _with(a, i, "1"), [name])]
    if dtype != F64:  # the kernels compute in float32: 1e300 is inf there
        fs.append(Fault(f"above float {name}", lambda a: _with(a, i, 1e300), [name]))
    if not nonneg:
        fs.append(Fault(f"zero {name}", lambda a: _with(a, i, 0.0), [name]))
    return fs


def _tensor_faults(i, name):
    return [Fault(f"int {name}", lambda a: _with(a, i, _int_like(a[i])), [name]),
            Fault(f"None {name}", lambda a: _with(a, i, None), [name])]


def _like_faults(i, name):
    return [Fault(f"{name} shape", lambda a: _with(a, i, torch.zeros(a[i].numel() + 1, dtype=a[i].dtype)), [name]),
            Fault(f"{name} dtype", lambda a: _with(a, i, a[i].to(F64 if a[i].dtype != F64 else F32)), [name])]


def _float_safe(dtype, value):
    """Whether ``value`` is inside the kernels' compute range for ``dtype``."""
    return value <= torch.finfo(F64 if dtype == F64 else F32).max


def _rgf_relu(d) -> Case:
    dtype = _gate_dtype(d)
    x = _values(d, _shape(d), dtype, d.draw(SEEDS, label="seed"))
    alpha = d.draw(st.sampled_from([0.0, 0.1, 1.0, 3e38]), label="alpha")

    def check(out, after):
        _close(out, rgf_relu_reference(x.double(), alpha), dtype, _mx(x))

    faults = _scalar_faults(1, "alpha", nonneg=True, dtype=dtype) + _tensor_faults(0, "x")
    return Case(torch.ops.prunopt.rgf_relu, [x, alpha], check, faults)


def _rgf_relu_backward(d) -> Case:
    dtype = _gate_dtype(d)
    seed = d.draw(SEEDS, label="seed")
    shape = _shape(d)
    x = _values(d, shape, dtype, seed)
    g = tensor(shape, dtype, seed + 1)
    alpha = d.draw(st.sampled_from([0.0, 0.1, 1.0]), label="alpha")

    def check(out, after):
        ref = rgf_relu_backward_reference(g.double(), x.double(), alpha)
        _close(out, ref, dtype, _mx(ref))

    faults = _scalar_faults(2, "alpha", nonneg=True, dtype=dtype) + _tensor_faults(1, "x") + _like_faults(0, "grad")
    return Case(torch.ops.prunopt.rgf_relu_backward, [g, x, alpha], check, faults)


def _gate_args(d):
    dtype = d.draw(st.sampled_from([F32, F64]), label="dtype")
    seed = d.draw(SEEDS, label="seed")
    groups = d.draw(st.integers(0, 5), label="groups")
    n = d.draw(st.integers(1, 40), label="n")
    alpha = tensor((groups, n), dtype, seed, d.draw(st.sampled_from([0.1, 1.0, 3.0]), label="scale"),
                   d.draw(st.sampled_from(["none", "zeros", "tiny"]), label="special"))
    beta = tensor((groups,), dtype, seed + 1, 2.0)
    signed = d.draw(st.booleans(), label="signed")
    rgf_alpha = d.draw(st.sampled_from([0.0, 0.1, 1.0]), label="rgf_alpha")
    return dtype, seed, alpha, beta, signed, rgf_alpha


def _gate_faults(ai, bi, ri, dtype):
    return ([Fault("1-D alpha", lambda a: _with(a, ai, a[ai].reshape(-1)), ["alpha"]),
             Fault("beta shape", lambda a: _with(a, bi, torch.zeros(a[ai].shape[0] + 1, dtype=a[ai].dtype)),
                   ["beta"]),
             Fault("beta dtype", lambda a: _with(a, bi, a[bi].to(F64 if a[bi].dtype == F32 else F32)), ["beta"]),
             Fault("None beta", lambda a: _with(a, bi, None), ["beta"])]
            + _tensor_faults(ai, "alpha") + _scalar_faults(ri, "alpha", nonneg=True, dtype=dtype))


def _sparse_gate(d) -> Case:
    dtype, seed, alpha, beta, signed, rgf_alpha = _gate_args(d)

    def check(out, after):
        _close(out, sparse_gate_reference(alpha.double(), beta.double(), signed), dtype,
               _mx(alpha.abs().sum(-1)) + 1)

    return Case(torch.ops.prunopt.sparse_gate, [alpha, beta, signed, rgf_alpha], check, _gate_faults(0, 1, 3, dtype))


def _sparse_gate_backward(d) -> Case:
    dtype, seed, alpha, beta, signed, rgf_alpha = _gate_args(d)
    g = tensor(alpha.shape, dtype, seed + 2)

    def check(out, after):
        ga, gb = sparse_gate_backward_reference(g.double(), alpha.double(), beta.double(), signed, rgf_alpha)
        scale = (_mx(g.abs().sum(-1)) + 1) * (_mx(alpha.abs().sum(-1)) + 1)
        _close(out[0], ga, dtype, scale, "d alpha")
        _close(out[1], gb, dtype, scale * max(1, alpha.shape[1]), "d beta")

    faults = [Fault(f.label, (lambda f: lambda a: [a[0]] + f.apply(a[1:]))(f), f.names)
              for f in _gate_faults(0, 1, 3, dtype)]
    faults += _like_faults(0, "grad")
    return Case(torch.ops.prunopt.sparse_gate_backward, [g, alpha, beta, signed, rgf_alpha], check, faults)


def _temperatures(d, dtype):
    big = 3e38 if dtype != F64 else 1e300
    return (d.draw(st.sampled_from([1e-3, 1.0, 100.0, 1000.0, big]), label="t_l"),
            d.draw(st.sampled_from([1e-3, 1.0, 10.0, big]), label="t_s"))


def _tts(d) -> Case:
    dtype = _gate_dtype(d)
    w = _values(d, _shape(d), dtype, d.draw(SEEDS, label="seed"))
    t_l, t_s = _temperatures(d, dtype)

    def check(out, after):
        _close(out, two_temperature_sigmoid_reference(w.double(), t_l, t_s), dtype)

    faults = _scalar_faults(1, "t_l", dtype=dtype) + _scalar_faults(2, "t_s", dtype=dtype) + _tensor_faults(0, "w")
    if dtype != F64:
        faults.append(Fault("t_l above float", lambda a: _with(a, 1, 1e39), ["t_l"]))
    return Case(torch.ops.prunopt.two_temperature_sigmoid, [w, t_l, t_s], check, faults)


def _tts_backward(d) -> Case:
    dtype = _gate_dtype(d)
    seed = d.draw(SEEDS, label="seed")
    shape = _shape(d)
    w = _values(d, shape, dtype, seed)
    g = tensor(shape, dtype, seed + 1)
    _, t_s = _temperatures(d, dtype)

    def check(out, after):
        ref = two_temperature_sigmoid_backward_reference(g.double(), w.double(), t_s)
        finite = torch.isfinite(ref.to(dtype))
        _close(out[finite], ref[finite], dtype, _mx(ref[finite]))
        # where the reference overflows the dtype, the kernel gives the same infinity
        assert same_bits(out[~finite & ~ref.isnan()], ref.to(dtype)[~finite & ~ref.isnan()])

    faults = _scalar_faults(2, "t_s", dtype=dtype) + _tensor_faults(1, "w") + _like_faults(0, "grad")
    return Case(torch.ops.prunopt.two_temperature_sigmoid_backward, [g, w, t_s], check, faults)


BUILDERS = {
    "project_budget": lambda d: _projection(d, False),
    "project_budget_": lambda d: _projection(d, True),
    "project_budget_bracket": _projection_bracket,
    "project_budget_apply_": _projection_apply,
    "topk_threshold": _topk,
    "topk_bracket": _topk_bracket,
    "topk_slice": _topk_slice,
    "prunadag_step_": _prunadag,
    "prunadag_norms": _prunadag_norms,
    "prunadag_bracket": _prunadag_bracket,
    "prunadag_slice": _prunadag_slice,
    "fb_reconstruct": _fb_reconstruct,
    "fb_reconstruct_backward": _fb_reconstruct_backward,
    "fb_conv2d": _fb_conv2d,
    "fb_conv2d_csr": _fb_conv2d_csr,
    "rgf_relu": _rgf_relu,
    "rgf_relu_backward": _rgf_relu_backward,
    "sparse_gate": _sparse_gate,
    "sparse_gate_backward": _sparse_gate_backward,
    "two_temperature_sigmoid": _tts,
    "two_temperature_sigmoid_backward": _tts_backward,
}

def _schema_names():
    with open(os.path.join(ROOT, "csrc", "ops.cpp")) as f:
        return sorted(set(re.findall(r'"([a-z_0-9]+)\(', f.read())))


def test_every_registered_op_is_fuzzed():
    assert set(BUILDERS) == set(_schema_names()) == set(REFERENCE_FOR_OP)


@pytest.mark.parametrize("name", sorted(BUILDERS))
@fuzz_settings
@given(data=st.data())
def test_valid_calls_agree_with_the_reference(name, data):
    case = BUILDERS[name](data)
    if case.check is None:
        return
    args = _fresh(case.args)
    out, exc = call(case.op, *args)
    assert exc is None, f"{name}: a valid call raised {type(exc).__name__}: {exc}"
    case.check(out, args)
    fake_out, fake_exc = call_fake(case.op, _fresh(case.args))
    assert fake_exc is None, f"{name}: the fake kernel raised {type(fake_exc).__name__}: {fake_exc}"
    assert same_metadata(metadata(fake_out), metadata(out)), f"{name}: fake kernel shapes/dtypes"


@pytest.mark.parametrize("name", sorted(BUILDERS))
@fuzz_settings
@given(data=st.data())
def test_bad_arguments_raise_cleanly_and_write_nothing(name, data):
    case = BUILDERS[name](data)
    fault = data.draw(st.sampled_from(case.faults), label="fault")
    args = fault.apply(_fresh(case.args))
    before = snapshot(args)
    out, exc = call(case.op, *args)
    assert exc is not None, f"{name}: {fault.label}: no error"
    assert_clean_error(exc, fault.names, f"{name}: {fault.label}")
    assert_unchanged(args, before, f"{name}: {fault.label}")
    if not fault.data and not any(
            isinstance(t, torch.Tensor) and t.device.type == "meta" for t in _flat(args)):
        fake_out, fake_exc = call_fake(case.op, args)
        assert fake_exc is not None, f"{name}: {fault.label}: the fake kernel accepted it"
        assert_clean_error(fake_exc, fault.names, f"{name} (fake kernel): {fault.label}")


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
