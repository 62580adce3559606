"""``prunopt train --method ds``: differentiable sparsification (Yongjin Lee,
*Differentiable Sparsification for Deep Neural Networks*).

Optimisation (the recipe of ``prunopt repro ds``, see docs/sparsification.md):
SGD with momentum 0.9 and a cosine learning rate (``--lr``, default 0.1) for
the weights and the gate magnitudes ``alpha``, weight decay on the weights
only; Adam (lr 0.01) for the gate thresholds ``beta``, whose gradient carries
the tiny factor ``sigmoid'(beta) ||alpha||_1`` (SGD barely moves them).

1. Train the dense SmallCNN (``dense_acc``).
2. Convert its BatchNorm2d layers to :class:`SparseBatchNorm2d` (function
   preserved), then keep training with the l1 (or group l2,1) regulariser on
   the gates, its strength ramped with the cubic schedule (appendix eq. 1).
   Gates reach exact zeros by themselves: no pruning step, no fine-tuning.
3. Export with the zero-gated channels physically removed (``pruned_acc`` is
   the accuracy of the smaller model). ``density`` is the fraction of the
   conv/linear weights that remain.
"""
from __future__ import annotations

import torch
from torch import nn

from prunopt.train.args import nonnegative_float_arg, positive_int_arg
from prunopt.nn.sparsification import (
    convert_to_sparse_batchnorm,
    cubic_strength,
    gate_density,
    group_l21_regularizer,
    l1_regularizer,
    remove_channels,
    sparse_gates,
)
from prunopt.train.data import load_digits
from prunopt.train.job import Job
from prunopt.train.loop import OptimizerGroup, Summary
from prunopt.train.methods import check_density, register_method
from prunopt.train.models import SmallCNN


def prunable_weights(model: nn.Module) -> int:
    """Number of Conv2d/Linear weights of ``model`` (the density's denominator)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))


# final regularisation strengths per norm; both reach about 50% channel sparsity
# on the digits SmallCNN (``prunopt repro ds``; the paper tunes lambda per norm)
DEFAULT_LAMBDA = {"l1": 0.05, "l21": 0.2}


def ds_optimizer(model: nn.Module, lr: float, epochs: int, beta_lr: float = 0.01, weight_decay: float = 5e-4):
    """``(optimizer, scheduler)`` for DS training: SGD (momentum 0.9, cosine
    schedule over ``epochs``) on the weights (``weight_decay``) and the gate
    magnitudes ``alpha`` (no decay, as in the paper), Adam (``beta_lr``) on
    the thresholds ``beta``. Works on models with or without sparse BN."""
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    alphas = [p for n, p in model.named_parameters() if n.endswith(".gate.alpha")]
    betas = [p for n, p in model.named_parameters() if n.endswith(".gate.beta")]
    weights = [p for n, p in model.named_parameters() if ".gate." not in n]
    groups = [{"params": weights, "weight_decay": weight_decay}]
    if alphas:
        groups.append({"params": alphas, "weight_decay": 0.0})
    sgd = torch.optim.SGD(groups, lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, max(1, epochs))
    opt = OptimizerGroup(sgd, torch.optim.Adam(betas, lr=beta_lr)) if betas else OptimizerGroup(sgd)
    return opt, sched


def add_arguments(p) -> None:
    """The ds options (validated by their argparse types and :func:`check_arguments`)."""
    g = p.add_argument_group("ds (differentiable sparsification)")
    g.add_argument("--ds-lambda", type=nonnegative_float_arg("--ds-lambda"), default=None,
                   help="final regularisation strength lam_f >= 0 (default 0.05 for l1, 0.2 for l21)")
    g.add_argument("--ds-norm", choices=["l1", "l21"], default="l1", help="gate regulariser: l1 (eq. 2) or group l2,1 (eq. 4)")
    g.add_argument("--ds-group", type=positive_int_arg("--ds-group"), default=4,
                   help="gates per group for --ds-norm l21 (must divide every BN layer's channel count)")


def check_arguments(args) -> None:
    """``--ds-group`` must divide the channel count of every BatchNorm of the
    example CNN when ``--ds-norm l21`` groups its gates; ``--density`` > 0
    (:func:`~prunopt.train.methods.check_density`)."""
    check_density(args)
    if getattr(args, "ds_norm", "l1") != "l21":
        return
    group = getattr(args, "ds_group", 4)
    channels = sorted({m.num_features for m in SmallCNN().modules() if isinstance(m, nn.BatchNorm2d)})
    if any(c % group for c in channels):
        raise ValueError(f"--ds-group {group} must divide every BatchNorm's channel count {channels}")


def run(args, job=None) -> Summary:
    """Dense training, sparse-BN gate training with the cubic strength ramp,
    channel removal."""
    check_arguments(args)
    job = job or Job(args)
    data = load_digits(seed=args.seed, limit=args.limit)
    epochs = args.epochs or 6
    lr = args.lr if args.lr is not None else 0.1
    gen = torch.Generator().manual_seed(args.seed)

    def accuracy(m):
        return job.evaluate(m, data.x_test, data.y_test)

    model = job.prepare(SmallCNN(num_classes=data.num_classes))
    opt, sched = ds_optimizer(model, lr, epochs)
    job.track(data_order=gen, model=model, optimizer=opt, scheduler=sched)
    for _ in job.epochs("dense", epochs):
        job.train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen)
        sched.step()
        job.log(**{"test accuracy": accuracy(model), "density": 1.0})
    dense_acc = job.value("dense_acc", lambda: accuracy(model))
    dense_weights = prunable_weights(model)

    # the conversion swaps layers: on a plain copy of the trained network (before wrapping), then prepared
    model = convert_to_sparse_batchnorm(job.plain_copy(model), preserve=True)
    model = job.prepare(model)
    norm = getattr(args, "ds_norm", "l1")
    lam_f = args.ds_lambda if getattr(args, "ds_lambda", None) is not None else DEFAULT_LAMBDA[norm]
    group = getattr(args, "ds_group", 4)
    if lam_f < 0:
        raise ValueError(f"--ds-lambda must be >= 0, got {lam_f}")
    opt, sched = ds_optimizer(model, lr, 2 * epochs)
    state = {"lam": 0.0}
    job.track(model=model, optimizer=opt, scheduler=sched, strength=state)

    def reg():
        gs = sparse_gates(model)
        r = l1_regularizer(gs) if norm == "l1" else group_l21_regularizer(gs, group)
        return state["lam"] * r

    ramp = max(1, int(0.6 * epochs))
    for epoch in job.epochs("sparsify", 2 * epochs):
        state["lam"] = cubic_strength(epoch, 0.0, lam_f, 0, ramp)
        job.train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen, loss_extra=reg)
        sched.step()
        job.log(**{"test accuracy": accuracy(model), "gate density": gate_density(model)})

    # the export works on the whole network: a plain copy of it under --fsdp
    small = remove_channels(job.plain_copy(model) if job.fsdp else model, example_input=data.x_test[:64])
    pruned_acc = accuracy(small)
    density = prunable_weights(small) / dense_weights
    summary = Summary("ds", dense_acc, pruned_acc, density,
                      extra={"gate_density": gate_density(model), "norm": norm, "lam_f": float(lam_f),
                             "target_density": float(args.density)})
    return job.finish(summary, {"model": job.state_dict(model), "exported": small})


register_method("ds", run, "differentiable sparsification: sparse-BN gates driven to exact zeros by an l1 or "
                "group l2,1 penalty, zero-gated channels removed", add_arguments, check_arguments, fsdp=None)
