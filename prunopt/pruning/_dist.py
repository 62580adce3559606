"""Masks that are the same on every rank: the distributed helpers of the
pruning toolkit (DDP and FSDP2; ``docs/distributed.md``, "Masks and pruning
methods").

Two layouts occur:

* **replicated** (DDP, or no wrapper): every rank holds the whole tensor, with
  the same values (DDP keeps parameters identical).  Selections run locally
  and give the same mask everywhere; what differs between ranks (gradients of
  the local batches, random draws) is averaged over the process group or
  drawn from a generator whose state is the same on every rank.
* **sharded** (FSDP2): parameters, gradients and the scores computed from them
  are DTensors; each rank holds a block of rows (``Shard(d)`` on one mesh
  dimension, any others ``Replicate``).  Selections are exact over the global
  tensor: the ``k``-th largest value is found with histogram rounds over the
  shards (no score tensor is gathered), ties are resolved from per-run counts,
  and each entry's decision is taken by the one rank that holds it, so the
  mask is the same on every rank by construction.  Masks are replicated
  buffers (FSDP2 does not shard buffers), assembled with one all-gather of one
  byte per entry.

**Tie rule** (the one-process rule of :mod:`prunopt.pruning.selection`): the
values of the listed tensors are ranked in one sequence, tensor after tensor,
each flattened in row-major order; among equal values the one that comes first
in this *global* order is kept (for ``largest=False``, selected).  A shard's
position in it is its global offset, so the sharded mask equals the
one-process mask of the full tensors, for any number of ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from prunopt.distributed import is_distributed_tensor, local_tensor

__all__ = []  # private


# ----------------------------------------------------------------- groups
def _dist():
    return torch.distributed


def initialized() -> bool:
    d = _dist()
    return d.is_available() and d.is_initialized()


def resolve_group(group=None):
    """The process group to keep replicated masks identical over: ``group``,
    or the default group when one is initialised; ``None`` when that group
    has a single process (nothing to synchronise)."""
    if not initialized():
        return None
    d = _dist()
    g = d.group.WORLD if group is None else group
    return g if d.get_world_size(g) > 1 else None


def group_rank(group) -> int:
    return 0 if group is None else _dist().get_rank(group)


def all_reduce_mean_(tensors: Sequence[Tensor], group) -> None:
    """Average plain tensors over ``group`` in place (one flat all-reduce per
    dtype and device: ``4 d`` bytes for ``d`` float32 entries)."""
    if group is None or not tensors:
        return
    n = _dist().get_world_size(group)
    by_kind = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for ts in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        _dist().all_reduce(flat, group=group)
        flat.div_(n)
        for t, part in zip(ts, flat.split([t.numel() for t in ts])):
            t.copy_(part.view_as(t))


def any_rank_each(flags: Sequence[bool], group) -> List[bool]:
    """Per flag, ``True`` on every rank when it is true on any (one
    all-reduce), so an error found on one rank is raised by all instead of
    leaving the others waiting in a collective."""
    if group is None or not flags:
        return [bool(f) for f in flags]
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64, device=_collective_device(group))
    _dist().all_reduce(t, op=_dist().ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def broadcast_generator_(generator: torch.Generator, group) -> None:
    """Give ``generator`` the state of the group's first rank (one broadcast of
    the state tensor: 5056 bytes for the CPU Mersenne Twister)."""
    if group is None:
        return
    d = _dist()
    state = generator.get_state()
    device = _collective_device(group)
    buf = state.to(device)
    d.broadcast(buf, src=d.get_global_rank(group, 0), group=group)
    generator.set_state(buf.cpu())


def broadcast_object(obj, group):
    """``obj`` of the group's first rank, on every rank."""
    if group is None:
        return obj
    d = _dist()
    box = [obj]
    d.broadcast_object_list(box, src=d.get_global_rank(group, 0), group=group)
    return box[0]


def _collective_device(group) -> torch.device:
    """A device the group's backend communicates on (CUDA for NCCL)."""
    backend = str(_dist().get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------- DTensors
is_dtensor = is_distributed_tensor
local = local_tensor  # a DTensor's local shard (a view: in-place writes reach the DTensor), else the tensor


def like(part: Tensor, ref: Tensor) -> Tensor:
    """``part`` (the local part of a tensor laid out as ``ref``) as a
    DTensor of ``ref``'s mesh, placements, shape and stride; ``part``
    itself when ``ref`` is a plain tensor."""
    if not is_dtensor(ref):
        return part
    return type(ref).from_local(part, ref.device_mesh, ref.placements, shape=ref.shape, stride=ref.stride(),
                                run_check=False)


@dataclass
class _Layout:
    """Where a tensor's local entries sit in its global row-major order.

    ``runs`` rows of ``run_len`` local entries each (the local tensor viewed as
    ``(runs, run_len)``): row ``r`` is global flat range
    ``[start + r * run_step, ... + run_len)``; ``offset``/``local_shape``
    place the local block in the global tensor.  ``group`` is the shard group
    (``None``: replicated, every rank holds everything; such a tensor in a
    sharded selection is counted by the group's first rank only)."""

    offset: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    runs: int
    run_len: int
    start: int
    run_step: int
    group: object


def layout(t: Tensor) -> _Layout:
    """The :class:`_Layout` of ``t`` (a plain tensor is one run, replicated).
    DTensors must shard one tensor dimension over one mesh dimension (FSDP2's
    ``Shard(d)``, HSDP's ``(Replicate, Shard(d))``), else ``NotImplementedError``."""
    shape = tuple(int(s) for s in t.shape)
    if not is_dtensor(t):
        return _Layout((0,) * len(shape), shape, 1, math.prod(shape), 0, 0, None)
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = t.device_mesh, t.placements
    shard_dims = [(i, p.dim) for i, p in enumerate(placements) if isinstance(p, Shard)]
    if len(shard_dims) > 1 or any(type(p) not in (Shard, Replicate) for p in placements):
        raise NotImplementedError(
            f"masks of DTensors with placements {tuple(placements)} are not supported: one Shard(d) (FSDP2, HSDP) "
            "and Replicate placements only")
    chunk = t.__create_chunk_list__()[0]
    offset = tuple(int(o) for o in chunk.offsets)
    local_shape = tuple(int(s) for s in chunk.sizes)
    if not shard_dims:
        return _Layout(offset, local_shape, 1, math.prod(shape), 0, 0, None)
    mesh_dim, d = shard_dims[0]
    group = mesh.get_group(mesh_dim)
    runs = math.prod(shape[:d])
    run_len = math.prod(local_shape[d:])
    inner = math.prod(shape[d + 1:])
    return _Layout(offset, local_shape, runs, run_len, offset[d] * inner if local_shape[d] else 0,
                   math.prod(shape[d:]), group if _dist().get_world_size(group) > 1 else None)


def local_part(full: Tensor, ref: Tensor) -> Tensor:
    """The block of the full (replicated) tensor ``full`` that ``ref``'s local
    shard holds (a view; ``full`` itself for a plain ``ref``)."""
    if not is_dtensor(ref):
        return full
    lay = layout(ref)
    out = full
    for dim, (o, s) in enumerate(zip(lay.offset, lay.local_shape)):
        if s != full.shape[dim]:
            out = out.narrow(dim, o, s)
    return out


def masked_fill(t: Tensor, full_mask: Tensor, value: float) -> Tensor:
    """``t.masked_fill(full_mask, value)`` for a plain or sharded ``t`` and a
    replicated (full) boolean ``full_mask``; the result is laid out as ``t``."""
    loc = local(t).detach()
    return like(loc.masked_fill(local_part(full_mask, t).to(loc.device), value), t)


def logical_or(a: Tensor, b: Tensor) -> Tensor:
    """``a | b`` of two boolean masks laid out alike (plain or sharded)."""
    return like(local(a) | local(b), a)


def logical_and_full(a: Tensor, full_mask: Tensor) -> Tensor:
    """``a & full_mask`` for a plain or sharded mask ``a`` and a replicated one."""
    loc = local(a)
    return like(loc & local_part(full_mask, a).to(loc.device), a)


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of a DTensor on every rank (an all-gather; booleans
    travel as one byte per entry), else ``t``."""
    if not is_dtensor(t):
        return t
    if t.dtype == torch.bool:
        return full_tensor(like(t.to_local().to(torch.uint8), t)).bool()
    return t.full_tensor()


def shard_group(tensors: Sequence[Tensor]):
    """The one shard group of the DTensors among ``tensors`` (``None`` if none
    is sharded); ``ValueError`` when they are sharded over different groups."""
    found = None
    for t in tensors:
        g = layout(t).group if is_dtensor(t) else None
        if g is None:
            continue
        if found is None:
            found = g
        elif g is not found and _dist().get_process_group_ranks(g) != _dist().get_process_group_ranks(found):
            raise ValueError("the tensors are sharded over different process groups; masks are selected over one")
    return found


def global_count(tensors: Sequence[Tensor], pred) -> int:
    """``sum(pred(t).sum())`` over the global tensors: local counts summed over
    the shard group (a DTensor's ``.sum().item()`` would give this rank's part
    only); a replicated tensor counts once."""
    group = shard_group(tensors)
    if group is None:
        return sum(int(pred(local(t)).sum()) for t in tensors)
    me = group_rank(group)
    n = sum(int(pred(local(t)).sum()) for t in tensors if layout(t).group is not None or me == 0)
    total = torch.tensor([n], dtype=torch.int64, device=_collective_device(group))
    _dist().all_reduce(total, group=group)
    return int(total.item())


# -------------------------------------------------------- exact selection
def _keys(v: Tensor) -> Tensor:
    """int64 keys ordered as the float64 values (``-0.0`` and ``0.0`` equal)."""
    bits = (v.double() + 0.0).view(torch.int64)  # + 0.0 turns -0.0 into 0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)


def _kth_largest_key(keys: List[Tensor], k: int, group) -> int:
    """The ``k``-th largest of the int64 ``keys`` over all ranks of ``group``
    (``1 <= k <= total``): eight rounds over the bytes of the keys, from the
    most significant, each one all-reduce of a 256-bin count histogram
    (2 KiB) of the candidates, which shrink to the keys sharing the bytes
    found so far."""
    device = _collective_device(group) if group is not None else torch.device("cpu")
    cands = [kk for kk in keys if kk.numel()]
    key = 0
    for shift in range(56, -8, -8):
        hist = torch.zeros(256, dtype=torch.int64, device=device)
        for c in cands:
            digit = (c >> shift) & 0xFF
            if shift == 56:
                digit = digit ^ 0x80  # the sign byte: negative keys rank below positive ones
            hist += torch.bincount(digit, minlength=256).to(device)
        if group is not None:
            _dist().all_reduce(hist, group=group)
        above = hist.flip(0).cumsum(0)  # above[i]: candidates whose byte is >= 255 - i
        i = int(torch.searchsorted(above, torch.tensor([k], device=device)).item())
        k -= int(above[i - 1]) if i > 0 else 0
        byte = (255 - i) ^ (0x80 if shift == 56 else 0)
        cands = [c[((c >> shift) & 0xFF) == byte] for c in cands]
        key |= byte << shift
    return key - (1 << 64) if key >= 1 << 63 else key  # the two's complement int64 value


def top_k_masks(values: Sequence[Tensor], k: int, largest: bool = True) -> List[Tensor]:
    """Exactly ``k`` entries over all ``values`` jointly: the largest (or
    smallest) ones, ties to the entry first in the global order (module
    docstring).  Plain tensors give plain bool masks (computed locally);
    DTensors give bool DTensors of the same layout, selected across their
    shard group with the exact histogram select and the tie counts described
    in the module docstring; a plain tensor among DTensors is replicated.
    ``-inf``/``inf`` are allowed, NaN is not (checked by the callers)."""
    values = list(values)
    group = shard_group(values)
    if group is None:  # every rank holds everything: the one-process rule
        flat = torch.cat([local(v).detach().reshape(-1).to("cpu", torch.float64) for v in values])
        keep = torch.zeros(flat.numel(), dtype=torch.bool)
        if k > 0:
            order = torch.sort(flat, descending=largest, stable=True).indices
            keep[order[:k]] = True
        out, i = [], 0
        for v in values:
            n = v.numel()
            out.append(like(keep[i:i + n].reshape(local(v).shape).to(local(v).device), v))
            i += n
        return out
    return _sharded_top_k(values, k, largest, group)


def _sharded_top_k(values: List[Tensor], k: int, largest: bool, group) -> List[Tensor]:
    me = group_rank(group)
    total = sum(v.numel() for v in values)
    lays = [layout(v) for v in values]
    # a replicated tensor (no shard group) is counted by rank 0 of the selection group only
    owned = [lay.group is not None or me == 0 for lay in lays]
    rows = []
    for v, lay in zip(values, lays):
        x = local(v).detach().reshape(lay.runs, lay.run_len) if lay.run_len else local(v).detach().reshape(lay.runs, 0)
        keys = _keys(x.to(torch.float64))
        rows.append(keys if largest else ~keys)  # ~key reverses the order: the k smallest values
    if k <= 0 or k >= total:
        return [like(torch.full(local(v).shape, k > 0, dtype=torch.bool, device=local(v).device), v)
                for v in values]
    t = _kth_largest_key([r.reshape(-1) for r, o in zip(rows, owned) if o], k, group)
    device = _collective_device(group)
    gt = sum(int((r > t).sum()) for r, o in zip(rows, owned) if o)
    eq = sum(int((r == t).sum()) for r, o in zip(rows, owned) if o)
    counts = torch.tensor([gt, eq], dtype=torch.int64, device=device)
    _dist().all_reduce(counts, group=group)
    ties_kept = k - int(counts[0])  # 1 <= ties_kept <= number of ties
    keeps = [r > t for r in rows]
    if ties_kept == int(counts[1]):  # every tie is kept: no order needed
        keeps = [kp | (r == t) for kp, r in zip(keeps, rows)]
    else:
        keeps = _keep_first_ties(rows, keeps, lays, values, owned, t, ties_kept, group)
    return [like(kp.reshape(local(v).shape), v) for kp, v in zip(keeps, values)]


def _keep_first_ties(rows, keeps, lays, values, owned, t: int, ties_kept: int, group) -> List[Tensor]:
    """Add to ``keeps`` the first ``ties_kept`` entries equal to ``t`` in the
    global order: every rank shares ``(global start, tie count)`` of its runs
    (one all-gather of ``16 * runs`` bytes per rank, ``runs`` = one per tensor
    for ``Shard(0)``), so each knows how many ties precede each of its runs."""
    d = _dist()
    base, bases = 0, []
    for v in values:
        bases.append(base)
        base += v.numel()
    mine = []  # (global start of the run, ties in it) of every run this rank counts
    per_tensor = []
    for i, (r, lay) in enumerate(zip(rows, lays)):
        ties = (r == t).sum(1)
        per_tensor.append(ties)
        if owned[i] and lay.run_len:  # an empty shard has no entries, hence no place in the order
            starts = bases[i] + lay.start + torch.arange(lay.runs, dtype=torch.int64) * lay.run_step
            mine.append(torch.stack([starts, ties.cpu()], 1))
    mine = torch.cat(mine) if mine else torch.zeros(0, 2, dtype=torch.int64)
    device = _collective_device(group)
    n = d.get_world_size(group)
    sizes = torch.tensor([mine.shape[0]], dtype=torch.int64, device=device)
    all_sizes = [torch.zeros_like(sizes) for _ in range(n)]
    d.all_gather(all_sizes, sizes, group=group)
    width = max(int(s) for s in all_sizes)
    padded = torch.full((width, 2), -1, dtype=torch.int64)
    padded[: mine.shape[0]] = mine
    gathered = [torch.zeros(width, 2, dtype=torch.int64, device=device) for _ in range(n)]
    d.all_gather(gathered, padded.to(device), group=group)
    table = torch.cat([g.cpu() for g in gathered])
    table = table[table[:, 0] >= 0]
    table = table[torch.argsort(table[:, 0], stable=True)]
    before = torch.cumsum(table[:, 1], 0) - table[:, 1]  # ties in earlier runs
    out = []
    for i, (r, lay, kp) in enumerate(zip(rows, lays, keeps)):
        starts = bases[i] + lay.start + torch.arange(lay.runs, dtype=torch.int64) * lay.run_step
        pos = torch.searchsorted(table[:, 0].contiguous(), starts).clamp(max=table.shape[0] - 1)
        quota = (ties_kept - before[pos]).clamp(min=0)  # ties this run may still keep
        eq = r == t
        rank_in_run = torch.cumsum(eq.to(torch.int64), 1)  # 1-based order of each tie in its run
        kp = kp | (eq & (rank_in_run <= quota.to(r.device).unsqueeze(1)))
        out.append(kp)
    return out
