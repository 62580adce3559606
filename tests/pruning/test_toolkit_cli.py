"""``prunopt train --method {pai-random,...,ft} --space ...`` and ``prunopt compare``
on tiny runs (--epochs 1 --limit 200)."""
import json
import os
import re

import pytest

from prunopt.cli import build_parser, main

TINY = ["--epochs", "1", "--limit", "200", "--no-progress", "--batch-size", "32"]
LINE = re.compile(r"^summary: method=(\S+) dense_acc=([\d.]+) pruned_acc=([\d.]+) density=([\d.]+) sparsity=([\d.]+) .*space=(\S+)")


def _run(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    m = LINE.match(out[-1])
    assert m, out[-1]
    return m, out[-1]


@pytest.mark.parametrize("method", ["pai-random", "snip", "synflow", "set", "gmp", "ft"])
def test_train_standard(method, capsys):
    m, line = _run(capsys, ["train", "--method", method, "--sparsity", "0.8"] + TINY)
    assert m.group(1) == method and m.group(6) == "standard"
    assert float(m.group(5)) == pytest.approx(0.8, abs=0.002)
    for g in (2, 3):
        assert 0.0 <= float(m.group(g)) <= 1.0


@pytest.mark.parametrize("method", ["grasp", "rigl", "lt"])
def test_train_interspace(method, capsys, tmp_path):
    out = tmp_path / "run"
    m, line = _run(capsys, ["train", "--method", method, "--space", "interspace", "--sparsity", "0.5", "--out", str(out)] + TINY)
    assert m.group(6) == "interspace"
    p_ip = float(re.search(r"p_ip=([\d.]+)", line).group(1))
    p_sp = float(re.search(r"p_sp=([\d.]+)", line).group(1))
    assert p_ip < p_sp  # eq. 9: the bases count as parameters
    if method == "lt":  # the classifier stays dense: the overall rate is a bit lower
        assert 0.45 < p_sp < 0.5
    else:
        assert p_sp == pytest.approx(0.5, abs=0.002)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and os.path.exists(out / "checkpoint.pt")


def test_train_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--method", "snip", "--space", "fourier"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--method", "snip", "--sparsity", "1.5"])
    with pytest.raises(SystemExit) as e:  # a usage error at parse time, before any training
        main(["train", "--method", "snip", "--sparsity", "0.5", "--score-batches", "0"] + TINY)
    assert e.value.code == 2 and "--score-batches" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_writes_table_and_plot(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--method", "snip", "--sparsities", "0.5,0.9", "--epochs", "1", "--limit", "200",
                 "--out", str(out), "--no-progress"]) == 0
    md = (out / "compare_snip.md").read_text()
    assert "| 0.500 |" in md and "| 0.900 |" in md
    assert (out / "compare_snip.png").stat().st_size > 1000
