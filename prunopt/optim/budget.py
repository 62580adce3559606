"""Keeping probabilistic mask scores inside a budget (ProM / ProbMask)."""
from __future__ import annotations

import copy
import math
import numbers
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
from torch import Tensor

from prunopt.ops import project_budget_
from prunopt.schedules import DensitySchedule

__all__ = ["BudgetProjection"]

Density = Union[float, DensitySchedule, Callable[[int], float]]


class BudgetProjection:
    r"""Projects score parameters onto ``{0 <= theta <= 1, sum(c * theta) <= S}``
    after every optimizer step (SPEC.md §1; ProM supplement eq. 9-17).

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
    """

    def __init__(self, params: Iterable[Tensor], density: Density, cost: Optional[Sequence[Tensor]] = None):
        self.params: List[Tensor] = list(params)
        if not self.params:
            raise ValueError("params must contain at least one tensor")
        for i, p in enumerate(self.params):
            if not isinstance(p, Tensor):
                raise TypeError(f"params[{i}] must be a Tensor, got {type(p).__name__}")
        self.density = _check_density(density)
        if cost is not None:
            cost = list(cost)
            if len(cost) != len(self.params):
                raise ValueError(f"cost must have one tensor per parameter ({len(self.params)}), got {len(cost)}")
            for i, (c, p) in enumerate(zip(cost, self.params)):
                if not isinstance(c, Tensor) or c.shape != p.shape:
                    raise ValueError(f"cost[{i}] must be a tensor of shape {tuple(p.shape)}")
                if not bool(((c > 0) & torch.isfinite(c)).all()):
                    raise ValueError(f"cost[{i}] must be finite and > 0 everywhere")
        self.cost = cost
        self.total = float(sum(c.double().sum().item() for c in cost)) if cost else float(sum(p.numel() for p in self.params))
        if not math.isfinite(self.total):
            raise ValueError(f"the costs sum to {self.total}; cost must have a finite total")
        self.step_count = 0
        self._hook = None

    def current_density(self) -> float:
        if callable(self.density):
            d = float(self.density(self.step_count))
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


def _check_density(density):
    if isinstance(density, numbers.Real) and not isinstance(density, bool):
        if not (math.isfinite(density) and 0.0 <= density <= 1.0):
            raise ValueError(f"density must be in [0, 1], got {density}")
        return density
    if not callable(density):
        raise TypeError(f"density must be a number, a DensitySchedule or a callable, got {type(density).__name__}")
    return density


def _handle_alive(handle) -> bool:
    """Whether a ``torch.utils.hooks.RemovableHandle`` is still registered."""
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks
