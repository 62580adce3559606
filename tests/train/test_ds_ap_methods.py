"""Smoke tests of ``prunopt train --method ds`` / ``--method ap`` (tiny runs)."""
import re

import pytest

from prunopt.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("method", ["ds", "ap"])
def test_train_method_prints_summary(method, capsys, tmp_path):
    assert main(["train", "--method", method, "--epochs", "1", "--limit", "300", "--no-progress",
                 "--density", "0.5", "--out", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.match(r"summary: method=(\w+) dense_acc=([\d.]+) pruned_acc=([\d.]+) density=([\d.]+) sparsity=([\d.]+)", line)
    assert m and m.group(1) == method
    density, sparsity = float(m.group(4)), float(m.group(5))
    assert 0.0 < density <= 1.0 and abs(density + sparsity - 1.0) < 1e-3
    assert (tmp_path / "summary.json").exists() and (tmp_path / "checkpoint.pt").exists()
