"""prunopt.distributed in one process (no process group; no ranks spawned).

Without torch.distributed initialised the functions are the one-process ops.
The sharded algorithms themselves also run in one process when their plan
has no group to sum over (the all_reduce calls are then no-ops): that is how
these tests check them against the one-process op and the float64 sort
oracle on many inputs quickly; tests/distributed/test_sharded_*.py check the
collectives on two ranks.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings, strategies as st

import prunopt.distributed as D
from prunopt.ops import project_budget as one_projection
from prunopt.ops import topk_threshold as one_threshold
from prunopt.reference.projection import project_budget_sort
from prunopt.reference.prunadag import _slice_sample

from tests.distributed._projection_data import COSTS, PATTERNS, projection_data

_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
        torch.bfloat16: torch.int16}

pytestmark = pytest.mark.skipif(dist.is_available() and dist.is_initialized(),
                                reason="needs a process without a default process group")


def _one_process_plan(tensors):
    return D._Plan(list(tensors), [True] * len(tensors), [], 1)


@pytest.fixture(params=["compact", "device"])
def radix_mode(request, monkeypatch):
    """The CPU path (candidates compacted after each pass) and the path other
    devices take (every pass masks all elements, nothing read back)."""
    monkeypatch.setattr(D, "_COMPACT_DEVICES", frozenset({"cpu"}) if request.param == "compact" else frozenset())
    return request.param


# ----------------------------------------------------------------- no process group

def test_without_process_group_the_ops_are_the_one_process_ops():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(100, generator=g), torch.randn(7, 3, generator=g)]
    for k in (1, 50, 121):
        assert torch.equal(D.topk_threshold(xs, k), one_threshold(xs, k))
    t = [torch.rand(300, generator=g, dtype=torch.float64), torch.rand(20, generator=g, dtype=torch.float64)]
    for a, b in zip(D.project_budget(t, 30.0), one_projection(t, 30.0)):
        assert torch.equal(a, b)
    inplace = [x.clone() for x in t]
    assert D.project_budget_(inplace, 30.0) is inplace
    for a, b in zip(inplace, one_projection(t, 30.0)):
        assert torch.equal(a, b)
    assert D.global_numel(xs) == 121
    s = D.all_reduce_sum([1.5, torch.tensor(2), torch.tensor([3.0], dtype=torch.float32)])
    assert s.dtype == torch.float64 and s.tolist() == [1.5, 2.0, 3.0]
    assert D.all_reduce_sum(torch.ones(2, 2, dtype=torch.float16)).dtype == torch.float64
    assert D.process_group_of(xs) is None
    assert D.local_tensor(xs[0]) is xs[0]
    assert not D.is_distributed_tensor(xs[0]) and not D.is_replicated(xs[0]) and D.counts_locally(xs[0])


def test_sum_over_shards_of_a_plain_tensor_is_the_local_sum():
    w = torch.randn(4, 3, requires_grad=True)
    s = (w ** 2).sum()
    assert D.sum_over_shards(s, w) is s  # one process / DDP: nothing to add
    with pytest.raises(TypeError, match="local_sum must be a plain tensor"):
        D.sum_over_shards(1.0, w)
    with pytest.raises(TypeError, match="like must be a Tensor"):
        D.sum_over_shards(s, [w])


def test_set_poll_time():
    previous = D.set_poll_time(0.25)
    try:
        assert D.set_poll_time(0) == 0.25
        assert D.set_poll_time("auto") == 0
        for bad, kind in ((-1e-6, ValueError), (math.inf, ValueError), (math.nan, ValueError), ("1", TypeError),
                          ("Auto", TypeError), (True, TypeError), (None, TypeError)):
            with pytest.raises(kind, match="seconds"):
                D.set_poll_time(bad)
        assert D.set_poll_time(previous) == "auto"  # unchanged by the refused values
    finally:
        D.set_poll_time(previous)


def test_the_default_wait_is_auto():
    assert D.set_poll_time(D.set_poll_time("auto")) == "auto"


@pytest.mark.parametrize("raw,want", [(None, "auto"), ("auto", "auto"), (" AUTO ", "auto"), ("0", 0.0),
                                      ("250", 250e-6)])
def test_poll_time_from_the_environment(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("PRUNOPT_DIST_POLL_US", raising=False)
    else:
        monkeypatch.setenv("PRUNOPT_DIST_POLL_US", raw)
    assert D._poll_time_from_env() == (want if isinstance(want, str) else pytest.approx(want))


def _chosen(chooser, kind, calls):
    """The poll times ``chooser`` gives for ``calls`` collectives of ``kind``."""
    return [chooser.poll_time(kind) for _ in range(calls)]


def _run_waits(chooser, kind, calls, took):
    """``calls`` collectives of ``kind`` that take ``took[poll]`` seconds
    waited each way: the poll times the chooser gave them."""
    seen = []
    for _ in range(calls):
        poll = chooser.poll_time(kind)
        seen.append(poll)
        chooser.record(kind, poll, took[poll])
    return seen


def test_the_auto_wait_tries_both_ways_then_takes_the_faster():
    """Until each way has its warm-up times both are drawn; then the way of
    the smaller median wins, the other still drawn now and then (one call in
    ``explore`` draws at random), and a change of the host (the other way
    becoming faster) turns the choice within a window of times."""
    c = D._WaitChooser(poll_s=0.005, window=9, warmup=3, explore=16, seed=1)
    seen = _run_waits(c, 7, 400, {0.0: 3e-3, 0.005: 1e-3})  # polling faster at first
    assert seen.count(0.0) >= 3 and seen.count(0.005) >= 3
    late = seen[100:]
    assert 0 < late.count(0.0) < len(late) // 8  # blocking only when explored
    late = _run_waits(c, 7, 2000, {0.0: 1e-3, 0.005: 4e-3})[1000:]  # now blocking is faster
    assert 0 < late.count(0.005) < len(late) // 8
    assert c.recorded == 2400


def test_the_auto_wait_is_not_misled_by_the_host_drifting():
    """The ways are compared in neighbouring calls: when the whole host slows
    down fivefold, polling (twice as fast throughout) stays the choice,
    although the blocked calls timed before the drift are faster than the
    polled ones after it."""
    c = D._WaitChooser(poll_s=0.005, window=9, warmup=3, explore=1 << 30, seed=4)  # never explores
    assert _run_waits(c, 7, 50, {0.0: 2e-3, 0.005: 1e-3})[6:] == [0.005] * 44
    assert _run_waits(c, 7, 50, {0.0: 10e-3, 0.005: 5e-3}) == [0.005] * 50
    c = D._WaitChooser(poll_s=0.005, window=9, warmup=3, explore=16, seed=4)
    _run_waits(c, 7, 300, {0.0: 2e-3, 0.005: 1e-3})
    late = _run_waits(c, 7, 600, {0.0: 10e-3, 0.005: 5e-3})
    assert 0 < late.count(0.0) < len(late) // 8  # blocking only when explored


def test_the_auto_wait_pairs_its_warm_up_calls():
    """The warm-up alternates the ways (blocked first), one comparison per
    pair, then the faster way is taken."""
    c = D._WaitChooser(poll_s=0.003, window=9, warmup=4, explore=1 << 30, seed=0)
    seen = _run_waits(c, 5, 8, {0.0: 1e-3, 0.003: 2e-3})
    assert seen == [0.0, 0.003] * 4
    assert set(_chosen(c, 5, 20)) == {0.0}


def test_the_auto_wait_learns_each_payload_size_apart():
    """Collectives of different sizes (a select's first and its radix
    passes) are timed apart: each kind takes its own faster way."""
    c = D._WaitChooser(poll_s=0.002, window=9, warmup=3, explore=1 << 30, seed=2)
    took = {(1, 0.0): 1e-3, (1, 0.002): 5e-3, (2, 0.0): 5e-3, (2, 0.002): 1e-3}
    for _ in range(60):
        for kind in (1, 2):
            poll = c.poll_time(kind)
            c.record(kind, poll, took[kind, poll])
    assert set(_chosen(c, 1, 20)) == {0.0} and set(_chosen(c, 2, 20)) == {0.002}


def test_the_auto_wait_draws_from_its_own_generator():
    """Its draws leave the user's random streams alone."""
    import random

    random.seed(5)
    torch.manual_seed(5)
    want = (random.random(), torch.rand(1))
    random.seed(5)
    torch.manual_seed(5)
    c = D._WaitChooser(seed=3)
    _chosen(c, 1, 50)
    assert (random.random(), torch.rand(1)) == want


@pytest.mark.parametrize("raw", ["-1", "abc", "inf", "nan", ""])
def test_poll_time_from_the_environment_refused(monkeypatch, raw):
    monkeypatch.setenv("PRUNOPT_DIST_POLL_US", raw)
    with pytest.raises(ValueError, match="PRUNOPT_DIST_POLL_US"):
        D._poll_time_from_env()


@pytest.mark.parametrize("pause, err, match", [("0.1", TypeError, "pause must be a real number"),
                                               (True, TypeError, "pause must be a real number"),
                                               (-0.01, ValueError, "pause must be finite and >= 0"),
                                               (math.inf, ValueError, "pause must be finite and >= 0"),
                                               (math.nan, ValueError, "pause must be finite and >= 0")])
def test_end_process_group_argument_errors(pause, err, match):
    with pytest.raises(err, match=match):
        D.end_process_group(pause)


def test_end_process_group_without_a_group():
    with pytest.raises(ValueError, match="no default process group is initialised"):
        D.end_process_group()


def _one_rank_gloo(tmp_path, name="store"):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / name), 1), rank=0, world_size=1)


def test_end_process_group_meets_sleeps_without_the_gil_then_destroys(tmp_path, monkeypatch):
    """gloo: a barrier, then the pause (a plain sleep, which frees the GIL for
    gloo's worker threads), then the group is gone; the barrier's work is
    still held during the pause (its last reference then dropped here)."""
    import time as time_module

    events = []
    real_barrier = dist.barrier

    def barrier(*args, **kwargs):
        work = real_barrier(*args, **kwargs)
        events.append(("barrier", kwargs.get("async_op", False)))
        return work

    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(time_module, "sleep", lambda s: events.append(("sleep", s, dist.is_initialized())))
    _one_rank_gloo(tmp_path)
    D.end_process_group(0.02)
    assert events == [("barrier", True), ("sleep", 0.02, True)]
    assert not dist.is_initialized()
    _one_rank_gloo(tmp_path, "store2")
    D.end_process_group()  # the default pause
    assert events[-1] == ("sleep", 0.05, True) and not dist.is_initialized()


def test_end_process_group_destroys_the_group_when_the_barrier_fails(tmp_path, monkeypatch):
    def barrier(*args, **kwargs):
        raise RuntimeError("a rank left")

    monkeypatch.setattr(dist, "barrier", barrier)
    _one_rank_gloo(tmp_path)
    with pytest.raises(RuntimeError, match="a rank left"):
        D.end_process_group()
    assert not dist.is_initialized()


def test_argument_errors():
    x = torch.randn(10)
    with pytest.raises(TypeError, match="k must be an int"):
        D.topk_threshold(x, 2.0)
    with pytest.raises(TypeError, match="k must be an int"):
        D.topk_threshold(x, True)
    with pytest.raises(TypeError, match="values must be a Tensor"):
        D.topk_threshold("x", 1)
    with pytest.raises(ValueError, match="k must be in"):
        D.topk_threshold(x, 11)
    with pytest.raises(ValueError, match="real floating"):
        D.topk_threshold(torch.ones(3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="at least one tensor"):
        D.topk_threshold([], 1)
    with pytest.raises(TypeError, match="group must be"):
        D.topk_threshold(x, 1, group="world")
    with pytest.raises(ValueError, match="budget"):
        D.project_budget(x, -1.0)
    with pytest.raises(ValueError, match=r"cost\[0\]"):
        D.project_budget(x, 1.0, torch.ones(11))
    with pytest.raises(TypeError, match="values"):
        D.all_reduce_sum(["a"])
    with pytest.raises(ValueError, match="one-element"):
        D.all_reduce_sum([torch.ones(2)])
    with pytest.raises(TypeError):
        D.all_reduce_sum(3.0)
    with pytest.raises(TypeError):
        D.local_tensor([1.0])
    y = torch.rand(5)
    with pytest.raises(ValueError, match="share memory"):
        D.project_budget_([y, y], 1.0)


# ----------------------------------------------------------------- the radix select

@st.composite
def threshold_case(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    sizes = draw(st.lists(st.sampled_from([0, 1, 2, 5, 100, 4097]), min_size=1, max_size=4))
    kind = draw(st.sampled_from(["randn", "ties", "zeros", "tiny", "huge", "one_value"]))
    seed = draw(st.integers(0, 2**31 - 1))
    kpos = draw(st.floats(0.0, 1.0))
    return dtype, sizes, kind, seed, kpos


def _threshold_data(dtype, sizes, kind, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in sizes:
        v = torch.randn(s, generator=g, dtype=torch.float64)
        if kind == "ties":
            v = v.mul(2).round()
        elif kind == "zeros":
            v = torch.where(v > 0, 0.0, -0.0).to(torch.float64)
        elif kind == "tiny":
            v = v * torch.finfo(dtype).tiny * 4  # subnormals and the smallest normals
        elif kind == "huge":
            v = v * (torch.finfo(dtype).max / 8)  # (the factor first: v * max overflows)
        elif kind == "one_value":
            v = torch.where(v > 0, 1.5, -1.5).to(torch.float64)
        out.append(v.to(dtype))
    return out


@settings(max_examples=60)
@given(threshold_case())
@example((torch.float32, [4097, 0, 5], "ties", 0, 1.0))
@example((torch.float64, [100, 1], "tiny", 1, 0.0))
@example((torch.bfloat16, [4097], "huge", 2, 0.5))
def test_radix_select_bit_identical(case):
    dtype, sizes, kind, seed, kpos = case
    vals = _threshold_data(dtype, sizes, kind, seed)
    n = sum(sizes)
    if n == 0:
        return
    k = min(n, 1 + int(kpos * n))
    want = one_threshold(vals, k)
    for compact in (frozenset({"cpu"}), frozenset()):
        saved, D._COMPACT_DEVICES = D._COMPACT_DEVICES, compact
        try:
            got = D._radix_select(vals, _one_process_plan(vals), k)
        finally:
            D._COMPACT_DEVICES = saved
        assert got.dtype == dtype and got.shape == ()
        assert got.view(_INT[dtype]).item() == want.view(_INT[dtype]).item(), (k, got, want)


@settings(max_examples=60)
@given(threshold_case())
@example((torch.float32, [4097, 0, 5], "ties", 0, 1.0))
@example((torch.float64, [100, 1], "tiny", 1, 0.0))
@example((torch.float32, [4097, 4097], "one_value", 2, 0.5))
def test_bracket_select_bit_identical(case):
    """The bracketed select (float32/float64 on the CPU) in one process: the
    bracket of two exact order statistics, then the radix passes among the
    elements inside it."""
    dtype, sizes, kind, seed, kpos = case
    if dtype not in (torch.float32, torch.float64):
        return
    vals = _threshold_data(dtype, sizes, kind, seed)
    n = sum(sizes)
    if n == 0:
        return
    k = min(n, 1 + int(kpos * n))
    got = D._bracket_select(vals, _one_process_plan(vals), k)
    want = one_threshold(vals, k)
    assert got.dtype == dtype and got.shape == ()
    assert got.view(_INT[dtype]).item() == want.view(_INT[dtype]).item(), (k, got, want)


@settings(max_examples=40)
@given(threshold_case())
@example((torch.float32, [4097, 0, 5], "ties", 0, 1.0))
@example((torch.float64, [300, 1], "tiny", 1, 0.0))
def test_bracket_select_from_a_strided_sample(case):
    """With a sample smaller than the shard (here about 64 values, in blocks
    of 4) the bracket comes from the sample's order statistics: still bit-identical
    (a bracket that misses falls back to the radix select over everything)."""
    dtype, sizes, kind, seed, kpos = case
    if dtype not in (torch.float32, torch.float64) or sum(sizes) == 0:
        return
    vals = _threshold_data(dtype, sizes, kind, seed)
    n = sum(sizes)
    k = min(n, 1 + int(kpos * n))
    saved = D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK
    D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK = 64, 64, 4
    try:
        assert n < 128 or _slice_sample([v.reshape(-1) for v in vals if v.numel()], n, D._sample_shape()).numel() < n
        got = D._bracket_select(vals, _one_process_plan(vals), k)
    finally:
        D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK = saved
    want = one_threshold(vals, k)
    assert got.view(_INT[dtype]).item() == want.view(_INT[dtype]).item(), (k, got, want)


def _simulated_ranks(ranks, k, dtype):
    """The bracketed select over ``ranks`` (a list of value lists, one per
    simulated rank) with its collectives done by hand: every rank's slice,
    the bracket ``[L, H]`` every rank derives from all slices, and each rank's
    count above ``H`` and candidates inside it (what the radix passes then
    select among)."""
    world = len(ranks)
    buckets = D._rank_buckets(world)
    keys = [[v.reshape(-1) for v in r if v.numel()] for r in ranks]
    owns = [D._OwnSlice.of_op(kk or [torch.empty(0, dtype=dtype)], k, world, buckets, 0)[0] for kk in keys]
    # the first collective: each rank's slice in its place of the summed vector
    area = torch.zeros(D._area(world), dtype=torch.int64)
    for r, o in enumerate(owns):
        at = r * (buckets + D._SLICE_HEAD)
        area[at:at + D._SLICE_HEAD] = torch.tensor(o.head)
        area[at + D._SLICE_HEAD:at + D._SLICE_HEAD + o.hist.numel()] = o.hist
    slices = D._slices(area, world, buckets)
    n = sum(o.n_r for o in owns)
    lo, hi = D._bracket_of_slices(slices, k, n, D._max_finite_bits(dtype))
    parts = [o.candidates(kk, lo, hi) for o, kk in zip(owns, keys)]
    return owns, lo, hi, sum(a for a, _ in parts), torch.cat([c.reshape(-1) for _, c in parts])


def _rank_data(dtype, sizes, kind, scales, seed):
    """One list per simulated rank: :func:`_threshold_data`'s tensors, rank
    ``r``'s scaled by ``scales[r]`` (unlike ranks; "huge" values, up to an
    eighth of the largest float, only scaled down, so they stay finite)."""
    return [[v * (min(s, 1.0) if kind == "huge" else s)]
            for v, s in zip(_threshold_data(dtype, sizes, kind, seed), scales)]


def _bits(t):
    return t.view(_INT[t.dtype]).item()


@st.composite
def ranks_case(draw, shard_sizes=(0, 1, 3, 100, 700, 3000)):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    sizes = draw(st.lists(st.sampled_from(shard_sizes), min_size=1, max_size=5))
    kind = draw(st.sampled_from(["randn", "ties", "zeros", "tiny", "huge", "one_value"]))
    # rank r's values scaled by scales[r]: unlike ranks, whose own brackets miss the threshold
    scales = draw(st.lists(st.sampled_from([1.0, 1.0, 1.0, 0.5, 1.01, 4.0, 1e-3]), min_size=len(sizes),
                           max_size=len(sizes)))
    seed = draw(st.integers(0, 2**31 - 1))
    kpos = draw(st.floats(0.0, 1.0))
    return dtype, sizes, kind, scales, seed, kpos


@settings(max_examples=80, deadline=None)
@given(ranks_case())
@example((torch.float32, [3000, 3000, 3000], "randn", [1.0, 1.0, 1.0], 0, 0.1))
@example((torch.float32, [3000, 3000], "randn", [1.0, 4.0], 1, 0.1))
@example((torch.float64, [3000, 0, 1], "ties", [1.0, 1.0, 1e-3], 2, 1.0))
@example((torch.float32, [700, 3000], "one_value", [1.0, 1.0], 3, 0.5))
def test_bracket_of_the_slices_holds_the_threshold(case):
    """Several ranks simulated in one process, with a sample smaller than the
    shards: the bracket [L, H] every rank derives from the slices holds the
    k-th largest, and the candidates inside it (with the counts above it)
    select it bit for bit, whether the ranks' own brackets hold it or not
    (unlike ranks take a second pass)."""
    dtype, sizes, kind, scales, seed, kpos = case
    ranks = _rank_data(dtype, sizes, kind, scales, seed)
    n = sum(sizes)
    if n == 0:
        return
    k = min(n, 1 + int(kpos * n))
    want = one_threshold([r[0] for r in ranks], k)
    saved = D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK
    D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK = 64, 64, 4
    try:
        owns, lo, hi, above, cands = _simulated_ranks(ranks, k, dtype)
    finally:
        D._SAMPLE_MIN, D._SAMPLE_MAX, D._SAMPLE_BLOCK = saved
    assert lo <= _bits(want) <= hi
    assert above < k <= above + cands.numel()
    got = torch.kthvalue(cands, cands.numel() - (k - above) + 1).values
    assert _bits(got) == _bits(want), (k, got, want)


def _counting_passes(ranks, k):
    """:func:`_simulated_ranks` in float32, with the size of the first tensor
    of every fused bracket pass it makes after the first round's (which runs
    inside ``topk_slice``): a second read of a rank's values, or a pass over
    its candidates."""
    passes = []
    inner = D._topk_bracket
    D._topk_bracket = lambda keys, lo, hi: passes.append(keys[0].numel()) or inner(keys, lo, hi)
    try:
        return _simulated_ranks(ranks, k, torch.float32) + (passes,)
    finally:
        D._topk_bracket = inner


def test_alike_ranks_need_one_pass_and_one_bucket():
    """Ranks whose values are alike (FSDP2's shards of the same layers): the
    bracket is one bucket of the ranks' common grid, no rank reads its values
    a second time, and one radix pass (at most 2048 buckets) finishes."""
    g = torch.Generator().manual_seed(11)
    ranks = [[torch.randn(200_000, generator=g)] for _ in range(2)]
    k = 40_000
    owns, lo, hi, above, cands, passes = _counting_passes(ranks, k)
    assert passes.count(200_000) == 0  # no second read of the values (the others: over candidates)
    assert len({o.j for o in owns}) == 1 and hi - lo + 1 == 1 << owns[0].j <= 1 << D._HIST0_BITS
    want = one_threshold([r[0] for r in ranks], k)
    assert _bits(torch.kthvalue(cands, cands.numel() - (k - above) + 1).values) == _bits(want)


@pytest.mark.parametrize("scale,rereads", [(1.0, 0), (1.05, 3), (0.01, 3), (100.0, 3)])
def test_ranks_whose_bracket_misses_read_their_values_again(scale, rereads):
    """Two alike ranks and a third one scaled by ``scale``. Alike, every
    rank's bracket of its equal share holds the threshold: one pass each.
    Values 5% larger, or 100x smaller or larger, on the third rank move the
    threshold out of every rank's own bracket, so [L, H] spans from one
    bracket to another and every rank reads its values a second time:
    slower, still exact. (Each rank brackets k / W of its values: shards of
    unequal sizes miss in the same way.)"""
    g = torch.Generator().manual_seed(12)
    ranks = [[torch.randn(50_000, generator=g)], [torch.randn(50_000, generator=g)]]
    ranks.append([torch.randn(50_000, generator=g) * scale])
    k = 20_000
    owns, lo, hi, above, cands, passes = _counting_passes(ranks, k)
    missed = [not (o.start <= lo and hi < o.stop) for o in owns]
    assert sum(missed) == rereads and passes.count(50_000) == rereads  # (the others: over candidates)
    want = one_threshold([r[0] for r in ranks], k)
    assert _bits(torch.kthvalue(cands, cands.numel() - (k - above) + 1).values) == _bits(want)


def test_rank_buckets_fit_the_first_collective():
    for world in (1, 2, 3, 8, 9, 29, 30, 64, 512):
        b = D._rank_buckets(world)
        assert b >= 64 and world * (b + D._SLICE_HEAD) <= D._slice_area(world)
        assert D._slice_area(world) == 2048 or b == 64  # 2048 slots until the 64-bucket floor
        # the windows: 8192 slots up to 8 ranks (at least 1020 values per rank), none beyond
        w = D._window_area(world)
        assert w == (8192 if world <= 8 else 0)
        assert not w or world * (D._window_slots(world) + D._WINDOW_HEAD) <= w and D._window_slots(world) >= 1020
        assert D._area(world) == D._slice_area(world) + w
    assert D._first_size(2) == 2048 + 8192 + 9
    assert D._first_size(9) == 2048 + 9


def test_bracket_select_non_finite():
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(200)
        x[3] = bad
        with pytest.raises(ValueError, match="non-finite"):
            D._bracket_select([x], _one_process_plan([x]), 2)
        assert D._bracket_select([x], _one_process_plan([x]), 2, nonfinite_is_none=True) is None


def test_radix_select_every_k_with_ties(radix_mode):
    g = torch.Generator().manual_seed(3)
    vals = [torch.randint(-4, 5, (40,), generator=g).float(), torch.tensor([0.0, -0.0, 4.0, -4.0])]
    for k in range(1, 45):
        got = D._radix_select(vals, _one_process_plan(vals), k)
        assert got.view(torch.int32).item() == one_threshold(vals, k).view(torch.int32).item()


def test_radix_select_non_contiguous_and_large(radix_mode):
    g = torch.Generator().manual_seed(4)
    big = torch.randn(600, 700, generator=g)  # > one radix chunk
    vals = [big.t(), torch.randn(10, generator=g)[::3]]
    for k in (1, 1000, 210_000, 420_004):
        got = D._radix_select(vals, _one_process_plan(vals), k)
        assert got.view(torch.int32).item() == one_threshold([v.contiguous() for v in vals], k).view(torch.int32).item()


def test_radix_select_non_finite(radix_mode):
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(20)
        x[3] = bad
        with pytest.raises(ValueError, match="non-finite"):
            D._radix_select([x], _one_process_plan([x]), 2)


# ----------------------------------------------------------------- the bracketing projection

def _project(thetas, budget, costs=None):
    blocks = []
    for i, t in enumerate(thetas):
        blocks += D._chunks(t, costs[i] if costs is not None else None)
    lam = D._solve_lambda(blocks, costs is not None, budget, _one_process_plan(thetas), torch.device("cpu"))
    outs = []
    for i, t in enumerate(thetas):
        out = torch.empty_like(t)
        D._write_projection(t, costs[i] if costs is not None else None, lam, out)
        outs.append(out)
    return outs


def _assert_exact(thetas, budget, costs=None, scale=1.0):
    got = _project(thetas, budget, costs)
    exact = project_budget_sort([t.double() for t in thetas], budget,
                                [c.double() for c in costs] if costs is not None else None)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}[thetas[0].dtype] * scale
    for g, e in zip(got, exact):
        if g.numel():
            assert (g.double() - e).abs().max().item() <= tol, (budget, (g.double() - e).abs().max().item())


@st.composite
def projection_case(draw):
    n = draw(st.sampled_from([1, 7, 4097, 30_000]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**31 - 1))
    pattern = draw(st.sampled_from(PATTERNS))
    density = draw(st.sampled_from([0.0, 1e-4, 0.01, 0.1, 0.3, 0.5, 0.9, 0.99, 1.5]))
    cost = draw(st.sampled_from(COSTS))
    return n, dtype, seed, pattern, density, cost


@settings(max_examples=40)
@given(projection_case())
@example((30_000, torch.float64, 0, "ties", 0.3, None))
@example((30_000, torch.float64, 1, "uniform", 0.1, "orders"))
@example((4097, torch.float32, 2, "tiny_free", 0.3, "near_one"))
def test_bracketing_projection_exact(case):
    n, dtype, seed, pattern, density, cost = case
    t, c = projection_data(n, torch.float64, seed, pattern, cost)
    total = n if c is None else float(c.sum())
    scale = max(1.0, float(t.abs().max()))
    _assert_exact([t.to(dtype)], density * total, None if c is None else [c.to(dtype)], scale=scale)


def test_bracketing_projection_ties_and_tie_root():
    n = 1 << 16
    t = torch.full((n,), 0.7, dtype=torch.float64)
    for S in (0.0, 1.0, 0.3 * n, 0.7 * n, float(n)):
        _assert_exact([t], S)
    t[1::2] = 0.3
    _assert_exact([t], 0.2 * n)  # lambda* = 0.3 exactly, the breakpoint of half the elements


def test_bracketing_projection_lists_and_half_precision():
    g = torch.Generator().manual_seed(9)
    ts = [torch.rand(1000, generator=g, dtype=torch.float64) * 1.2, torch.rand(0, dtype=torch.float64),
          torch.rand(5, 7, generator=g, dtype=torch.float64)]
    for S in (0.0, 10.0, 500.0, 2000.0):
        _assert_exact(ts, S)
    for dtype, tol in ((torch.float16, 1e-3), (torch.bfloat16, 1e-2)):
        t = (torch.rand(3000, generator=g) * 1.2).to(dtype)
        got = _project([t], 300.0)[0]
        want = one_projection(t, 300.0)
        assert got.dtype == dtype and (got.double() - want.double()).abs().max().item() <= tol


def test_buckets_index_counts_edges_below():
    """A key's bucket is integer arithmetic on its bits: the number of edges
    strictly below it, also for keys exactly on an edge, negative keys, -0.0 and inf."""
    g = torch.Generator().manual_seed(10)
    for lo, hi in ((0.0, math.inf), (0.5, 1.0), (0.3, 0.30000000000000004 * 3), (1e-300, 2e-300),
                   (0.25, 0.25 + 2 ** -40)):
        b = D._Buckets(lo, hi)
        edges = b.edges
        assert b.nb <= D._PROJ_BUCKETS and torch.all(edges[1:] > edges[:-1])
        keys = torch.cat([edges, edges.nextafter(torch.tensor(math.inf, dtype=torch.float64)),
                          edges.nextafter(torch.tensor(-math.inf, dtype=torch.float64)),
                          lo + (hi - lo if math.isfinite(hi) else 1e300) * torch.rand(1000, generator=g,
                                                                                       dtype=torch.float64),
                          torch.tensor([-1.0, -0.0, 0.0, 5e-324, math.inf], dtype=torch.float64)])
        keys = keys[~torch.isnan(keys)]
        want = torch.searchsorted(edges, keys, side="left")  # edges strictly below
        got = b.index(keys)
        if not math.isfinite(hi):  # nothing lies above inf: a key at inf is in the last bucket
            want = want.clamp(max=b.nb)
        assert torch.equal(got, want), (lo, hi)
