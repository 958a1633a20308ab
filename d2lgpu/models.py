"""Models of the course: d2l's ResNet-18 for small images, a small CNN for quick runs, and
a residual MLP whose size is set by a few numbers (chapter 8's model for memory and sharding).

:func:`resnet18` is the variant from "Dive into Deep Learning" 13.6, kept layer for
layer so that numbers can be compared with the book: a 3x3 stride-1 stem (no 7x7
conv and no max-pool, which would shrink a 28x28 image to nothing useful), four
stages of two residual blocks, global average pooling and one linear layer. Like the
book it keeps biases in convolutions that feed batch norm (they are redundant but
harmless) and has no batch norm on the 1x1 shortcut.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from d2lgpu.runtime.checks import check_bool, check_positive_int

__all__ = ["MLPBlock", "Residual", "resnet18", "residual_mlp", "small_cnn"]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        check_positive_int(name, value)


class Residual(nn.Module):
    """Two 3x3 conv + batch-norm layers with a skip connection: ``relu(F(x) + shortcut(x))``
    (chapter 4).

    The shortcut is the identity, or a strided 1x1 convolution (``use_1x1conv=True``)
    when the block changes the number of channels or the resolution.
    """

    def __init__(
        self, in_channels: int, out_channels: int, use_1x1conv: bool = False, strides: int = 1
    ) -> None:
        super().__init__()
        _check_positive(in_channels=in_channels, out_channels=out_channels, strides=strides)
        check_bool("use_1x1conv", use_1x1conv)
        if not use_1x1conv and (in_channels != out_channels or strides != 1):
            raise ValueError(
                f"an identity shortcut cannot map {in_channels} channels at stride {strides} "
                f"to {out_channels} channels: pass use_1x1conv=True"
            )
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, stride=strides)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.conv3 = (
            nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=strides)
            if use_1x1conv
            else None
        )
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        shortcut = X if self.conv3 is None else self.conv3(X)
        return F.relu(Y + shortcut)


def _resnet_stage(in_channels: int, out_channels: int, first_stage: bool) -> nn.Sequential:
    # Every stage but the first halves the resolution and changes the width in its
    # first block; the first stage follows a stem that already has 64 channels.
    if first_stage:
        return nn.Sequential(
            Residual(in_channels, out_channels), Residual(out_channels, out_channels)
        )
    return nn.Sequential(
        Residual(in_channels, out_channels, use_1x1conv=True, strides=2),
        Residual(out_channels, out_channels),
    )


def resnet18(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """ResNet-18 for small images, as in d2l 13.6 (11.2 M parameters for 10 classes) (chapter 4).

    Works for any input size of 8x8 or more (global average pooling at the end);
    output shape [batch, num_classes].
    """
    _check_positive(num_classes=num_classes, in_channels=in_channels)
    net = nn.Sequential(
        nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
    )
    net.add_module("resnet_block1", _resnet_stage(64, 64, first_stage=True))
    net.add_module("resnet_block2", _resnet_stage(64, 128, first_stage=False))
    net.add_module("resnet_block3", _resnet_stage(128, 256, first_stage=False))
    net.add_module("resnet_block4", _resnet_stage(256, 512, first_stage=False))
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, num_classes)))
    return net


def small_cnn(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """A LeNet-sized CNN with batch norm: trains on a few hundred images in about a second on CPU
    (chapter 4).

    For quick mode and for tests that start several processes. The adaptive pool
    before the classifier makes it accept any input of 16x16 or more, not just 28x28.
    """
    _check_positive(num_classes=num_classes, in_channels=in_channels)
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
    """``x + fc2(gelu(fc1(x)))``: the feed-forward half of a transformer layer, without the norm
    (chapter 8).

    ``width`` numbers in and out, ``hidden`` in between. The residual connection
    keeps a deep stack of these trainable without normalisation layers, so the
    model computes the same thing whatever the batch is split into.
    """

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        _check_positive(width=width, hidden=hidden)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return X + self.fc2(F.gelu(self.fc1(X)))


def residual_mlp(
    width: int = 256,
    hidden: int = 1024,
    depth: int = 4,
    in_features: int = 784,
    num_classes: int = 10,
) -> nn.Sequential:
    """A stack of ``depth`` :class:`MLPBlock` between an input and an output linear layer
    (chapter 8).

    Images are flattened first, so it takes Fashion-MNIST batches ``[B, 1, 28, 28]``
    as well as ``[B, in_features]``. Its parameters are mostly the blocks'
    ``depth * 2 * width * hidden`` weights, so width and depth set its size at will;
    without batch norm its gradients do not depend on how a batch is split,
    which makes it the model for comparing gradient accumulation, DDP and FSDP
    with one process on the whole batch.
    """
    _check_positive(
        width=width, hidden=hidden, depth=depth, in_features=in_features, num_classes=num_classes
    )
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, width),
        *(MLPBlock(width, hidden) for _ in range(depth)),
        nn.Linear(width, num_classes),
    )
