"""A small harness for multi-process tests.

:func:`run_scenarios` spawns ``world_size`` ranks with
:mod:`torch.multiprocessing` (``spawn``), joins them in one gloo process group
on ``127.0.0.1`` and a free port, runs every scenario function in turn in that
one group, and returns what each rank's scenarios returned (or raised) to the
parent, where pytest asserts on it. A scenario is a module-level function
``fn(rank, world_size)`` (spawned ranks import it by name) that returns
anything ``torch.save`` can store; an exception it raises is recorded as
``("error", type name, message)`` so tests can check that every rank raised
alike. Nothing hangs: the process group has a timeout, and the parent kills the
ranks once ``timeout`` seconds have passed.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_scenarios", "free_port", "ok", "error"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, scenarios: Sequence[Callable], out_dir: str,
            group_timeout: float) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections stay on the loopback too
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=group_timeout))
    from prunopt.distributed import end_process_group

    results: Dict[str, tuple] = {}
    try:
        for fn in scenarios:
            try:
                results[fn.__name__] = ("ok", fn(rank, world_size))
            except Exception as e:  # recorded for the parent, which asserts on it
                results[fn.__name__] = ("error", type(e).__name__, str(e), traceback.format_exc())
            dist.barrier()  # the next scenario starts in step on every rank
    except BaseException:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
        raise
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


def run_scenarios(scenarios: Sequence[Callable], world_size: int = 2, timeout: float = 120.0,
                  group_timeout: float = 30.0) -> Dict[str, List[tuple]]:
    """Runs ``scenarios`` on ``world_size`` spawned ranks in one gloo group.

    Returns ``{scenario name: [rank 0's outcome, rank 1's, ...]}``, an outcome
    being ``("ok", value)`` or ``("error", type name, message, traceback)``.
    Raises ``TimeoutError`` (after killing the ranks) if they take longer than
    ``timeout`` seconds, ``RuntimeError`` if a rank dies."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, list(scenarios), out_dir, group_timeout),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        if hung:
            raise TimeoutError(f"{len(hung)} of {world_size} ranks still ran after {timeout} s; killed")
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"ranks exited with an error: {bad}")
        per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    return {fn.__name__: [res[fn.__name__] for res in per_rank] for fn in scenarios}


def ok(outcomes: List[tuple]) -> list:
    """The values every rank returned; an AssertionError showing the first
    rank's traceback if one raised."""
    for r, o in enumerate(outcomes):
        assert o[0] == "ok", f"rank {r} raised {o[1]}: {o[2]}\n{o[3]}"
    return [o[1] for o in outcomes]


def error(outcomes: List[tuple]) -> List[tuple]:
    """``(type name, message)`` per rank; an AssertionError if a rank did not raise."""
    for r, o in enumerate(outcomes):
        assert o[0] == "error", f"rank {r} did not raise (returned {o[1]!r})"
    return [(o[1], o[2]) for o in outcomes]
