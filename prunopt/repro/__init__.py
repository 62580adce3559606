"""Registry of ``prunopt repro NAME`` paper reproductions.

A reproduction module calls :func:`register_repro` at import and is imported at
the bottom of this file; ``run(args)`` gets the parsed namespace (``out``,
``seed``, ``quick``, ``progress``) and prints its results.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional


@dataclass
class ReproEntry:
    name: str
    run: Callable
    help: str
    add_arguments: Optional[Callable] = None


REPROS: Dict[str, ReproEntry] = {}


def register_repro(name: str, run: Callable, help: str, add_arguments: Optional[Callable] = None) -> None:
    if name in REPROS:
        raise ValueError(f"reproduction {name!r} is already registered")
    REPROS[name] = ReproEntry(name, run, help, add_arguments)


# Reproduction modules register themselves on import (none yet).
from prunopt.repro import prunadag  # noqa: E402,F401  (prunAdag paper, Table 2 and 4)
from prunopt.repro import interspace as _interspace  # noqa: E402,F401  (prunopt repro interspace)
# differentiable sparsification / architecture pruning reproductions
from prunopt.repro import ap, ds  # noqa: E402,F401
