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
    INVESTIGATIONS,
    _int_keys,
    METHODS,
    batched_prunadag_step,
    dct_matrix,
    make_matrix,
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


def test_a6_is_the_first_rows_of_the_dct():
    n, m = 16, 5
    dct = dct_matrix(n)
    torch.testing.assert_close(dct @ dct.t(), torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(make_matrix("A6", m, n, g), dct[:m])
    # the other reading: m distinct rows of the same matrix, drawn with the generator
    a6r = make_matrix("A6r", m, n, torch.Generator().manual_seed(1))
    rows = [int(torch.argmin((dct - r).abs().sum(1))) for r in a6r]
    assert len(set(rows)) == m and torch.equal(a6r, dct[rows])
    # A6 and A6r share x* and the start, so only the matrix differs
    _, b6, x6 = least_squares_problems("A6", 2, 0, m, n)
    A6r, b6r, x6r = least_squares_problems("A6r", 2, 0, m, n)
    assert torch.equal(x6, x6r) and not torch.equal(b6, b6r)
    with pytest.raises(ValueError, match="problem"):
        least_squares_problems("A7", 1, 0, m, n)


def test_ratio_set_and_fw2_rule_options():
    """The investigation's variants: the library's choices are the defaults, the
    others change the step as stated."""
    g = torch.Generator().manual_seed(5)
    B, n, T, k = 3, 30, 4, 2
    x = torch.randn(B, n, generator=g, dtype=torch.float64)
    grad = torch.randn(B, n, generator=g, dtype=torch.float64)
    so = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.01
    sd = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.01
    base = batched_prunadag_step(x, grad, so, sd, k, T, 1)
    for a, b in zip(base, batched_prunadag_step(x, grad, so, sd, k, T, 1, ratio_set="M")):
        assert torch.equal(a, b)
    for a, b in zip(base, batched_prunadag_step(x, grad, so, sd, k, T, 1, ratio_set="prev_D", prev_dec=None)):
        assert torch.equal(a, b)  # no previous D yet: M
    every = torch.ones(B, n, dtype=torch.bool)  # prev_D is intersected with M: everything -> M
    for a, b in zip(base, batched_prunadag_step(x, grad, so, sd, k, T, 1, ratio_set="prev_D", prev_dec=every)):
        assert torch.equal(a, b)
    assert not torch.equal(batched_prunadag_step(x, grad, so, sd, k, T, 1, ratio_set="all")[0], base[0])
    x3, so3, sd3, dec = batched_prunadag_step(x, grad, so, sd, k, T, 3, return_decreasable=True)
    m = (x * grad > 0) & ~(grad.abs() >= grad.abs().topk(T, dim=1).values[:, -1:])
    assert torch.equal(x3[dec & ~m], x[dec & ~m])  # decreasable, not sign-matched: no step (eq. 2.16)
    assert bool((x3[dec & m].abs() <= x[dec & m].abs()).all())  # sign-matched: shrunk towards 0
    assert torch.equal(sd3[~dec], sd[~dec]) and torch.equal(so3[dec], so[dec])
    with pytest.raises(ValueError, match="ratio_set"):
        batched_prunadag_step(x, grad, so, sd, k, T, 1, ratio_set="D")
    # FW2 with the full gradient norm: eta = min(beta ||g|| / ||v - x||, 1)
    radius, beta = 5.0, 0.05
    xn = batched_sfw_step(x, grad, k, T, radius, "fw2", beta, fw2_rule="full_grad")
    for r in range(B):
        rel = grad[r].abs() >= grad[r].abs().topk(T).values.min()
        v = torch.where(rel, -radius * grad[r] / grad[r][rel].norm(), torch.zeros(n, dtype=torch.float64))
        eta = min(beta * float(grad[r].norm()) / float((v - x[r]).norm()), 1.0)
        torch.testing.assert_close(xn[r], x[r] + eta * (v - x[r]), rtol=1e-13, atol=1e-14)
    with pytest.raises(ValueError, match="fw2_rule"):
        batched_sfw_step(x, grad, k, T, radius, "fw2", beta, fw2_rule="other")


def _data_without_time(path):
    d = json.loads(path.read_text())
    for key in ("wall_s", "cpu_s"):
        d.pop(key)
        d["data"].pop(key, None)
    return d


def test_repro_tiny_is_deterministic(tmp_path, capsys):
    """The same seed and thread count give the same tables, twice."""
    for name in ("a", "b"):
        assert main(["repro", "prunadag", "--tiny", "--out", str(tmp_path / name), "--prunadag-problems", "A1,A6",
                     "--no-progress"]) == 0
    a, b = _data_without_time(tmp_path / "a" / "prunadag.json"), _data_without_time(tmp_path / "b" / "prunadag.json")
    assert a["command"].replace("/a ", "/b ") == b["command"]
    a.pop("command"), b.pop("command")
    assert a == b
    assert a["threads"] == 1 and a["seeds"] == [0] and a["data"]["runs"] == 2 and a["data"]["iters"] == 30
    assert {c["verdict"] for c in a["claims"]} <= {"reproduced", "qualitatively", "not reproduced"}
    assert set(a["data"]["omega"]) == {"A1", "A6"} and set(a["data"]["logistic"]) == {
        "digits-even-odd", "breast-cancer", "wine-1-vs-rest"}
    assert "wrote " in capsys.readouterr().out


def test_repro_command_tiny(tmp_path, capsys):
    """The command end to end at a tiny scale (2 runs, 3 iterations): tables with
    the paper's rows interleaved, JSON, PNG; then a merge of partial runs, some
    split by method."""
    common = ["--prunadag-runs", "2", "--prunadag-iters", "3", "--no-progress"]
    rc = main(["repro", "prunadag", "--out", str(tmp_path / "a"), "--prunadag-problems", "A1,A2",
               "--prunadag-logreg-iters", "2", *common])
    assert rc == 0
    md = (tmp_path / "a" / "prunadag.md").read_text()
    assert "| A1 (paper) | 10% | 2.2e-05 |" in md and "digits-even-odd" in md and "| A3 " not in md
    assert "| claim | paper value | prunopt value | verdict | note |" in md
    data = json.loads((tmp_path / "a" / "prunadag.json").read_text())["data"]
    assert data["runs"] == 2 and data["iters"] == 3 and set(data["rho"]) == {"A1", "A2"}
    assert data["convergence"]["A1"]["V3"]["mean_steps"] == 3.0
    assert (tmp_path / "a" / "prunadag.png").stat().st_size > 0
    for name, methods in (("b", "V1,V2,V3"), ("c", "V4,FW1,FW2,Adagrad")):
        rc = main(["repro", "prunadag", "--out", str(tmp_path / name), "--prunadag-problems", "A6",
                   "--prunadag-methods", methods, "--prunadag-logreg-iters", "0", *common])
        assert rc == 0
    merged = merge_reports([str(tmp_path / d) for d in "abc"])
    assert list(merged["rho"]) == ["A1", "A2", "A6"] and merged["logistic"] is not None
    assert list(merged["rho"]["A6"]) == METHODS
    b_json = json.loads((tmp_path / "b" / "prunadag.json").read_text())["data"]
    assert merged["rho"]["A6"]["V3"][10] == b_json["rho"]["A6"]["V3"]["10"]
    with pytest.raises(ValueError, match="lack A6/V4"):
        merge_reports([str(tmp_path / "a"), str(tmp_path / "b")])
    rc = main(["repro", "prunadag", "--out", str(tmp_path / "m"), "--prunadag-merge",
               ",".join(str(tmp_path / d) for d in "abc")])
    assert rc == 0 and "| A6 (paper) |" in (tmp_path / "m" / "prunadag.md").read_text()
    capsys.readouterr()


@pytest.mark.slow
def test_merge_of_runs_split_by_offset(tmp_path, capsys):
    """Runs 0-2 in one process and 3-4 in another merge to the means of runs
    0-4 in one process (rows are independent)."""
    common = ["repro", "prunadag", "--prunadag-problems", "A2",
              "--prunadag-iters", "40", "--prunadag-logreg-iters", "0", "--no-progress"]
    assert main(common + ["--prunadag-runs", "5", "--out", str(tmp_path / "all")]) == 0
    assert main(common + ["--prunadag-runs", "3", "--out", str(tmp_path / "lo")]) == 0
    assert main(common + ["--prunadag-runs", "2", "--prunadag-run-offset", "3", "--out", str(tmp_path / "hi")]) == 0
    whole = _int_keys(json.loads((tmp_path / "all" / "prunadag.json").read_text()))["data"]
    merged = merge_reports([str(tmp_path / "hi"), str(tmp_path / "lo")])
    assert merged["runs"] == 5
    for key in ("rho", "omega"):
        for meth in ("V3", "FW1"):
            for s in (10, 50, 90):
                assert merged[key]["A2"][meth][s] == pytest.approx(whole[key]["A2"][meth][s], rel=1e-12)
    c, w = merged["convergence"]["A2"]["V3"], whole["convergence"]["A2"]["V3"]
    assert (c["runs"], c["converged"]) == (w["runs"], w["converged"])
    assert c["mean_steps"] == pytest.approx(w["mean_steps"]) and c["grad_norm"] == pytest.approx(w["grad_norm"])
    with pytest.raises(ValueError, match="overlapping runs"):
        merge_reports([str(tmp_path / "all"), str(tmp_path / "lo")])
    capsys.readouterr()


def test_investigation_tiny(tmp_path, capsys):
    assert main(["repro", "prunadag", "--tiny", "--prunadag-investigate", "v2", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    d = json.loads((tmp_path / "prunadag_investigation.json").read_text())
    labels = [r["label"] for r in d["data"]["records"]]
    assert labels == [v[0] for v in INVESTIGATIONS["v2"]]
    assert [r["iters"] for r in d["data"]["records"]] == [30, 15, 30, 15]
    assert d["claims"][0]["claim"].startswith("v2:")
    # groups run in pieces merge into one report
    assert main(["repro", "prunadag", "--tiny", "--prunadag-investigate", "v1", "--out", str(tmp_path / "v1"),
                 "--no-progress"]) == 0
    assert main(["repro", "prunadag", "--prunadag-investigate", "v1,v2", "--merge", f"{tmp_path},{tmp_path / 'v1'}",
                 "--out", str(tmp_path / "m")]) == 0
    m = json.loads((tmp_path / "m" / "prunadag_investigation.json").read_text())
    assert [r["group"] for r in m["data"]["records"]] == ["v2"] * 4 + ["v1"] * len(INVESTIGATIONS["v1"])
    assert [c["claim"][:3] for c in m["claims"]] == ["v2:", "v1:"]
    capsys.readouterr()


def test_repro_rejects_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="--prunadag-problems"):
        main(["repro", "prunadag", "--out", str(tmp_path), "--prunadag-problems", "A9", "--no-progress"])
    with pytest.raises(ValueError, match="--prunadag-methods"):
        main(["repro", "prunadag", "--out", str(tmp_path), "--prunadag-methods", "V5", "--no-progress"])
    with pytest.raises(ValueError, match="--prunadag-investigate"):
        main(["repro", "prunadag", "--out", str(tmp_path), "--prunadag-investigate", "fw3", "--no-progress"])
