"""Every GPU decision of the package, on the chips learners have: one row per machine.

Each row fakes what torch (and NVML, and the NCCL peer-copy check's child process) would
report on that machine, and asserts what the package decides there: whether CUDA counts
as usable and which device the course runs on, the workload, precision "auto", which
techniques the fast path leaves out, which precision-sweep modes cannot run, the chip's
Tensor Core formats and data-sheet peak, the NCCL peer-to-peer switch, the process-group
backend, and the DataLoader's workers. Nothing here needs a GPU.

The chips: a T4 (Colab's free GPU: sm_75, no bf16 Tensor Cores), two T4s without peer
access (Kaggle), a P100 (sm_60: torch's CUDA 13 wheels carry no kernels for it; the cu126
wheel does), an A100 (sm_80), an H100 (sm_90), eight H100s on NVLink, and an RTX 4090
(sm_89). The wheel's arch lists are torch 2.15's table of its release wheels
(``PYTORCH_RELEASES_CODE_CC`` in torch/cuda/__init__.py; see tests/_fake_cuda.py).

Total memory is faked too (roughly what torch reports), although no decision of the
package reads it: how much fits is found by trying (``precision_sweep`` records "OOM"),
not predicted from ``total_memory``.

At the end, the torch-version axis of the TF32 switch, which needs no GPU at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _fake_cuda import CU13_ARCHS, CU126_ARCHS, fake_cuda_gpus

from d2lgpu import chips, data, devices, precision, profiling, report
from d2lgpu.fast import TECHNIQUES, Techniques, technique_skip_reason
from d2lgpu.runtime import config, distributed, gpus

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU = torch.device("cuda", 0)
GIB = 2**30

# Fragments of the reasons the package gives, as they appear in the table below.
NEEDS_80 = "needs compute capability 8.0"
TOO_OLD_FOR_TRITON = "too old for Triton: it needs sm70+"
NO_FAST_FORMAT = "no fast reduced format on cuda:0: 'auto' is fp32"
NO_KERNELS = "this PyTorch has no kernels for a GPU here"


@dataclass(frozen=True)
class Row:
    """One machine, and what the package decides on it.

    The machine: ``name`` as ``torch.cuda.get_device_name()`` reports it, ``count`` GPUs of
    ``capability`` with ``sms`` multiprocessors and ``memory_gib`` each, a torch wheel built
    for ``archs``; ``peer``: what ``torch.cuda.can_device_access_peer`` says for every pair;
    ``nvlink``: what NVML says about the GPUs' links.

    The decisions, read on GPU 0 where they concern one GPU:

    * ``usable``: ``gpus.cuda_usable()``; ``course_devices``: ``try_all_gpus()``;
      ``workload``: ``config.workload()`` with no ``D2LGPU_*`` variable set.
    * ``auto``: the name of ``precision_policy(cuda:0, "auto")``.
    * ``skips``: ``technique_skip_reason(t, cuda:0)`` for the techniques it refuses (a
      fragment of the reason), with Triton installed as on Colab and Kaggle; every other
      technique of ``TECHNIQUES`` is used.
    * ``refused_modes``: ``mode_unavailable_reason(mode, cuda:0)`` for the sweep modes it
      refuses; every other mode of ``PRECISION_MODES`` runs. ``sweep_mode``: the mode the
      sweep sets against fp32 (``amp_sweep_mode``).
    * ``formats``, ``narrow``: ``chips.native_tensor_core_formats`` and
      ``narrow_tensor_core_formats``; ``peak``: ``chips.peak_tflops(cuda:0)`` (None:
      unknown; a str: the fragment of the error it raises) in ``peak_format``.
    * ``p2p``: ``gpus.nccl_p2p_decision({})`` as (NCCL_P2P_DISABLE=1?, did the peer-copy
      check run?, a fragment of the reason).
    * ``backends``: ``distributed.choose_backend(ranks)`` for a few rank counts.
    * ``workers``: ``data.default_num_workers()`` outside quick mode on 16 cores;
      ``pins``: whether the loaders pin host memory; ``smoke_compiles``: whether smoke
      mode's ablation keeps its torch.compile row.
    """

    label: str
    name: str
    capability: tuple[int, int]
    count: int
    sms: int
    memory_gib: float
    archs: list[str]
    cuda_build: str
    peer: bool
    nvlink: bool | None
    # -- decisions --
    usable: bool
    course_devices: list[str]
    workload: str
    auto: str
    refused_modes: dict[str, str]
    sweep_mode: str
    formats: list[str]
    narrow: list[str]
    peak: float | str | None
    peak_format: str | None
    p2p: tuple[bool, bool, str]
    backends: dict[int, str]
    workers: int
    pins: bool
    smoke_compiles: bool
    skips: dict[str, str] = field(default_factory=dict)


ALONE = (False, False, "1 GPU(s) here: no peer for NCCL to copy to")
FP16_ONLY = {"tf32": NEEDS_80, "bf16": NEEDS_80}

ROWS = [
    Row("T4 (Colab)", "Tesla T4", (7, 5), 1, 40, 14.7, CU13_ARCHS, "13.0", False, False,
        usable=True, course_devices=["cuda:0"], workload="full", auto="fp16 + GradScaler",
        refused_modes=FP16_ONLY, sweep_mode="fp16", formats=["fp16"], narrow=["int8"],
        peak=65.0, peak_format="fp16", p2p=ALONE, backends={1: "nccl", 2: "gloo"},
        workers=4, pins=True, smoke_compiles=True),
    Row("2 x T4 (Kaggle)", "Tesla T4", (7, 5), 2, 40, 14.7, CU13_ARCHS, "13.0", False, False,
        usable=True, course_devices=["cuda:0", "cuda:1"], workload="full",
        auto="fp16 + GradScaler", refused_modes=FP16_ONLY, sweep_mode="fp16",
        formats=["fp16"], narrow=["int8"], peak=65.0, peak_format="fp16",
        p2p=(True, False, "2 T4s without NVLink"), backends={1: "nccl", 2: "nccl", 3: "gloo"},
        workers=8, pins=True, smoke_compiles=True),
    Row("P100, CUDA 13 wheel", "Tesla P100-PCIE-16GB", (6, 0), 1, 56, 15.9, CU13_ARCHS, "13.0",
        False, False,
        usable=False, course_devices=["cpu"], workload="cpu", auto="fp32",
        refused_modes={"tf32": NEEDS_80 + " (this GPU: 6.0)", "bf16": NEEDS_80},
        sweep_mode="fp16", formats=[], narrow=[], peak=NO_KERNELS, peak_format=None,
        p2p=(False, False, "0 GPU(s) here"), backends={1: "gloo"},
        workers=2, pins=False, smoke_compiles=False,
        skips={"precision": NO_FAST_FORMAT, "compile": TOO_OLD_FOR_TRITON}),
    Row("P100, cu126 wheel", "Tesla P100-PCIE-16GB", (6, 0), 1, 56, 15.9, CU126_ARCHS, "12.6",
        False, False,
        usable=True, course_devices=["cuda:0"], workload="full", auto="fp32",
        refused_modes={"tf32": NEEDS_80, "bf16": NEEDS_80}, sweep_mode="fp16", formats=[],
        narrow=[], peak=None, peak_format=None, p2p=ALONE, backends={1: "nccl", 2: "gloo"},
        workers=4, pins=True, smoke_compiles=False,  # too old for Triton, as in `skips`
        skips={"precision": NO_FAST_FORMAT, "compile": TOO_OLD_FOR_TRITON}),
    Row("A100", "NVIDIA A100-SXM4-40GB", (8, 0), 1, 108, 39.4, CU13_ARCHS, "13.0", False, None,
        usable=True, course_devices=["cuda:0"], workload="full", auto="bf16",
        refused_modes={}, sweep_mode="bf16", formats=["fp16", "bf16", "tf32"],
        narrow=["int8"], peak=312.0, peak_format="bf16", p2p=ALONE,
        backends={1: "nccl", 2: "gloo"}, workers=4, pins=True, smoke_compiles=True),
    Row("H100", "NVIDIA H100 80GB HBM3", (9, 0), 1, 132, 79.1, CU13_ARCHS, "13.0", False, None,
        usable=True, course_devices=["cuda:0"], workload="full", auto="bf16",
        refused_modes={}, sweep_mode="bf16", formats=["fp16", "bf16", "tf32"],
        narrow=["fp8", "int8"], peak=989.0, peak_format="bf16", p2p=ALONE,
        backends={1: "nccl", 2: "gloo"}, workers=4, pins=True, smoke_compiles=True),
    Row("8 x H100 (NVLink)", "NVIDIA H100 80GB HBM3", (9, 0), 8, 132, 79.1, CU13_ARCHS, "13.0",
        True, True,
        usable=True, course_devices=[f"cuda:{i}" for i in range(8)], workload="full",
        auto="bf16", refused_modes={}, sweep_mode="bf16", formats=["fp16", "bf16", "tf32"],
        narrow=["fp8", "int8"], peak=989.0, peak_format="bf16",
        p2p=(False, True, "peer copies between all 8 GPUs arrive intact"),
        backends={1: "nccl", 8: "nccl", 9: "gloo"}, workers=8, pins=True, smoke_compiles=True),
    Row("RTX 4090", "NVIDIA GeForce RTX 4090", (8, 9), 1, 128, 23.6, CU13_ARCHS, "13.0",
        False, False,
        usable=True, course_devices=["cuda:0"], workload="full", auto="bf16",
        refused_modes={}, sweep_mode="bf16", formats=["fp16", "bf16", "tf32"],
        narrow=["fp8", "int8"], peak=165.2, peak_format="bf16", p2p=ALONE,
        backends={1: "nccl", 2: "gloo"}, workers=4, pins=True, smoke_compiles=True),
]


@pytest.fixture(params=ROWS, ids=[row.label for row in ROWS])
def row(request, monkeypatch) -> Row:
    """Make this process look like the row's machine; no ``D2LGPU_*`` setting, no variable
    that hides GPUs or sets NCCL's peer-to-peer switch."""
    machine: Row = request.param
    fake_cuda_gpus(monkeypatch, [machine.capability] * machine.count, machine.archs,
                   machine.cuda_build, names=[machine.name] * machine.count,
                   multiprocessors=machine.sms, total_memory=int(machine.memory_gib * GIB))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: machine.peer)
    monkeypatch.setattr(gpus, "_PEER_COPY_VERDICTS", {})
    # Triton installed, as on Colab and Kaggle; a CUDA build, not ROCm.
    import torch.utils._triton as triton_utils

    monkeypatch.setattr(triton_utils, "has_triton", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(data, "_usable_cores", lambda: 16)
    for name in (config.QUICK_ENV, config.FULL_ENV, config.SMOKE_ENV, "CUDA_VISIBLE_DEVICES",
                 "NCCL_P2P_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    return machine


# --------------------------------------------------------------------------------------
# Which device the course runs on, and how much work it does
# --------------------------------------------------------------------------------------


def test_usable_cuda_and_the_workload(row):
    assert gpus.cuda_usable() is row.usable
    assert [str(d) for d in devices.try_all_gpus()] == row.course_devices
    assert str(devices.try_gpu()) == row.course_devices[0]
    assert gpus.num_gpus() == (row.count if row.usable else 0)
    assert config.workload() == row.workload
    # Chapter 1's diagnosis says the same, and names the missing kernels where they are.
    diagnosis = report.diagnose_this_machine(report.NvmlView(None, (), "NVML: faked"))
    assert diagnosis.usable is row.usable and diagnosis.device_count == row.count
    assert diagnosis.cause == ("ok" if row.usable else "arch_missing")


# --------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------


def test_auto_precision_and_the_sweep_modes(row):
    policy = precision.precision_policy(GPU, "auto")
    assert policy.name == row.auto
    assert policy.use_scaler is (row.auto == "fp16 + GradScaler")
    # The rule reads the capability alone: passing it gives the same policy.
    assert precision.precision_policy(GPU, "auto", capability=row.capability) == policy
    for mode in precision.PRECISION_MODES:
        reason = precision.mode_unavailable_reason(mode, GPU)
        if mode in row.refused_modes:
            assert reason is not None and row.refused_modes[mode] in reason, (mode, reason)
        else:
            assert reason is None, (mode, reason)
    assert precision.amp_sweep_mode(GPU) == row.sweep_mode


# --------------------------------------------------------------------------------------
# The fast path's techniques
# --------------------------------------------------------------------------------------


def test_techniques_the_fast_path_leaves_out(row):
    assert set(row.skips) <= set(TECHNIQUES)
    for technique in TECHNIQUES:
        reason = technique_skip_reason(technique, GPU)
        if technique in row.skips:
            assert reason is not None and row.skips[technique] in reason, (technique, reason)
            assert len(reason) <= 64
        else:
            assert reason is None, (technique, reason)
    fast = Techniques.fast(GPU)
    assert fast.precision == ("fp32" if "precision" in row.skips else "auto")
    assert fast.channels_last and fast.fused_optimizer and fast.device_data


# --------------------------------------------------------------------------------------
# What the chip can do
# --------------------------------------------------------------------------------------


def test_tensor_core_formats_and_the_data_sheet_peak(row):
    assert chips.native_tensor_core_formats(row.capability) == row.formats
    assert chips.narrow_tensor_core_formats(row.capability) == row.narrow
    assert chips.peak_format(GPU) == row.peak_format
    if isinstance(row.peak, str):
        with pytest.raises(RuntimeError, match=row.peak):
            chips.peak_tflops(GPU)
    else:
        assert chips.peak_tflops(GPU) == row.peak


# --------------------------------------------------------------------------------------
# Several GPUs: NCCL's peer-to-peer copies, and the backend
# --------------------------------------------------------------------------------------


def test_nccl_peer_to_peer_decision(row, monkeypatch):
    children = []

    def child(*args, **kwargs):  # the peer-copy check's process: every copy arrived intact
        children.append(args)
        return types.SimpleNamespace(stdout="STARTED\nOK\n", returncode=0, stderr="")

    monkeypatch.setattr(gpus.subprocess, "run", child)
    disable, checked, why = row.p2p
    decision = gpus.nccl_p2p_decision({})
    assert decision.disable is disable and not decision.user_set
    assert bool(children) is checked
    assert why in decision.reason
    environment = {}
    gpus.apply_nccl_p2p_decision(environment)
    assert environment == ({"NCCL_P2P_DISABLE": "1"} if disable else {})


def test_backend_for_the_ranks_on_this_machine(row):
    for ranks, backend in row.backends.items():
        assert distributed.choose_backend(ranks) == backend, ranks


# --------------------------------------------------------------------------------------
# Loading data, and the ablation's size in smoke mode
# --------------------------------------------------------------------------------------


def test_loader_workers_pinning_and_the_smoke_ablation(row, monkeypatch):
    assert data.default_num_workers(quick=False) == row.workers
    assert data._pin_memory() is row.pins
    monkeypatch.setenv(config.SMOKE_ENV, "1")
    plan = profiling.ablation_plan(devices.try_gpu(), profiling.ablation_settings().skip)
    compile_row = next(step for step in plan if step.technique == "compile")
    assert (compile_row.skip_reason is None) is row.smoke_compiles


# --------------------------------------------------------------------------------------
# The torch-version axis: the TF32 switches, on any device
# --------------------------------------------------------------------------------------

# Run in a fresh interpreter, so that it starts from torch's defaults. Each step reads
# every TF32 switch of both APIs; a read that raises is recorded as "ERR ...". Only the
# installed torch is tested: its check that the two APIs agree is in ATen's Context (C++,
# not in the wheel), and which of these reads raised on torch 2.9 could not be told from
# the sources at hand, so no claim about 2.9 is made here.
_TF32_SCRIPT = r"""
import json
import torch
from d2lgpu.precision import set_tf32, tf32_matmuls

def read(label):
    state = {"step": label}
    for key, get in [
        ("matmul", lambda: torch.backends.cuda.matmul.fp32_precision),
        ("conv", lambda: torch.backends.cudnn.conv.fp32_precision),
        ("rnn", lambda: torch.backends.cudnn.rnn.fp32_precision),
        ("mkldnn", lambda: torch.backends.mkldnn.matmul.fp32_precision),
        ("matmul_allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
        ("cudnn_allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
        ("matmul_precision", torch.get_float32_matmul_precision),
    ]:
        try:
            state[key] = get()
        except RuntimeError as exc:
            state[key] = "ERR " + str(exc).splitlines()[0][:120]
    return state

steps = [read("torch's defaults")]
for start in ("defaults", "learner"):
    if start == "learner":  # what chapters 1 and 6 show: the new API alone
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        steps.append(read("learner set matmul.fp32_precision = 'tf32'"))
    before = steps[-1]
    for enabled in (True, False):
        with tf32_matmuls(enabled):
            steps.append(read(f"{start}: inside tf32_matmuls({enabled})"))
        steps.append(read(f"{start}: after tf32_matmuls({enabled})"))
        steps[-1]["same_as_before"] = all(
            steps[-1][k] == before[k] for k in ("matmul", "conv", "rnn", "mkldnn"))
    for matmul, conv in (("tf32", "tf32"), ("ieee", "ieee"), ("none", "tf32"), ("tf32", "ieee")):
        set_tf32(matmul, conv)
        steps.append(read(f"{start}: set_tf32({matmul!r}, {conv!r})"))
    set_tf32("none", "tf32")  # torch's defaults again, for the next start
    torch.backends.mkldnn.matmul.fp32_precision = "none"
print(json.dumps(steps))
"""


def test_tf32_switches_leave_the_legacy_and_new_apis_in_agreement():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    result = subprocess.run([sys.executable, "-c", _TF32_SCRIPT], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    steps = json.loads(result.stdout.strip().splitlines()[-1])
    defaults, learner = steps[0], next(s for s in steps if s["step"].startswith("learner set"))
    # torch's defaults: TF32 off for matmuls, on for cuDNN, and the two APIs agree.
    assert (defaults["matmul"], defaults["conv"], defaults["matmul_allow_tf32"],
            defaults["cudnn_allow_tf32"], defaults["matmul_precision"]) == (
        "none", "tf32", False, True, "highest")
    # The learner's line alone leaves the legacy reads raising: the case the package repairs.
    assert str(learner["matmul_allow_tf32"]).startswith("ERR")
    for step in steps:
        if step is learner:
            continue
        errors = {k: v for k, v in step.items() if isinstance(v, str) and v.startswith("ERR")}
        assert not errors, (step["step"], errors)
        tf32 = step["matmul"] == "tf32"
        assert step["matmul_allow_tf32"] is tf32, step
        assert (step["matmul_precision"] != "highest") is tf32, step
        assert step["cudnn_allow_tf32"] is (step["conv"] == "tf32"), step
        assert step["conv"] == step["rnn"], step
        assert step.get("same_as_before", True), step
    # Inside the switch both APIs say what was asked; after it the learner keeps TF32.
    inside = {s["step"]: s for s in steps if "inside" in s["step"]}
    for start in ("defaults", "learner"):
        assert inside[f"{start}: inside tf32_matmuls(True)"]["conv"] == "tf32"
        assert inside[f"{start}: inside tf32_matmuls(False)"]["matmul"] == "ieee"
    after = [s for s in steps if s["step"].startswith("learner: after")]
    assert all(s["matmul"] == "tf32" and s["matmul_precision"] == "high" for s in after)
