"""``prunopt train --out``: checked before any work, written as a unit with the
user's umask; every method refuses ``--sparsity 1``; ``--help`` describes every
method; the history of a run covers its phases on one epoch axis."""
import argparse
import os
import stat

import pytest

from prunopt.cli import build_parser, main
from prunopt.train.loop import Summary, atomic_save, atomic_write_text, save_history_plot
from prunopt.train.methods import METHODS

from _job_helpers import summary_lines

TINY = ["--epochs", "1", "--limit", "120", "--no-progress", "--threads", "1"]


def _no_work(monkeypatch):
    from prunopt.train.methods import ap, ds, probmask, prunadag, toolkit

    def no_data(*args, **kwargs):
        raise AssertionError("the job started: the bad value was not caught before any work")

    for module in (ap, ds, probmask, prunadag, toolkit):
        monkeypatch.setattr(module, "load_digits", no_data)


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    return err


def test_out_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    _no_work(monkeypatch)
    train = ["train", "--method", "prunadag", "--out"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert "not a directory" in _usage_error(train + [str(a_file)], capsys)
    assert "not a directory" in _usage_error(train + [str(a_file / "below")], capsys)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert "not a finished prunopt train run" in _usage_error(train + [str(busy)], capsys)
    if os.geteuid() == 0:  # root writes anywhere a permission allows: use a place no one can create in
        unwritable = "/proc/prunopt-test-out"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        unwritable = str(locked / "out")
    assert "cannot create" in _usage_error(train + [unwritable], capsys)
    assert sorted(os.listdir(tmp_path)) == sorted(["a_file", "busy"] + ([] if os.geteuid() == 0 else ["locked"]))


def test_run_directory_is_written_as_a_unit_with_the_umask(tmp_path, capsys):
    out = tmp_path / "deep" / "run"  # missing parents are created
    old = os.umask(0o027)
    try:
        assert main(["train", "--method", "prunadag", "--out", str(out)] + TINY) == 0
    finally:
        os.umask(old)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == f"prunopt train: wrote {out} (checkpoint.pt, history.png, run.json, summary.json)"
    assert lines[-1].startswith("summary: method=prunadag")
    assert sorted(os.listdir(out)) == ["checkpoint.pt", "history.png", "run.json", "summary.json"]
    assert os.listdir(tmp_path / "deep") == ["run"]  # no staging directory or temporary left
    for name in os.listdir(out):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o640, name
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o750

    # the same --out again: the finished run is replaced at the end, never mixed
    before = os.stat(out / "summary.json").st_mtime_ns
    assert main(["train", "--method", "prunadag", "--seed", "1", "--out", str(out)] + TINY) == 0
    assert '"seed": 1' in (out / "run.json").read_text()
    assert os.stat(out / "summary.json").st_mtime_ns != before
    assert os.listdir(tmp_path / "deep") == ["run"]


def test_atomic_writes_follow_the_umask_and_leave_no_temporary(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text("hello", str(tmp_path / "a.txt"))
        atomic_save({"x": 1}, str(tmp_path / "b.pt"))
        with pytest.raises((AttributeError, TypeError)):
            atomic_save({"x": lambda: 0}, str(tmp_path / "c.pt"))  # not picklable: nothing left behind
    finally:
        os.umask(old)
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.pt"]
    for name in ("a.txt", "b.pt"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_refuses_sparsity_one(method, capsys, monkeypatch):
    _no_work(monkeypatch)
    err = _usage_error(["train", "--method", method, "--sparsity", "1", "--no-progress"], capsys)
    assert "--density > 0" in err or "lottery" in err


def test_compare_refuses_sparsity_one(capsys, monkeypatch):
    _no_work(monkeypatch)
    assert "--sparsities 1.0" in _usage_error(["compare", "--method", "snip", "--sparsities", "0.5,1"], capsys)


def test_help_describes_every_method():
    text = build_parser().subparsers["train"].format_help()
    listed = {line.split()[0]: line for line in text.split("methods (--method):")[1].splitlines()[1:]
              if line.startswith("  ") and line.split()}
    for name, entry in METHODS.items():
        assert name in listed and entry.help in listed[name]
        assert len(entry.help.split()) >= 4, name  # a description, not a name


def test_history_covers_the_phases_on_one_axis(tmp_path):
    from prunopt.train.job import Job
    from prunopt.train.methods.probmask import run

    parser = build_parser()
    args = parser.parse_args(["train", "--method", "probmask", "--epochs", "2", "--limit", "120", "--no-progress"])
    args.density = 0.2
    job = Job(args)
    summary = run(args, job)
    phases = job.history["phases"]
    assert [p["name"] for p in phases] == ["dense", "masked", "fine-tune"]
    assert [p["first"] for p in phases] == [1, 3, 5]
    records = job.history["epochs"]
    assert [r["epoch"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["phase"] for r in records] == ["dense"] * 2 + ["masked"] * 2 + ["fine-tune"]
    assert all("test accuracy" in r for r in records)
    assert records[-1]["density"] == pytest.approx(summary.density)
    path = tmp_path / "history.png"
    save_history_plot(job.history, str(path), "probmask", summary)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_direct_call_without_a_job_writes_nothing(tmp_path, monkeypatch):
    from prunopt.train.methods.prunadag import run

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["train", "--method", "prunadag", "--out", "x"] + TINY)
    args.density = 0.5
    s = run(args)
    assert isinstance(s, Summary) and s.extra["world_size"] == 1
    assert os.listdir(tmp_path) == []


def test_summary_line_is_the_last_line(tmp_path, capsys):
    assert main(["train", "--method", "prunadag"] + TINY) == 0
    out = capsys.readouterr().out.splitlines()
    assert summary_lines("\n".join(out)) == [out[-1]] and "world_size=1" in out[-1]
    assert not any("wrote" in line for line in out)  # no --out: nothing written, nothing said


def test_train_needs_a_method(capsys):
    assert "--method is required" in _usage_error(["train"], capsys)


def test_namespace_check_for_direct_calls():
    from prunopt.train.methods import check_density

    with pytest.raises(ValueError, match="--density > 0"):
        check_density(argparse.Namespace(method="snip", density=0.0))
    check_density(argparse.Namespace(method="snip", density=0.5))
