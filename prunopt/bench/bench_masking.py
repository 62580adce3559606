"""Per-step overhead of masked training (prunopt.pruning.Masker) against
unmasked training on a VGG-style CIFAR-shaped model (target <= 1.05x).

One training step = zero_grad, forward, cross-entropy, backward, SGD-momentum
step (weight decay 5e-4) and, for the masked contenders, ``masker.step()``:

* ``unmasked``: a plain model.
* ``masked``: every Conv2d/Linear weight masked through the ``WeightMask``
  parametrization (``w * mu`` in the forward pass, which also masks the
  gradient) at 90 % sparsity; ``masker.step()`` multiplies the weights and every
  per-element optimizer state tensor (the momentum buffers) by the masks
  (``zero_state_every_step=True``, the default).
* ``masked, state on update only``: the same with
  ``zero_state_every_step=False`` (state zeroed only when masks change — exact
  for SGD/Adam/Adagrad because masked gradients keep zero state at zero).

Verified before timing: after the timed steps every pruned weight and momentum
entry is exactly zero.  The machine is shared, so contenders are timed step by
step in alternation (rotating order): each round runs one step of every
contender; the median and the minimum over the rounds are reported, and the
ratio uses the medians.

    python -m bench.run --only masking [--quick]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import statistics
import time

from prunopt.bench.common import environment, write_results

CFG = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]  # VGG11


def vgg_cifar(width: float = 1.0, num_classes: int = 10) -> nn.Sequential:
    """VGG11 with BatchNorm for 3x32x32 inputs, channel widths scaled by ``width``."""
    layers, c = [], 3
    for v in CFG:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            o = max(8, int(v * width))
            layers += [nn.Conv2d(c, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]
            c = o
    layers += [nn.Flatten(), nn.Linear(c, num_classes)]
    return nn.Sequential(*layers)


def _setup(width, masked, zero_every_step, seed=0):
    from prunopt.pruning import Masker, global_masks, random_scores

    torch.manual_seed(seed)
    model = vgg_cifar(width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    masker = None
    if masked:
        masker = Masker(model, opt, zero_state_every_step=zero_every_step)
        masker.set_masks(global_masks(random_scores(masker, torch.Generator().manual_seed(0)), 0.9))
    return model, opt, masker


def _step_fn(model, opt, masker, x, y):
    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if masker is not None:
            masker.step()

    return step


def _verify(masker, opt) -> None:
    for n, pt in masker.tensors.items():
        pruned = ~pt.mask.bool()
        assert torch.count_nonzero(pt.parameter.detach()[pruned]) == 0, n
        buf = opt.state[pt.parameter].get("momentum_buffer")
        assert buf is not None and torch.count_nonzero(buf[pruned]) == 0, n


def run(quick: bool = False, threads: int = 2, out=None) -> str:
    torch.set_num_threads(threads)
    width, batch = (0.25, 32) if quick else (0.5, 64)
    rounds = 10 if quick else 30
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    contenders = {
        "unmasked": _setup(width, False, True),
        "masked": _setup(width, True, True),
        "masked, state on update only": _setup(width, True, False),
    }
    fns = {}
    for name, (model, opt, masker) in contenders.items():
        fns[name] = _step_fn(model, opt, masker, x, y)
        for _ in range(3):  # warm-up, creates the momentum buffers
            fns[name]()
        if masker is not None:
            _verify(masker, opt)
    names = list(fns)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - t)
    times = {name: statistics.median(v) for name, v in samples.items()}
    # the masking work alone (less noisy): masker.step() and the parametrized
    # weight computation w * mu of every layer, relative to an unmasked step
    model, opt, masker = contenders["masked"]
    iso = {"masker.step() alone": masker.step,
           "w * mu of all layers alone": lambda: [pt.effective() for pt in masker.tensors.values()]}
    for name, fn in iso.items():
        v = []
        for _ in range(rounds):
            t = time.perf_counter()
            fn()
            v.append(time.perf_counter() - t)
        samples[name] = v
        times[name] = statistics.median(v)
    for name, (model, opt, masker) in contenders.items():
        if masker is not None:
            _verify(masker, opt)
    nparams = sum(p.numel() for p in contenders["unmasked"][0].parameters())
    rows = []
    for name, t in times.items():
        rows.append({
            "contender": name,
            "model": f"VGG11-BN x{width} ({nparams / 1e6:.2f}M params), batch {batch}x3x32x32",
            "median ms/step": 1e3 * t,
            "min ms/step": 1e3 * min(samples[name]),
            "ratio vs unmasked": t / times["unmasked"],
        })
    notes = ("Per-step time of masked vs unmasked SGD-momentum training (90% global random masks). "
             f"Target <= 1.05x. {rounds} alternating rounds of one step per contender; ratio of medians.")
    return write_results("masking", rows, environment(threads), notes, out,
                         ["contender", "model", "median ms/step", "min ms/step", "ratio vs unmasked"])
