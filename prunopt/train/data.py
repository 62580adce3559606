"""Embedded datasets for the example jobs (no download)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Dataset:
    """Train/test tensors. Images are ``(N, 1, H, W)`` float32 in [0, 1]."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int


def load_digits(seed: int = 0, test_fraction: float = 0.3, limit: int | None = None) -> Dataset:
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), split
    ``1 - test_fraction : test_fraction`` with a fixed seed. ``limit`` keeps the
    first ``limit`` images (for quick tests)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    from sklearn.datasets import load_digits as _load

    d = _load()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    if limit is not None:
        perm = perm[:limit]
    x, y = x[perm], y[perm]
    n_test = max(1, int(round(len(y) * test_fraction)))
    return Dataset(x[n_test:], y[n_test:], x[:n_test], y[:n_test], 10)
