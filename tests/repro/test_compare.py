"""``prunopt compare``: SP and IP at equal eq. 9 rate, over seeds, written with
the user's umask, repeatable with a thread count."""
import json
import os
import stat

import pytest

from prunopt.cli import main
from prunopt.pruning.selection import kept_count
from prunopt.train.methods.toolkit import equal_rate_sparsity


@pytest.mark.parametrize("p", [0.5, 0.85, 0.9, 0.95, 0.98, 0.99])
@pytest.mark.parametrize("D,fb", [(14288, 243), (14288, 81), (1000, 0), (19384, 162)])
def test_equal_rate_sparsity_keeps_sp_budget_minus_bases(p, D, fb):
    keep_sp = kept_count(p, D)
    p_sp = 1 - keep_sp / D
    q = equal_rate_sparsity(p_sp, D, fb)
    if keep_sp - fb < 1:
        assert q is None
        return
    keep_ip = kept_count(q, D)  # what the IP run keeps (eq. A.39)
    assert keep_ip == keep_sp - fb
    assert 1 - (keep_ip + fb) / D == pytest.approx(p_sp, abs=1e-15)  # eq. 9: p_IP = p_SP
    # and through the CLI's round trip (repr, 1 - density)
    assert kept_count(1.0 - (1.0 - float(repr(q))), D) == keep_ip


def test_compare_equal_rate_seeds_umask_and_determinism(tmp_path, capsys):
    argv = ["compare", "--method", "pai-random", "--sparsities", "0.9,0.999", "--epochs", "1", "--limit", "100",
            "--seeds", "2", "--threads", "1", "--no-progress"]
    old = os.umask(0o027)
    try:
        for name in ("a", "b"):
            assert main(argv + ["--out", str(tmp_path / name)]) == 0
    finally:
        os.umask(old)
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'a' / 'compare_pai-random.md'}" in out
    for f in ("compare_pai-random.md", "compare_pai-random.json", "compare_pai-random.png"):
        assert stat.S_IMODE(os.stat(tmp_path / "a" / f).st_mode) == 0o640
    a = json.loads((tmp_path / "a" / "compare_pai-random.json").read_text())
    b = json.loads((tmp_path / "b" / "compare_pai-random.json").read_text())
    assert a == b  # same seeds and thread count: the same runs
    assert a["seeds"] == [0, 1] and [len(r["runs"]) for r in a["rows"]] == [2, 2]
    for run in a["rows"][0]["runs"]:
        # the IP run keeps SP's budget minus every basis entry: p_IP = p_SP once the bases are dense, and IP
        # never has more non-zeros than SP (a basis entry still at 0 after this 1-epoch run lowers p_IP's count)
        keep_sp = kept_count(0.9, a["D"])
        assert kept_count(run["ip_coefficient_sparsity"], a["D"]) == keep_sp - a["basis_nonzero"]
        assert run["p_sp"] - 1e-12 <= run["p_ip"] <= run["p_sp"] + a["basis_nonzero"] / a["D"]
    assert all(run["ip_coefficient_sparsity"] is None and "ip_acc" not in run for run in a["rows"][1]["runs"])
    md = (tmp_path / "a" / "compare_pai-random.md").read_text()
    assert "| 0.900 | 2 |" in md and "no IP network at this rate" in md


@pytest.mark.slow
def test_compare_merge_of_seed_pieces(tmp_path, capsys):
    base = ["compare", "--method", "pai-random", "--sparsities", "0.9", "--epochs", "1", "--limit", "100",
            "--seeds", "1", "--threads", "1", "--no-progress"]
    for seed in (0, 1):
        assert main(base + ["--seed", str(seed), "--out", str(tmp_path / f"s{seed}")]) == 0
    assert main(["compare", "--method", "pai-random", "--merge", f"{tmp_path / 's1'},{tmp_path / 's0'}",
                 "--out", str(tmp_path / "m")]) == 0
    m = json.loads((tmp_path / "m" / "compare_pai-random.json").read_text())
    s0 = json.loads((tmp_path / "s0" / "compare_pai-random.json").read_text())
    assert m["seeds"] == [0, 1] and [r["seed"] for r in m["rows"][0]["runs"]] == [0, 1]
    assert m["rows"][0]["runs"][0] == s0["rows"][0]["runs"][0]
    with pytest.raises(ValueError, match="overlap"):
        main(["compare", "--method", "pai-random", "--merge", f"{tmp_path / 's0'},{tmp_path / 's0'}",
              "--out", str(tmp_path / "x")])
    capsys.readouterr()
