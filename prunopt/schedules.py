"""Schedules shared by the pruning methods."""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict

__all__ = ["DensitySchedule", "TemperatureSchedule"]


def _check_step(step) -> int:
    """A step count: an int (or NumPy integer) >= 0, or a one-element tensor
    holding one (e.g. ``torch.optim``'s float ``state["step"]``); the same
    checks apply to both, and a tensor with a non-integral value is rejected."""
    import torch

    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise TypeError(f"step must be an int or a one-element tensor, got a tensor of shape {tuple(step.shape)}")
        if step.dtype == torch.bool or step.is_complex():
            raise TypeError(f"step must be an int or a one-element tensor, got a {step.dtype} tensor")
        value = step.item()
        if isinstance(value, float):
            if not (math.isfinite(value) and value == math.floor(value)):
                raise ValueError(f"step must be a whole number, got {value}")
            value = int(value)
        step = value
    elif isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    step = int(step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


class DensitySchedule:
    r"""Annealed density of the ProM supplement (A.1; SPEC.md §1).

    .. math::
        d(i) = \begin{cases}
            1 & i < i_{min} \\
            d_t + (1 - d_t)\left(1 - \frac{i - i_{min}}{i_{max} - i_{min}}\right)^{p} & i_{min} \le i \le i_{max} \\
            d_t & i > i_{max}
        \end{cases}, \qquad S(i) = d(i)\, D

    with ``d_t = target = 1/alpha`` (alpha the acceleration factor). The
    supplement's schedule is linear (``power=1``); ProM's and ProbMask's code
    use ``power=3``.

    Args:
        target: final density ``d_t`` in (0, 1].
        start: ``i_min``, the first step of the annealing (>= 0).
        end: ``i_max`` (> start).
        power: exponent ``p`` (> 0).

    Call it with a step to get ``d(step)``; :meth:`budget` scales by ``D``.
    """

    def __init__(self, target: float, start: int, end: int, power: float = 1.0):
        if isinstance(target, bool) or not isinstance(target, (int, float)):
            raise TypeError(f"target must be a number, got {type(target).__name__}")
        if not (0.0 < float(target) <= 1.0):
            raise ValueError(f"target must be in (0, 1], got {target}")
        for name, v in (("start", start), ("end", end)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if end <= start:
            raise ValueError(f"end must be > start ({start}), got {end}")
        if not (isinstance(power, (int, float)) and math.isfinite(power) and power > 0):
            raise ValueError(f"power must be a finite number > 0, got {power}")
        self.target = float(target)
        self.start = int(start)
        self.end = int(end)
        self.power = float(power)

    @classmethod
    def from_acceleration(cls, alpha: float, start: int, end: int, power: float = 1.0) -> "DensitySchedule":
        """The schedule for acceleration factor ``alpha >= 1`` (``target = 1/alpha``)."""
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 1):
            raise ValueError(f"alpha must be a finite number >= 1, got {alpha}")
        return cls(1.0 / alpha, start, end, power)

    def __call__(self, step: int) -> float:
        i = _check_step(step)
        if i < self.start:
            return 1.0
        if i > self.end:
            return self.target
        frac = 1.0 - (i - self.start) / (self.end - self.start)
        return self.target + (1.0 - self.target) * frac**self.power

    def budget(self, step: int, total: float) -> float:
        """``S(step) = d(step) * total`` (total = number of scores or sum of costs)."""
        return self(step) * float(total)

    def state_dict(self) -> Dict[str, Any]:
        return {"target": self.target, "start": self.start, "end": self.end, "power": self.power}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        fresh = DensitySchedule(state["target"], state["start"], state["end"], state.get("power", 1.0))
        self.__dict__.update(fresh.__dict__)

    def __repr__(self) -> str:
        return f"DensitySchedule(target={self.target}, start={self.start}, end={self.end}, power={self.power})"


class TemperatureSchedule:
    r"""Exponential annealing of a relaxation temperature:
    :math:`\tau(i) = \tau_0 (\tau_1/\tau_0)^{\min(i, n)/n}` (used for the
    Gumbel-sigmoid masks of ProbMask/ProM, SPEC.md §1)."""

    def __init__(self, start: float, end: float, steps: int):
        for name, v in (("start", start), ("end", end)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            raise ValueError(f"steps must be a positive int, got {steps}")
        self.start, self.end, self.steps = float(start), float(end), int(steps)

    def __call__(self, step: int) -> float:
        i = min(_check_step(step), self.steps)
        return self.start * (self.end / self.start) ** (i / self.steps)

    def state_dict(self) -> Dict[str, Any]:
        return {"start": self.start, "end": self.end, "steps": self.steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.__init__(state["start"], state["end"], state["steps"])
