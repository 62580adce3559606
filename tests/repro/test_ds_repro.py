"""prunopt repro ds: the statistics behind the DS Fig. 1-2 comparison, one
training run, and the command's structure and determinism."""
import json

import pytest
import torch

from prunopt.cli import main
from prunopt.repro.ds import sparsity_stats, train


def test_sparsity_stats_channel_and_group():
    # l1-like: zeros scattered over groups; l2,1-like: whole groups
    scattered = [torch.tensor([0.0, 1, 1, 1, 1, 0, 1, 1]), torch.tensor([1.0, 1, 0, 1])]
    grouped = [torch.tensor([0.0, 0, 0, 0, 1, 1, 1, 1]), torch.tensor([1.0, 2, 3, 4])]
    s = sparsity_stats(scattered, 4)
    assert s["channel_sparsity"] == pytest.approx(3 / 12)
    assert s["group_sparsity"] == 0.0 and s["zeros_in_zero_groups"] == 0.0
    assert s["layer_sparsity"] == [0.25, 0.25]
    g = sparsity_stats(grouped, 4)
    assert g["channel_sparsity"] == pytest.approx(4 / 12)
    assert g["group_sparsity"] == pytest.approx(1 / 3) and g["zeros_in_zero_groups"] == 1.0
    assert sparsity_stats([torch.ones(4)], 4)["zeros_in_zero_groups"] == 0.0


@pytest.mark.parametrize("norm", ["l1", "l21"])
def test_train_runs_and_exports(norm):
    r = train(norm, 0.1, 2, 150, 0, width=4)
    assert [g.numel() for g in r["gates"]] == [4, 8, 8]
    assert all(bool((g == 0.5).all()) for g in r["initial_gates"])  # eq. 12's initialisation
    assert 0.0 <= r["acc"] <= 1.0 and r["acc"] == pytest.approx(r["gated_acc"])  # the export changes nothing
    assert r["params"] <= r["dense_params"]
    with pytest.raises(ValueError, match="norm"):
        train("l2", 0.1, 1, 50, 0, width=4)


def test_cli_tiny_structure_and_determinism(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["repro", "ds", "--tiny", "--out", str(tmp_path / name), "--no-progress"]) == 0
    assert f"wrote {tmp_path / 'a' / 'ds.md'}" in capsys.readouterr().out
    a = json.loads((tmp_path / "a" / "ds.json").read_text())
    b = json.loads((tmp_path / "b" / "ds.json").read_text())
    for d in (a, b):
        d.pop("wall_s"), d.pop("command")
    assert a == b
    assert a["seeds"] == [0, 1] and len(a["data"]["runs"]["l1"]) == 2
    assert [c["claim"].split(" (")[0] for c in a["claims"]][:2] == [
        "Gates start at a_i = 0.5", "l1 and l2,1 reach a similar channel sparsity"]
    assert a["claims"][0]["verdict"] == "reproduced"
    md = (tmp_path / "a" / "ds.md").read_text()
    assert "| claim | paper value | prunopt value | verdict | note |" in md and "| l21 | 1 |" in md


@pytest.mark.slow
def test_cli_seed_pieces_merge_to_the_whole_run(tmp_path, capsys):
    """Seeds 0 and 1 run in two processes and merged give the two-seed run."""
    base = ["repro", "ds", "--tiny", "--no-progress"]
    assert main(base + ["--out", str(tmp_path / "whole")]) == 0
    for seed in (0, 1):
        assert main(base + ["--seed", str(seed), "--seeds", "1", "--out", str(tmp_path / f"s{seed}")]) == 0
    assert main(base + ["--merge", f"{tmp_path / 's1'},{tmp_path / 's0'}", "--out", str(tmp_path / "m")]) == 0
    whole = json.loads((tmp_path / "whole" / "ds.json").read_text())
    merged = json.loads((tmp_path / "m" / "ds.json").read_text())
    assert merged["data"] == whole["data"] and merged["claims"] == whole["claims"]
    assert "## How it was run" in (tmp_path / "m" / "ds.md").read_text()
    with pytest.raises(ValueError, match="overlap"):
        main(base + ["--merge", f"{tmp_path / 's0'},{tmp_path / 's0'}", "--out", str(tmp_path / "x")])
    capsys.readouterr()
