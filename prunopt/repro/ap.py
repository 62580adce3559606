"""``prunopt repro ap``: Colombo and Gao, *Differentiable architecture pruning
for transfer learning* (arXiv:2107.03375): Fig. 1 (two-temperature masks on a
logistic regression) and the layer-wise reshuffle experiment of Table 1, at a
scale this machine runs.

**Fig. 1.** Logistic regression on the 0-vs-1 digits (scikit-learn's 8x8
images, the paper uses MNIST's) selects a sparse sub-model through a
two-temperature mask ``v = sigmoid(t_l w)`` on its 64 weights (backward with
``t_s``, eq. 7): ``t_l = 1000``, ``t_s`` in ``{t_l, t_l/100, t_l/1000}``,
full-batch gradient descent on ``BCE + gamma ||v||^2`` (eq. 12), 1500
iterations. The paper: ``t_s = t_l/100`` reaches the lowest objective in the
fewest iterations, ``t_s = t_l`` (the exact gradient) is worst, and
``t_s = t_l/1000`` prunes every connection. Measured over seeds (the
initialisation of ``theta`` and ``w``), with the objective averaged over the
final 20 % of the iterations (a curve can oscillate), at several learning
rates (the paper gives none).

**Table 1 (reshuffle).** The paper learns AP masks on a VGG19 for CIFAR-10 and
fine-tunes the sub-networks on 500 CIFAR-100 images; randomly reshuffling the
masks inside each layer (keeping the layer-wise densities) keeps AP's transfer
accuracy (it is the layer-wise density that matters) and AP's densities
transfer better than IMP's. Here: a SmallCNN (width 16) trained on the digits
0-4 is the parent; AP (two-temperature masks, stop at the target sparsity) and
iterative magnitude pruning (IMP, 20 % of the remaining weights per round,
one retraining epoch between rounds) select sub-networks; each is fine-tuned
from the parent's weights (new classifier) on 100 images of the digits 5-9 and
tested on the other images of 5-9: the AP mask, AP reshuffled, IMP, IMP
reshuffled, and a uniformly random mask of the same global density.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from prunopt.nn.architecture import (
    apply_architecture,
    extract_architecture,
    layer_densities,
    mask_regularizer,
    reshuffle_masks,
    stop_at_sparsity,
    two_temperature_masks,
    wrap_two_temperature_masks,
)
from prunopt.ops import two_temperature_sigmoid
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

T_L = 1000.0
RATIOS = (("t_l", 1.0), ("t_l/100", 100.0), ("t_l/1000", 1000.0))
#: Table 1 of the paper: transfer accuracy after reshuffling (|D_new| = 500), mean ± std of 5 runs
PAPER_TABLE1 = {0.1: ((0.378, 0.021), (0.300, 0.024)), 0.3: ((0.343, 0.023), (0.332, 0.022)),
                0.5: ((0.429, 0.023), (0.342, 0.026)), 0.7: ((0.448, 0.020), (0.376, 0.025)),
                0.9: ((0.497, 0.021), (0.100, 0.000)), 0.95: ((0.301, 0.001), (0.100, 0.000)),
                0.99: ((0.100, 0.000), (0.100, 0.000))}


# --- Fig. 1 -----------------------------------------------------------------------
def zero_one_digits():
    """The 0 and 1 images of scikit-learn's digits (360), pixels in [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits(n_class=2)
    return torch.tensor(d.data, dtype=torch.float64) / 16.0, torch.tensor(d.target, dtype=torch.float64)


def fit(x, y, t_l: float, t_s: float, iters: int, gamma: float, lr: float, seed: int):
    """Gradient descent on ``BCE(x (v * theta) + b) + gamma ||v||^2`` with the
    two-temperature mask ``v`` (eq. 6-7, 12); ``theta ~ N(0, 0.01^2)``,
    ``w ~ |N(0, 0.01^2)|`` (every connection on) from ``seed``. Returns the
    objective per iteration, the final mask density ``mean(1[w > 0])`` and the
    training accuracy with the binary mask."""
    g = torch.Generator().manual_seed(seed)
    theta = (torch.randn(x.shape[1], generator=g, dtype=torch.float64) * 0.01).requires_grad_(True)
    bias = torch.zeros((), dtype=torch.float64, requires_grad=True)
    w = (torch.randn(x.shape[1], generator=g, dtype=torch.float64) * 0.01).abs().requires_grad_(True)
    opt = torch.optim.SGD([theta, bias, w], lr=lr)
    objective = []
    for _ in range(iters):
        opt.zero_grad()
        v = two_temperature_sigmoid(w, t_l, t_s)
        loss = F.binary_cross_entropy_with_logits(x @ (v * theta) + bias, y) + gamma * (v ** 2).sum()
        loss.backward()
        opt.step()
        objective.append(loss.item())
    with torch.no_grad():
        m = (w > 0).double()
        acc = (((x @ (m * theta) + bias) > 0).double() == y).double().mean().item()
    return objective, m.mean().item(), acc


def window_stats(objective: List[float], frac: float = 0.2) -> Dict[str, float]:
    """Over the final ``frac`` of the iterations: the mean objective, and how
    much it oscillates, ``window_rise`` = the sum of its increases divided by
    the mean (0 for a curve that only decreases, whatever its slope)."""
    if not objective:
        raise ValueError("objective is empty")
    k = max(1, int(round(frac * len(objective))))
    tail = objective[-k:]
    m = sum(tail) / k
    rise = sum(max(0.0, b - a) for a, b in zip(tail, tail[1:]))
    return {"window_mean": m, "window_rise": rise / m if m else 0.0, "last": objective[-1]}


def fig1(seeds, lrs, iters: int, gamma: float):
    """Every (learning rate, t_s, seed): window statistics, density, accuracy;
    and the curves of the first learning rate."""
    x, y = zero_one_digits()
    runs, curves = [], {}
    for lr in lrs:
        for name, div in RATIOS:
            for seed in seeds:
                obj, dens, acc = fit(x, y, T_L, T_L / div, iters, gamma, lr, seed)
                runs.append({"lr": lr, "t_s": name, "seed": seed, "density": dens, "accuracy": acc,
                             **window_stats(obj)})
                if lr == lrs[0]:
                    curves.setdefault(name, []).append(obj)
    return runs, curves


# --- Table 1 (reshuffle) ------------------------------------------------------------
def split_digits(seed: int, n_new: int = 100, parent_limit: Optional[int] = None):
    """Parent task: digits 0-4, 70:30 split (fixed; ``parent_limit`` keeps that
    many parent images, for tests). New task: ``n_new`` training images of 5-9
    (balanced, drawn with ``seed``), the other 5-9 images for testing. Images
    ``(N, 1, 8, 8)`` float32."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    parent = torch.nonzero(y < 5).flatten()
    parent = parent[torch.randperm(len(parent), generator=g)][:parent_limit]
    n_te = int(round(0.3 * len(parent)))
    gs = torch.Generator().manual_seed(1000 + seed)
    train_new, test_new = [], []
    per_class = n_new // 5
    for c in range(5, 10):
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=gs)]
        train_new.append(idx[:per_class])
        test_new.append(idx[per_class:])
    train_new, test_new = torch.cat(train_new), torch.cat(test_new)
    return {"parent": (x[parent[n_te:]], y[parent[n_te:]], x[parent[:n_te]], y[parent[:n_te]]),
            "new": (x[train_new], y[train_new], x[test_new], y[test_new])}


def _train(model, params, x, y, epochs: int, lr: float, gen, loss_extra=None, after_step=None):
    from prunopt.train.loop import train_epoch

    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(epochs):
        train_epoch(model, opt, x, y, 64, gen, loss_extra=loss_extra, after_step=after_step)


def _wrapped(state, seed: int):
    """A SmallCNN with the parent's weights, every conv/linear layer wrapped in a
    two-temperature mask (t_l = 1000, t_s = t_l/100)."""
    from prunopt.train.models import SmallCNN

    model = SmallCNN(10, width=16)
    model.load_state_dict(state)
    wrap_two_temperature_masks(model, t_l=T_L, generator=torch.Generator().manual_seed(seed))
    return model, two_temperature_masks(model)


def ap_architecture(state, data, sparsity: float, seed: int, gamma: float, max_epochs: int):
    """AP on the parent task: weights and mask logits trained (Adam) with the
    penalty ``gamma ||v||^2`` until the sparsity of ``1[w > 0]`` reaches the
    target (then frozen, footnote 10). Returns the masks and whether the target
    was reached."""
    from prunopt.train.loop import train_epoch

    model, masks = _wrapped(state, seed)
    xtr, ytr = data["parent"][0], data["parent"][1]
    weights = [p for n, p in model.named_parameters() if not n.endswith(".w")]
    opt = torch.optim.Adam([dict(params=weights, lr=1e-3), dict(params=[m.w for m in masks], lr=1e-3)])
    gen = torch.Generator().manual_seed(seed)
    done = {"v": stop_at_sparsity(masks, sparsity)}

    def after():
        if not done["v"]:
            done["v"] = stop_at_sparsity(masks, sparsity)

    for _ in range(max_epochs):
        if done["v"]:
            break
        train_epoch(model, opt, xtr, ytr, 64, gen, loss_extra=lambda: mask_regularizer(masks, gamma), after_step=after)
    for m in masks:
        m.freeze()
    return extract_architecture(masks), done["v"]


def imp_architecture(state, data, sparsity: float, seed: int, rate: float = 0.2):
    """Iterative magnitude pruning on the parent task: global magnitude pruning
    of ``rate`` of the remaining conv/linear weights, one retraining epoch
    (Adam, masks held), repeated until the target (the last round prunes to it
    exactly). Returns the keep-masks in wrap order."""
    from prunopt.pruning.selection import global_masks
    from prunopt.train.models import SmallCNN

    model = SmallCNN(10, width=16)
    model.load_state_dict(state)
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    masks = {str(i): torch.ones_like(l.weight, dtype=torch.bool) for i, l in enumerate(layers)}
    xtr, ytr = data["parent"][0], data["parent"][1]
    gen = torch.Generator().manual_seed(seed)
    current = 0.0

    def hold():
        with torch.no_grad():
            for i, l in enumerate(layers):
                l.weight.mul_(masks[str(i)])

    while current < sparsity - 1e-12:
        current = min(sparsity, 1 - (1 - current) * (1 - rate))
        scores = {str(i): l.weight.detach().abs() * masks[str(i)] for i, l in enumerate(layers)}
        masks = dict(global_masks(scores, current))
        hold()
        _train(model, model.parameters(), xtr, ytr, 1, 1e-3, gen, after_step=hold)
    return [masks[str(i)].clone() for i in range(len(layers))]


def reshuffled(arch, seed: int):
    """The same layer-wise densities, positions drawn uniformly at random."""
    from prunopt.train.models import SmallCNN

    model = SmallCNN(10, width=16)
    wrap_two_temperature_masks(model)
    masks = two_temperature_masks(model)
    apply_architecture(masks, arch)
    reshuffle_masks(masks, layer_densities(masks), generator=torch.Generator().manual_seed(seed))
    return extract_architecture(masks)


def uniform_random(arch, seed: int):
    """A uniformly random mask with the same global density as ``arch``."""
    sizes = [a.numel() for a in arch]
    k = int(sum(int(a.sum()) for a in arch))
    keep = torch.zeros(sum(sizes), dtype=torch.bool)
    keep[torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(seed))[:k]] = True
    return [p.view_as(a) for p, a in zip(keep.split(sizes), arch)]


def transfer(state, arch, data, seed: int, epochs: int) -> float:
    """Fine-tunes the parent's weights under the fixed mask ``arch`` on the new
    task's few images (new classifier weights), Adam; returns the test accuracy."""
    from prunopt.train.loop import evaluate

    model, masks = _wrapped(state, seed)
    apply_architecture(masks, arch)
    torch.manual_seed(seed)
    model.classifier.layer.reset_parameters()
    xtr, ytr, xte, yte = data["new"]
    weights = [p for n, p in model.named_parameters() if not n.endswith(".w")]
    _train(model, weights, xtr, ytr, epochs, 1e-3, torch.Generator().manual_seed(seed))
    return evaluate(model, xte, yte)


def parent_state(data, seed: int, epochs: int):
    """The dense parent SmallCNN trained on the digits 0-4 (Adam, lr 1e-2)."""
    from prunopt.train.loop import evaluate
    from prunopt.train.models import SmallCNN

    torch.manual_seed(seed)
    model = SmallCNN(10, width=16)
    xtr, ytr, xte, yte = data["parent"]
    _train(model, model.parameters(), xtr, ytr, epochs, 1e-2, torch.Generator().manual_seed(seed))
    return copy.deepcopy(model.state_dict()), evaluate(model, xte, yte)


CONDITIONS = ("AP", "AP reshuffled", "IMP", "IMP reshuffled", "random")
#: per size: seeds, Fig. 1 iterations and learning rates, Table 1 sparsities and
#: (parent, AP search, transfer) epochs
SIZES = {"full": dict(seeds=5, iters=1500, lrs=[0.5, 0.2, 0.1, 0.05], sparsities=[0.5, 0.9, 0.95], epochs=(8, 40, 30)),
         "quick": dict(seeds=2, iters=300, lrs=[0.5, 0.1], sparsities=[0.9], epochs=(3, 8, 10)),
         "tiny": dict(seeds=2, iters=40, lrs=[0.5], sparsities=[0.5], epochs=(1, 1, 1), parent_limit=150)}


def table1(seeds, sparsities, parent_epochs: int, search_epochs: int, transfer_epochs: int, gamma: float,
           parent_limit: Optional[int] = None):
    """Per seed and sparsity: the new-task accuracy of every condition in
    :data:`CONDITIONS` and the dense network, the masks' layer densities."""
    runs = []
    for seed in seeds:
        data = split_digits(seed, parent_limit=parent_limit)
        state, parent_acc = parent_state(data, seed, parent_epochs)
        dense = transfer(state, [torch.ones_like(p, dtype=torch.bool) for p in _arch_shapes()], data, seed,
                         transfer_epochs)
        for s in sparsities:
            ap, reached = ap_architecture(state, data, s, seed, gamma, search_epochs)
            imp = imp_architecture(state, data, s, seed)
            archs = {"AP": ap, "AP reshuffled": reshuffled(ap, seed), "IMP": imp,
                     "IMP reshuffled": reshuffled(imp, seed), "random": uniform_random(ap, seed)}
            rec = {"seed": seed, "sparsity": s, "parent_acc": parent_acc, "dense_transfer": dense,
                   "ap_reached": reached,
                   "ap_sparsity": 1 - sum(int(a.sum()) for a in ap) / sum(a.numel() for a in ap),
                   "ap_layer_density": [float(a.double().mean()) for a in ap],
                   "imp_layer_density": [float(a.double().mean()) for a in imp]}
            for name, arch in archs.items():
                rec[name] = transfer(state, arch, data, seed, transfer_epochs)
            runs.append(rec)
    return runs


def _arch_shapes():
    from prunopt.train.models import SmallCNN

    return [m.weight for m in SmallCNN(10, width=16).modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]


# --- report ---------------------------------------------------------------------------
def _best_counts(runs, lr):
    """Per seed, the t_s with the lowest final-window objective at ``lr``."""
    seeds = sorted({r["seed"] for r in runs})
    best = []
    for seed in seeds:
        rs = [r for r in runs if r["lr"] == lr and r["seed"] == seed]
        best.append(min(rs, key=lambda r: r["window_mean"])["t_s"])
    return {name: best.count(name) for name, _ in RATIOS}, len(seeds)


def _fig1_claims(rep: Report, runs, lrs) -> None:
    lr0 = lrs[0]
    counts, n = _best_counts(runs, lr0)
    by = {name: [r for r in runs if r["lr"] == lr0 and r["t_s"] == name] for name, _ in RATIOS}
    means = {name: pm([r["window_mean"] for r in rs], ".4f") for name, rs in by.items()}
    rep.claim(f"t_s = t_l/100 reaches the lowest objective (lr = {lr0}, mean of the final 20 %)",
              "t_l/100 lowest (Fig. 1)", f"lowest in {counts['t_l/100']}/{n} seeds (t_l/1000: "
              f"{counts['t_l/1000']}/{n}, t_l: {counts['t_l']}/{n}); " + ", ".join(f"{k}: {v}" for k, v in means.items()),
              "reproduced" if counts["t_l/100"] == n else "qualitatively" if counts["t_l/100"] > 0 else "not reproduced")
    worst = 0
    for seed in sorted({r["seed"] for r in runs}):
        rs = [r for r in runs if r["lr"] == lr0 and r["seed"] == seed]
        worst += max(rs, key=lambda r: r["window_mean"])["t_s"] == "t_l"
    rep.claim(f"t_s = t_l (the exact gradient) is the worst (lr = {lr0})", "worst (Fig. 1)",
              f"worst in {worst}/{n} seeds", "reproduced" if worst == n else "qualitatively" if worst > n / 2
              else "not reproduced")
    dens = [r["density"] for r in by["t_l/1000"]]
    rep.claim("t_s = t_l/1000 prunes every connection", "density 0 (text, section 4)",
              f"density {pm(dens, '.3f')}", "reproduced" if max(dens) == 0 else "not reproduced")
    osc = {lr: mean_std([r["window_rise"] for r in runs if r["lr"] == lr and r["t_s"] == "t_l/100"])[0] for lr in lrs}
    best_by_lr = {lr: _best_counts(runs, lr)[0]["t_l/100"] for lr in lrs}
    rep.claim("Learning rate and the t_l/100 oscillation (sum of the objective's increases over the final 20 %, "
              "relative to its mean)", "no learning rate given", "; ".join(f"lr {lr}: rise {osc[lr]:.3f}, t_l/100 lowest in "
                                                  f"{best_by_lr[lr]}/{n} seeds" for lr in lrs),
              "qualitatively" if any(best_by_lr[lr] == n for lr in lrs) else "not reproduced",
              "qualitatively: at some learning rate t_l/100 is the lowest in every seed")


def _table1_claims(rep: Report, runs, sparsities) -> None:
    for s in sparsities:
        rs = [r for r in runs if r["sparsity"] == s]
        ap_r = [r["AP reshuffled"] for r in rs]
        imp_r = [r["IMP reshuffled"] for r in rs]
        paper = PAPER_TABLE1.get(s)
        ptxt = (f"{paper[0][0]:.3f} ± {paper[0][1]:.3f} vs {paper[1][0]:.3f} ± {paper[1][1]:.3f}" if paper
                else "not in Table 1")
        d = mean_std([a - b for a, b in zip(ap_r, imp_r)])
        few = len(rs) < 3  # no verdict beyond "qualitatively" from fewer than three seeds
        rep.claim(f"Reshuffled AP masks transfer at least as well as reshuffled IMP masks, sparsity {s}",
                  ptxt, f"{pm(ap_r)} vs {pm(imp_r)} (difference {d[0]:+.3f} ± {d[1]:.3f}, {len(rs)} seeds)",
                  "reproduced" if d[0] > 0 and d[0] > d[1] and not few else "qualitatively" if d[0] > 0
                  else "not reproduced",
                  "digits 0-4 -> 5-9, 100 new-task images; paper: VGG19 CIFAR-10 -> CIFAR-100, 500 images")
        ap = [r["AP"] for r in rs]
        dd = mean_std([a - b for a, b in zip(ap_r, ap)])
        se = dd[1] / len(rs) ** 0.5  # standard error of the mean difference
        rep.claim(f"The layer-wise density is what matters: reshuffled AP ≈ AP, sparsity {s}",
                  "conjecture of Frankle et al., supported by Table 1", f"AP {pm(ap)}, reshuffled {pm(ap_r)} "
                  f"(difference {dd[0]:+.3f} ± {dd[1]:.3f}, standard error {se:.3f})",
                  "reproduced" if not few and (abs(dd[0]) <= 0.02 or (abs(dd[0]) <= 2 * se and se <= 0.03))
                  else "qualitatively" if abs(dd[0]) <= 2 * se else "not reproduced",
                  "reproduced: within 2 points, or within two standard errors that are <= 3 points; qualitatively: "
                  "within two (larger) standard errors, i.e. not distinguishable at this spread")


def _plot(curves, runs_fig, lrs, runs_t1, sparsities, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ax = axes[0]
    for k, (name, _) in enumerate(RATIOS):
        cs = torch.tensor(curves[name])
        it = torch.arange(cs.shape[1]) * CURVE_STRIDE
        ax.plot(it.numpy(), cs.mean(0).numpy(), color=f"C{k}", label=f"t_s = {name} (mean of {len(cs)} seeds)")
        ax.fill_between(it.numpy(), cs.min(0).values.numpy(), cs.max(0).values.numpy(), color=f"C{k}", alpha=0.2)
    n = len(curves[RATIOS[0][0]][0]) * CURVE_STRIDE
    ax.axvspan(0.8 * n, n, color="gray", alpha=0.12, label="final 20 % (averaged)")
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("objective (BCE + gamma ||v||^2)")
    ax.set_title(f"Fig. 1: 0 vs 1 digits, t_l = 1000, lr = {lrs[0]} (band: min-max over seeds)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    for k, (name, _) in enumerate(RATIOS):
        ms = [mean_std([r["window_mean"] for r in runs_fig if r["lr"] == lr and r["t_s"] == name]) for lr in lrs]
        ax.errorbar(lrs, [m for m, _ in ms], [s for _, s in ms], marker="o", capsize=3, color=f"C{k}",
                    label=f"t_s = {name}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import NullLocator

    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(lrs)
    ax.set_xticklabels([str(lr) for lr in lrs])
    ax.set_xlabel("learning rate")
    ax.set_ylabel("objective, final 20 % (mean ± std over seeds)")
    ax.set_title("effect of the learning rate", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[2]
    for k, name in enumerate(CONDITIONS):
        ms = [mean_std([r[name] for r in runs_t1 if r["sparsity"] == s]) for s in sparsities]
        ax.errorbar(sparsities, [m for m, _ in ms], [s for _, s in ms], marker="o", capsize=3, color=f"C{k}",
                    label=name)
    ps = [s for s in sparsities if s in PAPER_TABLE1]
    ax.plot(ps, [PAPER_TABLE1[s][0][0] for s in ps], "kx", ms=8, mew=2, label="paper: AP reshuffled (CIFAR)")
    ax.plot(ps, [PAPER_TABLE1[s][1][0] for s in ps], "k+", ms=9, mew=2, label="paper: IMP reshuffled (CIFAR)")
    ax.set_xlabel("sparsity")
    ax.set_ylabel("new-task test accuracy (mean ± std over seeds)")
    ax.set_title("Table 1: transfer digits 0-4 -> 5-9, 100 images", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


CURVE_STRIDE = 5  # the stored Fig. 1 curves keep every 5th iteration


def compute(size: dict, seeds: List[int]) -> dict:
    runs_fig, curves = fig1(seeds, size["lrs"], size["iters"], 1e-3)
    parent_epochs, search_epochs, transfer_epochs = size["epochs"]
    runs_t1 = table1(seeds, size["sparsities"], parent_epochs, search_epochs, transfer_epochs, 1e-3,
                     size.get("parent_limit"))
    curves = {name: [{"seed": s, "objective": [float(f"{v:.6g}") for v in c[::CURVE_STRIDE]]}
                     for s, c in zip(seeds, cs)] for name, cs in curves.items()}
    return {"size": size, "fig1": runs_fig, "curves": curves, "table1": runs_t1}


def merge(parts) -> dict:
    """Combines runs made in pieces (other seeds, same size)."""
    from prunopt.repro.report import same_setting

    size = same_setting(parts, "size")
    data = {"size": size, "fig1": [], "curves": {name: [] for name, _ in RATIOS}, "table1": []}
    for p in parts:
        d = p["data"]
        data["fig1"] += d["fig1"]
        data["table1"] += d["table1"]
        for name in data["curves"]:
            data["curves"][name] += d["curves"][name]
    data["fig1"].sort(key=lambda r: (size["lrs"].index(r["lr"]), [n for n, _ in RATIOS].index(r["t_s"]), r["seed"]))
    data["table1"].sort(key=lambda r: (size["sparsities"].index(r["sparsity"]), r["seed"]))
    for name in data["curves"]:
        data["curves"][name].sort(key=lambda c: c["seed"])
    seeds = [c["seed"] for c in data["curves"][RATIOS[0][0]]]
    if len(set(seeds)) != len(seeds):
        raise ValueError("--merge: the parts overlap (a seed was run twice)")
    return data


def run(args) -> None:
    from prunopt.repro.report import load_parts, pieces_section

    if getattr(args, "merge", None):
        parts = load_parts(args.merge, "ap")
        data = merge(parts)
        wall = sum(p["wall_s"] for p in parts)
        command = repro_command(args, "ap") + f" --merge {args.merge}"
    else:
        size = SIZES[scale(args)]
        command = repro_command(args, "ap")
        with deterministic(args.threads), Timer() as t:
            data = compute(size, seeds_from(args, size["seeds"]))
        wall = t.seconds
    size = data["size"]
    runs_fig, runs_t1 = data["fig1"], data["table1"]
    seeds = [c["seed"] for c in data["curves"][RATIOS[0][0]]]
    iters, lrs, sparsities = size["iters"], size["lrs"], size["sparsities"]
    parent_epochs, search_epochs, transfer_epochs = size["epochs"]
    gamma = 1e-3
    rep = Report("ap", "Differentiable architecture pruning (Colombo, Gao, arXiv:2107.03375): Fig. 1 and Table 1",
                 command, seeds, args.threads,
                 {"fig1": f"{iters} iterations, gamma {gamma}, learning rates {lrs}",
                  "table1": f"sparsities {sparsities}, parent {parent_epochs} epochs, AP search <= {search_epochs} "
                            f"epochs (gamma {gamma}), transfer {transfer_epochs} epochs"})
    rep.wall_s = wall
    _fig1_claims(rep, runs_fig, lrs)
    if runs_t1:
        _table1_claims(rep, runs_t1, sparsities)
    rows = []
    for lr in lrs:
        for name, _ in RATIOS:
            rs = [r for r in runs_fig if r["lr"] == lr and r["t_s"] == name]
            rows.append([lr, name, pm([r["window_mean"] for r in rs], ".4f"), pm([r["last"] for r in rs], ".4f"),
                         pm([r["window_rise"] for r in rs], ".3f"), pm([r["density"] for r in rs], ".3f"),
                         pm([r["accuracy"] for r in rs], ".4f")])
    rep.section(f"Fig. 1 over {len(seeds)} seeds (0 vs 1 digits, t_l = 1000, gamma = {gamma}, {iters} iterations)",
                markdown_table(["lr", "t_s", "objective, final 20 % mean", "objective, last iterate",
                                "oscillation: relative rise, final 20 %", "mask density", "accuracy (binary mask)"],
                               rows))
    if runs_t1:
        rows = []
        for s in sparsities:
            rs = [r for r in runs_t1 if r["sparsity"] == s]
            rows.append([s, f"{sum(r['ap_reached'] for r in rs)}/{len(rs)}"]
                        + [pm([r[c] for r in rs]) for c in CONDITIONS] + [pm([r["dense_transfer"] for r in rs])])
        first = runs_t1[0]["seed"]
        dens = "; ".join(f"{r['sparsity']}: AP {', '.join(f'{d:.2f}' for d in r['ap_layer_density'])} / IMP "
                         f"{', '.join(f'{d:.2f}' for d in r['imp_layer_density'])}"
                         for r in runs_t1 if r["seed"] == first)
        rep.section("Table 1 at small scale: new-task test accuracy after fine-tuning (mean ± std over seeds)",
                    "Parent: SmallCNN on digits 0-4 (test accuracy "
                    + pm([r["parent_acc"] for r in runs_t1 if r["sparsity"] == sparsities[0]])
                    + f"). Layer densities (conv1, conv2, conv3, linear), seed {first}: {dens}.\n\n"
                    + markdown_table(["sparsity", "AP reached target"] + list(CONDITIONS) + ["dense"], rows))
    rep.data = data
    if getattr(args, "merge", None):
        pieces_section(rep, parts)
    curves = {name: [c["objective"] for c in cs] for name, cs in data["curves"].items()}
    rep.write(args.out, {"ap.png": lambda path: _plot(curves, runs_fig, lrs, runs_t1, sparsities, path)})


register_repro("ap", run, "architecture pruning: Fig. 1 (two temperatures, over seeds and learning rates) and the "
               "Table 1 reshuffle experiment at small scale")
