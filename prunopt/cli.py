"""The ``prunopt`` command line.

    prunopt train --method probmask --density 0.1 [--epochs N] [--out DIR]
    prunopt repro NAME [--out DIR] [--quick]
    prunopt bench [--quick] [--only NAME]
    prunopt compare --method snip [--sparsities 0.85,0.9,0.95,0.98] [--seeds 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


from prunopt.train.args import fraction_arg, fractions_arg, positive_float_arg, positive_int_arg


def build_parser() -> argparse.ArgumentParser:
    """The ``prunopt`` parser: sub-commands ``train``, ``repro``, ``compare``, ``bench``."""
    from prunopt.repro import add_repro_arguments
    from prunopt.train.methods import METHODS

    p = argparse.ArgumentParser(prog="prunopt", description="Pruning-aware optimizers, masks and sparse layers.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train the example CNN on the embedded digits dataset with a pruning method")
    t.add_argument("--method", required=True, choices=sorted(METHODS), help="pruning method")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--density", type=fraction_arg("--density"), help="fraction of prunable weights kept (default 0.1)")
    g.add_argument("--sparsity", type=fraction_arg("--sparsity"), help="fraction of prunable weights removed (1 - density)")
    t.add_argument("--epochs", type=positive_int_arg("--epochs"), default=None, help="training epochs (method default)")
    t.add_argument("--batch-size", type=positive_int_arg("--batch-size"), default=64)
    t.add_argument("--lr", type=positive_float_arg("--lr"), default=None, help="learning rate > 0 (method default)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default=None, help="folder for checkpoint.pt, summary.json and history.png")
    t.add_argument("--limit", type=positive_int_arg("--limit"), default=None, help="use only this many images (quick runs)")
    t.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    for entry in METHODS.values():
        if entry.add_arguments is not None:
            entry.add_arguments(t)

    r = sub.add_parser("repro", help="reproduce a paper's experiment (claims table, markdown + JSON)")
    add_repro_arguments(r)

    # --- compare (issue 5): SP vs IP for one pruning-toolkit method ---
    c = sub.add_parser("compare", help="SP vs IP at equal pruning rate (eq. 9) for one pruning method, over seeds "
                       "(markdown + JSON tables, PNG)")
    c.add_argument("--method", required=True, choices=["pai-random", "snip", "grasp", "synflow", "lt", "set", "rigl", "gmp", "ft"])
    c.add_argument("--sparsities", type=fractions_arg("--sparsities"), default="0.85,0.9,0.95,0.98",
                   help="comma-separated target pruning rates in [0, 1] (default 0.85,0.9,0.95,0.98)")
    c.add_argument("--out", default="runs/compare", help="folder for compare_<method>.md, .json and .png")
    c.add_argument("--epochs", type=positive_int_arg("--epochs"), default=None)
    c.add_argument("--limit", type=positive_int_arg("--limit"), default=None)
    c.add_argument("--seed", type=int, default=0, help="first seed")
    c.add_argument("--seeds", type=positive_int_arg("--seeds"), default=5, help="number of seeds (mean ± std; default 5)")
    c.add_argument("--threads", type=positive_int_arg("--threads"), default=None,
                   help="torch threads; set, the runs are deterministic for a given seed and thread count")
    c.add_argument("--sharing", choices=["fine", "coarse"], default="fine")
    c.add_argument("--merge", default=None,
                   help="comma-separated folders of earlier compare runs of --method (other seeds); write their "
                        "combined report to --out")
    c.add_argument("--no-progress", dest="progress", action="store_false")

    b = sub.add_parser("bench", help="run the microbenchmark suite (writes bench/results/)")
    b.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    b.add_argument("--only", action="append", default=None, help="run only this benchmark (repeatable)")
    b.add_argument("--threads", type=positive_int_arg("--threads"), default=2)
    b.add_argument("--out", default=None, help="results folder (default bench/results)")
    p.subparsers = {"train": t, "repro": r, "compare": c, "bench": b}  # for check_arguments' usage errors
    return p


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that need several options or the chosen method (e.g. ``--sparsity 1``
    with ``--method lt``), right after parsing and before any work: a bad value
    is a usage error (``parser.error``: message on stderr, exit status 2).
    Fills ``args.density`` for ``train`` (default 0.1, or ``1 - --sparsity``)."""
    from prunopt.train.methods import METHODS

    sub = getattr(parser, "subparsers", {}).get(args.command, parser)
    if args.command == "train":
        if args.density is None:
            args.density = 1.0 - args.sparsity if args.sparsity is not None else 0.1
        check = METHODS[args.method].check_arguments
        if check is not None:
            try:
                check(args)
            except ValueError as e:
                sub.error(str(e))
    elif args.command == "compare":
        check = METHODS[args.method].check_arguments
        if check is None:
            return
        base = vars(parser.parse_args(["train", "--method", args.method]))  # the train defaults compare uses
        for p in args.sparsities:
            try:
                check(argparse.Namespace(**{**base, "sparsity": p, "density": 1.0 - p}))
            except ValueError as e:
                sub.error(f"--sparsities {p}: {e}")


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the ``prunopt`` command (``argv`` defaults to ``sys.argv[1:]``);
    returns the exit status. Bad option values exit with status 2 (usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    if args.command == "train":
        from prunopt.train.methods import METHODS

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
        from prunopt.train.methods.toolkit import compare, merge_compare

        if args.merge:
            folders = [d.strip() for d in args.merge.split(",") if d.strip()]
            print(merge_compare(args.method, folders, args.out), flush=True)
            return 0
        ps = args.sparsities
        extra = ["--sharing", args.sharing]
        extra += ["--epochs", str(args.epochs)] if args.epochs else []
        extra += ["--limit", str(args.limit)] if args.limit else []
        extra += [] if args.progress else ["--no-progress"]
        seeds = [args.seed + i for i in range(args.seeds)]
        print(compare(args.method, ps, args.out, extra, parser=parser, seeds=seeds, threads=args.threads), flush=True)
        return 0
    if args.command == "bench":
        from prunopt.bench import run as bench_run

        return bench_run.main(quick=args.quick, only=args.only, threads=args.threads, out=args.out)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
