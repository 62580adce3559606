"""Tiny models and data shared by the pruning tests."""
import torch
from torch import nn


class TinyNet(nn.Module):
    """conv-BN-ReLU, conv-ReLU, pool, linear: small enough for explicit Hessians."""

    def __init__(self, c=3, classes=4, bn=True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c) if bn else nn.Identity()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.fc(x.mean((2, 3)))


def batch(n=8, size=6, classes=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, size, size, generator=g, dtype=dtype)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def random_masks(masker, density=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.rand(pt.parameter.shape, generator=g) < density for n, pt in masker.tensors.items()}
