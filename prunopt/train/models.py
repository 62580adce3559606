"""Example models for the training jobs."""
from __future__ import annotations

from torch import nn


class SmallCNN(nn.Module):
    """A VGG-style CNN for 8x8 digits: three 3x3 conv-BN-ReLU blocks (one
    max-pool), global average pooling and a linear classifier."""

    def __init__(self, num_classes: int = 10, width: int = 16, in_channels: int = 1):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, w, 3, padding=1, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(inplace=True),
            nn.Conv2d(w, 2 * w, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * w),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * w),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * w, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))
