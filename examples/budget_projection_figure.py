"""The budget projection drawn: phi(lam) and its root, the projected scores for
three budgets, and an annealed density schedule with the projected scores'
sum following it (the figure of docs/projection.md; --out PATH writes it)."""
import argparse
import os

import torch

from prunopt.ops import project_budget
from prunopt.schedules import DensitySchedule


def phi(t, c, budget, lam):
    """sum_i c_i clamp(t_i - lam c_i, 0, 1) - S (the projection's eq. 14)."""
    return float((c * (t - lam * c).clamp(0, 1)).sum()) - budget


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", default=os.environ.get("PRUNOPT_EXAMPLES_TINY") == "1",
                        help="a seconds-long run (also PRUNOPT_EXAMPLES_TINY=1)")
    parser.add_argument("--out", default=None, help="where to write the figure (PNG); nothing is written without it")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    n = 200 if args.tiny else 2000
    t = torch.rand(n, generator=g, dtype=torch.float64) * 1.2
    c = 0.5 + 1.5 * torch.rand(n, generator=g, dtype=torch.float64)

    # (a) phi is non-increasing and piecewise linear; the projection's lam* is its root
    budget = 0.2 * float(c.sum())
    theta = project_budget(t, budget, c)
    lams = torch.linspace(0.0, 1.0, 201, dtype=torch.float64)
    phis = [phi(t, c, budget, float(x)) for x in lams]
    free = (theta > 0) & (theta < 1)
    lam_star = float(((t - theta) / c)[free].median())  # theta = t - lam* c on the free set
    assert abs(phi(t, c, budget, lam_star)) < 1e-6 * budget
    assert abs(float((c * theta).sum()) - budget) < 1e-6 * budget

    # (b) unit costs: theta* = clamp(t - lam*, 0, 1), a shift that keeps the order
    order = t.argsort()
    shifted = {s: project_budget(t, s * n)[order] for s in (0.1, 0.3, 0.5)}
    for s, th in shifted.items():
        assert abs(float(th.sum()) - s * n) < 1e-6 * n and bool((th[1:] >= th[:-1]).all())

    # (c) an annealed density d(k) and the projected scores' sum after each step
    steps = 20 if args.tiny else 200
    schedule = DensitySchedule(0.1, 0, steps, power=3)
    scores = torch.rand(n, generator=g, dtype=torch.float64)
    density = []
    for k in range(steps + 1):
        scores = project_budget(scores + 0.05 * torch.randn(n, generator=g, dtype=torch.float64), schedule(k) * n)
        density.append(float(scores.sum()) / n)
        assert density[-1] <= schedule(k) + 1e-9
    print(f"lam* = {lam_star:.4f}; final density {density[-1]:.3f} (target 0.1)")
    if args.out is None:
        return

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    ax[0].plot(lams, phis, label="phi(lam)")
    ax[0].axhline(0.0, color="gray", lw=0.8)
    ax[0].axvline(lam_star, color="C3", ls="--", label=f"lam* = {lam_star:.3f}")
    ax[0].set(xlabel="lam", ylabel="sum c clamp(t - lam c, 0, 1) - S", title="(a) the root of phi, S = 0.2 sum c")
    ax[0].legend()
    ts = t[order]
    for s, th in shifted.items():
        ax[1].plot(ts, th, label=f"S = {s:g} n")
    ax[1].plot(ts, ts.clamp(0, 1), color="gray", ls=":", label="clamp(t, 0, 1)")
    ax[1].set(xlabel="score t", ylabel="projected theta*", title="(b) unit costs: a shift, then a clamp")
    ax[1].legend()
    ax[2].plot(range(steps + 1), [schedule(k) for k in range(steps + 1)], label="budget d(k) (power 3)")
    ax[2].plot(range(steps + 1), density, ls="--", label="sum theta / n after the projection")
    ax[2].set(xlabel="step k", ylabel="density", title="(c) annealed budget")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
