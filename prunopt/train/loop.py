"""Training-loop helpers shared by every ``prunopt train`` method."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
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


def _temporary_file(folder: str, suffix: str = ""):
    """A new file ``.tmp-<random><suffix>`` in ``folder``, open for binary
    writing: ``(file, path)``. Created like ``open(path, "xb")``, so it gets the
    usual ``0o666 & ~umask`` permissions (``tempfile.mkstemp`` makes 0600 files,
    which would stay 0600 after the rename)."""
    for _ in range(100):
        path = os.path.join(folder, f".tmp-{secrets.token_hex(8)}{suffix}")
        try:
            return open(path, "xb"), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary file name in {folder}")


def atomic_write_bytes(write: Callable, path: str, suffix: str = "") -> None:
    """Calls ``write(file)`` on a temporary file in ``path``'s folder (created
    if needed), flushes it to disk and renames it to ``path``: readers see the
    old file or the whole new one, never a part. The temporary file is removed
    if ``write`` fails or the process is interrupted."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    f, tmp = _temporary_file(folder, suffix)
    try:
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_save(obj, path: str) -> None:
    """``torch.save(obj)`` to ``path`` atomically (:func:`atomic_write_bytes`)."""
    atomic_write_bytes(lambda f: torch.save(obj, f), path, ".pt")


def atomic_write_text(text: str, path: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write_bytes`)."""
    atomic_write_bytes(lambda f: f.write(text.encode("utf-8")), path)


def save_history_plot(history: dict, path: str, title: str, summary: Optional["Summary"] = None) -> None:
    """``history.png``: the job's phases (e.g. dense, masked, fine-tune) one
    after the other on one epoch axis, their boundaries marked and named, the
    test accuracy on the left axis and the densities (fraction of prunable
    weights kept) on a second axis; the final pruned accuracy and density of
    ``summary`` are marked after the last epoch. ``history`` is
    :attr:`prunopt.train.job.Job.history`: ``{"phases": [{"name", "first"}],
    "epochs": [{"epoch", "phase", <series>: value}]}``; a series whose name
    contains ``density`` goes on the right axis. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    records = history.get("epochs", [])
    phases = history.get("phases", [])
    last = max([r["epoch"] for r in records] + [p["first"] - 1 for p in phases] + [0])
    series = []
    for r in records:
        series += [k for k in r if k not in ("epoch", "phase") and k not in series]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    right = ax.twinx()
    handles = []
    colours = iter(["C0", "C3", "C4", "C5", "C6"])
    dens_colours = iter(["C1", "C2", "C8", "C9", "C7"])
    epochs = sorted({r["epoch"] for r in records})
    for name in series:
        # one point per epoch, NaN where the series was not recorded: a gap, not a line across a phase
        by_epoch = {r["epoch"]: r[name] for r in records if name in r}
        ys = [by_epoch.get(e, float("nan")) for e in epochs]
        is_density = "density" in name
        axis = right if is_density else ax
        style = dict(color=next(dens_colours), ls="--", marker=".") if is_density else dict(color=next(colours), marker="o", ms=3)
        handles += axis.plot(epochs, ys, label=name, **style)
    # phase boundaries and names on the shared epoch axis
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for i, ph in enumerate(phases):
        end = phases[i + 1]["first"] - 1 if i + 1 < len(phases) else last
        lo, hi = ph["first"] - 0.5, end + 0.5
        if i % 2:
            ax.axvspan(lo, hi, color="0.93", zorder=0)
        if i:
            ax.axvline(lo, color="0.45", ls=":", lw=1)
        if hi > lo:
            ax.text((lo + hi) / 2, 1.01, ph["name"], transform=top, ha="center", va="bottom", fontsize=8)
    if summary is not None:
        x = last + 1
        ax.axvline(last + 0.5, color="0.45", ls=":", lw=1)
        ax.text(x, 1.01, "final", transform=top, ha="center", va="bottom", fontsize=8)
        handles += ax.plot([x - 0.1], [summary.pruned_acc], marker="*", ms=14, ls="", color="C3",
                           label=f"final pruned accuracy {summary.pruned_acc:.4f}")
        handles += right.plot([x + 0.1], [summary.density], marker="D", ms=7, ls="", color="C1",
                              label=f"final density {summary.density:.4f}")
        ax.axhline(summary.pruned_acc, color="C3", lw=0.8, ls=(0, (1, 3)))
    ax.set_xlim(0.5, (last + 1.5) if summary is not None else max(last, 1) + 0.5)
    ax.set_ylim(0.0, 1.02)
    right.set_ylim(0.0, 1.02)
    ax.set_xlabel("epoch (phases in sequence)")
    ax.set_ylabel("test accuracy")
    right.set_ylabel("density (fraction of prunable weights kept)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title, pad=16)
    ax.grid(alpha=0.3)
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8,
                  frameon=False)
    try:
        atomic_write_bytes(lambda f: fig.savefig(f, format="png", dpi=100, bbox_inches="tight"), path, ".png")
    finally:
        plt.close(fig)


def write_outputs(out_dir: Optional[str], summary: Summary, state: dict, history: dict) -> None:
    """Writes a run's files into ``out_dir`` (each atomically): ``checkpoint.pt``
    (``state``), ``summary.json`` and ``history.png`` (:func:`save_history_plot`).
    ``prunopt train`` calls it on the run's staging directory, which is renamed
    to ``--out`` once everything is written (:mod:`prunopt.train.output`)."""
    if not out_dir:
        return
    atomic_save(state, os.path.join(out_dir, "checkpoint.pt"))
    atomic_write_text(json.dumps(summary.to_dict(), indent=2) + "\n", os.path.join(out_dir, "summary.json"))
    if history:
        title = f"{summary.method}: pruned accuracy {summary.pruned_acc:.4f} at density {summary.density:.4f}"
        save_history_plot(history, os.path.join(out_dir, "history.png"), title, summary)
