import json
import os
import re
import subprocess
import sys

import pytest

from prunopt.cli import build_parser, main

SUMMARY = re.compile(r"^summary: method=(\S+) dense_acc=([0-9.]+) pruned_acc=([0-9.]+) density=([0-9.]+) sparsity=([0-9.]+)")


def test_train_probmask_tiny(tmp_path, capsys):
    rc = main(["train", "--method", "probmask", "--density", "0.2", "--epochs", "2", "--limit", "300",
               "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = SUMMARY.match(line)
    assert m, line
    dense, pruned, density, sparsity = map(float, m.groups()[1:])
    assert 0 <= pruned <= 1 and 0 <= dense <= 1
    assert abs(density - 0.2) < 1e-3 and abs(density + sparsity - 1) < 1e-6
    assert {"checkpoint.pt", "summary.json", "history.png"} <= set(os.listdir(tmp_path))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]  # atomic writes left nothing behind
    assert json.load(open(tmp_path / "summary.json"))["method"] == "probmask"


@pytest.mark.parametrize("argv", [
    ["train", "--method", "probmask", "--density", "1.5"],
    ["train", "--method", "nope"],
    ["train", "--method", "probmask", "--epochs", "0"],
    ["train", "--method", "probmask", "--density", "0.1", "--sparsity", "0.9"],
])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "prunopt.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout and "bench" in out.stdout
