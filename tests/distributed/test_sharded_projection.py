"""prunopt.distributed.project_budget(_) on two gloo ranks.

Every scenario runs on both ranks of one process group (tests/distributed/_dist.py).
Each rank builds the whole problem from a fixed seed, projects its shard jointly
with the other rank's, and returns its part beside the same part of the
one-process projection (prunopt.ops.project_budget) of the concatenation and of
the float64 sort solution (prunopt.reference.projection.project_budget_sort).
The accuracy asked of every projection: 1e-12 in float64, 1e-5 in float32 against the sort solution.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import error, ok, run_scenarios

_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _pieces(full: torch.Tensor, rank: int, cut: int):
    flat = full.reshape(-1)
    return flat[:cut] if rank == 0 else flat[cut:]


def _compare(fulls, costs, cuts, rank, budgets, inplace=False):
    """(budget, sharded parts, one-process parts, sort parts) for each budget."""
    from prunopt.distributed import project_budget, project_budget_
    from prunopt.ops import project_budget as one
    from prunopt.reference.projection import project_budget_sort

    out = []
    for S in budgets:
        mine = [_pieces(f, rank, c).clone() for f, c in zip(fulls, cuts)]
        my_cost = [_pieces(c_, rank, c) for c_, c in zip(costs, cuts)] if costs is not None else None
        if inplace:
            ret = project_budget_(mine, S, my_cost)
            assert ret is mine
            got = mine
        else:
            got = project_budget(mine, S, my_cost)
        ref = one(list(fulls), S, list(costs) if costs is not None else None)
        exact = project_budget_sort([f.double() for f in fulls], S, [c.double() for c in costs] if costs else None)
        out.append((S, got, [_pieces(r, rank, c) for r, c in zip(ref, cuts)],
                    [_pieces(e, rank, c) for e, c in zip(exact, cuts)]))
    return out


def _budgets(fulls, costs):
    total = sum(float(c.double().sum()) for c in costs) if costs is not None else sum(f.numel() for f in fulls)
    clamped = sum(float((f.double().clamp(0, 1) * (c.double() if costs is not None else 1)).sum())
                  for f, c in zip(fulls, costs if costs is not None else fulls))
    # zero, tight, medium, just below phi(0) = 0, exactly phi(0) = 0 and beyond (slack: clamp only)
    return [0.0, 0.01 * total, 0.3 * total, clamped * (1 - 1e-9), clamped, 2.0 * total]


# ----------------------------------------------------------------- scenarios

def sc_unit(rank, world):
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.float64, torch.float32):
        fulls = [(torch.rand(3001, generator=g, dtype=torch.float64) * 1.4 - 0.2).to(dtype),
                 (torch.rand(40, 7, generator=g, dtype=torch.float64) * 1.2).to(dtype)]
        out += _compare(fulls, None, (1000, 100), rank, _budgets(fulls, None))
    return out


def sc_costs(rank, world):
    g = torch.Generator().manual_seed(1)
    fulls = [torch.rand(2000, generator=g, dtype=torch.float64) * 1.2,
             torch.rand(300, generator=g, dtype=torch.float64)]
    out = []
    for spread in (1.0, 6.0):  # costs in [0.5, 1.5], then over six orders of magnitude
        costs = [10 ** ((torch.rand(f.shape, generator=g, dtype=torch.float64) - 0.5) * spread) for f in fulls]
        out += _compare(fulls, costs, (1500, 10), rank, _budgets(fulls, costs))
    f32 = [f.float() for f in fulls]
    c32 = [(torch.rand(f.shape, generator=g) + 0.5) for f in fulls]
    out += _compare(f32, c32, (700, 290), rank, _budgets(f32, c32))
    return out


def sc_ties(rank, world):
    g = torch.Generator().manual_seed(2)
    levels = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25], dtype=torch.float64)
    full = levels[torch.randint(0, 6, (4000,), generator=g)]
    n = full.numel()
    budgets = [0.1 * n, 0.25 * n, 0.5 * n]
    # budgets whose root lies exactly on a tied breakpoint: lambda* = 0.25 takes 0.25-scores to 0
    counts = [(full == v).sum().item() for v in levels]
    at_tie = sum(c * min(max(float(v) - 0.25, 0.0), 1.0) for c, v in zip(counts, levels))
    out = _compare([full], None, (1234,), rank, budgets + [at_tie])
    same = torch.full((5000,), 0.7, dtype=torch.float64)  # one value everywhere
    out += _compare([same], None, (2500,), rank, [0.3 * 5000, 3500.0])
    return out


def sc_uneven_and_empty(rank, world):
    g = torch.Generator().manual_seed(3)
    full = torch.rand(999, generator=g, dtype=torch.float64) * 1.2
    out = []
    for cut in (999, 0, 1):  # rank 1 holds an empty tensor, then rank 0, then one element only
        out += _compare([full], None, (cut,), rank, [0.0, 50.0, 500.0])
    return out


def sc_empty_list(rank, world):
    """A rank may pass no tensors at all."""
    from prunopt.distributed import project_budget
    from prunopt.ops import project_budget as one

    g = torch.Generator().manual_seed(4)
    full = torch.rand(500, generator=g, dtype=torch.float64)
    got = project_budget([full.clone()] if rank == 0 else [], 100.0)
    return got, one([full], 100.0)


def sc_inplace(rank, world):
    g = torch.Generator().manual_seed(5)
    fulls = [torch.rand(800, generator=g, dtype=torch.float64) * 1.3, torch.rand(64, generator=g, dtype=torch.float64)]
    costs = [torch.rand(f.shape, generator=g, dtype=torch.float64) + 0.2 for f in fulls]
    return _compare(fulls, costs, (333, 64), rank, _budgets(fulls, costs), inplace=True)


def sc_large(rank, world):
    """Enough elements for several passes, blocks and compaction."""
    g = torch.Generator().manual_seed(6)
    full = torch.rand(1_200_000, generator=g, dtype=torch.float64) * 1.2
    return _compare([full], None, (500_000,), rank, [0.1 * full.numel(), 0.6 * full.numel()])


def sc_dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from prunopt.distributed import project_budget, project_budget_
    from prunopt.ops import project_budget as one

    g = torch.Generator().manual_seed(7)
    mesh = init_device_mesh("cpu", (world,))
    rows = torch.rand(7, 5, generator=g, dtype=torch.float64) * 1.2  # shards of 4 and 3 rows
    rep = torch.rand(13, generator=g, dtype=torch.float64)
    crow = torch.rand(7, 5, generator=g, dtype=torch.float64) + 0.5
    crep = torch.rand(13, generator=g, dtype=torch.float64) + 0.5
    s, r = distribute_tensor(rows, mesh, [Shard(0)]), distribute_tensor(rep, mesh, [Replicate()])
    cs, cr = distribute_tensor(crow, mesh, [Shard(0)]), distribute_tensor(crep, mesh, [Replicate()])
    out = {}
    got = project_budget([s, r], 9.0, [cs, cr])
    out["kinds"] = [(type(x).__name__, tuple(x.placements), tuple(x.shape)) for x in got]
    out["out"] = [x.full_tensor() for x in got]
    out["want"] = one([rows, rep], 9.0, [crow, crep])  # the replicated scores count once
    s2 = distribute_tensor(rows, mesh, [Shard(0)])
    ret = project_budget_(s2, 4.0)
    out["inplace_same"] = ret is s2
    out["inplace"] = s2.full_tensor()
    out["inplace_want"] = one(rows, 4.0)
    out["dtensor_type"] = all(isinstance(x, DTensor) for x in got)
    return out


def sc_collectives(rank, world):
    """The number and size of the all_reduce calls of one projection."""
    from prunopt.distributed import project_budget

    calls = []
    orig = dist.all_reduce

    def counting(t, *a, **kw):
        calls.append(t.numel() * t.element_size())
        return orig(t, *a, **kw)

    g = torch.Generator().manual_seed(8)
    out = {}
    dist.all_reduce = counting
    try:
        for n in (1000, 200_000):
            t = torch.rand(n, generator=g, dtype=torch.float64) * 1.2
            for name, S in (("slack", 2.0 * n), ("zero", 0.0), ("tight", 0.1 * n)):
                calls.clear()
                project_budget(t, S)
                out[(name, n)] = list(calls)
    finally:
        dist.all_reduce = orig
    return out


def sc_err_nonfinite(rank, world):
    from prunopt.distributed import project_budget_

    x = torch.rand(20, dtype=torch.float64)
    before = x.clone()
    if rank == 0:
        x[3] = float("nan")
        before[3] = float("nan")
    try:
        project_budget_(x, 5.0)
    except ValueError as e:
        return "ValueError", str(e), torch.equal(x.nan_to_num(7.0), before.nan_to_num(7.0))
    return None


def sc_err_cost(rank, world):
    from prunopt.distributed import project_budget_

    x = torch.rand(20, dtype=torch.float64)
    c = torch.ones(20, dtype=torch.float64)
    before = x.clone()
    if rank == 1:
        c[5] = -1.0
    try:
        project_budget_(x, 5.0, c)
    except ValueError as e:
        return "ValueError", str(e), torch.equal(x, before)
    return None


def sc_err_budget_differs(rank, world):
    from prunopt.distributed import project_budget

    return project_budget(torch.rand(20), 5.0 + rank)


def sc_err_cost_on_one_rank(rank, world):
    from prunopt.distributed import project_budget

    return project_budget(torch.rand(20), 5.0, torch.ones(20) if rank == 0 else None)


def sc_err_negative_budget(rank, world):
    from prunopt.distributed import project_budget

    return project_budget(torch.rand(20), -1.0)


def sc_err_shape(rank, world):
    from prunopt.distributed import project_budget

    return project_budget(torch.rand(20), 1.0, torch.ones(21))


def sc_after_errors(rank, world):
    from prunopt.distributed import project_budget
    from prunopt.ops import project_budget as one

    g = torch.Generator().manual_seed(9)
    full = torch.rand(100, generator=g, dtype=torch.float64)
    return project_budget(full[:30] if rank == 0 else full[30:], 10.0), one(full, 10.0), rank


SCENARIOS = [sc_unit, sc_costs, sc_ties, sc_uneven_and_empty, sc_empty_list, sc_inplace, sc_large, sc_dtensor,
             sc_collectives, sc_err_nonfinite, sc_err_cost, sc_err_budget_differs, sc_err_cost_on_one_rank,
             sc_err_negative_budget, sc_err_shape, sc_after_errors]


@pytest.fixture(scope="module")
def results():
    return run_scenarios(SCENARIOS, world_size=2)


def _assert_close(per_rank):
    for rank, cases in enumerate(per_rank):
        assert cases
        for S, got, ref, exact in cases:
            for g, r, e in zip(got, ref, exact):
                tol = _TOL[g.dtype] * max(1.0, float(e.abs().max()) if e.numel() else 1.0)
                assert g.dtype == r.dtype and g.shape == r.shape and not g.requires_grad
                assert (g.double() - e).abs().max().item() <= tol if g.numel() else True, (rank, S)
                assert (g.double() - r.double()).abs().max().item() <= 2 * tol if g.numel() else True, (rank, S)
                assert g.min() >= 0 and g.max() <= 1 if g.numel() else True


@pytest.mark.parametrize("name", ["sc_unit", "sc_costs", "sc_ties", "sc_uneven_and_empty", "sc_inplace",
                                  "sc_large"])
def test_equals_one_process(results, name):
    _assert_close(ok(results[name]))


def test_budget_is_met_jointly(results):
    # the sharded parts of a tight unit-cost budget sum to the budget over both ranks
    r0, r1 = ok(results["sc_large"])
    S, got0, _, _ = r0[0]
    _, got1, _, _ = r1[0]
    assert abs(float(got0[0].double().sum() + got1[0].double().sum()) - S) <= 1e-6 * S


def test_empty_list_on_a_rank(results):
    (got0, want0), (got1, want1) = ok(results["sc_empty_list"])
    assert got1 == [] and (got0[0] - want0[0]).abs().max().item() <= 1e-12


def test_dtensors(results):
    for r in ok(results["sc_dtensor"]):
        assert r["dtensor_type"] and r["inplace_same"]
        assert r["kinds"][0][1][0].is_shard() and r["kinds"][1][1][0].is_replicate()
        assert [k[2] for k in r["kinds"]] == [(7, 5), (13,)]
        for got, want in zip(r["out"], r["want"]):
            assert (got - want).abs().max().item() <= 1e-12
        assert (r["inplace"] - r["inplace_want"]).abs().max().item() <= 1e-12


def test_collectives_are_few_and_small(results):
    from prunopt.distributed import _PROJ_DEVICES, _proj_sizes

    first, per_pass = _proj_sizes(2)
    for per_rank in ok(results["sc_collectives"]):
        for (name, n), calls in per_rank.items():
            if not _PROJ_DEVICES:  # (the histogram search alone: 82 KB at most per pass)
                assert max(calls) <= (10 + 11 + 5 * 2050) * 8 and len(calls) <= 8, calls
                continue
            # the sample (131 KB), then passes of at most 148 KB
            assert calls[0] == 8 * first and max(calls[1:]) <= 8 * per_pass, (name, n, calls)
            if name in ("slack", "zero"):
                assert len(calls) == 2, (name, n, calls)  # the first pass decides
            else:
                assert 2 <= len(calls) <= 3, (name, n, calls)  # the kept elements solved at the first or second


@pytest.mark.parametrize("name,kind,text", [
    ("sc_err_budget_differs", "ValueError", "same on every rank"),
    ("sc_err_cost_on_one_rank", "ValueError", "every rank or on none"),
    ("sc_err_negative_budget", "ValueError", "budget"),
    ("sc_err_shape", "ValueError", "cost[0]"),
])
def test_errors_raised_on_every_rank(results, name, kind, text):
    for got_kind, message in error(results[name]):
        assert got_kind == kind and text in message, (got_kind, message)


@pytest.mark.parametrize("name,text", [("sc_err_nonfinite", "non-finite"), ("sc_err_cost", "cost")])
def test_data_errors_raised_on_every_rank_before_writing(results, name, text):
    for r in ok(results[name]):
        assert r is not None and r[0] == "ValueError" and text in r[1]
        assert r[2]  # theta unchanged on every rank


def test_group_in_step_after_errors(results):
    for got, want, rank in ok(results["sc_after_errors"]):
        part = want[:30] if rank == 0 else want[30:]
        assert (got - part).abs().max().item() <= 1e-12
