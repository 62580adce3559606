"""Registry of ``prunopt repro NAME`` paper reproductions.

A reproduction module calls :func:`register_repro` at import and is imported at
the bottom of this file; ``run(args)`` gets the parsed namespace (``out``,
``seed``, ``seeds``, ``threads``, ``quick``, ``progress`` and its own options),
prints its claims table (:class:`prunopt.repro.report.Report`) and writes it to
``out``.
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


def add_repro_arguments(parser) -> None:
    """The options of ``prunopt repro``: the common ones, then every
    reproduction's own (``add_arguments``)."""
    from prunopt.train.args import positive_int_arg

    parser.add_argument("name", choices=sorted(REPROS) or ["(none)"])
    parser.add_argument("--out", default="runs/repro", help="folder for the NAME.md / NAME.json tables and the plots")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=positive_int_arg("--seeds"), default=None,
                        help="number of seeds (seed, seed+1, ...; default: the reproduction's)")
    parser.add_argument("--threads", type=positive_int_arg("--threads"), default=1,
                        help="torch intra-op threads (results are deterministic for a given seed and thread count)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a small version that runs in a few minutes")
    size.add_argument("--tiny", action="store_true",
                      help="a smoke-test size that runs in seconds (for tests; its numbers mean nothing)")
    parser.add_argument("--merge", default=None,
                        help="comma-separated folders of earlier runs of NAME made in pieces (other seeds or parts); "
                             "write their combined report to --out")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    for entry in REPROS.values():
        if entry.add_arguments is not None:
            entry.add_arguments(parser)


# Reproduction modules register themselves on import.
from prunopt.repro import prunadag  # noqa: E402,F401  (prunAdag: Table 2 and 4)
from prunopt.repro import interspace  # noqa: E402,F401  (Interspace Pruning: Theorem 1, SP vs IP)
from prunopt.repro import ap, ds  # noqa: E402,F401  (architecture pruning Fig. 1 / Table 1; DS Fig. 1-2)
