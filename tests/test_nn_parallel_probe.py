"""d2lgpu.parallel.nn_parallel_on_devices: which torch.nn.parallel pieces accept which devices."""

import pytest
import torch
from torch import nn

from d2lgpu.parallel import nn_parallel_on_devices

PIECES = ["replicate", "scatter", "parallel_apply", "gather"]


def _module_and_batch() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(6, 3)


def test_every_piece_refuses_cpu_devices():
    # torch.nn.parallel is written for CUDA GPUs; chapter 3 shows each refusal.
    module, X = _module_and_batch()
    outcome = nn_parallel_on_devices(module, X, ["cpu", "cpu"])
    assert list(outcome) == PIECES
    for piece, error in outcome.items():
        assert isinstance(error, Exception), f"{piece} accepted CPU devices"


def test_a_piece_that_works_reports_none(monkeypatch):
    module, X = _module_and_batch()
    monkeypatch.setattr(torch.nn.parallel, "scatter", lambda inputs, devices: inputs)
    outcome = nn_parallel_on_devices(module, X, ["cpu", "cpu"])
    assert outcome["scatter"] is None
    assert isinstance(outcome["replicate"], Exception)


def test_the_module_is_left_alone():
    module, X = _module_and_batch()
    before = [p.detach().clone() for p in module.parameters()]
    nn_parallel_on_devices(module, X, ["cpu", "cpu"])
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert all(p.device.type == "cpu" for p in module.parameters())


def test_needs_devices_and_an_example_per_device():
    module, X = _module_and_batch()
    with pytest.raises(ValueError, match="at least one device"):
        nn_parallel_on_devices(module, X, [])
    with pytest.raises(ValueError, match="one example per device"):
        nn_parallel_on_devices(module, X[:1], ["cpu", "cpu"])


@pytest.mark.multigpu
def test_every_piece_works_on_two_gpus():
    module, X = _module_and_batch()
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    outcome = nn_parallel_on_devices(module.to(devices[0]), X.to(devices[0]), devices)
    assert outcome == dict.fromkeys(PIECES)
