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


class BasicBlock(nn.Module):
    """ResNet basic block: ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``
    with an identity shortcut, or a 1x1 conv + BN projection when the stride or
    the width changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x):
        out = self.bn1(self.conv1(x)).relu()
        out = self.bn2(self.conv2(out))
        return (out + self.shortcut(x)).relu()


class SmallResNet(nn.Module):
    """A ResNet-style CNN for 8x8 digits: a 3x3 conv-BN-ReLU stem, two basic
    blocks of ``width`` channels, one of ``2 * width`` (stride 2, projection
    shortcut) and one more of ``2 * width``, global average pooling and a
    linear classifier. ``blocks`` gives the number of blocks per stage."""

    def __init__(self, num_classes: int = 10, width: int = 16, in_channels: int = 1, blocks=(2, 2)):
        super().__init__()
        w = width
        layers = [nn.Conv2d(in_channels, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
        layers += [BasicBlock(w, w) for _ in range(blocks[0])]
        layers += [BasicBlock(w, 2 * w, stride=2)] + [BasicBlock(2 * w, 2 * w) for _ in range(blocks[1] - 1)]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(2 * w, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))
