"""Score patterns for the sharded projection's tests (shared by the
single-process and simulated-rank tests): uniform scores, a few distinct
values (many equal breakpoints), two points, sorted blocks, a root where
almost no element is free, a wide range; unit costs, costs near one or over
eight orders of magnitude."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

PATTERNS = ["uniform", "ties", "two_point", "sorted", "tiny_free", "wide"]
COSTS = [None, "near_one", "orders"]


def projection_data(n: int, dtype: torch.dtype, seed: int, pattern: str,
                    cost: Optional[str]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``n`` scores of ``pattern`` and their costs (``None``: unit costs), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g, dtype=torch.float64) * 1.2
    if pattern == "ties":  # a few distinct values, many equal breakpoints
        t = (t * 3).round() / 3
    elif pattern == "two_point":
        t = torch.where(t > 0.6, 1.0, 0.25).to(torch.float64)
    elif pattern == "sorted":
        t = t.sort().values
    elif pattern == "tiny_free":  # lam* where almost no element is free
        t = torch.where(t > 0.6, 5.0, -5.0).to(torch.float64)
        if n:
            t[n // 2] = 0.123
    elif pattern == "wide":
        t = (t - 0.6) * 20
    c = None
    if cost == "near_one":
        c = torch.rand(n, generator=g, dtype=torch.float64) * 2 + 0.05
    elif cost == "orders":  # costs over eight orders of magnitude
        c = 10 ** ((torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 8)
    return t.to(dtype), (c.to(dtype) if c is not None else None)
