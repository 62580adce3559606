"""Process group of a ``prunopt train`` job launched by ``torchrun``.

``torchrun --nproc_per_node=N -m prunopt train ...`` starts N processes whose
environment names their place in the job (``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``). :func:`process_group` reads
it, initialises the default process group (``gloo`` for a job on the CPU,
``nccl`` for one on CUDA devices) and destroys it when the job ends, also on
an error. Without that environment the job is one process and
:class:`Distributed` is the trivial world of one rank.
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from prunopt.distributed import end_process_group

#: the variables torchrun sets for every worker (MASTER_PORT too, but it has a default)
TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")


def torchrun_environment() -> Optional[Tuple[int, int, int]]:
    """``(rank, world_size, local_rank)`` from a torchrun worker's environment,
    or ``None`` when none of :data:`TORCHRUN_VARIABLES` is set. A partial or
    inconsistent environment is a ``ValueError`` naming the variables."""
    present = [v for v in TORCHRUN_VARIABLES if v in os.environ]
    if not present:
        return None
    missing = [v for v in TORCHRUN_VARIABLES if v not in os.environ]
    if missing:
        raise ValueError(f"incomplete torchrun environment: {', '.join(present)} set but {', '.join(missing)} "
                         "missing (launch with torchrun, or unset them for a one-process run)")
    values = {}
    for v in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        try:
            values[v] = int(os.environ[v])
        except ValueError:
            raise ValueError(f"environment variable {v} must be an integer, got {os.environ[v]!r}") from None
    world, rank, local = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"inconsistent torchrun environment: WORLD_SIZE={world}, RANK={rank}, LOCAL_RANK={local}")
    return rank, world, local


def launched_with_several_processes() -> bool:
    """True when this process is one of several torchrun workers (``WORLD_SIZE`` > 1)."""
    env = torchrun_environment()
    return env is not None and env[1] > 1


class Distributed:
    """This process's place in the job: ``rank`` of ``world_size`` processes
    (``local_rank`` on its node) and the collectives the job needs. With
    ``world_size == 1`` every collective is the identity and no process group
    is needed."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0, backend: Optional[str] = None):
        self.rank, self.world_size, self.local_rank, self.backend = rank, world_size, local_rank, backend

    @property
    def is_main(self) -> bool:
        """Rank 0, the process that writes the output and prints."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """Several processes exchange data (a process group with more than one rank)."""
        return self.world_size > 1

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; tensors included)."""
        if not self.active:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.active:
            return [obj]
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, value: float) -> float:
        """Sum of ``value`` over the ranks (float64)."""
        if not self.active:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def run_on_main(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn()`` on rank 0 only; returns its result there (``None`` on
        the other ranks). An exception raised by ``fn`` is raised on every rank
        (on the others as the same kind among ``ValueError``/``OSError``, else
        ``RuntimeError``, with rank 0's message), so no rank goes on alone into
        a collective."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except Exception as e:
                if not self.active:
                    raise
                error = e
        if not self.active:
            return result
        err = self.broadcast(None if error is None else (type(error).__name__, str(error)))
        if error is not None:
            raise error
        if err is not None:
            kind = {"ValueError": ValueError, "OSError": OSError}.get(err[0], RuntimeError)
            raise kind(f"on rank 0: {err[1]}")
        return result


@contextlib.contextmanager
def process_group(device: str = "cpu", timeout_s: float = 1800.0) -> Iterator[Distributed]:
    """The job's :class:`Distributed`: under torchrun, initialises the default
    process group (``gloo`` when the job runs on the CPU, ``nccl`` on CUDA;
    ``env://`` rendezvous) and destroys it on exit, also when the body raises;
    otherwise a world of one process. A process group initialised by the
    caller is used as it is (and left alone)."""
    env = torchrun_environment()
    if env is None:
        yield Distributed()
        return
    rank, world, local = env
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise RuntimeError(f"a process group of {dist.get_world_size()} ranks (rank {dist.get_rank()}) is "
                               f"already initialised, but the environment says rank {rank} of {world}")
        yield Distributed(rank, world, local, dist.get_backend())
        return
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        yield Distributed(rank, world, local, backend)
    except BaseException:
        dist.destroy_process_group()
        raise
    end_process_group()  # with gloo: a barrier and the workers' releases first (see there)
