"""``torchrun -m prunopt train``: data-parallel training (DDP, ``--fsdp``) with
the one-process run's global minibatches, rank 0 alone writing and printing,
exact resume under torchrun; usage errors for what cannot run distributed."""
import os
import re
import signal
import sys

import pytest
import torch
import torch.multiprocessing as mp

from prunopt.cli import main
from prunopt.train.methods import METHODS
from prunopt.train.parallel import torchrun_environment

from _job_helpers import (HERE, LINEAR_DRIVER, StoppedChild, assert_same_weights, assert_torchrun_finished, free_port,
                          read_json, run_child, summary_fields, summary_lines, torchrun_prefix, weights)

TORCHRUN_ENV = dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")


@pytest.fixture
def linear_method():
    sys.path.insert(0, HERE)
    import _linear_method

    _linear_method.register()
    yield _linear_method.NAME
    METHODS.pop(_linear_method.NAME, None)


# -------------------------------------------------- sharding, in two spawned ranks
class _Recorder(torch.nn.Module):
    """A linear model that records which samples (their first pixel holds the index) each forward sees."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 10)
        self.seen = []

    def forward(self, x):
        self.seen.append(x[:, 0, 0, 0].long().tolist())
        return self.lin(x.flatten(1))


def _shard_worker(rank, port, n, batch, queue):
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import argparse

    from prunopt.train.job import Job
    from prunopt.train.parallel import process_group

    with process_group() as d:
        job = Job(argparse.Namespace(seed=0, progress=False, out=None), d)
        model = job.prepare(_Recorder())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.zeros(n, 1, 8, 8)
        x[:, 0, 0, 0] = torch.arange(n, dtype=torch.float32)
        y = torch.arange(n) % 10
        loss = job.train_epoch(model, opt, x, y, batch, torch.Generator().manual_seed(3))
        # plain lists: tensors would travel as shared memory of a process that is about to exit
        queue.put((rank, model.seen, loss, [p.detach().flatten().tolist() for p in model.parameters()]))


def test_each_rank_takes_its_slice_of_every_global_minibatch():
    n, batch = 23, 6  # minibatches 6, 6, 6, 5: the last one splits 3 / 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_shard_worker, args=(r, port, n, batch, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (seen, loss, params)) for r, seen, loss, params in (queue.get(timeout=240) for _ in procs))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
    for step, start in enumerate(range(0, n, batch)):
        global_batch = perm[start:start + batch]
        first, second = results[0][0][step], results[1][0][step]
        assert first + second == global_batch  # contiguous slices of the shared permutation
        assert abs(len(first) - len(second)) <= 1
    assert results[0][1] == pytest.approx(results[1][1])  # the epoch's loss is reduced over the ranks
    assert results[0][2] == results[1][2]  # replicas stay identical


# ------------------------------------------------------------- torchrun jobs
LINEAR = ["--limit", "200", "--batch-size", "33", "--epochs", "2", "--no-progress"]  # shards of 17 / 16, last 4 / 4


def test_ddp_and_fsdp_match_the_one_process_run(tmp_path, capsys, linear_method):
    argv = ["train", "--method", linear_method] + LINEAR
    assert main(argv + ["--threads", "1", "--out", str(tmp_path / "one")]) == 0
    one = summary_lines(capsys.readouterr().out)[-1]
    r = run_child(torchrun_prefix(2) + [LINEAR_DRIVER] + argv + ["--out", "ddp", ";;"] + argv
                  + ["--fsdp", "--out", "fsdp"], cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = summary_lines(r.stdout)
    assert len(lines) == 2  # rank 0 alone prints: one line per run
    assert r.stdout.count("prunopt train: wrote") == 2
    for line, kind in zip(lines, ("ddp", "fsdp")):
        assert summary_fields(line)["world_size"] == "2"
        assert line.replace("world_size=2", "world_size=1") == one  # same accuracy
        w, ref = weights(tmp_path / kind), weights(tmp_path / "one")
        assert w.keys() == ref.keys()
        for k in ref:  # the same global minibatches: the same training up to rounding
            torch.testing.assert_close(w[k], ref[k], rtol=1e-5, atol=1e-6)
        assert read_json(tmp_path / kind / "run.json")["world_size"] == 2


def test_torchrun_method_like_one_process(tmp_path, capsys):
    argv = ["train", "--method", "prunadag", "--sparsity", "0.5", "--limit", "600", "--epochs", "8", "--no-progress"]
    assert main(argv + ["--threads", "1"]) == 0
    one = summary_fields(summary_lines(capsys.readouterr().out)[-1])
    r = run_child(torchrun_prefix(2) + ["-m", "prunopt"] + argv + ["--out", "run"], cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = summary_lines(r.stdout)
    assert len(lines) == 1 and "it/s" not in r.stderr  # one summary, no progress bar from any rank
    two = summary_fields(lines[0])
    assert two["world_size"] == "2" and one["world_size"] == "1"
    assert float(two["density"]) == pytest.approx(float(one["density"]), abs=1e-3)
    # BatchNorm sees each rank's half batch: comparable, not equal, accuracy (both trained: chance is 0.1)
    for key in ("dense_acc", "pruned_acc"):
        assert float(one[key]) > 0.6 and float(two[key]) > 0.6, (key, one[key], two[key])
        assert abs(float(two[key]) - float(one[key])) <= 0.1, (key, one[key], two[key])
    assert sorted(os.listdir(tmp_path)) == ["run"]
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint.pt", "history.png", "run.json", "summary.json"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_torchrun_resumes_bit_exactly(kind, tmp_path, linear_method):
    if kind == "ddp":  # a real method: BatchNorm buffers, PrunAdag state
        argv, env = ["--method", "prunadag", "--limit", "300", "--epochs", "2", "--no-progress"], {}
        launch = ["-m", "prunopt"]
    else:
        argv, env = ["--method", linear_method, "--fsdp"] + LINEAR, {"PRUNOPT_TEST_METHOD_MODULE": "_linear_method"}
        launch = [LINEAR_DRIVER]
    whole = run_child(torchrun_prefix(2) + launch + ["train"] + argv + ["--out", "whole"], cwd=str(tmp_path))
    assert_torchrun_finished(whole)
    child = StoppedChild(argv + ["--out", "cut"], 1, cwd=str(tmp_path), torchrun=2, **env)
    child.wait_for_checkpoint()
    child.kill(signal.SIGKILL)
    assert (tmp_path / ".cut.partial" / "resume.pt").is_file() and not (tmp_path / "cut").exists()
    resumed = run_child(torchrun_prefix(2) + launch + ["train", "--resume", "cut", "--no-progress"], cwd=str(tmp_path))
    assert_torchrun_finished(resumed)
    assert summary_lines(resumed.stdout) == summary_lines(whole.stdout)
    assert_same_weights(weights(tmp_path / "cut"), weights(tmp_path / "whole"))
    assert not (tmp_path / ".cut.partial").exists()


# ------------------------------------------------------------- usage errors
def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    return err


def test_every_method_runs_under_fsdp():
    assert sorted(n for n, e in METHODS.items() if e.fsdp is not None) == []


def test_fsdp_is_a_usage_error_where_a_method_cannot_shard(capsys, monkeypatch):
    from prunopt.train.methods import register_method

    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    register_method("unsharded-test", lambda args, job=None: None, "a method that cannot run sharded",
                    fsdp="its state cannot be sharded")
    try:
        err = _usage_error(["train", "--method", "unsharded-test", "--fsdp"], capsys)
    finally:
        METHODS.pop("unsharded-test")
    assert "--fsdp is not supported by --method unsharded-test yet: its state cannot be sharded" in err


def test_fsdp_needs_torchrun(capsys):
    assert "launch with torchrun" in _usage_error(["train", "--method", "prunadag", "--fsdp"], capsys)


@pytest.mark.parametrize("argv", [["compare", "--method", "snip"], ["repro", "prunadag"], ["bench", "--quick"]])
def test_single_process_commands_refuse_torchrun(argv, capsys, monkeypatch):
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    assert "runs in one process" in _usage_error(argv, capsys)


def test_torchrun_environment(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    assert torchrun_environment() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK, LOCAL_RANK, MASTER_ADDR missing"):
        torchrun_environment()
    for k, v in dict(RANK="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="inconsistent"):
        torchrun_environment()
    monkeypatch.setenv("RANK", "1")
    assert torchrun_environment() == (1, 2, 0)
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match=re.escape("RANK must be an integer")):
        torchrun_environment()


def test_the_process_group_ends_with_a_barrier_on_a_normal_exit_only(monkeypatch):
    """A job's process group meets every rank a last time before it is
    destroyed (so that no gloo worker still releases the last collective's
    tensors as the interpreter ends); after an error it is destroyed at once
    (another rank may never come) and the error goes through."""
    import torch.distributed as dist

    import prunopt.train.parallel as parallel

    port = free_port()
    for k, v in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    calls = []
    inner = parallel.end_process_group
    monkeypatch.setattr(parallel, "end_process_group", lambda: calls.append(dist.is_initialized()) or inner())
    with parallel.process_group() as d:
        assert d.world_size == 1 and dist.is_initialized()
    assert calls == [True] and not dist.is_initialized()
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(KeyError, match="stop"):
        with parallel.process_group():
            raise KeyError("stop")
    assert calls == [True] and not dist.is_initialized()


def test_rank_0_alone_checks_out(tmp_path, monkeypatch, capsys):
    """Rank 0 alone writes --out, so it alone checks it: a rank that parses its
    arguments after rank 0 has created the staging directory must not take it
    for an interrupted run (it exited with a usage error, and rank 0 stopped in
    its next collective)."""
    from prunopt.cli import build_parser, check_arguments
    from prunopt.train.output import staging_path

    out = tmp_path / "run"
    os.makedirs(staging_path(str(out)))  # what rank 0 creates when its run starts
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    argv = ["train", "--method", "prunadag", "--out", str(out)]
    assert "an interrupted run is staged" in _usage_error(argv, capsys)  # rank 0 still checks
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    parser = build_parser()
    args = check_arguments(parser, parser.parse_args(argv))
    assert args.out == str(out)
