"""``prunopt repro prunadag``: the batched solver (the paper's 20 runs stacked as
rows) against the library optimizers, per-run stopping, and the command at a
tiny scale."""
import json

import pytest
import torch

from prunopt.cli import main
from prunopt.optim import SFW
from prunopt.reference.prunadag import TensorHyper, prunadag_step_reference
from prunopt.repro.prunadag import (
    METHODS,
    batched_prunadag_step,
    batched_sfw_step,
    least_squares_problems,
    merge_reports,
    solve,
    solve_batched,
)

FW = (50.0, 100.0, 0.001)


def _problem(runs=3, m=20, n=120, name="A1"):
    A, b, x0 = least_squares_problems(name, runs, 0, m, n)
    At, bb = A.transpose(1, 2), b.unsqueeze(1)

    def grad_batched(x):
        return torch.bmm(torch.bmm(x.unsqueeze(1), At) - bb, A).squeeze(1)

    def grad_one(r):
        return lambda x: A[r].t() @ (A[r] @ x - b[r])

    return x0, grad_batched, grad_one


@pytest.mark.parametrize("method", METHODS)
def test_batched_rows_match_library_optimizer(method):
    """Each row of the batched solve is the run the library optimizer makes alone."""
    x0, grad_b, grad_one = _problem()
    T, iters = 12, 40
    xb, steps = solve_batched(grad_b, x0, method, T, iters, 1e-9, FW)
    assert steps.tolist() == [iters] * 3
    for r in range(3):
        xp = solve(grad_one(r), x0[r], method, T, iters, 1e-9, FW)
        torch.testing.assert_close(xb[r], xp, rtol=1e-10, atol=1e-12)
    # a single run alone (B = 1) is the same as that row in the batch
    x1, _ = solve_batched(lambda x: grad_one(1)(x[0]).unsqueeze(0), x0[1:2], method, T, iters, 1e-9, FW)
    torch.testing.assert_close(x1[0], xb[1], rtol=1e-12, atol=1e-14)


def test_batched_per_run_stopping():
    """A run that meets ||g|| <= tol stops for good while the others go on, and
    stops exactly where the library optimizer's loop stops."""
    x0, grad_b, grad_one = _problem(runs=4)
    T, iters = 12, 80
    norms = []

    def recording(x):
        g = grad_b(x)
        norms.append(g.norm(dim=1))
        return g

    solve_batched(recording, x0, "V3", T, iters, 0.0, FW)
    best = torch.stack(norms).amin(0)  # a row stops iff its ||g|| at some check <= tol
    tol = float(best.min() + best.max()) / 2
    xb, steps = solve_batched(grad_b, x0, "V3", T, iters, tol, FW)
    assert (steps < iters).any() and (steps == iters).any()
    x_more, steps_more = solve_batched(grad_b, x0, "V3", T, iters + 30, tol, FW)
    for r in range(4):
        xp = solve(grad_one(r), x0[r], "V3", T, iters, tol, FW)
        torch.testing.assert_close(xb[r], xp, rtol=1e-10, atol=1e-12)
        if steps[r] < iters:
            assert grad_one(r)(xb[r]).norm() <= tol
            assert steps_more[r] == steps[r] and torch.equal(x_more[r], xb[r])  # a stopped run no longer changes


@pytest.mark.parametrize("version", [1, 2, 3, 4, "relevant_only"])
def test_batched_step_matches_reference(version):
    """One batched step equals the reference step of Algorithm 2.1 (Porcelli et al.) on every
    row, including ties at the threshold, zeros, k > 0, lr != 1 and eps > 0."""
    g = torch.Generator().manual_seed(3)
    B, n, T, k, lr, eps = 4, 50, 7, 5, 0.3, 1e-3
    x = torch.randn(B, n, generator=g, dtype=torch.float64)
    x[:, ::9] = 0.0
    grad = torch.randn(B, n, generator=g, dtype=torch.float64)
    grad[:, 1:4] = grad[:, :1]  # ties in |g|
    so = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.01
    sd = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.01
    xn, son, sdn = batched_prunadag_step(x, grad, so, sd, k, T, version, lr=lr, eps=eps)
    for r in range(B):
        xr, sor, sdr = x[r].clone(), so[r].clone(), sd[r].clone()
        prunadag_step_reference([xr], [grad[r]], [sor], [sdr], [TensorHyper(lr=lr, k=float(k), eps=eps)], T, version)
        torch.testing.assert_close(xn[r], xr, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(son[r], sor, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(sdn[r], sdr, rtol=1e-14, atol=1e-15)
    assert not torch.equal(xn, x)  # the inputs are not modified, the result moved


@pytest.mark.parametrize("rule", ["fw1", "fw2"])
@pytest.mark.parametrize("k", [0, 3])
def test_batched_sfw_step_matches_sfw(rule, k):
    g = torch.Generator().manual_seed(4)
    B, n, T = 3, 40, 5
    x = torch.randn(B, n, generator=g, dtype=torch.float64)
    grad = torch.randn(B, n, generator=g, dtype=torch.float64)
    xn = batched_sfw_step(x, grad, k, T, 7.0, rule, 0.2)
    for r in range(B):
        p = x[r].clone()
        opt = SFW([p], radius=7.0, relevant=T, step_rule=rule, beta=0.2)
        opt.state[p]["step"] = torch.tensor(float(k))  # the step counter k of eq. 1.3
        p.grad = grad[r]
        opt.step()
        torch.testing.assert_close(xn[r], p, rtol=1e-13, atol=1e-14)


def test_solve_batched_rejects_bad_input():
    x0, grad_b, _ = _problem()
    with pytest.raises(ValueError, match="method"):
        solve_batched(grad_b, x0, "V9", 12, 5, 0.0, FW)
    with pytest.raises(ValueError, match="x0"):
        solve_batched(grad_b, x0.float(), "V3", 12, 5, 0.0, FW)


def test_repro_command_tiny(tmp_path, capsys):
    """The command end to end at a tiny scale (2 runs, 3 iterations): tables with
    the paper's rows interleaved, JSON, PNG; then a merge of two partial runs."""
    common = ["--prunadag-runs", "2", "--prunadag-iters", "3", "--no-progress"]
    rc = main(["repro", "prunadag", "--out", str(tmp_path / "a"), "--prunadag-problems", "A1,A2",
               "--prunadag-logreg-iters", "2", *common])
    assert rc == 0
    md = (tmp_path / "a" / "prunadag.md").read_text()
    assert "| A1 (paper) | 10% | 2.2e-05 |" in md and "digits-even-odd" in md and "| A3 " not in md
    data = json.loads((tmp_path / "a" / "prunadag.json").read_text())
    assert data["runs"] == 2 and data["iters"] == 3 and set(data["least_squares"]) == {"A1", "A2"}
    assert data["convergence"]["A1"]["V3"]["mean_steps"] == 3.0
    assert (tmp_path / "a" / "prunadag_rho.png").stat().st_size > 0
    rc = main(["repro", "prunadag", "--out", str(tmp_path / "b"), "--prunadag-problems", "A6",
               "--prunadag-logreg-iters", "0", *common])
    assert rc == 0
    merged = merge_reports([str(tmp_path / "a"), str(tmp_path / "b")])
    assert list(merged["least_squares"]) == ["A1", "A2", "A6"] and merged["logistic"] is not None
    b_json = json.loads((tmp_path / "b" / "prunadag.json").read_text())
    assert merged["least_squares"]["A6"]["V3"][10] == b_json["least_squares"]["A6"]["V3"]["10"]
    rc = main(["repro", "prunadag", "--out", str(tmp_path / "m"), "--prunadag-merge",
               f"{tmp_path / 'a'},{tmp_path / 'b'}"])
    assert rc == 0 and "| A6 (paper) |" in (tmp_path / "m" / "prunadag.md").read_text()
    capsys.readouterr()


def test_repro_rejects_unknown_problem(tmp_path):
    with pytest.raises(ValueError, match="--prunadag-problems"):
        main(["repro", "prunadag", "--out", str(tmp_path), "--prunadag-problems", "A9", "--no-progress"])
