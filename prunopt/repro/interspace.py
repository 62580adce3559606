"""``prunopt repro interspace``: Wimmer, Mehnert and Condurache, *Interspace
Pruning: Using Adaptive Filter Representations to Improve Training of Sparse
CNNs* (arXiv:2203.07808) -- Theorem 1 numerically, and SP against IP at equal
pruning rate (eq. 9) on a task where a small CPU network is not saturated.

**Theorem 1.** For ``U`` with i.i.d. ``N(0, 1)`` entries (``m`` rows: flattened
``K x K`` filters, ``n`` columns) and ``0 < s < m n``, let ``eps_2`` be the error
of magnitude pruning (eq. 2: keep the ``s`` largest ``|U_ij|``, the standard
basis, SP) and ``eps_1`` the infimum of eq. 1 (an adaptive square basis ``F``
and coefficients ``R`` with ``||R||_0 <= s``, IP). Then

* (free support) ``eps_1 < eps_2`` with probability 1;
* (fixed support) with ``supp R`` fixed to eq. 2's support, ``eps_1 <= eps_2``,
  strict with probability ``>= 1 - delta``; ``delta = C(n, s/m) / C(mn, s)`` when
  ``m`` divides ``s`` (the chance that eq. 2 keeps whole columns only; the
  appendix's eq. A.85), else 0.

Checked on many draws per sparsity: (a) ``m = 9`` (3x3 filters), ``n = 100``:
``eps_1`` from alternating least squares on the fixed support
(:func:`adaptive_basis_error`), which starts at eq. 2's solution and never
increases; (b) small ``(m, n, s)`` where ``delta`` is large: the frequency of
``eps_1 = eps_2`` on the fixed support against ``delta``, and the proof's
free-support construction (:func:`free_support_error`: one kept column becomes a
basis element, the coefficients it frees buy a pruned column one coefficient)
strictly below ``eps_2`` on every draw.

**SP vs IP.** A ResNet-style CNN (:class:`prunopt.train.models.SmallResNet`,
one basic block per stage, width 16) on *cluttered digits*
(:func:`cluttered_digits`: each 8x8 scikit-learn digit at a random place on a
12x12 canvas with two fragments of other digits and noise; harder than the 8x8
digits, which a 3-layer CNN learns to ~98 %), pruned at initialisation (random
and SNIP scores, the paper's Fig. 2(a) and 3) for SP and for IP with one
filter basis per stage ("medium" sharing, as for the paper's CIFAR-10 runs).
The IP run's coefficient sparsity makes its eq. 9 rate (bases counted as
parameters) equal to the SP run's (:func:`prunopt.train.methods.toolkit.equal_rate_sparsity`).
Mean and standard deviation over the seeds, as the paper reports five runs.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

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

__all__ = ["magnitude_error", "adaptive_basis_error", "free_support_error", "fixed_support_delta", "dense_accuracy",
           "cluttered_digits", "sp_ip_pair", "run"]


# --- Theorem 1 ---------------------------------------------------------------
def magnitude_error(u: torch.Tensor, s: int):
    """Eq. 2: error of keeping the ``s`` largest magnitudes, and that mask."""
    mask = torch.zeros(u.numel(), dtype=torch.bool)
    if s > 0:
        mask[u.abs().reshape(-1).topk(s).indices] = True
    mask = mask.reshape(u.shape)
    return float(torch.linalg.norm(u * ~mask)), mask


def _coefficients_on_support(u, f, mask):
    """min_R ||U - F R||_F with supp R in mask: one normal equation per column."""
    fm = mask.T.to(u.dtype)  # (n, m): support of column j
    gram = f.T @ f  # (m, m)
    a = fm[:, :, None] * gram[None] * fm[:, None, :] + torch.diag_embed(1.0 - fm)  # identity off the support
    b = fm * (u.T @ f)  # (n, m) = mask * F^T u_j
    r = torch.linalg.lstsq(a, b[:, :, None]).solution[:, :, 0]
    return (r * fm).T


def adaptive_basis_error(u: torch.Tensor, mask: torch.Tensor, iterations: int = 50):
    """Eq. 1 with ``supp R`` fixed to ``mask``: alternating least squares in ``F``
    and ``R`` from ``F = I, R = U * mask``. Returns the smallest error and the
    error after every iteration (non-increasing up to rounding)."""
    m = u.shape[0]
    f = torch.eye(m, dtype=u.dtype)
    r = u * mask
    history = [float(torch.linalg.norm(u - f @ r))]
    for _ in range(iterations):
        f = torch.linalg.lstsq(r.T, u.T, driver="gelsd").solution.T  # min_F ||U - F R||
        r = _coefficients_on_support(u, f, mask)
        history.append(float(torch.linalg.norm(u - f @ r)))
    return min(history), history


def column_aligned(mask: torch.Tensor) -> bool:
    """Every column of ``mask`` entirely kept or entirely pruned (the only case in
    which the fixed-support adaptive basis cannot beat eq. 2)."""
    return bool(((mask.sum(0) == 0) | (mask.sum(0) == mask.shape[0])).all())


def free_support_error(u: torch.Tensor, mask: torch.Tensor, return_factors: bool = False):
    """The proof's free-support point for a column-aligned eq. 2 solution
    ``mask`` (every column entirely kept or entirely pruned, ``m >= 2``, at least
    one kept and one pruned column) -- the case in which the fixed support
    cannot beat eq. 2. A kept column ``u_j`` replaces the basis vector ``e_i`` of
    its largest entry (``F`` stays invertible), so it needs one coefficient
    instead of ``m``; every other kept column is dense and needs at most ``m`` in
    any basis; the ``m - 1`` freed coefficients go, greedily, to the best single
    coefficients of the pruned columns. Returns ``(||U - F R||_F, ||R||_0)``
    with ``||R||_0 <= mask.sum()`` (and ``F``, ``R`` with ``return_factors``)."""
    if not column_aligned(mask):
        raise ValueError("free_support_error needs a column-aligned mask (every column all kept or all pruned)")
    if u.shape[0] < 2 or not mask.any() or mask.all():
        raise ValueError("free_support_error needs m >= 2, a kept column and a pruned column")
    m, n = u.shape
    j = int(torch.argmax(mask.sum(0)))  # a kept column
    i = int(torch.argmax(u[:, j].abs()))
    uj = u[:, j]
    f = torch.eye(m, dtype=u.dtype)
    f[:, i] = uj
    finv = torch.linalg.inv(f)
    target = u * mask  # what eq. 2 represents, column by column
    r = finv @ target
    r[:, j] = 0.0
    r[i, j] = 1.0
    r = torch.where(r.abs() < 1e-12 * (1 + target.abs().max()), torch.zeros_like(r), r)
    used = int((r != 0).sum())
    budget = int(mask.sum())
    # spend the freed coefficients, one at a time, on the best single (basis vector, column) pair
    resid = u - f @ r
    fnorm2 = (f * f).sum(0)  # ||f_t||^2
    while used < budget:
        gain = (f.T @ resid) ** 2 / fnorm2[:, None]  # error decrease of one new coefficient R[t, q]
        gain = torch.where(r == 0, gain, torch.zeros_like(gain))
        t, q = divmod(int(torch.argmax(gain)), n)
        if gain[t, q] <= 0:
            break
        c = float(f[:, t] @ resid[:, q] / fnorm2[t])
        r[t, q] = c
        resid[:, q] -= c * f[:, t]
        used += 1
    err, nnz = float(torch.linalg.norm(u - f @ r)), int((r != 0).sum())
    return (err, nnz, f, r) if return_factors else (err, nnz)


def fixed_support_delta(m: int, n: int, s: int) -> float:
    """``delta`` of Theorem 1 / eq. A.85: ``C(n, s/m) / C(mn, s)`` when ``m``
    divides ``s`` (all ``s``-subsets of the ``mn`` i.i.d. magnitudes are equally
    likely to be the top ``s``; ``C(n, s/m)`` of them are whole columns), else 0."""
    if s % m:
        return 0.0
    lg = math.lgamma
    log_num = lg(n + 1) - lg(s // m + 1) - lg(n - s // m + 1)
    log_den = lg(m * n + 1) - lg(s + 1) - lg(m * n - s + 1)
    return math.exp(log_num - log_den)


def theorem_fixed(m: int, n: int, sparsities: Sequence[float], draws: int, iterations: int, seed: int):
    """Per sparsity: draws with ``eps_1 < eps_2`` strictly (relative 1e-9), the
    largest ``eps_1/eps_2`` and the mean, for the fixed support."""
    rows = []
    for p in sparsities:
        s = int(round((1 - p) * m * n))
        ratios = []
        for d in range(draws):
            g = torch.Generator().manual_seed(seed * 100_003 + d * 101 + s)
            u = torch.randn(m, n, generator=g, dtype=torch.float64)
            eps2, mask = magnitude_error(u, s)
            eps1, _ = adaptive_basis_error(u, mask, iterations)
            ratios.append(eps1 / eps2)
        rows.append({"p": p, "s": s, "delta": fixed_support_delta(m, n, s), "draws": draws,
                     "strict": sum(r < 1 - 1e-9 for r in ratios), "max_ratio": max(ratios),
                     "mean_ratio": sum(ratios) / draws})
    return rows


def theorem_small(cases: Sequence[Tuple[int, int, int]], draws: int, iterations: int, seed: int):
    """Small ``(m, n, s)`` with a large ``delta``: per case the draws whose
    fixed-support error equals ``eps_2`` (and whether exactly those are column
    aligned), and the draws whose free-support construction is strictly below
    ``eps_2``."""
    out = []
    for m, n, s in cases:
        equal = aligned = agree = free_strict = 0
        worst_free = 0.0
        for d in range(draws):
            g = torch.Generator().manual_seed(seed * 100_003 + d * 7 + 1000 * m + 100 * n + s)
            u = torch.randn(m, n, generator=g, dtype=torch.float64)
            eps2, mask = magnitude_error(u, s)
            eps1, _ = adaptive_basis_error(u, mask, iterations)
            eq = eps1 >= eps2 * (1 - 1e-9)
            al = column_aligned(mask)
            equal += eq
            aligned += al
            agree += eq == al
            # free support: the fixed-support point where it is strict, the proof's construction where not
            free = eps1 if not eq else free_support_error(u, mask)[0]
            free_strict += free < eps2 * (1 - 1e-9)
            worst_free = max(worst_free, free / eps2)
        delta = fixed_support_delta(m, n, s)
        half = 3.29 * math.sqrt(max(delta * (1 - delta), 1e-12) / draws)  # 99.9 % normal interval
        out.append({"m": m, "n": n, "s": s, "delta": delta, "draws": draws, "equal": equal, "aligned": aligned,
                    "equal_iff_aligned": agree, "free_strict": free_strict, "worst_free_ratio": worst_free,
                    "delta_interval": [max(0.0, delta - half), delta + half]})
    return out


# --- SP vs IP ------------------------------------------------------------------
class Dataset:
    """Train/test tensors (``(N, 1, H, W)`` float32, labels long)."""

    def __init__(self, x_train, y_train, x_test, y_test, num_classes: int = 10):
        self.x_train, self.y_train, self.x_test, self.y_test = x_train, y_train, x_test, y_test
        self.num_classes = num_classes


def cluttered_digits(seed: int = 0, canvas: int = 16, train_copies: int = 2, test_copies: int = 1,
                     clutter: int = 3, noise: float = 0.15, limit: Optional[int] = None) -> Dataset:
    """scikit-learn's 8x8 digits made harder: each digit at a uniformly random
    position on a ``canvas x canvas`` image, with ``clutter`` random 4x4
    fragments of other digits at random positions (pixelwise maximum) and
    Gaussian noise of standard deviation ``noise``, clipped to [0, 1]. The digits
    are split 70:30 first, so no test image shares a digit with a training
    image; every training digit appears ``train_copies`` times (at different
    places), every test digit ``test_copies`` times. Deterministic in ``seed``;
    ``limit`` keeps the first ``limit`` digits (quick runs)."""
    from sklearn.datasets import load_digits

    if canvas < 8:
        raise ValueError(f"canvas must be >= 8, got {canvas}")
    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(labels), generator=g)
    if limit is not None:
        perm = perm[:limit]
    n_test = max(1, int(round(0.3 * len(perm))))
    test_idx, train_idx = perm[:n_test], perm[n_test:]

    def make(idx, copies):
        xs, ys = [], []
        for _ in range(copies):
            for k in idx.tolist():
                img = torch.zeros(canvas, canvas)
                for _c in range(clutter):
                    other = images[int(torch.randint(len(labels), (1,), generator=g))]
                    oy, ox = (int(v) for v in torch.randint(0, 5, (2,), generator=g))
                    py, px = (int(v) for v in torch.randint(0, canvas - 3, (2,), generator=g))
                    img[py:py + 4, px:px + 4] = torch.maximum(img[py:py + 4, px:px + 4], other[oy:oy + 4, ox:ox + 4])
                py, px = (int(v) for v in torch.randint(0, canvas - 7, (2,), generator=g))
                img[py:py + 8, px:px + 8] = torch.maximum(img[py:py + 8, px:px + 8], images[k])
                img += noise * torch.randn(canvas, canvas, generator=g)
                xs.append(img.clamp_(0.0, 1.0))
                ys.append(labels[k])
        return torch.stack(xs).unsqueeze(1), torch.stack(ys)

    x_tr, y_tr = make(train_idx, train_copies)
    x_te, y_te = make(test_idx, test_copies)
    return Dataset(x_tr, y_tr, x_te, y_te)


def _stage_key(name: str, conv: nn.Conv2d):
    """Medium sharing: one basis per stage (the convolutions of one width)."""
    return conv.out_channels


def build_model(space: str, seed: int, width: int = 16) -> nn.Module:
    """SmallResNet (one basic block per stage) seeded by ``seed``; IP converts
    its 3x3 convolutions to filter-basis form with one basis per stage."""
    from prunopt.nn import to_interspace
    from prunopt.train.models import SmallResNet

    torch.manual_seed(seed)
    model = SmallResNet(10, width=width, in_channels=1, blocks=(1, 1))
    if space == "interspace":
        to_interspace(model, sharing=_stage_key, init="standard", generator=torch.Generator().manual_seed(seed + 1))
    return model


def basis_entries(model: nn.Module) -> int:
    """Entries of the distinct filter bases (a trained basis is dense)."""
    return sum({id(m.basis.weight): m.basis.weight.numel() for m in model.modules() if hasattr(m, "basis")}.values())


def _optimizer(model, epochs: int, lr: float):
    """SGD (momentum 0.9, weight decay 5e-4 on everything but the bases, App.
    B.3) and a cosine learning rate over ``epochs``."""
    bases = {id(m.basis.weight) for m in model.modules() if hasattr(m, "basis")}
    groups = [dict(params=[p for p in model.parameters() if id(p) not in bases], weight_decay=5e-4)]
    if bases:
        groups.append(dict(params=[p for p in model.parameters() if id(p) in bases], weight_decay=0.0))
    opt = torch.optim.SGD(groups, lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs))
    return opt, sched


def sp_ip_pair(data: Dataset, score: str, p: float, seed: int, epochs: int, lr: float = 0.05,
               batch_size: int = 64, width: int = 16, score_batches: int = 10) -> Dict[str, object]:
    """One seed at one target rate: SP pruned at initialisation to ``p``
    (``score`` in ``random``, ``snip``), and IP with the coefficient sparsity
    whose eq. 9 rate equals SP's. Returns both accuracies and rates (IP's are
    ``None`` when the bases alone exceed SP's budget)."""
    from prunopt.pruning import Masker, PruningAtInit, pruning_rates
    from prunopt.train.loop import evaluate, iterate_minibatches, train_epoch
    from prunopt.train.methods.toolkit import equal_rate_sparsity

    out: Dict[str, object] = {"seed": seed, "target": p}
    q = None
    for space in ("standard", "interspace"):
        model = build_model(space, seed, width)
        if space == "interspace":
            q = equal_rate_sparsity(out["p_sp"], pruning_rates(model)["D"], basis_entries(model))
            out["ip_coefficient_sparsity"] = q
            if q is None:
                out.update(p_ip=None, ip_acc=None, ip_train_acc=None)
                break
        opt, sched = _optimizer(model, epochs, lr)
        masker = Masker(model, opt)
        gen = torch.Generator().manual_seed(seed)
        pai = PruningAtInit(masker, score, p if space == "standard" else q,
                            generator=torch.Generator().manual_seed(seed))
        batches = list(iterate_minibatches(data.x_train, data.y_train, batch_size, gen))[:score_batches]
        pai.prune(batches=batches, example_input=data.x_train[:1])
        for _ in range(epochs):
            train_epoch(model, opt, data.x_train, data.y_train, batch_size, gen, after_step=pai.step)
            sched.step()
        rates = pruning_rates(masker)
        key = "sp" if space == "standard" else "ip"
        out[f"p_{key}"] = rates["p_sp"] if key == "sp" else rates["p_ip"]
        out[f"{key}_acc"] = evaluate(model, data.x_test, data.y_test)
        out[f"{key}_train_acc"] = evaluate(model, data.x_train, data.y_train)
    return out


def dense_accuracy(data: Dataset, seed: int, epochs: int, lr: float = 0.05, batch_size: int = 64,
                   width: int = 16) -> float:
    """The unpruned standard network trained with the same schedule."""
    from prunopt.train.loop import evaluate, train_epoch

    model = build_model("standard", seed, width)
    opt, sched = _optimizer(model, epochs, lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        train_epoch(model, opt, data.x_train, data.y_train, batch_size, gen)
        sched.step()
    return evaluate(model, data.x_test, data.y_test)


# --- report ----------------------------------------------------------------------
SETTINGS = {
    "full": dict(fixed_n=100, fixed_draws=40, fixed_sparsities=[0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99], als_iters=40,
                 small_draws=2000, small_als_iters=3, scores=["random", "snip"], rates=[0.9, 0.95], epochs=10,
                 seeds=5, limit=None, train_copies=2),
    "quick": dict(fixed_n=100, fixed_draws=5, fixed_sparsities=[0.3, 0.9, 0.99], als_iters=15, small_draws=300,
                  small_als_iters=3, scores=["random"], rates=[0.9], epochs=8, seeds=1, limit=None, train_copies=1),
    "tiny": dict(fixed_n=20, fixed_draws=2, fixed_sparsities=[0.5, 0.9], als_iters=4, small_draws=30,
                 small_als_iters=2, scores=["random"], rates=[0.9], epochs=1, seeds=1, limit=100, train_copies=1),
}
#: the cluttered-digits task of the SP vs IP comparison
DATA = dict(canvas=12, clutter=2, noise=0.1)
SMALL_CASES = [(2, 2, 2), (2, 3, 2), (3, 2, 3), (2, 4, 4)]


def _verdict(ok: bool, partial: bool = False) -> str:
    return "reproduced" if ok else "qualitatively" if partial else "not reproduced"


def build_report(res: dict, command: str, seeds: List[int], threads: int, settings: dict) -> Report:
    rep = Report("interspace", "Interspace Pruning (Wimmer, Mehnert, Condurache, arXiv:2203.07808): Theorem 1 and SP "
                 "vs IP at equal pruning rate", command, seeds, threads,
                 {k: settings[k] for k in ("fixed_draws", "small_draws", "epochs", "rates", "scores")})
    if "fixed" in res:
        _theorem_claims(rep, res, settings)
    _training_claims(rep, res, settings)
    return rep


def _theorem_claims(rep: Report, res: dict, settings: dict) -> None:
    fixed, small = res["fixed"], res["small"]
    strict = sum(r["strict"] for r in fixed)
    draws = sum(r["draws"] for r in fixed)
    worst = max(r["max_ratio"] for r in fixed)
    n = settings["fixed_n"]
    rep.claim(f"Theorem 1, fixed support: eps_1 < eps_2 with P >= 1 - delta (m = 9, n = {n}, delta numerically 0)",
              "strict on every draw", f"strict on {strict}/{draws} draws ({len(fixed)} sparsities); "
              f"largest eps_1/eps_2 = {worst:.6f}", _verdict(strict == draws),
              "eps_1 from alternating least squares on eq. 2's support (an upper bound on the infimum)")
    ok_delta = all(c["delta_interval"][0] <= c["equal"] / c["draws"] <= c["delta_interval"][1] for c in small)
    iff = all(c["equal_iff_aligned"] == c["draws"] for c in small)
    rep.claim("Theorem 1, fixed support: eps_1 = eps_2 happens with probability delta = C(n, s/m)/C(mn, s) (s = 0 mod m)",
              ", ".join(f"(m,n,s)=({c['m']},{c['n']},{c['s']}): {c['delta']:.3f}" for c in small),
              ", ".join(f"{c['equal'] / c['draws']:.3f}" for c in small) + f" ({small[0]['draws']} draws each)",
              _verdict(ok_delta and iff),
              "equality on exactly the column-aligned draws: " + ("yes" if iff else "no")
              + "; frequencies inside the 99.9 % interval around delta: " + ("yes" if ok_delta else "no"))
    fs = sum(c["free_strict"] for c in small)
    fd = sum(c["draws"] for c in small)
    rep.claim("Theorem 1, free support: eps_1 < eps_2 with P = 1", "strict on every draw",
              f"strict on {fs}/{fd} draws, including every column-aligned one "
              f"(largest eps_1/eps_2 {max(c['worst_free_ratio'] for c in small):.6f})", _verdict(fs == fd),
              "the proof's construction (a kept column becomes a basis element) where the fixed support cannot help")
    rows = [[f"{r['p']:.2f}", r["s"], f"{r['delta']:.1e}", f"{r['strict']}/{r['draws']}", f"{r['mean_ratio']:.4f}",
             f"{r['max_ratio']:.6f}"] for r in fixed]
    rep.section(f"Theorem 1, fixed support (m = 9, n = {n}, U ~ N(0, 1))",
                markdown_table(["p", "s", "delta", "eps_1 < eps_2", "mean eps_1/eps_2", "largest eps_1/eps_2"], rows))
    rows = [[f"({c['m']}, {c['n']}, {c['s']})", f"{c['delta']:.4f}",
             f"[{c['delta_interval'][0]:.4f}, {c['delta_interval'][1]:.4f}]", f"{c['equal']}/{c['draws']}",
             f"{c['aligned']}/{c['draws']}", f"{c['free_strict']}/{c['draws']}", f"{c['worst_free_ratio']:.6f}"]
            for c in small]
    rep.section("Theorem 1 where delta is large: fixed support against free support",
                markdown_table(["(m, n, s)", "delta", "99.9 % interval", "fixed: eps_1 = eps_2", "column aligned",
                                "free: eps_1 < eps_2", "largest free eps_1/eps_2"], rows))


def _training_claims(rep: Report, res: dict, settings: dict) -> None:
    pairs = res["pairs"]
    for score in [s for s in settings["scores"] if any(r["score"] == s for r in pairs)]:
        for p in settings["rates"]:
            runs = [r for r in pairs if r["score"] == score and r["target"] == p]
            ip_runs = [r for r in runs if r.get("ip_acc") is not None]
            if not runs:
                continue
            if not ip_runs:
                rep.claim(f"IP beats SP at equal eq. 9 rate, {score} PaI, p = {p}", "IP > SP", "no IP network at this "
                          "rate (the bases exceed SP's budget)", "not reproduced")
                continue
            diff = [r["ip_acc"] - r["sp_acc"] for r in ip_runs]
            dm, ds = mean_std(diff)
            wins = sum(d > 0 for d in diff)
            verdict = _verdict(dm > 0 and wins == len(diff), dm > 0 and wins > len(diff) / 2)
            rep.claim(f"IP beats SP at equal eq. 9 rate, {score} PaI, p = {p}",
                      "IP > SP (VGG16 / CIFAR-10, Fig. 2(a), 3; 'for all PaI methods, pruning rates')",
                      f"SP {pm([r['sp_acc'] for r in ip_runs])}, IP {pm([r['ip_acc'] for r in ip_runs])}; "
                      f"IP - SP {dm:+.3f} ± {ds:.3f}, IP better in {wins}/{len(diff)} seeds",
                      verdict, "cluttered digits, SmallResNet; p_IP = p_SP (bases counted)")
    if pairs:
        rows = []
        for score in settings["scores"]:
            for p in settings["rates"]:
                runs = [r for r in pairs if r["score"] == score and r["target"] == p]
                if not runs:
                    continue
                ip_runs = [r for r in runs if r.get("ip_acc") is not None]
                rows.append([score, p, f"{mean_std([r['p_sp'] for r in runs])[0]:.4f}",
                             pm([r["sp_acc"] for r in runs]), pm([r["sp_train_acc"] for r in runs]),
                             f"{mean_std([r['ip_coefficient_sparsity'] for r in ip_runs])[0]:.4f}" if ip_runs else "-",
                             f"{mean_std([r['p_ip'] for r in ip_runs])[0]:.4f}" if ip_runs else "-",
                             pm([r["ip_acc"] for r in ip_runs]) if ip_runs else "-",
                             pm([r["ip_train_acc"] for r in ip_runs]) if ip_runs else "-"])
        dense = [r["acc"] for r in res.get("dense", [])]
        rep.section("SP vs IP at equal eq. 9 rate (cluttered digits, SmallResNet, mean ± std over seeds)",
                    (f"Dense standard network: test accuracy {pm(dense)}.\n\n" if dense else "")
                    + f"Data: {res['data']}.\n\n"
                    + markdown_table(["PaI score", "target p", "p_SP", "SP test acc", "SP train acc",
                                      "IP coefficient sparsity", "p_IP", "IP test acc", "IP train acc"], rows))


def plot(res: dict, settings: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    fixed = res.get("fixed", [])
    ax.plot([r["p"] for r in fixed], [r["mean_ratio"] for r in fixed], "o-", label="mean eps_1 / eps_2 (fixed support)")
    ax.plot([r["p"] for r in fixed], [r["max_ratio"] for r in fixed], "s--", label="largest eps_1 / eps_2")
    ax.axhline(1.0, color="gray", ls=":", label="eps_1 = eps_2 (no gain)")
    ax.set_xlabel("sparsity p")
    ax.set_ylabel("eps_1 / eps_2")
    ax.set_title(f"Theorem 1: adaptive basis / magnitude pruning (m=9, n={settings['fixed_n']})", fontsize=9)
    if fixed:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    pairs = res["pairs"]
    for k, score in enumerate(settings["scores"]):
        for space, marker, key in (("SP", "o", "sp"), ("IP", "s", "ip")):
            pts = []
            for p in settings["rates"]:
                runs = [r for r in pairs if r["score"] == score and r["target"] == p and r.get(f"{key}_acc") is not None]
                if runs:
                    m, s = mean_std([r[f"{key}_acc"] for r in runs])
                    pts.append((mean_std([r[f"p_{key}"] for r in runs])[0], m, s))
            if pts:
                ax.errorbar([a for a, _, _ in pts], [m for _, m, _ in pts], [s for _, _, s in pts], marker=marker,
                            ls="-" if key == "ip" else "--", color=f"C{k}", capsize=3, label=f"{space}, {score} PaI")
    if res.get("dense"):
        ax.axhline(mean_std([r["acc"] for r in res["dense"]])[0], color="gray", ls=":", label="dense")
    ax.set_xlabel("pruning rate p (eq. 9, bases counted)")
    ax.set_ylabel("test accuracy (mean ± std over seeds)")
    ax.set_title("SP vs IP at equal rate: cluttered digits, SmallResNet", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


JOBS = ("theorem", "dense", "random", "snip")


def compute(settings: dict, seeds: List[int], seed: int, jobs: Sequence[str], show_progress: bool) -> dict:
    """The raw results of the ``jobs`` (``theorem``; ``dense``: the dense
    network per seed; a PaI score: the SP/IP pairs at every rate per seed)."""
    from prunopt.train.loop import progress

    jobs = [j for j in jobs if j in ("theorem", "dense") or j in settings["scores"]]
    res: Dict[str, object] = {"settings": settings, "jobs": jobs}
    if "theorem" in jobs:
        res["fixed"] = theorem_fixed(9, settings["fixed_n"], settings["fixed_sparsities"], settings["fixed_draws"],
                                     settings["als_iters"], seed)
        res["small"] = theorem_small(SMALL_CASES, settings["small_draws"], settings["small_als_iters"], seed)
    scores = [s for s in settings["scores"] if s in jobs]
    res["pairs"], res["dense"] = [], []
    if not scores and "dense" not in jobs:
        return res
    data = cluttered_digits(0, train_copies=settings["train_copies"], limit=settings["limit"], **DATA)
    res["data"] = (f"cluttered digits (data seed 0; {DATA['canvas']}x{DATA['canvas']} canvas, {DATA['clutter']} "
                   f"fragments, noise {DATA['noise']}), {len(data.y_train)} training / {len(data.y_test)} test "
                   f"images, {settings['epochs']} epochs, SGD lr 0.05 cosine, batch 64")
    todo = [("dense", None, s) for s in seeds if "dense" in jobs]
    todo += [(score, p, s) for score in scores for p in settings["rates"] for s in seeds]
    for score, p, s in progress(todo, "interspace SP vs IP", show_progress):
        if score == "dense":
            res["dense"].append({"seed": s, "acc": dense_accuracy(data, s, settings["epochs"])})
        else:
            res["pairs"].append({"score": score, **sp_ip_pair(data, score, p, s, settings["epochs"])})
    return res


def merge(parts: Sequence[dict]) -> dict:
    """Combines pieces: the theorem from the piece that ran it, the dense runs
    and the pairs of every piece (settings must agree)."""
    from prunopt.repro.report import same_setting

    settings = same_setting(parts, "settings")
    res: Dict[str, object] = {"settings": settings, "jobs": sorted({j for p in parts for j in p["data"]["jobs"]}),
                              "pairs": [], "dense": []}
    for p in parts:
        d = p["data"]
        for key in ("fixed", "small", "data"):
            if key in d and key not in res:
                res[key] = d[key]
        res["pairs"] += d["pairs"]
        res["dense"] += d["dense"]
    res["pairs"].sort(key=lambda r: (settings["scores"].index(r["score"]), r["target"], r["seed"]))
    res["dense"].sort(key=lambda r: r["seed"])
    keys = [(r["score"], r["target"], r["seed"]) for r in res["pairs"]] + [("dense", r["seed"]) for r in res["dense"]]
    if len(set(keys)) != len(keys):
        raise ValueError("--merge: the parts overlap (a seed was run twice)")
    return res


def run(args) -> None:
    from prunopt.repro.report import load_parts, pieces_section

    if getattr(args, "merge", None):
        parts = load_parts(args.merge, "interspace")
        res = merge(parts)
        wall = sum(p["wall_s"] for p in parts)
        command = repro_command(args, "interspace") + f" --merge {args.merge}"
    else:
        jobs = [j.strip() for j in (args.interspace_jobs or ",".join(JOBS)).split(",") if j.strip()]
        bad = [j for j in jobs if j not in JOBS]
        if bad or not jobs:
            raise ValueError(f"--interspace-jobs: unknown job(s) {bad}; expected a subset of {list(JOBS)}")
        settings = dict(SETTINGS[scale(args)])
        seeds = seeds_from(args, settings["seeds"])
        command = repro_command(args, "interspace", ["interspace_jobs"])
        with deterministic(args.threads), Timer() as t:
            res = compute(settings, seeds, args.seed, jobs, args.progress)
        wall = t.seconds
    settings = res["settings"]
    seeds = sorted({r["seed"] for r in res["pairs"]} | {r["seed"] for r in res["dense"]}) or [args.seed]
    rep = build_report(res, command, seeds, args.threads, settings)
    rep.wall_s = wall
    if getattr(args, "merge", None):
        pieces_section(rep, parts)
    rep.data = res
    rep.write(args.out, {"interspace.png": lambda path: plot(res, settings, path)})


def add_arguments(parser) -> None:
    g = parser.add_argument_group("interspace")
    g.add_argument("--interspace-jobs", default=None,
                   help=f"interspace: comma-separated subset of {','.join(JOBS)} (default all; for runs in pieces, "
                        "combined with --merge)")


register_repro("interspace", run, "Interspace Pruning: Theorem 1 (fixed and free support) and SP vs IP at equal "
               "eq. 9 rate", add_arguments)
