"""Reproducible runs: the same command, seed and thread count give the same
summary line, in separate processes and one after the other in one process."""
import sys

import pytest

from prunopt.cli import main

from _job_helpers import run_child, summary_lines


@pytest.mark.slow
def test_same_command_same_summary_in_separate_processes(tmp_path):
    argv = [sys.executable, "-m", "prunopt", "train", "--method", "ds", "--epochs", "1", "--limit", "300",
            "--threads", "2", "--no-progress"]
    lines = []
    for _ in range(2):
        r = run_child(argv, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]
        lines += summary_lines(r.stdout)
    assert len(lines) == 2 and lines[0] == lines[1]


@pytest.mark.parametrize("method", ["probmask", "rigl"])  # the global RNG (Gumbel noise); generators (regrowth)
def test_same_command_same_summary_in_one_process(method, capsys):
    argv = ["train", "--method", method, "--epochs", "2", "--limit", "200", "--batch-size", "32",
            "--update-interval", "2", "--no-progress"]
    lines = []
    for _ in range(2):
        assert main(argv) == 0
        lines += summary_lines(capsys.readouterr().out)
    assert len(lines) == 2 and lines[0] == lines[1]
