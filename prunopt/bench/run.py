"""Runs every benchmark ``prunopt/bench/bench_<name>.py`` (or those named with
``--only``) and writes ``<name>.json`` and ``.md`` plus an ``index.md`` into
one results directory.

    prunopt bench [--quick] [--only projection] [--threads 2] [--out DIR] [--max-time S]
    python -m prunopt.bench.run [same options]

The benchmarks are found as modules of the installed ``prunopt.bench``
package (``pkgutil`` over its ``__path__``), so an installed prunopt runs them
as a source checkout does. Results go into ``--out`` or, by default, a new
``./prunopt-bench-<time>`` directory: never into the package, and into a
checkout's committed ``bench/results`` only when asked (``--out bench/results``).
A benchmark that cannot run here (``bench_gpu`` without CUDA) is reported as
skipped.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from typing import List, Optional, Sequence

import torch

from prunopt.bench import common
from prunopt.bench.common import BenchmarkSkipped, default_out_dir, environment


def discover() -> List[str]:
    """Names of the benchmarks (``bench_<name>`` modules of ``prunopt.bench``), sorted."""
    import prunopt.bench as package

    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(package.__path__)
                  if m.name.startswith("bench_"))


def main(quick: bool = False, only: Optional[Sequence[str]] = None, threads: int = 2, out: Optional[str] = None,
         max_time: Optional[float] = None, list_only: bool = False) -> int:
    """Runs the benchmarks; returns the exit status (0). ``only``: names to run
    (``ValueError`` for an unknown one); ``out``: results directory (default
    :func:`~prunopt.bench.common.default_out_dir`); ``max_time``: cap in
    seconds on every timing loop (smoke runs); ``list_only``: print the names."""
    names = discover()
    if list_only:
        print("\n".join(names))
        return 0
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(names)}")
        names = [n for n in names if n in only]
    cap = max_time
    if cap is not None and not cap > 0:
        raise ValueError(f"max_time must be > 0 seconds, got {cap}")
    out = os.path.abspath(out) if out else default_out_dir()
    os.makedirs(out, exist_ok=True)
    index = ["# Benchmark results", "",
             f"`prunopt bench{' --quick' if quick else ''}{f' --max-time {cap:g}' if cap else ''} "
             f"--threads {threads}` on " + ", ".join(f"{k}={v}" for k, v in environment(threads).items()), ""]
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with common.max_time(cap):
            for name in names:
                mod = importlib.import_module(f"prunopt.bench.bench_{name}")
                if not callable(getattr(mod, "run", None)):
                    raise RuntimeError(f"prunopt.bench.bench_{name} has no run(quick, threads, out)")
                print(f"== {name}", flush=True)
                try:
                    md = mod.run(quick=quick, threads=threads, out=out)
                except BenchmarkSkipped as e:
                    print(f"skipped: {e}", flush=True)
                    index.append(f"- {name}: skipped ({e})")
                    continue
                print(md, flush=True)
                written = sorted(f[:-3] for f in os.listdir(out) if f.endswith(".md") and f != "index.md")
                index.append(f"- {name}: " + ", ".join(f"[{w}]({w}.md)" for w in written if w.startswith(name)
                                                         or _belongs(name, w)))
    finally:
        torch.set_num_threads(old_threads)
    with open(os.path.join(out, "index.md"), "w") as f:
        f.write("\n".join(index) + "\n")
    print(f"prunopt bench: wrote {out}", flush=True)
    return 0


def _belongs(bench: str, result: str) -> bool:
    # bench_interspace writes fb_conv2d_training / fb_conv2d_inference
    return bench == "interspace" and result.startswith("fb_conv2d")


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m prunopt.bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", action="append")
    p.add_argument("--list", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-time", type=float, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    try:
        sys.exit(main(a.quick, a.only, a.threads, a.out, list_only=a.list, max_time=a.max_time))
    except ValueError as e:
        p.error(str(e))
