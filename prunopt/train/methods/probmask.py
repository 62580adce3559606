"""``prunopt train --method probmask``: ProbMask (Zhou et al., *Effective
Sparsification of Neural Networks with Global Sparsity Constraint*, CVPR 2021)
on the example CNN.

1. Train the dense CNN (the baseline accuracy).
2. Wrap every Conv2d/Linear weight with a probabilistic mask (scores start at
   1), train weights and scores jointly; after every step the scores are
   projected onto the annealed budget ``S(i) = d(i) D`` (DensitySchedule,
   supplement A.1) by the fused projection, and the Gumbel-sigmoid temperature is
   annealed.
3. Fix the deterministic mask with exactly ``round(density * D)`` ones, briefly
   fine-tune the weights under it, and report the pruned accuracy.
"""
from __future__ import annotations

import math

import torch

from prunopt.train.args import int_arg, positive_float_arg
from prunopt.nn.probmask import apply_probmask, finalize_probmask, probmask_density, probmask_scores, set_temperature
from prunopt.optim.budget import BudgetProjection
from prunopt.schedules import DensitySchedule, TemperatureSchedule
from prunopt.train.data import load_digits
from prunopt.train.job import Job, StateFns
from prunopt.train.loop import Summary
from prunopt.train.methods import check_density, register_method
from prunopt.train.models import SmallCNN


def add_arguments(parser) -> None:
    """The probmask options (validated by their argparse types)."""
    g = parser.add_argument_group("probmask")
    g.add_argument("--score-lr", type=positive_float_arg("--score-lr"), default=0.05,
                   help="probmask: learning rate of the mask scores (> 0)")
    g.add_argument("--power", type=positive_float_arg("--power"), default=3.0,
                   help="probmask: exponent of the density schedule (> 0; 1 = linear)")
    g.add_argument("--finetune-epochs", type=int_arg("--finetune-epochs", 0), default=None,
                   help="probmask: epochs (>= 0) of weight fine-tuning under the final mask")


def check_arguments(args) -> None:
    """The budget must keep some weights: ``--density`` > 0 (``--sparsity`` < 1);
    ``--lr`` (when given) must be > 0 (as the CLI's type checks; this also
    guards direct calls of :func:`run`)."""
    if not args.density > 0:
        raise ValueError("probmask needs --density > 0 (--sparsity < 1): the density schedule anneals to it")
    check_density(args)
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")


def _temperature(model):
    """The Gumbel-sigmoid temperatures of ``model``'s masks (plain attributes,
    outside the state dict) as job state."""
    from prunopt.nn.probmask import probmask_modules

    def get():
        return [pm.tau for _, pm in probmask_modules(model)]

    def put(taus):
        for (_, pm), t in zip(probmask_modules(model), taus):
            pm.tau = float(t)

    return StateFns(get, put)


def run(args, job=None) -> Summary:
    """Dense training, ProbMask training under the annealed budget, fine-tuning."""
    check_arguments(args)
    job = job or Job(args)
    data = load_digits(seed=args.seed, limit=args.limit)
    epochs = args.epochs or 12
    lr = args.lr if args.lr is not None else 3e-3
    gen = torch.Generator().manual_seed(args.seed)

    def accuracy(m):
        return job.evaluate(m, data.x_test, data.y_test)

    model = job.prepare(SmallCNN(data.num_classes))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    job.track(data_order=gen, model=model, optimizer=opt)
    for _ in job.epochs("dense", epochs):
        job.train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen)
        job.log(**{"test accuracy": accuracy(model), "density": 1.0})
    dense_acc = job.value("dense_acc", lambda: accuracy(model))

    masked = job.plain_copy(model)  # the masks go on a plain copy (before wrapping), then it is prepared
    apply_probmask(masked, init=1.0, tau=1.0)
    masked = job.prepare(masked)
    scores = probmask_scores(masked)
    steps_per_epoch = -(-len(data.y_train) // args.batch_size)
    total_steps = epochs * steps_per_epoch
    schedule = DensitySchedule(args.density, start=0, end=max(1, int(0.75 * total_steps)), power=args.power)
    projection = BudgetProjection(scores, schedule)
    temperature = TemperatureSchedule(1.0, 0.05, total_steps)
    weights = [p for n, p in masked.named_parameters() if not n.endswith(".scores")]
    opt = torch.optim.Adam([{"params": weights, "lr": lr}, {"params": scores, "lr": args.score_lr}])
    projection.attach(opt)
    job.track(masked=masked, optimizer=opt, projection=projection, temperature=_temperature(masked))

    def anneal():
        set_temperature(masked, temperature(projection.step_count))

    for _ in job.epochs("masked", epochs):
        job.train_epoch(masked, opt, data.x_train, data.y_train, args.batch_size, gen, after_step=anneal)
        job.log(**{"test accuracy": accuracy(masked), "budget density": projection.current_density()})

    finalize_probmask(masked, args.density)
    for s in scores:  # the fixed mask no longer reads the scores
        s.requires_grad_(False)
    masked = job.prepare(masked)
    finetune = args.finetune_epochs if args.finetune_epochs is not None else max(1, epochs // 4)
    opt = torch.optim.Adam(weights, lr=lr / 3)
    job.track(optimizer=opt)
    for _ in job.epochs("fine-tune", finetune):
        job.train_epoch(masked, opt, data.x_train, data.y_train, args.batch_size, gen)
        job.log(**{"test accuracy": accuracy(masked), "density": probmask_density(masked)})
    pruned_acc = accuracy(masked)
    density = probmask_density(masked)
    summary = Summary("probmask", dense_acc, pruned_acc, density, {"target_density": float(args.density)})
    return job.finish(summary, {"model": job.state_dict(masked), "args": vars(args)})


register_method("probmask", run, "ProbMask: probabilistic weight masks trained under an annealed global budget, "
                "then fixed and fine-tuned", add_arguments, check_arguments, fsdp=None)
