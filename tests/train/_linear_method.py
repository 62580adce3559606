"""A test-only ``prunopt train`` method, ``linear-test``: an MLP without
BatchNorm on the digits, trained with SGD through the job's API. Without
per-batch statistics its data-parallel training (DDP or FSDP2) must give the
one-process result up to the rounding of the gradient sums, which the
distributed tests check. It declares FSDP support (``fsdp=None``), so it also
exercises the sharded path of the job.

``python _linear_method.py ARGS [;; ARGS ...]`` registers it and runs
``prunopt ARGS`` for each ``;;``-separated set of arguments in turn; under
torchrun in one process group initialised here (the job then uses it as it is:
initialising the default group a second time in one process is not reliable)."""
import sys

import torch
from torch import nn

from prunopt.train.data import load_digits
from prunopt.train.job import Job
from prunopt.train.loop import Summary
from prunopt.train.methods import METHODS, register_method

NAME = "linear-test"


def run(args, job=None):
    job = job or Job(args)
    data = load_digits(seed=args.seed, limit=args.limit)
    model = job.prepare(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, data.num_classes)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr or 0.1, momentum=0.9)  # after prepare: FSDP2 swaps params
    gen = torch.Generator().manual_seed(args.seed)
    job.track(data_order=gen, model=model, optimizer=opt)
    for _ in job.epochs("train", args.epochs or 2):
        job.train_epoch(model, opt, data.x_train, data.y_train, args.batch_size, gen)
        job.log(**{"test accuracy": job.evaluate(model, data.x_test, data.y_test)})
    acc = job.evaluate(model, data.x_test, data.y_test)
    return job.finish(Summary(NAME, acc, acc, 1.0), {"model": job.state_dict(model), "optimizer": job.state_dict(opt)})


def register() -> None:
    if NAME not in METHODS:
        register_method(NAME, run, "a test-only MLP without BatchNorm trained by SGD", fsdp=None)


if __name__ == "__main__":
    from prunopt.cli import main
    from prunopt.distributed import end_process_group

    import torch.distributed as dist

    register()
    argv, status = sys.argv[1:], 0
    several = ";;" in argv and "WORLD_SIZE" in __import__("os").environ
    if several:
        dist.init_process_group("gloo")
    try:
        while argv:
            one = argv[: argv.index(";;")] if ";;" in argv else argv
            argv = argv[len(one) + 1:]
            status = status or main(one)
    except BaseException:
        if several:
            dist.destroy_process_group()
        raise
    if several:
        end_process_group()
    sys.exit(status)
