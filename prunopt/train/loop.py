"""Training-loop helpers shared by every ``prunopt train`` method."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def iterate_minibatches(x: Tensor, y: Tensor, batch_size: int, generator: torch.Generator) -> Iterator[Tuple[Tensor, Tensor]]:
    perm = torch.randperm(len(y), generator=generator)
    for i in range(0, len(y), batch_size):
        idx = perm[i : i + batch_size]
        yield x[idx], y[idx]


class OptimizerGroup:
    """Several optimizers stepped as one (``train_epoch`` takes one optimizer),
    e.g. SGD for the weights and Adam for the DS gate thresholds."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        if not optimizers:
            raise ValueError("OptimizerGroup needs at least one optimizer")
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        states = state["optimizers"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"state has {len(states)} optimizers, this group has {len(self.optimizers)}")
        for o, st in zip(self.optimizers, states):
            o.load_state_dict(st)


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: Tensor,
    y: Tensor,
    batch_size: int,
    generator: torch.Generator,
    loss_extra: Optional[Callable[[], Tensor]] = None,
    after_step: Optional[Callable[[], None]] = None,
) -> float:
    """One epoch of cross-entropy training; returns the mean loss.
    ``loss_extra()`` is added to the loss (regularisers); ``after_step()`` runs
    after every optimizer step (projections, masks, schedules)."""
    model.train()
    total, count = 0.0, 0
    for xb, yb in iterate_minibatches(x, y, batch_size, generator):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        if loss_extra is not None:
            loss = loss + loss_extra()
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step()
        total += loss.item() * len(yb)
        count += len(yb)
    return total / max(count, 1)


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 512) -> float:
    """Top-1 accuracy as a fraction."""
    model.eval()
    correct = 0
    for i in range(0, len(y), batch_size):
        correct += (model(x[i : i + batch_size]).argmax(1) == y[i : i + batch_size]).sum().item()
    return correct / max(len(y), 1)


def progress(iterable, desc: str, enabled: bool = True):
    """A tqdm progress bar on stderr (plain iteration when disabled)."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


@dataclass
class Summary:
    """The result of a training job. ``density`` is the fraction of prunable
    weights that are non-zero in the final model; ``sparsity = 1 - density``."""

    method: str
    dense_acc: float
    pruned_acc: float
    density: float
    extra: dict = field(default_factory=dict)

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density

    def line(self) -> str:
        """The final, script-readable summary line."""
        fields = [
            f"method={self.method}",
            f"dense_acc={self.dense_acc:.4f}",
            f"pruned_acc={self.pruned_acc:.4f}",
            f"density={self.density:.4f}",
            f"sparsity={self.sparsity:.4f}",
        ]
        fields += [f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in self.extra.items()]
        return "summary: " + " ".join(fields)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sparsity"] = self.sparsity
        return d


def atomic_save(obj, path: str) -> None:
    """torch.save to a temporary file in the same folder, then rename."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pt")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(text: str, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def save_history_plot(history: dict, path: str, title: str) -> None:
    """A PNG of every series in ``history`` (each a list over epochs), written
    atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in history.items():
        ax.plot(range(1, len(values) + 1), values, label=name)
    ax.set_xlabel("epoch")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=100, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def write_outputs(out_dir: Optional[str], summary: Summary, state: dict, history: dict) -> None:
    """``--out DIR``: checkpoint.pt, summary.json and history.png, each written atomically."""
    if not out_dir:
        return
    atomic_save(state, os.path.join(out_dir, "checkpoint.pt"))
    atomic_write_text(json.dumps(summary.to_dict(), indent=2), os.path.join(out_dir, "summary.json"))
    if history:
        save_history_plot(history, os.path.join(out_dir, "history.png"), summary.method)
