"""The sharded threshold's one-collective path (float32/float64 on the CPU,
up to 8 ranks): each rank sends, beside its slice, a window of its values
around its share of ``k``, and when the ``k``-th largest over all ranks lies
inside every window the pooled windows give it at once. Several ranks are
simulated as threads of one process (tests/distributed/_simranks.py) and
every answer is compared bit for bit with the one-process op on the
concatenation; a window that misses hands over to the slices' bracket and
its radix passes (another collective or more), never a different answer.
tests/distributed/test_sharded_threshold.py runs two real ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings

import prunopt.distributed as D
from prunopt.ops import topk_threshold as one_threshold

from tests.distributed._simranks import SimRanks, plan_of
from tests.distributed.test_sharded_single_process import _rank_data, ranks_case

pytestmark = [
    pytest.mark.skipif(dist.is_available() and dist.is_initialized(),
                       reason="needs a process without a default process group"),
    pytest.mark.skipif(not D.extension_available(), reason="needs the compiled extension (topk_bracket)"),
]
_INT = {torch.float32: torch.int32, torch.float64: torch.int64}


def _bits(t: torch.Tensor) -> int:
    return t.view(_INT[t.dtype]).item()


def _select(ranks, k):
    """Every rank's threshold and exception, and the bytes of each of its
    all_reduce calls."""
    sim = SimRanks(len(ranks))
    out, errs = sim.run(lambda r: D._select(ranks[r], plan_of(ranks[r], len(ranks)), k))
    return out, errs, sim.calls


def _check(ranks, k):
    out, errs, calls = _select(ranks, k)
    assert all(e is None for e in errs), errs
    want = one_threshold([t for r in ranks for t in r if t.numel()], k)
    for got in out:
        assert got.dtype == want.dtype and got.shape == ()
        assert _bits(got) == _bits(want), (k, got, want)
    assert len({len(c) for c in calls}) == 1  # every rank made the same calls
    return calls[0]


@settings(max_examples=60, deadline=None)
@given(ranks_case(shard_sizes=(0, 1, 7, 300, 5000, 20000)))
@example((torch.float32, [20000, 20000], "randn", [1.0, 1.0], 0, 0.1))
@example((torch.float32, [20000, 20000], "randn", [1.0, 4.0], 1, 0.1))
@example((torch.float64, [20000, 0, 7], "ties", [1.0, 1.0, 1.0], 2, 0.5))
@example((torch.float32, [20000, 20000], "one_value", [1.0, 1.0], 3, 0.5))
@example((torch.float32, [20000, 20000, 20000], "zeros", [1.0, 1.0, 1.0], 4, 0.9))
def test_bit_identical_to_one_process(case):
    """Any data, 1 to 5 ranks (alike, unlike, empty, all ties): the
    threshold is the one-process op's, bit for bit, whichever path gives it."""
    dtype, sizes, kind, scales, seed, kpos = case
    ranks = _rank_data(dtype, sizes, kind, scales, seed)
    n = sum(sizes)
    if n == 0:
        return
    _check(ranks, min(n, 1 + int(kpos * n)))


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_alike_ranks_take_one_collective(world, dtype):
    """Ranks of alike values (FSDP2's shards of the same layers): the
    threshold lies inside every rank's window, so the first collective,
    of the size every select's first has, is the only one."""
    g = torch.Generator().manual_seed(world)
    ranks = [[torch.randn(40_000, generator=g, dtype=dtype)] for _ in range(world)]
    for k in (1, 4_000 * world, 20_000 * world, 40_000 * world):
        calls = _check(ranks, k)
        assert calls == [D._first_size(world) * 8], (k, calls)


def test_a_rank_unlike_the_others_takes_the_slices_bracket():
    """A rank whose values are 4x the others': its window and theirs cannot
    all hold the threshold; the slices' bracket and one or two radix passes
    finish (2 or 3 collectives), still exact."""
    g = torch.Generator().manual_seed(5)
    ranks = [[torch.randn(40_000, generator=g)], [torch.randn(40_000, generator=g) * 4]]
    calls = _check(ranks, 8_000)
    assert 2 <= len(calls) <= 4 and calls[0] == D._first_size(2) * 8, calls


def test_more_ties_than_a_window_holds():
    """A bucket of ties larger than a window (every value 1.5): the window
    reports -1 and the slices' path gives the threshold."""
    ranks = [[torch.full((20_000,), 1.5)], [torch.full((20_000,), -1.5)]]
    calls = _check(ranks, 10_000)
    assert len(calls) >= 2, calls


def test_beyond_eight_ranks_there_are_no_windows():
    """9 ranks: no windows in the first collective (2048 slots + the
    agreement), the slices' bracket and its radix passes."""
    g = torch.Generator().manual_seed(9)
    ranks = [[torch.randn(3_000, generator=g)] for _ in range(9)]
    calls = _check(ranks, 2_700)
    assert calls[0] == (2048 + D._META) * 8 and len(calls) >= 2, calls


@pytest.mark.parametrize("kind", ["randn", "ties", "tiny"])
def test_a_window_counts_exactly_inside_its_range(kind):
    """The window's contract (what the select's first collective carries,
    from ``topk_slice``): for every bit pattern ``t`` in ``[lo, end)`` the
    rank has exactly ``a + #{window >= t}`` values ``|v| >= t``, and the
    window's values are this rank's values in that range."""
    from prunopt.ops import topk_slice

    dtype = torch.float32
    x = _rank_data(dtype, [50_000], kind, [1.0], 3)[0][0]
    slots = D._window_slots(2)
    _, (head, bits) = D._OwnSlice.of_op([x], 20_000, 2, D._rank_buckets(2), 2 * slots)
    a, lo, end, m = head
    assert 0 <= m <= 2 * slots and bits.numel() == m
    assert torch.equal(bits, topk_slice(x, 10_000, D._rank_buckets(2), 2 * slots)[2])
    mags = x.abs().view(torch.int32).long()
    inside = mags[(mags >= lo) & (mags < end)]
    assert sorted(inside.tolist()) == sorted(bits.long().tolist())
    for t in [lo, end - 1, (lo + end) // 2] + bits.long()[:50].tolist():
        assert a + int((bits.long() >= t).sum()) == int((mags >= t).sum()), t


def test_an_empty_rank_has_an_open_window():
    own, (head, bits) = D._OwnSlice.of_op([torch.empty(0)], 5, 2, D._rank_buckets(2), 2 * D._window_slots(2))
    assert head == [0, 0, D._max_finite_bits(torch.float32) + 1, 0] and bits is None
    assert own.n_r == 0 and own.head == [0] * D._SLICE_HEAD
