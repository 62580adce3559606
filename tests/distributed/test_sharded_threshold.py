"""prunopt.distributed.topk_threshold and the small helpers on two gloo ranks.

Every scenario runs on both ranks of one process group (tests/distributed/_dist.py).
Each rank builds the whole data from a fixed seed, keeps its shard, and returns
the sharded result beside the one-process op (prunopt.ops.topk_threshold, equal
to torch.kthvalue) on the concatenation of all shards: they must be
bit-identical on every rank.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import error, ok, run_scenarios

_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
        torch.bfloat16: torch.int16}


def _split(full: torch.Tensor, rank: int, cuts) -> torch.Tensor:
    """Rank ``rank``'s piece of the flattened ``full`` cut at ``cuts`` (uneven)."""
    return torch.tensor_split(full.reshape(-1), list(cuts))[rank]


def _cases(fulls, cuts_per_tensor, rank, ks, modes=("bracket", "compact", "device")):
    """(mode, k, sharded, one-process) for every k and every code path: the
    bracket (the CPU's float32/float64 path), the radix select over all the
    elements with its candidates compacted (the CPU's other dtypes) or not
    (CUDA's)."""
    import prunopt.distributed as D
    from prunopt.ops import topk_threshold

    local = [_split(f, rank, cuts) for f, cuts in zip(fulls, cuts_per_tensor)]
    out = []
    saved = D._COMPACT_DEVICES, D._BRACKET_DEVICES
    try:
        for mode in modes:
            D._BRACKET_DEVICES = frozenset({"cpu"}) if mode == "bracket" else frozenset()
            D._COMPACT_DEVICES = frozenset({"cpu"}) if mode in ("bracket", "compact") else frozenset()
            for k in ks:
                out.append((mode, k, D.topk_threshold(local, k), topk_threshold(fulls, k)))
    finally:
        D._COMPACT_DEVICES, D._BRACKET_DEVICES = saved
    return out


# ----------------------------------------------------------------- scenarios

def sc_random(rank, world):
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(1000, generator=g), torch.randn(37, 3, generator=g) * 5, torch.randn(2049, generator=g)]
    n = sum(f.numel() for f in fulls)
    ks = [1, 2, 17, n // 3, n // 2, n - 1, n] + torch.randint(1, n + 1, (6,), generator=g).tolist()
    return _cases(fulls, [(700,), (5,), (1024,)], rank, ks)


def sc_ties(rank, world):
    g = torch.Generator().manual_seed(1)
    out = []
    for dtype in (torch.float32, torch.float64):
        a = torch.randint(-3, 4, (23,), generator=g).to(dtype)
        b = torch.randint(-3, 4, (17,), generator=g).to(dtype)
        b[:4] = torch.tensor([0.0, -0.0, -0.0, 0.0], dtype=dtype)
        n = a.numel() + b.numel()
        out += _cases([a, b], [(9,), (16,)], rank, range(1, n + 1))  # every tie boundary
    return out


def sc_uneven_and_empty(rank, world):
    g = torch.Generator().manual_seed(2)
    full = torch.randn(501, generator=g)
    out = []
    for cuts in ((501,), (0,), (1,), (500,)):  # rank 1 empty, rank 0 empty, one element, one element
        out += _cases([full], [cuts], rank, [1, 2, 250, 500, 501])
    return out


def sc_all_equal(rank, world):
    eq = torch.full((64,), 0.75)
    eq[::3] = -0.75
    zeros = torch.zeros(40)
    zeros[::2] = -0.0
    out = _cases([eq], [(20,)], rank, [1, 5, 64])
    out += _cases([zeros], [(33,)], rank, [1, 40])
    return out


def sc_dtypes(rank, world):
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(3000, generator=g, dtype=torch.float64) * torch.logspace(-300, 300, 3000, dtype=torch.float64)
    wide[:5] = torch.tensor([5e-324, -5e-324, 1e-310, 0.0, 1.7e308], dtype=torch.float64)  # subnormals, extremes
    out = _cases([wide], [(1234,)], rank, [1, 2, 3, 4, 5, 1500, 2998, 2999, 3000])
    for dtype in (torch.float16, torch.bfloat16):
        h = (torch.randn(777, generator=g) * 100).to(dtype)
        out += _cases([h], [(300,)], rank, [1, 100, 388, 777])
    return out


def sc_dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from prunopt.distributed import topk_threshold as sharded
    from prunopt.ops import topk_threshold

    g = torch.Generator().manual_seed(4)
    mesh = init_device_mesh("cpu", (world,))
    rows = torch.randn(7, 5, generator=g)  # 7 rows: shards of 4 and 3 rows (FSDP2's dim-0 sharding)
    rep = torch.randn(11, generator=g)
    plain = torch.randn(6, generator=g)
    s = distribute_tensor(rows, mesh, [Shard(0)])
    r = distribute_tensor(rep, mesh, [Replicate()])
    s1 = distribute_tensor(rows.t().contiguous(), mesh, [Shard(1)])  # sharded on another dim
    out = []
    for k in (1, 9, 35):
        out.append(("shard", k, sharded(s, k), topk_threshold(rows, k)))
        out.append(("shard1", k, sharded(s1, k), topk_threshold(rows, k)))
    for k in (1, 11):
        out.append(("replicate", k, sharded(r, k), topk_threshold(rep, k)))
    for k in (1, 20, 46):  # replicated values count once
        out.append(("shard+replicate", k, sharded([s, r], k), topk_threshold([rows, rep], k)))
    # a plain tensor beside DTensors is this rank's own piece (here: different on each rank)
    mine = plain[:3] if rank == 0 else plain[3:]
    for k in (1, 30, 52):
        out.append(("mixed", k, sharded([s, r, mine], k), topk_threshold([rows, rep, plain], k)))
    return out


def sc_fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from prunopt.distributed import topk_threshold as sharded
    from prunopt.ops import topk_threshold

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    params = list(model.parameters())
    fulls = [p.full_tensor().detach() for p in params]
    n = sum(f.numel() for f in fulls)
    return [("fsdp2", k, sharded(params, k), topk_threshold(fulls, k)) for k in (1, 10, n // 2, n)]


def sc_mesh_2d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from prunopt.distributed import topk_threshold as sharded
    from prunopt.ops import topk_threshold

    g = torch.Generator().manual_seed(6)
    full = torch.randn(9, 4, generator=g)
    out = []
    for shape in ((1, world), (world, 1)):  # HSDP-style (Replicate, Shard(0)) either way round
        mesh = init_device_mesh("cpu", shape)
        d = distribute_tensor(full, mesh, [Replicate(), Shard(0)])
        out += [(str(shape), k, sharded(d, k), topk_threshold(full, k)) for k in (1, 18, 36)]
        out += [(str(shape) + " mesh group", 7, sharded(d, 7, group=mesh), topk_threshold(full, 7))]
    return out


def sc_collectives(rank, world):
    """The number and size of the all_reduce calls of one selection."""
    import prunopt.distributed as D

    calls = []
    orig = dist.all_reduce

    def counting(t, *a, **kw):
        calls.append(t.numel() * t.element_size())
        return orig(t, *a, **kw)

    g = torch.Generator().manual_seed(7 + rank)  # alike ranks, not equal ones
    out = {}
    dist.all_reduce = counting
    try:
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            for n in (10, 100_000):
                x = torch.randn(n, generator=g).to(dtype)
                for kind, scale in (("alike", 1.0), ("unlike", 4.0 if rank else 1.0)):
                    calls.clear()
                    D.topk_threshold(x * scale, n // 2 + 1)
                    out[(str(dtype), n, kind)] = list(calls)
    finally:
        dist.all_reduce = orig
    return out


def sc_err_nonfinite(rank, world):
    from prunopt.distributed import topk_threshold

    x = torch.randn(50)
    if rank == 1:
        x[7] = float("nan")
    return topk_threshold(x, 3)


def sc_err_inf(rank, world):
    from prunopt.distributed import topk_threshold

    x = torch.randn(50, dtype=torch.float64)
    if rank == 0:
        x[0] = -float("inf")
    return topk_threshold(x, 3)


def sc_err_k_too_large(rank, world):
    from prunopt.distributed import topk_threshold

    return topk_threshold(torch.randn(10 if rank == 0 else 5), 16)  # n = 15 over both ranks


def sc_err_k_zero(rank, world):
    from prunopt.distributed import topk_threshold

    return topk_threshold(torch.randn(10), 0)


def sc_err_k_differs(rank, world):
    from prunopt.distributed import topk_threshold

    return topk_threshold(torch.randn(10), 3 + rank)


def sc_err_dtype_differs(rank, world):
    from prunopt.distributed import topk_threshold

    return topk_threshold(torch.randn(10, dtype=torch.float32 if rank == 0 else torch.float64), 3)


def sc_err_k_type(rank, world):
    from prunopt.distributed import topk_threshold

    return topk_threshold(torch.randn(10), 2.0)


def sc_after_errors(rank, world):
    """The group is still in step after the errors above."""
    from prunopt.distributed import topk_threshold
    from prunopt.ops import topk_threshold as one

    g = torch.Generator().manual_seed(8)
    full = torch.randn(100, generator=g)
    return topk_threshold(full[:60] if rank == 0 else full[60:], 10), one(full, 10)


def sc_helpers(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import prunopt.distributed as D

    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (1, world))
    full = torch.arange(14.0).reshape(7, 2)
    s = distribute_tensor(full, mesh, [Shard(0)])
    r = distribute_tensor(full, mesh, [Replicate()])
    h = distribute_tensor(full, mesh2, [Replicate(), Shard(0)])
    x = torch.ones(3 + rank)
    return {
        "sum_list": D.all_reduce_sum([1.5 * (rank + 1), torch.tensor(2.0 + rank),
                                      torch.tensor([rank], dtype=torch.int64)]),
        "sum_tensor": D.all_reduce_sum(torch.full((2, 2), float(rank + 1), dtype=torch.float32)),
        "sum_mesh": D.all_reduce_sum([1.0], group=mesh2),
        "numel_plain": D.global_numel([x, torch.ones(2)]),
        "numel_dtensor": D.global_numel([s, r]),
        "numel_mixed": D.global_numel([s, x]),
        "is_dtensor": (D.is_distributed_tensor(s), D.is_distributed_tensor(x)),
        "local": (tuple(D.local_tensor(s).shape), D.local_tensor(x) is x),
        "local_is_view": D.local_tensor(s).data_ptr() == s._local_tensor.data_ptr(),
        "group_plain": D.process_group_of([x]) is None,
        "group_1d": D.process_group_of([s, r]) == mesh.get_group(),
        "group_2d": D.process_group_of(h) is mesh2,
        "replicated": (D.is_replicated(s), D.is_replicated(r), D.is_replicated(h), D.is_replicated(x)),
        "counts": (D.counts_locally(s), D.counts_locally(r), D.counts_locally(h), D.counts_locally(x)),
    }


def sc_helper_errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Shard, distribute_tensor
    from torch.distributed.tensor import DTensor

    import prunopt.distributed as D

    mesh = init_device_mesh("cpu", (world,))
    other = init_device_mesh("cpu", (world,))  # the same ranks, still one mesh by value
    s = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    p = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    out = {}
    for name, fn in (("partial_threshold", lambda: D.topk_threshold(p, 1)),
                     ("partial_replicated", lambda: D.is_replicated(p)),
                     ("dtensor_sum", lambda: D.all_reduce_sum(s)),
                     ("bad_group", lambda: D.topk_threshold(torch.ones(3), 1, group="world")),
                     ("bad_sum_item", lambda: D.all_reduce_sum(["x"])),
                     ("not_mesh_group", lambda: D.topk_threshold(s, 1, group=_OTHER[0])),
                     ("empty_list", lambda: D.topk_threshold([], 1)),
                     ("int_values", lambda: D.topk_threshold(torch.ones(3, dtype=torch.int32), 1))):
        try:
            fn()
            out[name] = None
        except Exception as e:
            out[name] = type(e).__name__
    out["same_mesh"] = D.process_group_of([s, distribute_tensor(torch.ones(2), other, [Shard(0)])]) is not None
    return out


_OTHER = []  # set by sc_make_group


def sc_make_group(rank, world):
    """A group that is not the mesh's (made collectively, before sc_helper_errors)."""
    _OTHER.append(dist.new_group(list(range(world))))
    return True


def sc_skewed(rank, world):
    """Ranks whose values differ by orders of magnitude (the bracket spans one
    rank's values whole): still bit-identical, for k at every scale."""
    g = torch.Generator().manual_seed(11)
    full = torch.cat([torch.randn(3000, generator=g) * 100 + 1000, torch.randn(5000, generator=g) * 1e-3])
    return _cases([full], [(3000,)], rank, [1, 7, 2999, 3000, 3001, 4000, 7999, 8000])


def sc_poll_times(rank, world):
    """The same results whether a rank blocks at once (0), polls past a
    collective's end (1 s), gives up polling before a late peer arrives
    (rank 1 enters each selection 30 ms late, rank 0 polls 1 ms and blocks)
    or chooses its way itself ("auto", the default, with a late peer too)."""
    import time

    import prunopt.distributed as D

    g = torch.Generator().manual_seed(12)
    full = torch.randn(3001, generator=g)
    out = []

    before = D._CHOOSER.recorded
    for poll, late in ((0.0, 0.0), (1.0, 0.0), (1e-3, 0.03), ("auto", 0.0), ("auto", 0.01)):
        previous = D.set_poll_time(poll)
        try:
            for k in (1, 1500, 3001):
                if rank == 1 and late:
                    time.sleep(late)
                out += _cases([full], [(1200,)], rank, [k], modes=("bracket",))
        finally:
            assert D.set_poll_time(previous) == poll
        if poll == "auto":  # ("auto" timed its collectives: at least one per selection)
            assert D._CHOOSER.recorded >= before + 3
        else:  # (a fixed way times nothing)
            assert D._CHOOSER.recorded == before
        before = D._CHOOSER.recorded
    return out


SCENARIOS = [sc_poll_times, sc_skewed, sc_random, sc_ties, sc_uneven_and_empty, sc_all_equal, sc_dtypes, sc_dtensor,
             sc_fsdp2, sc_mesh_2d,
             sc_collectives, sc_err_nonfinite, sc_err_inf, sc_err_k_too_large, sc_err_k_zero, sc_err_k_differs,
             sc_err_dtype_differs, sc_err_k_type, sc_after_errors, sc_helpers, sc_make_group, sc_helper_errors]


@pytest.fixture(scope="module")
def results():
    return run_scenarios(SCENARIOS, world_size=2)


def _assert_bit_identical(per_rank):
    for rank, cases in enumerate(per_rank):
        assert cases
        for mode, k, got, want in cases:
            assert got.dtype == want.dtype and got.shape == () and not got.requires_grad, (rank, mode, k)
            i = _INT[got.dtype]
            assert got.view(i).item() == want.detach().view(i).item(), (rank, mode, k, got.item(), want.item())


@pytest.mark.parametrize("name", ["sc_poll_times", "sc_skewed", "sc_random", "sc_ties", "sc_uneven_and_empty",
                                  "sc_all_equal", "sc_dtypes", "sc_dtensor", "sc_fsdp2", "sc_mesh_2d"])
def test_bit_identical_to_one_process(results, name):
    _assert_bit_identical(ok(results[name]))


def test_replicated_counts_once(results):
    # [Shard, Replicate] equals the one-process op on [rows, rep]: rep once, not twice
    cases = ok(results["sc_dtensor"])[0]
    assert any(m == "shard+replicate" for m, *_ in cases)


def test_fixed_number_of_small_collectives(results):
    first = (2048 + 8192 + 9) * 8  # every select's first call on 2 ranks (see _first_size)
    for per_rank in ok(results["sc_collectives"]):
        for (dtype, n, kind), calls in per_rank.items():
            if dtype == "torch.bfloat16":  # the radix passes alone
                assert len(calls) == 2 and calls[0] == first, (dtype, n, calls)
                continue
            # float32/float64 on the CPU: n, the agreement, every rank's slice (its
            # counts and a histogram of its candidates, 1018 buckets on 2 ranks) and
            # window (the values around its share, 8184 float32 or 4092 float64) in
            # one call of the first size
            assert calls[0] == first, (dtype, n, calls)
            if kind == "alike":
                # the threshold lies inside every rank's window: that one call
                assert len(calls) == 1, (dtype, n, kind, calls)
            elif n > 10:
                # a rank 4x the other: the windows miss, then 1 to 3 (float32) or 6
                # (float64) radix passes over the offsets inside the bracket (the
                # first also sums the counts above it): a bound that does not depend on n
                assert 1 <= len(calls) - 1 <= {"torch.float32": 3, "torch.float64": 6}[dtype], (dtype, n, calls)
                assert calls[1] == 2051 * 8 and all(c <= 2048 * 8 for c in calls[2:]), (dtype, n, calls)
            else:  # 10 values: a rank's window holds all of its values
                assert len(calls) == 1, (dtype, n, kind, calls)
            assert max(calls) <= first, calls


@pytest.mark.parametrize("name,kind,text", [
    ("sc_err_nonfinite", "ValueError", "non-finite"),
    ("sc_err_inf", "ValueError", "non-finite"),
    ("sc_err_k_too_large", "ValueError", "n=15"),
    ("sc_err_k_zero", "ValueError", "k must be in"),
    ("sc_err_k_differs", "ValueError", "same on every rank"),
    ("sc_err_dtype_differs", "ValueError", "one dtype on every rank"),
    ("sc_err_k_type", "TypeError", "k must be an int"),
])
def test_errors_raised_on_every_rank(results, name, kind, text):
    for got_kind, message in error(results[name]):
        assert got_kind == kind and text in message, (got_kind, message)


def test_group_in_step_after_errors(results):
    for got, want in ok(results["sc_after_errors"]):
        assert got.view(torch.int32).item() == want.view(torch.int32).item()


def test_helpers(results):
    r0, r1 = ok(results["sc_helpers"])
    for rank, r in enumerate((r0, r1)):
        assert r["sum_list"].dtype == torch.float64 and r["sum_list"].tolist() == [4.5, 5.0, 1.0]
        assert r["sum_tensor"].dtype == torch.float64 and r["sum_tensor"].tolist() == [[3.0, 3.0], [3.0, 3.0]]
        assert r["sum_mesh"].tolist() == [2.0]
        assert r["numel_plain"] == 3 + 4 + 2 * 2
        assert r["numel_dtensor"] == 28 and r["numel_mixed"] == 14 + 7
        assert r["is_dtensor"] == (True, False)
        assert r["local"] == ((4, 2) if rank == 0 else (3, 2), True) and r["local_is_view"]
        assert r["group_plain"] and r["group_1d"] and r["group_2d"]
        assert r["replicated"] == (False, True, False, False)
        # a Replicate tensor counts on the first rank only; Shard and plain tensors everywhere
        assert r["counts"] == (True, rank == 0, True, True)


def test_helper_errors(results):
    for r in ok(results["sc_helper_errors"]):
        assert r == {
            "partial_threshold": "ValueError", "partial_replicated": "ValueError", "dtensor_sum": "TypeError",
            "bad_group": "TypeError", "bad_sum_item": "TypeError", "not_mesh_group": "ValueError",
            "empty_list": "ValueError", "int_values": "ValueError", "same_mesh": True,
        }
