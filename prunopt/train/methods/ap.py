"""``prunopt train --method ap``: differentiable architecture pruning with
two-temperature masks (Colombo & Gao).

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
from prunopt.train.loop import Summary, evaluate, progress, train_epoch, write_outputs
from prunopt.train.methods import register_method
from prunopt.train.models import SmallCNN


def add_arguments(p) -> None:
    """The ap options (validated by their argparse types)."""
    g = p.add_argument_group("ap (two-temperature architecture pruning)")
    g.add_argument("--ap-gamma", type=nonnegative_float_arg("--ap-gamma"), default=None,
                   help="mask penalty gamma >= 0 (default 3e-4)")
    g.add_argument("--ap-tl", type=positive_float_arg("--ap-tl"), default=1000.0, help="forward temperature t_l > 0")
    g.add_argument("--ap-ts", type=positive_float_arg("--ap-ts"), default=None,
                   help="backward temperature t_s > 0 (default t_l/100)")


def run(args) -> Summary:
    """Dense training, two-temperature mask search to the target sparsity, fine-tuning."""
    torch.manual_seed(args.seed)
    data = load_digits(seed=args.seed, limit=args.limit)
    model = SmallCNN(num_classes=data.num_classes)
    epochs = args.epochs or 6
    lr = args.lr if args.lr is not None else 1e-2
    gen = torch.Generator().manual_seed(args.seed)
    history = {"dense_acc": [], "search_acc": [], "mask_density": [], "finetune_acc": []}

    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in progress(range(epochs), "ap dense", args.progress):
        train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen)
        history["dense_acc"].append(evaluate(model, data.x_test, data.y_test))
    dense_acc = evaluate(model, data.x_test, data.y_test)

    t_l = getattr(args, "ap_tl", 1000.0)
    t_s = getattr(args, "ap_ts", None)
    gamma = args.ap_gamma if getattr(args, "ap_gamma", None) is not None else 3e-4
    wrap_two_temperature_masks(model, t_l=t_l, t_s=t_s, generator=torch.Generator().manual_seed(args.seed))
    masks = two_temperature_masks(model)
    target = 1.0 - args.density
    weights = [p for n, p in model.named_parameters() if not n.endswith(".w")]
    opt = torch.optim.Adam([dict(params=weights, lr=lr * 0.1), dict(params=[m.w for m in masks], lr=lr * 0.1)])
    state = {"stopped": stop_at_sparsity(masks, target)}

    def after():
        if not state["stopped"]:
            state["stopped"] = stop_at_sparsity(masks, target)

    search_epochs = 0
    for _ in progress(range(4 * epochs), "ap search", args.progress):
        if state["stopped"]:
            break
        train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen,
                    loss_extra=lambda: mask_regularizer(masks, gamma), after_step=after)
        search_epochs += 1
        history["search_acc"].append(evaluate(model, data.x_test, data.y_test))
        history["mask_density"].append(mask_density(masks))
    for m in masks:
        m.freeze()  # final mask 1[w > 0] even if the target was not reached

    opt = torch.optim.Adam(weights, lr=lr * 0.1)
    for _ in progress(range(epochs), "ap finetune", args.progress):
        train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen)
        history["finetune_acc"].append(evaluate(model, data.x_test, data.y_test))
    pruned_acc = evaluate(model, data.x_test, data.y_test)
    summary = Summary("ap", dense_acc, pruned_acc, mask_density(masks),
                      extra={"target_reached": bool(state["stopped"]), "search_epochs": search_epochs,
                             "gamma": float(gamma),
                             "layer_densities": "/".join(f"{d:.3f}" for d in layer_densities(masks))})
    write_outputs(args.out, summary, {"model": model.state_dict()}, history)
    return summary


register_method("ap", run, "architecture pruning with two-temperature masks (t_l=1000, t_s=t_l/100)", add_arguments)
