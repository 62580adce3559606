"""Pruning methods (paper Sec. 5, App. G; Wimmer et al.), each a small object that
works beside any optimizer, for spatial weights (SP) and FB coefficients (IP)
alike (they only see the :class:`~prunopt.pruning.Masker`'s tensors).

The contract, as for LR schedulers: build the method after the optimizer, then
call ``method.step()`` once after every ``optimizer.step()``.  ``step()``
re-imposes the masks (parameters and optimizer state, see
:class:`~prunopt.pruning.Masker`), advances ``last_step`` and changes the masks
when the method's schedule says so.  ``state_dict()`` / ``load_state_dict()``
hold the counters (and, for :class:`LotteryTicket`, the ``t0`` rewind
snapshot); the masks are in the masker's state dict.

* :class:`PruningAtInit` — random, SNIP, GraSP, SynFlow (App. G.4), one shot
  (SynFlow: 100 rounds with A.81).
* :class:`LotteryTicket` — iterative magnitude pruning with rewinding to ``t0``
  (App. G.2, A.75).
* :class:`DynamicSparseTraining` — SET and RigL (App. G.3, A.76-A.77).
* :class:`GradualMagnitudePruning` — cubic schedule (App. G.5, A.82).
* :class:`FineTuning` — one-shot magnitude pruning of a trained model (App. G.6).
"""
from __future__ import annotations

import copy
import math
import numbers
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prunopt.pruning import _dist
from prunopt.pruning.masks import Masker
from prunopt.validation import SIZE_MAX, check_bool, check_real, check_str_list
from prunopt.pruning.scores import _batches, grasp_scores, magnitude_scores, random_scores, snip_scores, synflow_scores
from prunopt.pruning.selection import (
    check_sparsity,
    erk_counts,
    global_masks,
    kept_count,
    layerwise_masks,
)

__all__ = [
    "PruningMethod",
    "PruningAtInit",
    "LotteryTicket",
    "DynamicSparseTraining",
    "GradualMagnitudePruning",
    "FineTuning",
    "magnitude_prune",
    "synflow_prune",
    "gmp_sparsity",
    "cosine_drop_fraction",
    "lottery_ticket_trainings",
]


def _check_masker(masker) -> Masker:
    if not isinstance(masker, Masker):
        raise TypeError(f"masker must be a prunopt.pruning.Masker, got {type(masker).__name__}")
    return masker


def _shared_generator(generator: Optional[torch.Generator], group) -> torch.Generator:
    """The generator of a method's random choices, in the same state on every
    rank: ``generator`` or, when ``None``, a new CPU generator seeded with one
    draw from torch's global generator (so ``torch.manual_seed`` reproduces a
    run); under a process group its state is then set to that of the group's
    first rank (one broadcast), so per-rank seeds do not matter."""
    if generator is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator().manual_seed(seed)
    elif not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    _dist.broadcast_generator_(generator, group)
    return generator


def _check_generator_state(state, generator: torch.Generator) -> Tensor:
    """``ValueError`` unless ``state`` is a state ``generator`` accepts (tried on a fresh one)."""
    if not isinstance(state, Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise ValueError("state['generator'] must be the uint8 tensor of torch.Generator.get_state()")
    try:
        torch.Generator(device=generator.device).set_state(state)
    except RuntimeError as e:
        raise ValueError(f"state['generator'] is not a state of a {generator.device} generator: {e}") from None
    return state


def _check_int(v, name: str, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


class PruningMethod:
    """Base class: ``step()`` after every optimizer step, ``last_step`` counts
    them, ``state_dict()``/``load_state_dict()`` round-trip the counters."""

    _state_keys: Tuple[str, ...] = ("last_step",)

    def __init__(self, masker: Masker):
        self.masker = _check_masker(masker)
        self.last_step = 0

    def step(self) -> None:
        """Re-impose the masks and advance ``last_step``."""
        self.masker.step()
        self.last_step += 1

    def state_dict(self) -> Dict[str, object]:
        """The counters (``last_step`` and method-specific ones); masks live in
        the masker's state dict."""
        return {k: copy.deepcopy(getattr(self, k)) for k in self._state_keys}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore counters saved by :meth:`state_dict`."""
        missing = [k for k in self._state_keys if k not in state]
        if missing:
            raise ValueError(f"state dict lacks {missing}")
        for k in self._state_keys:
            setattr(self, k, copy.deepcopy(state[k]))


# ------------------------------------------------------------- one-shot tools
def _select_keeping_pruned(scores: "OrderedDict[str, Tensor]", masks: "OrderedDict[str, Tensor]", p: float,
                           scope: str) -> "OrderedDict[str, Tensor]":
    """Masks keeping the ``floor((1-p) d)`` largest scores (globally or per layer)
    among the entries kept by ``masks``; pruned entries stay pruned.  Pruned
    entries score ``-inf``, so they rank last (selection's tie rule); the ones
    the count would still reach are dropped by ``& masks``: a model already
    sparser than ``p`` (overall, or in a layer for ``"layerwise"``) keeps its
    masks."""
    scores = OrderedDict((n, _dist.masked_fill(s, ~masks[n], float("-inf"))) for n, s in scores.items())
    new = global_masks(scores, p) if scope == "global" else layerwise_masks(scores, p)
    return OrderedDict((n, _dist.logical_and_full(m, masks[n])) for n, m in new.items())


def magnitude_prune(masker: Masker, sparsity: float, scope: str = "global", keep_pruned: bool = True) -> None:
    """Magnitude pruning (A.41/A.42): keep the ``floor((1-p) d)`` largest ``|w|``
    globally (A.39-A.40) or per layer (``scope="layerwise"``).

    With ``keep_pruned`` (the default) every already-pruned entry stays pruned
    and only kept entries compete, so the new sparsity is in effect
    ``max(current, p)`` (per layer with ``"layerwise"``): pruning an 80 %-sparse
    model to ``p = 0.5`` changes nothing.  With ``keep_pruned=False`` the masks
    are recomputed from ``|w * mu|`` over all entries (pruned entries score 0,
    ties favour the earlier entry) and pruned entries may come back (at 0)."""
    _check_masker(masker)
    p = check_sparsity(sparsity)
    if scope not in ("global", "layerwise"):
        raise ValueError(f"scope must be 'global' or 'layerwise', got {scope!r}")
    keep_pruned = check_bool(keep_pruned, "keep_pruned")
    scores = magnitude_scores(masker)
    if keep_pruned:
        new = _select_keeping_pruned(scores, masker.masks(), p, scope)
    else:
        new = global_masks(scores, p) if scope == "global" else layerwise_masks(scores, p)
    masker.set_masks(new)


def synflow_prune(masker: Masker, sparsity: float, example_input, rounds: int = 100) -> None:
    """Iterative SynFlow (App. G.4): for ``k = 1..rounds`` compute the SynFlow
    scores of the currently masked network and keep the largest so that the
    pruning rate is ``p_k = 1 - (1 - p)^(k / rounds)`` (A.81); pruned entries
    are never revived (a masker already sparser than ``p_k`` keeps its masks
    in that round)."""
    _check_masker(masker)
    p = check_sparsity(sparsity)
    _check_int(rounds, "rounds", 1)
    for k in range(1, rounds + 1):
        p_k = 1.0 - (1.0 - p) ** (k / rounds)
        if k == rounds:
            p_k = p
        scores = synflow_scores(masker, example_input)
        masker.set_masks(_select_keeping_pruned(scores, masker.masks(), p_k, "global"))


class PruningAtInit(PruningMethod):
    """Pruning at initialisation (App. G.4): score once, prune globally
    (A.39-A.40), then train with fixed masks.

    ``score`` is ``"random"`` (F.2), ``"magnitude"`` (F.3), ``"snip"`` (F.5),
    ``"grasp"`` (F.6, ranked by ``-S``, i.e. keeping the largest ``(H g) w`` as
    GraSP's code does) or ``"synflow"`` (F.4, iterative with A.81).  SNIP and
    GraSP need ``batches`` (BatchNorm in train mode, the paper uses 100 batches
    on CIFAR-10; a single ``(inputs, targets)`` pair is one batch); SynFlow
    needs ``example_input``, or takes the inputs of the first batch.

    Random scores are drawn from ``generator`` or, when ``None``, from a CPU
    generator seeded with one draw from torch's global generator; under a
    process group its state is set to the first rank's at construction, so
    every rank draws the same scores (``docs/distributed.md``).

    Example::

        pai = PruningAtInit(Masker(model, opt), "snip", sparsity=0.9)
        pai.prune(batches=[(x, y)])
        ... optimizer.step(); pai.step()
    """

    SCORES = ("random", "magnitude", "snip", "grasp", "synflow")

    def __init__(self, masker: Masker, score: str, sparsity: float, synflow_rounds: int = 100,
                 generator: Optional[torch.Generator] = None, loss_fn=F.cross_entropy):
        super().__init__(masker)
        if score not in self.SCORES:
            raise ValueError(f"score must be one of {self.SCORES}, got {score!r}")
        self.score = score
        self.sparsity = check_sparsity(sparsity)
        self.synflow_rounds = _check_int(synflow_rounds, "synflow_rounds", 1)
        # random scores: one generator in the same state on every rank (broadcast from the first rank at
        # construction; ``generator=None``: a new one seeded from torch's global generator)
        self.generator = _shared_generator(generator, masker.group()) if score == "random" else generator
        self.loss_fn = loss_fn

    def state_dict(self) -> Dict[str, object]:
        """``last_step`` and, for random scores, ``generator`` (the state of
        the generator the scores are drawn from)."""
        state = super().state_dict()
        if self.score == "random":
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore :meth:`state_dict` (a missing ``generator`` keeps the
        current state); checked before anything changes."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        gen = state.get("generator") if self.score == "random" else None
        if gen is not None:
            _check_generator_state(gen, self.generator)
        super().load_state_dict(state)
        if gen is not None:
            self.generator.set_state(gen.clone())

    def prune(self, batches=None, example_input=None) -> None:
        """Compute the scores and set the masks (one shot; SynFlow iterative).
        Works under ``torch.no_grad()`` (the scores enable autograd themselves)."""
        m = self.masker
        if self.score == "synflow":
            if example_input is None:
                if batches is None:
                    raise ValueError("synflow needs example_input (or batches to take the input shape from)")
                example_input = _batches(batches)[0][0]  # the inputs of the first (inputs, targets) batch
            synflow_prune(m, self.sparsity, example_input, self.synflow_rounds)
            return
        if self.score in ("snip", "grasp") and batches is None:
            raise ValueError(f"{self.score} needs batches of (inputs, targets)")
        if self.score == "random":
            s = random_scores(m, self.generator)
        elif self.score == "magnitude":
            s = magnitude_scores(m)
        elif self.score == "snip":
            s = snip_scores(m, batches, self.loss_fn)
        else:
            s = OrderedDict((n, -v) for n, v in grasp_scores(m, batches, self.loss_fn).items())
        m.set_masks(global_masks(s, self.sparsity))


class FineTuning(PruningMethod):
    """Fine-tuning (App. G.6): one-shot global magnitude pruning (A.41/A.42,
    A.39-A.40) of a trained dense model, then training of the sparse model with
    the dense schedule (Renda et al. [68]: start with the high learning rate)."""

    def __init__(self, masker: Masker, sparsity: float, scope: str = "global"):
        super().__init__(masker)
        self.sparsity = check_sparsity(sparsity)
        if scope not in ("global", "layerwise"):
            raise ValueError(f"scope must be 'global' or 'layerwise', got {scope!r}")
        self.scope = scope

    def prune(self) -> None:
        magnitude_prune(self.masker, self.sparsity, self.scope)


def gmp_sparsity(t: int, sparsity: float, t0: int, t1: int) -> float:
    """Cubic schedule (A.82): 0 for ``t < t0``;
    ``p (1 - (1 - (t - t0)/(t1 - t0))^3)`` for ``t0 <= t <= t1``; ``p`` for
    ``t > t1`` (A.82 prints 1 there, which contradicts "p is the final pruning
    rate"; Zhu & Gupta's schedule holds ``p``).

    ``t``, ``t0`` and ``t1`` are ints >= 0 with ``t1 >= t0``; otherwise
    ``TypeError``/``ValueError`` naming the argument."""
    p = check_sparsity(sparsity)
    _check_int(t, "t", 0)
    _check_int(t0, "t0", 0)
    _check_int(t1, "t1", 0)
    if t1 < t0:
        raise ValueError(f"t1 must be >= t0, got t0={t0}, t1={t1}")
    if t < t0:
        return 0.0
    if t > t1:
        return p
    if t1 == t0:
        return p
    return p * (1.0 - (1.0 - (t - t0) / (t1 - t0)) ** 3)


class GradualMagnitudePruning(PruningMethod):
    """Gradual magnitude pruning (App. G.5, Zhu & Gupta / Gale et al. [21]).

    Every ``interval`` (N) optimizer steps, at ``t = k N``, the target rate
    ``p(t)`` of A.82 (:func:`gmp_sparsity`) is imposed by magnitude: the
    ``floor((1 - p(t)) d)`` largest ``|w|`` are kept, globally (the paper's
    reading: "the ``p(kN) d`` weights with smallest magnitude") or per layer.
    Pruned weights stay pruned (:func:`magnitude_prune` with ``keep_pruned``):
    the schedule starts from the masker's real sparsity at construction
    (``current_sparsity``; for ``"layerwise"`` the smallest layer sparsity), so
    a masker already sparser than ``p(t)`` is left alone until ``p(t)``
    exceeds it.  ``current_sparsity`` is the rate reached so far."""

    def __init__(self, masker: Masker, sparsity: float, t0: int, t1: int, interval: int, scope: str = "global"):
        super().__init__(masker)
        self.sparsity = check_sparsity(sparsity)
        _check_int(t0, "t0", 0)
        _check_int(t1, "t1", 0)
        if t1 < t0:
            raise ValueError(f"t1 must be >= t0, got t0={t0}, t1={t1}")
        self.t0, self.t1 = t0, t1
        self.interval = _check_int(interval, "interval", 1)
        if scope not in ("global", "layerwise"):
            raise ValueError(f"scope must be 'global' or 'layerwise', got {scope!r}")
        self.scope = scope
        self.current_sparsity = self._reached()

    _state_keys = ("last_step", "current_sparsity")

    def _reached(self) -> float:
        """The rate the masker already has (per layer: the least sparse layer)."""
        m = self.masker
        if self.scope == "global":
            return m.sparsity() if any(pt.parameter.numel() for pt in m.tensors.values()) else 0.0
        counts = m.counts()
        rates = [1.0 - counts[n] / pt.parameter.numel() for n, pt in m.tensors.items() if pt.parameter.numel()]
        return min(rates, default=0.0)

    def step(self) -> None:
        super().step()
        t = self.last_step
        if t % self.interval == 0 and t >= self.t0:
            p_t = gmp_sparsity(t, self.sparsity, self.t0, self.t1)
            if p_t > self.current_sparsity:
                magnitude_prune(self.masker, p_t, self.scope, keep_pruned=True)
                self.current_sparsity = max(p_t, self._reached())


def lottery_ticket_trainings(sparsity: float, rate: float = 0.2) -> int:
    """Number of trainings for a lottery ticket of sparsity ``p`` when each round
    prunes ``rate`` of the remaining weights: ``1 + ceil(log(1-p) / log(1-rate))``
    (A.75 for ``rate = 0.2``: ``log 4 - log 5 = log 0.8``)."""
    p = check_sparsity(sparsity)
    rate = check_real(rate, "rate")
    if not 0.0 < rate < 1.0:
        raise ValueError(f"rate must be in (0, 1), got {rate}")
    if p == 0.0:
        return 1
    if p == 1.0:
        raise ValueError("sparsity 1 cannot be reached by pruning a fraction of the remaining weights")
    return 1 + math.ceil(math.log(1.0 - p) / math.log(1.0 - rate) - 1e-12)


class LotteryTicket(PruningMethod):
    """Lottery tickets with rewinding (Frankle et al. [19], App. G.2).

    Call :meth:`step` after every optimizer step (and after the LR scheduler's
    ``step()`` when it is stepped per iteration); at ``last_step == t0`` the
    model's full state (weights, FBs, BatchNorm statistics), the optimizer's and
    the LR scheduler's state dicts are saved (``t0 = 0``: at construction).
    After training to convergence call :meth:`prune_and_rewind`: the 20 % (``rate``)
    smallest-magnitude remaining weights are pruned globally — fewer in the last
    round, to hit ``sparsity`` exactly — and model, optimizer, scheduler and
    ``last_step`` are rewound to ``t0`` while the new masks stay.  The number of
    trainings is A.75 (:func:`lottery_ticket_trainings`).  Tensors in ``dense``
    (default: the last prunable tensor when it is a Linear layer, i.e. the
    classifier) are never pruned; ``sparsity`` refers to the others, and a
    ``ValueError`` is raised at construction when there are none (e.g. a model
    whose only prunable layer is its classifier: pass ``dense=[]``)."""

    def __init__(self, masker: Masker, optimizer: torch.optim.Optimizer, sparsity: float, t0: int = 0,
                 scheduler=None, rate: float = 0.2, dense: Optional[Sequence[str]] = None):
        super().__init__(masker)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sparsity = check_sparsity(sparsity)
        if self.sparsity == 1.0:
            raise ValueError("sparsity must be < 1 for lottery tickets")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 < rate < 1.0:
            raise ValueError(f"rate must be in (0, 1), got {rate!r}")
        self.rate = float(rate)
        self.t0 = _check_int(t0, "t0", 0)
        if dense is None:
            last = list(masker.tensors.values())[-1]
            dense = [last.name] if isinstance(last.module, nn.Linear) else []
        elif isinstance(dense, str):
            raise TypeError("dense must be a sequence of layer names, not a string")
        else:
            dense = check_str_list(dense, "dense")
        self.dense = [masker[n].name for n in dense]  # validates names
        if sum(masker[n].parameter.numel() for n in self.prunable) == 0:
            raise ValueError(
                f"nothing to prune: every masked tensor is in dense={self.dense} (or empty); the default dense "
                "is the last tensor when it is a Linear layer (the classifier): pass dense=[] to prune it as well"
            )
        masker.attach(optimizer)
        self.rounds_done = 0
        self._snapshot = None
        if self.t0 == 0:
            self._save()

    _state_keys = ("last_step", "rounds_done")

    def state_dict(self) -> Dict[str, object]:
        """``last_step``, ``rounds_done`` and ``t0_state``: the rewind snapshot
        ``{"model", "optimizer", "scheduler"}`` (the three state dicts at
        ``t0``, tensors and plain containers that ``torch.save`` handles), or
        ``None`` before ``t0``.  A run resumed from it (model, optimizer,
        scheduler, masker and this state loaded into rebuilt objects) rewinds
        to the same ``t0`` weights as an uninterrupted one."""
        state = super().state_dict()
        state["t0_state"] = copy.deepcopy(self._snapshot)
        return state

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore :meth:`state_dict` (counters and the ``t0`` snapshot).
        ``t0_state`` may be absent only for a state saved before ``t0`` (then
        :meth:`step` takes the snapshot at ``t0``).  Everything is checked
        before anything changes: a snapshot whose model keys differ from the
        model's, or whose scheduler state does not match ``scheduler``, is a
        ``ValueError``."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        missing = [k for k in self._state_keys if k not in state]
        if missing:
            raise ValueError(f"state dict lacks {missing}")
        last_step = _check_int(state["last_step"], "state['last_step']", 0)
        snap = state.get("t0_state")
        if snap is None:
            if last_step >= self.t0:
                raise ValueError(f"state dict lacks 't0_state' (the rewind snapshot) but was saved at step "
                                 f"{last_step} >= t0={self.t0}: the run cannot be rewound")
        else:
            if not isinstance(snap, dict) or set(snap) != {"model", "optimizer", "scheduler"}:
                raise ValueError("state['t0_state'] must be a dict with keys 'model', 'optimizer', 'scheduler'")
            want = set(self.masker.model.state_dict())
            have = set(snap["model"])
            if want != have:
                raise ValueError(f"state['t0_state']['model'] does not fit the model: missing {sorted(want - have)}, "
                                 f"unexpected {sorted(have - want)}")
            if (snap["scheduler"] is None) != (self.scheduler is None):
                raise ValueError("state['t0_state'] has a scheduler state but this LotteryTicket has no scheduler"
                                 if self.scheduler is None else
                                 "state['t0_state'] has no scheduler state but this LotteryTicket has a scheduler")
        super().load_state_dict(state)
        self._snapshot = copy.deepcopy(snap)

    def _save(self) -> None:
        self._snapshot = {
            "model": copy.deepcopy(self.masker.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": None if self.scheduler is None else copy.deepcopy(self.scheduler.state_dict()),
        }

    def step(self) -> None:
        super().step()
        if self.last_step == self.t0 and self._snapshot is None:
            self._save()

    @property
    def prunable(self) -> List[str]:
        """Names of the tensors lottery-ticket rounds prune (all but ``dense``)."""
        return [n for n in self.masker.tensors if n not in self.dense]

    def current_sparsity(self) -> float:
        """Pruning rate over the non-dense tensors."""
        counts = self.masker.counts()
        total = sum(self.masker[n].parameter.numel() for n in self.prunable)
        return 1.0 - sum(counts[n] for n in self.prunable) / total

    @property
    def done(self) -> bool:
        """True once the target sparsity is reached (then train a final time)."""
        total = sum(self.masker[n].parameter.numel() for n in self.prunable)
        kept = sum(self.masker.counts()[n] for n in self.prunable)
        return kept <= kept_count(self.sparsity, total)

    def prune_and_rewind(self) -> float:
        """One LT round: prune ``rate`` of the remaining weights by magnitude, then
        rewind everything to ``t0``.  Returns the new sparsity."""
        if self._snapshot is None:
            raise RuntimeError(f"no t0 state yet: step() has been called {self.last_step} times, t0={self.t0}")
        m = self.masker
        names = self.prunable
        masks = m.masks()
        total = sum(masks[n].numel() for n in names)
        kept = sum(int(masks[n].sum()) for n in names)
        target = max(kept_count(self.sparsity, total), math.floor((1.0 - self.rate) * kept + 1e-9))
        scores = magnitude_scores(m)
        scores = OrderedDict((n, _dist.masked_fill(scores[n], ~masks[n], float("-inf"))) for n in names)
        new = global_masks(scores, 1.0 - target / total)
        # rewind, then impose the new masks (the t0 snapshot carries t0's masks)
        m.model.load_state_dict(self._snapshot["model"])
        self.optimizer.load_state_dict(copy.deepcopy(self._snapshot["optimizer"]))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(self._snapshot["scheduler"]))
        full = OrderedDict((n, masks[n]) for n in self.dense)
        full.update(new)
        m.set_masks(full)
        self.last_step = self.t0
        self.rounds_done += 1
        return self.current_sparsity()


def cosine_drop_fraction(t: int, total_steps: int, p_init: float = 0.5, p_min: float = 0.005) -> float:
    """Drop fraction of DST (A.77): ``p_t = p_min + (p_init - p_min)(1 + cos(pi t / T)) / 2``.

    ``total_steps`` (``T``) is an int >= 1 and ``t`` a finite number >= 0;
    otherwise ``TypeError``/``ValueError`` naming the argument."""
    total_steps = _check_int(total_steps, "total_steps", 1)
    if total_steps > SIZE_MAX:
        raise ValueError(f"total_steps must be at most {SIZE_MAX}, got {total_steps}")
    if isinstance(t, bool) or not isinstance(t, numbers.Real):
        raise TypeError(f"t must be a real number, got {type(t).__name__}")
    t = check_real(t, "t", 0.0)
    p_init, p_min = check_sparsity(p_init, "p_init"), check_sparsity(p_min, "p_min")
    return p_min + 0.5 * (p_init - p_min) * (1.0 + math.cos(math.pi * t / total_steps))


class DynamicSparseTraining(PruningMethod):
    """SET (Mocanu et al. [55]) and RigL (Evci et al. [17]), paper App. G.3.

    At construction the masks are random with Erdős–Rényi-kernel layer counts
    (A.76, :func:`~prunopt.pruning.erk_counts`).  The counts refer to the
    tensors actually masked: an FB layer gets the ERK score of its spatial
    weight ``(C_out, C_in/groups, kh, kw)`` (so SP and IP have the same layer
    densities) applied to its ``C_out C_in/groups N`` coefficients
    (``numels=``), hence ``sum_l count_l = floor((1-p) d)`` over the masked
    entries also for a dictionary of ``N != kh kw`` elements.  Every
    ``update_interval`` steps (1500 for SET, 4000 for RigL in the paper) while
    ``t < total_steps``, in every layer ``n_drop = floor(p_t n_l)`` of its
    ``n_l`` active weights are dropped (smallest ``|w|``) and as many weights
    that were inactive before the update are grown — at random (SET) or with
    the largest dense-gradient magnitude ``|dL/dw|`` (RigL); ``p_t`` is A.77.
    Grown weights start at 0 with zero optimizer state; every layer keeps
    exactly its count.

    RigL needs the dense gradient: pass ``closure`` (returning the loss of a
    batch, forward only) to :meth:`step`; it is evaluated on update steps only,
    through :meth:`Masker.dense_gradients`.

    The random choices (initial masks, SET's regrowth) come from
    ``generator``, or, when ``None``, from a CPU generator seeded with one
    draw from torch's global generator.  Under a process group (DDP, FSDP2)
    its state is set at construction to that of the first rank, so every rank
    draws the same numbers whatever its seed; :meth:`state_dict` carries the
    state (``"generator"``), so a resumed run draws what an uninterrupted one
    would.  RigL's dense gradient is averaged over the ranks
    (:meth:`Masker.dense_gradients`); every selection is exact over the
    global tensors also when sharded (``docs/distributed.md``).  Masks are
    therefore the same on every rank at every step, and equal to those of one
    process that sees every rank's batch."""

    def __init__(self, masker: Masker, sparsity: float, total_steps: int, mode: str = "set",
                 update_interval: Optional[int] = None, p_init: float = 0.5, p_min: float = 0.005,
                 generator: Optional[torch.Generator] = None):
        super().__init__(masker)
        if mode not in ("set", "rigl"):
            raise ValueError(f"mode must be 'set' or 'rigl', got {mode!r}")
        self.mode = mode
        self.sparsity = check_sparsity(sparsity)
        self.total_steps = _check_int(total_steps, "total_steps", 1)
        if update_interval is None:
            update_interval = 1500 if mode == "set" else 4000
        self.update_interval = _check_int(update_interval, "update_interval", 1)
        check_sparsity(p_init, "p_init")
        check_sparsity(p_min, "p_min")
        self.p_init, self.p_min = float(p_init), float(p_min)
        shapes = OrderedDict((n, pt.spatial_shape) for n, pt in masker.tensors.items())
        numels = OrderedDict((n, pt.parameter.numel()) for n, pt in masker.tensors.items())
        self.layer_counts = erk_counts(shapes, 1.0 - self.sparsity, numels=numels)
        self.generator = _shared_generator(generator, masker.group())
        scores = random_scores(masker, self.generator)
        masks = OrderedDict((n, _dist.top_k_masks([s], self.layer_counts[n])[0]) for n, s in scores.items())
        masker.set_masks(masks)
        self.updates = 0

    _state_keys = ("last_step", "updates")

    def state_dict(self) -> Dict[str, object]:
        """``last_step``, ``updates`` and ``generator``: the state of the
        generator of the random choices (``torch.Generator.get_state()``), so
        a resumed SET run regrows what an uninterrupted one would."""
        state = super().state_dict()
        state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore :meth:`state_dict`; a state without ``generator`` (saved
        before it was recorded) keeps the current generator state.  Checked
        before anything changes."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        gen = state.get("generator")
        if gen is not None:
            _check_generator_state(gen, self.generator)
        super().load_state_dict(state)
        if gen is not None:
            self.generator.set_state(gen.clone())

    def drop_fraction(self, t: Optional[int] = None) -> float:
        """``p_t`` of A.77 at step ``t`` (default: ``last_step``)."""
        return cosine_drop_fraction(self.last_step if t is None else t, self.total_steps, self.p_init, self.p_min)

    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> None:
        """Re-impose the masks, advance ``last_step`` and, on update steps, drop
        and grow (:meth:`update`).  RigL without ``closure`` on an update step
        raises ``ValueError`` before anything changes; if the update itself
        fails (e.g. a bad closure), ``last_step`` is restored, so the step can
        be retried."""
        t = self.last_step + 1
        due = t % self.update_interval == 0 and t < self.total_steps
        if due and self.mode == "rigl" and closure is None:
            raise ValueError(f"RigL needs closure= (a function returning the loss of one batch) on update steps "
                             f"(step {t} is one)")
        super().step()
        if due:
            try:
                self.update(closure)
            except BaseException:
                self.last_step = t - 1
                raise

    def update(self, closure: Optional[Callable[[], Tensor]] = None) -> None:
        """One drop-and-grow update of every layer at drop fraction ``p_t`` (A.77)."""
        m = self.masker
        if self.mode == "rigl":
            if closure is None:
                raise ValueError("RigL needs closure= (a function returning the loss of one batch) on update steps")
            grow_scores = OrderedDict((n, g.abs()) for n, g in m.dense_gradients(closure).items())
        else:
            grow_scores = random_scores(m, self.generator)
        p_t = self.drop_fraction()
        masks = m.masks()
        mags = magnitude_scores(m)
        new = OrderedDict()
        for n, mask in masks.items():
            active = int(mask.sum())
            n_drop = min(math.floor(p_t * active), mask.numel() - active)
            if n_drop <= 0:
                continue
            # drop the smallest |w| among the active, grow the largest scores among the inactive
            kept = _dist.top_k_masks([_dist.masked_fill(mags[n], ~mask, float("-inf"))], active - n_drop)[0]
            grown = _dist.top_k_masks([_dist.masked_fill(grow_scores[n], mask, float("-inf"))], n_drop)[0]
            new[n] = _dist.logical_or(kept, grown)
        if new:
            m.set_masks(new)  # zeroes the dropped weights; grown ones are already 0
        self.updates += 1
