"""Registry of ``prunopt train --method NAME`` entries.

A method module calls :func:`register_method` at import and is imported at the
bottom of this file. ``run(args)`` receives the parsed ``argparse.Namespace``
(common options: ``epochs``, ``batch_size``, ``lr``, ``seed``, ``out``,
``density``/``sparsity``, ``progress``, ``limit``, plus whatever the method's
``add_arguments`` added) and returns a :class:`prunopt.train.Summary`.
``check_arguments(args)``, if given, runs right after parsing (before any
work) and raises ``ValueError`` for values that are bad for this method; the
CLI turns that into a usage error (exit status 2). Single values are checked
by the options' argparse ``type=`` functions (``prunopt.train.args.positive_float_arg``
and friends).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional


@dataclass
class MethodEntry:
    """One ``prunopt train --method`` entry: its ``run(args)``, help text, and
    optional ``add_arguments(parser)`` and ``check_arguments(args)``."""

    name: str
    run: Callable
    help: str
    add_arguments: Optional[Callable] = None
    check_arguments: Optional[Callable] = None


METHODS: Dict[str, MethodEntry] = {}


def register_method(name: str, run: Callable, help: str, add_arguments: Optional[Callable] = None,
                    check_arguments: Optional[Callable] = None) -> None:
    """Adds ``name`` to :data:`METHODS` (``ValueError`` if it is already there)."""
    if name in METHODS:
        raise ValueError(f"method {name!r} is already registered")
    METHODS[name] = MethodEntry(name, run, help, add_arguments, check_arguments)


# Method modules register themselves on import.
from prunopt.train.methods import probmask  # noqa: E402,F401

# --- pruning toolkit: pai-random, snip, grasp, synflow, lt, set, rigl, gmp, ft ---
from prunopt.train.methods import toolkit  # noqa: E402,F401

from prunopt.train.methods import prunadag  # noqa: E402,F401  (prunAdag)

# differentiable sparsification and two-temperature architecture pruning
from prunopt.train.methods import ap, ds  # noqa: E402,F401
