"""Runs every ``bench/bench_*.py`` (or those named with ``--only``) and writes
``bench/results/<name>.json`` and ``.md`` plus an index ``bench/results/README.md``.

    python -m bench.run [--quick] [--only projection] [--threads 2]
    prunopt bench [--quick] [--only projection]
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import torch

from prunopt.bench.common import RESULTS_DIR


def discover():
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([here]) if m.name.startswith("bench_"))


def main(quick: bool = False, only=None, threads: int = 2, out=None) -> int:
    names = discover()
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise SystemExit(f"unknown benchmark(s) {unknown}; available: {names}")
        names = [n for n in names if n in only]
    torch.set_num_threads(threads)
    out = out or RESULTS_DIR
    index = ["# Benchmark results", "", "Regenerate with `prunopt bench` (or `python -m bench.run`).", ""]
    for name in names:
        mod = importlib.import_module(f"prunopt.bench.bench_{name}")
        print(f"== {name}", flush=True)
        md = mod.run(quick=quick, threads=threads, out=out)
        print(md, flush=True)
        index.append(f"- [{name}]({name}.md)")
    if not only:
        with open(os.path.join(out, "README.md"), "w") as f:
            f.write("\n".join(index) + "\n")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", action="append")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    sys.exit(main(a.quick, a.only, a.threads, a.out))
