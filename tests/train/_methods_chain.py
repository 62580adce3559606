"""Runs several ``prunopt train`` jobs in one process (and, under torchrun, in
one process group): ``python _methods_chain.py ARGS [;; ARGS ...]``.

Each set runs to its end: a set that fails on every rank alike (an
exception raised by ``prunopt`` before it leaves any rank inside a
collective, e.g. a usage error or an optimizer refusing the parameters)
prints ``failed: ARGS: ERROR`` on rank 0 and the next set runs; the exit
status is then 1. (A failure on some ranks only would leave the others in a
collective: the process group's timeout ends them.)

A set of arguments that begins with ``--ghost-batch-norm`` runs with the
example CNN's batch norms replaced by :class:`GhostBatchNorm2d`, whose
training statistics are those of fixed groups of 8 samples. With a global
minibatch of 16 split over 2 ranks (and a training set of a multiple of 16
images), each rank normalises exactly the groups the one-process run
normalises, so the data-parallel run must give the one-process result up to
the rounding of the gradient sums. (With plain batch norms every rank
normalises its own part of the batch, as under plain DDP, and the runs are
only comparable.) :func:`ghost_batch_norm` applies the same replacement in a
test's own process, for the one-process reference.
"""
import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from prunopt.train.models import SmallCNN

FLAG = "--ghost-batch-norm"
#: the method modules that build the example CNN (ds converts its batch norms into sparse ones: not replaced)
MODULES = ("toolkit", "probmask", "prunadag", "ap")


class GhostBatchNorm2d(nn.BatchNorm2d):
    """``BatchNorm2d`` whose training statistics are those of consecutive
    groups of ``ghost`` samples of its input (ghost batch normalisation), the
    first group alone updating the running statistics.

    With a global minibatch of ``world * ghost`` samples, one process
    normalises the same groups as ``world`` ranks that hold ``ghost`` samples
    each, and rank 0's running statistics (which the job gives every rank
    after each epoch) are the one process's."""

    def __init__(self, num_features: int, ghost: int = 8):
        super().__init__(num_features)
        self.ghost = ghost

    def forward(self, x):
        if not self.training or x.shape[0] <= self.ghost:
            return super().forward(x)
        first = super().forward(x[: self.ghost])
        rest = [F.batch_norm(c, None, None, self.weight, self.bias, True, 0.0, self.eps)
                for c in x[self.ghost:].split(self.ghost)]
        return torch.cat([first] + rest)


class GhostBatchNormCNN(SmallCNN):
    """:class:`~prunopt.train.SmallCNN` with :class:`GhostBatchNorm2d` (groups
    of 8 samples) in place of its batch norms: the same parameters, buffers
    and random initialisation draws."""

    def __init__(self, num_classes: int = 10, width: int = 16, in_channels: int = 1):
        super().__init__(num_classes, width, in_channels)
        for i, m in enumerate(self.features):
            if isinstance(m, nn.BatchNorm2d):
                self.features[i] = GhostBatchNorm2d(m.num_features)


@contextlib.contextmanager
def ghost_batch_norm():
    """In this block the method modules build :class:`GhostBatchNormCNN` instead of ``SmallCNN``."""
    import importlib

    mods = [importlib.import_module(f"prunopt.train.methods.{m}") for m in MODULES]
    saved = [m.SmallCNN for m in mods]
    for m in mods:
        m.SmallCNN = GhostBatchNormCNN
    try:
        yield
    finally:
        for m, cls in zip(mods, saved):
            m.SmallCNN = cls


def main(argv) -> int:
    from prunopt.cli import main as prunopt_main
    from prunopt.distributed import end_process_group

    import torch.distributed as dist

    several = "WORLD_SIZE" in os.environ
    if several:
        dist.init_process_group("gloo")
    status = 0
    try:
        while argv:
            one = argv[: argv.index(";;")] if ";;" in argv else argv
            argv = argv[len(one) + 1:]
            try:
                if one and one[0] == FLAG:
                    with ghost_batch_norm():
                        code = prunopt_main(one[1:])
                else:
                    code = prunopt_main(one)
            except (Exception, SystemExit) as e:
                if not several or dist.get_rank() == 0:
                    print(f"failed: {' '.join(one)}: {type(e).__name__}: {e}", flush=True)
                code = 1
            status = status or code
    except BaseException:
        if several:
            dist.destroy_process_group()
        raise
    if several:
        end_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
