"""Test driver: ``python _stop_after_checkpoint.py N train ARGS...`` runs
``prunopt train ARGS...`` and, right after its N-th checkpoint is written
(N = 0: as soon as the job starts, before any checkpoint), writes
``CHECKPOINT N`` into the file ``$PRUNOPT_TEST_STOP_MARKER`` and waits to be killed: the kill-and-resume tests send
SIGKILL or SIGTERM then. ``PRUNOPT_TEST_METHOD_MODULE=_linear_method`` first
registers that module's test-only method."""
import importlib
import os
import sys
import time

from prunopt.cli import main
from prunopt.train import job

stop_after = int(sys.argv[1])
if os.environ.get("PRUNOPT_TEST_METHOD_MODULE"):  # a test-only method to register first
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    importlib.import_module(os.environ["PRUNOPT_TEST_METHOD_MODULE"]).register()


def wait(announce: bool = True) -> None:
    # under torchrun rank 0 alone announces, once its file is written; in a file, since torchrun's
    # agent may hold its workers' output in a buffer
    if announce:
        with open(os.environ["PRUNOPT_TEST_STOP_MARKER"], "w") as f:
            f.write(f"CHECKPOINT {stop_after}\n")
    time.sleep(600)


if stop_after == 0:
    _init = job.Job.__init__

    def init_then_wait(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        wait(self.is_main)

    job.Job.__init__ = init_then_wait
else:
    _save = job.Job._save_checkpoint

    def save_then_wait(self, *args):
        _save(self, *args)
        if self.checkpoints_written == stop_after:
            wait(self.is_main)

    job.Job._save_checkpoint = save_then_wait
sys.exit(main(sys.argv[2:]))
