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


@pytest.mark.parametrize("argv, message", [
    (["train", "--method", "probmask", "--density", "0"], "--density > 0"),
    (["train", "--method", "probmask", "--sparsity", "1"], "--density > 0"),
    (["train", "--method", "probmask", "--power", "-1"], "--power"),
    (["train", "--method", "probmask", "--score-lr", "0"], "--score-lr"),
    (["train", "--method", "probmask", "--finetune-epochs", "-1"], "--finetune-epochs"),
    (["train", "--method", "probmask", "--lr", "nan"], "--lr"),
    (["train", "--method", "probmask", "--lr", "0"], "--lr"),
    (["train", "--method", "snip", "--lr", "-0.1"], "--lr"),
    (["train", "--method", "lt", "--sparsity", "1"], "lottery"),
    (["train", "--method", "snip", "--score-batches", "0"], "--score-batches"),
    (["train", "--method", "lt", "--rewind-step", "-1"], "--rewind-step"),
    (["train", "--method", "set", "--update-interval", "0"], "--update-interval"),
    (["train", "--method", "ap", "--ap-tl", "0"], "--ap-tl"),
    (["train", "--method", "ap", "--ap-gamma", "-1"], "--ap-gamma"),
    (["train", "--method", "ds", "--ds-lambda", "inf"], "--ds-lambda"),
    (["train", "--method", "ds", "--ds-norm", "l21", "--ds-group", "3"], "--ds-group"),
    (["train", "--method", "prunadag", "--prunadag-relevant", "-0.5"], "--prunadag-relevant"),
    (["train", "--method", "prunadag", "--prunadag-relevant", "5"], "--prunadag-relevant"),  # was clamped to 1
    (["train", "--method", "prunadag", "--prunadag-relevant", "0"], "--prunadag-relevant"),
    (["compare", "--method", "snip", "--sparsities", "1.5"], "--sparsities"),
    (["compare", "--method", "snip", "--sparsities", ","], "--sparsities"),
    (["compare", "--method", "lt", "--sparsities", "0.5,1"], "lottery"),
])
def test_bad_values_are_usage_errors_before_any_work(argv, message, capsys, monkeypatch):
    from prunopt.train.methods import ap, ds, probmask, prunadag, toolkit

    def no_data(*args, **kwargs):
        raise AssertionError("the job started: the bad value was not caught at parse time")

    for module in (ap, ds, probmask, prunadag, toolkit):
        monkeypatch.setattr(module, "load_digits", no_data)
    with pytest.raises(SystemExit) as e:
        main(argv + ["--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err


def test_probmask_lr_zero_is_not_replaced_by_the_default():
    from argparse import Namespace

    from prunopt.train.methods.probmask import run

    # --lr 0 used to become 3e-3 (``args.lr or 3e-3``); a direct call now fails before any work
    with pytest.raises(ValueError, match="--lr"):
        run(Namespace(lr=0.0, density=0.5, seed=0, limit=10, epochs=1))


def test_python_dash_m_prunopt():
    out = subprocess.run([sys.executable, "-m", "prunopt", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout and "compare" in out.stdout
    out = subprocess.run([sys.executable, "-m", "prunopt", "train", "--method", "probmask", "--density", "0"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--density > 0" in out.stderr


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "prunopt.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout and "bench" in out.stdout
