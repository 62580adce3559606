"""prunopt repro interspace: Theorem 1 (adaptive basis beats magnitude pruning)."""
import os

import torch

from prunopt.cli import main
from prunopt.repro.interspace import adaptive_basis_error, magnitude_error


def test_magnitude_error_is_eq2_minimum():
    u = torch.tensor([[3.0, -1.0], [0.5, -2.0]], dtype=torch.float64)
    eps, mask = magnitude_error(u, 2)
    assert mask.tolist() == [[True, False], [False, True]]
    assert abs(eps - (1.0 + 0.25) ** 0.5) < 1e-12


def test_adaptive_basis_strictly_better_and_monotone():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(9, 100, generator=g, dtype=torch.float64)
    for p in (0.2, 0.6, 0.9):
        s = int((1 - p) * u.numel())
        eps2, mask = magnitude_error(u, s)
        eps1, history = adaptive_basis_error(u, mask, iterations=8)
        assert abs(history[0] - eps2) < 1e-9  # starts at the magnitude solution
        assert all(b <= a + 1e-9 for a, b in zip(history, history[1:]))  # alternating LS never increases
        assert eps1 < eps2 * (1 - 1e-6)  # Theorem 1: strictly better


def test_cli_quick(tmp_path, capsys):
    assert main(["repro", "interspace", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "strictly better at every sparsity: True" in out
    assert os.path.exists(tmp_path / "theorem1.csv") and os.path.exists(tmp_path / "theorem1.png")
