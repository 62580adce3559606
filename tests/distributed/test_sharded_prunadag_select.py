"""The sharded PrunAdag step's fused select (threshold and the ratio's norms
from one pass and the selection's collectives) in one process: without a
process group its collectives are no-ops, so these tests check the algorithm
against the exact top-T threshold and float64 norms on many inputs quickly
(tests/distributed/test_prunadag_dist.py checks the step on two ranks)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings, strategies as st

import prunopt
import prunopt.distributed as D
from prunopt.ops import topk_threshold as one_threshold
from prunopt.optim.prunadag import _NONFINITE, _fused_select, _Scope
from prunopt.reference.prunadag import TensorHyper

pytestmark = [
    pytest.mark.skipif(dist.is_available() and dist.is_initialized(),
                       reason="needs a process without a default process group"),
    pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built"),
]
_INT = {torch.float32: torch.int32, torch.float64: torch.int64}


def _scope(dtype, sizes, seed, *, wd=0.0, maximize=False, unpruned=(), kind="normal"):
    g = torch.Generator().manual_seed(seed)
    s = _Scope()
    for i, n in enumerate(sizes):
        x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        gr = torch.randn(n, generator=g, dtype=torch.float64)
        if kind == "ties":
            gr = gr.round()
        elif kind == "tiny":
            gr, x = gr * 1e-30, x * 1e-30
        s.params.append(x)
        s.grads.append(gr.to(dtype))
        s.steps.append(torch.tensor(0.0))
        s.hypers.append(TensorHyper(lr=0.1, weight_decay=wd, maximize=maximize, prune=i not in unpruned))
    return s


def _expected(s: _Scope, counted, T):
    """tau over the counted pruned effective gradients (the fused kernels'
    formula: weight decay's product rounded before the sum) and the float64
    norms of Table 1 for it."""
    keys, xs = [], []
    for x, g, h, c in zip(s.params, s.grads, s.hypers, counted):
        if h.prune and c and x.numel():
            ge = -g if h.maximize else g
            if h.weight_decay:
                ge = ge + x * h.weight_decay
            keys.append(ge)
            xs.append(x)
    tau = one_threshold(keys, T)
    ge, x = torch.cat(keys), torch.cat(xs)
    rel = ge.abs() >= tau
    g_r2 = math.fsum((ge.double()[rel] ** 2).tolist())
    x_m2 = math.fsum((x.double()[~rel & (x * ge > 0)] ** 2).tolist())
    return tau, g_r2, x_m2


@pytest.fixture
def small_sample(monkeypatch):
    """A sample of ~512 values in blocks of 4, so that shards of a few
    thousand values take the sampled bracket (not the exact one of a whole
    shard)."""
    monkeypatch.setattr(D, "_SAMPLE_MIN", 512)
    monkeypatch.setattr(D, "_SAMPLE_MAX", 512)
    monkeypatch.setattr(D, "_SAMPLE_BLOCK", 4)


def _check(s, counted, T, dtype, may_fall_back=False):
    """The fused select against _expected; with ``may_fall_back`` (a sampled
    bracket, which may miss or be unbounded for extreme T) None is accepted."""
    tau, g_r2, x_m2 = _expected(s, counted, T)
    got = _fused_select(s, counted, T)
    if got is None and may_fall_back:
        return
    assert got is not None and got is not _NONFINITE
    got_tau, norms = got
    assert got_tau.dtype == dtype
    assert got_tau.view(_INT[dtype]).item() == tau.view(_INT[dtype]).item(), (got_tau, tau)
    n = sum(x.numel() for x, h, c in zip(s.params, s.hypers, counted) if h.prune and c)
    xmin, digits = (2.0 ** -60, 24) if dtype == torch.float32 else (2.0 ** -500, 53)
    if x_m2 < n * xmin * xmin * 2.0 ** digits or (dtype == torch.float32 and g_r2 < n * 2.0 ** -102):
        assert norms is None  # (e.g. nothing in M): left to the exact pass, as one process does
        return
    assert norms is not None
    rtol = 1e-6 if dtype == torch.float32 else 1e-12
    assert norms[0] == pytest.approx(g_r2, rel=rtol, abs=1e-300)
    assert norms[1] == pytest.approx(x_m2, rel=rtol, abs=1e-300)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float64]),
       sizes=st.lists(st.integers(0, 700), min_size=1, max_size=4).filter(lambda v: sum(v) > 0),
       seed=st.integers(0, 1000), frac=st.floats(0.0, 1.0), wd=st.sampled_from([0.0, 0.3]),
       maximize=st.booleans(), kind=st.sampled_from(["normal", "ties"]), sampled=st.booleans())
@example(torch.float32, [600, 0, 5], 0, 1.0, 0.0, False, "ties", True)
@example(torch.float64, [1], 1, 0.0, 0.3, True, "normal", False)
def test_fused_select_is_the_exact_threshold_and_norms(dtype, sizes, seed, frac, wd, maximize, kind, sampled):
    """tau bit-identical to the one-process threshold of the same keys, the
    norms equal to their float64 sums (float32: the scan's short float blocks)."""
    s = _scope(dtype, sizes, seed, wd=wd, maximize=maximize, kind=kind)
    n = sum(sizes)
    T = min(n, 1 + int(frac * (n - 1)))
    saved = D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK
    if sampled:
        D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK = 64, 64, 4
    try:
        _check(s, [True] * len(sizes), T, dtype, may_fall_back=sampled)
    finally:
        D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [300, 800, 1500])
def test_sampled_bracket_selects_among_the_candidates(dtype, T, monkeypatch):
    """With a sample smaller than the shard (512 of 2000 values, blocks of 4)
    the bracket holds tau (ordinary data, T away from the ends) and the radix
    passes run over the candidates only, in a float64 vector that carries the
    weights."""
    for name, value in (("_SAMPLE_MIN", 512), ("_SAMPLE_MAX", 512), ("_SAMPLE_BLOCK", 4)):
        monkeypatch.setattr(D, name, value)
    s = _scope(dtype, [1200, 700, 100], 9, wd=0.05)
    seen = []
    inner = D._select_in_bracket
    monkeypatch.setattr(D, "_select_in_bracket", lambda cands, *a, **kw: seen.append(cands.numel()) or inner(
        cands, *a, **kw))
    _check(s, [True, True, True], T, dtype)
    assert len(seen) == 1 and 0 < seen[0] < 2000


def test_uncounted_and_unpruned_tensors_take_no_part(small_sample):
    """A replica counted on another rank and a tensor that is not pruned are
    left out of n, tau and the norms (only checked for finiteness)."""
    s = _scope(torch.float32, [1500, 300, 200], 3, wd=0.1, unpruned=(2,))
    counted = [True, False, True]
    _check(s, counted, 300, torch.float32)
    s.grads[2][5] = math.inf  # the unpruned tensor is still checked
    assert _fused_select(s, counted, 300) is _NONFINITE


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_gradient_is_reported_not_raised(bad, small_sample):
    """A non-finite gradient outside the sample is seen by the bracket pass and
    reported through the first radix pass (one in the sample gives an
    unbounded bracket: the caller's select then reports it)."""
    s = _scope(torch.float64, [1400, 50], 1)
    idx = [torch.arange(1400, dtype=torch.float64), torch.arange(1400, 1450, dtype=torch.float64)]
    sampled = set(torch.cat(D._sample_parts(idx, 1450)).long().tolist())
    assert len(sampled) < 1450
    i = min(set(range(1450)) - sampled)
    s.grads[0 if i < 1400 else 1].view(-1)[i % 1400] = bad
    assert _fused_select(s, [True, True], 400) is _NONFINITE


@pytest.mark.parametrize("bracket", ["missed_above", "missed_below", "unbounded"])
def test_fallbacks_leave_the_select_to_the_caller(monkeypatch, bracket):
    """A sample bracket that misses tau (seen in the summed counts) or has no
    upper end returns None on every rank: the caller selects as before."""
    s = _scope(torch.float32, [2000, 345], 4)
    top = float(torch.cat(s.grads).abs().max())
    ends = {"missed_above": (top, top), "missed_below": (0.0, 0.0), "unbounded": (0.0, math.inf)}[bracket]
    monkeypatch.setattr(D, "_bracket_of_sample", lambda sample, share, n_r: ends)
    assert _fused_select(s, [True, True], 500) is None


def test_small_norms_are_left_to_the_exact_pass(small_sample):
    """Norms so small that the scan's float blocks could lose digits (|g|,
    |x| ~ 1e-30 in float32) come back as None: the caller takes them in
    double, as the one-process fused step does."""
    s = _scope(torch.float32, [1500, 100], 2, kind="tiny")
    tau, norms = _fused_select(s, [True, True], 400)
    assert norms is None
    assert tau.view(torch.int32).item() == _expected(s, [True, True], 400)[0].view(torch.int32).item()


def test_other_dtypes_and_mixed_scopes_are_not_taken():
    s = _scope(torch.float32, [100, 20], 0)
    s.params[1], s.grads[1] = s.params[1].double(), s.grads[1].double()
    assert _fused_select(s, [True, True], 10) is None
    s = _scope(torch.float32, [100], 0)
    s.params[0], s.grads[0] = s.params[0].bfloat16(), s.grads[0].bfloat16()
    assert _fused_select(s, [True], 10) is None
