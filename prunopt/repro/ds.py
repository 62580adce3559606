"""``prunopt repro ds``: Lee, *Differentiable Sparsification for Deep Neural
Networks* (arXiv:1910.03201), Fig. 1-2 and Table 2 -- l1 against group l2,1
regularisation of the sparse batch-norm gates.

What the paper shows (CIFAR-10, DenseNet-40-K12, 5 runs): the two norms reach a
similar channel sparsity (50.0 ± 0.6 vs 50.3 ± 1.0 %) and a similar error
(5.72 ± 0.09 vs 5.79 ± 0.11 %), but l1 removes channels scattered over the
groups (group sparsity 1.7 ± 0.9 %) while l2,1 removes whole groups
(45.8 ± 0.8 %).

Here (CPU scale): :class:`prunopt.train.models.SmallCNN` (width 16, three sparse
batch norms, eq. 17, gates starting at exactly 0.5 by eq. 12's initialisation)
trained from scratch on scikit-learn's 8x8 digits, once per norm and seed,
with the l1 (eq. 2) or the group l2,1 (eq. 4, groups of 4 consecutive
channels) regulariser on the gates, strength ramped by the cubic schedule
(appendix eq. 1) over the first half of training. SGD (momentum 0.9, cosine
learning rate) for the weights and the gate magnitudes ``alpha`` (weight decay
on the weights only, none on ``alpha`` and ``beta`` as in the paper), Adam for
the thresholds ``beta`` (see docs/sparsification.md). The final strengths
(:data:`LAMBDA`) are chosen, as the paper chooses its lambda, so that both
norms reach about half the channels. Accuracy is that of the exported model
(zero-gated channels physically removed).
"""
from __future__ import annotations

from typing import Dict, List, Optional

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
from prunopt.repro.report import (
    Report,
    Timer,
    deterministic,
    markdown_table,
    mean_std,
    pm,
    pyplot,
    repro_command,
    save_figure,
    scale,
    seeds_from,
)
from prunopt.train.data import load_digits
from prunopt.train.loop import evaluate, train_epoch
from prunopt.train.methods.ds import ds_optimizer
from prunopt.train.models import SmallCNN

GROUP = 4
NORMS = ("l1", "l21")
#: final strengths: l1 at the library's default (``prunopt.train.methods.ds.DEFAULT_LAMBDA``, ~51 % channel
#: sparsity over 5 seeds); l2,1 lowered from the library's 0.2 (~63 %) so that
#: both norms remove about the same share of channels, as the paper sets lambda
LAMBDA = {"l1": 0.05, "l21": 0.15}
#: epochs, images (None: all), SmallCNN width and seeds per size
SIZES = {"full": dict(epochs=30, limit=None, width=16, seeds=5),
         "quick": dict(epochs=15, limit=None, width=16, seeds=1),
         "tiny": dict(epochs=2, limit=150, width=4, seeds=2)}
#: DS Table 2 (CIFAR-10, DenseNet-40-K12): channel / group sparsity %, error %, mean and std of 5 runs
PAPER = {"l1": {"channel": (50.0, 0.6), "group": (1.7, 0.9), "error": (5.72, 0.09)},
         "l21": {"channel": (50.3, 1.0), "group": (45.8, 0.8), "error": (5.79, 0.11)}}


def train(norm: str, lam: float, epochs: int, limit, seed: int, width: int = 16, lr: float = 0.1,
          beta_lr: float = 0.01, weight_decay: float = 5e-4):
    """Trains one DS model from scratch; returns a dict with the final gate
    vectors (``gates``), the initial ones (``initial_gates``), the exported and
    gated accuracies (``acc``, ``gated_acc``) and the conv/linear weight counts
    of the exported and dense models (``params``, ``dense_params``)."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    torch.manual_seed(seed)
    data = load_digits(seed=seed, limit=limit)
    model = convert_to_sparse_batchnorm(SmallCNN(width=width), preserve=False)
    with torch.no_grad():
        initial = [g.detach().clone() for g in sparse_gates(model)]
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
    return {"gates": gates, "initial_gates": initial, "acc": evaluate(small, data.x_test, data.y_test),
            "gated_acc": gated_acc, "params": small_params, "dense_params": dense_params}


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


def _plot(runs: Dict[str, List[dict]], seed: int, path: str) -> None:
    """Fig. 1 (channel-wise gate magnitudes) and Fig. 2 (group-wise) for one
    seed, and the channel / group sparsity over all seeds beside the paper's."""
    import numpy as np
    from matplotlib.patches import Patch

    plt = pyplot()
    no_channel, zero, border = "#cfe3f5", "tab:red", "gold"
    # exact zeros are drawn below the colour range (value -1), missing channels as masked
    cmap = plt.get_cmap("gray").with_extremes(bad=no_channel, under=zero)
    fig = plt.figure(figsize=(12, 5.4))
    gs = fig.add_gridspec(2, 3, width_ratios=[4, 1.2, 2.2])
    for row, norm in enumerate(NORMS):
        res = next(r for r in runs[norm] if r["seed"] == seed)
        gates = [torch.tensor(g) for g in res["gates"]]
        width = max(g.numel() for g in gates)
        ax = fig.add_subplot(gs[row, 0])
        img = np.full((len(gates), width), np.nan)
        for i, g in enumerate(gates):
            mag = g.abs()
            img[i, : g.numel()] = np.where(mag.numpy() == 0, -1.0, np.sqrt((mag / mag.max().clamp_min(1e-30)).numpy()))
        ax.imshow(np.ma.masked_invalid(img), cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        for i, g in enumerate(gates):
            for j in range(GROUP, g.numel(), GROUP):
                ax.plot([j - 0.5, j - 0.5], [i - 0.5, i + 0.5], color=border, lw=1.0)
        s = res["stats"]
        ax.set_title(f"{norm} (lambda={res['lambda']}, seed {seed}): channel-wise, grey = sqrt(|a| / max |a|); "
                     f"channel sparsity {s['channel_sparsity']:.0%}", fontsize=8)
        ax.set_yticks(range(len(gates)))
        ax.set_yticklabels([f"BN{i + 1}" for i in range(len(gates))], fontsize=8)
        ax.set_xticks([])
        ax = fig.add_subplot(gs[row, 1])
        gw = width // GROUP
        gimg = np.full((len(gates), gw), np.nan)
        for i, g in enumerate(gates):
            live = (g.reshape(-1, GROUP) != 0).double().mean(1).numpy()
            gimg[i, : g.numel() // GROUP] = np.where(live == 0, -1.0, live)
        ax.imshow(np.ma.masked_invalid(gimg), cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_title(f"group-wise: share of live channels\n(group sparsity {s['group_sparsity']:.0%})", fontsize=8)
        ax.set_yticks([])
        ax.set_xticks([])
    legend = [Patch(facecolor=zero, edgecolor="gray", label="gate exactly 0: channel removed (right: whole group)"),
              Patch(facecolor="black", edgecolor="gray", label="left: smallest non-zero gate; right: few live channels"),
              Patch(facecolor="white", edgecolor="gray", label="left: largest gate of the layer; right: all 4 live"),
              Patch(facecolor=no_channel, edgecolor="gray", label="no channel (the layer is narrower)"),
              Patch(facecolor="none", edgecolor=border, label="yellow line: border between groups of 4")]
    fig.legend(handles=legend, loc="lower left", ncol=3, fontsize=8, frameon=False, bbox_to_anchor=(0.0, -0.08))
    ax = fig.add_subplot(gs[:, 2])
    labels = ["channel", "group"]
    x = np.arange(2)
    for k, norm in enumerate(NORMS):
        vals = [[100 * r["stats"][f"{lab}_sparsity"] for r in runs[norm]] for lab in labels]
        ms = [mean_std(v) for v in vals]
        ax.bar(x + (k - 0.5) * 0.35, [m for m, _ in ms], 0.35, yerr=[s for _, s in ms], capsize=3, color=f"C{k}",
               label=f"{norm}, prunopt (mean ± std, {len(runs[norm])} seeds)")
        ax.errorbar(x + (k - 0.5) * 0.35, [PAPER[norm][lab][0] for lab in labels],
                    [PAPER[norm][lab][1] for lab in labels], fmt="kx", ms=8, mew=2, capsize=2,
                    label="paper, Table 2" if k == 0 else None)
    ax.set_xticks(x)
    ax.set_xticklabels(["channel sparsity", "group sparsity"])
    ax.set_ylabel("%")
    ax.set_title("sparsity over seeds (crosses: paper)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def _claims(rep: Report, runs: Dict[str, List[dict]]) -> None:
    init_err = max(abs(v - 0.5) for r in runs["l1"] + runs["l21"] for v in r["initial_gates"])
    rep.claim("Gates start at a_i = 0.5 (eq. 12's initialisation)", "0.5", f"max |a - 0.5| = {init_err:.1e}",
              "reproduced" if init_err == 0 else "not reproduced")

    def stat(norm, key):
        return [100 * r["stats"][key] for r in runs[norm]]

    c1, c2 = stat("l1", "channel_sparsity"), stat("l21", "channel_sparsity")
    dc = abs(mean_std(c1)[0] - mean_std(c2)[0])
    rep.claim("l1 and l2,1 reach a similar channel sparsity (%)", "50.0 ± 0.6 vs 50.3 ± 1.0",
              f"{pm(c1, '.1f')} vs {pm(c2, '.1f')}", "reproduced" if dc <= 5 else "qualitatively" if dc <= 15
              else "not reproduced", "lambda chosen for ~50 %, as the paper chooses it; similar read as <= 5 points")
    g1, g2 = stat("l1", "group_sparsity"), stat("l21", "group_sparsity")
    m1, m2 = mean_std(g1)[0], mean_std(g2)[0]
    rep.claim("Group sparsity (groups of 4): low for l1, high for l2,1 (%)", "1.7 ± 0.9 vs 45.8 ± 0.8",
              f"{pm(g1, '.1f')} vs {pm(g2, '.1f')}",
              "reproduced" if m1 <= 10 and m2 >= 35 else "qualitatively" if m2 >= m1 + 10 else "not reproduced",
              "reproduced: l1 <= 10 % and l2,1 >= 35 %; qualitatively: l2,1 at least 10 points above l1")
    z1, z2 = stat("l1", "zeros_in_zero_groups"), stat("l21", "zeros_in_zero_groups")
    rep.claim("l2,1 removes whole groups, l1 scatters its zeros (Fig. 1-2): zero gates lying in all-zero groups (%)",
              "pattern (figures)", f"{pm(z1, '.1f')} (l1) vs {pm(z2, '.1f')} (l2,1)",
              "reproduced" if mean_std(z2)[0] >= mean_std(z1)[0] + 30 else
              "qualitatively" if mean_std(z2)[0] > mean_std(z1)[0] else "not reproduced")
    a1 = [100 * r["acc"] for r in runs["l1"]]
    a2 = [100 * r["acc"] for r in runs["l21"]]
    da = abs(mean_std(a1)[0] - mean_std(a2)[0])
    rep.claim("Similar accuracy for l1 and l2,1 (test accuracy %; paper: error)", "94.28 ± 0.09 vs 94.21 ± 0.11",
              f"{pm(a1, '.1f')} vs {pm(a2, '.1f')}", "reproduced" if da <= 1 else "qualitatively" if da <= 3
              else "not reproduced", "similar read as <= 1 point between the means; exported (channel-removed) models")


def parse_lambdas(text: Optional[str]) -> Dict[str, float]:
    """``"l1=0.05,l21=0.2"`` -> final strengths per norm (missing norms:
    :data:`LAMBDA`)."""
    lam = dict(LAMBDA)
    for item in [t.strip() for t in (text or "").split(",") if t.strip()]:
        key, _, val = item.partition("=")
        if key not in NORMS:
            raise ValueError(f"--ds-lambda: unknown norm {key!r}; expected {NORMS}")
        try:
            lam[key] = float(val)
        except ValueError:
            raise ValueError(f"--ds-lambda: {item!r} is not norm=number") from None
        if not lam[key] > 0:
            raise ValueError(f"--ds-lambda: the strength of {key} must be > 0, got {lam[key]}")
    return lam


def compute(size: dict, seeds: List[int], lam: Optional[Dict[str, float]] = None) -> dict:
    """One DS model per (seed, norm); the per-run records."""
    lam = lam or dict(LAMBDA)
    runs: Dict[str, List[dict]] = {n: [] for n in NORMS}
    for seed in seeds:
        for norm in NORMS:
            r = train(norm, lam[norm], size["epochs"], size["limit"], seed, width=size["width"])
            runs[norm].append({"seed": seed, "lambda": lam[norm], "acc": r["acc"],
                               "gated_acc": r["gated_acc"], "params": r["params"],
                               "dense_params": r["dense_params"], "stats": sparsity_stats(r["gates"]),
                               "gates": [g.tolist() for g in r["gates"]],
                               "initial_gates": [v for g in r["initial_gates"] for v in g.tolist()]})
    return {"size": size, "lambda": lam, "runs": runs, "paper": PAPER}


def merge(parts) -> dict:
    """Combines runs made in pieces (other seeds, same size)."""
    from prunopt.repro.report import same_setting

    size = same_setting(parts, "size")
    runs = {n: sorted((r for p in parts for r in p["data"]["runs"][n]), key=lambda r: r["seed"]) for n in NORMS}
    seeds = [r["seed"] for r in runs["l1"]]
    if len(set(seeds)) != len(seeds):
        raise ValueError("--merge: the parts overlap (a seed was run twice)")
    if any(len({r["lambda"] for r in runs[n]}) > 1 for n in NORMS):
        raise ValueError("--merge: the parts disagree on the regularisation strengths")
    lam = {n: runs[n][0]["lambda"] for n in NORMS}
    return {"size": size, "lambda": lam, "runs": runs, "paper": PAPER}


def run(args) -> None:
    from prunopt.repro.report import load_parts, pieces_section

    if getattr(args, "merge", None):
        parts = load_parts(args.merge, "ds")
        data = merge(parts)
        wall = sum(p["wall_s"] for p in parts)
        command = repro_command(args, "ds") + f" --merge {args.merge}"
    else:
        size = SIZES[scale(args)]
        command = repro_command(args, "ds", ["ds_lambda"])
        lam = parse_lambdas(getattr(args, "ds_lambda", None))
        with deterministic(args.threads), Timer() as t:
            data = compute(size, seeds_from(args, size["seeds"]), lam)
        wall = t.seconds
    size, runs = data["size"], data["runs"]
    seeds = [r["seed"] for r in runs["l1"]]
    epochs, limit, width = size["epochs"], size["limit"], size["width"]
    rep = Report("ds", "Differentiable Sparsification (Lee, arXiv:1910.03201): l1 vs group l2,1 (Fig. 1-2, Table 2)",
                 command, seeds, args.threads, {"epochs": epochs, "width": width,
                                                "images": "all 1797" if limit is None else limit,
                                                "lambda": data["lambda"], "group": GROUP})
    rep.wall_s = wall
    _claims(rep, runs)
    rows = []
    for norm in NORMS:
        for r in runs[norm]:
            s = r["stats"]
            rows.append([norm, r["seed"], f"{100 * s['channel_sparsity']:.1f}", f"{100 * s['group_sparsity']:.1f}",
                         f"{100 * s['zeros_in_zero_groups']:.1f}", ", ".join(f"{v:.2f}" for v in s["layer_sparsity"]),
                         f"{r['params']} / {r['dense_params']}", f"{r['acc']:.4f}"])
    rep.section(f"Per seed (SmallCNN width {width}, digits; BN1-BN3 have {width}, {2 * width}, {2 * width} channels)",
                markdown_table(["norm", "seed", "channel sparsity %", "group sparsity %", "zeros in all-zero groups %",
                                "sparsity per layer (BN1, BN2, BN3)", "weights exported / dense", "test accuracy"], rows))
    rep.data = data
    if getattr(args, "merge", None):
        pieces_section(rep, parts)
    rep.write(args.out, {"ds.png": lambda path: _plot(runs, seeds[0], path)})


def add_arguments(parser) -> None:
    g = parser.add_argument_group("ds")
    g.add_argument("--ds-lambda", default=None,
                   help=f"ds: final regularisation strengths, e.g. l1=0.05,l21=0.2 (default {LAMBDA})")


register_repro("ds", run, "DS: l1 vs group l2,1 gate regularisation (Fig. 1-2, Table 2), over seeds", add_arguments)
