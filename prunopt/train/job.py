"""The ``prunopt train`` job: data parallelism, checkpoints, exact resume.

A method's ``run(args, job)`` (see :mod:`prunopt.train.methods`) trains through
a :class:`Job`, which hides how the run is laid out:

* **Processes.** Under ``torchrun`` every rank runs the same method code. The
  model is wrapped for training by :meth:`Job.prepare` (``DistributedDataParallel``,
  or FSDP2's ``fully_shard`` with ``--fsdp``) *after* the method's model
  transformations (masks, ProbMask, interspace layers). Every global minibatch
  is the one of the one-process run (``--batch-size`` is global, the data
  order is one shared permutation); rank ``r`` takes its contiguous slice
  (``torch.tensor_split``), and the loss is scaled so that the averaged
  gradient is the mean over the whole global batch, also for a last, uneven
  minibatch. (A last minibatch with fewer samples than ranks is dropped.)
  BatchNorm statistics are per rank during a step, as in plain DDP, and
  rank 0's running statistics are broadcast after every epoch, so every rank
  evaluates the same model on the full test set and they all agree; the job
  checks at the end that they hold the same weights (under ``--fsdp``: the
  same buffers, masks among them, and parameters left whole). Rank 0 alone
  writes and prints.
* **Sharded models** (``--fsdp``). :meth:`Job.prepare` shards the model with
  FSDP2 after the method's transformations; optimizers, projections and
  pruning methods that keep parameters are built after it. A transformation
  between phases (masks on a pre-trained network, a layer conversion) is
  applied to :meth:`Job.plain_copy` of the trained model, which is then
  prepared in its turn.
* **Checkpoints.** With ``--out`` the job writes ``resume.pt`` into the run's
  staging directory after every epoch (``--checkpoint-every N``: every N-th):
  every tracked object's state, every rank's RNG states (torch, Python,
  NumPy), the values and the history so far. Sharded models and their
  optimizers are saved whole; other state holding shards (a lottery ticket's
  rewind snapshot, an optimizer group) is saved as every rank's part.
* **Exact resume** (``--resume``). The method's code runs again from the
  start in *replay*: every ``job.epochs(...)`` loop before the checkpoint's
  phase is empty, so the code between phases only rebuilds the same objects
  (the model transformations run again, cheaply, on untrained weights); on
  entering the checkpoint's phase the job loads every tracked object, the RNG
  states, the values and the history, and the loop continues with the next
  epoch. The result is bit for bit that of the uninterrupted run (same
  thread count).

The rules a method follows for this to hold:

1. :meth:`Job.track` every object an epoch changes (models, optimizers, LR
   schedulers, pruning methods, ``torch.Generator``s, plain dicts of counters)
   before the phase that changes it.
2. A value computed between two phases and used later (an accuracy, a
   decision that steers the control flow) goes through :meth:`Job.value`; in
   replay it returns the recorded value.
3. Work between phases whose result the checkpoint restores may be skipped
   while :attr:`Job.replaying` (and must be when it could not run on untrained
   state, e.g. a lottery-ticket rewind before its snapshot exists).

Runs are reproducible: seeds everywhere (:func:`seed_everything`),
``torch.use_deterministic_algorithms(True, warn_only=True)``; the same
command, seed and thread count give the same summary line. Floating-point
sums are split differently with another thread count (``--threads``), so
results may differ between thread counts.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import random
import signal
import sys
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from prunopt.train.loop import Summary, atomic_save, evaluate, write_outputs
from prunopt.train.output import RunDirectory, read_run_info
from prunopt.train.parallel import Distributed, process_group

CHECKPOINT_FORMAT = 1


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while a job ran (raised in the main thread so
    that the job's cleanup runs). ``signum`` is the signal number."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StateFns:
    """Job state that is not an object with a state dict: ``get()`` returns a
    picklable value, ``set(value)`` puts it back (e.g. a temperature held as a
    plain attribute of some modules)."""

    def __init__(self, get: Callable[[], Any], set: Callable[[Any], None]):
        self.get, self.set = get, set

    def state_dict(self) -> dict:
        return {"value": self.get()}

    def load_state_dict(self, state: dict) -> None:
        self.set(state["value"])


def seed_everything(seed: int) -> None:
    """Seeds torch's global generator (CPU and CUDA), Python's ``random`` and NumPy's."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def rng_state() -> dict:
    """The global RNG states of this process (torch CPU and CUDA, Python, NumPy)
    in a form ``torch.load(weights_only=True)`` reads."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict) -> None:
    """Restores :func:`rng_state`'s output."""
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _as_tuples(x):
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


@contextlib.contextmanager
def deterministic(threads: Optional[int] = None) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` (errors become
    warnings for ops without a deterministic version) and, when given, ``threads``
    intra-op threads; both restored on exit."""
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    old_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True, warn_only=True)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
        torch.set_num_threads(old_threads)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While the body runs, SIGTERM and SIGHUP raise :class:`Interrupted` in the
    main thread (Ctrl-C raises ``KeyboardInterrupt`` anyway), so ``finally``
    blocks clean up. A signal the process ignores (``nohup``) stays ignored;
    nothing changes outside the main thread."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)
           if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _is_fsdp(module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, FSDPModule)


def _fingerprint(module: nn.Module) -> str:
    """A hash of the module's state that every rank holds whole (its state
    dict without DTensor shards: all of it under DDP; buffers, masks and the
    parameters left whole under FSDP2)."""
    h = hashlib.sha256()
    for name, t in list(module.state_dict().items()):
        if isinstance(t, torch.Tensor) and not _is_dtensor(t):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _is_dtensor(t) -> bool:
    from prunopt.distributed import is_distributed_tensor

    return is_distributed_tensor(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are empty tensors
    on the meta device (no data is copied): the structure that
    :meth:`Job.plain_copy` fills."""
    memo = {}
    for p in model.parameters(recurse=True):
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers(recurse=True):
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, value)


#: key of a checkpointed state that holds every rank's own part (a list in rank order)
_PER_RANK = "per_rank"
_SHARD = "dtensor_local_shard"


def _has_dtensor(obj) -> bool:
    if _is_dtensor(obj):
        return True
    if isinstance(obj, dict):
        return any(_has_dtensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_dtensor(v) for v in obj)
    return False


def _placement_code(p) -> list:
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(p, Shard) and type(p) is Shard:
        return ["shard", int(p.dim)]
    if isinstance(p, Replicate):
        return ["replicate"]
    raise NotImplementedError(f"checkpointing a DTensor placed {p!r} is not supported (Shard and Replicate only)")


def _encode_shards(obj):
    """``obj`` with every DTensor replaced by a plain dict of its local shard
    (on the CPU) and layout, which ``torch.load(weights_only=True)`` reads."""
    if _is_dtensor(obj):
        return {_SHARD: obj.to_local().detach().cpu().clone(),
                "placements": [_placement_code(p) for p in obj.placements],
                "shape": list(obj.shape), "stride": list(obj.stride()), "requires_grad": bool(obj.requires_grad)}
    if isinstance(obj, dict):
        return type(obj)((k, _encode_shards(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_encode_shards(v) for v in obj)
    return obj


def _decode_shards(obj, mesh):
    """Inverse of :func:`_encode_shards` on ``mesh`` (the job's device mesh)."""
    if isinstance(obj, dict) and _SHARD in obj:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if mesh is None:
            raise RuntimeError("the checkpoint holds sharded state but this job has no sharded model")
        placements = [Shard(c[1]) if c[0] == "shard" else Replicate() for c in obj["placements"]]
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device(mesh.device_type)
        t = DTensor.from_local(obj[_SHARD].to(device), mesh, placements, run_check=False,
                               shape=torch.Size(obj["shape"]), stride=tuple(obj["stride"]))
        return t.requires_grad_(obj["requires_grad"]) if obj["requires_grad"] else t
    if isinstance(obj, dict):
        return type(obj)((k, _decode_shards(v, mesh)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_decode_shards(v, mesh) for v in obj)
    return obj


class Job:
    """One ``prunopt train`` run as the method code sees it (module docstring).

    ``args`` are the parsed options; ``dist`` the process group
    (:func:`~prunopt.train.parallel.process_group`; default: one process);
    ``run_dir`` the staging directory rank 0 writes (None: nothing written);
    ``resume`` the checkpoint dict to continue from (every rank gets it)."""

    def __init__(self, args, dist: Optional[Distributed] = None, run_dir: Optional[RunDirectory] = None,
                 resume: Optional[dict] = None):
        self.args = args
        self.dist = dist or Distributed()
        self.run_dir = run_dir
        self.fsdp = bool(getattr(args, "fsdp", False))
        self.checkpoint_every = int(getattr(args, "checkpoint_every", None) or 1)
        # every rank checkpoints (a collective) when rank 0 writes a run directory
        self.writes = bool(getattr(args, "out", None)) and (run_dir is not None or self.dist.active)
        if resume is not None:
            if resume.get("format") != CHECKPOINT_FORMAT:
                raise ValueError(f"checkpoint format {resume.get('format')!r} is not {CHECKPOINT_FORMAT}")
            if resume["world_size"] != self.dist.world_size:
                raise ValueError(f"the checkpoint was written by {resume['world_size']} processes, this job has "
                                 f"{self.dist.world_size}: resume with the same number of processes")
        self._resume = resume
        self._values: Dict[str, Any] = dict(resume["values"]) if resume else {}
        self._tracked: "OrderedDict[str, Any]" = OrderedDict()
        self._phase_count = 0
        self._epochs_done = 0
        self.history: Dict[str, list] = {"phases": [], "epochs": []}
        self._current: Optional[dict] = None
        self._bar = None
        self._prepared: Dict[int, tuple] = {}
        self._skeletons: Dict[int, nn.Module] = {}
        self._whole: Dict[int, List[nn.Parameter]] = {}  # parameters FSDP2 leaves whole
        self._mesh = None  # the device mesh of the sharded models (--fsdp)
        self.checkpoints_written = 0
        seed_everything(args.seed)

    # ------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    @property
    def replaying(self) -> bool:
        """True in a resumed run until the checkpoint's phase is reached: the
        epochs loops before it are empty and the tracked objects still hold
        rebuilt, untrained state (module docstring)."""
        return self._resume is not None

    @property
    def epochs_done(self) -> int:
        """Epochs completed over all phases."""
        return self._epochs_done

    # ----------------------------------------------------------------- state
    def track(self, **objects) -> None:
        """Registers objects whose state checkpoints carry, by name (a name
        given again refers to the new object): ``nn.Module``\\ s, optimizers,
        LR schedulers, pruning methods and masks (anything with
        ``state_dict``/``load_state_dict``), ``torch.Generator``\\ s, plain
        ``dict``\\ s (copied), :class:`StateFns`."""
        for name, obj in objects.items():
            if obj is None:
                raise TypeError(f"track({name}=None): nothing to track")
            if not (isinstance(obj, (torch.Generator, dict)) or
                    (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))):
                raise TypeError(f"track({name}=...): {type(obj).__name__} has no state_dict/load_state_dict")
            self._tracked[name] = obj

    def value(self, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, computed once per run and checkpointed under ``name``; in a
        resumed run the recorded value (rule 2 of the module docstring). Values
        must be picklable plain data (numbers, strings, bools)."""
        if name not in self._values:
            self._values[name] = fn()
        return self._values[name]

    def log(self, **series: float) -> None:
        """Records this epoch's values for ``history.png`` (e.g. ``acc=...``,
        ``density=...``; a name containing ``density`` is drawn on the density
        axis). Only inside a :meth:`epochs` loop."""
        if self._current is None:
            raise RuntimeError("Job.log() is for values of the current epoch, inside a job.epochs() loop")
        for k, v in series.items():
            self._current[k] = float(v)
        if hasattr(self._bar, "set_postfix"):
            self._bar.set_postfix({k: f"{v:.3f}" for k, v in self._current.items() if k not in ("epoch", "phase")})

    def _object_state(self, obj):
        if isinstance(obj, torch.Generator):
            return obj.get_state()
        if isinstance(obj, dict):
            return copy.deepcopy(obj)
        state = self.state_dict(obj)
        if self.dist.active and _has_dtensor(state):
            # state holding this rank's shards (under --fsdp: a lottery ticket's rewind snapshot, the
            # optimizers of an OptimizerGroup): every rank's part, each rank restores its own
            return {_PER_RANK: self.dist.all_gather(_encode_shards(state))}
        return state

    def _load_object(self, name: str, obj, state) -> None:
        if isinstance(state, dict) and _PER_RANK in state:
            parts = state[_PER_RANK]
            if len(parts) != self.world_size:
                raise RuntimeError(f"the checkpoint holds {len(parts)} ranks' state of {name!r}, this job has "
                                   f"{self.world_size} ranks")
            state = _decode_shards(parts[self.rank], self._mesh)
        if isinstance(obj, torch.Generator):
            obj.set_state(state)
        elif isinstance(obj, dict):
            obj.clear()
            obj.update(copy.deepcopy(state))
        elif isinstance(obj, nn.Module) and _is_fsdp(obj):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(obj, state, options=StateDictOptions(full_state_dict=True))
        elif isinstance(obj, torch.optim.Optimizer) and self._fsdp_owner(obj) is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self._fsdp_owner(obj), obj, state,
                                     options=StateDictOptions(full_state_dict=True))
        else:
            obj.load_state_dict(state)

    def _fsdp_owner(self, optimizer) -> Optional[nn.Module]:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for module, _, _ in self._prepared.values():
            if _is_fsdp(module) and any(id(p) in ids for p in module.parameters()):
                return module
        return None

    def state_dict(self, obj) -> Any:
        """``obj.state_dict()``, whole on rank 0 also for a model sharded by
        ``--fsdp`` and its optimizers (then a collective: every rank calls it)."""
        if isinstance(obj, nn.Module) and _is_fsdp(obj):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(obj, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if isinstance(obj, torch.optim.Optimizer):
            owner = self._fsdp_owner(obj)
            if owner is not None:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

                return get_optimizer_state_dict(owner, obj,
                                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return obj.state_dict()

    # ---------------------------------------------------------------- phases
    def epochs(self, phase: str, n: int, desc: Optional[str] = None) -> Iterator[int]:
        """The epochs ``0 .. n-1`` of the next phase of the job (named ``phase``,
        shown as ``desc`` on the progress bar). After each completed epoch the
        job may write a checkpoint. In a resumed run the phases before the
        checkpoint's yield nothing, and the checkpoint's phase loads the saved
        state and continues after its last completed epoch."""
        index = self._phase_count
        self._phase_count += 1
        start = 0
        if self._resume is not None:
            saved = self._resume["history"]["phases"]
            at_phase, at_epoch = self._resume["position"]
            if index >= len(saved) or saved[index]["name"] != phase:
                got = saved[index]["name"] if index < len(saved) else "(none)"
                raise RuntimeError(f"the checkpoint does not fit this run: phase {index} is {phase!r} here and "
                                   f"{got!r} in the checkpoint")
            if index < at_phase:
                return
            self._restore(self._resume)
            self._resume = None
            start = at_epoch
        else:
            self.history["phases"].append({"name": phase, "first": self._epochs_done + 1, "epochs": int(n)})
        self._bar = self.progress(range(start, n), desc or phase, initial=start, total=n)
        for e in self._bar:
            self._current = {"epoch": self._epochs_done + 1, "phase": phase}
            yield e
            if len(self._current) > 2:
                self.history["epochs"].append(self._current)
            self._current = None
            self._epochs_done += 1
            if self.writes and self._epochs_done % self.checkpoint_every == 0:
                self._save_checkpoint(index, e + 1)

    def _checkpoint(self, phase_index: int, epoch: int) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "position": [phase_index, epoch],
            "epochs_done": self._epochs_done,
            "objects": OrderedDict((name, self._object_state(obj)) for name, obj in self._tracked.items()),
            "values": dict(self._values),
            "history": copy.deepcopy(self.history),
            "rng": self.dist.all_gather(rng_state()),
            "world_size": self.world_size,
        }

    def _save_checkpoint(self, phase_index: int, epoch: int) -> None:
        state = self._checkpoint(phase_index, epoch)  # collective under --fsdp: every rank
        if self.is_main and self.run_dir is not None:
            atomic_save(state, self.run_dir.checkpoint)
        self.checkpoints_written += 1

    def _restore(self, ckpt: dict) -> None:
        saved, here = list(ckpt["objects"]), list(self._tracked)
        if set(saved) != set(here):
            raise RuntimeError(f"the checkpoint does not fit this run: it holds {sorted(saved)}, the run tracks "
                               f"{sorted(here)}")
        for name, obj in self._tracked.items():
            self._load_object(name, obj, ckpt["objects"][name])
        self._values = dict(ckpt["values"])
        self.history = copy.deepcopy(ckpt["history"])
        self._epochs_done = int(ckpt["epochs_done"])
        set_rng_state(ckpt["rng"][self.rank])

    # -------------------------------------------------------------- training
    def prepare(self, model: nn.Module, find_unused_parameters: bool = False) -> nn.Module:
        """Declares ``model`` ready for training, after the method's
        transformations of it, and returns it: unchanged in one process;
        wrapped (internally, for :meth:`train_epoch`) in
        ``DistributedDataParallel`` under torchrun; sharded in place by
        ``fully_shard`` with ``--fsdp`` (build its optimizers after this).
        Call it again after changing the model's parameters (e.g. converting
        layers or freezing some). ``find_unused_parameters`` is passed to DDP
        (for parameters frozen during a phase).

        Under ``--fsdp`` every child module holding parameters and then the
        model itself are sharded (``fully_shard``); 0-dim parameters, which
        FSDP2 cannot shard (e.g. a sparse gate's threshold), stay whole on
        every rank and :meth:`train_epoch` averages their gradients over the
        ranks. An empty copy of the model (on the meta device: no memory) is
        kept for :meth:`plain_copy`. A model that is already sharded is only
        recorded again."""
        if self.fsdp and self.dist.active:
            if not _is_fsdp(model):
                from torch.distributed.fsdp import fully_shard

                self._skeletons[id(model)] = _meta_copy(model)
                self._whole[id(model)] = [p for p in model.parameters() if p.dim() == 0]
                whole = set(self._whole[id(model)])
                for child in model.children():
                    if any(True for _ in child.parameters()):
                        fully_shard(child, ignored_params=whole)
                fully_shard(model, ignored_params=whole)
            self._mesh = next((p.device_mesh for p in model.parameters() if _is_dtensor(p)), self._mesh)
            wrapper = model
        elif self.dist.active:
            from torch.nn.parallel import DistributedDataParallel

            wrapper = DistributedDataParallel(model, find_unused_parameters=find_unused_parameters)
        else:
            wrapper = model
        self._prepared[id(model)] = (model, wrapper, tuple(id(p) for p in model.parameters()))
        return model

    def plain_copy(self, model: nn.Module) -> nn.Module:
        """A plain copy of ``model`` on every rank: no wrapper, no shards, the
        current values of all its parameters and buffers and their
        ``requires_grad`` flags. Model transformations that must come before
        wrapping (masks, ProbMask, layer conversions) are applied to it, and
        it is then passed to :meth:`prepare`; ``model`` is left as it is.

        In one process and under DDP a ``copy.deepcopy`` of the model (the
        module inside DDP). Under ``--fsdp`` the empty copy :meth:`prepare`
        kept is filled: each sharded parameter is gathered whole
        (``DTensor.full_tensor()``, a collective: every rank calls this, one
        parameter at a time), the buffers (never sharded) are copied. Plain
        module attributes (not parameters or buffers) are those the model had
        when it was prepared."""
        if not _is_fsdp(model):
            return copy.deepcopy(model)
        skeleton = self._skeletons.get(id(model))
        if skeleton is None:
            raise RuntimeError("plain_copy() of a sharded model needs the model passed through job.prepare(model)")
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        device = next((_local(t).device for t in list(params.values()) + list(buffers.values())),
                      torch.device("cpu"))
        out = copy.deepcopy(skeleton).to_empty(device=device)
        with torch.no_grad():
            for name, p in out.named_parameters(remove_duplicate=False):
                src = params[name]
                p.copy_(src.full_tensor() if _is_dtensor(src) else src)
                p.requires_grad_(src.requires_grad)
            for name, b in out.named_buffers(remove_duplicate=False):
                src = buffers[name]
                if b.shape != src.shape:  # a buffer that was re-assigned since prepare (e.g. a fixed mask)
                    _set_buffer(out, name, src.detach().clone())
                else:
                    b.copy_(src)
        for mine, theirs in zip(out.modules(), model.modules()):
            mine.training = theirs.training
        return out

    def _wrapper(self, model: nn.Module) -> nn.Module:
        entry = self._prepared.get(id(model))
        if entry is None or entry[0] is not model:
            raise RuntimeError("train_epoch() needs a model passed through job.prepare(model) first")
        if entry[2] != tuple(id(p) for p in model.parameters()):
            raise RuntimeError("the model's parameters changed since job.prepare(model): call job.prepare(model) "
                               "again after transforming it")
        return entry[1]

    def train_epoch(self, model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor, batch_size: int,
                    generator: torch.Generator, loss_extra: Optional[Callable[[], torch.Tensor]] = None,
                    after_step: Optional[Callable[[], None]] = None) -> float:
        """One epoch of cross-entropy training (as :func:`prunopt.train.loop.train_epoch`)
        over this rank's share of every global minibatch; returns the mean loss
        over all ranks. ``loss_extra()`` (a regulariser, the same on every rank)
        is added to the loss; ``after_step()`` runs after every optimizer step."""
        net = self._wrapper(model)
        world, rank = self.world_size, self.rank
        model.train()
        total, count = 0.0, 0
        perm = torch.randperm(len(y), generator=generator)
        for i in range(0, len(y), batch_size):
            idx = perm[i: i + batch_size]
            global_size = len(idx)
            if world > 1:
                if global_size < world:
                    break  # not one sample per rank: the last minibatch is dropped
                idx = idx.tensor_split(world)[rank]
            optimizer.zero_grad(set_to_none=True)
            out = net(x[idx])
            if world == 1:
                loss = F.cross_entropy(out, y[idx])
                extra = None
                if loss_extra is not None:
                    extra = loss_extra()
                    loss = loss + extra
                loss.backward()
                total += loss.item() * global_size
            else:
                # gradients are averaged over the ranks: sum * world / global size is the
                # global batch's mean, also when the shards differ in size
                ce = F.cross_entropy(out, y[idx], reduction="sum")
                loss = ce * (world / global_size)
                extra = None
                if loss_extra is not None:
                    extra = loss_extra()
                    loss = loss + extra
                loss.backward()
                self._average_whole_gradients(model)
                total += ce.item() + (extra.item() * len(idx) if extra is not None else 0.0)
            count += global_size if world == 1 else len(idx)
            optimizer.step()
            if after_step is not None:
                after_step()
        if world > 1:
            self._sync_buffers(model)
            total, count = self.dist.sum(total), self.dist.sum(count)
        return total / max(count, 1)

    def _average_whole_gradients(self, model: nn.Module) -> None:
        """Under ``--fsdp``, averages over the ranks the gradients of the
        parameters FSDP2 left whole (:meth:`prepare`), as FSDP2's
        reduce-scatter does for the sharded ones (one ``all_reduce``)."""
        whole = self._whole.get(id(model))
        if not whole or not self.dist.active:
            return
        import torch.distributed as dist

        grads = [p.grad for p in whole if p.grad is not None]  # the same parameters on every rank
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)  # divided first, as DDP does
        dist.all_reduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def _sync_buffers(self, model: nn.Module) -> None:
        import torch.distributed as dist

        with torch.no_grad():
            for b in model.buffers():
                if b.dtype != torch.bool and b.numel():
                    dist.broadcast(b, src=0)

    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        """Top-1 accuracy on the full ``(x, y)``, the same on every rank (every
        rank evaluates the same model; a sharded model gathers its parameters)."""
        return evaluate(model, x, y)

    def progress(self, iterable, desc: str, initial: int = 0, total: Optional[int] = None):
        """A progress bar on rank 0's stderr (``--no-progress`` hides it; other ranks never show one)."""
        if not (self.is_main and getattr(self.args, "progress", True)):
            return iterable
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False, initial=initial,
                    total=total)

    # ----------------------------------------------------------------- output
    def check_ranks_agree(self) -> None:
        """``RuntimeError`` unless every rank holds the same weights and buffers
        in every tracked model (data parallelism keeps replicas identical; of
        a sharded model, what every rank holds whole: buffers such as masks
        and running statistics, and the parameters FSDP2 left whole)."""
        if not self.dist.active:
            return
        prints = {n: _fingerprint(m) for n, m in self._tracked.items() if isinstance(m, nn.Module)}
        everyone = self.dist.all_gather(prints)
        bad = sorted(n for n in prints if any(p.get(n) != prints[n] for p in everyone))
        if bad:
            raise RuntimeError(f"the ranks hold different states of {bad}: data-parallel replicas diverged")

    def finish(self, summary: Summary, state: dict) -> Summary:
        """The end of a method's run: adds ``world_size`` to the summary, checks
        that the ranks agree and (rank 0, with ``--out``) writes
        ``checkpoint.pt`` (``state``, built with :meth:`state_dict` for sharded
        objects), ``summary.json`` and ``history.png`` into the run directory.
        Returns ``summary``."""
        if self._resume is not None:
            raise RuntimeError("the run ended before the phase of its checkpoint "
                               f"({self._resume['history']['phases'][self._resume['position'][0]]['name']!r}): "
                               "the checkpoint does not fit this run")
        summary.extra["world_size"] = self.world_size
        self.check_ranks_agree()
        if self.is_main and self.run_dir is not None:
            write_outputs(self.run_dir.path, summary, state, self.history)
        return summary


# ------------------------------------------------------------------ the run
def run_info(args, world_size: int) -> dict:
    """The ``run.json`` of a run: its options (``args``, as JSON), the number of
    processes, the thread count and the versions; ``--resume`` reads the
    options back from it."""
    import prunopt

    return {
        "args": json.loads(json.dumps(vars(args), default=str)),
        "world_size": world_size,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "prunopt": getattr(prunopt, "__version__", "?"),
        "command": [os.path.basename(sys.argv[0])] + sys.argv[1:],
    }


def run(args, out=None, err=None) -> Summary:
    """Runs ``prunopt train`` with parsed and checked ``args``: sets up the
    process group (torchrun), determinism and threads, the run directory
    (``--out``; resumed with ``--resume``), runs the method and moves the
    finished run into place. Rank 0 prints where the files went and the summary
    line (on ``out``, default stdout); stopping early (error, Ctrl-C, SIGTERM, SIGHUP) leaves no
    temporary file and tells on ``err`` (stderr) how to resume."""
    from prunopt.train.methods import METHODS

    out = out or sys.stdout
    err = err or sys.stderr
    entry = METHODS[args.method]
    with process_group() as d, deterministic(getattr(args, "threads", None)), signals_raise():
        run_dir: List[Optional[RunDirectory]] = [None]
        resume = None
        if args.out:
            if getattr(args, "resume", None):
                def reopen():
                    run_dir[0] = RunDirectory.reopen(args.resume, args.out)
                    return torch.load(run_dir[0].checkpoint, weights_only=True)

                resume = d.broadcast(d.run_on_main(reopen))
            else:
                args.out = os.path.abspath(args.out)
                info = run_info(args, d.world_size)
                d.run_on_main(lambda: run_dir.__setitem__(0, RunDirectory.create(args.out, info)))
        job = None
        try:
            job = Job(args, d, run_dir[0], resume)
            summary = entry.run(args, job)
            where = d.run_on_main(lambda: run_dir[0].commit() if run_dir[0] is not None else None)
        except BaseException as e:
            if run_dir[0] is not None:
                kept = run_dir[0].abort()
                what = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
                done = job.epochs_done if job is not None else 0
                if kept:
                    print(f"prunopt train: {what} after {done} epoch(s); the last checkpoint is in "
                          f"{run_dir[0].path}; continue with: prunopt train --resume {args.out}", file=err, flush=True)
                else:
                    print(f"prunopt train: {what} before the first checkpoint; nothing was written", file=err,
                          flush=True)
            raise
        if d.is_main:
            if where:
                files = ", ".join(sorted(os.listdir(where)))
                print(f"prunopt train: wrote {where} ({files})", file=out, flush=True)
            print(summary.line(), file=out, flush=True)
        return summary


def resume_info(staging: str) -> dict:
    """``run.json`` of the run staged in ``staging`` (its options and world size)."""
    return read_run_info(staging)
