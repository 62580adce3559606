"""Registry of ``prunopt train --method NAME`` entries.

A method module calls :func:`register_method` at import and is imported at the
bottom of this file. ``run(args, job)`` receives the parsed ``argparse.Namespace``
(common options: ``epochs``, ``batch_size``, ``lr``, ``seed``, ``out``,
``density``/``sparsity``, ``progress``, ``limit``, plus whatever the method's
``add_arguments`` added) and the :class:`prunopt.train.job.Job` it trains
through (processes, checkpoints, resume: read the rules in that module), and
returns a :class:`prunopt.train.Summary` after ``job.finish(summary, state)``.
In a direct call ``job`` may be omitted: the method then trains in one
process and writes nothing (``--out``, ``--resume`` and torchrun are handled
by :func:`prunopt.train.job.run`, the ``prunopt train`` command).

``check_arguments(args)``, if given, runs right after parsing (before any
work) and raises ``ValueError`` for values that are bad for this method; the
CLI turns that into a usage error (exit status 2). Every method refuses
``--sparsity 1`` (``--density 0``, nothing left to train): :func:`check_density`.
Single values are checked by the options' argparse ``type=`` functions
(``prunopt.train.args.positive_float_arg`` and friends).

``fsdp`` is ``None`` for a method that runs under ``--fsdp`` (FSDP2), or the
reason it cannot yet (then ``--fsdp`` with it is a usage error). Every
registered method runs sharded: a method does under ``--fsdp`` what it does
under DDP, its transformations applied before :meth:`Job.prepare` (or to a
:meth:`Job.plain_copy` of a trained model), its optimizers built after it
(docs/distributed.md, "prunopt train under torchrun").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

@dataclass
class MethodEntry:
    """One ``prunopt train --method`` entry: its ``run(args, job)``, a one-line
    help text, optional ``add_arguments(parser)`` and ``check_arguments(args)``,
    and ``fsdp``: ``None`` when it runs under ``--fsdp``, else why not."""

    name: str
    run: Callable
    help: str
    add_arguments: Optional[Callable] = None
    check_arguments: Optional[Callable] = None
    fsdp: Optional[str] = "not declared to run sharded"


METHODS: Dict[str, MethodEntry] = {}


def register_method(name: str, run: Callable, help: str, add_arguments: Optional[Callable] = None,
                    check_arguments: Optional[Callable] = None, fsdp: Optional[str] = "not declared to run sharded"
                    ) -> None:
    """Adds ``name`` to :data:`METHODS` (``ValueError`` if it is already there)."""
    if name in METHODS:
        raise ValueError(f"method {name!r} is already registered")
    METHODS[name] = MethodEntry(name, run, help, add_arguments, check_arguments, fsdp)


def check_density(args) -> None:
    """``ValueError`` for ``--density 0`` (``--sparsity 1``): every prunable
    weight removed leaves a network that predicts a constant, so no method
    trains towards it."""
    density = getattr(args, "density", None)
    if density is not None and not density > 0:
        raise ValueError(f"--method {getattr(args, 'method', '?')} needs --density > 0 (--sparsity < 1): at density 0 every "
                         "prunable weight is removed and the network predicts a constant")


# Method modules register themselves on import.
from prunopt.train.methods import probmask  # noqa: E402,F401

# the pruning toolkit: pai-random, snip, grasp, synflow, lt, set, rigl, gmp, ft
from prunopt.train.methods import toolkit  # noqa: E402,F401

from prunopt.train.methods import prunadag  # noqa: E402,F401  (prunAdag)

# differentiable sparsification and two-temperature architecture pruning
from prunopt.train.methods import ap, ds  # noqa: E402,F401
