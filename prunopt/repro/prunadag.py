"""``prunopt repro prunadag``: the prunAdag paper's random least-squares problems
A1-A6 (section 3.1, Table 2) and logistic regression (section 3.4, Table 4).

Least squares: ``f(x) = ||Ax - b||^2 / 2`` (eq. 3.2), ``m = 100``, ``n = 1000``,
``x* ~ N(0, 1)``, ``b = A x*``, ``T = n/10``, ``ς = 0.01``, ``lr = 1``,
``eps = 0``, a start with exactly ``T`` random non-zeros of unit norm, stop at
``||g|| <= 1e-9`` or the iteration limit; ``rho = ||g(x_pruned)||`` (eq. 3.1)
for ``sigma`` = 10..90% pruned, averaged over the runs. FW1: ``tau = 50``; FW2:
``tau = 100``, ``beta = 0.001`` (section 3.1.4).

Matrices (the paper cites Wen et al. and Porcelli-Rinaldi without formulas;
for ``m < n`` "orthogonal columns" cannot hold exactly, so these are our
readings, see docs/prunadag.md): A1 Gaussian; A2 ``m`` rows of a random
orthogonal ``n x n`` matrix (orthonormal rows); A3 Gaussian with unit-norm
columns; A4 orthogonal rows of random lengths in [0.5, 2]; A5 symmetric Bernoulli +-1;
A6 ``m`` random rows of the orthonormal DCT-II matrix of size ``n``.

Logistic regression (eq. 3.4, labels in {-1, +1}, no intercept): scikit-learn's
digits (even vs odd) and breast cancer, min-max normalised, 70:30 split, 2000
iterations, ``T = ceil(n/10)``; FW1 ``tau = 10``, FW2 ``tau = 100``, ``beta = 0.5``.
Test accuracy after pruning 65..95% of the weights.

The runs of one problem are solved together as the rows of one ``(runs, n)``
float64 problem (:func:`solve_batched`; per-run top-T set, ratio and stopping),
which makes the paper's setting (20 runs, 10^4 iterations) affordable; each row
reproduces the library optimizer (:func:`solve`) run alone. Problems can be run
in separate processes (``--prunadag-problems``) and merged (``--prunadag-merge``).
"""
from __future__ import annotations

import json
import math
import os
import time

import torch

from prunopt.optim import SFW, PrunAdag
from prunopt.pruning.magnitude import magnitude_masks
from prunopt.repro import register_repro

METHODS = ["V1", "V2", "V3", "V4", "FW1", "FW2", "Adagrad"]
PROBLEMS = ["A1", "A2", "A3", "A4", "A5", "A6"]
SIGMAS = [10, 20, 30, 40, 50, 60, 70, 80, 90]
LOGREG_SIGMAS = [65, 70, 75, 80, 85, 90, 95]

#: Table 2 of the paper (rho, averaged over 20 runs), for the side-by-side print.
PAPER_TABLE2 = {
    "A1": {10: [2.2e-5, 1.39, 9.4e-10, 0.88, 6.34, 8.92, 670], 20: [0.01, 1.39, 9.7e-10, 0.88, 6.34, 25.67, 1.7e3],
           30: [0.21, 1.38, 5.2e-4, 0.88, 6.34, 47.2, 3.0e3], 40: [1.69, 1.36, 0.17, 0.88, 6.43, 79.1, 4.4e3],
           50: [12.9, 1.35, 9.73, 0.89, 7.52, 109, 6.0e3]},
    "A2": {20: [8.7e-4, 8.2e-4, 5.9e-6, 1.1e-3, 4.5e-3, 0.39, 0.61], 40: [0.02, 8.2e-4, 6.0e-6, 1.1e-3, 5.4e-3, 0.40, 1.72],
           60: [0.20, 0.12, 5.3e-3, 2.2e-3, 0.03, 0.42, 3.57], 70: [0.63, 0.57, 0.15, 0.21, 0.14, 0.44, 4.90],
           80: [1.62, 1.67, 0.67, 1.06, 0.60, 0.49, 6.43]},
    "A3": {20: [4.1e-3, 0.02, 9.7e-10, 9.7e-3, 0.06, 0.09, 6.29], 30: [0.12, 0.02, 9.7e-10, 9.7e-3, 0.06, 0.44, 29.7],
           40: [0.38, 0.02, 3.4e-5, 9.7e-3, 0.06, 0.70, 44.1], 50: [1.19, 0.01, 0.03, 9.8e-3, 0.08, 1.00, 60.1],
           60: [3.57, 0.33, 0.50, 0.23, 0.22, 1.38, 76.7]},
    "A4": {20: [6.1e-4, 8.8e-4, 4.2e-8, 9.7e-4, 4.5e-3, 0.38, 0.65], 30: [4.1e-3, 8.8e-4, 4.2e-8, 9.7e-4, 4.6e-3, 0.38, 1.13],
           50: [0.06, 6.9e-3, 7.5e-6, 9.7e-4, 0.01, 0.39, 2.65], 70: [0.65, 0.57, 0.13, 0.22, 0.14, 0.42, 5.12],
           90: [3.98, 4.10, 2.51, 3.34, 2.53, 1.91, 8.43]},
    "A5": {10: [3.7e-4, 1.58, 9.5e-10, 0.88, 6.34, 8.96, 648], 20: [0.03, 1.58, 9.5e-10, 0.88, 6.35, 25.4, 1.7e3],
           30: [0.34, 1.57, 6.5e-4, 0.88, 6.35, 47.6, 3.0e3], 40: [2.41, 1.54, 0.12, 0.88, 6.47, 77.0, 4.4e3],
           50: [14.6, 1.49, 7.64, 0.89, 8.21, 113, 6.0e3]},
    "A6": {10: [2.2e-3, 4.3e-4, 3.0e-3, 3.6e-4, 6.4e-3, 1.40, 0.20], 30: [0.11, 0.13, 0.29, 0.10, 0.02, 1.40, 1.34],
           50: [0.64, 0.80, 1.01, 0.73, 0.35, 1.41, 3.15], 60: [1.23, 1.47, 1.60, 1.40, 0.91, 1.42, 4.2],
           70: [2.2, 2.5, 2.4, 2.4, 1.89, 1.44, 5.33]},
}


def make_matrix(name: str, m: int, n: int, g: torch.Generator) -> torch.Tensor:
    """The test matrices A1-A6 (float64); see the module docstring for the readings."""
    if name == "A1":
        return torch.randn(m, n, generator=g, dtype=torch.float64)
    if name in ("A2", "A4"):
        q, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
        a = q.t().contiguous()  # orthonormal rows
        if name == "A4":
            a = a * (0.5 + 1.5 * torch.rand(m, 1, generator=g, dtype=torch.float64))
        return a
    if name == "A3":
        a = torch.randn(m, n, generator=g, dtype=torch.float64)
        return a / a.norm(dim=0, keepdim=True)
    if name == "A5":
        # symmetric Bernoulli (+-1): the paper's A5 column is nearly identical to
        # its Gaussian A1 column, which a {0, 1} matrix (a large rank-one mean
        # part) does not reproduce with lr = 1
        return (torch.rand(m, n, generator=g, dtype=torch.float64) < 0.5).double() * 2 - 1
    if name == "A6":
        k = torch.arange(n, dtype=torch.float64)
        dct = torch.cos(math.pi / n * (k[None, :] + 0.5) * k[:, None]) * math.sqrt(2.0 / n)
        dct[0] /= math.sqrt(2.0)
        rows = torch.randperm(n, generator=g)[:m]
        return dct[rows].contiguous()
    raise ValueError(f"unknown problem {name!r}; expected one of {PROBLEMS}")


def sparse_start(n: int, T: int, g: torch.Generator) -> torch.Tensor:
    """A start with exactly T random non-zeros and unit norm (section 3)."""
    x = torch.zeros(n, dtype=torch.float64)
    idx = torch.randperm(n, generator=g)[:T]
    x[idx] = torch.randn(T, generator=g, dtype=torch.float64)
    return x / x.norm()


def make_optimizer(method: str, x: torch.Tensor, T: int, fw=(50.0, 100.0, 0.001)):
    if method.startswith("V"):
        return PrunAdag([x], lr=1.0, relevant=T, version=int(method[1]), eps=0.0, initial_accumulator_value=0.01)
    if method == "FW1":
        return SFW([x], lr=1.0, rescale="fw1", radius=fw[0], relevant=T)
    if method == "FW2":
        return SFW([x], lr=fw[2], rescale="fw2", radius=fw[1], relevant=T)
    if method == "Adagrad":
        return torch.optim.Adagrad([x], lr=1.0, eps=0.0, initial_accumulator_value=0.01)
    raise ValueError(f"unknown method {method!r}")


def solve(grad_fn, x0: torch.Tensor, method: str, T: int, iters: int, tol: float, fw) -> torch.Tensor:
    """One run with the library optimizers (:class:`PrunAdag`, :class:`SFW`,
    ``torch.optim.Adagrad``): at most ``iters`` steps, stopping before a step
    when ``||g|| <= tol`` (``tol = 0``: never). The oracle of :func:`solve_batched`."""
    x = x0.clone().requires_grad_(False)
    opt = make_optimizer(method, x, T, fw)
    for _ in range(iters):
        g = grad_fn(x)
        if tol > 0 and float(g.norm()) <= tol:
            break
        x.grad = g
        opt.step()
    return x.detach()


# --- batched runs --------------------------------------------------------------
# The paper's 20 runs of one problem are independent; on this scale (n = 1000)
# one optimizer step is dominated by Python overhead, so the runs are stacked as
# the rows of a (B, n) float64 problem and every quantity of Algorithm 2.1 that
# the paper takes over "the" parameter vector -- the top-T set (eq. 2.6), the
# ratio r = ||g||_R / ||x||_M (Table 1, Porcelli et al.), ||g||_R of the LMO
# (eq. 1.2), FW2's ||v - x|| -- is taken per row. The element arithmetic is that
# of prunopt.reference.prunadag / prunopt.optim.sfw / torch.optim.Adagrad, op for
# op, so one row reproduces the library optimizer (tests/repro/test_prunadag_repro.py).


def _row_relevant(g: torch.Tensor, T: int) -> torch.Tensor:
    """Per row, ``R = {i : |g_i| >= tau}`` with ``tau`` the T-th largest ``|g_i|``
    of the row (ties at ``tau`` are all relevant, eq. 2.6 / Porcelli et al.)."""
    ag = g.abs()
    if T >= g.shape[1]:
        return torch.ones_like(ag, dtype=torch.bool)
    tau = torch.topk(ag, T, dim=1, sorted=False).values.amin(1, keepdim=True)  # = kthvalue(n - T + 1)
    return ag >= tau


def batched_prunadag_step(x, g, opt_sum, dec_sum, k: int, T: int, version, lr: float = 1.0, eps: float = 0.0):
    """One prunAdag step (Algorithm 2.1, Porcelli et al.) on every row of ``x``
    (``(B, n)``): row ``b`` is the whole parameter vector of run ``b`` (its own
    top-T set and ratio ``r``). ``k`` is the step counter shared by the rows.
    Returns the new ``(x, opt_sum, dec_sum)``; the inputs are not modified."""
    rel = _row_relevant(g, T)
    m = x * g > 0
    m &= ~rel  # sign-matched irrelevant set M (strict: a zero never matches)
    g2 = g * g
    x2 = x * x
    g_r = (g2 * rel).sum(1, keepdim=True)  # ||g||_R^2 (float64)
    x_m = (x2 * m).sum(1, keepdim=True)  # ||x||_M^2
    ratio = torch.where(x_m > 0, g_r.sqrt() / torch.where(x_m > 0, x_m, torch.ones_like(x_m)).sqrt(), torch.zeros_like(x_m))
    so_new = opt_sum + g2  # eq. 2.7
    std = so_new.sqrt()
    if eps:
        std += eps
    s_opt = torch.div(g, std).mul_(-lr)  # eq. 2.9
    base = lr / (k + 1.0)
    ax = x.abs()
    a = ax * base if version in (2, 4) else ax * (base * ratio)  # Table 1
    if version == "relevant_only":
        opt = rel
    else:
        s_abs = s_opt.abs()
        opt = a <= s_abs  # eq. 2.8: A = {i in M : a_i <= |s_i| <= b_i}
        opt &= m
        if version in (3, 4):
            opt &= s_abs <= ax
        opt |= rel  # O = R u A
    sd_new = dec_sum + x2  # eq. 2.10
    sd_root = sd_new.sqrt()
    if eps:
        sd_root += eps
    s_l = (ax * lr).div_(sd_root)
    # eq. 2.16: on D ∩ M shrink by min(a, |s^L|) towards 0; elsewhere in D no step
    x_dec = torch.where(m, x - torch.minimum(a, s_l).mul_(torch.sign(x)), x)
    return (torch.where(opt, x + s_opt, x_dec), torch.where(opt, so_new, opt_sum), torch.where(opt, dec_sum, sd_new))


def batched_sfw_step(x, g, k: int, T: int, radius: float, step_rule: str, beta: float):
    """One Frank-Wolfe step (eq. 1.2-1.3, :class:`prunopt.optim.SFW` without
    momentum) on every row of ``x``; returns the new ``x``."""
    rel = _row_relevant(g, T)
    g_r = (g * g * rel).sum(1, keepdim=True).sqrt()
    pos = g_r > 0
    v = torch.where(rel & pos, g * (-radius / torch.where(pos, g_r, torch.ones_like(g_r))), torch.zeros_like(g))  # eq. 1.2
    d = v - x
    if step_rule == "fw1":
        return x + d * (1.0 / (k + 1.0))  # eq. 1.3
    dist = (d * d).sum(1, keepdim=True).sqrt()
    eta = torch.where(dist > 0, torch.clamp_max(beta * g_r / torch.where(dist > 0, dist, torch.ones_like(dist)), 1.0),
                      torch.zeros_like(dist))
    return x + d * eta  # eq. 1.3


def batched_adagrad_step(x, g, opt_sum, lr: float = 1.0, eps: float = 0.0):
    """``torch.optim.Adagrad``'s step (no decay) on every row; returns the new
    ``(x, opt_sum)``."""
    so = opt_sum + g * g
    std = so.sqrt()
    if eps:
        std += eps
    return x - torch.div(g, std).mul_(lr), so


def solve_batched(grad_fn, x0: torch.Tensor, method: str, T: int, iters: int, tol: float, fw):
    """Runs ``method`` on every row of ``x0`` (``(B, n)``, the start of each run)
    for at most ``iters`` steps. ``grad_fn(X)`` returns the ``(B, n)`` gradients.
    Row ``b`` stops, for good, before the first step at which its ``||g|| <= tol``
    (``tol = 0``: never) -- the per-run stopping rule of section 3; a stopped row
    keeps its iterate and accumulators unchanged while the others go on.

    Returns ``(x, steps)``: the final iterates and the number of steps each row took.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if x0.dim() != 2 or x0.dtype != torch.float64:
        raise ValueError(f"x0 must be a (runs, n) float64 tensor, got {tuple(x0.shape)} {x0.dtype}")
    x = x0.detach().clone()
    B = x.shape[0]
    opt_sum = torch.full_like(x, 0.01)  # ς = 0.01 (eq. 2.15)
    dec_sum = torch.full_like(x, 0.01)
    active = torch.ones(B, 1, dtype=torch.bool, device=x.device)
    steps = torch.zeros(B, dtype=torch.long)
    all_active = True
    for k in range(iters):
        g = grad_fn(x)
        if tol > 0:
            active &= g.norm(dim=1, keepdim=True) > tol
            if not bool(active.any()):
                break
            all_active = bool(active.all())
        if method.startswith("V"):
            new = batched_prunadag_step(x, g, opt_sum, dec_sum, k, T, int(method[1]), lr=1.0, eps=0.0)
        elif method == "Adagrad":
            new = batched_adagrad_step(x, g, opt_sum, lr=1.0, eps=0.0) + (dec_sum,)
        else:
            radius = fw[0] if method == "FW1" else fw[1]
            new = (batched_sfw_step(x, g, k, T, radius, method.lower(), fw[2]), opt_sum, dec_sum)
        if all_active:
            x, opt_sum, dec_sum = new
        else:  # a stopped run stops changing
            x, opt_sum, dec_sum = (torch.where(active, nw, old) for nw, old in zip(new, (x, opt_sum, dec_sum)))
        steps += active.view(-1)
    return x, steps


def _row_prune(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Each row magnitude-pruned to the fraction ``sigma`` (the paper prunes each
    run's solution on its own)."""
    return torch.stack([row * magnitude_masks(row, sigma=sigma)[0] for row in x])


def least_squares_problems(problem: str, runs: int, seed: int, m: int = 100, n: int = 1000):
    """The ``runs`` instances of one problem, stacked: ``A`` ``(runs, m, n)``,
    ``b`` ``(runs, m)``, starts ``x0`` ``(runs, n)``. Run ``r`` draws its matrix,
    ``x* ~ N(0, 1)`` and its start from its own generator."""
    T = n // 10
    As, bs, x0s = [], [], []
    for r in range(runs):
        g = torch.Generator().manual_seed(seed * 1000 + r * 17 + PROBLEMS.index(problem))
        A = make_matrix(problem, m, n, g)
        As.append(A)
        bs.append(A @ torch.randn(n, generator=g, dtype=torch.float64))
        x0s.append(sparse_start(n, T, g))
    return torch.stack(As), torch.stack(bs), torch.stack(x0s)


def least_squares(runs: int, iters: int, seed: int, show_progress: bool, problems=PROBLEMS, m: int = 100, n: int = 1000):
    """Mean rho per (problem, method, sigma), and per (problem, method) the mean
    final ``||g||``, how many runs met ``||g|| <= 1e-9`` and their mean step count."""
    from prunopt.train.loop import progress

    T = n // 10
    out = {p: {meth: {s: 0.0 for s in SIGMAS} for meth in METHODS} for p in problems}
    conv = {p: {} for p in problems}
    jobs = [(p, meth) for p in problems for meth in METHODS]
    cache = {}
    for p, meth in progress(jobs, "prunadag least squares", show_progress):
        if p not in cache:
            cache.clear()
            cache[p] = least_squares_problems(p, runs, seed, m, n)
        A, b, x0 = cache[p]
        At = A.transpose(1, 2)
        b = b.unsqueeze(1)

        def grad(x):  # g = A^T (A x - b), every run at once (row-vector products: the fast bmm layout)
            return torch.bmm(torch.bmm(x.unsqueeze(1), At) - b, A).squeeze(1)

        x, steps = solve_batched(grad, x0, meth, T, iters, 1e-9, (50.0, 100.0, 0.001))
        gn = grad(x).norm(dim=1)
        conv[p][meth] = {"grad_norm": float(gn.mean()), "converged": int((gn <= 1e-9).sum()), "runs": runs,
                         "mean_steps": float(steps.double().mean())}
        for s in SIGMAS:
            out[p][meth][s] = float(grad(_row_prune(x, s / 100)).norm(dim=1).mean())
    return out, conv


def _load_logreg(name: str, seed: int):
    from sklearn import datasets

    if name == "digits-even-odd":
        d = datasets.load_digits()
        y = torch.tensor(d.target % 2 == 0, dtype=torch.float64) * 2 - 1
    elif name == "breast-cancer":
        d = datasets.load_breast_cancer()
        y = torch.tensor(d.target, dtype=torch.float64) * 2 - 1
    else:
        raise ValueError(name)
    X = torch.tensor(d.data, dtype=torch.float64)
    lo, hi = X.min(0).values, X.max(0).values
    X = (X - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi))  # min-max normalisation
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    ntr = int(round(0.7 * len(y)))
    return X[perm[:ntr]], y[perm[:ntr]], X[perm[ntr:]], y[perm[ntr:]]


def logistic(runs: int, iters: int, seed: int, show_progress: bool):
    """Mean pruned test accuracy per (dataset, method, sigma). Run ``r`` has its
    own 70:30 split and its own sparse start; the runs are solved together."""
    from prunopt.train.loop import progress

    names = ["digits-even-odd", "breast-cancer"]
    out = {d: {meth: {s: 0.0 for s in LOGREG_SIGMAS} for meth in METHODS} for d in names}
    jobs = [(d, meth) for d in names for meth in METHODS]
    cache = {}
    for d, meth in progress(jobs, "prunadag logistic", show_progress):
        if d not in cache:
            cache.clear()
            splits = [_load_logreg(d, seed + r) for r in range(runs)]
            Xtr, ytr, Xte, yte = (torch.stack([s[i] for s in splits]) for i in range(4))
            n = Xtr.shape[2]
            T = max(1, math.ceil(n / 10))
            x0 = torch.stack([sparse_start(n, T, torch.Generator().manual_seed(seed * 7 + r)) for r in range(runs)])
            cache[d] = (Xtr, ytr, Xte, yte, x0, T)
        Xtr, ytr, Xte, yte, x0, T = cache[d]
        N = ytr.shape[1]

        def grad(x):  # eq. 3.4: f = mean log(1 + exp(-y a^T x)), every run at once
            z = ytr * torch.bmm(Xtr, x.unsqueeze(2)).squeeze(2)
            return -torch.bmm(Xtr.transpose(1, 2), (ytr * torch.sigmoid(-z)).unsqueeze(2)).squeeze(2) / N

        x, _ = solve_batched(grad, x0, meth, T, iters, 0.0, (10.0, 100.0, 0.5))
        for s in LOGREG_SIGMAS:
            xp = _row_prune(x, s / 100)
            acc = ((torch.bmm(Xte, xp.unsqueeze(2)).squeeze(2) * yte) > 0).double().mean(1)
            out[d][meth][s] = float(100.0 * acc.mean())
    return out


def _fmt(v: float) -> str:
    return f"{v:.2g}" if (v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e3)) else f"{v:.3g}"


def lsq_markdown(res) -> str:
    lines = ["| problem | sigma | " + " | ".join(METHODS) + " |", "|---|---|" + "---|" * len(METHODS)]
    for p, by_m in res.items():
        for s in SIGMAS:
            ours = " | ".join(_fmt(by_m[meth][s]) for meth in METHODS)
            lines.append(f"| {p} | {s}% | {ours} |")
            paper = PAPER_TABLE2.get(p, {}).get(s)
            if paper:
                lines.append(f"| {p} (paper) | {s}% | " + " | ".join(_fmt(v) for v in paper) + " |")
    return "\n".join(lines)


def convergence_markdown(conv) -> str:
    """Per (problem, method): mean final ``||g||``, runs that met ``||g|| <= 1e-9``,
    mean number of steps."""
    lines = ["| problem | " + " | ".join(METHODS) + " |", "|---|" + "---|" * len(METHODS)]
    for p, by_m in conv.items():
        cells = [f"{_fmt(c['grad_norm'])} ({c['converged']}/{c['runs']}, {c['mean_steps']:.0f})"
                 for c in (by_m[meth] for meth in METHODS)]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def logreg_markdown(res) -> str:
    lines = ["| dataset | sigma | " + " | ".join(METHODS) + " |", "|---|---|" + "---|" * len(METHODS)]
    for d, by_m in res.items():
        for s in LOGREG_SIGMAS:
            lines.append(f"| {d} | {s}% | " + " | ".join(f"{by_m[meth][s]:.2f}%" for meth in METHODS) + " |")
    return "\n".join(lines)


def plot_rho(res, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probs = list(res)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), squeeze=False)
    for ax, p in zip(axes.flat, probs):
        paper = PAPER_TABLE2.get(p, {})
        for j, meth in enumerate(METHODS):
            color = f"C{j}"
            ax.semilogy(SIGMAS, [max(res[p][meth][s], 1e-12) for s in SIGMAS], marker="o", ms=3, color=color, label=meth)
            if paper:
                ps = sorted(paper)
                ax.semilogy(ps, [max(paper[s][j], 1e-12) for s in ps], ls=":", marker="x", ms=5, color=color)
        ax.set_title(f"{p}: rho = ||g(x pruned)||  (dotted x: paper)")
        ax.set_xlabel("sigma (% pruned)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    for ax in list(axes.flat)[len(probs):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def add_arguments(parser) -> None:
    g = parser.add_argument_group("prunadag")
    g.add_argument("--prunadag-runs", type=int, default=None, help="prunadag: runs per problem (paper 20; quick 2)")
    g.add_argument("--prunadag-iters", type=int, default=None, help="prunadag: iteration limit (paper 1e4; quick 1000)")
    g.add_argument("--prunadag-logreg-iters", type=int, default=None,
                   help="prunadag: logistic-regression iterations (paper 2000; quick 300; 0 skips it)")
    g.add_argument("--prunadag-problems", default=None, help="prunadag: comma-separated subset of A1..A6 (default all)")
    g.add_argument("--prunadag-merge", default=None,
                   help="prunadag: comma-separated folders of earlier runs; write their combined report to --out")


def run(args) -> None:
    if getattr(args, "prunadag_merge", None):
        write_report(merge_reports([d.strip() for d in args.prunadag_merge.split(",") if d.strip()]), args.out)
        return
    quick = args.quick
    runs = getattr(args, "prunadag_runs", None) or (2 if quick else 20)
    iters = getattr(args, "prunadag_iters", None) or (1000 if quick else 10_000)
    lr_iters = getattr(args, "prunadag_logreg_iters", None)
    lr_iters = (300 if quick else 2000) if lr_iters is None else lr_iters
    problems = PROBLEMS
    if getattr(args, "prunadag_problems", None):
        problems = [p.strip() for p in args.prunadag_problems.split(",") if p.strip()]
        bad = [p for p in problems if p not in PROBLEMS]
        if bad:
            raise ValueError(f"--prunadag-problems: unknown problem(s) {bad}; expected a subset of {PROBLEMS}")
    for name, v in (("--prunadag-runs", runs), ("--prunadag-iters", iters)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if lr_iters < 0:
        raise ValueError(f"--prunadag-logreg-iters must be >= 0, got {lr_iters}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; one thread is what the figures were taken with
    try:
        _run(args, runs, iters, lr_iters, problems)
    finally:
        torch.set_num_threads(threads)


def _run(args, runs: int, iters: int, lr_iters: int, problems) -> None:
    t0 = time.perf_counter()
    lsq, conv = least_squares(runs, iters, args.seed, args.progress, problems)
    t_lsq = time.perf_counter() - t0
    logreg, t_lr = None, 0.0
    if lr_iters > 0:
        t1 = time.perf_counter()
        logreg = logistic(runs, lr_iters, args.seed, args.progress)
        t_lr = time.perf_counter() - t1
    data = {"least_squares": lsq, "convergence": conv, "logistic": logreg, "runs": runs, "iters": iters,
            "logreg_iters": lr_iters, "seed": args.seed, "wall_s": {"least_squares": t_lsq, "logistic": t_lr}}
    write_report(data, args.out)


def _int_keys(d):
    """JSON turns the sigma keys into strings; this turns them back."""
    if isinstance(d, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v) for k, v in d.items()}
    return d


def merge_reports(dirs) -> dict:
    """Combines the ``prunadag.json`` of several runs (e.g. problems run in
    parallel processes): least-squares problems and the logistic part are taken
    from whichever run has them; runs, iteration limits and seed must agree."""
    parts = []
    for d in dirs:
        with open(os.path.join(d, "prunadag.json")) as f:
            parts.append(_int_keys(json.load(f)))
    if not parts:
        raise ValueError("--prunadag-merge: no folders given")
    for key in ("runs", "iters", "seed"):
        vals = {p[key] for p in parts}
        if len(vals) > 1:
            raise ValueError(f"--prunadag-merge: the runs disagree on {key}: {sorted(vals)}")
    data = {"least_squares": {}, "convergence": {}, "logistic": None, "runs": parts[0]["runs"],
            "iters": parts[0]["iters"], "logreg_iters": 0, "seed": parts[0]["seed"],
            "wall_s": {"least_squares": 0.0, "logistic": 0.0}}
    for p in parts:
        data["least_squares"].update(p["least_squares"])
        data["convergence"].update(p["convergence"])
        if p.get("logistic"):
            data["logistic"], data["logreg_iters"] = p["logistic"], p["logreg_iters"]
        for k in data["wall_s"]:
            data["wall_s"][k] += p.get("wall_s", {}).get(k, 0.0)
    data["least_squares"] = {p: data["least_squares"][p] for p in PROBLEMS if p in data["least_squares"]}
    data["convergence"] = {p: data["convergence"][p] for p in PROBLEMS if p in data["convergence"]}
    return data


def write_report(data: dict, out: str) -> None:
    """Writes ``prunadag.md`` (tables with the paper's rows interleaved),
    ``prunadag.json`` and ``prunadag_rho.png`` to ``out`` and prints the tables."""
    os.makedirs(out, exist_ok=True)
    runs, iters, lr_iters = data["runs"], data["iters"], data["logreg_iters"]
    md = (f"## Least squares (rho = ||g(x pruned)||, mean of {runs} runs, at most {iters} iterations)\n\n"
          f"Rows marked (paper) are the paper's Table 2.\n\n{lsq_markdown(data['least_squares'])}\n\n"
          f"### Convergence: mean final ||g|| (runs with ||g|| <= 1e-9 / runs, mean steps)\n\n"
          f"{convergence_markdown(data['convergence'])}\n")
    if data.get("logistic"):
        md += (f"\n## Logistic regression (test accuracy after pruning, mean of {runs} runs, {lr_iters} iterations)"
               f"\n\n{logreg_markdown(data['logistic'])}\n")
    w = data.get("wall_s", {})
    md += (f"\nWall time (1 thread, summed over processes): least squares {w.get('least_squares', 0):.0f} s, "
           f"logistic regression {w.get('logistic', 0):.0f} s.\n")
    with open(os.path.join(out, "prunadag.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "prunadag.json"), "w") as f:
        json.dump(data, f, indent=1)
    if data["least_squares"]:
        plot_rho(data["least_squares"], os.path.join(out, "prunadag_rho.png"))
    print(md, flush=True)
    print(f"wrote {out}/prunadag.md, prunadag.json, prunadag_rho.png", flush=True)


register_repro("prunadag", run, "prunAdag paper: least squares A1-A6 (Table 2) and logistic regression (Table 4)",
               add_arguments)
