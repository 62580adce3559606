"""``prunopt repro ds``: the DS paper's Fig. 1-2 on a small CNN (Lee).

SmallCNN with sparse batch norm (eq. 17, gates start at 0.5) is trained from
scratch on the embedded digits, once with the l1 (eq. 2) and once with the
group l2,1 (eq. 4, groups of 4 consecutive channels) regulariser on the gates,
strength ramped by the cubic schedule (appendix eq. 1). What the paper's
figures show, and what is compared here: l1 removes individual channels,
spread irregularly over the groups; l2,1 keeps or removes whole groups, so at
a similar channel sparsity its group sparsity is much higher (DS Table 2:
50.0 / 1.7 % vs 50.3 / 45.8 % channel / group sparsity).

Training (see docs/sparsification.md for why): SGD with momentum 0.9 and a
cosine learning rate for the weights and the gate magnitudes ``alpha`` (weight
decay on the weights only, none on ``alpha`` and ``beta`` as in the paper),
Adam for the gate thresholds ``beta``. Outputs: ``ds_patterns.png`` (channel-
and group-wise views, the paper's Fig. 1 and 2), ``ds_patterns.md`` and
``ds_patterns.json``.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

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
from prunopt.train.methods.ds import DEFAULT_LAMBDA, ds_optimizer
from prunopt.train.models import SmallCNN

GROUP = 4
# final strengths, chosen so that both norms reach a similar channel sparsity
# (the paper tunes lambda per norm in the same way)
LAMBDA = DEFAULT_LAMBDA


def train(norm: str, lam: float, epochs: int, limit, seed: int, width: int = 16, lr: float = 0.1,
          beta_lr: float = 0.01, weight_decay: float = 5e-4):
    """Trains one DS model; returns (gate vectors, exported accuracy, gated accuracy,
    parameters of the exported model, parameters of the dense model)."""
    torch.manual_seed(seed)
    data = load_digits(seed=seed, limit=limit)
    model = convert_to_sparse_batchnorm(SmallCNN(width=width), preserve=False)
    # beta's gradient is scaled by sigmoid'(beta) ||alpha||_1, tiny at the paper's
    # initial threshold 1/(n^2+n); Adam moves it at a rate independent of that scale
    opt, sched = ds_optimizer(model, lr, epochs, beta_lr=beta_lr, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    state = {"lam": 0.0}

    def reg():
        gs = sparse_gates(model)
        return state["lam"] * (l1_regularizer(gs) if norm == "l1" else group_l21_regularizer(gs, GROUP))

    for epoch in range(epochs):
        state["lam"] = cubic_strength(epoch, 0.0, lam, 0, max(1, epochs // 2))
        train_epoch(model, opt, data.x_train, data.y_train, 64, gen, loss_extra=reg)
        sched.step()
    gates = [g.detach() for g in sparse_gates(model)]
    gated_acc = evaluate(model, data.x_test, data.y_test)
    small = remove_channels(model, example_input=data.x_test[:32])
    dense_params = sum(m.weight.numel() for m in SmallCNN(width=width).modules()
                       if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)))
    small_params = sum(m.weight.numel() for m in small.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)))
    return gates, evaluate(small, data.x_test, data.y_test), gated_acc, small_params, dense_params


def sparsity_stats(gates: List[torch.Tensor], group: int = GROUP) -> Dict[str, float]:
    """Channel sparsity (zero gates), group sparsity (groups whose gates are all
    zero) and the fraction of zero gates that lie in fully-zero groups."""
    ch = torch.cat([g.flatten() for g in gates])
    zero_groups = torch.cat([(g.reshape(-1, group) == 0).all(1) for g in gates])
    in_groups = torch.cat([((g.reshape(-1, group) == 0).all(1, keepdim=True).expand(-1, group)).flatten()
                           for g in gates])
    zeros = ch == 0
    return {
        "channel_sparsity": zeros.double().mean().item(),
        "group_sparsity": zero_groups.double().mean().item(),
        "zeros_in_zero_groups": (in_groups & zeros).double().sum().item() / max(int(zeros.sum()), 1),
        "layer_sparsity": [(g == 0).double().mean().item() for g in gates],
    }


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cmap = plt.get_cmap("gray").copy()
    cmap.set_bad("#cfe3f5")  # no channel there (a narrower layer)
    fig, axes = plt.subplots(2, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [4, 1.2]})
    for row, (norm, res) in zip(axes, results.items()):
        gates = res["gates"]
        width = max(g.numel() for g in gates)
        # Fig. 1: channel-wise, brightness = |a| / max |a| of the layer, black = exact zero
        img = np.full((len(gates), width), np.nan)
        for i, g in enumerate(gates):
            mag = g.abs()
            img[i, : g.numel()] = (mag / mag.max().clamp_min(1e-30)).numpy()
        row[0].imshow(np.ma.masked_invalid(np.sqrt(img)), cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        for i, g in enumerate(gates):
            for j in range(GROUP, g.numel(), GROUP):
                row[0].plot([j - 0.5, j - 0.5], [i - 0.5, i + 0.5], color="tab:red", lw=0.6)
        s = res["stats"]
        row[0].set_title(f"{norm} (lambda={res['lambda']}): channel-wise sqrt(|a| / max) (black = 0), red = group borders; "
                         f"channel sparsity {s['channel_sparsity']:.0%}", fontsize=8)
        row[0].set_yticks(range(len(gates)))
        row[0].set_yticklabels([f"BN{i + 1}" for i in range(len(gates))], fontsize=8)
        row[0].set_xticks([])
        # Fig. 2: group-wise, brightness = fraction of non-zero channels in the group
        gw = width // GROUP
        gimg = np.full((len(gates), gw), np.nan)
        for i, g in enumerate(gates):
            gimg[i, : g.numel() // GROUP] = (g.reshape(-1, GROUP) != 0).double().mean(1).numpy()
        row[1].imshow(np.ma.masked_invalid(gimg), cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        row[1].set_title(f"group-wise (group sparsity {s['group_sparsity']:.0%})", fontsize=8)
        row[1].set_yticks([])
        row[1].set_xticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def run(args) -> None:
    epochs = 15 if args.quick else 30
    results = {}
    for norm, lam in LAMBDA.items():
        gates, acc, gated_acc, small_params, dense_params = train(norm, lam, epochs, None, args.seed)
        results[norm] = {"lambda": lam, "gates": gates, "acc": acc, "gated_acc": gated_acc,
                         "params": small_params, "dense_params": dense_params, "stats": sparsity_stats(gates)}
    os.makedirs(args.out, exist_ok=True)
    _plot(results, os.path.join(args.out, "ds_patterns.png"))
    lines = ["| regulariser | lambda | channel sparsity | group sparsity (groups of 4) | zero gates in all-zero groups "
             "| sparsity per layer (BN1, BN2, BN3) | weights of exported model | accuracy (exported) |",
             "|---|---|---|---|---|---|---|---|"]
    for norm, r in results.items():
        s = r["stats"]
        lines.append(f"| {norm} | {r['lambda']} | {s['channel_sparsity']:.3f} | {s['group_sparsity']:.3f} "
                     f"| {s['zeros_in_zero_groups']:.3f} | {', '.join(f'{v:.2f}' for v in s['layer_sparsity'])} "
                     f"| {r['params']} / {r['dense_params']} | {r['acc']:.4f} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "ds_patterns.md"), "w") as f:
        f.write(f"epochs={epochs} seed={args.seed} (SmallCNN width 16, embedded digits, all images)\n\n{table}\n")
    with open(os.path.join(args.out, "ds_patterns.json"), "w") as f:
        json.dump({"epochs": epochs, "seed": args.seed,
                   "results": {n: {k: (v if k != "gates" else [g.tolist() for g in v]) for k, v in r.items()}
                               for n, r in results.items()}}, f, indent=1)
    print(table)
    l1, l21 = results["l1"]["stats"], results["l21"]["stats"]
    print(f"l2,1 group sparsity / l1 group sparsity: {l21['group_sparsity']:.3f} / {l1['group_sparsity']:.3f}; "
          f"zero gates in all-zero groups: {l21['zeros_in_zero_groups']:.3f} (l2,1) vs "
          f"{l1['zeros_in_zero_groups']:.3f} (l1)")


register_repro("ds", run, "DS Fig. 1-2: l1 vs l2,1 channel sparsity patterns of a small CNN")
