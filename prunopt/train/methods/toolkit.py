"""``prunopt train --method {pai-random,snip,grasp,synflow,lt,set,rigl,gmp,ft}
--space {standard,interspace} --sparsity P`` and ``prunopt compare --method M``.

Every job trains :class:`~prunopt.train.SmallCNN` on the embedded digits with
SGD (momentum 0.9, weight decay 5e-4 — none on filter bases, App. B.3) and a
cosine learning-rate schedule, and ends with the summary line: ``dense_acc``
(the same network trained dense), ``pruned_acc``, ``density``/``sparsity`` of
the prunable tensors (``p_SP`` of eq. 9) and ``p_ip`` (eq. 9 with the bases).
With ``--space interspace`` every 3×3 convolution becomes an ``FBConv2d``
(``prunopt.nn.to_interspace``) and its coefficients are pruned instead of its
spatial weights (paper Sec. 4.4).  Schedules scaled to the small job (the
paper's step counts are for CIFAR/ImageNet) are documented in docs/pruning.md.
"""
from __future__ import annotations

import copy
import math
import os
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from prunopt.train.args import int_arg, positive_int_arg
from prunopt.pruning import (
    DynamicSparseTraining,
    FineTuning,
    GradualMagnitudePruning,
    LotteryTicket,
    Masker,
    PruningAtInit,
    export_csr,
    lottery_ticket_trainings,
    pruning_rates,
)
from prunopt.train.data import load_digits
from prunopt.train.job import Job
from prunopt.train.loop import Summary, iterate_minibatches
from prunopt.train.methods import check_density, register_method
from prunopt.train.models import SmallCNN

TOOLKIT_METHODS = {
    "pai-random": "pruning at initialisation with random scores (App. F.2, G.4)",
    "snip": "pruning at initialisation with SNIP scores |g*w| (App. F.5, G.4)",
    "grasp": "pruning at initialisation with GraSP scores -(Hg)*w (App. F.6, G.4)",
    "synflow": "pruning at initialisation with iterative SynFlow, 100 rounds (App. F.4, A.81)",
    "lt": "lottery tickets: iterative magnitude pruning (20%/round) with rewinding to t0 (App. G.2, A.75)",
    "set": "dynamic sparse training SET: ERK, magnitude drop, random regrowth (App. G.3)",
    "rigl": "dynamic sparse training RigL: ERK, magnitude drop, gradient regrowth (App. G.3)",
    "gmp": "gradual magnitude pruning with the cubic schedule (App. G.5, A.82)",
    "ft": "fine-tuning of a magnitude-pruned trained network (App. G.6)",
}

DEFAULT_EPOCHS = 12
DEFAULT_LR = 0.05


def add_arguments(parser) -> None:
    """The toolkit's options (added once, whichever toolkit method comes first)."""
    if "--space" in parser._option_string_actions:
        return
    g = parser.add_argument_group("pruning toolkit (pai-random, snip, grasp, synflow, lt, set, rigl, gmp, ft)")
    g.add_argument("--space", choices=["standard", "interspace"], default="standard",
                   help="prune spatial weights (SP) or filter-basis coefficients (IP)")
    g.add_argument("--sharing", choices=["fine", "coarse"], default="fine", help="filter-basis sharing for --space interspace")
    g.add_argument("--basis-init", choices=["standard", "orthonormal", "random"], default="standard",
                   help="filter-basis initialisation for --space interspace (App. G, Alg. A1-A3)")
    g.add_argument("--score-batches", type=positive_int_arg("--score-batches"), default=10,
                   help="batches for SNIP/GraSP scores (paper: 100)")
    g.add_argument("--rewind-step", type=int_arg("--rewind-step", 0), default=None,
                   help="LT rewinding step t0 (default: half an epoch)")
    g.add_argument("--update-interval", type=positive_int_arg("--update-interval"), default=None,
                   help="SET/RigL mask-update interval in steps (default: one epoch)")


def _model(args, num_classes: int):
    model = SmallCNN(num_classes)
    if args.space == "interspace":
        from prunopt.nn import to_interspace

        g = torch.Generator().manual_seed(args.seed + 1)
        to_interspace(model, sharing=args.sharing, init=args.basis_init, generator=g)
    return model


def _optimizer(model, lr: float, epochs: int):
    bases = {id(m.weight) for m in model.modules() if type(m).__name__ == "FilterBasis"}
    decay = [p for p in model.parameters() if id(p) not in bases]
    no_decay = [p for p in model.parameters() if id(p) in bases]
    groups = [dict(params=decay, weight_decay=5e-4)]
    if no_decay:
        groups.append(dict(params=no_decay, weight_decay=0.0))
    opt = torch.optim.SGD(groups, lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs))
    return opt, sched


def _train(job, model, opt, sched, data, args, epochs, gen, phase, after_step=None, masker=None):
    """One phase of ``epochs`` epochs; returns the test accuracy after it
    (recorded, so a resumed run reads it instead of evaluating again)."""
    for _ in job.epochs(phase, epochs):
        job.train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen, after_step=after_step)
        sched.step()
        job.log(**{"test accuracy": job.evaluate(model, data.x_test, data.y_test),
                   "density": masker.density() if masker is not None else 1.0})
    return job.value(f"{phase}: accuracy", lambda: job.evaluate(model, data.x_test, data.y_test))


def check_arguments(method: str, args) -> None:
    """``ValueError`` for option values bad for ``method`` (run by the CLI right
    after parsing, and by :func:`run_toolkit`)."""
    if method == "lt" and not 1.0 - args.density < 1.0:
        raise ValueError("--sparsity must be < 1 for lottery tickets (--density > 0)")
    check_density(args)
    _check_args(args)


def _check_args(args) -> None:
    if args.score_batches < 1:
        raise ValueError(f"--score-batches must be >= 1, got {args.score_batches}")
    if args.rewind_step is not None and args.rewind_step < 0:
        raise ValueError(f"--rewind-step must be >= 0, got {args.rewind_step}")
    if args.update_interval is not None and args.update_interval < 1:
        raise ValueError(f"--update-interval must be >= 1, got {args.update_interval}")


def run_toolkit(method: str, args, job=None) -> Summary:
    """One training job of the pruning toolkit; returns the :class:`Summary`
    (``job``: the :class:`~prunopt.train.job.Job`, default one process)."""
    check_arguments(method, args)
    job = job or Job(args)
    data = load_digits(seed=args.seed, limit=args.limit)
    epochs = args.epochs or DEFAULT_EPOCHS
    lr = args.lr if args.lr is not None else DEFAULT_LR
    sparsity = 1.0 - args.density
    gen = torch.Generator().manual_seed(args.seed)
    model = _model(args, data.num_classes)
    init_state = copy.deepcopy(model)
    steps_per_epoch = math.ceil(len(data.y_train) / args.batch_size)
    total_steps = epochs * steps_per_epoch
    extra: Dict[str, object] = {"space": args.space}
    job.track(data_order=gen)

    def dense_baseline() -> float:
        dense = job.prepare(copy.deepcopy(init_state))
        opt, sched = _optimizer(dense, lr, epochs)
        g = torch.Generator().manual_seed(args.seed)
        job.track(dense_model=dense, dense_optimizer=opt, dense_scheduler=sched, dense_data_order=g)
        return _train(job, dense, opt, sched, data, args, epochs, g, "dense")

    def masked_model(before_wrapping=None):
        """Masks on ``model``, then ``job.prepare`` (under --fsdp it shards the
        model), then the optimizer (FSDP2 replaces the parameters).
        ``before_wrapping(masker)`` runs on the plain masked model."""
        masker = Masker(model)
        if before_wrapping is not None:
            before_wrapping(masker)
        job.prepare(model)  # after the masks are in place
        opt, sched = _optimizer(model, lr, epochs)
        masker.attach(opt)
        job.track(model=model, optimizer=opt, scheduler=sched, masker=masker)
        return opt, sched, masker

    if method in ("pai-random", "snip", "grasp", "synflow"):
        dense_acc = dense_baseline()
        score = "random" if method == "pai-random" else method
        batches = list(iterate_minibatches(data.x_train, data.y_train, args.batch_size, gen))[: args.score_batches]
        pai = []

        def prune(masker):
            pai.append(PruningAtInit(masker, score, sparsity, generator=torch.Generator().manual_seed(args.seed)))
            pai[0].prune(batches=batches, example_input=data.x_train[:1])

        # every rank scores the same global batches. GraSP's Hessian-vector product (a double
        # backward) needs the whole model: it scores before --fsdp shards it (each rank alike);
        # the other scores are taken on the prepared model (sharded scores under --fsdp)
        opt, sched, masker = masked_model(prune if method == "grasp" else None)
        if method != "grasp":
            prune(masker)
        pai = pai[0]
        job.track(method=pai)
        pruned_acc = _train(job, model, opt, sched, data, args, epochs, gen, method, pai.step, masker)
    elif method in ("set", "rigl"):
        dense_acc = dense_baseline()
        opt, sched, masker = masked_model()
        interval = args.update_interval or steps_per_epoch
        dst_gen = torch.Generator().manual_seed(args.seed)
        dst = DynamicSparseTraining(masker, sparsity, total_steps, mode=method, update_interval=interval,
                                    generator=dst_gen)
        job.track(method=dst, method_generator=dst_gen)

        def closure():  # RigL's dense gradient on a fresh training batch (the same on every rank)
            idx = torch.randint(0, len(data.y_train), (args.batch_size,), generator=gen)
            return F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])

        after = (lambda: dst.step(closure)) if method == "rigl" else dst.step
        pruned_acc = _train(job, model, opt, sched, data, args, epochs, gen, method, after, masker)
        extra["updates"] = dst.updates
    elif method == "gmp":
        dense_acc = dense_baseline()
        opt, sched, masker = masked_model()
        t0, t1 = int(0.1 * total_steps), max(int(0.1 * total_steps), int(0.7 * total_steps))
        gmp = GradualMagnitudePruning(masker, sparsity, t0=t0, t1=t1, interval=max(1, steps_per_epoch // 4))
        job.track(method=gmp)
        pruned_acc = _train(job, model, opt, sched, data, args, epochs, gen, method, gmp.step, masker)
        if masker.sparsity() < sparsity - 1e-9:  # a schedule too short to reach t1
            FineTuning(masker, sparsity).prune()
            pruned_acc = job.evaluate(model, data.x_test, data.y_test)
    elif method == "ft":
        dense = job.prepare(model)
        opt, sched = _optimizer(dense, lr, epochs)
        job.track(model=dense, optimizer=opt, scheduler=sched)
        dense_acc = _train(job, dense, opt, sched, data, args, epochs, gen, "pretrain")
        # masks go on a plain copy of the trained network (before wrapping), which is then prepared
        model = job.plain_copy(dense)
        del dense, opt, sched
        opt, sched, masker = masked_model()  # App. G.6: the dense schedule again, high LR first
        ft = FineTuning(masker, sparsity)
        ft.prune()
        job.track(method=ft)
        extra["pruned_before_ft"] = job.value("pruned before fine-tuning",
                                              lambda: job.evaluate(model, data.x_test, data.y_test))
        pruned_acc = _train(job, model, opt, sched, data, args, epochs, gen, "fine-tune", ft.step, masker)
    elif method == "lt":
        if sparsity >= 1.0:
            raise ValueError("--sparsity must be < 1 for lottery tickets")
        opt, sched, masker = masked_model()
        t0 = args.rewind_step if args.rewind_step is not None else steps_per_epoch // 2
        if t0 >= total_steps:
            raise ValueError(f"--rewind-step {t0} must be smaller than the {total_steps} steps of one training")
        lt = LotteryTicket(masker, opt, sparsity, t0=t0, scheduler=sched)
        job.track(method=lt)
        trainings = lottery_ticket_trainings(sparsity)
        dense_acc = _train(job, model, opt, sched, data, args, epochs, gen, f"round 1/{trainings}", lt.step, masker)
        r = 1
        # the stop decision is recorded: a resumed run replays the rounds before its checkpoint
        while not job.value(f"lt done after round {r}", lambda: lt.done):
            if not job.replaying:  # the rewind needs the t0 snapshot, which a replay restores later
                lt.prune_and_rewind()
            r += 1
            pruned_acc = _train(job, model, opt, sched, data, args, epochs, gen, f"round {r}/{trainings}", lt.step,
                                masker)
        if r == 1:
            pruned_acc = dense_acc
        extra["trainings"] = r
        extra["lt_sparsity"] = lt.current_sparsity()
    else:
        raise ValueError(f"unknown toolkit method {method!r}")

    rates = pruning_rates(masker)
    storage = export_csr(masker)
    extra.update(p_sp=rates["p_sp"], p_ip=rates["p_ip"], csr_fraction=storage["csr_fraction"],
                 entropy_fraction=storage["entropy_fraction"])
    summary = Summary(method, dense_acc, pruned_acc, 1.0 - rates["p_sp"], extra)
    state = {"model": job.state_dict(model), "masks": masker.state_dict(), "args": dict(vars(args))}
    return job.finish(summary, state)


def _runner(method: str):
    def run(args, job=None) -> Summary:
        return run_toolkit(method, args, job)

    run.__doc__ = f"``prunopt train --method {method}``: {TOOLKIT_METHODS[method]}."
    return run


def _checker(method: str):
    def check(args) -> None:
        check_arguments(method, args)

    check.__doc__ = f"Option checks of ``prunopt train --method {method}`` (:func:`check_arguments`)."
    return check


for _name, _help in TOOLKIT_METHODS.items():
    register_method(_name, _runner(_name), _help, add_arguments, _checker(_name), fsdp=None)


# ---------------------------------------------------------------- compare
def equal_rate_sparsity(p_sp: float, D: int, basis_nonzero: int) -> Optional[float]:
    """The coefficient sparsity ``q`` of an IP run whose eq. 9 rate ``p_IP``
    equals ``p_sp``: eq. 9 counts the bases' non-zeros as parameters, so the IP
    run keeps ``(1 - p_sp) D - basis_nonzero`` coefficients (``D`` prunable
    weights). ``q`` is placed half a weight inside the interval that
    ``kept_count``'s floor (eq. A.39) maps to that count. ``None`` when the
    bases alone already hold SP's budget (no IP network has that rate)."""
    keep_sp = int(round((1.0 - p_sp) * D))
    keep_ip = keep_sp - int(basis_nonzero)
    if keep_ip < 1:
        return None
    return 1.0 - (keep_ip + 0.5) / D


def _seed_argv(base_argv: List[str], seed: int) -> List[str]:
    """``base_argv`` with ``--seed`` set to ``seed``."""
    argv = list(base_argv)
    if "--seed" in argv:
        i = argv.index("--seed")
        del argv[i:i + 2]
    return argv + ["--seed", str(seed)]


def compare(method: str, sparsities: List[float], out: str, base_argv: Optional[List[str]] = None, *,
            parser, seeds: Optional[List[int]] = None, threads: Optional[int] = None) -> str:
    """``prunopt compare``: ``method`` with SP and with IP at equal pruning rate
    (eq. 9 of Interspace Pruning, the paper's comparison): for each target
    sparsity ``p`` and seed, the SP run prunes spatial weights to ``p``; the IP
    run's coefficient sparsity is chosen by :func:`equal_rate_sparsity` so that
    its ``p_IP`` (which counts the filter bases as parameters) equals the SP
    run's ``p_SP``. Writes ``compare_<method>.md`` (mean ± standard deviation
    over the seeds), ``compare_<method>.json`` (every run) and
    ``compare_<method>.png`` (accuracy vs eq. 9 rate, error bars) into ``out``
    with the user's umask, prints where, and returns the markdown. ``parser``
    is the ``prunopt`` parser (:func:`prunopt.cli.build_parser`), which parses
    each run's ``train`` options; ``seeds`` default to ``--seed`` of
    ``base_argv`` (or 0); ``threads`` sets torch's intra-op threads and
    deterministic algorithms for the runs (results are then repeatable)."""
    from contextlib import nullcontext

    from prunopt.repro.report import deterministic

    if method not in TOOLKIT_METHODS:
        raise ValueError(f"method must be one of {sorted(TOOLKIT_METHODS)}, got {method!r}")
    if not sparsities:
        raise ValueError("sparsities must not be empty")
    base_argv = list(base_argv or [])
    if seeds is None:
        seeds = [int(base_argv[base_argv.index("--seed") + 1])] if "--seed" in base_argv else [0]
    if not seeds:
        raise ValueError("seeds must not be empty")

    def parse(p: float, space: str, seed: int):
        argv = ["train", "--method", method, "--sparsity", repr(float(p)), "--space", space]
        args = parser.parse_args(argv + _seed_argv(base_argv, seed))
        args.density = 1.0 - args.sparsity
        return args

    probe = parse(0.5, "interspace", seeds[0])
    probe_model = _model(probe, 10)
    D = pruning_rates(probe_model)["D"]
    # a trained basis is dense (the standard basis at initialisation is not): count every entry
    fb = sum({id(m.basis.weight): m.basis.weight.numel() for m in probe_model.modules()
              if hasattr(m, "basis")}.values())
    rows: List[dict] = []
    with deterministic(threads) if threads else nullcontext():
        for p in sparsities:
            row = {"sparsity": float(p), "runs": []}
            for seed in seeds:
                s_sp = run_toolkit(method, parse(p, "standard", seed))
                print(s_sp.line(), flush=True)
                run = {"seed": seed, "p_sp": s_sp.extra["p_sp"], "sp_acc": s_sp.pruned_acc, "sp_dense": s_sp.dense_acc}
                q = equal_rate_sparsity(s_sp.extra["p_sp"], D, fb)
                run["ip_coefficient_sparsity"] = q
                if q is not None:
                    s_ip = run_toolkit(method, parse(q, "interspace", seed))
                    print(s_ip.line(), flush=True)
                    run.update(p_ip=s_ip.extra["p_ip"], ip_acc=s_ip.pruned_acc, ip_dense=s_ip.dense_acc)
                row["runs"].append(run)
            rows.append(row)
    result = {"method": method, "seeds": list(seeds), "threads": threads, "D": D, "basis_nonzero": fb,
              "sharing": probe.sharing, "train_options": base_argv, "rows": rows}
    return write_compare(result, out)


def merge_compare(method: str, dirs: List[str], out: str) -> str:
    """Combines ``compare_<method>.json`` of runs made in pieces (other seeds;
    same sparsities, network and thread count) and writes the combined
    report like :func:`compare`; returns its markdown."""
    import json

    parts = []
    for d in dirs:
        with open(os.path.join(d, f"compare_{method}.json")) as f:
            parts.append(json.load(f))
    if not parts:
        raise ValueError("merge_compare: no folders given")
    for key in ("D", "basis_nonzero", "sharing", "threads", "train_options"):
        if len({json.dumps(p[key]) for p in parts}) > 1:
            raise ValueError(f"merge_compare: the parts disagree on {key}")
    if len({tuple(r["sparsity"] for r in p["rows"]) for p in parts}) > 1:
        raise ValueError("merge_compare: the parts disagree on the sparsities")
    seeds = sorted(s for p in parts for s in p["seeds"])
    if len(set(seeds)) != len(seeds):
        raise ValueError("merge_compare: the parts overlap (a seed was run twice)")
    rows = [{"sparsity": r["sparsity"], "runs": sorted((x for p in parts for x in p["rows"][i]["runs"]),
                                                        key=lambda x: x["seed"])}
            for i, r in enumerate(parts[0]["rows"])]
    result = {**{k: parts[0][k] for k in ("method", "threads", "D", "basis_nonzero", "sharing", "train_options")},
              "seeds": seeds, "rows": rows}
    return write_compare(result, out)


def write_compare(result: dict, out: str) -> str:
    """Writes ``compare_<method>.md`` / ``.json`` / ``.png`` of a
    :func:`compare` result into ``out`` (user's umask), prints where, returns
    the markdown."""
    import json

    from prunopt.repro.report import markdown_table, mean_std, write_text

    method, rows, seeds, threads = result["method"], result["rows"], result["seeds"], result["threads"]
    D, fb, sharing = result["D"], result["basis_nonzero"], result["sharing"]
    table = []
    for r in rows:
        runs = r["runs"]
        sp = [x["sp_acc"] for x in runs]
        cells = [f"{r['sparsity']:.3f}", len(runs), f"{mean_std([x['p_sp'] for x in runs])[0]:.4f}", _pm(sp)]
        ip_runs = [x for x in runs if x.get("ip_acc") is not None]
        if ip_runs:
            ip = [x["ip_acc"] for x in ip_runs]
            diff = [x["ip_acc"] - x["sp_acc"] for x in ip_runs]
            cells += [f"{mean_std([x['ip_coefficient_sparsity'] for x in ip_runs])[0]:.4f}",
                      f"{mean_std([x['p_ip'] for x in ip_runs])[0]:.4f}", _pm(ip), _pm(diff),
                      f"{sum(d > 0 for d in diff)}/{len(diff)}"]
        else:
            keep = int(round((1 - runs[0]["p_sp"]) * D))
            cells += ["-", "-", f"no IP network at this rate: the bases hold {fb} of SP's {keep} weights", "-", "-"]
        dense = [x["sp_dense"] for x in runs]
        cells.append(_pm(dense) if method != "lt" else "-")
        table.append(cells)
    header = ["target p", "seeds", "p_SP (eq. 9)", "SP acc", "IP coefficient sparsity", "p_IP (eq. 9)", "IP acc",
              "IP - SP", "IP better", "dense acc (SP net)"]
    md = "\n".join([
        f"# SP vs IP at equal pruning rate: {method}", "",
        f"SmallCNN on the embedded digits; {sharing} filter-basis sharing ({fb} basis entries, counted as parameters "
        f"by eq. 9), D = {D} prunable weights; seeds {', '.join(map(str, seeds))}"
        + (f"; {threads} thread(s)" if threads else "")
        + (f"; train options `{' '.join(result['train_options'])}`" if result.get("train_options") else "")
        + ". Each IP run keeps (1 - p_SP) D - "
        f"{fb} coefficients, so that p_IP = p_SP; accuracies are test-set fractions, mean ± standard deviation "
        "over the seeds.", "",
        markdown_table(header, table)]) + "\n"
    os.makedirs(out, exist_ok=True)
    md_path = os.path.join(out, f"compare_{method}.md")
    json_path = os.path.join(out, f"compare_{method}.json")
    png_path = os.path.join(out, f"compare_{method}.png")
    write_text(md_path, md)
    write_text(json_path, json.dumps(result, indent=1) + "\n")
    _plot(rows, method, png_path, sharing)
    print(f"wrote {md_path}, {json_path}, {png_path}", flush=True)
    return md


def _pm(values) -> str:
    from prunopt.repro.report import pm

    return pm(values, ".4f")


def _plot(rows, method: str, path: str, sharing: str = "fine") -> None:
    """Accuracy against the eq. 9 rate, mean and standard deviation over the
    seeds, for SP and for IP at the same rate; saved with the user's umask."""
    from prunopt.repro.report import mean_std, pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    sp = [(mean_std([x["p_sp"] for x in r["runs"]])[0], *mean_std([x["sp_acc"] for x in r["runs"]])) for r in rows]
    ip = [(mean_std([x["p_ip"] for x in ip_runs])[0], *mean_std([x["ip_acc"] for x in ip_runs]))
          for ip_runs in ([x for x in r["runs"] if x.get("ip_acc") is not None] for r in rows) if ip_runs]
    ax.errorbar([a for a, _, _ in sp], [m for _, m, _ in sp], [s for _, _, s in sp], fmt="o-", capsize=3,
                label="SP (spatial weights)")
    if ip:
        ax.errorbar([a for a, _, _ in ip], [m for _, m, _ in ip], [s for _, _, s in ip], fmt="s-", capsize=3,
                    label="IP (FB coefficients), same eq. 9 rate")
    if method != "lt":
        ax.axhline(mean_std([x["sp_dense"] for x in rows[0]["runs"]])[0], ls=":", color="gray", label="dense (SP net)")
    ax.set_xlabel("pruning rate p (eq. 9: bases count as parameters)")
    ax.set_ylabel(f"test accuracy (mean ± std, {len(rows[0]['runs'])} seeds)")
    ax.set_title(f"{method}: interspace ({sharing} sharing) vs standard pruning at equal rate", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)
