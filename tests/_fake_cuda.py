"""Fake GPUs for tests that run without one: what torch.cuda reports, monkeypatched.

A test makes torch believe it is a CUDA build that lists some GPUs, and then asks the
package what it decides. Nothing here touches a real GPU or creates a CUDA context.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch

# torch 2.15's table of its release wheels (PYTORCH_RELEASES_CODE_CC in torch/cuda/__init__.py):
# the x86-64 cu126 wheels carry sm_50 to sm_90, the CUDA 13 wheels start at sm_75.
CU126_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU13_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


def device_index(device: torch.device | str | int | None = None) -> int:
    """The GPU index torch reads from ``device``; None and a bare ``'cuda'`` are GPU 0, the
    current GPU of a faked process."""
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return 0 if device.index is None else device.index


def fake_props(name: str, capability: tuple[int, int], multiprocessors: int = 40,
               total_memory: int = 16 * 10**9) -> types.SimpleNamespace:
    """What ``torch.cuda.get_device_properties`` returns, with the fields the package reads."""
    major, minor = capability
    return types.SimpleNamespace(name=name, major=major, minor=minor, total_memory=total_memory,
                                 multi_processor_count=multiprocessors, uuid=f"uuid-{name}")


def fake_cuda_gpus(monkeypatch, capabilities: Sequence[tuple[int, int]],
                   arch_list: Sequence[str], cuda_build: str | None = "13.0", *,
                   names: Sequence[str] | None = None, multiprocessors: int = 40,
                   total_memory: int = 16 * 10**9) -> None:
    """Pretend torch is a CUDA ``cuda_build`` build that lists GPUs of ``capabilities`` (called
    ``names``) and was compiled for ``arch_list``. GPUs are read by index, ``torch.device`` or
    string, as torch reads them; GPU 0 is the current one."""
    names = [f"Fake GPU {i}" for i in range(len(capabilities))] if names is None else names
    props = [fake_props(name, tuple(capability), multiprocessors, total_memory)
             for name, capability in zip(names, capabilities, strict=True)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props[device_index(d)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: props[device_index(d)].name)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda d=None: (props[device_index(d)].major, props[device_index(d)].minor))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(arch_list))
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
