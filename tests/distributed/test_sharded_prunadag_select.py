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
from hypothesis import HealthCheck, example, given, settings, strategies as st

import prunopt
import prunopt.distributed as D
from prunopt.ops import topk_threshold as one_threshold
import prunopt.ops.prunadag as ops_prunadag
from prunopt.optim.prunadag import _NONFINITE, _fused_select, _FusedShare, _Scope
from prunopt.reference.prunadag import TensorHyper, _slice_sample

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


def _counting_reads(monkeypatch):
    """A list that gets, for every second ``prunadag_bracket`` pass from now
    on (the first runs inside ``prunadag_slice``), the number of elements it
    reads."""
    reads = []
    inner = ops_prunadag.prunadag_bracket

    def counting(params, *a, **kw):
        reads.append(sum(p.numel() for p in params))
        return inner(params, *a, **kw)

    monkeypatch.setattr(ops_prunadag, "prunadag_bracket", counting)
    return reads


def _check(s, counted, T, dtype):
    """The fused select against _expected."""
    _assert_exact(_fused_select(s, counted, T), s, counted, T, dtype)


def _assert_exact(got, s, counted, T, dtype):
    """``got`` (a fused select's answer over the scope ``s``) against
    _expected: tau bit for bit, the norms to the rounding of their sums."""
    tau, g_r2, x_m2 = _expected(s, counted, T)
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
    norms equal to their float64 sums (float32: the scan's short float blocks),
    from the whole shard or from a sample smaller than it (a bracket that
    misses costs a second read, never the answer)."""
    s = _scope(dtype, sizes, seed, wd=wd, maximize=maximize, kind=kind)
    n = sum(sizes)
    T = min(n, 1 + int(frac * (n - 1)))
    saved = D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK
    if sampled:
        D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK = 64, 64, 4
    try:
        for windows in (D._WINDOW_WORLD, 0):  # the one-collective path, and the slices' path
            saved_w, D._WINDOW_WORLD = D._WINDOW_WORLD, windows
            try:
                _check(s, [True] * len(sizes), T, dtype)
            finally:
                D._WINDOW_WORLD = saved_w
    finally:
        D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [300, 800, 1500])
def test_sampled_bracket_selects_among_the_candidates(dtype, T, monkeypatch):
    """With a sample smaller than the shard (512 of 2000 values, blocks of 4)
    the bracket holds tau (ordinary data, T away from the ends) and the radix
    passes run over the candidates only, in a float64 vector that carries the
    weights (the slices' path: no windows)."""
    for name, value in (("_SAMPLE_MIN", 512), ("_SAMPLE_MAX", 512), ("_SAMPLE_BLOCK", 4), ("_WINDOW_WORLD", 0)):
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
@pytest.mark.parametrize("in_sample", [False, True])
def test_nonfinite_gradient_is_reported_not_raised(bad, in_sample, small_sample):
    """A non-finite gradient is seen by the bracket pass and reported through
    the first collective's slices, whether the sample holds it (the bracket
    is then all values) or not."""
    s = _scope(torch.float64, [1400, 50], 1)
    idx = [torch.arange(1400, dtype=torch.float64), torch.arange(1400, 1450, dtype=torch.float64)]
    sampled = set(_slice_sample(idx, 1450, D._sample_shape()).long().tolist())
    assert 0 < len(sampled) < 1450
    i = min(sampled) if in_sample else min(set(range(1450)) - sampled)
    s.grads[0 if i < 1400 else 1].view(-1)[i % 1400] = bad
    assert _fused_select(s, [True, True], 400) is _NONFINITE


@pytest.mark.parametrize("bracket", ["missed_above", "missed_below", "open_above"])
def test_a_bracket_that_misses_costs_a_second_read_not_the_answer(monkeypatch, small_sample, bracket):
    """A sample unlike the rest of the shard (its values scaled up or down)
    brackets the share away from tau: [L, H] reaches past this rank's own
    bracket, the rank reads x and g a second time with [L, H] and the select
    stays exact. A share so near the top that the sample's bracket is open
    above covers tau: the one read inside prunadag_slice. (Without windows:
    a bracket holds half a window either side of the share at least, all of
    a shard this small.)"""
    monkeypatch.setattr(D, "_WINDOW_WORLD", 0)
    s = _scope(torch.float32, [2000, 345], 4)
    T = 5 if bracket == "open_above" else 500
    if bracket != "open_above":
        idx = [torch.arange(2000, dtype=torch.float64), torch.arange(2000, 2345, dtype=torch.float64)]
        sampled = _slice_sample(idx, 2345, D._sample_shape()).long()
        flat = torch.cat(s.grads)
        flat[sampled] *= 100.0 if bracket == "missed_above" else 1e-3
        s.grads = list(flat.split([2000, 345]))
    reads = _counting_reads(monkeypatch)
    _check(s, [True, True], T, torch.float32)
    assert reads == ([] if bracket == "open_above" else [2345])


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


# ------------------------------------------------ several ranks in one process

def _merged(scopes):
    """One scope holding every simulated rank's tensors (what one process
    would select over)."""
    m = _Scope()
    for s in scopes:
        m.params += s.params
        m.grads += s.grads
        m.steps += s.steps
        m.hypers += s.hypers
    return m


def _simulated_select(scopes, counted, T):
    """The fused select over several simulated ranks (one scope each) with
    its collectives done by hand: every rank's round 1, the first collective
    (each rank's slice in its place of the summed area), the bracket [L, H]
    every rank derives from all slices, each rank's round 2, and the radix
    passes over the candidates of all ranks (a sum of per-rank histograms is
    the histogram of their union). Returns the answer, every rank's share,
    and the number of radix passes (collectives after the first)."""
    world = len(scopes)
    buckets = D._rank_buckets(world)
    shares = [_FusedShare(s, c, T, world) for s, c in zip(scopes, counted)]
    area = torch.zeros(D._area(world), dtype=torch.int64)
    for r, sh in enumerate(shares):
        at = r * (buckets + D._SLICE_HEAD)
        area[at:at + D._SLICE_HEAD] = torch.tensor(sh.own.head)
        area[at + D._SLICE_HEAD:at + D._SLICE_HEAD + sh.own.hist.numel()] = sh.own.hist
    slices = D._slices(area, world, buckets)
    if any(sl.bad for sl in slices):
        return _NONFINITE, shares, 0
    n = sum(sh.own.n_r for sh in shares)
    dtype = shares[0].dtype
    lo, hi = D._bracket_of_slices(slices, T, n, D._max_finite_bits(dtype))
    parts = [sh.candidates(lo, hi) for sh in shares]
    cands = torch.cat([p[0] for p in parts])
    weights = tuple(torch.cat([p[2][i] for p in parts]) for i in range(2))
    extra = tuple(math.fsum(p[3][i] for p in parts) for i in range(2))
    passes = []
    inner = D._all_reduce
    D._all_reduce = lambda vec, groups: passes.append(vec.numel()) or inner(vec, groups)
    try:
        got = D._select_in_bracket(cands, [], T, sum(p[1] for p in parts), False, D._bits_value(lo, dtype),
                                   D._bits_value(hi, dtype), True, weights=weights, extra=extra)
    finally:
        D._all_reduce = inner
    tau, s_ge, s_lt, (G, X) = got
    g_r2, x_m2 = G + s_ge, X + s_lt
    xmin = 2.0 ** -60 if dtype == torch.float32 else 2.0 ** -500
    small = x_m2 < n * xmin * xmin * (2.0 ** 24 if dtype == torch.float32 else 2.0 ** 53)
    if (dtype == torch.float32 and g_r2 < n * 2.0 ** -102) or small:
        return (tau, None), shares, len(passes)
    return (tau, (g_r2, x_m2)), shares, len(passes)


def _rank_scopes(dtype, sizes, scales, seed, **kw):
    scopes = []
    for r, (size, scale) in enumerate(zip(sizes, scales)):
        s = _scope(dtype, size, seed + 1000 * r, **kw)
        s.params = [x * scale for x in s.params]
        s.grads = [g * scale for g in s.grads]
        scopes.append(s)
    return scopes


def test_alike_ranks_read_once_and_meet_twice(monkeypatch):
    """The slices' round (where the windows miss) on two ranks with alike
    values (FSDP2's shards of the same layers): each reads x and g once,
    [L, H] is one bucket of their common grid, and one radix pass finishes:
    2 collectives in all, tau exact and the norms to the rounding of their
    sums."""
    scopes = _rank_scopes(torch.float32, [[150_000, 50_000]] * 2, [1.0, 1.0], 21, wd=0.01)
    counted = [[True, True]] * 2
    T = 40_000
    reads = _counting_reads(monkeypatch)
    got, shares, passes = _simulated_select(scopes, counted, T)
    assert reads == [] and not any(sh.reread for sh in shares)  # (the one read is inside prunadag_slice)
    assert passes == 1  # + the first collective: 2
    assert len({sh.own.j for sh in shares}) == 1 and shares[0].own.j <= D._HIST0_BITS
    _assert_exact(got, _merged(scopes), counted[0] * 2, T, torch.float32)


@pytest.mark.parametrize("scale,rereads", [(1.0, 0), (1.05, 3), (0.01, 3), (100.0, 3)])
def test_ranks_whose_bracket_misses_read_again_still_exact(monkeypatch, scale, rereads):
    """Two alike ranks and a third whose x and g are scaled by ``scale``:
    alike, every rank's bracket of its equal share holds tau (one read each);
    5% larger, or 100x smaller or larger, the third moves tau out of every
    rank's own bracket, so every rank reads x and g a second time with
    [L, H]: slower, still exact. (The slices' path, without windows: their
    brackets are then those of the sample alone.)"""
    monkeypatch.setattr(D, "_WINDOW_WORLD", 0)
    scopes = _rank_scopes(torch.float32, [[30_000, 20_000]] * 3, [1.0, 1.0, scale], 22, wd=0.01)
    counted = [[True, True]] * 3
    T = 20_000
    reads = _counting_reads(monkeypatch)
    got, shares, passes = _simulated_select(scopes, counted, T)
    assert sum(sh.reread for sh in shares) == rereads and reads == [50_000] * rereads
    _assert_exact(got, _merged(scopes), counted[0] * 3, T, torch.float32)


@st.composite
def ranks_case(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    world = draw(st.integers(1, 4))
    sizes = [draw(st.lists(st.sampled_from([0, 1, 3, 100, 700, 2000]), min_size=1, max_size=3))
             for _ in range(world)]
    scales = draw(st.lists(st.sampled_from([1.0, 1.0, 1.0, 0.5, 4.0, 1e-3]), min_size=world, max_size=world))
    kind = draw(st.sampled_from(["normal", "ties", "tiny"]))
    wd = draw(st.sampled_from([0.0, 0.3]))
    maximize = draw(st.booleans())
    # which tensor (by position in every rank's list) is not pruned, which is counted on another rank
    unpruned = draw(st.sampled_from([(), (0,), (1,)]))
    uncounted = draw(st.sampled_from([None, 0, 1]))
    seed = draw(st.integers(0, 2**20))
    frac = draw(st.floats(0.0, 1.0))
    return dtype, sizes, scales, kind, wd, maximize, unpruned, uncounted, seed, frac


def _ranks_problem(case):
    """A :func:`ranks_case`'s scopes, one per rank, which tensors each rank
    counts (a tensor counted on another rank, a replica, is counted on the
    first rank only), the merged scope of one process with its flags, and
    ``T``; ``None`` when nothing is pruned."""
    dtype, sizes, scales, kind, wd, maximize, unpruned, uncounted, seed, frac = case
    scopes = _rank_scopes(dtype, sizes, scales, seed, wd=wd, maximize=maximize, unpruned=unpruned, kind=kind)
    counted = [[not (i == uncounted and r > 0) for i in range(len(s.params))] for r, s in enumerate(scopes)]
    merged = _merged(scopes)
    flat = [c for cs in counted for c in cs]
    n = sum(x.numel() for x, h, c in zip(merged.params, merged.hypers, flat) if h.prune and c)
    if n == 0:
        return None
    return dtype, scopes, counted, merged, flat, min(n, 1 + int(frac * (n - 1)))


# (the fixture only sets the sample's size: the same for every input)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ranks_case())
@example((torch.float32, [[2000, 700], [2000, 700]], [1.0, 1.0], "normal", 0.3, False, (), None, 0, 0.1))
@example((torch.float32, [[2000], [0], [3, 100]], [1.0, 1.0, 4.0], "ties", 0.0, True, (), 0, 1, 1.0))
@example((torch.float64, [[700, 1], [2000, 3]], [1e-3, 1.0], "normal", 0.3, False, (1,), 1, 2, 0.0))
@example((torch.float32, [[2000], [2000]], [1.0, 1.0], "tiny", 0.0, False, (), None, 3, 0.5))
def test_simulated_ranks_select_exactly(small_sample, case):
    """Ranks of uneven, empty or unlike shards (a sample smaller than the
    shards), ties, tiny values, weight decay, tensors not pruned or counted on
    another rank: tau bit-identical to one process over the union, the norms
    to the rounding of their float64 sums."""
    problem = _ranks_problem(case)
    if problem is None:
        return
    dtype, scopes, counted, merged, flat, T = problem
    got, _, _ = _simulated_select(scopes, counted, T)
    _assert_exact(got, merged, flat, T, dtype)


def test_a_nonfinite_gradient_on_one_rank_is_seen_by_every_rank(small_sample):
    """A non-finite gradient of a tensor that is not pruned, on one rank of
    three: its slice carries the flag, so every rank returns _NONFINITE after
    the first collective."""
    scopes = _rank_scopes(torch.float32, [[1500, 40]] * 3, [1.0] * 3, 5, unpruned=(1,))
    scopes[2].grads[1][7] = math.nan
    got, shares, _ = _simulated_select(scopes, [[True, True]] * 3, 300)
    assert got is _NONFINITE and [sh.own.bad for sh in shares] == [False, False, True]


# ------------------------------------------ the whole fused select, ranks as threads

def _threaded_select(scopes, counted, T, monkeypatch):
    """:func:`_fused_select` itself on every simulated rank (threads, their
    collectives summed by tests/distributed/_simranks.py): every rank's
    answer, exception and all_reduce sizes."""
    from tests.distributed._simranks import SimRanks, plan_of

    world = len(scopes)
    sim = SimRanks(world)
    monkeypatch.setattr(D, "_plan", lambda params, group, name: plan_of(params, world))
    out, errs = sim.run(lambda r: _fused_select(scopes[r], counted[r], T, object()))
    assert all(e is None for e in errs), errs
    return out, sim.calls


def _same_answers(out):
    """Every rank's answer is the same: tau bit for bit, the same floats."""
    taus = {o[0].view(_INT[o[0].dtype]).item() for o in out}
    assert len(taus) == 1 and len({o[1] for o in out}) == 1, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_alike_ranks_take_one_collective_with_the_norms(dtype, world, monkeypatch):
    """Ranks of alike shards: the threshold lies inside every rank's window,
    so the first collective (the size of every select's first) gives tau and
    both norms, each rank reading x and g once."""
    scopes = _rank_scopes(dtype, [[30_000, 10_000]] * world, [1.0] * world, 31, wd=0.01)
    counted = [[True, True]] * world
    reads = _counting_reads(monkeypatch)
    for T in (1, 4_000 * world, 20_000 * world, 40_000 * world - 1):
        reads.clear()
        out, calls = _threaded_select(scopes, counted, T, monkeypatch)
        assert calls == [[D._first_size(world) * 8]] * world, (T, calls)
        assert reads == []  # (each rank's one read is inside prunadag_slice)
        _same_answers(out)
        _assert_exact(out[0], _merged(scopes), counted[0] * world, T, dtype)


def test_a_rank_unlike_the_others_takes_the_slices_round(monkeypatch):
    """A rank whose gradients are 4x the others': the windows cannot all hold
    tau, the slices' bracket and the radix passes carrying the norms finish
    (another collective at least), still exact."""
    scopes = _rank_scopes(torch.float32, [[20_000]] * 2, [1.0, 4.0], 32, wd=0.01)
    out, calls = _threaded_select(scopes, [[True]] * 2, 6_000, monkeypatch)
    assert len(calls[0]) >= 2 and calls[0][0] == D._first_size(2) * 8, calls
    _same_answers(out)
    _assert_exact(out[0], _merged(scopes), [True] * 2, 6_000, torch.float32)


# (the fixture only sets the sample's size: the same for every input)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ranks_case())
@example((torch.float32, [[2000, 700], [2000, 700]], [1.0, 1.0], "normal", 0.3, False, (), None, 0, 0.1))
@example((torch.float32, [[2000], [0], [3, 100]], [1.0, 1.0, 4.0], "ties", 0.0, True, (), 0, 1, 1.0))
@example((torch.float64, [[700, 1], [2000, 3]], [1e-3, 1.0], "normal", 0.3, False, (1,), 1, 2, 0.0))
def test_threaded_ranks_select_exactly(small_sample, monkeypatch, case):
    """The whole fused select on simulated ranks, whichever path it takes
    (windows, or the slices and radix passes): the same answer on every rank,
    tau bit-identical to one process over the union, the norms to the
    rounding of their float64 sums."""
    problem = _ranks_problem(case)
    if problem is None:
        return
    dtype, scopes, counted, merged, flat, T = problem
    with monkeypatch.context() as m:
        out, _ = _threaded_select(scopes, counted, T, m)
    _same_answers(out)
    _assert_exact(out[0], merged, flat, T, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_window_carries_every_candidate_and_its_m_exactly(dtype):
    """A rank's window holds the candidates of [lo, end) with their
    sign-matched x^2 bit for bit (float32 packs a candidate and sqrt(m),
    exact, in one slot: twice the candidates of float64's two slots), x
    ranging over zeros, subnormals, huge values and both signs; the sums
    outside it complete the norms."""
    import numpy as np

    g = torch.Generator().manual_seed(41)
    n = 200_000
    x = torch.randn(n, generator=g, dtype=torch.float64)
    tiny = torch.finfo(dtype).tiny
    x[::7] = 0.0
    x[1::11] = tiny / 8  # subnormal
    x[2::13] = torch.finfo(dtype).max / 4
    x[3::17] = -x[3::17]
    s = _Scope()
    s.params, s.grads = [x.to(dtype)], [torch.randn(n, generator=g, dtype=torch.float64).to(dtype)]
    s.steps, s.hypers = [torch.tensor(0.0)], [TensorHyper(lr=0.1)]
    share = _FusedShare(s, [True], 20_000, 2)  # (as one of two ranks: their window size)
    slots = D._window_slots(2)
    head, out = share.window(10_000, slots)
    a, lo, end, count = head
    keys, (G, X, m) = share.own.inside, share.own.more
    int_dtype = _INT[dtype]
    bits = keys.view(int_dtype) & ((1 << D._RADIX[dtype].nbits) - 1)
    inside = (bits >= lo) & (bits < end)
    assert count == int(inside.sum()) > 0
    o = out.numpy()
    if dtype == torch.float32:
        assert (slots - 2) // 2 < count <= slots - 2  # more than float64's two slots each would hold
        c = torch.from_numpy(o[2:] & 0xFFFFFFFF).to(torch.int32)
        got_m = torch.from_numpy(np.square((o[2:] >> 32).astype(np.int32).view(np.float32).astype(np.float64)))
        assert bool(((got_m > 0) & (got_m < tiny * tiny)).any())  # a subnormal x's square came through
    else:
        assert count <= (slots - 2) // 2
        c, got_m = torch.from_numpy(o[2::2].copy()), torch.from_numpy(o[3::2].copy().view(np.float64))
    assert torch.equal(c, bits[inside]) and torch.equal(got_m, m[inside])
    G_w, X_w = o[:2].view(np.float64)
    c2 = keys.double().square()
    assert a == share.own.above + int((bits >= end).sum())
    assert G_w == pytest.approx(G + float(c2[bits >= end].sum()), rel=1e-12)
    assert X_w == pytest.approx(X + float(m[bits < lo].sum()), rel=1e-12)
