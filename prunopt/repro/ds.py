"""``prunopt repro ds``: the DS paper's Fig. 1-2 on a small CNN (Lee, SPEC.md §4).

SmallCNN with sparse batch norm (eq. 17, gates start at 0.5) is trained on the
embedded digits with the l1 (eq. 2) and with the group l2,1 (eq. 4, groups of 4
channels) regulariser, strength ramped by the cubic schedule. The gate patterns
(one row per layer, zero gates dark) are written to ``ds_patterns.png``; the table
``ds_patterns.md`` gives channel and group sparsity and accuracy of the exported
(physically smaller) model.
"""
from __future__ import annotations

import os

import torch

from prunopt.nn.sparsification import (
    convert_to_sparse_batchnorm,
    cubic_strength,
    group_l21_regularizer,
    l1_regularizer,
    remove_channels,
    sparse_gates,
)
from prunopt.repro import register_repro
from prunopt.train.data import load_digits
from prunopt.train.loop import evaluate, train_epoch
from prunopt.train.models import SmallCNN

GROUP = 4


class _Both:
    """Steps two optimizers as one (train_epoch takes a single optimizer)."""

    def __init__(self, *opts):
        self.opts = opts

    def zero_grad(self, set_to_none: bool = True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self.opts:
            o.step()


def train(norm: str, lam: float, epochs: int, limit, seed: int):
    torch.manual_seed(seed)
    data = load_digits(seed=seed, limit=limit)
    model = convert_to_sparse_batchnorm(SmallCNN(), preserve=False)
    gate_params = [p for n, p in model.named_parameters() if ".gate." in n]
    others = [p for n, p in model.named_parameters() if ".gate." not in n]
    # Adam for the weights; plain SGD with momentum for alpha/beta as in the paper
    # (Adam's per-coordinate normalisation makes alpha oscillate around 0 by ~lr
    # instead of settling below the threshold)
    opt = torch.optim.Adam(others, lr=1e-2)
    gate_opt = torch.optim.SGD(gate_params, lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    state = {"lam": 0.0}

    def reg():
        gs = sparse_gates(model)
        return state["lam"] * (l1_regularizer(gs) if norm == "l1" else group_l21_regularizer(gs, GROUP))

    for epoch in range(epochs):
        state["lam"] = cubic_strength(epoch, 0.0, lam, 0, max(1, epochs // 2))
        train_epoch(model, _Both(opt, gate_opt), data.x_train, data.y_train, 64, gen, loss_extra=reg)
    gates = [g.detach() for g in sparse_gates(model)]
    small = remove_channels(model, example_input=data.x_test[:32])
    return gates, evaluate(small, data.x_test, data.y_test)


def run(args) -> None:
    epochs, limit = (10, None) if args.quick else (30, None)
    results = {}
    for norm, lam in (("l1", 0.05), ("l21", 0.05)):
        results[norm] = train(norm, lam, epochs, limit, args.seed)
    os.makedirs(args.out, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7, 3.5))
    width = max(g.numel() for g in results["l1"][0])
    lines = ["| regulariser | channel sparsity | group sparsity (groups of 4) | accuracy (exported) |", "|---|---|---|---|"]
    for ax, (norm, (gates, acc)) in zip(axes, results.items()):
        img = torch.full((len(gates), width), float("nan"))
        for i, g in enumerate(gates):
            img[i, : g.numel()] = (g != 0).float()
        ax.imshow(img.numpy(), cmap="gray", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_title(f"{norm}: non-zero gates per layer (white = kept)")
        ax.set_yticks(range(len(gates)))
        ax.set_yticklabels([f"BN{i + 1}" for i in range(len(gates))])
        ch = torch.cat([g.flatten() for g in gates])
        groups = torch.cat([g.reshape(-1, GROUP).abs().sum(1) for g in gates])
        lines.append(f"| {norm} | {(ch == 0).double().mean().item():.3f} | {(groups == 0).double().mean().item():.3f} | {acc:.4f} |")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "ds_patterns.png"), dpi=100, bbox_inches="tight")
    plt.close(fig)
    table = "\n".join(lines)
    with open(os.path.join(args.out, "ds_patterns.md"), "w") as f:
        f.write(f"epochs={epochs} limit={limit} seed={args.seed}\n\n{table}\n")
    print(table)


register_repro("ds", run, "DS Fig. 1-2: l1 vs l2,1 channel sparsity patterns of a small CNN")
