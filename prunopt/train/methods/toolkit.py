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
from prunopt.train.methods import FSDP_MASKS, check_density, register_method
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

    def masked_model():
        opt, sched = _optimizer(model, lr, epochs)
        masker = Masker(model, opt)
        job.prepare(model)  # after the masks are in place
        job.track(model=model, optimizer=opt, scheduler=sched, masker=masker)
        return opt, sched, masker

    if method in ("pai-random", "snip", "grasp", "synflow"):
        dense_acc = dense_baseline()
        opt, sched, masker = masked_model()
        score = "random" if method == "pai-random" else method
        pai = PruningAtInit(masker, score, sparsity, generator=torch.Generator().manual_seed(args.seed))
        batches = list(iterate_minibatches(data.x_train, data.y_train, args.batch_size, gen))[: args.score_batches]
        pai.prune(batches=batches, example_input=data.x_train[:1])
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
        model = job.prepare(model)
        opt, sched = _optimizer(model, lr, epochs)
        job.track(model=model, optimizer=opt, scheduler=sched)
        dense_acc = _train(job, model, opt, sched, data, args, epochs, gen, "pretrain")
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
    register_method(_name, _runner(_name), _help, add_arguments, _checker(_name), fsdp=FSDP_MASKS)


# ---------------------------------------------------------------- compare
def compare(method: str, sparsities: List[float], out: str, base_argv: Optional[List[str]] = None, *,
            parser) -> str:
    """``prunopt compare``: run ``method`` with SP and with IP at each sparsity
    (the shape of the paper's Fig. 3-4), write ``compare_<method>.md`` (table)
    and ``compare_<method>.png`` (accuracy vs. sparsity) into ``out`` and return
    the markdown. ``parser`` is the ``prunopt`` parser (:func:`prunopt.cli.build_parser`),
    which parses each run's ``train`` options."""
    from prunopt.train.loop import atomic_write_text

    if method not in TOOLKIT_METHODS:
        raise ValueError(f"method must be one of {sorted(TOOLKIT_METHODS)}, got {method!r}")
    if not sparsities:
        raise ValueError("sparsities must not be empty")
    rows = []
    for p in sparsities:
        row = {"sparsity": p}
        for space in ("standard", "interspace"):
            argv = ["train", "--method", method, "--sparsity", repr(float(p)), "--space", space] + list(base_argv or [])
            args = parser.parse_args(argv)
            args.density = 1.0 - args.sparsity
            s = run_toolkit(method, args)
            key = "sp" if space == "standard" else "ip"
            row[f"{key}_acc"], row[f"{key}_dense"] = s.pruned_acc, s.dense_acc
            row[f"p_{key}"] = s.extra["p_ip"] if key == "ip" else s.extra["p_sp"]
            print(s.line(), flush=True)
        rows.append(row)
    lines = [f"# SP vs IP: {method}", "",
             "Digits, SmallCNN; accuracies are test-set fractions; p_SP / p_IP from eq. 9.", "",
             "| target sparsity | p_SP | SP acc | SP dense | p_IP | IP acc | IP dense |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['sparsity']:.3f} | {r['p_sp']:.4f} | {r['sp_acc']:.4f} | {r['sp_dense']:.4f} | "
                     f"{r['p_ip']:.4f} | {r['ip_acc']:.4f} | {r['ip_dense']:.4f} |")
    md = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    atomic_write_text(md, os.path.join(out, f"compare_{method}.md"))
    _plot(rows, method, os.path.join(out, f"compare_{method}.png"))
    return md


def _plot(rows, method: str, path: str) -> None:
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    # each curve at its own eq.-9 pruning rate (IP counts its bases as parameters)
    ax.plot([r["p_sp"] for r in rows], [r["sp_acc"] for r in rows], "o-", label="SP (spatial weights), x = p_SP")
    ax.plot([r["p_ip"] for r in rows], [r["ip_acc"] for r in rows], "s-", label="IP (FB coefficients), x = p_IP")
    ax.axhline(rows[0]["sp_dense"], ls=":", color="gray", label="dense (SP)")
    ax.set_xlabel("pruning rate p (eq. 9)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{method}: interspace vs standard pruning")
    ax.grid(alpha=0.3)
    ax.legend()
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=100, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)
