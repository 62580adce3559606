"""Keeping probabilistic mask scores inside a budget (ProM / ProbMask)."""
from __future__ import annotations

import math
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
        if isinstance(density, (int, float)) and not isinstance(density, bool):
            if not (math.isfinite(density) and 0.0 <= density <= 1.0):
                raise ValueError(f"density must be in [0, 1], got {density}")
        elif not callable(density):
            raise TypeError(f"density must be a number, a DensitySchedule or a callable, got {type(density).__name__}")
        self.density = density
        if cost is not None:
            cost = list(cost)
            if len(cost) != len(self.params):
                raise ValueError(f"cost must have one tensor per parameter ({len(self.params)}), got {len(cost)}")
            for i, (c, p) in enumerate(zip(cost, self.params)):
                if not isinstance(c, Tensor) or c.shape != p.shape:
                    raise ValueError(f"cost[{i}] must be a tensor of shape {tuple(p.shape)}")
                if not bool((c > 0).all()):
                    raise ValueError(f"cost[{i}] must be positive")
        self.cost = cost
        self.total = float(sum(c.double().sum().item() for c in cost)) if cost else float(sum(p.numel() for p in self.params))
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
        ``handle.remove()`` detaches."""
        if self._hook is not None:
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
        self.step_count = int(state["step_count"])
        if "density" in state:
            if isinstance(self.density, DensitySchedule) and isinstance(state["density"], dict):
                self.density.load_state_dict(state["density"])
            elif not isinstance(state["density"], dict):
                self.density = float(state["density"])
