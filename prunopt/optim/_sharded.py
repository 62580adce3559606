"""Global quantities of the optimizers over parameters sharded by FSDP2.

Under ``torch.distributed.fsdp.fully_shard`` every parameter is a DTensor and
each rank holds a shard of it. prunAdag's relevant set (the top-``T`` of
``|g|`` over the pruned parameters, eq. 2.6 of Porcelli, Seraghiti, Toint,
"prunAdag: an adaptive pruning-aware gradient method") and the ratio ``r`` of
Table 1, and the top-``T`` LMO of Frank-Wolfe (eq. 1.2), are defined over the
*logical* parameters. :class:`ShardedView` gives an optimizer the local shards
of its tensors and the reductions it needs over every rank: exact thresholds
through :func:`prunopt.distributed.topk_threshold` (radix select on all-reduced
histograms: the values are never gathered) and float64 sums through one
``all_reduce`` each.

Which elements take part: a DTensor contributes its local shard, counted once
over the mesh (a tensor ``Replicate`` on a mesh dimension is counted on the
rank at coordinate 0 of that dimension only); a plain tensor beside DTensors
is taken as replicated (every rank holds the same values, as for FSDP2's
``ignored_params``) and counted once too. Every rank updates its own local
values with the same global threshold and ratio.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from prunopt import distributed as pd

__all__ = ["ShardedView", "sharded_view"]


class ShardedView:
    """The local parts of a list of tensors (DTensors and replicated plain
    tensors on one device mesh) and the global reductions over the mesh.

    Attributes:
        group: what :mod:`prunopt.distributed` sums over (a process group for
            a 1-D mesh, the mesh itself otherwise).
        device: the device of the local shards (where summaries live).
    """

    def __init__(self, tensors: Sequence[Tensor]):
        dts = [t for t in tensors if pd.is_distributed_tensor(t)]
        if not dts:
            raise ValueError("ShardedView needs at least one DTensor")
        self.mesh = dts[0].device_mesh
        for t in dts:
            if t.device_mesh != self.mesh:
                raise ValueError("the optimizer's DTensor parameters live on different device meshes; one "
                                 "optimizer step selects over one mesh")
        self.group = pd.process_group_of(dts)
        coord = self.mesh.get_coordinate()
        if coord is None:
            raise ValueError("this rank is not part of the device mesh of the optimizer's parameters")
        # a replicated plain tensor is counted on the rank at coordinate 0 of every mesh dimension
        self._plain_counts = all(c == 0 for c in coord)
        self.device = dts[0].to_local().device
        self._counts = {}  # placements -> counts_locally (one mesh: the placements decide)

    def local(self, t: Tensor) -> Tensor:
        """This rank's part of ``t`` (a view: in-place writes reach the DTensor)."""
        return pd.local_tensor(t)

    def counts(self, t: Tensor) -> bool:
        """Whether this rank's values of ``t`` take part in global sums and selections."""
        if pd.is_distributed_tensor(t):
            key = tuple(t.placements)
            try:
                got = self._counts.get(key)
            except TypeError:  # (a placement that cannot be hashed: asked each time)
                return pd.counts_locally(t)
            if got is None:
                got = self._counts[key] = pd.counts_locally(t)
            return got
        return self._plain_counts

    def numel(self, t: Tensor) -> int:
        """The logical (global) number of elements of ``t``."""
        return t.numel()  # a DTensor's numel is its global size; a replicated tensor's, its own

    def sum(self, values: List) -> Tensor:
        """Elementwise float64 sum over every rank of a list of local
        contributions (numbers or one-element tensors): one ``all_reduce``."""
        return pd.all_reduce_sum(values, group=self.group, device=self.device)

    def threshold(self, values: List[Tensor], counted: List[bool], k: int) -> Optional[Tensor]:
        """The ``k``-th largest ``|v|`` over the counted local ``values`` of every
        rank (bit-identical to the one-process threshold on the logical
        tensors), or ``None`` on every rank when a counted value on some rank
        is not finite. ``values`` are local tensors of one dtype; the
        uncounted ones (replicas held by another rank too) take no part."""
        part = [v if c else v.reshape(-1)[:0] for v, c in zip(values, counted)]
        if not part:
            part = [torch.empty(0, device=self.device)]
        return pd._topk_threshold_or_none(part, k, group=self.group)


def sharded_view(tensors: Sequence[Tensor]) -> Optional[ShardedView]:
    """A :class:`ShardedView` when some of ``tensors`` are DTensors, else ``None``."""
    if any(pd.is_distributed_tensor(t) for t in tensors):
        return ShardedView(tensors)
    return None
