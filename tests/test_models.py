"""Tests of d2lgpu.models: shapes, parameter counts and the residual connection."""

import pytest
import torch
import torchvision
from torch import nn

from d2lgpu.models import Residual, resnet18, small_cnn


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("size", [28, 96])
def test_resnet18_output_shape(size):
    net = resnet18(num_classes=10, in_channels=1).eval()
    with torch.no_grad():
        assert net(torch.zeros(2, 1, size, size)).shape == (2, 10)


def test_resnet18_parameter_count_matches_torchvision_with_the_d2l_changes():
    # torchvision's ImageNet ResNet-18 differs from the d2l variant in three ways:
    # a 7x7 RGB stem without bias (d2l: 3x3, 1 channel, with bias), no biases in
    # the block convs (d2l has them), batch norm on the 1x1 shortcut (d2l has none).
    reference = torchvision.models.resnet18(num_classes=10)
    expected = count(reference) - count(reference.conv1) + (3 * 3 * 1 * 64 + 64)
    for stage in (reference.layer1, reference.layer2, reference.layer3, reference.layer4):
        for module in stage.modules():
            if isinstance(module, nn.Conv2d):
                assert module.bias is None
                expected += module.out_channels
        for block in stage:
            if block.downsample is not None:
                expected -= count(block.downsample[1])  # its BatchNorm2d
    assert count(resnet18(num_classes=10, in_channels=1)) == expected


def test_resnet18_widths_follow_the_arguments():
    net = resnet18(num_classes=7, in_channels=3).eval()
    with torch.no_grad():
        assert net(torch.zeros(1, 3, 28, 28)).shape == (1, 7)
    assert count(net) - count(resnet18(num_classes=10, in_channels=3)) == -3 * (512 + 1)


@pytest.mark.parametrize("size", [28, 96])
def test_small_cnn_output_shape(size):
    net = small_cnn(num_classes=10).eval()
    with torch.no_grad():
        assert net(torch.zeros(3, 1, size, size)).shape == (3, 10)


def test_small_cnn_is_small():
    # LeNet-5 sized: far below ResNet-18's eleven million parameters.
    assert count(small_cnn()) < 100_000 < count(resnet18())


def test_residual_shapes():
    X = torch.randn(2, 8, 12, 12)
    assert Residual(8, 8)(X).shape == (2, 8, 12, 12)
    assert Residual(8, 16, use_1x1conv=True, strides=2)(X).shape == (2, 16, 6, 6)


def test_residual_adds_its_input():
    # With the second batch norm zeroed the residual branch contributes nothing,
    # so the block must return relu(X): the identity shortcut is really added.
    block = Residual(4, 4)
    nn.init.zeros_(block.bn2.weight)
    nn.init.zeros_(block.bn2.bias)
    X = torch.randn(2, 4, 5, 5)
    assert torch.allclose(block(X), torch.relu(X))


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="use_1x1conv=True"):
        Residual(8, 16)
    with pytest.raises(ValueError, match="use_1x1conv=True"):
        Residual(8, 8, strides=2)
