"""Sharded global selection and projection (:mod:`prunopt.distributed`) on two
ranks of this machine, against the ways a global top-k or projection is
usually computed over sharded scores, and against the one-process op on the
same number of elements.

float32, ``N`` elements in all, split evenly over 2 gloo ranks spawned here
(``127.0.0.1``), ``threads // 2`` threads per rank (at least 1). Per ``N``:

* ``sharded``: ``prunopt.distributed.topk_threshold(shard, k = N/10)`` and
  ``project_budget(shard, S = 0.1 N)`` (scores uniform in [0, 1.2)), their
  collectives waited for the default way (``set_poll_time("auto")``); beside
  the threshold (and the FSDP2 step) the same calls with the waits fixed
  (``polled waits``: up to 5 ms of polling, ``blocking waits``: blocked at
  once) and without the selects' windows;
* ``all_gather``: ``all_gather_single`` of the shards, then
  ``torch.kthvalue`` of ``|v|`` (a global top-k that gathers the values, as a
  global magnitude sparsifier does) or the one-process projection of the
  gathered scores;
* ``dense all_reduce``: every rank writes its shard into an ``N``-sized zero
  tensor and all_reduces it (global scores kept dense on every rank, as in
  RigL-style code), then the one-process op;
* ``one-process``: ``prunopt.ops.topk_threshold`` / ``project_budget`` on
  all ``N`` elements in this process with ``threads`` threads and with 1,
  after the ranks have exited.

Every contender is verified before it is timed (the sharded threshold
bit-identical to ``torch.kthvalue`` on the gathered values, the sharded
projection within 1e-5 of the one-process projection). The ranks time the
contenders in lockstep and in turn (one warm-up round, then ``reps // 5``
rounds in which every contender makes a burst of about 5 consecutive calls
after one untimed settling call, each timed alone, round ``r`` starting at
contender ``r``; a contender's figure is the median of its ``reps`` calls on
the slower rank), so that the host's drift falls on all contenders alike and
none pays for the one before it; the FSDP2 steps likewise, among themselves. Bytes are counted by
wrapping ``torch.distributed.all_reduce`` and ``all_gather_single``: the
payload one rank hands to the collectives per call. The model rows give the
bytes one rank sends per call with ``W`` ranks on a ring (all_reduce
``2 (W-1)/W`` times the payload, all_gather ``(W-1)/W`` times the gathered size).
"""
from __future__ import annotations

import datetime
import os
import socket
import statistics
import tempfile
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prunopt.bench.common import environment, median_time, write_results

WORLD = 2
MODEL_RANKS = (8, 64, 512)
_SIZES = {True: [1_000_000, 10_000_000], False: [10_000_000, 100_000_000]}


def _shard(n: int, rank: int, world: int, kind: str) -> torch.Tensor:
    """Rank ``rank``'s shard of the benchmark's data (the parent rebuilds the
    whole from the same seeds)."""
    g = torch.Generator().manual_seed(1000 * n + 10 * rank + (0 if kind == "grad" else 1))
    m = n // world
    return torch.randn(m, generator=g) if kind == "grad" else torch.rand(m, generator=g) * 1.2


# the one-tensor all_gather (``all_gather_into_tensor`` before its rename)
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


class _Counter:
    """Counts the collectives prunopt.distributed and the baselines call, and
    their payload, by wrapping the torch.distributed functions."""

    def __init__(self):
        self.calls, self.bytes = 0, 0
        self._orig = {}

    def __enter__(self):
        for name in ("all_reduce", _ALL_GATHER):
            orig = getattr(dist, name)
            self._orig[name] = orig

            def wrapped(tensor, *args, _orig=orig, _name=name, **kwargs):
                self.calls += 1
                self.bytes += tensor.numel() * tensor.element_size() if _name == "all_reduce" else \
                    args[0].numel() * args[0].element_size()  # all_gather: the shard handed over
                return _orig(tensor, *args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def _lockstep_medians(fns: Dict[tuple, object], reps: int, learn: int = 0) -> Dict[tuple, float]:
    """Median seconds of ``reps`` calls of each contender, made in
    ``reps // 5`` rounds (at least one) that take the contenders in turn (each
    round a burst of about 5 consecutive calls of each contender), so that the
    host's drift over the seconds of a run falls on all contenders alike
    instead of on their ratios. Each burst starts with one call that is not
    timed: the first call after another contender pays for that contender's
    traces (fresh pages after its large allocations, 50K page faults for 200
    MB; the caches it filled), and so would a contender that always came
    first. Round ``r`` starts at contender ``r`` (mod their number), so no
    contender always follows the same one. The order is the same on every
    rank: every rank makes the same calls (the collectives inside keep them in
    lockstep; an adaptive count such as ``blocked_autorange`` could differ
    between ranks and hang). The warm-up is one call of each contender,
    ``1 + learn`` of those whose waits learn (:func:`_learns`)."""
    per: Dict[tuple, List[float]] = {key: [] for key in fns}
    rounds = max(1, reps // 5)
    for key, fn in fns.items():  # warm-up
        for _ in range(1 + (learn if _learns(key) else 0)):
            fn()
    keys = list(fns)
    for r in range(rounds):
        count = reps // rounds + (1 if r < reps % rounds else 0)
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            fn = fns[key]
            fn()  # the burst's settling call, not timed
            for _ in range(count):
                t0 = time.perf_counter()
                fn()
                per[key].append(time.perf_counter() - t0)
    return {key: statistics.median(ts) for key, ts in per.items()}


# the floor contender's name (see _worker)
_FLOOR = "floor: the shard's pass + one all_reduce"


def _learns(key: tuple) -> bool:
    """Whether a contender's collectives wait the default way, which learns
    (``set_poll_time("auto")`` times both ways over its first calls, as in a
    training run's first steps): it is warmed up ``learn`` calls more."""
    name = key[1]
    return ("sharded" in name or "PrunAdag" in name or name == _FLOOR) and not name.endswith(("polled waits",
                                                                                             "blocking waits"))


def _learn_calls() -> int:
    """Warm-up calls of the contenders that learn how to wait (beyond the one
    every contender makes): twice the chooser's warm-up of each way, and some."""
    import prunopt.distributed as D

    return 2 * D._CHOOSER.warmup + 6


def _worker(rank: int, world: int, port: int, n: int, threads: int, reps: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    import prunopt.distributed as D
    from prunopt.ops import project_budget, topk_bracket, topk_slice

    try:
        grad, score = _shard(n, rank, world, "grad"), _shard(n, rank, world, "score")
        k, budget = n // 10, 0.1 * n
        m = grad.numel()

        def gathered(x):
            full = torch.empty(m * world, dtype=x.dtype)
            getattr(dist, _ALL_GATHER)(full, x)
            return full

        def dense(x):
            full = torch.zeros(m * world, dtype=x.dtype)
            full[rank * m:(rank + 1) * m] = x
            dist.all_reduce(full)
            return full

        # the floor of any exact sharded select: one read of the shard (the
        # sharded select's own pass, over the bracket it takes) and one
        # all_reduce of its first collective's size, waited the default way
        head = topk_slice(grad, -(-k // world), D._rank_buckets(world), 2 * D._window_slots(world))[0].tolist()
        floor_lo, floor_hi = D._bits_value(head[10], torch.float32), D._bits_value(head[11] - 1, torch.float32)
        floor_vec = torch.zeros(D._first_size(world), dtype=torch.int64)

        contenders = {
            ("threshold", "sharded"): lambda: D.topk_threshold(grad, k),
            ("threshold", _FLOOR): lambda: (topk_bracket(grad, floor_lo, floor_hi),
                                            D._all_reduce(floor_vec.zero_(), [dist.group.WORLD])),
            ("threshold", "sharded, polled waits"): _polled(lambda: D.topk_threshold(grad, k)),
            ("threshold", "sharded, blocking waits"): _polled(lambda: D.topk_threshold(grad, k), 0.0),
            ("threshold", "sharded without windows"): _without_windows(lambda: D.topk_threshold(grad, k)),
            ("threshold", "all_gather + kthvalue"):
                lambda: torch.kthvalue(gathered(grad).abs_(), m * world - k + 1).values,
            ("threshold", "dense all_reduce + topk_threshold"): lambda: D._topk_threshold_one(dense(grad), k),
            ("projection", "sharded"): lambda: D.project_budget(score, budget),
            ("projection", "all_gather + project_budget"):
                lambda: project_budget(gathered(score), budget)[rank * m:(rank + 1) * m],
            ("projection", "dense all_reduce + project_budget"):
                lambda: project_budget(dense(score), budget)[rank * m:(rank + 1) * m],
        }
        # verify before timing
        results: Dict[tuple, dict] = {}
        outs = {}
        for key, fn in contenders.items():
            with _Counter() as cnt:
                outs[key] = fn()
            results[key] = {"calls": cnt.calls, "bytes": cnt.bytes}
        thr = outs[("threshold", "sharded")]
        for key in (("threshold", "sharded, polled waits"), ("threshold", "sharded, blocking waits"),
                    ("threshold", "sharded without windows"),
                    ("threshold", "all_gather + kthvalue"),
                    ("threshold", "dense all_reduce + topk_threshold")):
            if not torch.equal(thr.view(torch.int32), outs[key].view(torch.int32)):
                raise AssertionError(f"sharded threshold {thr} differs from {key[1]} {outs[key]}")
        proj = outs[("projection", "sharded")]
        for key in (("projection", "all_gather + project_budget"), ("projection", "dense all_reduce + project_budget")):
            err = (proj.double() - outs[key].double()).abs().max().item()
            if err > 1e-5:
                raise AssertionError(f"sharded projection differs from {key[1]} by {err}")
        results["threshold_value"] = thr.item()
        results["projection_sum"] = float(proj.double().sum())
        del outs, proj
        times = _lockstep_medians(contenders, reps, _learn_calls())
        for key, secs in times.items():
            results[key]["seconds"] = secs
        del grad, score, contenders
        results.update(_fsdp_steps(rank, world, n, threads, reps))
    except BaseException:
        torch.save(results if "results" in locals() else {}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
        raise
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    D.end_process_group()


def _polled(fn, seconds: float = 0.005):
    """``fn`` run with prunopt.distributed's waits fixed (each collective
    polled for up to ``seconds`` before it blocks; 0: blocked at once), where
    the default ("auto") measures and chooses: each way, measured side by
    side."""
    import prunopt.distributed as D

    def call():
        previous = D.set_poll_time(seconds)
        try:
            return fn()
        finally:
            D.set_poll_time(previous)

    return call


def _without_windows(fn):
    """``fn`` run without the windows in the selects' first collective (the
    slices' bracket and its radix passes: 2 collectives on alike ranks): the
    windows' effect, measured side by side."""
    import prunopt.distributed as D

    def call():
        previous, D._WINDOW_WORLD = D._WINDOW_WORLD, 0
        try:
            return fn()
        finally:
            D._WINDOW_WORLD = previous

    return call


def _fsdp_model(n: int) -> torch.nn.Module:
    """Linear layers of ``n`` weights in all (1000 x n/10^4 ... : 10 layers of
    equal size, biases included), the same on every rank."""
    width = max(1, n // 10 // 1000)
    g = torch.Generator().manual_seed(5)
    layers = [torch.nn.Linear(1000, width) for _ in range(10)]
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return torch.nn.Sequential(*layers)


def _fsdp_steps(rank: int, world: int, n: int, threads: int, reps: int) -> dict:
    """An optimizer step on a model of ``n`` weights sharded by FSDP2: PrunAdag
    (fused, version 3, 10 % relevant, global scope) against torch's fused
    Adagrad on the same sharded model, with fixed gradients. Verified first:
    one sharded PrunAdag step equals the one-process step on the gathered
    parameters (to the rounding of the ratio's norms)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from prunopt.optim import PrunAdag

    def sharded():
        model = _fsdp_model(n)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        g = torch.Generator().manual_seed(6)
        for p in model.parameters():
            full = torch.randn(p.shape, generator=g)
            p.grad = DTensor.from_local(full.chunk(world)[rank].clone(), p.device_mesh, p.placements,
                                        shape=p.shape, stride=p.stride())
        return model

    # verification: one step, sharded vs one process on the full tensors
    model = sharded()
    full_p = [p.detach().full_tensor().clone() for p in model.parameters()]
    full_g = [p.grad.full_tensor().clone() for p in model.parameters()]
    PrunAdag(model.parameters(), lr=0.01, relevant=0.1, fused=True).step()
    ref = [torch.nn.Parameter(p) for p in full_p]
    for p, g in zip(ref, full_g):
        p.grad = g
    PrunAdag(ref, lr=0.01, relevant=0.1, fused=True).step()
    err = max((p.detach().full_tensor() - q.detach()).abs().max().item() for p, q in zip(model.parameters(), ref))
    if err > 1e-6:
        raise AssertionError(f"the sharded PrunAdag step differs from the one-process step by {err}")
    del full_p, full_g, ref
    out = {"fsdp_verified_max_error": err}
    prunadag = lambda m: PrunAdag(m.parameters(), lr=0.01, relevant=0.1, fused=True)  # noqa: E731
    contenders = {
        ("fsdp2 step", "PrunAdag (fused, V3, 10 %)"): prunadag,
        ("fsdp2 step", "PrunAdag (fused, V3, 10 %), polled waits"): prunadag,
        ("fsdp2 step", "PrunAdag (fused, V3, 10 %), blocking waits"): prunadag,
        ("fsdp2 step", "PrunAdag (fused, V3, 10 %), without windows"): prunadag,
        # torch's fused Adagrad has no DTensor sharding rule: foreach and the for-loop are what runs under FSDP2
        ("fsdp2 step", "torch Adagrad (foreach)"): lambda m: torch.optim.Adagrad(m.parameters(), lr=0.01, foreach=True),
        ("fsdp2 step", "torch Adagrad (for-loop)"):
            lambda m: torch.optim.Adagrad(m.parameters(), lr=0.01, foreach=False),
    }
    steps = {}
    for key, make in contenders.items():  # every model and optimizer first, then the steps in turn
        model = sharded()
        opt = make(model)
        opt.step()  # state created, kernels warm
        wrap = {"polled waits": _polled, "blocking waits": lambda f: _polled(f, 0.0),
                "without windows": _without_windows}.get(key[1].rpartition(", ")[2])
        step = wrap(opt.step) if wrap else opt.step
        with _Counter() as cnt:
            step()
        steps[key] = step
        out[key] = {"calls": cnt.calls, "bytes": cnt.bytes}
    for key, secs in _lockstep_medians(steps, reps, _learn_calls()).items():
        out[key]["seconds"] = secs
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(n: int, threads: int, reps: int, timeout: float = 540.0) -> List[dict]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, WORLD, port, n, threads, reps, out_dir), daemon=True)
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
                raise TimeoutError(f"the benchmark ranks ran over {timeout} s (n={n})")
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a benchmark rank failed (n={n}): exit codes {[p.exitcode for p in procs]}")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


# the collective each contender's bytes go through
_MODEL_KINDS = {
    ("threshold", "sharded"): "all_reduce",
    ("threshold", "all_gather + kthvalue"): "all_gather",
    ("threshold", "dense all_reduce + topk_threshold"): "all_reduce",
    ("projection", "sharded"): "all_reduce",
    ("projection", "all_gather + project_budget"): "all_gather",
    ("projection", "dense all_reduce + project_budget"): "all_reduce",
}


def _ring_bytes(kind: str, payload: float, ranks: int) -> float:
    """Bytes one rank sends per call on a ring of ``ranks`` ranks."""
    factor = 2.0 * (ranks - 1) / ranks if kind == "all_reduce" else (ranks - 1) / ranks
    return factor * payload


def run(quick: bool = False, threads: int = 2, out=None) -> str:
    from prunopt import distributed as D
    from prunopt.ops import project_budget, topk_threshold

    torch.set_num_threads(threads)
    sizes = _SIZES[bool(quick)]
    per_rank = max(1, threads // WORLD)
    rows = []
    for n in sizes:
        reps = 3 if quick else (5 if n > 10_000_000 else 15)
        ranks = _run_ranks(n, per_rank, reps)
        grad = torch.cat([_shard(n, r, WORLD, "grad") for r in range(WORLD)])
        score = torch.cat([_shard(n, r, WORLD, "score") for r in range(WORLD)])
        k, budget = n // 10, 0.1 * n
        thr = topk_threshold(grad, k)
        if thr.item() != ranks[0]["threshold_value"]:
            raise AssertionError("the one-process threshold differs from the sharded one")
        proj_sum = float(project_budget(score, budget).double().sum())
        if abs(proj_sum - sum(r["projection_sum"] for r in ranks)) > 1e-6 * n:
            raise AssertionError("the one-process projection differs from the sharded one")
        min_t = 0.3 if quick else 1.0
        fns = {"threshold": lambda: topk_threshold(grad, k), "projection": lambda: project_budget(score, budget)}
        ones = {op: median_time(fn, min_t, threads) for op, fn in fns.items()}
        # one thread too: on a loaded host, threads that wait for each other inflate the parallel figure
        ones1 = {op: median_time(fn, min_t, 1) for op, fn in fns.items()} if threads > 1 else ones
        del grad, score
        for op in ("threshold", "projection"):
            one, one1 = ones[op], ones1[op]
            rows.append({"n": n, "op": op, "contender": f"one-process ({threads} threads)", "ranks": 1,
                         "time_ms": 1e3 * one, "vs_one_process": 1.0, "collectives_per_call": 0,
                         "payload_bytes_per_rank": 0})
            if threads > 1:
                rows.append({"n": n, "op": op, "contender": "one-process (1 thread)", "ranks": 1,
                             "time_ms": 1e3 * one1, "vs_one_process": one1 / one,
                             "collectives_per_call": 0, "payload_bytes_per_rank": 0})
            for (o, name), r0 in ((key, v) for key, v in ranks[0].items() if isinstance(key, tuple)):
                if o != op:
                    continue
                secs = max(rk[(o, name)]["seconds"] for rk in ranks)
                rows.append({"n": n, "op": op, "contender": f"{name} ({WORLD} ranks x {per_rank} thread)",
                             "ranks": WORLD, "time_ms": 1e3 * secs, "vs_one_process": secs / one,
                             "vs_one_process_1_thread": secs / one1, "collectives_per_call": r0["calls"],
                             "payload_bytes_per_rank": r0["bytes"]})
        step = {key[1]: max(rk[key]["seconds"] for rk in ranks)
                for key in ranks[0] if isinstance(key, tuple) and key[0] == "fsdp2 step"}
        base = min(secs for name, secs in step.items() if name.startswith("torch Adagrad"))
        for name, secs in step.items():
            r0 = ranks[0][("fsdp2 step", name)]
            rows.append({"n": n, "op": "fsdp2 step", "contender": f"{name} ({WORLD} ranks x {per_rank} thread)",
                         "ranks": WORLD, "time_ms": 1e3 * secs, "vs_one_process": "",
                         "vs_adagrad": secs / base, "collectives_per_call": r0["calls"],
                         "payload_bytes_per_rank": r0["bytes"]})
        for (op, name), kind in _MODEL_KINDS.items():
            r0 = ranks[0][(op, name)]
            # the baselines move all N values (the gathered tensor, the dense scores) whatever the ranks
            payload = r0["bytes"] * WORLD if kind == "all_gather" else r0["bytes"]
            for w in MODEL_RANKS:
                grown, calls = payload, r0["calls"]
                if (op, name) == ("threshold", "sharded"):
                    # the first call: the windows' 8192 slots up to 8 ranks, none beyond, and the slices'
                    # area grows beyond 29 ranks (70 slots per rank): prunopt.distributed._first_size
                    grown += 8 * (D._first_size(w) - D._first_size(WORLD))
                    if w > D._WINDOW_WORLD and calls == 1:
                        # without windows, the slices' bracket and one radix pass (2051 slots) on alike ranks
                        calls, grown = 2, grown + 8 * (2048 + 3)
                elif (op, name) == ("projection", "sharded") and D._PROJ_DEVICES:
                    # the sample call and each pass grow by 16 and 8 bytes per rank (two float64 counts, one):
                    # prunopt.distributed._proj_sizes
                    (f_w, p_w), (f_2, p_2) = D._proj_sizes(w), D._proj_sizes(WORLD)
                    grown += 8 * ((f_w - f_2) + (r0["calls"] - 1) * (p_w - p_2))
                rows.append({"n": n, "op": op, "contender": f"model: {name}", "ranks": w, "time_ms": "",
                             "vs_one_process": "", "collectives_per_call": calls,
                             "payload_bytes_per_rank": _ring_bytes(kind, grown, w)})
    notes = (f"float32; N elements in all, 2 gloo ranks spawned on this machine (127.0.0.1), {per_rank} thread(s) "
             f"each; one-process contenders with {threads} threads and 1 after the ranks exit. threshold: k = N/10 of "
             "randn; projection: S = 0.1 N of scores uniform in [0, 1.2). Rank rows: the slower rank's median of "
             "reps calls (15 up to 10M, 5 above; 3 with --quick) after a warm-up round, each call timed alone, in "
             "lockstep, in reps/5 rounds that take the contenders in turn (a burst of 5 calls each after one untimed "
             "settling call; round r starts at contender r; one burst of 5 at 100M); "
             "payload_bytes_per_rank = what one rank hands to the collectives per call (counted by wrapping "
             "torch.distributed). Model rows: bytes one rank sends per call on a ring of `ranks` ranks "
             "(all_reduce 2(W-1)/W x payload, all_gather (W-1)/W x the gathered N x 4 bytes); the sharded rows' "
             "payload does not depend on N (the threshold's first call carries up to 8 ranks every rank's window, "
             "8192 slots in all, and no window beyond, where alike ranks take a second call of 2051 slots; beyond "
             "29 ranks, a 70-entry slice per rank, 560 bytes; the projection's calls 16 and 8 bytes per rank). "
             "Targets: sharded bytes per rank per call independent of N (<= 1 MB); the 2-rank sharded threshold "
             "<= 1.5x the one-process time on the same N. "
             "vs_one_process_1_thread: against the one-process op on one thread (a loaded host inflates the "
             "multi-threaded figure). fsdp2 step: one optimizer step on a model of N weights (10 linear layers) "
             "sharded by fully_shard over the 2 ranks, fixed gradients; PrunAdag (fused, version 3, relevant "
             "0.1, global scope: the exact sharded threshold with the ratio's norms carried by its collectives) "
             "against the faster of torch's Adagrad foreach and for-loop steps on the same sharded model (torch's "
             "fused Adagrad has no "
             "DTensor support) (vs_adagrad; target <= 1.3), verified first against the "
             "one-process PrunAdag step on the gathered parameters. The plain sharded rows wait the default way "
             "(set_poll_time('auto'): each rank times its collectives blocked and polled and takes the faster); "
             "'polled waits': the same calls with prunopt.distributed.set_poll_time(0.005) (each collective "
             "polled for completion for up to 5 ms before it blocks), 'blocking waits' with set_poll_time(0) "
             "(blocked at once, as torch.distributed waits). 'without windows': the same calls with the selects' "
             "windows off (the slices' bracket, then a radix pass: 2 collectives on alike ranks), the windows' "
             "effect side by side. 'floor': what any exact sharded select must at least do here, the sharded "
             "select's own pass over its shard (topk_bracket over the bracket it takes) and one all_reduce of its "
             "first collective's size, waited the default way: the sharded row's distance to it is the select's "
             "own overhead (sample, slice, window, Python), the floor's to the one-process row the cost of two "
             "ranks sharing this host's cores and memory bandwidth and of one gloo round. "
             "Rerun: `python -m prunopt.bench.run --only distributed [--quick]`.")
    columns = ["n", "op", "contender", "ranks", "time_ms", "vs_one_process", "vs_one_process_1_thread", "vs_adagrad",
               "collectives_per_call", "payload_bytes_per_rank"]
    return write_results("distributed", rows, environment(threads), notes, out, columns)
