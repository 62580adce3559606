"""``prunopt repro prunadag``: the random least-squares problems A1-A6 of
Porcelli, Seraghiti and Toint, *prunAdag: an adaptive pruning-aware gradient
method* (arXiv:2502.08308), section 3.1 / Table 2, and the binary
classification protocol of section 3.4 / Table 4.

Least squares: ``f(x) = ||Ax - b||^2 / 2`` (eq. 3.2), ``m = 100``, ``n = 1000``,
``x* ~ N(0, 1)``, ``b = A x*``, ``T = n/10``, ``ς = 0.01``, ``lr = 1``,
``eps = 0``, a start with exactly ``T`` random non-zeros of unit norm, stop at
``||g|| <= 1e-9`` or the iteration limit (1e4); after optimisation the
``sigma`` fraction of smallest-magnitude entries is pruned and
``rho = ||g(x_pruned)||``, ``omega = sqrt(|f(x_pruned) - f(x)|)`` (eq. 3.1) are
averaged over the runs (20). FW1: ``tau = 50``; FW2: ``tau = 100``,
``beta = 0.001`` (section 3.1.4).

Matrices (the paper cites Wen et al. and Porcelli-Rinaldi without formulas;
for ``m < n`` "orthogonal columns" cannot hold exactly, so these are
readings): A1 Gaussian; A2 ``m`` rows of a random orthogonal ``n x n`` matrix
(orthonormal rows); A3 Gaussian with unit-norm columns; A4 orthonormal rows of
random lengths in [0.5, 2]; A5 symmetric Bernoulli ``±1`` (a ``{0, 1}``
matrix's rank-one mean part does not give the paper's A5 column, which is
nearly A1's); A6 the first ``m`` rows of the orthonormal DCT-II matrix of size
``n`` ("obtained from the discrete cosine transform matrix of dimension n").
``A6r`` is the other reading, ``m`` random rows of it; it is reported beside
A6.

Binary classification (eq. 3.4, labels ``±1``, no intercept): the paper's
datasets (GISETTE, MNIST, REGEDO, A9A, MOLECULE) are not embedded; the
protocol (min-max normalisation, a 70:30 split per run, a random sparse start,
2000 iterations, ``T = ceil(n/10)``, FW1 ``tau = 10``, FW2 ``tau = 100``,
``beta = 0.5``, test accuracy after pruning 65..95 % of the weights) runs on
scikit-learn's embedded classification sets: digits (even vs odd, 64
features), breast cancer (30) and wine (cultivar 1 vs the rest, 13). Iris (4
features, ``T = 1``) is too small for the protocol's pruning levels.

The runs of one problem are solved together as the rows of one ``(runs, n)``
float64 problem (:func:`solve_batched`; per-run top-T set, ratio and stopping),
which makes the paper's setting affordable; each row reproduces the library
optimizer (:func:`solve`) run alone (tests/repro/test_prunadag_repro.py).
Problems can be run in separate processes (``--prunadag-problems``) and
merged (``--merge``). ``--prunadag-investigate`` runs the study of the
choices the paper leaves open for FW1/FW2 and V1/V2 (:data:`INVESTIGATIONS`).
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

import torch

from prunopt.optim import SFW, PrunAdag
from prunopt.repro import register_repro
from prunopt.repro.report import (
    Report,
    Timer,
    deterministic,
    markdown_table,
    pyplot,
    repro_command,
    save_figure,
    scale,
    sig,
)

METHODS = ["V1", "V2", "V3", "V4", "FW1", "FW2", "Adagrad"]
PROBLEMS = ["A1", "A2", "A3", "A4", "A5", "A6"]
#: problems that are run beside the paper's: A6 from random rows of the DCT
ALL_PROBLEMS = PROBLEMS + ["A6r"]
SIGMAS = [10, 20, 30, 40, 50, 60, 70, 80, 90]
LOGREG_SIGMAS = [0, 65, 70, 75, 80, 85, 90, 95]
LOGREG_DATASETS = ["digits-even-odd", "breast-cancer", "wine-1-vs-rest"]
LSQ_FW = (50.0, 100.0, 0.001)  # tau1, tau2, beta (section 3.1.4)
LOGREG_FW = (10.0, 100.0, 0.5)  # section 3.4
TOL = 1e-9

#: Table 2 of the paper (rho, averaged over 20 runs), columns in METHODS order.
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


def paper_rho(problem: str) -> Dict[int, List[float]]:
    """The paper's Table 2 rows for ``problem`` (A6r is compared with A6)."""
    return PAPER_TABLE2.get("A6" if problem == "A6r" else problem, {})


#: Table 4 of the paper (test accuracy %, mean of 20 runs), columns in METHODS order.
PAPER_TABLE4 = {
    "GISETTE": {75: [93.75, 94.50, 93.68, 94.51, 94.66, 94.30, 94.13], 80: [93.75, 94.42, 93.55, 94.33, 94.66, 94.26, 93.61],
                85: [93.40, 94.03, 93.10, 94.05, 94.68, 94.35, 92.45], 90: [92.63, 93.55, 92.20, 93.70, 94.31, 93.85, 89.76],
                95: [87.13, 90.86, 83.73, 89.53, 91.81, 90.20, 83.70]},
    "MNIST": {75: [81.90, 81.91, 80.60, 80.46, 83.65, 81.85, 80.15], 80: [81.48, 81.53, 80.48, 80.41, 83.33, 81.21, 79.45],
              85: [80.43, 80.53, 80.35, 80.12, 82.80, 80.83, 77.32], 90: [78.02, 78.15, 78.83, 78.85, 81.51, 79.02, 75.68],
              95: [72.26, 72.38, 74.11, 73.92, 76.60, 72.48, 66.06]},
    "REGEDO": {70: [96.36, 95.93, 96.36, 96.33, 97.33, 97.33, 96.20], 75: [96.33, 95.93, 96.50, 96.67, 97.33, 97.33, 95.86],
               80: [96.20, 95.83, 96.23, 96.76, 97.33, 97.33, 96.00], 85: [96.76, 96.10, 96.96, 96.60, 97.33, 97.46, 93.06],
               90: [95.90, 95.67, 84.50, 96.40, 97.33, 98.60, 65.20]},
    "A9A": {65: [81.65, 82.16, 81.87, 81.97, 83.07, 83.33, 76.93], 70: [81.33, 81.34, 81.53, 81.67, 83.37, 83.10, 72.78],
            75: [80.68, 80.86, 80.77, 80.22, 83.40, 83.03, 71.25], 80: [79.53, 78.63, 79.55, 79.01, 82.70, 82.85, 71.25],
            85: [75.83, 75.95, 76.20, 76.23, 82.36, 81.60, 72.76]},
    "MOLECULE": {65: [79.30, 78.77, 78.70, 78.39, 78.53, 79.54, 65.00], 70: [77.51, 78.11, 78.43, 78.18, 78.56, 78.95, 62.76],
                 75: [76.11, 76.22, 78.04, 78.28, 78.32, 79.12, 62.86], 80: [74.65, 74.90, 77.80, 78.11, 76.74, 75.17, 62.51],
                 85: [71.01, 70.83, 75.69, 76.53, 76.50, 73.00, 60.73]},
}


# --- problems ----------------------------------------------------------------
def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size ``n`` (float64; row ``k`` is the
    ``k``-th cosine, so the first rows are the lowest frequencies)."""
    k = torch.arange(n, dtype=torch.float64)
    dct = torch.cos(math.pi / n * (k[None, :] + 0.5) * k[:, None]) * math.sqrt(2.0 / n)
    dct[0] /= math.sqrt(2.0)
    return dct


def make_matrix(name: str, m: int, n: int, g: torch.Generator) -> torch.Tensor:
    """The test matrices A1-A6 and A6r (float64); see the module docstring."""
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
        return (torch.rand(m, n, generator=g, dtype=torch.float64) < 0.5).double() * 2 - 1
    if name == "A6":
        return dct_matrix(n)[:m].contiguous()
    if name == "A6r":
        return dct_matrix(n)[torch.randperm(n, generator=g)[:m]].contiguous()
    raise ValueError(f"unknown problem {name!r}; expected one of {ALL_PROBLEMS}")


def sparse_start(n: int, T: int, g: torch.Generator) -> torch.Tensor:
    """A start with exactly T random non-zeros and unit norm (section 3)."""
    x = torch.zeros(n, dtype=torch.float64)
    idx = torch.randperm(n, generator=g)[:T]
    x[idx] = torch.randn(T, generator=g, dtype=torch.float64)
    return x / x.norm()


def least_squares_problems(problem: str, runs: int, seed: int, m: int = 100, n: int = 1000, rhs: str = "paper",
                           offset: int = 0):
    """The ``runs`` instances of one problem, stacked: ``A`` ``(runs, m, n)``,
    ``b`` ``(runs, m)``, starts ``x0`` ``(runs, n)``. Run ``r`` draws its matrix
    from one generator and ``x*`` and its start from another, both seeded by
    ``(seed, r, problem)``; A6 and A6r share ``x*`` and the start.
    ``rhs="unit"`` rescales ``b`` to unit norm (an investigation option);
    ``offset`` starts at run ``offset`` (runs ``offset .. offset + runs - 1``,
    for runs split over processes)."""
    if rhs not in ("paper", "unit"):
        raise ValueError(f"rhs must be 'paper' or 'unit', got {rhs!r}")
    T = n // 10
    idx = PROBLEMS.index("A6" if problem == "A6r" else problem) if problem in ALL_PROBLEMS else None
    if idx is None:
        raise ValueError(f"unknown problem {problem!r}; expected one of {ALL_PROBLEMS}")
    As, bs, x0s = [], [], []
    for r in range(offset, offset + runs):
        base = seed * 1000 + r * 17 + idx
        A = make_matrix(problem, m, n, torch.Generator().manual_seed(base))
        g = torch.Generator().manual_seed(base + 500)
        b = A @ torch.randn(n, generator=g, dtype=torch.float64)
        if rhs == "unit":
            b = b / b.norm()
        As.append(A)
        bs.append(b)
        x0s.append(sparse_start(n, T, g))
    return torch.stack(As), torch.stack(bs), torch.stack(x0s)


def make_optimizer(method: str, x: torch.Tensor, T: int, fw=LSQ_FW):
    """The library optimizer of ``method`` with the paper's settings."""
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
# ratio r = ||g||_R / ||x||_M (Table 1), ||g||_R of the LMO (eq. 1.2), FW2's
# ||v - x|| -- is taken per row. The element arithmetic is that of
# prunopt.reference.prunadag / prunopt.optim.sfw / torch.optim.Adagrad, op for
# op, so one row reproduces the library optimizer.

#: the sets the V1/V3 ratio ``r = ||g||_R / ||x||_S`` can be taken over: the
#: library's ``M`` (sign-matched irrelevant), every irrelevant entry, the whole
#: vector, or the previous step's decreasable set within ``M`` (the paper's
#: ``S ⊂ D`` made non-circular)
RATIO_SETS = ("M", "irrelevant", "all", "prev_D")
#: FW2 step rules: the paper's ``min(beta ||g||_R / ||v - x||, 1)`` and the same
#: with the full gradient norm ``||g||`` (Zimmer et al.'s gradient rescaling)
FW2_RULES = ("paper", "full_grad")


def _row_relevant(g: torch.Tensor, T: int) -> torch.Tensor:
    """Per row, ``R = {i : |g_i| >= tau}`` with ``tau`` the T-th largest ``|g_i|``
    of the row (ties at ``tau`` are all relevant, eq. 2.6)."""
    ag = g.abs()
    if T >= g.shape[1]:
        return torch.ones_like(ag, dtype=torch.bool)
    tau = torch.topk(ag, T, dim=1, sorted=False).values.amin(1, keepdim=True)  # = kthvalue(n - T + 1)
    return ag >= tau


def _masked_norm(v2: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (v2 * mask).sum(1, keepdim=True)


def batched_prunadag_step(x, g, opt_sum, dec_sum, k: int, T: int, version, lr: float = 1.0, eps: float = 0.0,
                          ratio_set: str = "M", prev_dec: Optional[torch.Tensor] = None, return_decreasable=False):
    """One prunAdag step (Algorithm 2.1) on every row of ``x`` (``(B, n)``): row
    ``b`` is the whole parameter vector of run ``b`` (its own top-T set and
    ratio ``r``). ``k`` is the step counter shared by the rows. Returns the new
    ``(x, opt_sum, dec_sum)`` (and the decreasable set ``D`` with
    ``return_decreasable``); the inputs are not modified. ``ratio_set`` (one of
    :data:`RATIO_SETS`; ``"prev_D"`` needs ``prev_dec``, the previous step's
    ``D``, or uses ``M`` when it is ``None``) is for the investigation; the
    library's is ``"M"``."""
    if ratio_set not in RATIO_SETS:
        raise ValueError(f"ratio_set must be one of {RATIO_SETS}, got {ratio_set!r}")
    rel = _row_relevant(g, T)
    m = x * g > 0
    m &= ~rel  # sign-matched irrelevant set M (strict: a zero never matches)
    g2 = g * g
    x2 = x * x
    g_r = _masked_norm(g2, rel)  # ||g||_R^2 (float64)
    if ratio_set == "M" or (ratio_set == "prev_D" and prev_dec is None):
        s = m
    elif ratio_set == "irrelevant":
        s = ~rel
    elif ratio_set == "all":
        s = torch.ones_like(m)
    else:
        s = prev_dec & m
    x_s = _masked_norm(x2, s)  # ||x||_S^2
    ratio = torch.where(x_s > 0, g_r.sqrt() / torch.where(x_s > 0, x_s, torch.ones_like(x_s)).sqrt(),
                        torch.zeros_like(x_s))
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
    out = (torch.where(opt, x + s_opt, x_dec), torch.where(opt, so_new, opt_sum), torch.where(opt, dec_sum, sd_new))
    return out + (~opt,) if return_decreasable else out


def batched_sfw_step(x, g, k: int, T: int, radius: float, step_rule: str, beta: float, fw2_rule: str = "paper"):
    """One Frank-Wolfe step (eq. 1.2-1.3, :class:`prunopt.optim.SFW` without
    momentum) on every row of ``x``; returns the new ``x``. ``fw2_rule`` (one of
    :data:`FW2_RULES`) is for the investigation; the library's is ``"paper"``."""
    if fw2_rule not in FW2_RULES:
        raise ValueError(f"fw2_rule must be one of {FW2_RULES}, got {fw2_rule!r}")
    rel = _row_relevant(g, T)
    g_r = _masked_norm(g * g, rel).sqrt()
    pos = g_r > 0
    v = torch.where(rel & pos, g * (-radius / torch.where(pos, g_r, torch.ones_like(g_r))), torch.zeros_like(g))  # eq. 1.2
    d = v - x
    if step_rule == "fw1":
        return x + d * (1.0 / (k + 1.0))  # eq. 1.3
    scale = g_r if fw2_rule == "paper" else g.norm(dim=1, keepdim=True)
    dist = (d * d).sum(1, keepdim=True).sqrt()
    eta = torch.where(dist > 0, torch.clamp_max(beta * scale / torch.where(dist > 0, dist, torch.ones_like(dist)), 1.0),
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


def solve_batched(grad_fn, x0: torch.Tensor, method: str, T: int, iters: int, tol: float, fw,
                  ratio_set: str = "M", fw2_rule: str = "paper"):
    """Runs ``method`` on every row of ``x0`` (``(B, n)``, the start of each run)
    for at most ``iters`` steps. ``grad_fn(X)`` returns the ``(B, n)`` gradients.
    Row ``b`` stops, for good, before the first step at which its ``||g|| <= tol``
    (``tol = 0``: never) -- the per-run stopping rule of section 3; a stopped row
    keeps its iterate and accumulators unchanged while the others go on.
    ``fw = (tau1, tau2, beta)``; ``ratio_set`` / ``fw2_rule``: see
    :func:`batched_prunadag_step` / :func:`batched_sfw_step`.

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
    prev_dec = None
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
            *new, prev_dec = batched_prunadag_step(x, g, opt_sum, dec_sum, k, T, int(method[1]), lr=1.0, eps=0.0,
                                                   ratio_set=ratio_set, prev_dec=prev_dec, return_decreasable=True)
        elif method == "Adagrad":
            new = batched_adagrad_step(x, g, opt_sum, lr=1.0, eps=0.0) + (dec_sum,)
        else:
            radius = fw[0] if method == "FW1" else fw[1]
            new = (batched_sfw_step(x, g, k, T, radius, method.lower(), fw[2], fw2_rule), opt_sum, dec_sum)
        if all_active:
            x, opt_sum, dec_sum = new
        else:  # a stopped run stops changing
            x, opt_sum, dec_sum = (torch.where(active, nw, old) for nw, old in zip(new, (x, opt_sum, dec_sum)))
        steps += active.view(-1)
    return x, steps


def _row_prune(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Each row magnitude-pruned to the fraction ``sigma`` (each run's solution
    on its own): the ``round(sigma n)`` smallest ``|x_i|`` set to 0, ties by position."""
    count = int(round(sigma * x.shape[1]))
    if count == 0:
        return x.clone()
    order = torch.sort(x.abs(), dim=1, stable=True).indices[:, :count]
    return x.scatter(1, order, 0.0)


# --- least squares ---------------------------------------------------------
def lsq_grad_fn(A: torch.Tensor, b: torch.Tensor):
    """``g(X) = A^T (A x - b)`` for every run at once (row-vector products: the
    fast bmm layout) and ``f(X) = ||A x - b||^2 / 2``."""
    At, bb = A.transpose(1, 2), b.unsqueeze(1)

    def grad(x):
        return torch.bmm(torch.bmm(x.unsqueeze(1), At) - bb, A).squeeze(1)

    def f(x):
        return 0.5 * (torch.bmm(x.unsqueeze(1), At) - bb).squeeze(1).pow(2).sum(1)

    return grad, f


def run_least_squares(problem: str, method: str, runs: int, iters: int, seed: int, m: int = 100, n: int = 1000,
                      fw=LSQ_FW, ratio_set: str = "M", fw2_rule: str = "paper", rhs: str = "paper", problems=None,
                      relevant: Optional[int] = None):
    """One (problem, method) cell group: per sigma the mean ``rho`` and ``omega``
    (eq. 3.1), and the convergence record (mean final ``||g||``, runs that met
    ``||g|| <= 1e-9``, mean steps). ``relevant`` overrides the method's ``T``
    (the paper's ``n/10``; the start keeps ``n/10`` non-zeros)."""
    A, b, x0 = problems if problems is not None else least_squares_problems(problem, runs, seed, m, n, rhs)
    grad, f = lsq_grad_fn(A, b)
    T = n // 10 if relevant is None else relevant
    x, steps = solve_batched(grad, x0, method, T, iters, TOL, fw, ratio_set, fw2_rule)
    gn = grad(x).norm(dim=1)
    fx = f(x)
    rho, omega = {}, {}
    for s in SIGMAS:
        xp = _row_prune(x, s / 100)
        rho[s] = float(grad(xp).norm(dim=1).mean())
        omega[s] = float((f(xp) - fx).abs().sqrt().mean())
    conv = {"grad_norm": float(gn.mean()), "converged": int((gn <= TOL).sum()), "runs": x.shape[0],
            "mean_steps": float(steps.double().mean())}
    return rho, omega, conv


def least_squares(runs: int, iters: int, seed: int, show_progress: bool, problems=ALL_PROBLEMS, m: int = 100,
                  n: int = 1000, methods=METHODS, offset: int = 0):
    """``{"rho": {p: {meth: {sigma: mean}}}, "omega": ..., "convergence": {p: {meth: {...}}}}``."""
    from prunopt.train.loop import progress

    out = {"rho": {}, "omega": {}, "convergence": {}}
    jobs = [(p, meth) for p in problems for meth in methods]
    cache = {}
    for p, meth in progress(jobs, "prunadag least squares", show_progress):
        if p not in cache:
            cache.clear()
            cache[p] = least_squares_problems(p, runs, seed, m, n, offset=offset)
        rho, omega, conv = run_least_squares(p, meth, runs, iters, seed, m, n, problems=cache[p])
        for key, val in (("rho", rho), ("omega", omega), ("convergence", conv)):
            out[key].setdefault(p, {})[meth] = val
    return out


# --- binary classification --------------------------------------------------
def load_logreg(name: str, seed: int):
    """One 70:30 split of an embedded scikit-learn dataset, min-max normalised
    (with the full data's range, as the paper normalises the data set), labels
    ``±1``; returns ``(X_train, y_train, X_test, y_test)`` float64."""
    from sklearn import datasets

    if name == "digits-even-odd":
        d = datasets.load_digits()
        y = torch.tensor(d.target % 2 == 0, dtype=torch.float64) * 2 - 1
    elif name == "breast-cancer":
        d = datasets.load_breast_cancer()
        y = torch.tensor(d.target, dtype=torch.float64) * 2 - 1
    elif name == "wine-1-vs-rest":
        d = datasets.load_wine()
        y = torch.tensor(d.target == 0, dtype=torch.float64) * 2 - 1
    else:
        raise ValueError(f"unknown dataset {name!r}; expected one of {LOGREG_DATASETS}")
    X = torch.tensor(d.data, dtype=torch.float64)
    lo, hi = X.min(0).values, X.max(0).values
    X = (X - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi))  # min-max normalisation
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    ntr = int(round(0.7 * len(y)))
    return X[perm[:ntr]], y[perm[:ntr]], X[perm[ntr:]], y[perm[ntr:]]


def logistic(runs: int, iters: int, seed: int, show_progress: bool, datasets=LOGREG_DATASETS):
    """Mean pruned test accuracy (%) per (dataset, method, sigma), sigma = 0 the
    unpruned solution. Run ``r`` has its own 70:30 split and sparse start; the
    runs are solved together."""
    from prunopt.train.loop import progress

    out = {d: {} for d in datasets}
    jobs = [(d, meth) for d in datasets for meth in METHODS]
    cache = {}
    for d, meth in progress(jobs, "prunadag logistic", show_progress):
        if d not in cache:
            cache.clear()
            splits = [load_logreg(d, seed * 1000 + r) for r in range(runs)]
            Xtr, ytr, Xte, yte = (torch.stack([s[i] for s in splits]) for i in range(4))
            n = Xtr.shape[2]
            T = max(1, math.ceil(n / 10))
            x0 = torch.stack([sparse_start(n, T, torch.Generator().manual_seed(seed * 1000 + 500 + r))
                              for r in range(runs)])
            cache[d] = (Xtr, ytr, Xte, yte, x0, T)
        Xtr, ytr, Xte, yte, x0, T = cache[d]
        N = ytr.shape[1]

        def grad(x):  # eq. 3.4: f = mean log(1 + exp(-y a^T x)), every run at once
            z = ytr * torch.bmm(Xtr, x.unsqueeze(2)).squeeze(2)
            return -torch.bmm(Xtr.transpose(1, 2), (ytr * torch.sigmoid(-z)).unsqueeze(2)).squeeze(2) / N

        x, _ = solve_batched(grad, x0, meth, T, iters, 0.0, LOGREG_FW)
        out[d][meth] = {}
        for s in LOGREG_SIGMAS:
            xp = _row_prune(x, s / 100)
            acc = ((torch.bmm(Xte, xp.unsqueeze(2)).squeeze(2) * yte) > 0).double().mean(1)
            out[d][meth][s] = float(100.0 * acc.mean())
    return out


# --- investigation ---------------------------------------------------------
#: the choices the paper leaves open, one group per method family: each entry is
#: ``(label, method, problem, overrides)``; overrides of :func:`run_least_squares`
INVESTIGATIONS = {
    "fw2": [
        ("FW2 as read (tau2=100, beta=1e-3, ||g||_R)", "FW2", "A1", {}),
        ("beta = 1e-2", "FW2", "A1", {"fw": (50.0, 100.0, 1e-2)}),
        ("beta = 0.1", "FW2", "A1", {"fw": (50.0, 100.0, 0.1)}),
        ("tau2 = 10", "FW2", "A1", {"fw": (50.0, 10.0, 1e-3)}),
        ("tau2 = 1000", "FW2", "A1", {"fw": (50.0, 1000.0, 1e-3)}),
        ("b scaled to unit norm", "FW2", "A1", {"rhs": "unit"}),
        ("step with ||g|| (not ||g||_R)", "FW2", "A1", {"fw2_rule": "full_grad"}),
        ("LMO over every entry (T = n)", "FW2", "A1", {"relevant": 1000}),
        ("LMO over every entry, step with ||g||", "FW2", "A1", {"relevant": 1000, "fw2_rule": "full_grad"}),
        ("step with ||g||", "FW2", "A3", {"fw2_rule": "full_grad"}),
        ("step with ||g||", "FW2", "A5", {"fw2_rule": "full_grad"}),
    ],
    "fw1": [
        ("FW1 as read (tau1=50), 1e4 iterations", "FW1", "A1", {}),
        ("half the iteration limit (5e3)", "FW1", "A1", {"iters_fraction": 0.5}),
        ("tau1 = 25", "FW1", "A1", {"fw": (25.0, 100.0, 1e-3)}),
        ("tau1 = 100", "FW1", "A1", {"fw": (100.0, 100.0, 1e-3)}),
    ],
    "v1": [
        ("V1 as read (ratio over M)", "V1", "A1", {}),
        ("ratio over all irrelevant entries", "V1", "A1", {"ratio_set": "irrelevant"}),
        ("ratio over the whole x", "V1", "A1", {"ratio_set": "all"}),
        ("ratio over the previous step's D ∩ M", "V1", "A1", {"ratio_set": "prev_D"}),
        ("b scaled to unit norm", "V1", "A1", {"rhs": "unit"}),
        ("V3, ratio over the previous step's D ∩ M", "V3", "A1", {"ratio_set": "prev_D"}),
    ],
    "v2": [
        ("V2 as read, 1e4 iterations", "V2", "A1", {}),
        ("half the iteration limit (5e3)", "V2", "A1", {"iters_fraction": 0.5}),
        ("V4 as read", "V4", "A1", {}),
        ("V4, half the iteration limit (5e3)", "V4", "A1", {"iters_fraction": 0.5}),
    ],
}


def investigate(groups, runs: int, iters: int, seed: int, show_progress: bool):
    """Runs the variants of :data:`INVESTIGATIONS` ``groups``; returns one record
    per variant: label, method, problem, overrides, rho (paper's sigmas), the
    convergence record and how many of the paper's cells are within 10x."""
    from prunopt.train.loop import progress

    jobs = [(grp, *v) for grp in groups for v in INVESTIGATIONS[grp]]
    out = []
    for grp, label, meth, prob, over in progress(jobs, "prunadag investigation", show_progress):
        kw = dict(over)
        it = max(1, int(iters * kw.pop("iters_fraction", 1.0)))
        rho, omega, conv = run_least_squares(prob, meth, runs, it, seed, **kw)
        paper = paper_rho(prob)
        j = METHODS.index(meth)
        within = sum(1 for s, row in paper.items() if _within(rho[s], row[j], 10.0))
        out.append({"group": grp, "label": label, "method": meth, "problem": prob, "iters": it,
                    "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in over.items()},
                    "rho": rho, "omega": omega, "convergence": conv, "within_10x": within, "cells": len(paper),
                    "log_error": sum(_log_error(rho[s], row[j]) for s, row in paper.items()) / len(paper)})
    return out


def _log_error(ours: float, paper: float) -> float:
    """``|log10(ours / paper)|`` (0 when both are at the 1e-9 tolerance)."""
    if ours <= 1e-8 and paper <= 1e-8:
        return 0.0
    return abs(math.log10(max(ours, 1e-12) / paper))


def _within(ours: float, paper: float, factor: float) -> bool:
    """``ours`` within a factor of ``paper`` (both below 1e-8: both at the
    stopping tolerance, counted as agreeing)."""
    if ours <= 1e-8 and paper <= 1e-8:
        return True
    if ours <= 0 or paper <= 0:
        return False
    return max(ours / paper, paper / ours) <= factor


# --- claims -----------------------------------------------------------------
def table2_agreement(rho, problems) -> Dict[str, List[int]]:
    """Per problem ``[cells within 10x, cells within 2x, cells]`` of the paper's Table 2."""
    out = {}
    for p in problems:
        paper = paper_rho(p)
        cells = [(rho[p][meth][s], row[j]) for s, row in paper.items() for j, meth in enumerate(METHODS)]
        out[p] = [sum(_within(o, q, 10.0) for o, q in cells), sum(_within(o, q, 2.0) for o, q in cells), len(cells)]
    return out


def _v3_best_below_50(table: Dict[int, List[float]]) -> bool:
    """V3 has the lowest rho (ties at the tolerance count) at every sigma < 50 of ``table``."""
    j = METHODS.index("V3")
    rows = [row for s, row in table.items() if s < 50]
    return bool(rows) and all(row[j] <= min(row) or (row[j] <= 1e-8 and min(row) <= 1e-8) for row in rows)


def _ours_as_rows(rho_p, sigmas) -> Dict[int, List[float]]:
    return {s: [rho_p[meth][s] for meth in METHODS] for s in sigmas}


def _count_of(hits, problems) -> str:
    """``"2/6 (A1, A3)"``; ``"0/6"`` when there is none."""
    return f"{len(hits)}/{len(problems)}" + (f" ({', '.join(hits)})" if hits else "")


def _verdict_share(share: float) -> str:
    return "reproduced" if share >= 0.9 else "qualitatively" if share >= 0.6 else "not reproduced"


def lsq_claims(rep: Report, res) -> None:
    rho, conv = res["rho"], res["convergence"]
    complete = [p for p in ALL_PROBLEMS if p in rho and all(m in rho[p] for m in METHODS)]
    probs = [p for p in PROBLEMS if p in complete]
    if not probs:
        return
    agree = table2_agreement(rho, complete)
    tot = [sum(agree[p][i] for p in probs) for i in range(3)]
    rep.claim(f"Table 2 ({', '.join(probs)}): rho per (problem, sigma, method) cell",
              f"{tot[2]} cells", f"{tot[0]}/{tot[2]} within 10x, {tot[1]}/{tot[2]} within 2x",
              _verdict_share(tot[0] / tot[2]),
              "verdict by the share within 10x: >= 90 % reproduced, >= 60 % qualitatively")
    for p in complete:
        a = agree[p]
        note = "A6 from random rows of the DCT (the other reading), against the paper's A6" if p == "A6r" else ""
        rep.claim(f"Table 2, {p} column", f"{a[2]} cells", f"{a[0]}/{a[2]} within 10x, {a[1]}/{a[2]} within 2x",
                  _verdict_share(a[0] / a[2]), note)
    paper_v3 = [p for p in probs if _v3_best_below_50(PAPER_TABLE2[p])]
    ours_v3 = [p for p in probs if _v3_best_below_50(_ours_as_rows(rho[p], sorted(PAPER_TABLE2[p])))]
    rep.claim("V3 has the lowest rho at every sigma < 50 % (\"most reliable ... in five of the six problems\")",
              _count_of(paper_v3, probs), _count_of(ours_v3, probs),
              "reproduced" if len(ours_v3) >= len(paper_v3) - 1 else
              "qualitatively" if len(ours_v3) >= len(paper_v3) // 2 else "not reproduced",
              "at the paper's sigmas of each problem; rho at the 1e-9 tolerance counts as a tie")
    if "A1" in rho:
        ours = [rho["A1"]["V1"][s] for s in (10, 20, 30)]
        paper = [PAPER_TABLE2["A1"][s][0] for s in (10, 20, 30)]
        ok = sum(_within(o, q, 10.0) for o, q in zip(ours, paper))
        rep.claim("V1 on A1 at sigma 10 / 20 / 30 %", " / ".join(sig(v) for v in paper),
                  " / ".join(sig(v) for v in ours), "reproduced" if ok == 3 else "not reproduced",
                  "see the investigation (ratio set, b scaling)")
    fw2 = [p for p in ("A1", "A3", "A5") if p in rho]
    if fw2:
        j = METHODS.index("FW2")
        paper = ", ".join(f"{p}: {sig(PAPER_TABLE2[p][min(PAPER_TABLE2[p])][j])}" for p in fw2)
        ours = ", ".join(f"{p}: {sig(rho[p]['FW2'][min(PAPER_TABLE2[p])])} ({conv[p]['FW2']['converged']}/"
                         f"{conv[p]['FW2']['runs']} runs at ‖g‖ <= 1e-9)" for p in fw2)
        far = all(not _within(rho[p]["FW2"][min(PAPER_TABLE2[p])], PAPER_TABLE2[p][min(PAPER_TABLE2[p])][j], 10.0)
                  for p in fw2)
        rep.claim("FW2 (tau2 = 100, beta = 1e-3) stays far from a pruning-robust point on A1/A3/A5 "
                  "(rho at the smallest sigma)", paper, ours, "not reproduced" if far else "qualitatively",
                  "our FW2 converges to a sparse stationary point there; see the investigation")
    at70 = probs  # every problem is run at every sigma of SIGMAS
    best = {p: min(METHODS, key=lambda meth: rho[p][meth][70]) for p in at70}
    hits = [p for p in at70 if best[p] in ("FW1", "FW2", "V4")]
    paper70 = {p: METHODS[min(range(7), key=lambda j: PAPER_TABLE2[p][70][j])] for p in probs if 70 in PAPER_TABLE2[p]}
    rep.claim("At sigma = 70 % FW1, FW2 or V4 is the best method",
              ", ".join(f"{p}: {m}" for p, m in paper70.items()),
              f"{len(hits)}/{len(at70)}: " + ", ".join(f"{p}: {best[p]}" for p in at70),
              _verdict_share(len(hits) / max(len(at70), 1)), "the paper's own table: 2 of its 3 problems with a 70 % row")
    worst_p = sum(1 for p in probs for row in PAPER_TABLE2[p].values() if row[-1] >= max(row))
    cells_p = sum(len(PAPER_TABLE2[p]) for p in probs)
    worst_o = sum(1 for p in probs for s in PAPER_TABLE2[p] if rho[p]["Adagrad"][s] >= max(rho[p][m][s] for m in METHODS))
    rep.claim("Adagrad is the least robust to pruning (largest rho)", f"{worst_p}/{cells_p} of the (problem, sigma) rows",
              f"{worst_o}/{cells_p}", _verdict_share(worst_o / max(worst_p, 1)))
    v3c = sum(conv[p]["V3"]["converged"] for p in probs)
    v3r = sum(conv[p]["V3"]["runs"] for p in probs)
    rep.claim("V3 satisfies the stopping criterion ‖g‖ <= 1e-9", "yes (text, section 3.1.4)",
              f"{v3c}/{v3r} runs", _verdict_share(v3c / v3r))
    fast = {p: min(METHODS, key=lambda meth: conv[p][meth]["mean_steps"]) for p in probs}
    slow_fw = [p for p in probs if all(conv[p][fw]["mean_steps"] >= max(conv[p][meth]["mean_steps"]
                                                                         for meth in ("V1", "V3", "Adagrad"))
                                       for fw in ("FW1", "FW2"))]
    rep.claim("FW1 and FW2 converge the slowest", "yes (text, section 3.1.4)",
              f"slower than V1/V3/Adagrad on {len(slow_fw)}/{len(probs)}; fastest: "
              + ", ".join(f"{p}: {m}" for p, m in fast.items()),
              _verdict_share(len(slow_fw) / len(probs)), "mean steps to ‖g‖ <= 1e-9 (or the limit)")


def logreg_claims(rep: Report, res) -> None:
    if not res:
        return
    vs = ["V1", "V2", "V3", "V4"]
    drops, robust, total, v4best = [], 0, 0, []
    for d, by_m in res.items():
        for v in vs:
            drops.append(by_m[v][0] - by_m[v][80])
        for s in (80, 85, 90, 95):
            for v in vs:
                total += 1
                robust += by_m[v][s] > by_m["Adagrad"][s]
        top = max(by_m[v][95] for v in vs)
        v4best.append(by_m["V4"][95] >= top - 1e-9)
    worst = max(drops)
    rep.claim("prunAdag V1-V4 prune > 80 % of the weights without affecting the test accuracy",
              "yes on its 5 datasets (Table 4)", f"largest drop from unpruned to 80 % pruned: {worst:.1f} points "
              f"({', '.join(res)})", "reproduced" if worst <= 2.0 else "qualitatively" if worst <= 10.0 else "not reproduced",
              "different datasets: the paper's are not embedded; 'without affecting' read as a drop <= 2 points")
    p_total = sum(4 for t in PAPER_TABLE4.values() for s in t if s >= 80)
    p_robust = sum(row[j] > row[-1] for t in PAPER_TABLE4.values() for s, row in t.items() if s >= 80 for j in range(4))
    rep.claim("prunAdag is significantly more robust to pruning than Adagrad",
              f"V1-V4 above Adagrad in {p_robust}/{p_total} (dataset, sigma >= 80 %) cells of Table 4",
              f"V1-V4 above Adagrad in {robust}/{total} (dataset, sigma in 80..95 %) cells",
              _verdict_share(robust / total))
    rep.claim("V4 tolerates the largest number of pruned components (best V at the highest sigma)",
              "text, section 3.4", f"V4 best of V1-V4 at 95 % on {sum(v4best)}/{len(v4best)} datasets",
              _verdict_share(sum(v4best) / len(v4best)))


# --- output -----------------------------------------------------------------
def lsq_markdown(rho) -> str:
    rows = []
    for p, by_m in rho.items():
        paper = paper_rho(p)
        for s in SIGMAS:
            rows.append([p, f"{s}%"] + [sig(by_m[meth][s]) if meth in by_m else "-" for meth in METHODS])
            if s in paper:
                rows.append([f"{p} (paper{' A6' if p == 'A6r' else ''})", f"{s}%"] + [sig(v) for v in paper[s]])
    return markdown_table(["problem", "sigma"] + METHODS, rows)


def omega_markdown(omega) -> str:
    rows = [[p, f"{s}%"] + [sig(by_m[meth][s]) if meth in by_m else "-" for meth in METHODS]
            for p, by_m in omega.items() for s in SIGMAS]
    return markdown_table(["problem", "sigma"] + METHODS, rows)


def convergence_markdown(conv) -> str:
    rows = [[p] + [f"{sig(c['grad_norm'])} ({c['converged']}/{c['runs']}, {c['mean_steps']:.0f})" if c else "-"
                   for c in (by_m.get(meth) for meth in METHODS)] for p, by_m in conv.items()]
    return markdown_table(["problem"] + METHODS, rows)


def logreg_markdown(res) -> str:
    rows = [[d, "unpruned" if s == 0 else f"{s}%"] + [f"{by_m[meth][s]:.2f}" for meth in METHODS]
            for d, by_m in res.items() for s in LOGREG_SIGMAS]
    rows += [[f"{d} (paper)", f"{s}%"] + [f"{v:.2f}" for v in row]
             for d, t in PAPER_TABLE4.items() for s, row in t.items()]
    return markdown_table(["dataset", "sigma"] + METHODS, rows)


def investigation_markdown(records) -> str:
    rows = []
    for r in records:
        paper = paper_rho(r["problem"])
        sigmas = sorted(paper)
        j = METHODS.index(r["method"])
        c = r["convergence"]
        rows.append([r["group"], r["problem"], r["method"], r["label"],
                     " / ".join(sig(r["rho"][s]) for s in sigmas), " / ".join(sig(paper[s][j]) for s in sigmas),
                     f"{r['within_10x']}/{r['cells']}", f"{r['log_error']:.2f}",
                     f"{sig(c['grad_norm'])} ({c['converged']}/{c['runs']}, {c['mean_steps']:.0f})"])
    return markdown_table(["group", "problem", "method", "variant", "rho at the paper's sigmas (prunopt)",
                           "paper", "within 10x", "mean abs log10(prunopt/paper)", "final ||g|| (converged, mean steps)"],
                          rows)


def plot(rho, path: str) -> None:
    """One panel per problem: prunopt's rho (lines) and the paper's (crosses,
    same colour), and a panel of log10(prunopt / paper) per cell."""
    plt = pyplot()
    probs = list(rho)
    ncol = 4
    nrow = (len(probs) + 1 + ncol - 1) // ncol + 1
    fig = plt.figure(figsize=(4.2 * ncol, 3.3 * nrow))
    gs = fig.add_gridspec(nrow, ncol)
    for i, p in enumerate(probs):
        ax = fig.add_subplot(gs[i // ncol, i % ncol])
        paper = paper_rho(p)
        for j, meth in enumerate(METHODS):
            if meth in rho[p]:
                ax.semilogy(SIGMAS, [max(rho[p][meth][s], 1e-12) for s in SIGMAS], "-", color=f"C{j}", lw=1.2)
            if paper:
                ps = sorted(paper)
                ax.semilogy(ps, [max(paper[s][j], 1e-12) for s in ps], "x", color=f"C{j}", ms=6, mew=1.5)
        ax.set_title(p + (" (random DCT rows; crosses: paper's A6)" if p == "A6r" else ""), fontsize=9)
        ax.set_xlabel("sigma (% pruned)", fontsize=8)
        ax.set_ylabel("rho = ||g(x pruned)||", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    lax = fig.add_subplot(gs[len(probs) // ncol, len(probs) % ncol])
    lax.axis("off")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=f"C{j}", lw=2, label=meth) for j, meth in enumerate(METHODS)]
    handles += [Line2D([], [], color="k", lw=1.2, label="prunopt (line)"),
                Line2D([], [], color="k", ls="", marker="x", mew=1.5, label="paper, Table 2 (cross)")]
    lax.legend(handles=handles, loc="center", fontsize=9, frameon=False)
    # agreement: log10(ours / paper) per (problem, sigma) row and method
    ax = fig.add_subplot(gs[nrow - 1, :])
    rows = [(p, s) for p in probs for s in sorted(paper_rho(p))]
    import numpy as np

    vals = np.array([[math.log10(max(rho[p][meth][s], 1e-12) / paper_rho(p)[s][j]) if meth in rho[p] else np.nan
                      for (p, s) in rows] for j, meth in enumerate(METHODS)])
    im = ax.imshow(vals, cmap="RdBu_r", vmin=-3, vmax=3, aspect="auto")
    ax.set_yticks(range(len(METHODS)))
    ax.set_yticklabels(METHODS, fontsize=8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{p} {s}%" for p, s in rows], rotation=90, fontsize=7)
    ax.set_title("log10(prunopt rho / paper rho) per Table 2 cell (white: equal; |value| > 1: off by more than 10x)",
                 fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01)
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


def add_arguments(parser) -> None:
    g = parser.add_argument_group("prunadag")
    g.add_argument("--prunadag-runs", type=int, default=None, help="prunadag: runs per problem (paper 20; quick 2)")
    g.add_argument("--prunadag-iters", type=int, default=None, help="prunadag: iteration limit (paper 1e4; quick 1000)")
    g.add_argument("--prunadag-logreg-iters", type=int, default=None,
                   help="prunadag: logistic-regression iterations (paper 2000; quick 300; 0 skips it)")
    g.add_argument("--prunadag-problems", default=None,
                   help=f"prunadag: comma-separated subset of {','.join(ALL_PROBLEMS)} (default all; A6r = A6 from "
                        "random DCT rows; none: the logistic regression alone)")
    g.add_argument("--prunadag-methods", default=None,
                   help=f"prunadag: comma-separated subset of {','.join(METHODS)} (default all; for runs in pieces)")
    g.add_argument("--prunadag-run-offset", type=int, default=None,
                   help="prunadag: first run of the least squares (runs split over processes; merged by run count)")
    g.add_argument("--prunadag-merge", default=None, help="prunadag: the same as --merge")
    g.add_argument("--prunadag-investigate", default=None,
                   help=f"prunadag: run the investigation groups ({','.join(INVESTIGATIONS)}, comma-separated) "
                        "instead of the tables; writes prunadag_investigation.md/.json")


#: runs, iteration limits: the paper's (full), a few minutes (quick), seconds (tiny, for tests)
SIZES = {"full": dict(runs=20, iters=10_000, logreg_iters=2000, investigation_runs=5),
         "quick": dict(runs=2, iters=1000, logreg_iters=300, investigation_runs=2),
         "tiny": dict(runs=2, iters=30, logreg_iters=20, investigation_runs=2)}

_KEYS = ("prunadag_runs", "prunadag_iters", "prunadag_logreg_iters", "prunadag_problems", "prunadag_methods",
         "prunadag_run_offset", "prunadag_investigate")


def run(args) -> None:
    merge = getattr(args, "prunadag_merge", None) or getattr(args, "merge", None)
    if merge and getattr(args, "prunadag_investigate", None):  # investigation groups run in pieces
        from prunopt.repro.report import load_parts, pieces_section

        parts = load_parts(merge, "prunadag_investigation")
        d0 = parts[0]["data"]
        if any((p["data"]["runs"], p["data"]["iters"], p["data"]["seed"]) != (d0["runs"], d0["iters"], d0["seed"])
               for p in parts):
            raise ValueError("--merge: the investigation parts disagree on runs, iterations or seed")
        records = [_int_keys(r) for p in parts for r in p["data"]["records"]]
        write_investigation(records, args.out, f"{repro_command(args, 'prunadag', ['prunadag_investigate'])} "
                            f"--merge {merge}", d0["seed"], parts[0]["threads"], d0["runs"], d0["iters"],
                            sum(p["wall_s"] for p in parts), lambda rep: pieces_section(rep, parts),
                            cpu=sum(p.get("cpu_s", 0.0) for p in parts))
        return
    if merge:
        from prunopt.repro.report import load_parts

        parts = load_parts(merge, "prunadag")
        write_report(merge_reports([d.strip() for d in merge.split(",") if d.strip()]), args.out,
                     f"{repro_command(args, 'prunadag')} --merge {merge}", parts)
        return
    size = SIZES[scale(args)]
    runs = getattr(args, "prunadag_runs", None) or size["runs"]
    iters = getattr(args, "prunadag_iters", None) or size["iters"]
    lr_iters = getattr(args, "prunadag_logreg_iters", None)
    lr_iters = size["logreg_iters"] if lr_iters is None else lr_iters
    problems = ALL_PROBLEMS
    if getattr(args, "prunadag_problems", None) == "none":  # the logistic part alone
        problems = []
    elif getattr(args, "prunadag_problems", None):
        problems = [p.strip() for p in args.prunadag_problems.split(",") if p.strip()]
        bad = [p for p in problems if p not in ALL_PROBLEMS]
        if bad or not problems:
            raise ValueError(f"--prunadag-problems: unknown problem(s) {bad}; expected a subset of {ALL_PROBLEMS}")
    methods = METHODS
    if getattr(args, "prunadag_methods", None):
        methods = [m.strip() for m in args.prunadag_methods.split(",") if m.strip()]
        bad = [m for m in methods if m not in METHODS]
        if bad or not methods:
            raise ValueError(f"--prunadag-methods: unknown method(s) {bad}; expected a subset of {METHODS}")
    offset = getattr(args, "prunadag_run_offset", 0) or 0
    if offset < 0:
        raise ValueError(f"--prunadag-run-offset must be >= 0, got {offset}")
    for name, v in (("--prunadag-runs", runs), ("--prunadag-iters", iters)):
        if v < 1:
            raise ValueError(f"--prunadag-runs/--prunadag-iters must be >= 1, got {name} {v}")
    if lr_iters < 0:
        raise ValueError(f"--prunadag-logreg-iters must be >= 0, got {lr_iters}")
    command = repro_command(args, "prunadag", _KEYS)
    groups = None
    if getattr(args, "prunadag_investigate", None):
        groups = [s.strip() for s in args.prunadag_investigate.split(",") if s.strip()]
        bad = [s for s in groups if s not in INVESTIGATIONS]
        if bad or not groups:
            raise ValueError(f"--prunadag-investigate: unknown group(s) {bad}; expected a subset of {list(INVESTIGATIONS)}")
    with deterministic(args.threads):
        if groups is not None:
            runs_i = getattr(args, "prunadag_runs", None) or size["investigation_runs"]
            with Timer() as t:
                records = investigate(groups, runs_i, iters, args.seed, args.progress)
            write_investigation(records, args.out, command, args.seed, args.threads, runs_i, iters, t.seconds,
                                cpu=t.cpu_seconds)
            return
        with Timer() as t_lsq:
            lsq = least_squares(runs, iters, args.seed, args.progress, problems, methods=methods, offset=offset)
        logreg = None
        with Timer() as t_lr:
            if lr_iters > 0:
                logreg = logistic(runs, lr_iters, args.seed, args.progress)
    data = {**lsq, "logistic": logreg, "runs": runs, "run_offset": offset, "iters": iters, "logreg_iters": lr_iters,
            "seed": args.seed,
            "threads": args.threads, "wall_s": {"least_squares": t_lsq.seconds, "logistic": t_lr.seconds},
            "cpu_s": {"least_squares": t_lsq.cpu_seconds, "logistic": t_lr.cpu_seconds}}
    write_report(data, args.out, command)


def _int_keys(d):
    """JSON turns the sigma keys into strings; this turns them back."""
    if isinstance(d, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v) for k, v in d.items()}
    return d


def merge_reports(dirs) -> dict:
    """Combines the ``prunadag.json`` of several runs made in separate
    processes: least-squares (problem, method) cells, possibly split over runs
    (``--prunadag-run-offset``; their means are combined weighted by run
    count, the run ranges must not overlap), and the logistic part from
    whichever run has it. Every problem must end up with every method and the
    same number of runs; iteration limits, seed and threads must agree."""
    parts = []
    for d in dirs:
        with open(os.path.join(d, "prunadag.json")) as f:
            parts.append(_int_keys(json.load(f))["data"])
    if not parts:
        raise ValueError("--prunadag-merge: no folders given")
    for key in ("iters", "seed", "threads"):
        vals = {p[key] for p in parts}
        if len(vals) > 1:
            raise ValueError(f"--prunadag-merge: the runs disagree on {key}: {sorted(vals)}")
    cells: Dict[tuple, list] = {}
    for p in parts:
        for prob, by_method in p["rho"].items():
            for meth in by_method:
                cells.setdefault((prob, meth), []).append(p)
    data = {"rho": {}, "omega": {}, "convergence": {}, "logistic": None, "iters": parts[0]["iters"],
            "logreg_iters": 0, "seed": parts[0]["seed"], "threads": parts[0]["threads"],
            "wall_s": {"least_squares": 0.0, "logistic": 0.0}, "cpu_s": {"least_squares": 0.0, "logistic": 0.0}}
    totals = set()
    for (prob, meth), ps in cells.items():
        ranges = sorted((q.get("run_offset", 0), q.get("run_offset", 0) + q["runs"]) for q in ps)
        if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
            raise ValueError(f"--prunadag-merge: {prob}/{meth} has overlapping runs {ranges}")
        n = sum(q["runs"] for q in ps)
        totals.add(n)
        for key in ("rho", "omega"):
            data[key].setdefault(prob, {})[meth] = {s: sum(q["runs"] * q[key][prob][meth][s] for q in ps) / n
                                                    for s in SIGMAS}
        cs = [q["convergence"][prob][meth] for q in ps]
        data["convergence"].setdefault(prob, {})[meth] = {
            "grad_norm": sum(c["runs"] * c["grad_norm"] for c in cs) / n, "converged": sum(c["converged"] for c in cs),
            "runs": n, "mean_steps": sum(c["runs"] * c["mean_steps"] for c in cs) / n}
    for p in parts:
        if p.get("logistic"):
            data["logistic"], data["logreg_iters"] = p["logistic"], p["logreg_iters"]
            totals.add(p["runs"])
        for key in ("wall_s", "cpu_s"):
            for k in data[key]:
                data[key][k] += p.get(key, {}).get(k, 0.0)
    if len(totals) > 1:
        raise ValueError(f"--prunadag-merge: the cells have different numbers of runs: {sorted(totals)}")
    data["runs"] = totals.pop() if totals else parts[0]["runs"]
    for key in ("rho", "omega", "convergence"):
        data[key] = {p: {m: data[key][p][m] for m in METHODS if m in data[key][p]}
                     for p in ALL_PROBLEMS if p in data[key]}
    missing = [f"{p}/{m}" for p in data["rho"] for m in METHODS if m not in data["rho"][p]]
    if missing:
        raise ValueError(f"--prunadag-merge: the runs lack {', '.join(missing)}")
    return data


def build_report(data: dict, command: str) -> Report:
    """The claims table and sections of a (possibly merged) run."""
    runs, iters, lr_iters = data["runs"], data["iters"], data["logreg_iters"]
    w = data.get("wall_s", {})
    rep = Report("prunadag", "prunAdag (Porcelli, Seraghiti, Toint, arXiv:2502.08308): Table 2 and Table 4",
                 command, [data["seed"]], data["threads"],
                 {"runs": runs, "iterations": iters, "logistic iterations": lr_iters})
    rep.wall_s = float(w.get("least_squares", 0.0) + w.get("logistic", 0.0))
    c = data.get("cpu_s", {})
    rep.cpu_s = float(c.get("least_squares", 0.0) + c.get("logistic", 0.0))
    lsq_claims(rep, data)
    logreg_claims(rep, data.get("logistic"))
    if data["rho"]:
        rep.section(f"Table 2: rho = ||g(x pruned)||, mean of {runs} runs, at most {iters} iterations",
                    "Rows marked (paper) are the paper's Table 2; A6r (random DCT rows) is printed beside the "
                    f"paper's A6 rows.\n\n{lsq_markdown(data['rho'])}")
        rep.section("omega = sqrt(|f(x pruned) - f(x)|) (eq. 3.1; the paper plots it, it has no table)",
                    omega_markdown(data["omega"]))
        rep.section("Convergence: mean final ||g|| (runs with ||g|| <= 1e-9 / runs, mean steps)",
                    convergence_markdown(data["convergence"]))
    if data.get("logistic"):
        rep.section(f"Table 4 protocol on embedded datasets (test accuracy %, mean of {runs} runs, {lr_iters} "
                    "iterations)", "The paper's rows (its datasets, which are not embedded) follow ours.\n\n"
                    + logreg_markdown(data["logistic"]))
    rep.section("Wall and CPU time", f"least squares {w.get('least_squares', 0):.0f} s wall, "
                f"{c.get('least_squares', 0):.0f} s CPU; logistic regression {w.get('logistic', 0):.0f} s wall, "
                f"{c.get('logistic', 0):.0f} s CPU ({data['threads']} thread(s), summed over merged processes)")
    rep.data = data
    return rep


def write_report(data: dict, out: str, command: str, parts=None) -> Report:
    """Prints and writes ``prunadag.md``, ``prunadag.json`` and ``prunadag.png``
    (with the commands of the merged ``parts``, if any)."""
    rep = build_report(data, command)
    if parts:
        from prunopt.repro.report import pieces_section

        pieces_section(rep, parts)
    figs = {"prunadag.png": (lambda path: plot(data["rho"], path))} if data["rho"] else {}
    rep.write(out, figs)
    return rep


def write_investigation(records, out: str, command: str, seed: int, threads: int, runs: int, iters: int,
                        wall: float, extra=None, cpu: float = 0.0) -> Report:
    rep = Report("prunadag_investigation", "prunAdag: the choices the paper leaves open for FW1, FW2, V1 and V2",
                 command, [seed], threads, {"runs": runs, "iterations": iters})
    rep.wall_s, rep.cpu_s = wall, cpu
    for grp in dict.fromkeys(r["group"] for r in records):
        recs = [r for r in records if r["group"] == grp]
        base = recs[0]
        same = [r for r in recs if (r["problem"], r["method"]) == (base["problem"], base["method"])]
        best = min(same, key=lambda r: r["log_error"])
        j = METHODS.index(base["method"])
        paper = " / ".join(sig(v[j]) for _, v in sorted(paper_rho(base["problem"]).items()))
        rep.claim(f"{grp}: the reading of {base['method']} closest to the paper's {base['problem']} column",
                  f"{base['problem']} {base['method']}: {paper}",
                  f"{best['label']}: " + " / ".join(sig(best["rho"][s]) for s in sorted(paper_rho(base["problem"])))
                  + f" ({best['within_10x']}/{best['cells']} within 10x, mean |log10 ratio| {best['log_error']:.2f}; "
                  f"as read: {base['within_10x']}/{base['cells']}, {base['log_error']:.2f})",
                  "reproduced" if best["within_10x"] == best["cells"] else
                  "qualitatively" if 2 * best["within_10x"] >= best["cells"] else "not reproduced",
                  "verdict for the closest reading: all cells within 10x reproduced, at least half qualitatively")
    rep.section(f"Variants ({runs} runs each, at most {iters} iterations unless stated)", investigation_markdown(records))
    rep.data = {"records": records, "runs": runs, "iters": iters, "seed": seed}
    if extra is not None:
        extra(rep)
    rep.write(out)
    return rep


register_repro("prunadag", run, "prunAdag paper: least squares A1-A6 (Table 2) and logistic regression (Table 4)",
               add_arguments)
