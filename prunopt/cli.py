"""The ``prunopt`` command line.

    prunopt train --method probmask --density 0.1 [--epochs N] [--out DIR]
    prunopt train --resume DIR
    torchrun --nproc_per_node=N -m prunopt train --method M ...
    prunopt repro NAME [--out DIR] [--quick]
    prunopt bench [--quick] [--only NAME] [--out DIR]
    prunopt compare --method snip [--sparsities 0.85,0.9,0.95,0.98] [--seeds 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import List, Optional


from prunopt.train.args import fraction_arg, fractions_arg, positive_float_arg, positive_int_arg

#: options that a resumed run may give with another value than the interrupted one
RESUME_MAY_CHANGE = ("resume", "progress", "checkpoint_every", "command")


def _methods_epilog(methods) -> str:
    width = max(len(n) for n in methods) + 2
    lines = ["methods (--method):"] + [f"  {n:<{width}}{methods[n].help}" for n in sorted(methods)]
    lines += ["",
              "torchrun --nproc_per_node=N -m prunopt train --method M ... trains data-parallel, every method:",
              "  replicated with DDP by default, sharded with FSDP2 (fully_shard) with --fsdp. --batch-size is the",
              "  global minibatch: each rank trains on its slice of every minibatch of the one-process run, and",
              "  rank 0 alone prints and writes --out; the summary line ends with world_size=N. Masks, scores,",
              "  projections and regularisers are global (the same on every rank, as in one process); batch-norm",
              "  statistics are each rank's. Under --fsdp, GraSP scores the whole model before it is sharded.",
              "  (docs/distributed.md, \"prunopt train under torchrun\")",
              "With --out, a checkpoint is written every epoch (--checkpoint-every) and an interrupted run "
              "continues exactly with --resume DIR (also under torchrun, with the same N)."]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The ``prunopt`` parser: sub-commands ``train``, ``repro``, ``compare``, ``bench``."""
    from prunopt.repro import add_repro_arguments
    from prunopt.train.methods import METHODS

    p = argparse.ArgumentParser(prog="prunopt", description="Pruning-aware optimizers, masks and sparse layers.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train the example CNN on the embedded digits dataset with a pruning method",
                       description="Train the example CNN on the embedded digits dataset with a pruning method "
                                   "and print one summary line.",
                       epilog=_methods_epilog(METHODS), formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--method", choices=sorted(METHODS), metavar="METHOD",
                   help="pruning method (listed below; required unless --resume)")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--density", type=fraction_arg("--density"), help="fraction of prunable weights kept (default 0.1)")
    g.add_argument("--sparsity", type=fraction_arg("--sparsity"), help="fraction of prunable weights removed (1 - density)")
    t.add_argument("--epochs", type=positive_int_arg("--epochs"), default=None, help="training epochs (method default)")
    t.add_argument("--batch-size", type=positive_int_arg("--batch-size"), default=64,
                   help="global minibatch size (under torchrun split over the processes; default 64)")
    t.add_argument("--lr", type=positive_float_arg("--lr"), default=None, help="learning rate > 0 (method default)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default=None,
                   help="directory for the run's files (run.json, checkpoint.pt, summary.json, history.png), "
                        "written as a unit: a new or empty directory, or a finished run to replace")
    t.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the interrupted run of --out DIR from its last checkpoint, bit for bit "
                        "(the run's options are read from it)")
    t.add_argument("--checkpoint-every", type=positive_int_arg("--checkpoint-every"), default=1, metavar="N",
                   help="with --out, write the resume checkpoint every N epochs (default 1)")
    t.add_argument("--threads", type=positive_int_arg("--threads"), default=None,
                   help="intra-op CPU threads (default: torch's); results are reproducible for a given count")
    t.add_argument("--fsdp", action="store_true",
                   help="under torchrun, shard the model with FSDP2 (parameters, gradients and optimizer state "
                        "split over the ranks) instead of replicating it with DDP; every method runs sharded")
    t.add_argument("--limit", type=positive_int_arg("--limit"), default=None, help="use only this many images (quick runs)")
    t.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    for entry in METHODS.values():
        if entry.add_arguments is not None:
            entry.add_arguments(t)

    r = sub.add_parser("repro", help="reproduce a paper's experiment (claims table, markdown + JSON)")
    add_repro_arguments(r)

    # SP vs IP for one pruning-toolkit method
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

    b = sub.add_parser("bench", help="run the microbenchmark suite (writes a new ./prunopt-bench-<time>/ by default)")
    b.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    b.add_argument("--only", action="append", default=None, metavar="NAME",
                   help="run only this benchmark (repeatable; names: see --list)")
    b.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    b.add_argument("--threads", type=positive_int_arg("--threads"), default=2)
    b.add_argument("--max-time", type=positive_float_arg("--max-time"), default=None, metavar="S",
                   help="cap every timing loop at S seconds (smoke runs; the figures get noisier)")
    b.add_argument("--out", default=None,
                   help="results folder (default: a new ./prunopt-bench-<time>; the committed results are "
                        "bench/results of a source checkout)")
    p.subparsers = {"train": t, "repro": r, "compare": c, "bench": b}  # for check_arguments' usage errors
    return p


def _option_name(parser: argparse.ArgumentParser, dest: str) -> str:
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return action.option_strings[0]
    return "--" + dest.replace("_", "-")


def _merge_resumed(sub: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` of ``train --resume DIR``: the interrupted run's options (its
    run.json); options given again must have the run's values."""
    from prunopt.train.output import find_resumable, read_run_info, staging_path

    staging = find_resumable(args.resume)
    info = read_run_info(staging)
    saved = dict(info["args"])
    for key, value in vars(args).items():
        if key in RESUME_MAY_CHANGE or value == sub.get_default(key):
            continue
        have = saved.get(key)
        if key == "out" and value is not None and have is not None:
            same = os.path.abspath(value) == have or staging_path(value) == staging
        elif key in ("density", "sparsity") and isinstance(have, float):
            same = math.isclose(value, have, abs_tol=1e-12)
        else:
            same = value == have
        if not same:
            raise ValueError(f"{_option_name(sub, key)} {value} differs from the interrupted run's value {have}: "
                             f"a resumed run keeps its options ({os.path.join(staging, 'run.json')})")
    merged = argparse.Namespace(**saved)
    merged.command, merged.resume, merged.progress = "train", staging, args.progress
    if args.checkpoint_every != sub.get_default("checkpoint_every"):
        merged.checkpoint_every = args.checkpoint_every
    from prunopt.train.parallel import torchrun_environment

    env = torchrun_environment()
    world = env[1] if env else 1
    if info.get("world_size", 1) != world:
        raise ValueError(f"--resume {args.resume}: the run was started by {info.get('world_size', 1)} process(es), "
                         f"this one has {world}: resume it with the same number of processes")
    return merged


def _check_train(sub: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    from prunopt.train.methods import METHODS
    from prunopt.train.output import check_out
    from prunopt.train.parallel import torchrun_environment

    env = torchrun_environment()
    if args.resume:
        args = _merge_resumed(sub, args)
    else:
        if args.method is None:
            raise ValueError("--method is required (or --resume DIR to continue an interrupted run)")
        if args.density is None:
            args.density = 1.0 - args.sparsity if args.sparsity is not None else 0.1
        # rank 0 alone writes --out, so it alone checks it: another rank looking
        # later could see the staging directory rank 0 has already created
        if args.out is not None and (env is None or env[0] == 0):
            check_out(args.out)
    entry = METHODS[args.method]
    if args.fsdp:
        if env is None or env[1] < 2:
            raise ValueError("--fsdp shards the model over the processes of torchrun: launch with "
                             "torchrun --nproc_per_node=N (N >= 2)")
        if entry.fsdp is not None:
            raise ValueError(f"--fsdp is not supported by --method {args.method} yet: {entry.fsdp}")
    if entry.check_arguments is not None:
        entry.check_arguments(args)
    return args


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Checks that need several options, the chosen method (e.g. ``--sparsity 1``)
    or the filesystem (``--out``, ``--resume``), right after parsing and before
    any work: a bad value is a usage error (``parser.error``: message on
    stderr, exit status 2, no traceback). Returns the arguments to run with:
    for ``train``, ``density`` is filled (default 0.1, or ``1 - --sparsity``)
    and ``--resume`` brings back the interrupted run's options."""
    from prunopt.train.methods import METHODS, check_density
    from prunopt.train.parallel import launched_with_several_processes

    sub = getattr(parser, "subparsers", {}).get(args.command, parser)
    try:
        if args.command == "train":
            return _check_train(sub, args)
        if launched_with_several_processes():
            raise ValueError(f"prunopt {args.command} runs in one process: launch it without torchrun "
                             "(only prunopt train is distributed)")
        if args.command == "compare":
            check = METHODS[args.method].check_arguments or check_density
            base = vars(parser.parse_args(["train", "--method", args.method]))  # the train defaults compare uses
            for p in args.sparsities:
                try:
                    check(argparse.Namespace(**{**base, "sparsity": p, "density": 1.0 - p}))
                except ValueError as e:
                    raise ValueError(f"--sparsities {p}: {e}") from None
    except ValueError as e:
        sub.error(str(e))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the ``prunopt`` command (``argv`` defaults to ``sys.argv[1:]``);
    returns the exit status. Bad option values exit with status 2 (usage
    error); a train run stopped by Ctrl-C, SIGTERM or SIGHUP returns 128 + the
    signal number after cleaning up."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args = check_arguments(parser, args)
    if args.command == "train":
        from prunopt.train.job import Interrupted, run

        try:
            run(args)
        except Interrupted as e:
            return 128 + e.signum
        except KeyboardInterrupt:
            return 130
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

        try:
            return bench_run.main(quick=args.quick, only=args.only, threads=args.threads, out=args.out,
                                  max_time=args.max_time, list_only=args.list)
        except ValueError as e:
            parser.subparsers["bench"].error(str(e))
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
