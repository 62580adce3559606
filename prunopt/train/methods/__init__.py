"""Registry of ``prunopt train --method NAME`` entries.

A method module calls :func:`register_method` at import and is imported at the
bottom of this file. ``run(args)`` receives the parsed ``argparse.Namespace``
(common options: ``epochs``, ``batch_size``, ``lr``, ``seed``, ``out``,
``density``/``sparsity``, ``progress``, ``limit``, plus whatever the method's
``add_arguments`` added) and returns a :class:`prunopt.train.Summary`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional


@dataclass
class MethodEntry:
    name: str
    run: Callable
    help: str
    add_arguments: Optional[Callable] = None


METHODS: Dict[str, MethodEntry] = {}


def register_method(name: str, run: Callable, help: str, add_arguments: Optional[Callable] = None) -> None:
    if name in METHODS:
        raise ValueError(f"method {name!r} is already registered")
    METHODS[name] = MethodEntry(name, run, help, add_arguments)


# Method modules register themselves on import.
from prunopt.train.methods import probmask  # noqa: E402,F401

# --- pruning toolkit (issue 5): pai-random, snip, grasp, synflow, lt, set, rigl, gmp, ft ---
from prunopt.train.methods import toolkit  # noqa: E402,F401

from prunopt.train.methods import prunadag  # noqa: E402,F401  (prunAdag)

# issue 6: differentiable sparsification and two-temperature architecture pruning
from prunopt.train.methods import ap, ds  # noqa: E402,F401
