"""``prunopt train --resume``: a run killed after a checkpoint continues bit for
bit. Each test runs the whole job in this process, starts the same job in a
child process, kills it (SIGKILL) right after a checkpoint in the middle of a
phase, resumes it here and compares the summary line, summary.json and every
saved tensor with the uninterrupted run."""
import argparse
import fcntl
import json
import os
import signal

import pytest

from prunopt.cli import build_parser, check_arguments, main
from prunopt.train.job import run_info

from _job_helpers import StoppedChild, assert_same_weights, read_json, summary_lines, weights

COMMON = ["--limit", "200", "--batch-size", "32", "--threads", "1", "--no-progress"]

# (method, options, checkpoint after which the child is killed): always inside a later phase,
# so the resumed run replays the phases before it
CASES = [
    ("probmask", ["--epochs", "2"], 3),            # dense 2, masked 2, fine-tune 1: killed in "masked"
    ("prunadag", ["--epochs", "2"], 1),            # one phase of 2 epochs
    ("set", ["--epochs", "2", "--update-interval", "2"], 3),  # dense 2, set 2 (with drop-and-grow updates)
    ("ds", ["--epochs", "1"], 2),                  # dense 1, sparsify 2
    ("lt", ["--epochs", "1", "--sparsity", "0.5"], 3),  # five rounds; the rewind snapshot and round decisions
]
# in the default run (the others run with the slow-marked tests): a phased method and the lottery ticket
FAST = ("probmask", "lt")


@pytest.mark.parametrize("method, options, after", [
    c if c[0] in FAST else pytest.param(*c, marks=pytest.mark.slow) for c in CASES], ids=[c[0] for c in CASES])
def test_killed_run_resumes_bit_exactly(method, options, after, tmp_path, capsys):
    argv = ["--method", method] + options + COMMON
    assert main(["train"] + argv + ["--out", str(tmp_path / "whole")]) == 0
    whole = summary_lines(capsys.readouterr().out)[-1]

    child = StoppedChild(argv + ["--out", "cut"], after, cwd=str(tmp_path))
    child.wait_for_checkpoint()
    assert child.kill(signal.SIGKILL) == -signal.SIGKILL
    staging = tmp_path / ".cut.partial"
    assert not (tmp_path / "cut").exists()  # nothing half-written where the run goes
    assert (staging / "resume.pt").is_file() and (staging / "run.json").is_file()
    (staging / ".tmp-0123456789abcdef.pt").write_bytes(b"half a checkpoint")  # as a kill during a write leaves

    assert main(["train", "--resume", str(tmp_path / "cut"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert summary_lines(out)[-1] == whole
    assert f"wrote {tmp_path / 'cut'}" in out
    assert read_json(tmp_path / "cut" / "summary.json") == read_json(tmp_path / "whole" / "summary.json")
    assert_same_weights(weights(tmp_path / "cut"), weights(tmp_path / "whole"))
    assert not staging.exists()
    assert sorted(os.listdir(tmp_path / "cut")) == sorted(os.listdir(tmp_path / "whole"))


def test_sigterm_keeps_the_checkpoint_and_no_temporary(tmp_path):
    child = StoppedChild(["--method", "prunadag", "--epochs", "2", "--out", "run"] + COMMON, 1, cwd=str(tmp_path))
    child.wait_for_checkpoint()
    assert child.kill(signal.SIGTERM) == 128 + signal.SIGTERM
    assert "prunopt train --resume" in child.stderr and "Traceback" not in child.stderr
    assert sorted(os.listdir(tmp_path)) == [".run.partial"]
    assert sorted(os.listdir(tmp_path / ".run.partial")) == [".lock", "resume.pt", "run.json"]


def test_sigterm_before_the_first_checkpoint_leaves_nothing(tmp_path):
    child = StoppedChild(["--method", "prunadag", "--epochs", "2", "--out", "run"] + COMMON, 0, cwd=str(tmp_path))
    child.wait_for_checkpoint()
    assert child.kill(signal.SIGTERM) == 128 + signal.SIGTERM
    assert "nothing was written" in child.stderr
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------ option checks
def _staged(tmp_path, argv):
    """A staging directory as an interrupted ``train ARGV --out tmp/run`` leaves it."""
    parser = build_parser()
    args = check_arguments(parser, parser.parse_args(["train"] + argv + ["--out", str(tmp_path / "run")]))
    args.out = os.path.abspath(args.out)
    staging = tmp_path / ".run.partial"
    staging.mkdir()
    (staging / "run.json").write_text(json.dumps(run_info(args, 1)))
    (staging / "resume.pt").write_bytes(b"")
    return staging


def test_resume_takes_the_runs_options(tmp_path):
    staging = _staged(tmp_path, ["--method", "snip", "--sparsity", "0.7", "--epochs", "3"])
    parser = build_parser()
    for given in (str(tmp_path / "run"), str(staging)):
        args = check_arguments(parser, parser.parse_args(["train", "--resume", given, "--epochs", "3", "--no-progress"]))
        assert (args.method, args.epochs, args.progress) == ("snip", 3, False)
        assert args.density == pytest.approx(0.3) and args.resume == str(staging)
        assert args.out == str(tmp_path / "run")


@pytest.mark.parametrize("extra, message", [
    (["--epochs", "5"], "--epochs 5 differs"),
    (["--method", "lt"], "--method lt differs"),
    (["--seed", "1"], "--seed 1 differs"),
])
def test_resume_with_other_options_is_a_usage_error(extra, message, tmp_path, capsys):
    _staged(tmp_path, ["--method", "snip", "--epochs", "3"])
    with pytest.raises(SystemExit) as e:
        main(["train", "--resume", str(tmp_path / "run")] + extra)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err and "Traceback" not in err


def test_resume_errors(tmp_path, capsys, monkeypatch):
    def usage_error(argv):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "no interrupted run" in usage_error(["train", "--resume", str(tmp_path / "nowhere")])
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "summary.json").write_text("{}")
    assert "finished" in usage_error(["train", "--resume", str(finished)])

    staging = _staged(tmp_path, ["--method", "snip"])
    with open(staging / ".lock", "w") as f:  # another process writes this run
        fcntl.flock(f, fcntl.LOCK_EX)
        assert "in use" in usage_error(["train", "--resume", str(tmp_path / "run")])
    # a fresh run into the same --out must not start over the staged one
    assert "--resume" in usage_error(["train", "--method", "snip", "--out", str(tmp_path / "run")])
    for k, v in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)
    assert "same number of processes" in usage_error(["train", "--resume", str(tmp_path / "run")])


def test_resumed_namespace_round_trips_through_run_json(tmp_path):
    parser = build_parser()
    args = check_arguments(parser, parser.parse_args(["train", "--method", "ap", "--ap-gamma", "0.001",
                                                      "--out", str(tmp_path / "x")]))
    saved = json.loads(json.dumps(run_info(args, 1)))["args"]
    assert argparse.Namespace(**saved) == args
