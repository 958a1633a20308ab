"""Models of the course: d2l's ResNet-18 for small images, a small CNN for quick runs, and
a residual MLP whose size is set by a few numbers (chapter 8's model for memory and sharding)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MLPBlock", "Residual", "resnet18", "residual_mlp", "small_cnn"]


class Residual(nn.Module):
    """Two 3x3 conv + batch-norm layers with a skip connection: ``relu(F(x) + shortcut(x))``
    (chapter 4); the shortcut is a strided 1x1 convolution with ``use_1x1conv=True``."""

    def __init__(self, in_channels: int, out_channels: int, use_1x1conv: bool = False,
                 strides: int = 1) -> None:
        super().__init__()
        if not use_1x1conv and (in_channels != out_channels or strides != 1):
            raise ValueError(f"an identity shortcut cannot map {in_channels} channels at stride "
                             f"{strides} to {out_channels} channels: pass use_1x1conv=True")
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, stride=strides)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.conv3 = (nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=strides)
                      if use_1x1conv else None)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        shortcut = X if self.conv3 is None else self.conv3(X)
        return F.relu(Y + shortcut)


def resnet18(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """ResNet-18 for small images, d2l 13.6's layer for layer (chapter 4): a 3x3 stride-1 stem,
    as a 7x7 conv and max-pool would shrink 28x28 images to nothing; any input of 8x8 or more."""
    net = nn.Sequential(nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
                        nn.BatchNorm2d(64), nn.ReLU())
    for i, (c_in, c_out) in enumerate([(64, 64), (64, 128), (128, 256), (256, 512)], start=1):
        # Every stage but the first halves the resolution and changes the width.
        first = (Residual(c_in, c_out) if i == 1
                 else Residual(c_in, c_out, use_1x1conv=True, strides=2))
        net.add_module(f"resnet_block{i}", nn.Sequential(first, Residual(c_out, c_out)))
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, num_classes)))
    return net


def small_cnn(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """A LeNet-sized CNN with batch norm for quick runs: a few hundred images train in about a
    second on a CPU (chapter 4); any input of 16x16 or more."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, kernel_size=5, padding=2), nn.BatchNorm2d(6), nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(6, 16, kernel_size=5), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.AdaptiveAvgPool2d((5, 5)), nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120), nn.BatchNorm1d(120), nn.ReLU(),
        nn.Linear(120, 84), nn.BatchNorm1d(84), nn.ReLU(),
        nn.Linear(84, num_classes),
    )


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))``: a transformer layer's feed-forward half (chapter 8); without
    normalisation it computes the same whatever the batch is split into."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return X + self.fc2(F.gelu(self.fc1(X)))


def residual_mlp(width: int = 256, hidden: int = 1024, depth: int = 4, in_features: int = 784,
                 num_classes: int = 10) -> nn.Sequential:
    """``depth`` :class:`MLPBlock` s between input and output layers (chapter 8): without batch
    norm its gradients do not depend on how a batch is split (accumulation, DDP, FSDP)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, width),
                         *(MLPBlock(width, hidden) for _ in range(depth)),
                         nn.Linear(width, num_classes))
