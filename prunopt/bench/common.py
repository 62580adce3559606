"""Shared helpers of the microbenchmarks: timing with torch.utils.benchmark,
the environment record, and the JSON + markdown writers.

Every benchmark verifies its results before it times them, times each
contender in the same process, and reports medians and ratios.

A benchmark module ``prunopt/bench/bench_<name>.py`` exposes
``run(quick: bool, threads: int, out: str) -> str`` (the markdown it wrote)
and raises :class:`BenchmarkSkipped` when it cannot run here (e.g. no CUDA
device). Results go where ``out`` points; without one, into a new
``./prunopt-bench-<time>`` directory (:func:`default_out_dir`), never into the
package or a checkout's committed ``bench/results``.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch.utils import benchmark

#: where a source checkout keeps its committed results (``prunopt bench --out bench/results`` writes there)
RESULTS_DIR = os.path.join("bench", "results")

_max_time: Optional[float] = None
_default_out: Optional[str] = None


class BenchmarkSkipped(Exception):
    """Raised by a benchmark's ``run`` that cannot run on this machine (the
    message says why); the runner reports it and goes on."""


def default_out_dir() -> str:
    """A new directory ``./prunopt-bench-<UTC time>`` (``-2``, ``-3``... if
    taken), created once per process and reused by later calls."""
    global _default_out
    if _default_out is None or not os.path.isdir(_default_out):
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        base = os.path.abspath(f"prunopt-bench-{stamp}")
        path, n = base, 1
        while True:
            try:
                os.makedirs(path)
                break
            except FileExistsError:
                n += 1
                path = f"{base}-{n}"
        _default_out = path
    return _default_out


@contextlib.contextmanager
def max_time(seconds: Optional[float]) -> Iterator[None]:
    """Within the block, every timing loop of :func:`median_time` (and so
    :func:`interleaved_times`) runs at most ``seconds`` (None: no cap): fast
    smoke runs of the suite, with noisier figures."""
    global _max_time
    old, _max_time = _max_time, seconds
    try:
        yield
    finally:
        _max_time = old


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(threads: int) -> Dict[str, object]:
    import prunopt

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "prunopt_extension": prunopt.extension_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return env


def median_time(fn: Callable[[], object], min_run_time: float = 1.0, threads: int = 2, device: str = "cpu") -> float:
    """Median seconds per call of ``fn`` (torch.utils.benchmark, blocked autorange;
    CUDA calls are synchronised by the Timer)."""
    if _max_time is not None:
        min_run_time = min(min_run_time, _max_time)
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    return timer.blocked_autorange(min_run_time=min_run_time).median


def interleaved_times(fns: Dict[str, Callable[[], object]], min_run_time: float = 1.0, threads: int = 2,
                      rounds: int = 5, device: str = "cpu") -> Dict[str, float]:
    """Median seconds per call of each contender, measured in ``rounds`` rounds
    that take the contenders in turn (each round a blocked autorange of
    ``min_run_time / rounds``); a contender's time is the median of its round
    medians. On a shared or throttled host the speed drifts over seconds, and
    timing one contender after the other puts that drift into their ratio;
    alternating spreads it over all of them."""
    per = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per[name].append(median_time(fn, min_run_time / rounds, threads, device))
    return {name: statistics.median(ts) for name, ts in per.items()}


def write_results(name: str, rows: List[Dict[str, object]], env: Dict[str, object], notes: str = "",
                  out_dir: Optional[str] = None, columns: Optional[List[str]] = None) -> str:
    """Writes ``<name>.json`` and ``<name>.md`` into ``out_dir`` (default: :func:`default_out_dir`)."""
    out_dir = out_dir or default_out_dir()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"benchmark": name, "environment": env, "rows": rows, "notes": notes}, f, indent=2)
    columns = columns or list(rows[0].keys()) if rows else []
    lines = [f"# {name}", "", notes, "", "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), ""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    return md


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
