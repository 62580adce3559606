"""Sharded primitives: exact global selection and budget projection under
:mod:`torch.distributed`.

prunopt's methods are global by definition: prunAdag's relevant set is the
top-``T`` of ``|g|`` over every pruned parameter (Porcelli, Seraghiti, Toint,
"prunAdag: an adaptive pruning-aware gradient method", 2025, eq. 2.6), the
budget projection of ProM / ProbMask (Weber et al.; Zhou et al., "Effective
Sparsification of Neural Networks with Global Sparsity Constraint",
arXiv:2105.00075) spans all mask scores, and magnitude or SNIP masks keep a
global count. When the parameters are sharded (FSDP2's ``fully_shard`` turns
them into DTensors sharded on dim 0) each rank holds a shard only. The
functions here compute those global quantities *exactly* from the shards with
a small, fixed number of ``all_reduce`` calls on summaries (histograms and
sums): the values themselves are never gathered, and the bytes sent per call
do not grow with the number of elements.

**Which elements take part.** Every function takes a tensor or a list of
tensors and an optional ``group``:

* plain tensors are this rank's own elements; the whole is the union over the
  ranks of ``group`` (``None``: the default group when :mod:`torch.distributed`
  is initialised, otherwise this process alone, where every function is the
  one-process op of :mod:`prunopt.ops`);
* DTensors contribute their local shards and bring their device mesh: the sums
  run over the mesh dimensions on which some tensor is sharded, a tensor
  ``Replicate`` on such a dimension is counted once (on the rank at coordinate 0
  of that dimension), and a ``Partial`` placement (pending sums, not values) is
  a ``ValueError``. ``group`` may also be a :class:`DeviceMesh` (all its ranks).

As for any collective, every rank of the group must make the same call: the
same ``k`` or ``budget``, tensors of one dtype. What the data decides (the
global number of elements, non-finite values, bad costs) and a ``k``, a dtype
or a budget that differs between ranks are agreed through the first collective,
so every rank raises the same ``ValueError`` and none is left waiting. Argument
types and local shapes are checked on each rank before any communication.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import math
import numbers
import os
import random
import statistics
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from prunopt.ops.projection import _check_grad_writes, _check_no_overlap
from prunopt.ops.projection import project_budget as _project_budget_one
from prunopt.ops.projection import project_budget_ as _project_budget_one_
from prunopt._extension import extension_available
from prunopt.ops._registry import _kernel_devices
from prunopt.ops.prunadag import topk_bracket as _topk_bracket
from prunopt.ops.prunadag import topk_threshold as _topk_threshold_one
from prunopt.validation import as_tensor_list, validate_projection_args

__all__ = [
    "topk_threshold",
    "project_budget",
    "project_budget_",
    "all_reduce_sum",
    "global_numel",
    "is_distributed_tensor",
    "local_tensor",
    "process_group_of",
    "is_replicated",
    "counts_locally",
    "sum_over_shards",
    "set_poll_time",
    "end_process_group",
]

TensorOrList = Union[Tensor, Sequence[Tensor]]
#: What ``group`` accepts: ``None``, a ``ProcessGroup`` or a ``DeviceMesh``.
Group = Union[None, "dist.ProcessGroup", "torch.distributed.device_mesh.DeviceMesh"]


# ---------------------------------------------------------------------------
# DTensor and group helpers
# ---------------------------------------------------------------------------

_DTENSOR = None  # the DTensor class once torch.distributed.tensor is imported


def _dtensor_class():
    # A DTensor can only exist once torch.distributed.tensor is imported; looking it
    # up in sys.modules keeps ``import prunopt.distributed`` from paying that import
    # (and once found, the class is kept: an optimizer step asks for every tensor)
    global _DTENSOR
    if _DTENSOR is None:
        mod = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = getattr(mod, "DTensor", None) if mod is not None else None
    return _DTENSOR


def _device_mesh_class():
    mod = sys.modules.get("torch.distributed.device_mesh")
    return getattr(mod, "DeviceMesh", None) if mod is not None else None


def is_distributed_tensor(t) -> bool:
    """Whether ``t`` is a DTensor (``torch.distributed.tensor.DTensor``)."""
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: ``t.to_local()`` for a DTensor (a view of its
    local shard, so in-place writes reach the DTensor), ``t`` itself for a plain
    tensor."""
    cls = _dtensor_class()
    if cls is not None and isinstance(t, cls):
        return t.to_local()
    if isinstance(t, Tensor):
        return t
    raise TypeError(f"expected a Tensor, got {type(t).__name__}")


def _placement_kinds(t, name: str) -> List[str]:
    """``"replicate"`` or ``"shard"`` per mesh dimension of a DTensor; a
    ``Partial`` placement is a ValueError (its local tensor holds pending sums)."""
    kinds = []
    for d, p in enumerate(t.placements):
        if p.is_partial():
            raise ValueError(f"{name} has a Partial placement on mesh dimension {d}: its local tensor holds "
                             "pending sums, not values; redistribute it to Shard or Replicate first")
        # Shard, _StridedShard and any other layout that splits the tensor
        kinds.append("replicate" if p.is_replicate() else "shard")
    return kinds


def is_replicated(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor replicated on every dimension of its mesh (each
    rank holds the whole tensor, which then counts once in a global quantity,
    not once per rank). ``False`` for a DTensor sharded on some mesh dimension
    and for a plain tensor; ``ValueError`` for a ``Partial`` placement."""
    if not is_distributed_tensor(t):
        if not isinstance(t, Tensor):
            raise TypeError(f"expected a Tensor, got {type(t).__name__}")
        return False
    return all(k == "replicate" for k in _placement_kinds(t, "t"))


def counts_locally(t: Tensor) -> bool:
    """Whether this rank's local values of ``t`` belong in a sum over all ranks
    of ``t``'s mesh: always for a plain tensor and for a DTensor sharded on every
    mesh dimension; for a DTensor ``Replicate`` on some mesh dimensions only on
    the rank at coordinate 0 of each of them, so each element is counted once.
    Sum local contributions gated by this with :func:`all_reduce_sum` over
    ``process_group_of([t])``."""
    if not is_distributed_tensor(t):
        if not isinstance(t, Tensor):
            raise TypeError(f"expected a Tensor, got {type(t).__name__}")
        return True
    kinds = _placement_kinds(t, "t")
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, k in zip(coord, kinds) if k == "replicate")


def process_group_of(tensors: TensorOrList) -> Group:
    """The group the global quantities of ``tensors`` are summed over: ``None``
    when no tensor is a DTensor (the default group), the mesh's process group
    for DTensors on a 1-D mesh (FSDP2), and the :class:`DeviceMesh` itself for a
    multi-dimensional mesh (every function of this module accepts it as
    ``group``: it sums over all the mesh's ranks). ``ValueError`` if the
    DTensors live on different meshes."""
    tensors, _ = as_tensor_list(tensors, "tensors")
    mesh = _common_mesh(tensors, "tensors")
    if mesh is None:
        return None
    return mesh.get_group() if mesh.ndim == 1 else mesh


def _common_mesh(tensors: List[Tensor], name: str, mesh=None):
    for i, t in enumerate(tensors):
        if is_distributed_tensor(t):
            if mesh is None:
                mesh = t.device_mesh
            elif t.device_mesh != mesh:
                raise ValueError(f"{name}[{i}] lives on another device mesh than {name}[0] (or than group); "
                                 "the tensors of one call must share one mesh")
    return mesh


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _groups_of(group) -> List:
    """The process groups a sum over ``group`` runs over, in turn ([] = one process)."""
    mesh_cls = _device_mesh_class()
    if group is None:
        return [dist.group.WORLD] if _dist_ready() else []
    if mesh_cls is not None and isinstance(group, mesh_cls):
        return [group.get_group(d) for d in range(group.ndim)]
    if isinstance(group, dist.ProcessGroup):
        return [group]
    raise TypeError(f"group must be None, a ProcessGroup or a DeviceMesh, got {type(group).__name__}")


@dataclass
class _Plan:
    """Where the elements of one call live: every input's local tensor, whether
    it takes part on this rank, the process groups to sum over (in turn) and
    the number of ranks those sums span."""

    locals: List[Tensor]
    counted: List[bool]
    groups: List
    world: int


def _plan(tensors: List[Tensor], group, name: str) -> _Plan:
    mesh_cls = _device_mesh_class()
    explicit_mesh = group if (mesh_cls is not None and isinstance(group, mesh_cls)) else None
    has_dtensor = any(is_distributed_tensor(t) for t in tensors)
    locals_ = [local_tensor(t) for t in tensors]
    if not has_dtensor:
        groups = _groups_of(group)
        world = 1
        for g in groups:
            world *= dist.get_world_size(g)
        return _Plan(locals_, [True] * len(tensors), groups, world)
    mesh = _common_mesh(tensors, name, explicit_mesh)
    if group is not None and explicit_mesh is None:
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be None, a ProcessGroup or a DeviceMesh, got {type(group).__name__}")
        if mesh.ndim != 1 or mesh.get_group() != group:
            raise ValueError(f"group must be None or the process group of the DTensors' 1-D mesh; {name} are "
                             "DTensors, which bring their mesh")
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"this rank is not part of the device mesh of {name}")
    kinds = [_placement_kinds(t, f"{name}[{i}]") if is_distributed_tensor(t) else None
             for i, t in enumerate(tensors)]
    plain = any(k is None for k in kinds)
    # Sum over a mesh dimension only where some tensor is split along it; where all
    # are replicated every rank already holds the same values.
    dims = [d for d in range(mesh.ndim) if plain or any(k is not None and k[d] == "shard" for k in kinds)]
    counted = [k is None or all(coord[d] == 0 for d in dims if k[d] == "replicate") for k in kinds]
    world = 1
    for d in dims:
        world *= mesh.size(d)
    return _Plan(locals_, counted, [mesh.get_group(d) for d in dims], world)


# How a rank waits for its CPU collectives: a poll time in seconds (0: block at
# once), or "auto" (_WaitChooser); see set_poll_time.
_AUTO = "auto"
# The poll time "auto" tries against blocking at once.
_AUTO_POLL_S = 0.005


def _poll_time_from_env() -> Union[float, str]:
    raw = os.environ.get("PRUNOPT_DIST_POLL_US")
    if raw is None or raw.strip().lower() == _AUTO:
        return _AUTO
    try:
        us = float(raw)
    except ValueError:
        us = math.nan
    if not (math.isfinite(us) and us >= 0):
        raise ValueError(f"PRUNOPT_DIST_POLL_US must be 'auto' or a non-negative number of microseconds, got {raw!r}")
    return us / 1e6


class _WaitChooser:
    """The ``"auto"`` wait of :func:`set_poll_time`: for each kind of CPU
    collective (its payload size, to the power of two), whether to block at
    once or to poll for up to ``poll_s`` first, from *paired* timings of the
    two ways (issue to completion), so that the host's drift, which moves
    both ways alike, does not decide.

    * The first ``2 warmup`` calls of a kind alternate the ways; each
      (blocked, polled) pair of neighbouring calls gives one comparison.
    * Then the way the comparisons favour is taken (their median of
      ``log(polled / blocked)``, over the last ``window`` of them), except on
      a ``1 / explore`` share of the calls, drawn at random, which take the
      other way; each such call is compared with the median of the chosen
      way's last ``recent`` calls, made just before it.

    One comparison is noisy (each rank's wait includes the other rank's
    lateness, which varies by more than the ways differ), and after the
    warm-up new ones come only from the explored calls, so the warm-up sets
    the choice for a long while: 16 pairs by default (with 5, 2-rank runs of
    the sharded threshold kept the slower way in 2 of 3 runs).

    A way's old timings never stand against the other's new ones (as medians
    of each way's own last calls would, when one way is explored only now and
    then). Only the waiting changes, never what the collective computes, so
    every rank chooses for itself (the draws come from a private generator:
    the user's random streams are untouched)."""

    def __init__(self, poll_s: float = _AUTO_POLL_S, window: int = 31, warmup: int = 16, explore: int = 16,
                 seed: int = 0, recent: int = 5):
        self.poll_s, self.window, self.warmup, self.explore, self.recent = poll_s, window, warmup, explore, recent
        self._kinds: dict = {}
        self.recorded = 0  # collectives timed so far
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _kind(self, kind: int) -> dict:
        got = self._kinds.get(kind)
        if got is None:
            got = self._kinds[kind] = dict(calls=0, last=[None, None], ratios=collections.deque(maxlen=self.window),
                                           recent=collections.deque(maxlen=self.recent), way=None)
        return got

    @staticmethod
    def _favoured(k: dict) -> int:
        """1 (polled) when the comparisons favour polling, else 0 (blocked)."""
        return 1 if statistics.median(k["ratios"]) < 0 else 0

    def poll_time(self, kind: int) -> float:
        """The poll time for the next collective of ``kind``: 0 or ``poll_s``."""
        with self._lock:
            k = self._kind(kind)
            if k["calls"] < 2 * self.warmup or not k["ratios"]:
                return self.poll_s if k["calls"] % 2 else 0.0  # blocked, polled, blocked, ...
            way = self._favoured(k)
            if self._rng.randrange(self.explore) == 0:
                way = 1 - way
            return self.poll_s if way else 0.0

    def record(self, kind: int, poll_s: float, seconds: float) -> None:
        """Records that a collective of ``kind`` waited this way (``poll_s``,
        0 or not) and took ``seconds`` from its issue to its completion."""
        way = 1 if poll_s > 0 else 0
        seconds = max(seconds, 1e-9)
        with self._lock:
            k = self._kind(kind)
            k["calls"] += 1
            self.recorded += 1
            if k["calls"] <= 2 * self.warmup or not k["ratios"]:
                k["last"][way] = seconds
                blocked, polled = k["last"]
                if way == 1 and blocked is not None:  # a pair: the blocked call just before this polled one
                    k["ratios"].append(math.log(polled / blocked))
                    k["last"] = [None, None]
                return
            chosen = self._favoured(k)
            if chosen != k["way"]:  # a new choice: its recent calls start afresh
                k["way"] = chosen
                k["recent"].clear()
            if way == chosen:
                k["recent"].append(seconds)
            elif k["recent"]:
                ref = statistics.median(k["recent"])
                k["ratios"].append(math.log(seconds / ref) if way == 1 else math.log(ref / seconds))


_POLL_S = _poll_time_from_env()
_CHOOSER = _WaitChooser()


def set_poll_time(seconds) -> Union[float, str]:
    """Sets how a rank waits for each of this module's collectives on CPU
    tensors (gloo), and returns the previous setting: ``"auto"`` (the
    default, or ``PRUNOPT_DIST_POLL_US=auto``) measures and chooses, a number
    of seconds *polls* each collective for completion for up to that long
    before it blocks in ``Work.wait()`` (``0``: block at once, as
    :mod:`torch.distributed` does; ``PRUNOPT_DIST_POLL_US`` in
    microseconds).

    The collectives here carry a few KB of histograms and sums, so their time
    is latency, and a blocked waiter's latency includes its wake-up: on a
    virtual machine an idle vCPU is descheduled, and waking it can cost
    milliseconds. Polling keeps the waiting core busy for at most the poll
    time per call (yielding it to any runnable thread), after which the call
    blocks as usual. Whether that pays depends on the host and on the work
    between the collectives: on one 2-vCPU VM with 2 gloo ranks of one thread
    a 5 ms poll made the sharded threshold of 10M float32 values faster and
    that of 1M slower (both ranks then reach each collective almost together
    and their polling competes with gloo's own threads for the two cores); on
    another it made every size faster, and the time from the last rank's
    arrival to the end of an FSDP2 PrunAdag step's collective went from 1.8-4.9
    ms blocked to 0.5-0.8 ms polled. So by default each process measures:
    ``"auto"`` times its collectives both ways, per payload size, comparing
    the ways in neighbouring calls (so that the host's drift, which moves
    both alike, does not decide), waits the way those comparisons favour
    (blocking, or polling up to 5 ms), and still tries the other on one call
    in 16, against the chosen way's calls just before, to follow the host.
    Every way
    computes the same result; only the waiting differs. CUDA tensors (NCCL)
    are never polled: their collectives are asynchronous on a stream already.

    Args:
        seconds: ``"auto"``, or the poll time per collective, finite and
            ``>= 0``.

    Returns:
        The previous setting: ``"auto"`` or a poll time in seconds.

    Raises:
        TypeError: ``seconds`` neither ``"auto"`` nor a real number.
        ValueError: ``seconds`` negative or not finite."""
    global _POLL_S
    if isinstance(seconds, str) and seconds == _AUTO:
        previous, _POLL_S = _POLL_S, _AUTO
        return previous
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"seconds must be 'auto' or a real number, got {type(seconds).__name__}")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
    previous, _POLL_S = _POLL_S, float(seconds)
    return previous


_END_PAUSE_S = 0.05


def end_process_group(pause: float = _END_PAUSE_S) -> None:
    """Destroys the default process group at the normal end of a job, without
    the abort that a gloo job can meet as its interpreter shuts down.

    Call it on every rank in place of the last
    :func:`torch.distributed.destroy_process_group` once the work is done
    (after an error, when another rank may never come, destroy the group
    directly). With the gloo backend it first makes every rank meet at a
    barrier and then pauses ``pause`` seconds without holding the GIL; with
    any other backend it only destroys the group.

    Why: gloo runs each collective on one of its worker threads, and the
    worker drops its references to the collective's tensors only after the
    caller has been woken. In torch 2.13 dropping a reference to a tensor made
    in Python takes the GIL. The worker threads outlive
    ``destroy_process_group()`` whenever something still holds the group
    (DistributedDataParallel does, to the end of the process), so when the
    script ends right after a collective, a worker can ask for the GIL while
    the interpreter is shutting down; Python then stops that thread in the
    middle of a C++ destructor, and the process aborts with "terminate called
    without an active exception". A barrier alone does not close the gap: the
    barrier's own work keeps (weak) references to the collectives before it
    and frees them when the worker drops it, again after the caller has been
    woken. The pause hands the GIL to the workers while they finish. Measured
    with ``examples/ddp_prunadag.py`` (DDP, 2 gloo ranks, 2 vCPUs): 5 of 30
    runs aborted ending with ``destroy_process_group()`` alone, 2 of 40 with a
    barrier before it, 0 of 180 with a barrier and then this pause. The pause
    is a margin, not a proof: Python cannot see when gloo's workers are done
    (a worker not scheduled for the whole pause would still be late).

    Args:
        pause: seconds to sleep after the barrier (gloo only), finite and
            ``>= 0``; the default, 0.05, is far longer than the few
            microseconds the release takes once a worker holds the GIL.

    Raises:
        TypeError: ``pause`` not a real number.
        ValueError: ``pause`` negative or not finite, or no default process
            group is initialised.
        RuntimeError: the barrier failed (a rank left or timed out); the
            group is destroyed all the same."""
    if isinstance(pause, bool) or not isinstance(pause, numbers.Real):
        raise TypeError(f"pause must be a real number of seconds, got {type(pause).__name__}")
    if not (math.isfinite(pause) and pause >= 0):
        raise ValueError(f"pause must be finite and >= 0, got {pause}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("end_process_group: no default process group is initialised "
                         "(call torch.distributed.init_process_group first)")
    try:
        if dist.get_backend() == "gloo":
            work = dist.barrier(async_op=True)
            work.wait()
            time.sleep(pause)  # the GIL is free: the workers finish releasing the last collectives
            del work  # if a worker has dropped the barrier's work already, it is freed here, under the GIL
    finally:
        dist.destroy_process_group()  # also when the barrier failed (a rank gone): the group ends either way


def _reduce(vec: Tensor, op, group) -> None:
    """``dist.all_reduce(vec, op, group)``, polled for completion for up to
    :func:`set_poll_time`'s time when ``vec`` is on the CPU (``"auto"``:
    the time :class:`_WaitChooser` chooses, which then records how long the
    call took)."""
    if vec.device.type != "cpu":
        dist.all_reduce(vec, op=op, group=group)
        return
    auto = isinstance(_POLL_S, str)
    kind = (vec.numel() * vec.element_size()).bit_length()
    poll = _CHOOSER.poll_time(kind) if auto else _POLL_S
    start = time.perf_counter()
    if poll <= 0:
        dist.all_reduce(vec, op=op, group=group)
    else:
        work = dist.all_reduce(vec, op=op, group=group, async_op=True)
        if not work.is_completed():
            end = start + poll
            while not work.is_completed() and time.perf_counter() < end:
                os.sched_yield()  # busy, but any runnable thread here goes first
        work.wait()  # raises what the collective raised (a timeout, a closed peer)
    if auto:
        _CHOOSER.record(kind, poll, time.perf_counter() - start)


def _all_reduce(vec: Tensor, groups: List) -> Tensor:
    """Sums ``vec`` over every rank the groups span (one ``all_reduce`` per group:
    the sum over a mesh is the sum over each of its dimensions in turn)."""
    for g in groups:
        _reduce(vec, dist.ReduceOp.SUM, g)
    return vec


def _rank_index(groups: List) -> int:
    """This rank's index among the ranks of the product of ``groups`` (summed
    over in turn; their number is the plan's ``world``): the place of its own
    entries in a vector of per-rank slots that a sum fills on every rank."""
    index = 0
    for g in groups:
        index = index * dist.get_world_size(g) + dist.get_rank(g)
    return index


def _default_device(groups: List) -> torch.device:
    """Where to put a summary when no tensor says: the device of the group's
    backend (``cuda:<current>`` for NCCL, ``cpu`` for gloo or mixed backends)."""
    if groups:
        try:
            kind = dist.distributed_c10d._get_object_coll_device(groups[0])
        except Exception:  # a private helper: fall back to the CPU
            kind = "cpu"
        if kind != "cpu":
            mod = getattr(torch, kind, None)
            if mod is not None and hasattr(mod, "current_device"):
                return torch.device(kind, mod.current_device())
            return torch.device(kind)
    return torch.device("cpu")


def all_reduce_sum(values, group: Group = None, device=None) -> Tensor:
    """Sum of ``values`` over every rank of ``group``, in float64, in one
    ``all_reduce`` per process group (one for a process group or a 1-D mesh).

    Args:
        values: a plain tensor (summed elementwise), or a list/tuple of Python
            or NumPy numbers and one-element tensors (each summed as a scalar).
            DTensors are refused: pass local contributions (see
            :func:`counts_locally` for replicated tensors).
        group: ``None`` (the default group; this process alone when
            :mod:`torch.distributed` is not initialised), a ``ProcessGroup`` or
            a ``DeviceMesh`` (all its ranks).
        device: where a list of numbers is reduced (default: the device of the
            first tensor among them, else the group's default device).

    Returns:
        A new float64 tensor: ``values``' shape for a tensor, ``(len(values),)``
        for a list.
    """
    groups = _groups_of(group)
    if isinstance(values, Tensor):
        if is_distributed_tensor(values):
            raise TypeError("values must be local contributions, not a DTensor (use its to_local() part, "
                            "gated by counts_locally when it is replicated)")
        out = values.detach().to(torch.float64, copy=True)
    elif isinstance(values, (list, tuple)):
        parts = []
        for i, v in enumerate(values):
            if isinstance(v, Tensor):
                if is_distributed_tensor(v):
                    raise TypeError(f"values[{i}] must be a local contribution, not a DTensor")
                if v.numel() != 1:
                    raise ValueError(f"values[{i}] must be a number or a one-element tensor, got shape "
                                     f"{tuple(v.shape)}")
                if v.is_complex():
                    raise TypeError(f"values[{i}] must be real, got {v.dtype}")
                parts.append(v.detach().reshape(()))
            elif isinstance(v, numbers.Real) and not isinstance(v, bool):
                parts.append(float(v))
            else:
                raise TypeError(f"values[{i}] must be a real number or a one-element tensor, got {type(v).__name__}")
        if device is None:
            device = next((p.device for p in parts if isinstance(p, Tensor)), None) or _default_device(groups)
        out = torch.stack([p.to(device=device, dtype=torch.float64) if isinstance(p, Tensor)
                           else torch.full((), p, dtype=torch.float64, device=device) for p in parts]) \
            if parts else torch.zeros(0, dtype=torch.float64, device=device)
    else:
        raise TypeError(f"values must be a Tensor or a list/tuple of numbers and tensors, got {type(values).__name__}")
    return _all_reduce(out, groups)


def global_numel(tensors: TensorOrList, group: Group = None) -> int:
    """The number of distinct elements of ``tensors`` over all ranks (the ``n`` of
    a global top-k or budget): a DTensor counts its global size (no
    communication), plain tensors their local sizes summed over ``group`` (one
    ``all_reduce`` of one integer; a host synchronisation on CUDA)."""
    tensors, _ = as_tensor_list(tensors, "tensors")
    if tensors and all(is_distributed_tensor(t) for t in tensors):
        _plan(tensors, group, "tensors")  # the same checks as every other function
        return sum(t.numel() for t in tensors)
    plan = _plan(tensors, group, "tensors")
    local = sum(loc.numel() for t, loc, c in zip(tensors, plan.locals, plan.counted)
                if c and not is_distributed_tensor(t))
    dtensors = sum(t.numel() for t in tensors if is_distributed_tensor(t))
    if not plan.groups:
        return local + dtensors
    device = next((loc.device for loc in plan.locals), None) or _default_device(plan.groups)
    vec = torch.full((1,), local, dtype=torch.int64, device=device)
    return int(_all_reduce(vec, plan.groups).item()) + dtensors


def sum_over_shards(local_sum: Tensor, like: Tensor) -> Tensor:
    """The sum over a whole tensor from this rank's part of it, differentiably.

    ``local_sum`` is computed from the local shard of ``like`` (for example
    ``(f(local_tensor(w)) ** 2).sum()`` for a DTensor parameter ``w``); the
    result is the sum over every shard, a plain tensor with the same value on
    every rank (one ``all_reduce`` per sharded mesh dimension). Its gradient
    reaches each rank's shard once, unscaled: a loss that adds the result on
    every rank back-propagates into each shard the gradient of the global
    sum, as the one-process sum would. On a mesh dimension where ``like`` is
    replicated, every rank's ``local_sum`` already is the sum over that
    dimension and is taken as it is. For a plain ``like`` (one process, DDP)
    ``local_sum`` itself is returned. Regularisers that read sharded
    parameters outside the forward pass (FSDP2 reshards them after it) are
    summed with this.

    Built on DTensor: ``local_sum`` becomes a ``Partial`` DTensor on the
    sharded mesh dimensions and is redistributed to ``Replicate``; the
    backward of that redistribution passes the gradient through unchanged.
    ``like`` with a ``Partial`` placement is a ``ValueError``."""
    if not isinstance(local_sum, Tensor) or is_distributed_tensor(local_sum):
        raise TypeError(f"local_sum must be a plain tensor (this rank's part), got {type(local_sum).__name__}")
    if not is_distributed_tensor(like):
        if not isinstance(like, Tensor):
            raise TypeError(f"like must be a Tensor, got {type(like).__name__}")
        return local_sum
    from torch.distributed.tensor import DTensor, Partial, Replicate

    kinds = _placement_kinds(like, "like")
    placements = [Partial() if k == "shard" else Replicate() for k in kinds]
    return DTensor.from_local(local_sum, like.device_mesh, placements, run_check=False).full_tensor()


def _limbs(value: int, count: int, bits: int) -> List[int]:
    """``value`` (``0 <= value < 2**(count*bits)``) as ``count`` limbs of ``bits`` bits."""
    return [(value >> (bits * i)) & ((1 << bits) - 1) for i in range(count)]


def _limbs_agree(sums: Sequence[int], squares: Sequence[int], world: int) -> bool:
    """Whether every rank sent the same limbs: by Cauchy-Schwarz, the sum of the
    squares of ``world`` integers is ``(sum)**2 / world`` iff they are all equal.
    Decided from the reduced sums, so every rank reaches the same answer."""
    return all(world * int(q) == int(s) * int(s) for s, q in zip(sums, squares))


# ---------------------------------------------------------------------------
# topk_threshold: radix select on the magnitude bits
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Radix:
    int_dtype: torch.dtype
    nbits: int            # magnitude bits (the sign bit excluded)
    widths: Tuple[int, ...]  # digit widths, most significant first
    nonfinite_digit: int  # first digit of the first pass that is inf or NaN (exponent all ones)
    code: int             # the dtype's number in the cross-rank agreement


def _radix(int_dtype, exp_bits, man_bits, widths, code) -> _Radix:
    nbits = exp_bits + man_bits
    assert sum(widths) == nbits and widths[0] <= _HIST0_BITS
    exp_mask = ((1 << exp_bits) - 1) << man_bits
    return _Radix(int_dtype, nbits, widths, exp_mask >> (nbits - widths[0]), code)


_HIST0_BITS = 11
_RADIX = {
    torch.float64: _radix(torch.int64, 11, 52, (11, 11, 11, 10, 10, 10), 1),
    torch.float32: _radix(torch.int32, 8, 23, (11, 10, 10), 2),
    torch.float16: _radix(torch.int16, 5, 10, (8, 7), 3),
    torch.bfloat16: _radix(torch.int16, 8, 7, (8, 7), 4),
}
# The first pass's vector: 2048 counts (padded for narrower first digits, so a
# dtype that differs between ranks is caught instead of mismatching the sizes;
# more slots, unused here, beyond 29 ranks), then n, k's limbs and their
# squares, the dtype code and its square: the layout of every select's first
# collective (see _first_size).
_META = 9
# Devices where the candidates of a digit are compacted after each pass (on the
# host the size of a compacted tensor is free to read); elsewhere every pass
# reads all elements and masks the non-candidates, with nothing read back.
_COMPACT_DEVICES = frozenset({"cpu"})


class _TopDigit:
    """The first pass's digit (the top ``width`` magnitude bits) of every key,
    computed when needed and not kept: with ``chunked``, block by block into one
    small reused buffer (an n-sized tensor of digits would page-fault on every
    call), once for the histogram and once to select the chosen bucket."""

    def __init__(self, keys: List[Tensor], shift: int, width: int, chunked: bool):
        self.shift, self.mask, self.chunked = shift, (1 << width) - 1, chunked
        self.keys = [c for bits in keys for c in bits.split(_RADIX_CHUNK)] if chunked else keys
        self.size = 1 << width
        self.device = keys[0].device if keys else torch.device("cpu")
        top = max((c.numel() for c in self.keys), default=0) if chunked else 0
        self.buf = torch.empty(top, dtype=keys[0].dtype if keys else torch.int32, device=self.device)

    def _digits(self, bits: Tensor) -> Tensor:
        if self.chunked:
            d = torch.bitwise_right_shift(bits, self.shift, out=self.buf[:bits.numel()])
        else:
            d = torch.bitwise_right_shift(bits, self.shift)
        return d.bitwise_and_(self.mask)  # the mask drops the sign bit

    def histogram(self) -> Tensor:
        hist = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        for bits in self.keys:
            hist += _bincount(self._digits(bits), self.size)
        return hist

    def select(self, b: int) -> List[Tensor]:
        """The keys whose digit is ``b``."""
        return [bits[self._digits(bits) == b] for bits in self.keys]


_RADIX_CHUNK = 1 << 18


def _bincount(d: Tensor, size: int) -> Tensor:
    """Counts of the digits ``d`` (``0 <= d < size``) as ``size`` int64 values."""
    if d.device.type == "cpu":
        return torch.bincount(d, minlength=size)
    # CUDA's bincount reads the largest digit back to the host; index_add_ does not
    ones = torch.ones((), dtype=torch.int64, device=d.device).expand(d.numel())
    return torch.zeros(size, dtype=torch.int64, device=d.device).index_add_(0, d.int(), ones)


def _choose_host(hist: Sequence[int], k: int) -> Tuple[int, int]:
    """The bucket holding the ``k``-th largest (counting from the top bucket) and
    the rank of that element inside the bucket."""
    incl = list(itertools.accumulate(reversed(hist)))  # incl[i]: elements in the top i + 1 buckets
    i = bisect.bisect_left(incl, k)  # counts are >= 0: incl is non-decreasing
    if i == len(incl):
        return 0, k  # k > n: unreachable, k is checked first
    return len(hist) - 1 - i, k - (incl[i - 1] if i else 0)


def _choose_device(hist: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`_choose_host` on the device (0-dim int64 tensors, nothing read back)."""
    incl = hist.flip(0).cumsum(0).flip(0)  # incl[b] = elements in buckets >= b
    b = ((incl >= k).sum() - 1).clamp_(min=0)
    above = incl.gather(0, b.view(1)) - hist.gather(0, b.view(1))
    return b, k - above.view(())


def topk_threshold(values: TensorOrList, k: int, group: Group = None) -> Tensor:
    r"""The ``k``-th largest :math:`|v|` over the union of every rank's ``values``
    (prunAdag eq. 2.6, the threshold :math:`\tau` of the relevant set
    :math:`\mathcal R = \{i : |g_i| \ge \tau\}`), bit-identical to
    :func:`prunopt.ops.topk_threshold` on the concatenation of all shards in one
    process (that is, to ``torch.kthvalue(cat(|v|), n - k + 1)``, ties included).

    Radix select on the bit patterns of :math:`|v|` (a float's magnitude bits
    order like unsigned integers): each pass histograms the next digit (at most
    11 bits) of the candidates whose higher digits match the prefix chosen so
    far, sums the histogram over the ranks (one ``all_reduce`` of at most 2057
    int64 from 9 to 29 ranks, 16 KB; 10 249 up to 8 ranks, 82 KB; beyond 29,
    70 more per rank, 560 bytes: the first collective's layout), and picks
    the bucket that holds the ``k``-th largest. The passes are fixed by the
    dtype: 3 for float32, 6 for float64, 2 for float16 and bfloat16 (times the
    number of sharded mesh dimensions). The first pass also sums the global
    ``n``, the count of non-finite values and ``k``, so every rank validates
    identically; on CUDA that is the one host synchronisation, the later
    passes choose their buckets on the device. float32 and float64 on the CPU
    instead take one or two rounds (:func:`_bracket_select`): each rank
    brackets its share of the threshold from a sample and reads its values
    once, counting above the bracket, histogramming inside it and, up to 8
    ranks, keeping a window of its values around its share; one collective
    of every rank's histogram and window gives the threshold at once when it
    lies inside every window (1 collective when the ranks' values are alike,
    as FSDP2's shards of the same layers), else a narrow bracket of it, and
    radix passes over the values inside the bracket finish: up to 4
    collectives for float32 (7 for float64) and a second read on ranks whose
    own bracket missed.

    Args:
        values: a tensor or a list of tensors of one real floating dtype
            (float32, float64, float16, bfloat16) and device; DTensors
            contribute their local shards (see the module notes). An empty
            local shard is fine; an empty list is not (its dtype is unknown).
        k: ``1 <= k <= n``, ``n`` the global number of elements; the same on
            every rank.
        group: ``None``, a ``ProcessGroup`` or a ``DeviceMesh`` (see the module
            notes); with DTensors, ``None`` or their mesh (or its group).

    Returns:
        A 0-dim tensor of the values' dtype on their device, the same on every
        rank.

    Raises:
        TypeError: ``values`` not tensors, ``k`` not an int, a bad ``group``.
        ValueError: on every rank alike: ``k`` out of range or different
            between ranks, a non-finite value on any rank, a dtype that differs
            between ranks; locally: mixed dtypes or devices, a non-float dtype,
            an empty list, a ``Partial`` DTensor.
    """
    tensors, _ = as_tensor_list(values, "values")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    k = int(k)
    plan = _plan(tensors, group, "values")
    local = plan.locals
    if not local:
        raise ValueError("values must hold at least one tensor on every rank (an empty tensor of the values' "
                         "dtype stands for a rank without elements)")
    for i, v in enumerate(local):
        if not v.is_floating_point():
            raise ValueError(f"values[{i}] must be a real floating tensor, got {v.dtype}")
        if v.dtype != local[0].dtype or v.device != local[0].device:
            raise ValueError(f"values[{i}] must have the dtype and device of values[0]")
    if local[0].dtype not in _RADIX:
        raise ValueError(f"values must be float32, float64, float16 or bfloat16, got {local[0].dtype}")
    if not plan.groups:
        return _topk_threshold_one(local, k)
    return _select(local, plan, k)


def _select(local: List[Tensor], plan: _Plan, k: int, nonfinite_is_none: bool = False) -> Optional[Tensor]:
    """The bracketed select where the fused one-process op can bracket the
    threshold (float32/float64 on the CPU), else the radix select."""
    dt, dev = local[0].dtype, local[0].device
    if dev.type in _BRACKET_DEVICES and dt in (torch.float32, torch.float64) and extension_available():
        return _bracket_select(local, plan, k, nonfinite_is_none)
    return _radix_select(local, plan, k, nonfinite_is_none)


# Devices where the bracket is taken (the fused op's order statistics are cheap
# passes on the CPU; on CUDA the radix passes choose on the device, without the
# bracket's host reads)
_BRACKET_DEVICES = frozenset({"cpu"})
def _bracket_select(local: List[Tensor], plan: _Plan, k: int, nonfinite_is_none: bool = False) -> Optional[Tensor]:
    """The sharded select in one or two rounds, so that one pass over the
    data and usually one collective give the exact threshold (step 2's
    windows, up to ``_WINDOW_WORLD`` ranks; beyond, or when a window misses,
    steps 3 and 4, usually one more collective):

    1. each rank, in one call of ``prunopt.ops.topk_slice``
       (:meth:`_OwnSlice.of_op`), brackets its own ``s``-th largest ``|v|``
       (``s = ceil(k / W)`` over ``W`` ranks) from a fixed strided sample of
       its values (all of them where ``s`` exceeds them), widens the bracket
       to a grid of at most ``_rank_buckets(W)`` buckets of ``2**j`` ulps
       aligned at multiples of ``2**j``, and in one fused pass counts its
       values above the bracket, keeps those inside it and checks
       finiteness; the candidates' histogram on the grid is its *slice*, the
       candidates of the grid buckets around its share, at most
       ``_window_slots(W)`` slots of them, its *window* (the bracket holds
       half a window either side at least);
    2. one ``all_reduce`` sums ``n``, the agreement on ``k`` and the dtype,
       and lays every rank's slice and window side by side (each rank writes
       only its own). When ``tau`` lies inside every window, the pooled
       windows give it (:func:`_window_tau`): done;
    3. otherwise every rank knows, for any bit pattern ``t``, bounds on the
       global count of ``|v| >= t`` that are exact at each rank's grid
       points (:func:`_bracket_of_slices`). The largest ``t`` whose lower
       bound reaches ``k`` and the smallest whose upper bound falls below it
       bracket the threshold ``tau`` exactly: ``[L, H]``, one bucket of the
       ranks' grids when their brackets overlap around ``tau``;
    4. each rank takes its values inside ``[L, H]`` and its count above ``H``
       from its candidates (another fused pass only on a rank whose own
       bracket does not cover ``[L, H]``, e.g. one whose data differ from the
       others'), and :func:`_select_in_bracket` selects ``tau`` by radix
       passes over them, usually one.

    Exact whatever the samples: a window that misses costs step 4, a poor
    bracket widens ``[L, H]`` (more radix passes, a second pass over the data
    on some ranks), never the answer."""
    dtype = local[0].dtype
    keys = [v.detach().reshape(-1) for v, c in zip(local, plan.counted) if c and v.numel()]
    world = plan.world
    buckets = _rank_buckets(world)
    windows = _window_area(world) > 0
    # step 1 in one call of the fused op (the sample, the bracket, the pass, the
    # slice and the window; with windows, the bracket holds at least half a
    # window either side of the share, so that a small shard's exact bracket
    # is not one value)
    cap = _window_slots(world) * (8 // _RADIX[dtype].int_dtype.itemsize) if windows else 0
    own, window = _OwnSlice.of_op(keys or [local[0].new_empty(0)], k, world, buckets, cap)
    if not windows:
        window = None
    # 2) the first collective: the slices, the windows, n and the agreement
    n, vec = _first_collective(own, k, plan, window)
    if _any_bad(vec, world):
        if nonfinite_is_none:
            return None
        raise ValueError("values contain a non-finite value (on at least one rank)")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    tau = _window_tau(vec, world, k, dtype) if windows else None
    if tau is not None:
        return torch.tensor(tau, dtype=_RADIX[dtype].int_dtype).view(dtype)
    # 3) the bracket [L, H] from the slices, 4) this rank's candidates in it, then the radix passes among them
    lo_bits, hi_bits = _bracket_of_slices(_slices(vec, world, buckets), k, n, _max_finite_bits(dtype))
    above, cands = own.candidates(keys, lo_bits, hi_bits)
    got = _select_in_bracket(cands, plan.groups, k, above, False, _bits_value(lo_bits, dtype),
                             _bits_value(hi_bits, dtype), nonfinite_is_none)
    if got is _MISSED:  # unreachable: [L, H] holds tau by construction (kept as a safe answer)
        return _radix_select(local, plan, k, nonfinite_is_none)
    return got


# The first collective of a select, whichever path a rank takes (the radix
# select, the bracketed select, prunAdag's fused select, which is a bracketed
# select too), has one layout, so that ranks of different dtypes, which take
# different paths, still meet in one collective of one size and all raise: an
# area (the radix select's 2048-bucket histogram, or the bracketed selects'
# per-rank slices, and up to _WINDOW_WORLD ranks their windows), then _META
# integers (n, k's limbs and their squares, the dtype code and its square).
_SLICE_HEAD = 6  # a slice: n_r, above, first grid point, log2 of the step, buckets, non-finite flag
_MIN_RANK_BUCKETS = 64
# The plain select's first collective also carries, up to _WINDOW_WORLD ranks,
# each rank's window (see prunopt.ops.topk_slice) in _WINDOW_AREA slots after the
# slices (the other paths leave them zero): its head, then its values' bit
# patterns. The head: the count above the window, its first bit pattern, its
# end (exclusive) and its count of values (-1: more than fit).
_WINDOW_WORLD = 8
_WINDOW_AREA = 8192
_WINDOW_HEAD = 4


def _first_collective(own: "_OwnSlice", k: int, plan: _Plan, window=None) -> Tuple[int, Tensor]:
    """The first collective of a bracketed select (:func:`_bracket_select`,
    prunAdag's fused select): this rank's slice in its place of the area
    (every rank writes only its own), its window (``(head, bits)`` of
    ``prunopt.ops.topk_slice``, or prunAdag's) in its place of the windows'
    area when given, ``n_r`` and the agreement fields. Returns the global
    ``n`` and the summed vector (every rank's slice: :func:`_slices`), after
    checking that ``k`` and the dtype agree (``ValueError`` on every rank
    alike)."""
    world = plan.world
    buckets, area = _rank_buckets(world), _area(world)
    # (written through numpy: a handful of small copies, each a fraction of a
    # torch op's overhead; the tensor shares the array's memory)
    arr = np.zeros(_first_size(world), dtype=np.int64)
    rank = _rank_index(plan.groups)
    at = rank * (buckets + _SLICE_HEAD)
    arr[at:at + _SLICE_HEAD] = own.head
    arr[at + _SLICE_HEAD:at + _SLICE_HEAD + own.hist.numel()] = own.hist.numpy()
    if window is not None:
        head, bits = window
        slots = _window_slots(world)
        at = _slice_area(world) + rank * (_WINDOW_HEAD + slots)
        arr[at:at + _WINDOW_HEAD] = head
        if bits is not None and bits.numel():
            seg = arr[at + _WINDOW_HEAD:at + _WINDOW_HEAD + slots]
            (seg.view(np.int32) if bits.dtype == torch.int32 else seg)[:bits.numel()] = bits.numpy()
    arr[area:area + _META] = _meta(own.n_r, k, _RADIX[own.dtype])
    vec = torch.from_numpy(arr)
    _all_reduce(vec, plan.groups)
    n = _agreed_n(vec[area:area + _META].tolist(), k, world)
    return n, vec


def _rank_buckets(world: int) -> int:
    """Grid buckets per rank in the bracketed select's first collective: as
    many as fit beside the other ranks' in 2048 slots, at least 64 (beyond 29
    ranks the area grows by 70 slots per rank: 280 KB at 512 ranks)."""
    return max(_MIN_RANK_BUCKETS, (1 << _HIST0_BITS) // world - _SLICE_HEAD)


def _slice_area(world: int) -> int:
    """The slots of the slices (or the radix select's first histogram)."""
    return max(1 << _HIST0_BITS, world * (_rank_buckets(world) + _SLICE_HEAD))


def _window_area(world: int) -> int:
    """The slots of the windows after the slices: ``_WINDOW_AREA`` up to
    ``_WINDOW_WORLD`` ranks, none beyond (windows of a few hundred values
    rarely all hold the threshold)."""
    return _WINDOW_AREA if world <= _WINDOW_WORLD else 0


def _window_slots(world: int) -> int:
    """The slots of values in each rank's window (two float32 or one float64
    bit pattern per slot)."""
    return _window_area(world) // world - _WINDOW_HEAD


def _area(world: int) -> int:
    """The slots before the agreement fields: the slices', then the windows'."""
    return _slice_area(world) + _window_area(world)


def _first_size(world: int) -> int:
    """The int64 entries of a select's first collective over ``world`` ranks."""
    return _area(world) + _META


def _meta(n_r: int, k: int, spec: _Radix) -> List[int]:
    """The agreement fields of a first collective: ``n_r``, ``k``'s limbs and
    their squares, the dtype's code and its square."""
    k_limbs = _limbs(min(max(k, 0), (1 << 63) - 1), 3, 21)
    return [n_r] + k_limbs + [x * x for x in k_limbs] + [spec.code, spec.code ** 2]


def _agreed_n(meta: Sequence[int], k: int, world: int) -> int:
    """The global ``n`` from a first collective's summed agreement fields,
    after checking that the dtype and ``k`` are the same on every rank
    (``ValueError`` on every rank alike)."""
    if not _limbs_agree(meta[7:8], meta[8:9], world):
        raise ValueError("values must have one dtype on every rank")
    if not _limbs_agree(meta[1:4], meta[4:7], world):
        raise ValueError(f"k must be the same on every rank, got {k} on this one")
    return int(meta[0])


_STRUCT = {torch.float32: ("<f", "<I"), torch.float64: ("<d", "<Q")}


def _value_bits(x: float, dtype: torch.dtype) -> int:
    """The bit pattern of ``|x|`` in ``dtype`` (float32 or float64; ``x`` a
    value of that dtype)."""
    f, i = _STRUCT[dtype]
    return struct.unpack(i, struct.pack(f, x))[0] & ((1 << _RADIX[dtype].nbits) - 1)


def _bits_value(b: int, dtype: torch.dtype) -> float:
    f, i = _STRUCT[dtype]
    return struct.unpack(f, struct.pack(i, b))[0]


def _max_finite_bits(dtype: torch.dtype) -> int:
    return _value_bits(torch.finfo(dtype).max, dtype)


class _OwnSlice:
    """Step 1 of :func:`_bracket_select` on this rank, as the fused ops give
    it (``prunopt.ops.topk_slice``, or prunAdag's ``prunadag_slice``): the
    grid-aligned bracket ``[start, stop)`` (bit patterns; ``2**j`` per
    bucket), the pass's count above it, its candidates ``inside`` and its
    non-finite flag, the candidates' histogram ``hist`` on the grid, and the
    bit patterns ``scanned`` that the pass read; ``head`` is the slice's
    fixed fields (what the first collective carries), ``more`` what the pass
    gave besides (prunAdag's sums and the candidates' ``m``)."""

    def __init__(self, h: List[int], hist: Tensor, inside: Tensor, dtype: torch.dtype, more: tuple = ()):
        self.dtype, self.n_r, self.above, self.start, self.j, self.bad = dtype, h[0], h[1], h[2], h[3], bool(h[5])
        self.stop = self.start + (h[4] << self.j)
        self.scanned = (h[10], h[11])
        self.inside, self.hist, self.more = inside, hist, more
        self.head = h[:_SLICE_HEAD]

    @classmethod
    def of_op(cls, values: List[Tensor], k: int, world: int, buckets: int,
              cap: int) -> Tuple["_OwnSlice", Tuple[List[int], Optional[Tensor]]]:
        """Step 1 and the window of the plain select in one call of the fused
        op ``prunopt::topk_slice`` (its sample's bracket, its pass, and a
        window of at most ``cap`` values: the candidates of whole grid
        buckets around the share):
        ``(slice, (window head, window bits or None))``."""
        head, hist, bits, inside = torch.ops.prunopt.topk_slice(values, -(-k // world), buckets, cap, _sample_shape())
        h = head.tolist()
        return cls(h, hist, inside, values[0].dtype), (h[6:10], bits if h[9] > 0 else None)

    def covers(self, lo_bits: int, hi_bits: int) -> bool:
        """Whether this rank's bracket holds ``[L, H]`` (bit patterns): then
        its candidates are all its values in ``[L, H]``."""
        return self.scanned[0] <= lo_bits and hi_bits < self.scanned[1]

    def candidates(self, keys: List[Tensor], lo_bits: int, hi_bits: int) -> Tuple[int, Tensor]:
        """This rank's count of ``|v| > H`` and its ``|v|`` in ``[L, H]`` (bit
        patterns ``lo_bits``, ``hi_bits``): from the candidates when the
        bracket covers ``[L, H]``, else from another fused pass."""
        if not self.n_r:
            return 0, self.inside
        lo, hi = _bits_value(lo_bits, self.dtype), _bits_value(hi_bits, self.dtype)
        covered = self.covers(lo_bits, hi_bits)
        count, inside = _topk_bracket([self.inside] if covered else keys, lo, hi)
        return int(count) + (self.above if covered else 0), inside


class _Slice:
    """A rank's slice of the bracketed select's first collective, read back:
    ``ge[i]``, the exact count of its ``|v| >= start + i 2**j`` at its grid
    points (``i = 0..buckets``), gives bounds on its count of ``|v| >= t``
    for any bit pattern ``t``."""

    def __init__(self, head: Sequence[int], ge: Sequence[int]):
        self.n_r, self.above, self.start, self.j, nb, self.bad = (int(x) for x in head)
        self.stop = self.start + (nb << self.j)
        self.ge = ge

    def lower(self, t: int) -> int:
        """A lower bound on this rank's count of ``|v| >= t`` (bit pattern ``t > 0``)."""
        if not self.n_r or t > self.stop:
            return 0
        if t <= self.start:
            return self.ge[0]
        return self.ge[-(-(t - self.start) >> self.j)]

    def upper(self, t: int) -> int:
        """An upper bound on this rank's count of ``|v| >= t``."""
        if t < self.start:
            return self.n_r
        if t >= self.stop:
            return self.above if self.n_r else 0
        return self.ge[(t - self.start) >> self.j]


def _any_bad(vec: Tensor, world: int) -> bool:
    """Whether a slice of the summed first collective ``vec`` flags a
    non-finite value."""
    width = _rank_buckets(world) + _SLICE_HEAD
    return bool(vec.numpy()[_SLICE_HEAD - 1:world * width:width].any())


def _windows_of(vec: Tensor, world: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """Every rank's window head ``[a, lo, end, m]`` and value slots (rows of
    int64, a view of the summed first collective ``vec``), or ``None`` when
    some rank's window did not fit (``m = -1``)."""
    slots = _window_slots(world)
    at = _slice_area(world)
    rows = vec[at:at + world * (_WINDOW_HEAD + slots)].view(world, _WINDOW_HEAD + slots).numpy()
    heads = rows[:, :_WINDOW_HEAD]
    return None if (heads[:, 3] < 0).any() else (heads, rows[:, _WINDOW_HEAD:])


def _pooled_kth(pool: np.ndarray, heads: np.ndarray, k: int) -> Optional[int]:
    """The threshold's bit pattern from the pooled windows' bit patterns
    ``pool``: with ``A`` the sum of the counts above the windows, every ``t``
    inside all windows (``max lo <= t < min end``) has exactly ``A + #{pool
    >= t}`` values ``>= t`` over all ranks, so the ``(k - A)``-th largest of
    the pool, when it lies inside all windows, is the ``k``-th largest;
    ``None`` otherwise (the same on every rank).

    Only the pool's values inside all windows can be it: the ``C`` at or
    above ``min end`` all lie above it, those below ``max lo`` all below, so
    it is the ``r = (k - A - C)``-th largest of the inner values when ``r``
    is in range. That one is found in two steps, a histogram of the inner
    values on at most 1024 buckets and a partition of the bucket that holds
    it (half a partition of the whole pool's time)."""
    lo, end = int(heads[:, 1].max()), int(heads[:, 2].min())
    if lo >= end:
        return None
    rest = k - int(heads[:, 0].sum()) - int(np.count_nonzero(pool >= end))
    inner = pool[(pool >= lo) & (pool < end)].astype(np.int64)
    if not 1 <= rest <= inner.size:
        return None
    shift = max(0, (end - lo - 1).bit_length() - 10)
    digit = (inner - lo) >> shift
    hist = np.bincount(digit)
    ge = np.cumsum(hist[::-1])  # ge[i]: the inner values in the top i + 1 buckets
    b = int(np.searchsorted(ge, rest))  # the first count of the top buckets that reaches rest
    rest -= int(ge[b - 1]) if b else 0
    part = inner[digit == hist.size - 1 - b]
    return int(np.partition(part, part.size - rest)[part.size - rest])


def _window_tau(vec: Tensor, world: int, k: int, dtype: torch.dtype) -> Optional[int]:
    """The bit pattern of the ``k``-th largest ``|v|`` from every rank's
    window of values (``prunopt.ops.topk_slice``) in the summed first
    collective ``vec``, or ``None`` when the windows do not show it
    (:func:`_pooled_kth`)."""
    got = _windows_of(vec, world)
    if got is None:
        return None
    heads, vals = got
    if dtype == torch.float32:
        vals = vals.view(np.int32)
    return _pooled_kth(np.concatenate([vals[r, :int(m)] for r, m in enumerate(heads[:, 3])]), heads, k)


def _slices(area: Tensor, world: int, buckets: int) -> List[_Slice]:
    """Every rank's :class:`_Slice` from the summed area of the first collective."""
    rows = area[:world * (buckets + _SLICE_HEAD)].view(world, buckets + _SLICE_HEAD)
    heads = rows[:, :_SLICE_HEAD]
    # ge[:, i] = above + the counts of buckets >= i (buckets past a rank's own are 0)
    ge = torch.cat([rows[:, _SLICE_HEAD:].flip(1).cumsum(1).flip(1), torch.zeros(world, 1, dtype=rows.dtype)], 1)
    ge += heads[:, 1:2]
    return [_Slice(h, g) for h, g in zip(heads.tolist(), ge.tolist())]


def _bracket_of_slices(slices: Sequence[_Slice], k: int, n: int, top: int) -> Tuple[int, int]:
    """``[L, H]`` (bit patterns, ``H <= top``, the largest finite) holding the
    ``k``-th largest ``|v|`` ``tau`` of ``n`` (``1 <= k <= n``), from every
    rank's slice: ``L`` the largest ``t`` where the summed lower bounds reach
    ``k`` (at least ``k`` values are ``>= L``, so ``tau >= L``), ``H + 1`` the
    smallest where the summed upper bounds are below ``k`` (fewer than ``k``
    values are ``>= H + 1``, so ``tau <= H``). Both sums are non-increasing
    in ``t``: two binary searches over the bit patterns ``[0, top + 1]``, the
    same integers on every rank."""

    def lower(t: int) -> int:
        return n if t == 0 else sum(s.lower(t) for s in slices)

    def upper(t: int) -> int:
        return 0 if t > top else sum(s.upper(t) for s in slices)

    lo, hi = 0, top + 1  # lower(0) = n >= k: the largest t with lower(t) >= k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if lower(mid) >= k:
            lo = mid
        else:
            hi = mid - 1
    first = lo
    lo, hi = 0, top + 1  # upper(top + 1) = 0 < k: the smallest t with upper(t) < k
    while lo < hi:
        mid = (lo + hi) // 2
        if upper(mid) < k:
            hi = mid
        else:
            lo = mid + 1
    return first, lo - 1


def _select_in_bracket(cands: Tensor, groups: List, k: int, above: int, bad: bool, lo: float, hi: float,
                       nonfinite_is_none: bool, weights: Optional[Tuple[Tensor, Tensor]] = None,
                       extra: Sequence[float] = ()):
    """The ``(k - above summed over the ranks)``-th largest of the candidates
    ``cands`` (this rank's ``|v|`` inside ``[lo, hi]``, ``hi`` finite), by
    radix passes over the offsets ``bits(c) - bits(lo)``: the order of
    non-negative floats is the order of their bit patterns, and the offsets
    span only ``bits(hi) - bits(lo)``, so a narrow bracket takes one or two
    passes of at most 2048 buckets (at most 3 for float32, 6 for float64).
    The first pass also sums the counts above the bracket, the candidates'
    count and the non-finite flags; ``_MISSED`` on every rank when the rank
    left for the candidates is not in ``[1, their count]``.

    With ``weights = (w_ge, w_lt)`` (float64, one per candidate) each pass
    also sums both weights per bucket, and the ``extra`` float64 numbers are
    summed in the first pass (the vectors are then float64: counts stay exact
    below 2^53). The result is then ``(tau, s_ge, s_lt, extra_sums)`` with
    ``s_ge`` the sum of ``w_ge`` over every rank's candidates ``>= tau`` and
    ``s_lt`` that of ``w_lt`` over those ``< tau``: a quantity split at the
    threshold, with no pass over the values after it (the same float64 sums,
    in the same order, on every rank)."""
    dtype = cands.dtype
    int_dtype = _RADIX[dtype].int_dtype
    base = int(torch.tensor(lo, dtype=dtype).view(int_dtype))
    span = int(torch.tensor(hi, dtype=dtype).view(int_dtype)) - base
    nb = max(span.bit_length(), 1)
    npass = -(-nb // _HIST0_BITS)
    widths = [nb // npass + (1 if i < nb % npass else 0) for i in range(npass)]
    # (the sign bit cleared: a candidate -0.0 is 0.0)
    off = cands.view(int_dtype).bitwise_and((1 << _RADIX[dtype].nbits) - 1).sub_(base)
    shift = nb - widths[0]
    size = 1 << _HIST0_BITS
    nblocks = 1 if weights is None else 3
    vec = torch.zeros(nblocks * size + 3 + len(extra), dtype=torch.int64 if weights is None else torch.float64)
    digits = torch.bitwise_right_shift(off, shift)

    def fill(v: Tensor, d: Tensor, width: int, block: int, w: Optional[Tuple[Tensor, Tensor]]) -> None:
        # counts, then (weighted) the two weights' sums, per bucket; blocks of `block`
        v[:1 << width] = torch.bincount(d, minlength=1 << width)
        if w is not None:
            v[block:block + (1 << width)] = torch.bincount(d, weights=w[0], minlength=1 << width)
            v[2 * block:2 * block + (1 << width)] = torch.bincount(d, weights=w[1], minlength=1 << width)

    fill(vec, digits, widths[0], size, weights)
    vec[nblocks * size:] = torch.tensor([off.numel(), above, int(bad)] + list(extra), dtype=vec.dtype)
    _all_reduce(vec, groups)
    tail = vec[nblocks * size:].tolist()
    n_c, n_above, n_bad = (int(x) for x in tail[:3])
    if n_bad:
        if nonfinite_is_none:
            return None
        raise ValueError("values contain a non-finite value (on at least one rank)")
    k_rem = k - n_above
    if not 1 <= k_rem <= n_c:
        return _MISSED
    s_ge, s_lt = [], []  # the weights' sums of whole buckets above / below the threshold's

    def choose(v: Tensor, width: int, block: int, k_rem: int, last: bool) -> Tuple[int, int]:
        hist = v[:1 << width]  # (float64 counts when weighted: exact below 2^53)
        b, k_rem = _choose_host((hist if weights is None else hist.long()).tolist(), k_rem)
        if weights is not None:  # (the last pass's bucket holds tau itself: >= tau)
            s_ge.extend(v[block + b + (0 if last else 1):block + (1 << width)].tolist())
            s_lt.extend(v[2 * block:2 * block + b].tolist())
        return b, k_rem

    b, k_rem = choose(vec, widths[0], size, k_rem, len(widths) == 1)
    prefix = b
    w = weights
    for i, width in enumerate(widths[1:], start=2):
        if off.numel():
            keep = digits == b
            off = off[keep]
            if w is not None:
                w = (w[0][keep], w[1][keep])
        shift -= width
        digits = torch.bitwise_right_shift(off, shift).bitwise_and_((1 << width) - 1)
        hist = torch.zeros(nblocks << width, dtype=vec.dtype)
        fill(hist, digits, width, 1 << width, w)
        _all_reduce(hist, groups)
        b, k_rem = choose(hist, width, 1 << width, k_rem, i == len(widths))
        prefix = (prefix << width) | b
    tau = torch.tensor(base + prefix, dtype=int_dtype).view(dtype)
    if weights is None:
        return tau
    return tau, math.fsum(s_ge), math.fsum(s_lt), tail[3:]


# The sample that brackets a rank's order statistic (in the fused ops
# topk_slice and prunadag_slice, which take these sizes): blocks of
# _SAMPLE_BLOCK contiguous values taken at a fixed stride (no random draw:
# every run sees the same bracket), about (6 n_r)^(2/3) values in all within
# [_SAMPLE_MIN, _SAMPLE_MAX] (the sample's cost grows with its size, the
# candidates' as n_r / sqrt(size)); the bracket spans the sample's order
# statistics 5 standard deviations of a binomial count (plus 8 ranks) either
# side of the share.
_SAMPLE_MIN, _SAMPLE_MAX, _SAMPLE_BLOCK = 1 << 15, 1 << 20, 128
# _radix_select's answer when the bracket missed (see _bracket_select)
_MISSED = object()


def _sample_shape() -> List[int]:
    """The sample's shape that the fused ops take: ``[min, max, block]``."""
    return [_SAMPLE_MIN, _SAMPLE_MAX, _SAMPLE_BLOCK]


def _topk_threshold_or_none(values: List[Tensor], k: int, group: Group = None) -> Optional[Tensor]:
    """:func:`topk_threshold` over plain local tensors, but ``None`` on every
    rank (instead of a ``ValueError``) when a value on some rank is not finite:
    for callers that report non-finite inputs in their own way (PrunAdag skips
    or raises its step)."""
    plan = _plan(values, group, "values")
    if not plan.groups:
        if not all(bool(torch.isfinite(v).all()) for v in plan.locals):
            return None
        return _topk_threshold_one(plan.locals, k)
    return _select(plan.locals, plan, k, nonfinite_is_none=True)


def _radix_select(local: List[Tensor], plan: _Plan, k: int, nonfinite_is_none: bool = False,
                  above: Optional[int] = None, bad: bool = False):
    """The sharded radix select of :func:`topk_threshold` on checked local
    tensors (with ``plan.groups`` empty it runs in one process: the tests use
    that to compare it with the one-process op on many inputs). With
    ``above`` (this rank's count of elements known to rank above all of
    ``local``, e.g. above a bracket) the first pass also sums it, and the
    ``(k - total above)``-th largest of ``local`` is selected, and when that
    rank falls outside ``[1, total of local]`` (the elements above were
    counted from a bracket that missed) every rank returns ``_MISSED``.
    ``bad`` flags a non-finite value this rank found outside ``local``."""
    dtype, device = local[0].dtype, local[0].device
    spec = _RADIX[dtype]
    keys = [v.detach().reshape(-1).view(spec.int_dtype) for v, c in zip(local, plan.counted) if c and v.numel()]
    compact = device.type in _COMPACT_DEVICES

    # Pass 1: the top digit of every element, and what every rank must agree on.
    w0 = spec.widths[0]
    shift = spec.nbits - w0
    extra = 0 if above is None else 1
    # a select's first collective (above is None) has the layout of every path's (see _first_size)
    meta_at = _area(plan.world) if above is None else 1 << _HIST0_BITS
    size = _first_size(plan.world) if above is None else meta_at + _META + extra
    vec = torch.zeros(size, dtype=torch.int64, device=device)
    top = _TopDigit(keys, shift, w0, chunked=compact)
    vec[:1 << w0] = top.histogram()
    meta = _meta(sum(b.numel() for b in keys), k, spec) + ([] if above is None else [above])
    for j, m in enumerate(meta):
        vec[meta_at + j].fill_(m)
    if bad:  # counted as an element of a non-finite digit, so every rank sees it
        vec[spec.nonfinite_digit] += 1
    _all_reduce(vec, plan.groups)
    # the one read back (host sync on CUDA): the non-finite digits' counts and the agreement fields
    tail = torch.cat([vec[spec.nonfinite_digit:1 << w0], vec[meta_at:meta_at + _META + extra]]).tolist()
    meta = tail[(1 << w0) - spec.nonfinite_digit:]
    n = _agreed_n(meta, k, plan.world)
    if sum(tail[:(1 << w0) - spec.nonfinite_digit]):
        if nonfinite_is_none:
            return None
        raise ValueError("values contain a non-finite value (on at least one rank)")
    if above is not None:
        k -= int(meta[_META])
        if not 1 <= k <= n:
            return _MISSED
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    keep = (1 << spec.nbits) - 1

    if compact:
        b, k_rem = _choose_host(vec[:1 << w0].tolist(), k)
        prefix = b
        cands = [c.bitwise_and_(keep) for c in top.select(b)]
        for p, w in enumerate(spec.widths[1:], start=1):
            shift -= w
            hist = torch.zeros(1 << w, dtype=torch.int64, device=device)
            ds = []
            for c in cands:
                d = torch.bitwise_right_shift(c, shift).bitwise_and_((1 << w) - 1)
                hist += _bincount(d, 1 << w)
                ds.append(d)
            _all_reduce(hist, plan.groups)
            b, k_rem = _choose_host(hist.tolist(), k_rem)
            prefix = (prefix << w) | b
            if p < len(spec.widths) - 1:
                cands = [c[d == b] for c, d in zip(cands, ds)]
        return torch.tensor(prefix, dtype=spec.int_dtype, device=device).view(dtype)

    # Elsewhere (CUDA): the prefix and the remaining rank stay on the device.
    prefix, k_rem = _choose_device(vec[:1 << w0], torch.full((), k, dtype=torch.int64, device=device))
    prev = shift
    for w in spec.widths[1:]:
        shift = prev - w
        hist = torch.zeros((1 << w) + 1, dtype=torch.int64, device=device)  # + a bucket for non-candidates
        for bits in keys:
            key = bits & keep
            match = torch.bitwise_right_shift(key, prev) == prefix
            d = torch.bitwise_right_shift(key, shift).bitwise_and_((1 << w) - 1)
            hist += _bincount(torch.where(match, d, 1 << w), (1 << w) + 1)
        _all_reduce(hist, plan.groups)
        b, k_rem = _choose_device(hist[:1 << w], k_rem)
        prefix = prefix * (1 << w) + b
        prev = shift
    return prefix.to(spec.int_dtype).view(dtype)


# ---------------------------------------------------------------------------
# project_budget: a bracketing search on lambda with verified brackets
# ---------------------------------------------------------------------------

_PROJ_BUCKETS = 2048
_CHUNK = 1 << 20
_MAX_PASSES = 500
_ULPS = 16  # a bracket this many ulps wide is the end of the search


def _f2b(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _b2f(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


class _Buckets:
    """At most ``_PROJ_BUCKETS`` sub-buckets of a bracket ``[lo, hi]``
    (``0 <= lo < hi <= inf``) cut at bit-pattern boundaries: a non-negative
    double's bits order like the double, so a key's bucket is exact integer
    arithmetic on its bits (no rounding at the edges)."""

    def __init__(self, lo: float, hi: float):
        self.lo_b, self.hi_b = _f2b(lo), _f2b(hi)
        width = self.hi_b - self.lo_b
        per = -(-width // _PROJ_BUCKETS)
        self.shift = max(0, (per - 1).bit_length())
        self.nb = -((-width) >> self.shift)
        # (float64 edges from their bit patterns in one vector op: nb + 1 of them)
        bits = torch.arange(self.nb + 1, dtype=torch.int64).bitwise_left_shift_(self.shift).add_(self.lo_b)
        self.edges = bits.view(torch.float64)
        self.edges[self.nb] = hi
        self.aligned = width == self.nb << self.shift
        # ceil((bits - lo) / 2**shift) as one shift: (bits - lo - 1 + 2**shift) >> shift
        self.offset = self.lo_b + 1 - (1 << self.shift)
        # (hi = inf: one more ulp would overflow int64; nothing but NaN lies above inf)
        self.top = self.hi_b + 1 if width + (1 << self.shift) < (1 << 63) else self.hi_b

    def index(self, x: Tensor) -> Tensor:
        """The number of edges strictly below each key, ``0 ... nb + 1``."""
        xb = x.view(torch.int64)  # negative keys (and -0.0) have negative bits: below lo
        if self.aligned:  # keys above hi clamp to hi + 1 ulp, which is bucket nb + 1
            return torch.bitwise_right_shift(xb.clamp(self.lo_b, self.top) - self.offset, self.shift)
        m = torch.bitwise_right_shift(xb.clamp(self.lo_b, self.hi_b) - self.offset, self.shift)
        return m + (xb > self.hi_b)


@dataclass
class _Block:
    """Elements of one local tensor (or candidates kept from them): scores and
    costs (``None``: unit costs), flat, any float dtype."""

    t: Tensor
    c: Optional[Tensor]


def _chunks(t: Tensor, c: Optional[Tensor]) -> List[_Block]:
    t = t.detach().reshape(-1)
    c = c.detach().reshape(-1) if c is not None else None
    if t.numel() <= _CHUNK:
        return [_Block(t, c)] if t.numel() else []
    ts = t.split(_CHUNK)
    cs = c.split(_CHUNK) if c is not None else [None] * len(ts)
    return [_Block(a, b) for a, b in zip(ts, cs)]


# Slots of a pass's vector (float64): phi at both ends of the proposal, its number
# of candidates, the base sums of the verified bracket and of the proposal, the
# number of elements swept; the first pass adds the checks every rank must agree
# on; then the histograms.
_PHI_LO, _PHI_HI, _NCAND, _BV, _BP, _NBLOCK = 0, 1, 2, 3, 6, 9
_HEAD = 10
_NONFINITE, _BADCOST, _HASCOST, _LIMBS = _HEAD, _HEAD + 1, _HEAD + 2, _HEAD + 3
_CHECKS = 3 + 2 * 4
_SAMPLE = 1 << 14  # elements per block whose breakpoints a sampled histogram reads


def _sweep(blocks: List[_Block], base: Sequence[float], plo: float, phi: float, buckets: Optional[_Buckets], *,
           first: bool, ends: bool, classify: bool, sample: bool, has_cost: bool, budget: float, device):
    """One pass over this rank's candidate blocks for the proposal ``[plo, phi]``.

    Fills a float64 vector to all_reduce with (as asked): phi at both ends
    (``ends``), taken directly over the elements, every term ``>= 0``; the
    proposal's candidates (elements with a breakpoint strictly inside it) and
    the base sums of the others, whose class (U or F) is fixed over it
    (``classify``); the five histograms of the breakpoints on the sub-buckets
    of ``buckets`` from which the next proposal is read (all elements, or a
    strided sample of each block, scaled, when ``sample``: a proposal from a
    sample is checked like any other). ``base`` holds the sums of the elements
    folded away before (their class is fixed over the verified bracket).
    Returns the vector, the candidate masks and this rank's base sums of the
    proposal."""
    nb = buckets.nb if buckets is not None else 0
    extra = _CHECKS if first else 0
    vec = torch.zeros(_HEAD + extra + (5 * (nb + 2) if buckets is not None else 0), dtype=torch.float64,
                      device=device)
    hist = vec[_HEAD + extra:].view(5, nb + 2) if buckets is not None else None
    bu, bfct, bfcc = base
    acc = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(_HEAD + extra)]
    acc[_PHI_LO] += bu + bfct - plo * bfcc
    if math.isfinite(phi):
        acc[_PHI_HI] += bu + bfct - phi * bfcc
    for j, v in enumerate(base):
        acc[_BV + j] += v
        acc[_BP + j] += v
    masks = []
    for blk in blocks:
        acc[_NBLOCK] += blk.t.numel()
        t = blk.t.double()
        c = blk.c.double() if blk.c is not None else None
        if first:
            acc[_NONFINITE] += (~torch.isfinite(t)).sum()
            if c is not None:
                acc[_BADCOST] += (~((c > 0) & torch.isfinite(c))).sum()
        if ends:
            acc[_PHI_LO] += _clamped_sum(t, c, plo)
            if math.isfinite(phi):
                acc[_PHI_HI] += _clamped_sum(t, c, phi)
        if classify:
            k1, k2 = _breakpoints(t, c)
            up = k2 >= phi  # U over the whole proposal
            free = (k2 <= plo) & (k1 >= phi)  # F over the whole proposal
            cand = ~(up | free | (k1 <= plo))
            acc[_NCAND] += cand.sum()
            acc[_BP] += _masked_sum(c, up)
            if c is None:
                acc[_BP + 1] += _masked_sum(t, free)
                acc[_BP + 2] += free.sum()
            else:
                acc[_BP + 1] += _masked_sum(c * t, free)
                acc[_BP + 2] += _masked_sum(c * c, free)
            masks.append(cand)
        else:  # at least the candidates (V's own, or all): 0 only when there are none
            acc[_NCAND] += t.numel()
        if buckets is not None:
            if sample and t.numel() > _SAMPLE:
                stride = t.numel() // _SAMPLE
                ts, cs = t[::stride], (c[::stride] if c is not None else None)
                scale = t.numel() / ts.numel()
            else:
                ts, cs, scale = t, c, 1.0
            k1, k2 = _breakpoints(ts, cs)
            m2, m1 = buckets.index(k2), buckets.index(k1)
            # each element is free on [a, b] = [max(k2, plo), max(k1, a)]: offsets from plo
            xa = (k2 - plo).clamp_(min=0.0)
            free_len = (k1 - plo).clamp_(min=0.0).sub_(xa).clamp_(min=0.0)
            if cs is None:
                w = (None, xa, None, xa, free_len)
            else:
                cc = cs * cs
                w = (cc, cc * xa, cc, cc * xa, cc * free_len)
            for row, (m, wt) in enumerate(zip((m2, m2, m1, m1, m1), w)):
                h = torch.bincount(m, weights=wt, minlength=nb + 2)
                hist[row] += h if scale == 1.0 else h * scale
    if first:
        acc[_HASCOST] += 1.0 if has_cost else 0.0
        for j, x in enumerate(_limbs(_f2b(budget), 4, 16)):  # exact in float64 (16-bit limbs)
            acc[_LIMBS + j] += float(x)
            acc[_LIMBS + 4 + j] += float(x * x)
    vec[:_HEAD + extra] = torch.stack(acc)
    return vec, masks, tuple(vec[_BP:_BP + 3].tolist())  # (this rank's own, read before the reduce)


def _breakpoints(t: Tensor, c: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``t/c`` (where the element reaches 0 as lambda grows) and ``(t-1)/c``
    (where it leaves 1)."""
    if c is None:
        return t, t - 1.0
    return t / c, (t - 1.0) / c


def _clamped_terms(t: Tensor, c: Optional[Tensor], lam: float) -> Tensor:
    """``c clamp(t - lam c, 0, 1)`` per element (each element's term of phi)."""
    if c is None:
        return (t - lam).clamp_(0.0, 1.0)
    return (t - lam * c).clamp_(0.0, 1.0).mul_(c)


def _clamped_sum(t: Tensor, c: Optional[Tensor], lam: float) -> Tensor:
    """``sum c clamp(t - lam c, 0, 1)``, every term >= 0 (no cancellation)."""
    return _clamped_terms(t, c, lam).sum()


def _masked_sum(w: Optional[Tensor], mask: Tensor) -> Tensor:
    return mask.sum() if w is None else torch.where(mask, w, 0.0).sum()


def _propose(hist: Tensor, free_cc: float, buckets: _Buckets, phi_lo: float, phi_hi: float) -> Tuple[float, float]:
    """The sub-bucket of the proposal where the histograms put phi's sign change.

    phi falls with slope ``-c_i^2`` where element ``i`` is free, on
    ``[k2_i, k1_i]`` (its breakpoints), so from the directly summed
    ``phi(lambda_0)``, ``phi(lambda_j) = phi(lambda_0) - sum_i c_i^2 |[lambda_0,
    lambda_j] cap [k2_i, k1_i]|``: prefix sums of the histograms of ``c^2``,
    ``c^2 a`` (by the bucket where each element starts being free, ``a``
    measured from ``lambda_0``) and of ``c^2``, ``c^2 a``, ``c^2 (b - a)`` (by
    the bucket where it stops). Every term is measured from ``lambda_0``, so the
    rounding scales with the proposal's width, not with the scores (running
    sums of ``c t`` would cancel near the root). Still a proposal only: the
    histograms may come from a sample, and the next pass checks the proposal
    with sums taken directly over the data."""
    h = hist.view(5, -1).cpu().cumsum(1)[:, :buckets.nb + 1]  # prefix sums: the elements with m <= j
    nb = buckets.nb
    lam = buckets.edges - buckets.edges[0]
    started = h[0] - h[2]  # free at lambda_j: started (m2 <= j) and not stopped (m1 > j)
    drop = lam * (started + free_cc) - (h[1] - h[3]) + h[4]
    phi = phi_lo - torch.nan_to_num(drop, nan=0.0, posinf=0.0)
    phi[0], phi[nb] = phi_lo, phi_hi
    below = torch.nonzero(phi[1:] <= 0)
    j = int(below[0]) + 1 if below.numel() else nb
    return float(buckets.edges[j - 1]), float(buckets.edges[j])


def _compact(blocks: List[_Block], masks: List[Tensor]) -> List[_Block]:
    """The candidates of each block, in float64, in blocks of at most ``_CHUNK``."""
    if not blocks:
        return []
    t = torch.cat([b.t[m].double() for b, m in zip(blocks, masks)])
    c = torch.cat([b.c[m].double() for b, m in zip(blocks, masks)]) if blocks[0].c is not None else None
    return _chunks(t, c)


def _solve_lambda(blocks: List[_Block], has_cost: bool, budget: float, plan: _Plan, device,
                  start: Optional[Tuple[float, float, Tuple[float, float, float]]] = None) -> float:
    """lambda* of the projection over all ranks; every rank returns the same value.

    Keeps a verified bracket ``V`` (``phi(lo) > 0 >= phi(hi)`` from direct sums;
    first ``[0, inf]``) with this rank's candidate blocks (at least the
    elements with a breakpoint strictly inside ``V``) and the base sums of the
    elements folded away, and a proposal ``P`` inside ``V`` read from the
    histograms of ``V``'s sub-buckets (by binade at first, from a sample). A
    pass checks ``P`` by phi at its ends: confirmed, it becomes ``V``, and if it
    holds no breakpoint phi is linear on it, so the root is one division, as in
    the one-process solvers; refuted, ``V`` is cut at ``P``'s end and the next
    proposal reaches out from there. In the usual case the whole data are read
    twice (the first pass, with the histograms of a sample; the check of the
    first proposal, which also compacts) and later passes read the candidates.

    ``start = (lo, hi, base)``: the search goes on from a bracket already
    verified (the input checked), with ``blocks`` exactly its candidates and
    ``base`` this rank's sums of the others (:func:`_bracketed_lambda`)."""
    vlo, vhi = 0.0, math.inf
    base = (0.0, 0.0, 0.0)
    exact = False  # whether the blocks are exactly V's candidates
    compacted = False
    first = True
    if start is not None:
        vlo, vhi, base = start
        exact = compacted = True
        first = False
    plo, phi = vlo, vhi
    for _ in range(_MAX_PASSES):
        if not first and _f2b(vhi) - _f2b(vlo) <= _ULPS:
            # V is a few ulps wide: the sums cannot place the root more closely (it
            # sits in a cluster of breakpoints, phi's slope is within their rounding).
            # Its upper end keeps the budget: phi(vhi) <= 0.
            return vhi
        verify = (plo, phi) != (vlo, vhi)
        # the candidates of P: needed to check it, and to compact blocks that are more than V's candidates
        classify = verify or (compacted and not exact)
        with_hist = compacted or not verify
        buckets = _Buckets(plo, phi) if with_hist else None
        vec, masks, base_p = _sweep(
            blocks, base, plo, phi, buckets, first=first, ends=first or verify or with_hist, classify=classify,
            sample=first, has_cost=has_cost, budget=budget, device=device)
        _all_reduce(vec, plan.groups)
        extra = _CHECKS if first else 0
        head = vec[:_HEAD + extra].tolist()
        if first:
            if head[_HASCOST] not in (0.0, float(plan.world)):
                raise ValueError("cost must be given on every rank or on none")
            if not _limbs_agree(head[_LIMBS:_LIMBS + 4], head[_LIMBS + 4:_LIMBS + 8], plan.world):
                raise ValueError(f"budget must be the same on every rank, got {budget} on this one")
            if head[_NONFINITE]:
                raise ValueError("project_budget: theta contains a non-finite value (on at least one rank)")
            if head[_BADCOST]:
                raise ValueError("project_budget: cost must be positive and finite everywhere (on at least one rank)")
            if budget == 0:
                return math.inf  # every score goes to zero
            if head[_PHI_LO] - budget <= 0:
                return 0.0  # slack budget: clamp only
            first = False
        phi_lo = head[_PHI_LO] - budget
        phi_hi = head[_PHI_HI] - budget if math.isfinite(phi) else -budget
        # V's own ends keep their known signs (a recomputed sum may round the other way)
        pos = plo == vlo or phi_lo > 0
        nonpos = phi == vhi or phi_hi <= 0
        if not (pos and nonpos):
            # Refuted: the root lies between P's end and V's, close to P's end (the
            # histograms missed it by their rounding, or the sample by its noise).
            # The next proposal reaches from that end 16 times as far as P was wide.
            reach = 16 * (_f2b(phi) - _f2b(plo))
            if not pos:
                vhi = plo
                plo, phi = _b2f(max(_f2b(vlo), _f2b(plo) - reach)), plo
            else:
                vlo = phi
                plo, phi = phi, _b2f(min(_f2b(vhi), _f2b(phi) + reach))
            exact = False
            continue
        vlo, vhi = plo, phi
        if head[_NCAND] == 0:
            # no breakpoint inside: phi is linear on [plo, phi]; the base sums of P are its U and F sums
            su, sfct, sfcc = head[_BP:_BP + 3]
            if sfcc <= 0:
                return phi
            return min(max((su + sfct - budget) / sfcc, plo), phi)
        if classify:  # compact when that halves the elements (decided alike on every rank: it shapes the passes)
            if head[_NCAND] <= 0.5 * head[_NBLOCK]:
                blocks, base, exact, compacted = _compact(blocks, masks), base_p, True, True
            else:
                exact = False
        if with_hist:
            plo, phi = _propose(vec[_HEAD + extra:], head[_BV + 2], buckets, phi_lo, phi_hi)
        # else: the next pass histograms V itself
    raise RuntimeError("project_budget: the bracketing search did not converge")  # pragma: no cover


def _projection_inputs(theta, budget, cost, group):
    thetas, single = as_tensor_list(theta, "theta")
    costs = None
    if cost is not None:
        costs, _ = as_tensor_list(cost, "cost")
        if len(costs) != len(thetas):
            raise ValueError(f"cost must have as many tensors as theta ({len(thetas)}), got {len(costs)}")
        for i, (t, c) in enumerate(zip(thetas, costs)):
            if is_distributed_tensor(t) != is_distributed_tensor(c):
                raise ValueError(f"cost[{i}] must be a DTensor exactly when theta[{i}] is one")
            if is_distributed_tensor(t) and (c.device_mesh != t.device_mesh or tuple(c.placements) != tuple(
                    t.placements) or c.shape != t.shape):
                raise ValueError(f"cost[{i}] must have the device mesh, placements and shape of theta[{i}]")
    plan = _plan(thetas, group, "theta")
    local_costs = [local_tensor(c) for c in costs] if costs is not None else None
    _, local_costs, budget, _ = validate_projection_args(plan.locals, budget, local_costs)
    return thetas, single, plan, local_costs, budget


def _solve_for(plan: _Plan, costs: Optional[List[Tensor]], budget: float) -> float:
    ts = [t for t, counted in zip(plan.locals, plan.counted) if counted]
    cs = [c for c, counted in zip(costs, plan.counted) if counted] if costs is not None else None
    device = plan.locals[0].device if plan.locals else _default_device(plan.groups)
    if device.type in _PROJ_DEVICES:
        return _bracketed_lambda(ts, cs, budget, plan, device)
    return _solve_lambda(_blocks_of(ts, cs), costs is not None, budget, plan, device)


def _blocks_of(ts: List[Tensor], cs: Optional[List[Tensor]]) -> List[_Block]:
    blocks = []
    for i, t in enumerate(ts):
        blocks += _chunks(t, cs[i] if cs is not None else None)
    return blocks


# The sharded projection in few collectives (_bracketed_lambda): a sample of
# _PROJ_SAMPLE elements over all ranks (ceil(_PROJ_SAMPLE / W) per rank, in
# runs of _PROJ_RUN consecutive elements), a bracket of _PROJ_Z standard
# deviations of the sampled phi (over its slope) either side of the sampled
# root, at least _PROJ_MIN_WIDTH of it (relative); up to _PROJ_GATHER kept
# elements over all ranks travel in a pass's collective and are solved
# exactly; after _PROJ_LEVELS levels the histogram search goes on.
_PROJ_DEVICES = frozenset({"cpu"}) & _kernel_devices("project_budget_bracket", meta=False)
_PROJ_SAMPLE, _PROJ_RUN, _PROJ_Z, _PROJ_MIN_WIDTH = 8192, 8, 4.0, 1e-9
_PROJ_GATHER, _PROJ_LEVELS = 4096, 8


def _proj_sizes(world: int) -> Tuple[int, int]:
    """The float64 entries of :func:`_bracketed_lambda`'s collectives over
    ``world`` ranks: the sample collective, and each pass's (the sweep's
    head and histograms, three flags, the gathered kept elements)."""
    per = -(-_PROJ_SAMPLE // world)
    cap = -(-_PROJ_GATHER // world)
    return world * (2 + 2 * per) + 9, _HEAD + 5 * (_PROJ_BUCKETS + 2) + 3 + world * (1 + 2 * cap)


def _proj_sample(ts: List[Tensor], cs: Optional[List[Tensor]], m: int) -> Tuple[int, Tensor, Tensor]:
    """This rank's ``n_r`` and up to ``m`` of its ``(t, c)`` (float64, ``c = 1``
    without costs), spread over its elements in runs of ``_PROJ_RUN`` (all of
    them when they are ``m`` or fewer), leaving out non-finite scores and bad
    costs (the pass reports those)."""
    flat = [t.detach().reshape(-1) for t in ts]
    sizes = [t.numel() for t in flat]
    n_r = sum(sizes)
    empty = torch.zeros(0, dtype=torch.float64)
    if n_r == 0 or m == 0:
        return n_r, empty, empty
    if n_r <= m:
        idx = torch.arange(n_r)
    else:
        runs = max(1, m // _PROJ_RUN)
        run = min(_PROJ_RUN, m)
        starts = torch.arange(runs, dtype=torch.int64) * (n_r - run) // max(runs - 1, 1)
        idx = (starts[:, None] + torch.arange(run)).reshape(-1)
    tparts, cparts = [], []
    at = 0
    for i, (v, n) in enumerate(zip(flat, sizes)):
        lo, hi = torch.searchsorted(idx, at), torch.searchsorted(idx, at + n)
        if hi > lo:
            j = idx[lo:hi] - at
            tparts.append(v.index_select(0, j.to(v.device)).double().cpu())
            c = cs[i].detach().reshape(-1).index_select(0, j.to(v.device)).double().cpu() if cs is not None else None
            cparts.append(c if c is not None else torch.ones(j.numel(), dtype=torch.float64))
        at += n
    t, c = torch.cat(tparts), torch.cat(cparts)
    ok = torch.isfinite(t) & torch.isfinite(c) & (c > 0)
    return n_r, t[ok], c[ok]


def _phi_at(t: Tensor, c: Tensor, w: Optional[Tensor], base: Sequence[float], budget: float, lam: float) -> float:
    """``base(lam) + sum w c clamp(t - lam c, 0, 1) - S`` (``base`` the U, F
    sums ``(u, f_ct, f_cc)`` of elements of fixed class, ``w = 1`` if None)."""
    y = _clamped_terms(t, c, lam)
    if w is not None:
        y.mul_(w)
    return base[0] + base[1] - lam * base[2] + float(y.sum()) - budget


def _set_root(t: Tensor, c: Tensor, w: Optional[Tensor], base: Sequence[float], budget: float, lo: float,
              hi: float) -> float:
    """The root of :func:`_phi_at` on ``[lo, hi]`` (``phi(lo) > 0 >= phi(hi)``
    taken as given): a binary search over the set's breakpoints inside ``(lo,
    hi)`` with phi summed directly at each, then the linear piece between two
    neighbours, whose root is one division (the one-process solvers' exact
    root, for a small set)."""
    k1, k2 = _breakpoints(t, c)
    pts = torch.cat([k1, k2])
    pts = torch.unique(pts[(pts > lo) & (pts < hi)]).tolist()
    pts = [lo] + pts + [hi]
    i, j = 0, len(pts) - 1  # phi(pts[i]) > 0 >= phi(pts[j])
    while j - i > 1:
        mid = (i + j) // 2
        if _phi_at(t, c, w, base, budget, pts[mid]) > 0:
            i = mid
        else:
            j = mid
    a, b = pts[i], pts[j]
    wc = c if w is None else w * c
    up = k2 >= b
    free = (k2 <= a) & (k1 >= b)
    fcc = base[2] + float((wc * c)[free].sum())
    if not fcc > 0:
        return b
    root = (base[0] + float(wc[up].sum()) + base[1] + float((wc * t)[free].sum()) - budget) / fcc
    return min(max(root, a), b)


def _sample_bracket_of(slots: List[Tuple[int, Tensor, Tensor]], budget: float) -> Tuple[float, float]:
    """A bracket of lambda* from every rank's sample ``(n_r, t, c)``: the root
    of the sampled phi (each rank's elements weighted ``n_r / m_r``), widened
    by ``_PROJ_Z`` standard deviations of the sampled phi there (the ranks'
    samples are strata: the variance is the sum of theirs) over its slope.
    The same floats on every rank (the same slots, the same order)."""
    ts, cs, ws, ranks = [], [], [], []
    var = 0.0
    for r, (n_r, t, c) in enumerate(slots):
        if t.numel():
            ts.append(t)
            cs.append(c)
            ws.append(torch.full_like(t, n_r / t.numel()))
            ranks.append(torch.full((t.numel(),), r, dtype=torch.int64))
    if not ts:
        return 0.0, math.inf
    t, c, w, rank = torch.cat(ts), torch.cat(cs), torch.cat(ws), torch.cat(ranks)
    zero = (0.0, 0.0, 0.0)
    if _phi_at(t, c, w, zero, budget, 0.0) <= 0:
        lam = 0.0
    else:
        top = float((t / c).max())  # phi(max t/c) = -S < 0
        lam = _set_root(t, c, w, zero, budget, 0.0, top)
    # each rank's sample variance of the terms, from per-rank sums (one pass)
    y = _clamped_terms(t, c, lam)
    m = torch.bincount(rank, minlength=len(slots)).double()
    mean = torch.bincount(rank, weights=y, minlength=len(slots)) / m.clamp(min=1.0)
    var_r = (torch.bincount(rank, weights=y * y, minlength=len(slots)) / m.clamp(min=1.0) - mean * mean).clamp(min=0.0)
    for (n_r, _, _), m_r, v in zip(slots, m.tolist(), var_r.tolist()):
        if 0 < m_r < n_r:
            var += n_r * n_r * v / m_r * (1.0 - m_r / n_r)
    k1, k2 = _breakpoints(t, c)
    slope = float((w * c * c)[(k2 < lam) & (k1 > lam)].sum())
    scale = max(1.0, abs(lam))
    delta = _PROJ_Z * math.sqrt(var) / slope if slope > 0 else 1e-3 * scale
    delta = max(delta, _PROJ_MIN_WIDTH * scale)
    return max(0.0, lam - delta), lam + delta


def _bracketed_lambda(ts: List[Tensor], cs: Optional[List[Tensor]], budget: float, plan: _Plan, device) -> float:
    """lambda* of the sharded projection in few collectives (CPU):

    1. every rank puts a sample of its elements in its slot of the first
       ``all_reduce`` (with the checks every rank must agree on), and every
       rank brackets lambda* alike from all of them
       (:func:`_sample_bracket_of`);
    2. one ``project_budget_bracket`` pass over this rank's elements keeps
       those with a breakpoint inside the bracket and sums the others (their
       class is fixed on it), and checks the input; the next ``all_reduce``
       verifies the bracket by phi at its ends (summed directly), carries the
       histograms of the kept breakpoints on 2048 sub-buckets and, when they
       are ``_PROJ_GATHER`` or fewer over all ranks, the kept elements
       themselves, which every rank then solves exactly (:func:`_set_root`);
    3. otherwise the sub-bucket the histograms point to is the next bracket,
       and the kept elements the data of the next pass (the op again, on
       them), and so on.

    Three collectives on data alike across ranks. A bracket that the sums
    refute (a misleading sample) hands over to the histogram search
    (:func:`_solve_lambda`), from scratch or from the last verified bracket:
    the result never depends on the sample, only the time."""
    from prunopt.ops.projection import project_budget_bracket

    world, me = plan.world, _rank_index(plan.groups)
    has_cost = cs is not None
    per = -(-_PROJ_SAMPLE // world)
    n_r, st, sc = _proj_sample(ts, cs, per)
    # 1) the sample collective: slots [n_r, m_r, t (per), c (per)], then the checks
    slot = 2 + 2 * per
    vec = torch.zeros(world * slot + 9, dtype=torch.float64)
    at = me * slot
    m_r = st.numel()
    vec[at], vec[at + 1] = float(n_r), float(m_r)
    vec[at + 2:at + 2 + m_r] = st
    vec[at + 2 + per:at + 2 + per + m_r] = sc
    checks = world * slot
    vec[checks] = 1.0 if has_cost else 0.0
    limbs = _limbs(_f2b(budget), 4, 16)
    vec[checks + 1:checks + 9] = torch.tensor([float(x) for x in limbs] + [float(x * x) for x in limbs],
                                              dtype=torch.float64)
    _all_reduce(vec, plan.groups)
    head = vec[checks:].tolist()
    if head[0] not in (0.0, float(world)):
        raise ValueError("cost must be given on every rank or on none")
    if not _limbs_agree(head[1:5], head[5:9], world):
        raise ValueError(f"budget must be the same on every rank, got {budget} on this one")
    rows = vec[:world * slot].view(world, slot)
    slots = []
    for r in range(world):
        nr, mr = int(rows[r, 0]), int(rows[r, 1])
        slots.append((nr, rows[r, 2:2 + mr], rows[r, 2 + per:2 + per + mr]))
    if budget > 0:
        lo, hi = _sample_bracket_of(slots, budget)
    else:
        lo, hi = 0.0, 0.0  # the pass only checks the input
    # 2-3) the passes: the op over this rank's data (first all of it, then what
    # the last pass kept), then one all_reduce
    cap = -(-_PROJ_GATHER // world)
    data_t, data_c = [t for t in ts if t.numel()], ([c for t, c in zip(ts, cs) if t.numel()] if has_cost else None)
    base = (0.0, 0.0, 0.0)
    verified = None  # (lo, hi, blocks, base) of the last verified bracket
    for level in range(_PROJ_LEVELS):
        if data_t:
            summary, kt, kc = project_budget_bracket(data_t, lo, hi, data_c)
            s = summary.tolist()
        else:
            s, kt, kc = [0.0] * 5, torch.zeros(0, dtype=torch.float64), None
        base = (base[0] + s[0], base[1] + s[1], base[2] + s[2])
        kt = kt.double()
        kc = kc.double() if has_cost and kc is not None else None
        blocks = _chunks(kt, kc)
        buckets = _Buckets(lo, hi) if hi > lo else None
        sweep, _, _ = _sweep(blocks, base, lo, hi, buckets, first=False, ends=True, classify=False, sample=False,
                             has_cost=has_cost, budget=budget, device=torch.device("cpu"))
        nk = kt.numel()
        area = torch.zeros(world * (1 + 2 * cap), dtype=torch.float64)
        if nk <= cap:
            at = me * (1 + 2 * cap)
            area[at] = float(nk)
            area[at + 1:at + 1 + nk] = kt
            area[at + 1 + cap:at + 1 + cap + nk] = kc if kc is not None else 1.0
        flags = torch.tensor([s[3], s[4], float(nk > cap)], dtype=torch.float64)
        full = torch.cat([sweep, flags, area])
        _all_reduce(full, plan.groups)
        ns = sweep.numel()
        head = full[:_HEAD].tolist()
        bad_t, bad_c, over = full[ns:ns + 3].tolist()
        if bad_t:
            raise ValueError("project_budget: theta contains a non-finite value (on at least one rank)")
        if bad_c:
            raise ValueError("project_budget: cost must be positive and finite everywhere (on at least one rank)")
        if budget == 0:
            return math.inf  # every score goes to zero
        phi_lo = head[_PHI_LO] - budget
        phi_hi = head[_PHI_HI] - budget if math.isfinite(hi) else -budget
        if level == 0 and lo == 0.0 and phi_lo <= 0:
            return 0.0  # slack budget: clamp only (phi(0) summed directly)
        known = verified is not None
        pos = (known and lo == verified[0]) or phi_lo > 0
        nonpos = (known and hi == verified[1]) or phi_hi <= 0
        if not (pos and nonpos):
            break  # refuted: the histogram search takes over
        verified = (lo, hi, blocks, base)
        if head[_NCAND] == 0:
            su, sfct, sfcc = head[_BP:_BP + 3]
            return hi if sfcc <= 0 else min(max((su + sfct - budget) / sfcc, lo), hi)
        if not over:
            gathered = full[ns + 3:].view(world, 1 + 2 * cap)
            tt, cc = [], []
            for r in range(world):
                k = int(gathered[r, 0])
                tt.append(gathered[r, 1:1 + k])
                cc.append(gathered[r, 1 + cap:1 + cap + k])
            return _set_root(torch.cat(tt), torch.cat(cc), None, head[_BP:_BP + 3], budget, lo, hi)
        if _f2b(hi) - _f2b(lo) <= _ULPS:
            return hi  # as _solve_lambda: the sums cannot place the root more closely
        lo, hi = _propose(full[_HEAD:ns], head[_BV + 2], buckets, phi_lo, phi_hi)
        data_t, data_c = ([kt] if nk else []), ([kc] if (has_cost and nk) else None)
    if verified is None:
        return _solve_lambda(_blocks_of(ts, cs), has_cost, budget, plan, device)
    vlo, vhi, blocks, vbase = verified
    return _solve_lambda(blocks, has_cost, budget, plan, device, start=(vlo, vhi, vbase))


def _write_projection(src: Tensor, cost: Optional[Tensor], lam: float, dst: Tensor) -> None:
    """``dst = clamp(src - lam cost, 0, 1)`` computed in float64 and rounded once
    (the ``project_budget_apply_`` op where it has a kernel; otherwise in
    blocks of contiguous memory, to bound the temporaries)."""
    if src.numel() and src.device.type in _APPLY_DEVICES:
        torch.ops.prunopt.project_budget_apply_([dst], [src], [cost] if cost is not None else None, lam)
        return
    if lam == 0.0:
        torch.clamp(src, 0.0, 1.0, out=dst) if dst is not src else src.clamp_(0.0, 1.0)
        return
    if math.isinf(lam):
        dst.zero_()
        return
    contiguous = src.is_contiguous() and dst.is_contiguous() and (cost is None or cost.is_contiguous())
    if not contiguous or src.numel() <= _CHUNK:
        x = src.double() - (lam if cost is None else lam * cost.double())
        dst.copy_(x.clamp_(0.0, 1.0))
        return
    s, d = src.view(-1).split(_CHUNK), dst.view(-1).split(_CHUNK)
    cs = cost.view(-1).split(_CHUNK) if cost is not None else [None] * len(s)
    for a, b, c in zip(s, d, cs):
        x = a.double() - (lam if c is None else lam * c.double())
        b.copy_(x.clamp_(0.0, 1.0))


_APPLY_DEVICES = _kernel_devices("project_budget_apply_", meta=False)


def _wrap_like(t: Tensor, local: Tensor) -> Tensor:
    if not is_distributed_tensor(t):
        return local
    return type(t).from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def project_budget(theta: TensorOrList, budget, cost: Optional[TensorOrList] = None, group: Group = None):
    r"""The Euclidean projection of scores sharded over ranks onto the budget set,
    jointly over all ranks (the ProM supplement's eq. 9-17):

    .. math::
        \theta^* = \arg\min_x \|x - \theta\|^2 \;\text{s.t.}\; 0 \le x_i \le 1,\;
        \textstyle\sum_i c_i x_i \le S, \qquad
        \theta^* = \mathrm{clamp}(\theta - \lambda^* c, 0, 1),

    :math:`\lambda^* = \max(0, \lambda_1)` with :math:`\phi(\lambda_1) = 0`,
    :math:`\phi(\lambda) = \sum_i c_i\,\mathrm{clamp}(\theta_i - \lambda c_i, 0, 1) - S`
    summed over every rank's elements. The result equals
    :func:`prunopt.ops.project_budget` on the concatenation of all shards to
    rounding (1e-12 in float64, 1e-5 in float32 against the float64 sort
    solution, for scores of order one).

    On the CPU every rank writes a sample of its
    scores (8192 over all ranks) into one ``all_reduce``, every rank brackets
    :math:`\lambda^*` alike from all of them, and one fused pass
    (:func:`prunopt.ops.project_budget_bracket`) per rank sums the elements
    whose form is fixed on the bracket and keeps the others; the next
    ``all_reduce`` verifies the bracket by :math:`\phi` at its ends (summed
    directly, :math:`\phi(lo) > 0 \ge \phi(hi)`) and carries the kept
    elements when they are few (4096 over all ranks: every rank then solves
    them exactly, the linear piece's root
    :math:`\lambda^* = (\sum_U c + \sum_F c\theta - S) / \sum_F c^2`), else
    histograms of their breakpoints that point to the next, narrower bracket.
    Three ``all_reduce`` on shards alike (131 KB, then at most 148 KB each on
    2 ranks), two for a slack budget (:math:`\phi(0) \le 0`, clamp only) or
    ``S = 0``; :func:`prunopt.ops.project_budget_apply_` writes the result.
    Elsewhere, and when the direct sums refute a bracket, a histogram search
    keeps a verified bracket and narrows it by histograms of the breakpoints
    :math:`\theta_i / c_i` and :math:`(\theta_i - 1)/c_i` on at most 2048
    sub-buckets cut at bit-pattern boundaries of :math:`\lambda` (each pass
    one ``all_reduce`` of at most ``5 * 2050 + 21`` float64, 82 KB; typically
    4-6 passes, each read on the host). The result never depends on the
    sample, only the time.

    Args:
        theta: a tensor or a list of tensors (this rank's scores, or DTensors);
            float32/float64/float16/bfloat16, computed in float64. A rank may
            hold an empty list.
        budget: ``S >= 0`` (the same on every rank), a real number or a
            one-element tensor.
        cost: optional positive costs with the shape(s) of ``theta`` (DTensors
            with ``theta``'s mesh and placements when ``theta`` holds DTensors),
            given on every rank or on none; default all ones.
        group: ``None``, a ``ProcessGroup`` or a ``DeviceMesh`` (module notes).

    Returns:
        New tensors (DTensors for DTensor inputs, with their placements), the
        kind of ``theta``; they do not require grad (the projection is an
        optimisation step, as in :func:`prunopt.ops.project_budget`). Every
        replica of a replicated DTensor gets the same values.

    Raises:
        TypeError: as :func:`prunopt.ops.project_budget`, or a bad ``group``.
        ValueError: locally as :func:`prunopt.ops.project_budget` (shapes,
            dtypes, devices, a negative budget); on every rank alike: a
            non-finite score or a bad cost on any rank, a budget that differs
            between ranks, costs given on some ranks only.
    """
    with torch.no_grad():
        thetas, single, plan, costs, budget = _projection_inputs(theta, budget, cost, group)
        if not plan.groups:
            outs = _project_budget_one(plan.locals, budget, costs)
        else:
            lam = _solve_for(plan, costs, budget)
            outs = []
            for i, t in enumerate(plan.locals):
                out = torch.empty_like(t)
                _write_projection(t, costs[i] if costs is not None else None, lam, out)
                outs.append(out)
        outs = [_wrap_like(t, o) for t, o in zip(thetas, outs)]
    return outs[0] if single else outs


def project_budget_(theta: TensorOrList, budget, cost: Optional[TensorOrList] = None, group: Group = None):
    """In-place :func:`project_budget`: overwrites ``theta`` (for DTensors, their
    local shards) with its projection and returns ``theta``. Everything is
    checked, on every rank, before anything is written, so on error no rank's
    ``theta`` has changed. The tensors must not share memory (as for
    :func:`prunopt.ops.project_budget_`), and a tensor that requires grad is
    written only with grad mode off (``RuntimeError`` otherwise, as for
    :func:`prunopt.ops.project_budget_` and PyTorch's in-place ops)."""
    grad_enabled = torch.is_grad_enabled()
    with torch.no_grad():
        thetas, single, plan, costs, budget = _projection_inputs(theta, budget, cost, group)
        if not torch.compiler.is_compiling():
            _check_grad_writes(thetas, grad_enabled=grad_enabled)
            _check_no_overlap(plan.locals)
        if not plan.groups:
            _project_budget_one_(plan.locals, budget, costs)
            return theta
        lam = _solve_for(plan, costs, budget)
        for i, t in enumerate(plan.locals):
            _write_projection(t, costs[i] if costs is not None else None, lam, t)
    return theta
