"""``prunopt train --method prunadag`` and the pieces of ``prunopt repro prunadag``."""
import json

import pytest
import torch

from prunopt.cli import main
from prunopt.repro import REPROS
from prunopt.repro.prunadag import METHODS, make_matrix, solve, sparse_start


@pytest.mark.slow
def test_train_prunadag_summary(tmp_path, capsys):
    rc = main(["train", "--method", "prunadag", "--sparsity", "0.8", "--epochs", "1", "--limit", "300",
               "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("summary:")][-1]
    assert "method=prunadag" in line and "dense_acc=" in line and "pruned_acc=" in line
    s = json.loads((tmp_path / "summary.json").read_text())
    assert abs(s["sparsity"] - 0.8) < 1e-3
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert "sum" in next(iter(ck["optimizer"]["state"].values()))


def test_repro_registered():
    assert "prunadag" in REPROS


@pytest.mark.parametrize("name", ["A1", "A2", "A3", "A4", "A5", "A6"])
def test_matrices(name):
    A = make_matrix(name, 10, 40, torch.Generator().manual_seed(0))
    assert A.shape == (10, 40) and A.dtype == torch.float64
    if name == "A2" or name == "A6":
        torch.testing.assert_close(A @ A.t(), torch.eye(10, dtype=torch.float64), atol=1e-12, rtol=0)
    if name == "A4":
        gram = A @ A.t()
        torch.testing.assert_close(gram - torch.diag(gram.diag()), torch.zeros(10, 10, dtype=torch.float64), atol=1e-12, rtol=0)
    if name == "A5":
        assert set(A.unique().tolist()) <= {-1.0, 1.0}


@pytest.mark.slow
def test_solvers_decrease_gradient():
    g = torch.Generator().manual_seed(1)
    A = make_matrix("A1", 10, 50, g)
    b = A @ torch.randn(50, generator=g, dtype=torch.float64)
    x0 = sparse_start(50, 5, g)
    assert int((x0 != 0).sum()) == 5 and abs(x0.norm().item() - 1) < 1e-12

    def grad(x):
        return A.t() @ (A @ x - b)

    for meth in METHODS:
        x = solve(grad, x0, meth, 5, 200, 1e-9, (50.0, 100.0, 0.001))
        assert torch.isfinite(x).all()
    x = solve(grad, x0, "V3", 5, 300, 1e-9, (50.0, 100.0, 0.001))
    assert grad(x).norm() < 0.1 * grad(x0).norm()
