"""The health check on one rank, including on builds of PyTorch without NCCL."""

from __future__ import annotations

import pytest
import torch

from d2lgpu.healthcheck import health_check
from d2lgpu.runtime.distributed import find_free_port, process_group


def test_health_check_single_rank():
    with process_group(0, 1, master_port=find_free_port(), timeout_s=20) as ctx:
        healthy, lines = health_check(ctx)
    assert healthy
    assert "all_reduce of rank+1 must give 1" in lines[1]
    assert "rank 0 (local 0)" in lines[2] and "all_reduce OK" in lines[2]


def test_health_check_passes_on_a_cuda_build_without_nccl(monkeypatch):
    # As on Windows: CUDA works, but the build has no NCCL and asking for its version raises.
    def no_nccl():
        raise RuntimeError("PyTorch was built without NCCL")

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", no_nccl)
    with process_group(0, 1, master_port=find_free_port(), backend="gloo", timeout_s=20) as ctx:
        healthy, lines = health_check(ctx)
    assert healthy, lines
    assert lines[0].endswith("NCCL n/a"), lines[0]


@pytest.mark.gpu
def test_health_check_reports_the_nccl_version_on_a_gpu():
    with process_group(0, 1, master_port=find_free_port(), timeout_s=60) as ctx:
        healthy, lines = health_check(ctx)
    assert healthy, lines
    expected = ".".join(map(str, torch.cuda.nccl.version()))
    assert lines[0].endswith(f"NCCL {expected}"), lines[0]
