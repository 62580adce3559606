"""The ``prunopt`` command line.

    prunopt train --method probmask --density 0.1 [--epochs N] [--out DIR]
    prunopt repro NAME [--out DIR] [--quick]
    prunopt bench [--quick] [--only NAME]
    prunopt compare --method snip [--sparsities 0.5,0.8,0.9] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


def _fraction(name):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number in [0, 1], got {text!r}")
        if not 0.0 <= v <= 1.0:
            raise argparse.ArgumentTypeError(f"{name} must be in [0, 1], got {v}")
        return v

    return parse


def _positive_int(name):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {v}")
        return v

    return parse


def build_parser() -> argparse.ArgumentParser:
    from prunopt.repro import REPROS
    from prunopt.train.methods import METHODS

    p = argparse.ArgumentParser(prog="prunopt", description="Pruning-aware optimizers, masks and sparse layers.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train the example CNN on the embedded digits dataset with a pruning method")
    t.add_argument("--method", required=True, choices=sorted(METHODS), help="pruning method")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--density", type=_fraction("--density"), help="fraction of prunable weights kept (default 0.1)")
    g.add_argument("--sparsity", type=_fraction("--sparsity"), help="fraction of prunable weights removed (1 - density)")
    t.add_argument("--epochs", type=_positive_int("--epochs"), default=None, help="training epochs (method default)")
    t.add_argument("--batch-size", type=_positive_int("--batch-size"), default=64)
    t.add_argument("--lr", type=float, default=None, help="learning rate (method default)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default=None, help="folder for checkpoint.pt, summary.json and history.png")
    t.add_argument("--limit", type=_positive_int("--limit"), default=None, help="use only this many images (quick runs)")
    t.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    for entry in METHODS.values():
        if entry.add_arguments is not None:
            entry.add_arguments(t)

    r = sub.add_parser("repro", help="reproduce a paper's experiment")
    r.add_argument("name", choices=sorted(REPROS) or ["(none)"])
    r.add_argument("--out", default="runs/repro", help="folder for tables and plots")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--quick", action="store_true", help="a small, fast version")
    r.add_argument("--no-progress", dest="progress", action="store_false")
    for entry in REPROS.values():
        if entry.add_arguments is not None:
            entry.add_arguments(r)

    # --- compare (issue 5): SP vs IP for one pruning-toolkit method ---
    c = sub.add_parser("compare", help="SP vs IP for one pruning method over a few sparsities (markdown table + PNG)")
    c.add_argument("--method", required=True, choices=["pai-random", "snip", "grasp", "synflow", "lt", "set", "rigl", "gmp", "ft"])
    c.add_argument("--sparsities", default="0.5,0.8,0.9,0.95", help="comma-separated sparsities (default 0.5,0.8,0.9,0.95)")
    c.add_argument("--out", default="runs/compare", help="folder for compare_<method>.md and .png")
    c.add_argument("--epochs", type=_positive_int("--epochs"), default=None)
    c.add_argument("--limit", type=_positive_int("--limit"), default=None)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--sharing", choices=["fine", "coarse"], default="fine")
    c.add_argument("--no-progress", dest="progress", action="store_false")

    b = sub.add_parser("bench", help="run the microbenchmark suite (writes bench/results/)")
    b.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    b.add_argument("--only", action="append", default=None, help="run only this benchmark (repeatable)")
    b.add_argument("--threads", type=_positive_int("--threads"), default=2)
    b.add_argument("--out", default=None, help="results folder (default bench/results)")
    return p


def _bench_dir() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(here, "bench")
    if not os.path.isfile(os.path.join(path, "run.py")):
        raise SystemExit("prunopt bench: the bench/ folder of a source checkout is needed (not found next to the package)")
    return path


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        from prunopt.train.methods import METHODS

        if args.density is None:
            args.density = 1.0 - args.sparsity if args.sparsity is not None else 0.1
        summary = METHODS[args.method].run(args)
        print(summary.line(), flush=True)
        return 0
    if args.command == "repro":
        from prunopt.repro import REPROS

        if args.name not in REPROS:
            raise SystemExit("prunopt repro: no reproductions are registered")
        REPROS[args.name].run(args)
        return 0
    if args.command == "compare":
        from prunopt.train.methods.toolkit import compare

        ps = [_fraction("--sparsities")(v.strip()) for v in args.sparsities.split(",") if v.strip()]
        extra = ["--seed", str(args.seed), "--sharing", args.sharing]
        extra += ["--epochs", str(args.epochs)] if args.epochs else []
        extra += ["--limit", str(args.limit)] if args.limit else []
        extra += [] if args.progress else ["--no-progress"]
        print(compare(args.method, ps, args.out, extra), flush=True)
        return 0
    if args.command == "bench":
        sys.path.insert(0, os.path.dirname(_bench_dir()))
        from bench import run as bench_run

        return bench_run.main(quick=args.quick, only=args.only, threads=args.threads, out=args.out)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
