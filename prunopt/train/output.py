"""``prunopt train --out DIR``: a run's files are written as one unit.

A run writes into a staging directory next to ``DIR``, ``.<name>.partial``
(same parent, so the final rename stays on one filesystem), and renames it to
``DIR`` when every file is written. ``DIR`` therefore never holds a half
run: it is absent (or holds the previous run, which is replaced only at the
end) until the new run is complete.

While the run trains, the staging directory holds ``run.json`` (the options,
written first) and ``resume.pt`` (the latest checkpoint, replaced atomically
after every epoch or every ``--checkpoint-every`` epochs). Every file is
written to a temporary ``.tmp-*`` file first and renamed.

If the run stops early (an error, Ctrl-C, SIGTERM, SIGHUP) the temporary files
are removed; the staging directory is kept when it holds a checkpoint (continue
with ``prunopt train --resume DIR``) and removed otherwise. After a SIGKILL
(which no process can catch) the staging directory stays as it is; a resumed
run removes any ``.tmp-*`` file left in it. A lock (``flock`` on
``.lock``) keeps two processes from writing one staging directory.

Files are created with the user's umask (``0o666 & ~umask``, directories
``0o777 & ~umask``).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
from typing import List, Optional

#: the files of a finished run (``history.png`` when the method records a history)
RUN_FILES = ("run.json", "checkpoint.pt", "summary.json", "history.png")
CHECKPOINT = "resume.pt"
RUN_INFO = "run.json"
LOCK = ".lock"
_SUFFIX = ".partial"


def staging_path(out: str) -> str:
    """The staging directory of ``--out out``: ``<parent>/.<name>.partial``."""
    out = os.path.abspath(out)
    parent, name = os.path.split(out.rstrip(os.sep))
    return os.path.join(parent, f".{name}{_SUFFIX}")


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _probe_writable(folder: str) -> Optional[str]:
    """None if a directory can be created in ``folder`` (tried for real: root,
    ACLs and read-only mounts all answer), else the reason."""
    probe = os.path.join(folder, f".prunopt-probe-{secrets.token_hex(6)}")
    try:
        os.mkdir(probe)
    except OSError as e:
        return os.strerror(e.errno) if e.errno else str(e)
    os.rmdir(probe)
    return None


def _is_finished_run(path: str) -> bool:
    names = set(os.listdir(path))
    return RUN_INFO in names and "summary.json" in names and names <= set(RUN_FILES)


def check_out(out: str) -> None:
    """``ValueError`` (the CLI's usage error) when ``--out out`` cannot take a
    new run, checked before any work: ``out`` exists and is not a directory;
    ``out`` is a non-empty directory that is not a finished ``prunopt train``
    run (a finished run is replaced at the end of the new one); an interrupted
    run is still staged next to it; or no directory can be created where
    ``out`` would go (a missing parent is created, a file on the way or an
    unwritable place is an error)."""
    if not isinstance(out, str) or not out.strip():
        raise ValueError("--out must name a directory")
    path = os.path.abspath(out)
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise ValueError(f"--out {out}: exists and is not a directory")
        if os.listdir(path) and not _is_finished_run(path):
            raise ValueError(f"--out {out}: is a non-empty directory that is not a finished prunopt train run "
                             "(choose a new or empty directory)")
    staging = staging_path(path)
    if os.path.lexists(staging):
        raise ValueError(f"--out {out}: an interrupted run is staged in {staging}; continue it with "
                         f"--resume {out}, or delete that directory to start afresh")
    base = _nearest_existing(os.path.dirname(path))
    if not os.path.isdir(base):
        raise ValueError(f"--out {out}: {base} is not a directory")
    reason = _probe_writable(base)
    if reason is not None:
        raise ValueError(f"--out {out}: cannot create a directory in {base} ({reason})")


def find_resumable(path: str) -> str:
    """The staging directory that ``--resume path`` continues: ``path`` itself
    when it is one (holds ``run.json`` and ``resume.pt``), else the staging
    directory of ``--out path``. ``ValueError`` when there is none, or when
    another process holds its lock."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError("--resume must name a run directory")
    candidates = [os.path.abspath(path), staging_path(path)]
    for c in candidates:
        if os.path.isfile(os.path.join(c, RUN_INFO)) and os.path.isfile(os.path.join(c, CHECKPOINT)):
            if not _lock_free(c):
                raise ValueError(f"--resume {path}: {c} is in use by another prunopt train process")
            return c
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "summary.json")):
        raise ValueError(f"--resume {path}: this run is finished; there is nothing to resume")
    raise ValueError(f"--resume {path}: no interrupted run there (looked for {CHECKPOINT} and {RUN_INFO} "
                     f"in {candidates[0]} and {candidates[1]})")


def read_run_info(staging: str) -> dict:
    """The ``run.json`` of a staging or run directory."""
    with open(os.path.join(staging, RUN_INFO), encoding="utf-8") as f:
        return json.load(f)


def _lock_free(folder: str) -> bool:
    try:
        fd = os.open(os.path.join(folder, LOCK), os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    finally:
        os.close(fd)  # closing releases a lock taken here
    return True


class RunDirectory:
    """The staging directory of one run (rank 0 only) and its final rename.

    Use :meth:`create` for a new run, :meth:`reopen` to resume one; write the
    files with :attr:`path` as their folder; then :meth:`commit` (rename into
    place) or :meth:`abort`."""

    def __init__(self, out: str, staging: str, lock_fd: int):
        self.out = out
        self.path = staging
        self._lock_fd = lock_fd

    @staticmethod
    def _lock(staging: str) -> int:
        fd = os.open(os.path.join(staging, LOCK), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RuntimeError(f"{staging} is in use by another prunopt train process") from None
        return fd

    @classmethod
    def create(cls, out: str, run_info: dict) -> "RunDirectory":
        """A new staging directory for ``--out out`` (missing parents are
        created), locked, with ``run.json`` written."""
        from prunopt.train.loop import atomic_write_text

        out = os.path.abspath(out)
        staging = staging_path(out)
        os.makedirs(os.path.dirname(staging), exist_ok=True)
        os.mkdir(staging)  # fails if another run is staged there
        try:
            fd = cls._lock(staging)
            atomic_write_text(json.dumps(run_info, indent=2, sort_keys=True) + "\n", os.path.join(staging, RUN_INFO))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls(out, staging, fd)

    @classmethod
    def reopen(cls, staging: str, out: str) -> "RunDirectory":
        """The staging directory of an interrupted run, locked, with the
        temporary files a killed process may have left removed."""
        fd = cls._lock(staging)
        d = cls(os.path.abspath(out), staging, fd)
        d.remove_temporaries()
        return d

    @property
    def checkpoint(self) -> str:
        return os.path.join(self.path, CHECKPOINT)

    def has_checkpoint(self) -> bool:
        return os.path.isfile(self.checkpoint)

    def remove_temporaries(self) -> List[str]:
        removed = []
        for name in os.listdir(self.path):
            if name.startswith(".tmp-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.path, name))
                removed.append(name)
        return removed

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def commit(self) -> str:
        """Renames the finished staging directory to ``out`` (a previous finished
        run there, or an empty directory, is replaced) and returns ``out``."""
        self.remove_temporaries()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.checkpoint)
        os.unlink(os.path.join(self.path, LOCK))
        old = None
        if os.path.lexists(self.out):
            if os.path.isdir(self.out) and os.listdir(self.out) and not _is_finished_run(self.out):
                raise RuntimeError(f"{self.out} was filled by something else during the run; the finished run "
                                   f"stays in {self.path}")
            old = os.path.join(os.path.dirname(self.out), f".{os.path.basename(self.out)}.old-{secrets.token_hex(4)}")
            os.rename(self.out, old)
        try:
            os.rename(self.path, self.out)
        except BaseException:
            if old is not None:
                os.rename(old, self.out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._unlock()
        return self.out

    def abort(self) -> bool:
        """After an error or a signal: removes the temporary files, and the
        whole staging directory unless it holds a checkpoint to resume from.
        Returns True when the directory is kept."""
        keep = False
        if os.path.isdir(self.path):
            self.remove_temporaries()
            keep = self.has_checkpoint()
            if not keep:
                shutil.rmtree(self.path, ignore_errors=True)
        self._unlock()
        return keep
