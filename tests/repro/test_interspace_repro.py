"""prunopt repro interspace: Theorem 1 (fixed and free support), the cluttered
digits, the command's structure and determinism."""
import itertools
import json
import math

import pytest
import torch

from prunopt.cli import main
from prunopt.repro.interspace import (
    adaptive_basis_error,
    cluttered_digits,
    column_aligned,
    fixed_support_delta,
    free_support_error,
    magnitude_error,
)


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


@pytest.mark.parametrize("m,n,s", [(2, 2, 2), (2, 3, 2), (3, 2, 3), (2, 3, 4), (2, 3, 3), (3, 3, 3)])
def test_delta_counts_column_aligned_supports(m, n, s):
    """delta = (column-aligned s-subsets) / (all s-subsets), by enumeration."""
    cells = list(itertools.product(range(m), range(n)))
    aligned = 0
    for sub in itertools.combinations(cells, s):
        mask = torch.zeros(m, n, dtype=torch.bool)
        for i, j in sub:
            mask[i, j] = True
        aligned += column_aligned(mask)
    assert fixed_support_delta(m, n, s) == pytest.approx(aligned / math.comb(m * n, s), rel=1e-12)


def test_fixed_support_equality_exactly_when_column_aligned_and_free_support_beats_it():
    g = torch.Generator().manual_seed(3)
    seen_aligned = 0
    for _ in range(60):
        u = torch.randn(2, 3, generator=g, dtype=torch.float64)
        eps2, mask = magnitude_error(u, 2)
        eps1, _ = adaptive_basis_error(u, mask, iterations=5)
        if column_aligned(mask):
            seen_aligned += 1
            assert eps1 == pytest.approx(eps2, rel=1e-12)  # the fixed support cannot help
            free, nnz = free_support_error(u, mask)
            assert nnz <= 2 and free < eps2 * (1 - 1e-6)  # the free support does (P = 1)
        else:
            assert eps1 < eps2 * (1 - 1e-9)
            with pytest.raises(ValueError, match="column-aligned"):
                free_support_error(u, mask)
    assert seen_aligned > 0


def test_free_support_error_is_an_honest_point():
    """The returned error and count are those of the returned (F, R): F
    invertible, ||R||_0 <= s, recomputed here; two kept columns of three rows."""
    u = torch.tensor([[3.0, -2.5, 0.1, 0.2], [2.0, 2.8, -0.3, 0.1], [-2.2, 2.1, 0.2, -0.4]], dtype=torch.float64)
    eps2, mask = magnitude_error(u, 6)
    assert column_aligned(mask) and mask[:, :2].all()
    free, nnz, f, r = free_support_error(u, mask, return_factors=True)
    assert abs(float(torch.linalg.det(f))) > 1e-6
    assert nnz == int(torch.count_nonzero(r)) <= 6
    assert free == pytest.approx(float(torch.linalg.norm(u - f @ r)), rel=1e-12)
    assert free < eps2 * (1 - 1e-6)


def test_cluttered_digits_deterministic_and_split():
    a = cluttered_digits(0, canvas=12, limit=60)  # 42 training digits twice, 18 test digits once
    b = cluttered_digits(0, canvas=12, limit=60)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert a.x_train.shape == (84, 1, 12, 12) and a.x_test.shape == (18, 1, 12, 12)
    assert torch.equal(a.y_train[:42], a.y_train[42:]) and not torch.equal(a.x_train[:42], a.x_train[42:])
    assert float(a.x_train.min()) >= 0.0 and float(a.x_train.max()) <= 1.0
    c = cluttered_digits(1, canvas=12, limit=60)
    assert not torch.equal(a.x_train, c.x_train)
    with pytest.raises(ValueError, match="canvas"):
        cluttered_digits(0, canvas=6)


def test_cli_tiny_structure_and_determinism(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["repro", "interspace", "--tiny", "--out", str(tmp_path / name), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'b' / 'interspace.md'}" in out
    a = json.loads((tmp_path / "a" / "interspace.json").read_text())
    b = json.loads((tmp_path / "b" / "interspace.json").read_text())
    for d in (a, b):
        d.pop("wall_s"), d.pop("command")
    assert a == b
    claims = [c["claim"] for c in a["claims"]]
    assert any("fixed support" in c for c in claims) and any("free support" in c for c in claims)
    assert any(c.startswith("IP beats SP at equal eq. 9 rate") for c in claims)
    pair = a["data"]["pairs"][0]
    # equal eq. 9 rates once the bases are dense; IP never holds more non-zeros than SP
    assert pair["p_sp"] - 1e-12 <= pair["p_ip"] <= pair["p_sp"] + 2 * 81 / 1000
    assert (tmp_path / "a" / "interspace.png").stat().st_size > 1000


@pytest.mark.slow
def test_cli_job_pieces_merge_to_the_whole_run(tmp_path, capsys):
    base = ["repro", "interspace", "--tiny", "--no-progress"]
    assert main(base + ["--out", str(tmp_path / "whole")]) == 0
    for jobs in ("theorem", "dense,random"):
        assert main(base + ["--interspace-jobs", jobs, "--out", str(tmp_path / jobs.replace(",", "_"))]) == 0
    assert main(base + ["--merge", f"{tmp_path / 'dense_random'},{tmp_path / 'theorem'}", "--out",
                        str(tmp_path / "m")]) == 0
    whole = json.loads((tmp_path / "whole" / "interspace.json").read_text())
    merged = json.loads((tmp_path / "m" / "interspace.json").read_text())
    whole["data"]["jobs"] = sorted(whole["data"]["jobs"])
    assert merged["data"] == whole["data"] and merged["claims"] == whole["claims"]
    with pytest.raises(ValueError, match="--interspace-jobs"):
        main(base + ["--interspace-jobs", "grasp", "--out", str(tmp_path / "x")])
    capsys.readouterr()
