"""Shared helpers of the ``prunopt train`` job tests: child processes (plain and
torchrun), summary lines, saved weights."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import torch

import prunopt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(prunopt.__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
STOP_DRIVER = os.path.join(HERE, "_stop_after_checkpoint.py")
LINEAR_DRIVER = os.path.join(HERE, "_linear_method.py")
TIMEOUT = 600  # seconds; an oversubscribed 2-core machine runs these child processes slowly


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for v in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(v, None)
    env["PYTHONFAULTHANDLER"] = "1"  # a child killed by a signal prints where its Python threads were
    env.update(extra)
    return env


# A C++ std::terminate in a torchrun worker with no Python exception: seen once on
# CI (rank 0 of a resumed FSDP2 run), never reproduced here in 47 runs; where
# it came from is printed by the faulthandler (PYTHONFAULTHANDLER above).
ABORT_WITHOUT_EXCEPTION = "terminate called without an active exception"


def assert_torchrun_finished(r: subprocess.CompletedProcess) -> None:
    """``r`` (a torchrun of ``prunopt train``) exited 0, or it finished the
    job (rank 0 printed the summary line, after writing and committing the
    run) and a worker then aborted in C++ on the way out: that abort is
    reported as a warning with its output, and the caller's checks of the
    written run decide the test."""
    if r.returncode != 0 and ABORT_WITHOUT_EXCEPTION in r.stderr and summary_lines(r.stdout):
        import warnings

        warnings.warn(f"a torchrun worker aborted after the job finished:\n{r.stderr[-3000:]}")
        return
    assert r.returncode == 0, r.stderr[-3000:]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_prefix(nproc: int = 2) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}"]


def run_child(argv: List[str], cwd: Optional[str] = None, timeout: float = TIMEOUT, **env) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=child_env(**env))


def summary_lines(stdout: str) -> List[str]:
    return [line for line in stdout.splitlines() if line.startswith("summary: ")]


def summary_fields(line: str) -> dict:
    return dict(re.findall(r"(\w+)=(\S+)", line))


def weights(run_dir) -> dict:
    """The model state dict saved in a finished run's checkpoint.pt."""
    return torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=False)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


class StoppedChild:
    """A ``prunopt train`` child process (plain or under torchrun) that stops
    right after writing its ``after``-th checkpoint (``_stop_after_checkpoint.py``)
    and waits; :meth:`kill` then sends it a signal (to its whole process group)."""

    def __init__(self, train_argv: List[str], after: int, cwd: str, torchrun: int = 0, **env):
        prefix = torchrun_prefix(torchrun) if torchrun else [sys.executable]
        argv = prefix + [STOP_DRIVER, str(after), "train"] + train_argv
        fd, self.marker = tempfile.mkstemp(prefix="prunopt-stop-")
        os.close(fd)
        os.unlink(self.marker)
        # files, not pipes: a chatty child cannot block on them
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=child_env(PRUNOPT_TEST_STOP_MARKER=self.marker, **env),
                                     stdout=self._out, stderr=self._err, text=True, start_new_session=True)
        self.after = after

    def wait_for_checkpoint(self, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.marker):
                os.unlink(self.marker)
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the child ended ({self.proc.returncode}) before checkpoint {self.after}: "
                                     f"{self._read(self._err)[-3000:]}")
            time.sleep(0.05)
        self.kill(signal.SIGKILL)
        raise AssertionError(f"no checkpoint {self.after} within {timeout} s")

    def _descendants(self) -> List[int]:
        """Every process below the child (torchrun's workers lead their own sessions, out of its group)."""
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            kids = [p for p, pp in parents.items() if pp == pid]
            found += kids
            todo += kids
        return found

    def kill(self, sig=signal.SIGKILL, timeout: float = 60) -> int:
        below = self._descendants() if sig == signal.SIGKILL else []
        os.killpg(self.proc.pid, sig)
        for pid in below:  # a SIGKILLed torchrun cannot stop its workers: kill them as well
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.stdout, self.stderr = self._read(self._out), self._read(self._err)
        return self.proc.returncode

    @staticmethod
    def _read(f) -> str:
        f.seek(0)
        return f.read()
