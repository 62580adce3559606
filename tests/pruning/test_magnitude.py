"""A posteriori magnitude pruning and the measures rho, omega (eq. 3.1)."""
import math

import pytest
import torch

from prunopt.pruning import magnitude_masks, magnitude_prune_, rho_omega, sparsity


def test_sigma_prunes_exact_count_globally():
    ps = [torch.randn(10, 10), torch.randn(37), torch.zeros(0)]
    flat = torch.cat([p.abs().reshape(-1) for p in ps])
    masks = magnitude_prune_(ps, sigma=0.3)
    assert sum(int((~m).sum()) for m in masks) == round(0.3 * 137)
    kept = torch.cat([(p.abs() * m).reshape(-1) for p, m in zip(ps, masks)])
    removed_max = flat[torch.cat([(~m).reshape(-1) for m in masks])].max()
    assert kept[kept > 0].min() >= removed_max
    assert math.isclose(sparsity(ps), round(0.3 * 137) / 137)


def test_delta_and_ties():
    x = torch.tensor([0.0, 0.5, -0.5, 1.0, -2.0])
    assert magnitude_masks(x, delta=0.6)[0].tolist() == [False, False, False, True, True]
    y = torch.ones(10)
    magnitude_prune_(y, sigma=0.5)
    assert int((y == 0).sum()) == 5  # ties broken by position: exact count


@pytest.mark.parametrize("kw", [dict(), dict(sigma=0.1, delta=0.1), dict(sigma=1.5), dict(delta=-1.0)])
def test_errors(kw):
    with pytest.raises(ValueError):
        magnitude_masks(torch.ones(3), **kw)


def test_rho_omega_least_squares():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(5, 8, generator=g, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64)
    x = torch.randn(8, generator=g, dtype=torch.float64)

    def f(xs):
        return 0.5 * (A @ xs[0] - b).pow(2).sum()

    xp = x * magnitude_masks(x, sigma=0.5)[0]
    rho, omega = rho_omega(f, [x], [xp])
    assert math.isclose(rho, (A.t() @ (A @ xp - b)).norm().item(), rel_tol=1e-12)
    assert math.isclose(omega, math.sqrt(abs(f([xp]).item() - f([x]).item())), rel_tol=1e-12)
