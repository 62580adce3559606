"""``prunopt train --method ap``: differentiable architecture pruning with
two-temperature masks (Colombo and Gao, *Differentiable Architecture Pruning
for Transfer Learning*).

1. Train the dense SmallCNN (``dense_acc``).
2. Wrap every conv/linear layer in :class:`TwoTemperatureMask` (t_l = 1000,
   t_s = t_l/100) and train weights and mask logits with the penalty
   gamma ||v||^2; once the global sparsity of 1[w > 0] reaches ``1 - density``
   the masks are frozen (AP footnote 10).
3. Fine-tune the weights under the final binary masks (``pruned_acc``).
"""
from __future__ import annotations

import torch

from prunopt.train.args import nonnegative_float_arg, positive_float_arg
from prunopt.nn.architecture import (
    layer_densities,
    mask_density,
    mask_regularizer,
    stop_at_sparsity,
    two_temperature_masks,
    wrap_two_temperature_masks,
)
from prunopt.train.data import load_digits
from prunopt.train.job import Job
from prunopt.train.loop import Summary
from prunopt.train.methods import check_density, register_method
from prunopt.train.models import SmallCNN


def add_arguments(p) -> None:
    """The ap options (validated by their argparse types)."""
    g = p.add_argument_group("ap (two-temperature architecture pruning)")
    g.add_argument("--ap-gamma", type=nonnegative_float_arg("--ap-gamma"), default=None,
                   help="mask penalty gamma >= 0 (default 3e-4)")
    g.add_argument("--ap-tl", type=positive_float_arg("--ap-tl"), default=1000.0, help="forward temperature t_l > 0")
    g.add_argument("--ap-ts", type=positive_float_arg("--ap-ts"), default=None,
                   help="backward temperature t_s > 0 (default t_l/100)")


def check_arguments(args) -> None:
    """``--density`` > 0 (:func:`~prunopt.train.methods.check_density`)."""
    check_density(args)


def run(args, job=None) -> Summary:
    """Dense training, two-temperature mask search to the target sparsity, fine-tuning."""
    check_arguments(args)
    job = job or Job(args)
    data = load_digits(seed=args.seed, limit=args.limit)
    epochs = args.epochs or 6
    lr = args.lr if args.lr is not None else 1e-2
    gen = torch.Generator().manual_seed(args.seed)

    def accuracy(m):
        return job.evaluate(m, data.x_test, data.y_test)

    model = job.prepare(SmallCNN(num_classes=data.num_classes))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    job.track(data_order=gen, model=model, optimizer=opt)
    for _ in job.epochs("dense", epochs):
        job.train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen)
        job.log(**{"test accuracy": accuracy(model), "density": 1.0})
    dense_acc = job.value("dense_acc", lambda: accuracy(model))

    t_l = getattr(args, "ap_tl", 1000.0)
    t_s = getattr(args, "ap_ts", None)
    gamma = args.ap_gamma if getattr(args, "ap_gamma", None) is not None else 3e-4
    # the masks wrap layers: on a plain copy of the trained network (before wrapping), then prepared
    model = job.plain_copy(model)
    wrap_two_temperature_masks(model, t_l=t_l, t_s=t_s, generator=torch.Generator().manual_seed(args.seed))
    target = 1.0 - args.density
    # the masks freeze in the middle of an epoch once the target is reached: their logits stop getting gradients
    model = job.prepare(model, find_unused_parameters=True)
    masks = two_temperature_masks(model)
    weights = [p for n, p in model.named_parameters() if not n.endswith(".w")]  # after prepare: FSDP2 swaps them
    opt = torch.optim.Adam([dict(params=weights, lr=lr * 0.1), dict(params=[m.w for m in masks], lr=lr * 0.1)])
    state = {"stopped": stop_at_sparsity(masks, target), "search_epochs": 0}
    job.track(model=model, optimizer=opt, search=state)

    def after():
        if not state["stopped"]:
            state["stopped"] = stop_at_sparsity(masks, target)

    for _ in job.epochs("search", 4 * epochs):
        if state["stopped"]:
            break
        job.train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen,
                        loss_extra=lambda: mask_regularizer(masks, gamma), after_step=after)
        state["search_epochs"] += 1
        job.log(**{"test accuracy": accuracy(model), "density": mask_density(masks)})
    stopped = job.value("target_reached", lambda: bool(state["stopped"]))
    search_epochs = job.value("search_epochs", lambda: state["search_epochs"])
    for m in masks:
        m.freeze()  # final mask 1[w > 0] even if the target was not reached
    model = job.prepare(model)

    opt = torch.optim.Adam(weights, lr=lr * 0.1)
    job.track(optimizer=opt)
    for _ in job.epochs("fine-tune", epochs):
        job.train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen)
        job.log(**{"test accuracy": accuracy(model), "density": mask_density(masks)})
    pruned_acc = accuracy(model)
    summary = Summary("ap", dense_acc, pruned_acc, mask_density(masks),
                      extra={"target_reached": stopped, "search_epochs": search_epochs,
                             "gamma": float(gamma),
                             "layer_densities": "/".join(f"{d:.3f}" for d in layer_densities(masks))})
    return job.finish(summary, {"model": job.state_dict(model)})


register_method("ap", run, "architecture pruning: two-temperature masks (t_l=1000, t_s=t_l/100) searched to the "
                "target sparsity, then fine-tuning", add_arguments, check_arguments, fsdp=None)
