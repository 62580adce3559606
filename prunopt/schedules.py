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


def _real(value, name: str) -> float:
    """``value`` as a float: ``TypeError`` naming ``name`` unless a real number
    (int, float, NumPy scalar or one-element real tensor, not a bool); a value
    too large for a float (an int such as ``10**400``) is a ``ValueError``."""
    import torch

    if (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()
            and value.dtype != torch.bool):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got an int too large for a float "
                         f"({value.bit_length()} bits)") from None


def _int(value, name: str) -> int:
    """``value`` as an int: ``TypeError`` naming ``name`` unless an int or NumPy
    integer (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _state_values(state, keys, defaults, owner: str) -> list:
    """The values of ``keys`` in a state dict; a missing key is a ``ValueError``
    naming it (``defaults`` fills optional keys)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict from {owner}.state_dict(), got {type(state).__name__}")
    missing = [k for k in keys if k not in state and k not in defaults]
    if missing:
        raise ValueError(f"state lacks the key(s) {missing} of {owner}.state_dict()")
    return [state[k] if k in state else defaults[k] for k in keys]


class DensitySchedule:
    r"""Annealed density of the ProM supplement (A.1).

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
        target: final density ``d_t`` in (0, 1] (a real number).
        start: ``i_min``, the first step of the annealing (an int >= 0; NumPy
            integers too, as for the step).
        end: ``i_max`` (an int > start).
        power: exponent ``p`` (a real number > 0, finite).

    A value of the wrong type (a string, a bool, a float step) is a
    ``TypeError`` naming the argument; a value out of range (including one too
    large for a float) a ``ValueError``.

    Call it with a step to get ``d(step)``; :meth:`budget` scales by ``D``.
    """

    def __init__(self, target: float, start: int, end: int, power: float = 1.0):
        target = _real(target, "target")
        if not (0.0 < target <= 1.0):
            raise ValueError(f"target must be in (0, 1], got {target}")
        start, end = _int(start, "start"), _int(end, "end")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if end <= start:
            raise ValueError(f"end must be > start ({start}), got {end}")
        power = _real(power, "power")
        if not (math.isfinite(power) and power > 0):
            raise ValueError(f"power must be a finite number > 0, got {power}")
        self.target = target
        self.start = start
        self.end = end
        self.power = power

    @classmethod
    def from_acceleration(cls, alpha: float, start: int, end: int, power: float = 1.0) -> "DensitySchedule":
        """The schedule for acceleration factor ``alpha >= 1`` (``target = 1/alpha``;
        a real number, finite)."""
        alpha = _real(alpha, "alpha")
        if not (math.isfinite(alpha) and alpha >= 1):
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
        """``S(step) = d(step) * total`` (total = number of scores or sum of
        costs: a finite real number >= 0, else ``TypeError``/``ValueError``
        naming ``total``)."""
        total = _real(total, "total")
        if not (math.isfinite(total) and total >= 0):
            raise ValueError(f"total must be a finite number >= 0, got {total}")
        return self(step) * total

    def state_dict(self) -> Dict[str, Any]:
        return {"target": self.target, "start": self.start, "end": self.end, "power": self.power}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (``power`` may be absent: 1).
        The whole state is checked first: a missing key is a ``ValueError``
        naming it, a bad value the constructor's error, and the schedule is
        unchanged when it raises."""
        values = _state_values(state, ("target", "start", "end", "power"), {"power": 1.0}, "DensitySchedule")
        fresh = DensitySchedule(*values)
        self.__dict__.update(fresh.__dict__)

    def __repr__(self) -> str:
        return f"DensitySchedule(target={self.target}, start={self.start}, end={self.end}, power={self.power})"


class TemperatureSchedule:
    r"""Exponential annealing of a relaxation temperature:
    :math:`\tau(i) = \tau_0 (\tau_1/\tau_0)^{\min(i, n)/n}` (used for the
    Gumbel-sigmoid masks of ProbMask/ProM, ProM supplement A.2)."""

    def __init__(self, start: float, end: float, steps: int):
        values = []
        for name, v in (("start", start), ("end", end)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
            try:
                v = float(v)
            except OverflowError:
                v = math.inf
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v}")
            values.append(v)
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps <= 0:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        (self.start, self.end), self.steps = values, int(steps)

    def __call__(self, step: int) -> float:
        i = min(_check_step(step), self.steps)
        return self.start * (self.end / self.start) ** (i / self.steps)

    def state_dict(self) -> Dict[str, Any]:
        return {"start": self.start, "end": self.end, "steps": self.steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output; checked first (a missing key is a
        ``ValueError`` naming it), unchanged when it raises."""
        fresh = TemperatureSchedule(*_state_values(state, ("start", "end", "steps"), {}, "TemperatureSchedule"))
        self.__dict__.update(fresh.__dict__)
