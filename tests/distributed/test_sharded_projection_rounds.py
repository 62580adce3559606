"""The sharded projection's solver on the CPU (``_bracketed_lambda``: a
sample collective, then passes of the ``project_budget_bracket`` op with the
kept elements gathered and solved exactly) with several ranks simulated as
threads of one process (tests/distributed/_simranks.py), against the float64
sort solution on the concatenation of every rank's elements; the fallbacks
to the histogram search when a bracket is refuted; the sizes and number of
the collectives. tests/distributed/test_sharded_projection.py runs the
public functions on two real ranks."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings, strategies as st

import prunopt.distributed as D
from prunopt.reference.projection import project_budget_sort

from tests.distributed._projection_data import COSTS, PATTERNS, projection_data
from tests.distributed._simranks import SimRanks, plan_of

pytestmark = [
    pytest.mark.skipif(dist.is_available() and dist.is_initialized(),
                       reason="needs a process without a default process group"),
    pytest.mark.skipif(not D._PROJ_DEVICES, reason="compiled extension without project_budget_bracket"),
]
# (float16 / bfloat16: the result itself is rounded to the dtype, an ulp at 1)
_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def _solve(ranks, budget, costs=None, *, world=None):
    """Every rank's lambda, exception and all_reduce sizes."""
    world = world or len(ranks)
    sim = SimRanks(world)

    def fn(r):
        cs = costs[r] if costs is not None else None
        return D._solve_for(plan_of(ranks[r], world), cs, budget)

    out, errs = sim.run(fn)
    return out, errs, sim.calls


def _check_exact(ranks, budget, costs=None, scale=1.0):
    out, errs, calls = _solve(ranks, budget, costs)
    assert all(e is None for e in errs), errs
    assert len(set(out)) == 1, out  # the same lambda on every rank
    lam = out[0]
    ts = [t for r in ranks for t in r]
    cs = [c for r in costs for c in r] if costs is not None else None
    if not ts:
        return calls
    exact = project_budget_sort([t.double() for t in ts], budget, [c.double() for c in cs] if cs else None)
    for i, (t, e) in enumerate(zip(ts, exact)):
        got = torch.empty_like(t)
        D._write_projection(t, cs[i] if cs else None, lam, got)
        if t.numel():
            tol = _TOL[t.dtype] * scale
            assert (got.double() - e).abs().max().item() <= tol, (budget, (got.double() - e).abs().max().item())
    return calls


@st.composite
def sharded_case(draw):
    world = draw(st.sampled_from([1, 2, 3, 5]))
    sizes = [draw(st.sampled_from([0, 1, 7, 3000, 40_000])) for _ in range(world)]
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16]))
    seed = draw(st.integers(0, 2**31 - 1))
    pattern = draw(st.sampled_from(PATTERNS))
    density = draw(st.sampled_from([0.0, 1e-4, 0.01, 0.1, 0.5, 0.9, 1.5]))
    cost = draw(st.sampled_from(COSTS))
    skew = draw(st.sampled_from([1.0, 1.05, 100.0]))  # the last rank's scores scaled
    return world, sizes, dtype, seed, pattern, density, cost, skew


@settings(max_examples=40, deadline=None)
@given(sharded_case())
@example((2, [40_000, 40_000], torch.float32, 0, "uniform", 0.1, None, 1.0))
@example((3, [40_000, 0, 7], torch.float64, 1, "ties", 0.5, "orders", 1.0))
@example((2, [3000, 40_000], torch.float32, 2, "tiny_free", 0.1, "near_one", 100.0))
def test_sharded_projection_exact(case):
    """Any split over 1-5 ranks (empty ranks, a rank with different scores),
    dtypes, ties and costs: the float64 sort solution of all elements, the
    same lambda on every rank."""
    world, sizes, dtype, seed, pattern, density, cost, skew = case
    ranks, costs = [], []
    for r, n in enumerate(sizes):
        t, c = projection_data(n, dtype, seed + r, pattern, cost)
        if r == world - 1 and skew != 1.0:
            t = (t.double() * skew).to(dtype)
        ranks.append([t])
        costs.append([c] if c is not None else None)
    if cost is None:
        costs = None
    elif any(c is None for c in costs):
        costs = [[torch.ones_like(r[0])] if c is None else c for r, c in zip(ranks, costs)]
    total = sum(sizes) if costs is None else sum(float(c[0].double().sum()) for c in costs)
    scale = max([1.0] + [float(r[0].double().abs().max()) for r in ranks if r[0].numel()])
    _check_exact(ranks, density * total, costs, scale=scale)


def test_alike_ranks_take_three_collectives_of_bounded_size():
    """Shards alike (uniform scores, 2 ranks): the sample collective, the pass
    over the data, a pass over what it kept (gathered and solved exactly)."""
    g = torch.Generator().manual_seed(3)
    ranks = [[torch.rand(200_000, generator=g) * 1.2] for _ in range(2)]
    calls = _check_exact(ranks, 0.1 * 400_000)
    first, per_pass = D._proj_sizes(2)
    for c in calls:
        assert len(c) == 3 and c[0] == 8 * first and max(c[1:]) <= 8 * per_pass
    assert 8 * (first + 2 * per_pass) < 1 << 20  # < 1 MB in all


@pytest.mark.parametrize("budget,calls", [(0.0, 2), (1e9, 2)])
def test_zero_and_slack_budgets_take_two_collectives(budget, calls):
    g = torch.Generator().manual_seed(4)
    ranks = [[torch.rand(50_000, generator=g) * 1.2] for _ in range(2)]
    got = _check_exact(ranks, budget)
    assert [len(c) for c in got] == [calls, calls]


def test_few_elements_are_gathered_after_the_first_pass():
    # 3000 elements per rank: the first pass keeps few enough to gather and solve
    g = torch.Generator().manual_seed(5)
    ranks = [[torch.rand(3000, generator=g) * 1.2] for _ in range(2)]
    calls = _check_exact(ranks, 600.0)
    assert [len(c) for c in calls] == [2, 2]


def test_misleading_sample_falls_back_to_the_histogram_search(monkeypatch):
    """A bracket far narrower than the sample's error (z = 1e-6 sigma) is
    refuted by the sums at its ends: the histogram search takes over from
    scratch (more collectives), still exact."""
    monkeypatch.setattr(D, "_PROJ_Z", 1e-6)
    monkeypatch.setattr(D, "_PROJ_MIN_WIDTH", 0.0)
    g = torch.Generator().manual_seed(6)
    ranks = [[torch.rand(100_000, generator=g) * 1.2] for _ in range(2)]
    calls = _check_exact(ranks, 0.1 * 200_000)
    assert all(len(c) > 3 for c in calls)


def test_refuted_sub_bracket_goes_on_from_the_last_verified_one(monkeypatch):
    """A proposal from the histograms that the next pass refutes: the
    histogram search goes on from the bracket verified before it."""
    refuted = []
    real = D._propose

    def wrong(hist, free_cc, buckets, phi_lo, phi_hi):  # the first proposal: the wrong sub-bucket
        lo, hi = real(hist, free_cc, buckets, phi_lo, phi_hi)
        if not refuted:
            refuted.append((lo, hi))
            j = 0 if float(buckets.edges[1]) < lo else 1
            return float(buckets.edges[j]), float(buckets.edges[j + 1])
        return lo, hi

    monkeypatch.setattr(D, "_propose", wrong)
    starts = []
    solve = D._solve_lambda
    monkeypatch.setattr(D, "_solve_lambda", lambda *a, **k: starts.append(k.get("start")) or solve(*a, **k))
    g = torch.Generator().manual_seed(7)
    ranks = [[torch.rand(300_000, generator=g) * 1.2]]
    _check_exact(ranks, 0.1 * 300_000)
    assert refuted and starts and starts[0] is not None


def test_tied_breakpoints_at_the_root():
    """Every score equal: the kept elements never shrink below the gather
    capacity, the bracket narrows to a few ulps (as the histogram search)."""
    ranks = [[torch.full((5000,), 0.7, dtype=torch.float64)] for _ in range(2)]
    for S in (0.0, 1.0, 3000.0, 7000.0, 10_000.0):
        _check_exact(ranks, S)


@pytest.mark.parametrize("bad", ["nan_score", "inf_score", "zero_cost", "nan_cost"])
def test_bad_input_on_one_rank_raises_on_every_rank(bad):
    g = torch.Generator().manual_seed(8)
    ranks = [[torch.rand(1000, generator=g)] for _ in range(2)]
    costs = [[torch.rand(1000, generator=g) + 0.5] for _ in range(2)]
    if bad == "nan_score":
        ranks[1][0][17] = math.nan
    elif bad == "inf_score":
        ranks[1][0][3] = math.inf
    elif bad == "zero_cost":
        costs[1][0][5] = 0.0
    else:
        costs[1][0][5] = math.nan
    out, errs, _ = _solve(ranks, 100.0, costs)
    text = "theta contains a non-finite" if "score" in bad else "cost must be positive"
    assert all(isinstance(e, ValueError) and text in str(e) for e in errs), errs


def test_disagreements_raise_on_every_rank():
    g = torch.Generator().manual_seed(9)
    ranks = [[torch.rand(1000, generator=g)] for _ in range(2)]
    sim = SimRanks(2)
    out, errs = sim.run(lambda r: D._solve_for(plan_of(ranks[r], 2), None, 10.0 + r))
    assert all(isinstance(e, ValueError) and "same on every rank" in str(e) for e in errs), errs
    sim = SimRanks(2)
    costs = [torch.ones(1000)]
    out, errs = sim.run(lambda r: D._solve_for(plan_of(ranks[r], 2), costs if r else None, 10.0))
    assert all(isinstance(e, ValueError) and "every rank or on none" in str(e) for e in errs), errs


def test_sample_bracket_holds_the_root_of_the_sample():
    g = torch.Generator().manual_seed(10)
    t = torch.rand(4096, generator=g, dtype=torch.float64) * 1.2
    slots = [(1_000_000, t[:2048], torch.ones(2048, dtype=torch.float64)),
             (1_000_000, t[2048:], torch.ones(2048, dtype=torch.float64))]
    lo, hi = D._sample_bracket_of(slots, 0.1 * 2_000_000)
    w = torch.full_like(t, 1_000_000 / 2048)
    phi = lambda lam: D._phi_at(t, torch.ones_like(t), w, (0.0, 0.0, 0.0), 0.1 * 2_000_000, lam)  # noqa: E731
    assert 0 <= lo < hi and phi(lo) > 0 >= phi(hi)
    assert (hi - lo) < 0.1  # a few percent of the scores' range, not all of it


def test_set_root_is_the_exact_root():
    g = torch.Generator().manual_seed(11)
    t = torch.rand(500, generator=g, dtype=torch.float64) * 1.2
    c = torch.rand(500, generator=g, dtype=torch.float64) + 0.5
    S = 40.0
    lam = D._set_root(t, c, None, (0.0, 0.0, 0.0), S, 0.0, float((t / c).max()))
    want = project_budget_sort(t, S, c)
    assert (( t - lam * c).clamp(0, 1) - want).abs().max().item() <= 1e-13
