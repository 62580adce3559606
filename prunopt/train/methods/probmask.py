"""``prunopt train --method probmask``: ProbMask on the example CNN.

1. Train the dense CNN (the baseline accuracy).
2. Wrap every Conv2d/Linear weight with a probabilistic mask (scores start at
   1), train weights and scores jointly; after every step the scores are
   projected onto the annealed budget ``S(i) = d(i) D`` (DensitySchedule,
   ProM supplement A.2) by the fused projection, and the Gumbel-sigmoid temperature is
   annealed.
3. Fix the deterministic mask with exactly ``round(density * D)`` ones, briefly
   fine-tune the weights under it, and report the pruned accuracy.
"""
from __future__ import annotations

import copy
import math

import torch

from prunopt.train.args import int_arg, positive_float_arg
from prunopt.nn.probmask import apply_probmask, finalize_probmask, probmask_density, probmask_scores, set_temperature
from prunopt.optim.budget import BudgetProjection
from prunopt.schedules import DensitySchedule, TemperatureSchedule
from prunopt.train.data import load_digits
from prunopt.train.loop import Summary, evaluate, progress, train_epoch, write_outputs
from prunopt.train.methods import register_method
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
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")


def run(args) -> Summary:
    """Dense training, ProbMask training under the annealed budget, fine-tuning."""
    check_arguments(args)
    torch.manual_seed(args.seed)
    data = load_digits(seed=args.seed, limit=args.limit)
    epochs = args.epochs or 12
    lr = args.lr if args.lr is not None else 3e-3
    gen = torch.Generator().manual_seed(args.seed)
    history = {"dense test acc": [], "masked test acc": [], "budget density": []}

    model = SmallCNN(data.num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in progress(range(epochs), "dense", args.progress):
        train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen)
        history["dense test acc"].append(evaluate(model, data.x_test, data.y_test))
    dense_acc = evaluate(model, data.x_test, data.y_test)

    masked = copy.deepcopy(model)
    apply_probmask(masked, init=1.0, tau=1.0)
    scores = probmask_scores(masked)
    steps_per_epoch = -(-len(data.y_train) // args.batch_size)
    total_steps = epochs * steps_per_epoch
    schedule = DensitySchedule(args.density, start=0, end=max(1, int(0.75 * total_steps)), power=args.power)
    projection = BudgetProjection(scores, schedule)
    temperature = TemperatureSchedule(1.0, 0.05, total_steps)
    weights = [p for n, p in masked.named_parameters() if not n.endswith(".scores")]
    opt = torch.optim.Adam([{"params": weights, "lr": lr}, {"params": scores, "lr": args.score_lr}])
    projection.attach(opt)

    def anneal():
        set_temperature(masked, temperature(projection.step_count))

    for _ in progress(range(epochs), "probmask", args.progress):
        train_epoch(masked, opt, data.x_train, data.y_train, args.batch_size, gen, after_step=anneal)
        history["masked test acc"].append(evaluate(masked, data.x_test, data.y_test))
        history["budget density"].append(projection.current_density())

    finalize_probmask(masked, args.density)
    finetune = args.finetune_epochs if args.finetune_epochs is not None else max(1, epochs // 4)
    opt = torch.optim.Adam(weights, lr=lr / 3)
    for _ in progress(range(finetune), "finetune", args.progress):
        train_epoch(masked, opt, data.x_train, data.y_train, args.batch_size, gen)
    pruned_acc = evaluate(masked, data.x_test, data.y_test)
    density = probmask_density(masked)
    summary = Summary("probmask", dense_acc, pruned_acc, density, {"target_density": float(args.density)})
    write_outputs(args.out, summary, {"model": masked.state_dict(), "args": vars(args)}, history)
    return summary


register_method("probmask", run, "ProbMask: probabilistic weight masks under an annealed budget (ProM supplement A.2)", add_arguments,
                check_arguments)
