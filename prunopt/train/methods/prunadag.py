"""``prunopt train --method prunadag --sparsity P``: train the example CNN with
:class:`prunopt.optim.PrunAdag` (conv and linear weights pruned, BN and bias
parameters in a ``prune=False`` group), then magnitude-prune the weights a
posteriori to sparsity ``P`` (Porcelli, Seraghiti and Toint, *prunAdag: an
adaptive pruning-aware gradient method*, Algorithm 2.1 and section 3)."""
from __future__ import annotations

import torch

from prunopt.train.args import open_fraction_arg
from prunopt.optim import PrunAdag
from prunopt.pruning.magnitude import magnitude_prune_, sparsity
from prunopt.train.data import load_digits
from prunopt.train.job import Job
from prunopt.train.loop import Summary
from prunopt.train.methods import check_density, register_method
from prunopt.train.models import SmallCNN


def _version(text):
    return "relevant_only" if text == "relevant_only" else int(text)


def add_arguments(parser) -> None:
    """The prunadag options (validated by their argparse types)."""
    g = parser.add_argument_group("prunadag")
    g.add_argument("--prunadag-relevant", type=open_fraction_arg("--prunadag-relevant"), default=None,
                   help="prunadag: fraction T/n in (0, 1] of relevant weights per step (default: the target density)")
    g.add_argument("--prunadag-version", type=_version, default=3, choices=[1, 2, 3, 4, "relevant_only"],
                   help="prunadag: Table 1 version (default 3)")


def run(args, job=None) -> Summary:
    """PrunAdag training, then a posteriori magnitude pruning to the target density."""
    check_density(args)
    job = job or Job(args)
    data = load_digits(seed=args.seed, limit=args.limit)
    model = job.prepare(SmallCNN(num_classes=data.num_classes))
    weights = [p for p in model.parameters() if p.dim() > 1]  # conv and linear weights are pruned
    others = [p for p in model.parameters() if p.dim() <= 1]  # BN and bias: plain Adagrad
    relevant = args.prunadag_relevant if getattr(args, "prunadag_relevant", None) is not None else max(args.density, 1e-6)
    version = getattr(args, "prunadag_version", 3)
    opt = PrunAdag([dict(params=weights), dict(params=others, prune=False)], lr=args.lr if args.lr is not None else 0.2,
                   eps=0.0, initial_accumulator_value=0.01, relevant=float(relevant), version=version)
    epochs = args.epochs or 15
    gen = torch.Generator().manual_seed(args.seed)
    job.track(data_order=gen, model=model, optimizer=opt)
    for _ in job.epochs("prunadag", epochs):
        job.train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen)
        job.log(**{"test accuracy": job.evaluate(model, data.x_test, data.y_test)})
    dense_acc = job.evaluate(model, data.x_test, data.y_test)
    magnitude_prune_(weights, sigma=1.0 - args.density)  # a posteriori, global over all weights
    pruned_acc = job.evaluate(model, data.x_test, data.y_test)
    summary = Summary("prunadag", dense_acc, pruned_acc, 1.0 - sparsity(weights),
                      extra={"version": version, "relevant": float(relevant), "epochs": epochs})
    return job.finish(summary, {"model": job.state_dict(model), "optimizer": job.state_dict(opt)})


register_method("prunadag", run, "prunAdag: Adagrad restricted to the relevant weights each step, then a posteriori "
                "magnitude pruning to --sparsity", add_arguments, check_density, fsdp=None)
