"""Several ranks of a sharded algorithm in one process, as threads: the
module's ``_all_reduce`` sums the vectors of every rank (in rank order, so
every rank gets the same floats) and ``_rank_index`` is the thread's rank.
The algorithm's own code runs unchanged, collectives and all, without a
process group (tests stay fast, and many inputs fit in a hypothesis test)."""
from __future__ import annotations

import functools
import threading
from typing import Callable, List, Tuple

import prunopt.distributed as D


class SimRanks:
    """``world`` ranks; :meth:`run` calls ``fn(rank)`` on each, in its own
    thread, and returns every rank's result and exception; ``calls[r]`` are
    the bytes of each all_reduce rank ``r`` made."""

    def __init__(self, world: int, timeout: float = 30.0):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.local = threading.local()
        self.slots: List = [None] * world
        self.calls: List[List[int]] = [[] for _ in range(world)]

    def all_reduce(self, vec, groups):
        r = self.local.rank
        self.slots[r] = vec.clone()
        self.barrier.wait()
        if len({v.numel() for v in self.slots}) != 1:  # as a real collective of mismatched sizes: fails
            raise RuntimeError(f"all_reduce sizes differ: {[v.numel() for v in self.slots]}")
        total = functools.reduce(lambda a, b: a + b, self.slots)
        self.barrier.wait()
        vec.copy_(total)
        self.calls[r].append(vec.numel() * vec.element_size())
        return vec

    def rank_index(self, groups) -> int:
        return self.local.rank

    def run(self, fn: Callable[[int], object]) -> Tuple[list, list]:
        out, errs = [None] * self.world, [None] * self.world

        def body(r: int) -> None:
            self.local.rank = r
            try:
                out[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 (reported to the test)
                # (no abort: the others may still be leaving a collective; a
                # rank left waiting alone times out with BrokenBarrierError)
                errs[r] = e

        saved = D._all_reduce, D._rank_index
        D._all_reduce, D._rank_index = self.all_reduce, self.rank_index
        try:
            threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            D._all_reduce, D._rank_index = saved
        return out, errs


def plan_of(tensors, world: int) -> "D._Plan":
    """A plan of this rank's plain tensors over ``world`` ranks (a group that
    is never used: the simulator's all_reduce replaces the collectives)."""
    return D._Plan(list(tensors), [True] * len(tensors), [object()], world)
