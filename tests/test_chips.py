"""Tests of d2lgpu.chips: Tensor Core formats by compute capability, the data-sheet peaks
and FLOP counting."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import d2lgpu
from d2lgpu.chips import (
    narrow_tensor_core_formats,
    native_tensor_core_formats,
    peak_format,
    peak_tflops,
    training_flops_per_example,
)

CPU = torch.device("cpu")


# --------------------------------------------------------------------------- #
# Formats
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("capability", "formats"),
    [
        ((6, 1), []),
        ((7, 0), ["fp16"]),
        ((7, 5), ["fp16"]),
        ((8, 0), ["fp16", "bf16", "tf32"]),
        ((8, 9), ["fp16", "bf16", "tf32"]),
        ((9, 0), ["fp16", "bf16", "tf32"]),
    ],
)
def test_native_tensor_core_formats(capability, formats):
    assert native_tensor_core_formats(capability) == formats


@pytest.mark.parametrize(
    ("capability", "narrow"),
    [((6, 0), []), ((6, 1), []), ((7, 0), []), ((7, 5), ["int8"]), ((8, 0), ["int8"]),
     ((8, 6), ["int8"]), ((8, 9), ["fp8", "int8"]), ((9, 0), ["fp8", "int8"]),
     ((10, 0), ["fp8", "fp6", "fp4", "int8"]), ((12, 0), ["fp8", "fp6", "fp4", "int8"])],
)
def test_narrow_formats_per_generation(capability, narrow):
    assert narrow_tensor_core_formats(capability) == narrow


def test_h100_and_l4_differ_from_a100_by_fp8_only():
    a100, l4, h100 = (8, 0), (8, 9), (9, 0)
    assert native_tensor_core_formats(a100) == native_tensor_core_formats(h100)
    assert "fp8" not in narrow_tensor_core_formats(a100)
    assert "fp8" in narrow_tensor_core_formats(l4) and "fp8" in narrow_tensor_core_formats(h100)


@pytest.mark.parametrize("call", [
    lambda: native_tensor_core_formats(None),
    lambda: native_tensor_core_formats("8.0"),
    lambda: narrow_tensor_core_formats(None),
    lambda: narrow_tensor_core_formats((8, True)),
])
def test_formats_name_a_bad_capability(call):
    with pytest.raises(TypeError, match="capability"):
        call()


# --------------------------------------------------------------------------- #
# FLOPs and peaks
# --------------------------------------------------------------------------- #


def test_training_flops_counted_by_hand():
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
    # Forward: two matmuls. Backward: the last layer needs gradients for its input and
    # weight, the first only for its weight (the images need no gradient). 2 FLOPs per MAC.
    expected = 2 * (784 * 32 + 32 * 10) + 2 * (32 * 10 * 2) + 2 * (784 * 32)
    assert training_flops_per_example(net) == expected


def test_flop_count_leaves_the_model_unchanged():
    net = d2lgpu.small_cnn()
    before = copy.deepcopy(net.state_dict())
    assert training_flops_per_example(net) > 0
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _fake_gpu(monkeypatch, name: str, multiprocessors: int) -> None:
    """Make cuda:0 look like a GPU called ``name`` with ``multiprocessors`` SMs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    props = type("Props", (), {"name": name, "multi_processor_count": multiprocessors})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


# Names as torch.cuda.get_device_name reports them, with the dense (no sparsity) peak of
# the fast Tensor Core format from NVIDIA's data sheets, and the full GPU's SM count.
@pytest.mark.parametrize(
    "name, multiprocessors, peak",
    [
        ("NVIDIA H100 80GB HBM3", 132, 989.0), ("NVIDIA H100 PCIe", 114, 756.0),
        ("NVIDIA H100 NVL", 132, 835.0), ("NVIDIA H200", 132, 989.0),
        ("NVIDIA H200 NVL", 132, 835.0), ("NVIDIA A100-SXM4-80GB", 108, 312.0),
        ("NVIDIA A100-PCIE-40GB", 108, 312.0), ("NVIDIA A100 80GB PCIe", 108, 312.0),
        ("Tesla T4", 40, 65.0), ("NVIDIA L40S", 142, 362.0), ("NVIDIA L40", 142, 181.0),
        ("NVIDIA L4", 58, 121.0), ("NVIDIA A10", 72, 125.0),
        ("Tesla V100-PCIE-16GB", 80, 112.0), ("Tesla V100-SXM2-16GB", 80, 125.0),
        ("Tesla V100-SXM2-32GB", 80, 125.0), ("Tesla V100S-PCIE-32GB", 80, 130.0),
        ("NVIDIA GeForce RTX 4090", 128, 165.2),
    ],
)
def test_peak_table_matches_whole_model_names(monkeypatch, name, multiprocessors, peak):
    _fake_gpu(monkeypatch, name, multiprocessors)
    assert peak_tflops("cuda:0") == peak


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA RTX A1000",  # contains "A100", but is a small workstation card
        "NVIDIA T400",  # contains "T4"
        "NVIDIA L40G",  # an unknown variant of a known model
        "Tesla V100-FHHL-16GB",  # a V100 variant with its own clocks, not in the table
        # Other chips whose names start like a known one's: a 4090 with fewer SMs, the
        # laptop part (another die), and a GeForce card the table does not list.
        "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 4090 Laptop GPU",
        "NVIDIA GeForce RTX 4080", "NVIDIA GeForce", "Some Future GPU", "",
    ],
)
def test_unknown_gpus_have_no_peak(monkeypatch, name):
    _fake_gpu(monkeypatch, name, 40)
    assert peak_tflops("cuda:0") is None


def test_peak_of_the_cpu_is_unknown():
    assert peak_tflops(CPU) is None


def test_a_mig_slice_gets_its_share_of_the_peak(monkeypatch):
    # A MIG instance reports its parent's name but only its own multiprocessors.
    _fake_gpu(monkeypatch, "NVIDIA A100-SXM4-40GB", 42)  # a 3g.20gb slice: 42 of 108 SMs
    assert peak_tflops("cuda:0") == pytest.approx(312.0 * 42 / 108)
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 16)  # a 1g.10gb slice
    assert peak_tflops("cuda:0") == pytest.approx(989.0 * 16 / 132)
    # More multiprocessors than the data sheet's GPU has: not the GPU the table describes.
    _fake_gpu(monkeypatch, "NVIDIA A100-SXM4-40GB", 128)
    assert peak_tflops("cuda:0") is None


def test_peak_format_names_the_data_sheet_dtype(monkeypatch):
    assert peak_format(CPU) is None
    for capability, expected in (((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp16"),
                                 ((7, 0), "fp16"), ((6, 1), None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None, c=capability: c)
        assert peak_format("cuda:0") == expected


@pytest.mark.parametrize("function", [peak_format, peak_tflops])
def test_peak_lookups_name_a_bad_device(function):
    with pytest.raises(ValueError, match="device"):
        function(-1)


@pytest.mark.parametrize("net", [None, "resnet18"])
def test_flop_count_names_a_bad_net(net):
    with pytest.raises(TypeError, match="net"):
        training_flops_per_example(net)
