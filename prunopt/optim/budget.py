"""Keeping probabilistic mask scores inside a budget (ProM / ProbMask)."""
from __future__ import annotations

import copy
import math
import numbers
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
from torch import Tensor

from prunopt.ops.projection import _check_no_overlap, project_budget_
from prunopt.schedules import DensitySchedule

__all__ = ["BudgetProjection"]

Density = Union[float, DensitySchedule, Callable[[int], float]]


class BudgetProjection:
    r"""Projects score parameters onto ``{0 <= theta <= 1, sum(c * theta) <= S}``
    after every optimizer step (ProM supplement A.2, eq. 9-17).

    The budget is ``S(i) = d(i) * D`` with ``D`` the number of scores (or the
    sum of the costs) and ``d`` a fixed density or a schedule (e.g.
    :class:`~prunopt.schedules.DensitySchedule`) evaluated at the number of
    projections done so far. All parameters share one budget and are projected
    jointly by one fused op, without concatenating them.

    Works beside any ``torch.optim`` optimizer, either explicitly::

        proj = BudgetProjection(scores, density=DensitySchedule(0.1, 0, 1000))
        optimizer.step(); proj.step()

    or attached as a step post-hook::

        proj.attach(optimizer)      # proj.step() now runs after optimizer.step()

    Args:
        params: the score tensors (parameters) to keep in the budget.
        density: a float in [0, 1], a ``DensitySchedule`` or any callable
            ``step -> density``.
        cost: optional positive costs, one tensor per parameter, same shapes.

    Everything is checked here (``TypeError``/``ValueError`` naming the
    argument), not at the first :meth:`step`, which when attached runs after
    ``optimizer.step()`` has already moved the parameters: ``params`` must be
    distinct real floating-point tensors of one dtype on one device that do not
    share memory; each ``cost[i]`` a finite, positive tensor of ``params[i]``'s
    shape, dtype and device; ``density`` a number in [0, 1] or a callable.

    **Distributed.**  Under DDP the scores are plain tensors, the same on every
    rank (DDP averages their gradients), so each rank projects its copy and the
    results agree; nothing is communicated.  Under FSDP2 the scores are DTensor
    shards (build the projection after ``fully_shard``, which replaces the
    parameters, like the optimizer): every step is the exact sharded
    projection :func:`prunopt.distributed.project_budget_` over the global
    scores (a few all-reduces of histograms, no score gathered), ``D`` is the
    global number of scores and the cost total is summed over the ranks; the
    costs must then be DTensors laid out as the scores.  All parameters are
    plain or all are DTensors.
    """

    def __init__(self, params: Iterable[Tensor], density: Density, cost: Optional[Sequence[Tensor]] = None):
        # everything is checked here, not at the first step(): attached to an
        # optimizer, that step runs after optimizer.step() has moved the params
        if isinstance(params, Tensor):
            raise TypeError("params must be an iterable of tensors, got a single tensor: write [params]")
        if isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
            raise TypeError(f"params must be an iterable of tensors, got {type(params).__name__}")
        self.params: List[Tensor] = list(params)
        if not self.params:
            raise ValueError("params must contain at least one tensor")
        _check_params(self.params)
        self.density = _check_density(density)
        if cost is not None:
            if isinstance(cost, Tensor):
                raise TypeError("cost must be a sequence of tensors, one per parameter, got a single tensor")
            if isinstance(cost, (str, bytes)) or not hasattr(cost, "__iter__"):
                raise TypeError(f"cost must be a sequence of tensors, one per parameter, got {type(cost).__name__}")
            cost = list(cost)
            _check_cost(cost, self.params)
        self.cost = cost
        self.total = _total(self.params, cost)
        if not math.isfinite(self.total):
            raise ValueError(f"the costs sum to {self.total}; cost must have a finite total")
        self.step_count = 0
        self._hook = None

    def current_density(self) -> float:
        if callable(self.density):
            d = self.density(self.step_count)
            try:
                d = float(d)
            except (TypeError, ValueError, OverflowError):
                raise ValueError(f"the density schedule returned a {type(d).__name__} that is not a number in "
                                 f"[0, 1] at step {self.step_count}") from None
            if not (0.0 <= d <= 1.0):
                raise ValueError(f"the density schedule returned {d} at step {self.step_count}; expected [0, 1]")
            return d
        return float(self.density)

    def budget(self) -> float:
        """The budget ``S`` the next :meth:`step` projects onto."""
        return self.current_density() * self.total

    @torch.no_grad()
    def step(self) -> float:
        """Projects the parameters in place; returns the budget used."""
        budget = self.budget()
        if _sharded(self.params):
            from prunopt.distributed import project_budget_ as project_sharded_

            project_sharded_(self.params, budget, self.cost)
        else:
            project_budget_(self.params, budget, self.cost)
        self.step_count += 1
        return budget

    def attach(self, optimizer: torch.optim.Optimizer):
        """Runs :meth:`step` after every ``optimizer.step()`` (through
        ``Optimizer.register_step_post_hook``). Returns the hook handle;
        ``handle.remove()`` detaches (after which it can be attached again)."""
        if self._hook is not None and _handle_alive(self._hook):
            raise RuntimeError("this BudgetProjection is already attached to an optimizer")
        self._hook = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.step())
        return self._hook

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"step_count": self.step_count}
        if isinstance(self.density, DensitySchedule):
            state["density"] = self.density.state_dict()
        elif not callable(self.density):
            state["density"] = float(self.density)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output. Everything is checked before
        anything is assigned (``ValueError``/``TypeError`` leave the projection
        as it was)."""
        if not isinstance(state, dict) or "step_count" not in state:
            raise ValueError("state must be a dict from BudgetProjection.state_dict() (with 'step_count')")
        count = state["step_count"]
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"state['step_count'] must be an int >= 0, got {count!r}")
        density = self.density
        if "density" in state:
            d = state["density"]
            if isinstance(d, dict):
                if not isinstance(self.density, DensitySchedule):
                    raise ValueError("state['density'] is a schedule's state, but this projection has no DensitySchedule")
                density = copy.deepcopy(self.density)
                density.load_state_dict(d)  # validates (raises before self.density changes)
            else:
                density = float(_check_density(d))
        self.step_count = int(count)
        self.density = density


def _sharded(tensors: Sequence[Tensor]) -> bool:
    from prunopt.distributed import is_distributed_tensor

    return any(is_distributed_tensor(t) for t in tensors)


def _total(params: List[Tensor], cost: Optional[List[Tensor]]) -> float:
    """``D``: the number of scores, or the sum of the costs (over the global
    tensors when they are sharded)."""
    if cost is None:
        return float(sum(p.numel() for p in params))  # a DTensor's numel is its global size
    if not _sharded(params):
        return float(sum(c.double().sum().item() for c in cost))
    from prunopt.distributed import all_reduce_sum, counts_locally, local_tensor, process_group_of

    local = sum(float(local_tensor(c).double().sum()) for c in cost if counts_locally(c))
    return float(all_reduce_sum([local], group=process_group_of(params))[0])


def _check_params(params: List[Tensor]) -> None:
    """``params``: distinct real floating tensors of one dtype on one device
    (what the projection op needs), each named ``params[i]`` when wrong; all
    plain or all DTensors."""
    if _sharded(params):
        from prunopt.distributed import is_distributed_tensor

        plain = [i for i, p in enumerate(params) if not is_distributed_tensor(p)]
        if plain:
            raise ValueError(f"params{plain} are plain tensors among DTensors: the budget of sharded scores "
                             "(FSDP2) is global, so every parameter must be a DTensor")
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"params[{i}] must be a Tensor, got {type(p).__name__}")
        if not p.is_floating_point():
            raise ValueError(f"params[{i}] must be a real floating-point tensor (scores), got {p.dtype}")
        if p.dtype != params[0].dtype:
            raise ValueError(f"params[{i}] is {p.dtype} but params[0] is {params[0].dtype}: params must share one "
                             "dtype")
        if p.device != params[0].device:
            raise ValueError(f"params[{i}] is on {p.device} but params[0] is on {params[0].device}: params must be on "
                             "one device")
    from prunopt.distributed import local_tensor

    # the in-place op's own check, before any step (on the local shards of DTensors)
    _check_no_overlap([local_tensor(p) for p in params], "params")


def _check_cost(cost: List[Tensor], params: List[Tensor]) -> None:
    """One finite, positive cost tensor per parameter, of its shape, dtype and device."""
    if len(cost) != len(params):
        raise ValueError(f"cost must have one tensor per parameter ({len(params)}), got {len(cost)}")
    for i, (c, p) in enumerate(zip(cost, params)):
        if not isinstance(c, Tensor):
            raise TypeError(f"cost[{i}] must be a Tensor, got {type(c).__name__}")
        if c.shape != p.shape:
            raise ValueError(f"cost[{i}] must be a tensor of shape {tuple(p.shape)}, got {tuple(c.shape)}")
        if c.dtype != p.dtype:
            raise ValueError(f"cost[{i}] must have the dtype of params[{i}] ({p.dtype}), got {c.dtype}")
        if c.device != p.device:
            raise ValueError(f"cost[{i}] must be on the device of params[{i}] ({p.device}), got {c.device}")
    from prunopt.distributed import is_distributed_tensor, local_tensor

    for i, (c, p) in enumerate(zip(cost, params)):
        if is_distributed_tensor(c) != is_distributed_tensor(p) or (is_distributed_tensor(c) and (
                c.device_mesh != p.device_mesh or tuple(c.placements) != tuple(p.placements))):
            raise ValueError(f"cost[{i}] must be laid out as params[{i}] (a DTensor with its mesh and placements "
                             f"exactly when params[{i}] is one)")
    bad = [not bool(((local_tensor(c) > 0) & torch.isfinite(local_tensor(c))).all()) for c in cost]
    if _sharded(params):  # a bad shard on one rank is an error on every rank
        from prunopt.distributed import all_reduce_sum, process_group_of

        bad = [b > 0 for b in all_reduce_sum([float(b) for b in bad], group=process_group_of(params)).tolist()]
    for i, b in enumerate(bad):
        if b:
            raise ValueError(f"cost[{i}] must be finite and > 0 everywhere")


def _check_density(density):
    if isinstance(density, numbers.Real) and not isinstance(density, bool):
        try:
            value = float(density)
        except OverflowError:
            raise ValueError("density must be in [0, 1], got an int too large for a float") from None
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"density must be in [0, 1], got {density}")
        return density
    if not callable(density):
        raise TypeError(f"density must be a number, a DensitySchedule or a callable, got {type(density).__name__}")
    return density


def _handle_alive(handle) -> bool:
    """Whether a ``torch.utils.hooks.RemovableHandle`` is still registered."""
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks
