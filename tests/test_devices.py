"""Tests of d2lgpu.devices: naming the CPU and GPUs, and refusing bad indices."""

import numpy as np
import pytest
import torch

import d2lgpu


def _torch_gpu_count() -> int:
    # Computed directly from torch, independently of d2lgpu.num_gpus.
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_cpu():
    assert d2lgpu.cpu() == torch.device("cpu")


def test_num_gpus_matches_torch():
    assert d2lgpu.num_gpus() == _torch_gpu_count()


def test_try_all_gpus_is_never_empty():
    devices = d2lgpu.try_all_gpus()
    n = _torch_gpu_count()
    if n == 0:
        assert devices == [torch.device("cpu")]
    else:
        assert devices == [torch.device("cuda", i) for i in range(n)]


def test_try_gpu_falls_back_to_cpu_for_missing_gpu():
    assert d2lgpu.try_gpu(10_000) == torch.device("cpu")


def test_try_gpu_zero():
    expected = torch.device("cuda", 0) if _torch_gpu_count() else torch.device("cpu")
    assert d2lgpu.try_gpu() == expected


def test_try_gpu_accepts_numpy_integers():
    assert d2lgpu.try_gpu(np.int64(10_000)) == torch.device("cpu")


# Explicit ids: an id of plain "gpu" would read as the gpu marker's keyword.
@pytest.mark.parametrize("func", [d2lgpu.try_gpu, d2lgpu.gpu], ids=["try_gpu", "gpu_func"])
def test_negative_index_is_a_value_error(func):
    with pytest.raises(ValueError, match="0 or more"):
        func(-1)


@pytest.mark.parametrize("bad", ["0", 1.0, True, None])
@pytest.mark.parametrize("func", [d2lgpu.try_gpu, d2lgpu.gpu], ids=["try_gpu", "gpu_func"])
def test_non_integer_index_is_a_type_error(func, bad):
    with pytest.raises(TypeError, match="must be an int"):
        func(bad)


def test_string_index_error_names_the_fix():
    with pytest.raises(TypeError, match="write 0 instead"):
        d2lgpu.try_gpu("0")


def test_gpu_missing_index_names_try_gpu():
    with pytest.raises(RuntimeError) as excinfo:
        d2lgpu.gpu(99)
    message = str(excinfo.value)
    assert "GPU 99 does not exist" in message
    assert "try_gpu(99)" in message
    assert f"sees {_torch_gpu_count()} GPU(s)" in message


@pytest.mark.gpu
def test_gpu_zero_holds_tensors():
    device = d2lgpu.gpu(0)
    assert device == torch.device("cuda", 0)
    x = torch.ones(3, device=device)
    assert x.device == device
    assert x.sum().item() == 3


@pytest.mark.multigpu
def test_every_gpu_is_addressable():
    for i, device in enumerate(d2lgpu.try_all_gpus()):
        assert device == d2lgpu.gpu(i)
        assert torch.zeros(1, device=device).device == device


def test_as_device_reads_what_torch_reads_and_names_the_spellings_otherwise():
    assert d2lgpu.devices.as_device("cpu") == torch.device("cpu")
    assert d2lgpu.devices.as_device(1) == torch.device("cuda", 1)  # an int is a GPU, as in torch
    with pytest.raises(ValueError, match="'cuda:0'"):
        d2lgpu.devices.as_device("cuda0")
    with pytest.raises(TypeError, match="not a device"):
        d2lgpu.devices.as_device(True)
