"""prunopt repro ap: the Fig. 1 statistics, the reshuffle experiment's masks,
and the command's structure and determinism."""
import json

import pytest
import torch

from prunopt.cli import main
from prunopt.pruning.selection import kept_count
from prunopt.repro.ap import (
    _arch_shapes,
    fit,
    imp_architecture,
    parent_state,
    reshuffled,
    split_digits,
    uniform_random,
    window_stats,
    zero_one_digits,
)


def test_window_stats():
    s = window_stats([10.0, 9.0, 8.0, 7.0, 1.0, 3.0, 1.0, 3.0, 1.0, 3.0], frac=0.4)
    assert s["window_mean"] == pytest.approx(2.0) and s["last"] == 3.0
    assert s["window_rise"] == pytest.approx((2.0 + 2.0) / 2.0)  # two rises of 2 in the last 4 values
    assert window_stats([5.0, 4.0, 2.0, 1.0], frac=1.0)["window_rise"] == 0.0  # only decreasing: no oscillation
    with pytest.raises(ValueError):
        window_stats([])


def test_fit_is_seeded_and_t_s_changes_only_the_backward():
    x, y = zero_one_digits()
    a = fit(x, y, 1000.0, 10.0, 20, 1e-3, 0.5, 3)
    assert a == fit(x, y, 1000.0, 10.0, 20, 1e-3, 0.5, 3)
    b = fit(x, y, 1000.0, 1000.0, 20, 1e-3, 0.5, 3)
    assert a[0][0] == b[0][0]  # same start, same forward: the first objective agrees
    assert a[0][-1] != b[0][-1]


def _arch(density_per_layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(w.shape, generator=g) < d for w, d in zip(_arch_shapes(), density_per_layer)]


def test_reshuffle_keeps_layer_counts_and_random_keeps_the_global_count():
    arch = _arch([0.9, 0.3, 0.1, 0.5])
    r = reshuffled(arch, 1)
    assert [int(a.sum()) for a in r] == [int(a.sum()) for a in arch]
    assert any(not torch.equal(a, b) for a, b in zip(r, arch))
    u = uniform_random(arch, 1)
    assert sum(int(a.sum()) for a in u) == sum(int(a.sum()) for a in arch)
    assert [a.shape for a in u] == [a.shape for a in arch]


def test_imp_reaches_the_target_exactly():
    data = split_digits(0, n_new=20)
    state, _ = parent_state({"parent": tuple(t[:100] for t in data["parent"])}, 0, 1)
    masks = imp_architecture(state, {"parent": tuple(t[:100] for t in data["parent"])}, 0.8, 0)
    total = sum(m.numel() for m in masks)
    kept = sum(int(m.sum()) for m in masks)
    assert kept == kept_count(0.8, total)  # floor((1 - p) d), eq. A.39


def test_split_digits_tasks():
    d = split_digits(2, n_new=50)
    xtr, ytr, xte, yte = d["new"]
    assert len(ytr) == 50 and set(ytr.tolist()) == {5, 6, 7, 8, 9} and bool((yte >= 5).all())
    assert bool((d["parent"][1] < 5).all()) and bool((d["parent"][3] < 5).all())
    assert torch.equal(split_digits(2, n_new=50)["new"][0], xtr)


def test_cli_tiny_structure_and_determinism(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["repro", "ap", "--tiny", "--out", str(tmp_path / name), "--no-progress"]) == 0
    assert f"wrote {tmp_path / 'a' / 'ap.md'}" in capsys.readouterr().out
    a = json.loads((tmp_path / "a" / "ap.json").read_text())
    b = json.loads((tmp_path / "b" / "ap.json").read_text())
    for d in (a, b):
        d.pop("wall_s"), d.pop("command")
    assert a == b
    claims = [c["claim"] for c in a["claims"]]
    assert claims[0].startswith("t_s = t_l/100 reaches the lowest objective")
    assert any(c.startswith("Reshuffled AP masks transfer") for c in claims)
    assert len(a["data"]["fig1"]) == 3 * 2  # 3 ratios x 2 seeds at one learning rate
    assert (tmp_path / "a" / "ap.png").stat().st_size > 1000


@pytest.mark.slow
def test_cli_seed_pieces_merge_to_the_whole_run(tmp_path, capsys):
    """Seeds 0 and 1 run in two processes and merged give the two-seed run."""
    base = ["repro", "ap", "--tiny", "--no-progress"]
    assert main(base + ["--out", str(tmp_path / "whole")]) == 0
    for seed in (0, 1):
        assert main(base + ["--seed", str(seed), "--seeds", "1", "--out", str(tmp_path / f"s{seed}")]) == 0
    assert main(base + ["--merge", f"{tmp_path / 's1'},{tmp_path / 's0'}", "--out", str(tmp_path / "m")]) == 0
    whole = json.loads((tmp_path / "whole" / "ap.json").read_text())
    merged = json.loads((tmp_path / "m" / "ap.json").read_text())
    assert merged["data"] == whole["data"] and merged["claims"] == whole["claims"]
    assert "## How it was run" in (tmp_path / "m" / "ap.md").read_text()
    with pytest.raises(ValueError, match="overlap"):
        main(base + ["--merge", f"{tmp_path / 's0'},{tmp_path / 's0'}", "--out", str(tmp_path / "x")])
    capsys.readouterr()
