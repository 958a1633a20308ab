"""What a chip can do: its Tensor Cores' formats, its data-sheet figures (each naming its
source), and FLOP counts; facts that need no GPU to be read."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from d2lgpu.runtime.checks import check_capability
from d2lgpu.runtime.gpus import as_device, require_cuda_device

__all__ = ["CUDA_13_DROPPED_BELOW", "GPU_DATASHEETS", "PEAK_TFLOPS", "narrow_tensor_core_formats",
           "native_tensor_core_formats", "peak_format", "peak_tflops",
           "training_flops_per_example"]


def native_tensor_core_formats(capability: tuple[int, int]) -> list[str]:
    """Reduced-precision formats that GPUs of this compute capability run on Tensor Cores
    (chapter 1)."""
    capability = check_capability(capability)
    first = {"fp16": (7, 0), "bf16": (8, 0), "tf32": (8, 0)}  # the first capability with each
    return [fmt for fmt, since in first.items() if capability >= since]


def narrow_tensor_core_formats(capability: tuple[int, int]) -> list[str]:
    """Tensor Core formats narrower than 16 bits on GPUs of this compute capability, none of
    which ``torch.autocast`` uses (chapter 6); from NVIDIA's whitepapers and the PTX ISA."""
    check_capability(capability)
    formats = []
    if capability >= (8, 9):
        formats.append("fp8")
    if capability >= (10, 0):
        formats += ["fp6", "fp4"]
    if capability >= (7, 2):
        formats.append("int8")
    return formats


#: CUDA 13.0 removed compute capabilities below 7.5 from its compilers (release notes): of
#: torch 2.15's release wheels only cu126 carries kernels for a P100 or V100.
CUDA_13_DROPPED_BELOW = (7, 5)


# Sources: "NVIDIA H100 Tensor Core GPU Architecture" whitepaper; the "NVIDIA T4 Tensor
# Core GPU" datasheet and "NVIDIA Turing GPU Architecture" whitepaper; per-SM limits from
# the CUDA C++ Programming Guide's "Technical Specifications per Compute Capability".
GPU_DATASHEETS: dict[str, dict[str, object]] = {
    "H100 SXM5": {
        "compute capability": "9.0",  # whitepaper: H100 is compute capability 9.0
        "SMs": 132,  # whitepaper, A100/H100 table: 132 SMs on the SXM5 board
        "warp size (threads)": 32,  # programming guide: 32 for every compute capability
        "max threads per SM": 2048,  # programming guide, cc 9.0: 64 warps x 32
        "registers per SM (32-bit)": 65536,  # whitepaper: 256 KB register file per SM
        "shared memory per SM, max": "228 KiB",  # whitepaper: up to 228 KB of the 256 KB
        "L1 + shared memory per SM": "256 KiB",  # whitepaper: 256 KB combined per SM
        "L2 cache": "50 MB",  # whitepaper, A100/H100 table
        "memory": "80 GB HBM3",  # whitepaper, A100/H100 table
        "memory bandwidth": "3352 GB/s",  # whitepaper, A100/H100 table
        "Tensor Cores": "528 (4 per SM)",  # whitepaper: 4th-generation, 528 on SXM5
    },
    "T4": {
        "compute capability": "7.5",  # Turing whitepaper: Turing GPUs are cc 7.5
        "SMs": 40,  # datasheet: 2,560 CUDA cores; Turing whitepaper: 64 per SM
        "warp size (threads)": 32,  # programming guide
        "max threads per SM": 1024,  # programming guide, cc 7.5: 32 warps x 32
        "registers per SM (32-bit)": 65536,  # programming guide, cc 7.5: 64 K registers
        "shared memory per SM, max": "64 KiB",  # programming guide, cc 7.5
        "L1 + shared memory per SM": "96 KiB",  # Turing whitepaper: 96 KB per SM
        # Turing whitepaper, TU104 table: 4,096 KB of L2 (a T4 is a TU104 with 40 of 48 SMs);
        # Jia et al., "Dissecting the NVidia Turing T4 GPU via Microbenchmarking" (2019), agree.
        "L2 cache": "4 MB",
        "memory": "16 GB GDDR6",  # datasheet
        "memory bandwidth": "320 GB/s",  # datasheet: "320+ GB/s"
        "Tensor Cores": "320 (8 per SM)",  # datasheet: 320 Turing Tensor Cores
    },
}


def training_flops_per_example(net: nn.Module, example_shape: Sequence[int] = (1, 28, 28),
                               batch_size: int = 8) -> float:
    """FLOPs of one training step per example, counted by ``FlopCounterMode`` on a CPU copy
    of ``net`` (chapter 4): matrix products and convolutions only, as Tensor Core peaks."""
    from torch.utils.flop_counter import FlopCounterMode

    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module (the model to count), "
                        f"got {type(net).__name__} {net!r}")
    probe = copy.deepcopy(net).to("cpu", torch.float32).train()
    X = torch.zeros(batch_size, *example_shape)
    with FlopCounterMode(display=False) as counter:
        out = probe(X)
        out.float().sum().backward()
    return counter.get_total_flops() / batch_size


#: Dense bf16 Tensor Core peak in TFLOP/s (fp16 on a T4, V100) from NVIDIA's data sheets,
#: keyed as :func:`_model_and_form_factor` reads the device name; each value is (peak, SMs
#: of the full GPU, to scale a MIG slice's peak; None: not splittable).
PEAK_TFLOPS: dict[tuple[str, str | None], tuple[float, int | None]] = {
    # "NVIDIA H100 Tensor Core GPU" datasheet: BF16 Tensor Core 1,979 TFLOPS (SXM), 1,671
    # (NVL), 1,513 (PCIe), each "with sparsity", i.e. twice the dense rate; 132 SMs on
    # SXM5 and NVL, 114 on PCIe ("NVIDIA H100 Tensor Core GPU Architecture" whitepaper).
    ("h100", None): (989.0, 132),  # the SXM5 board's name carries no form factor
    ("h100", "sxm5"): (989.0, 132),
    ("h100", "pcie"): (756.0, 114),
    ("h100", "nvl"): (835.0, 132),
    # "NVIDIA H200 Tensor Core GPU" datasheet: BF16 1,979 TFLOPS (SXM), 1,671 (NVL),
    # with sparsity; the same GH100 configuration as the H100 SXM5, 132 SMs.
    ("h200", None): (989.0, 132),  # SXM
    ("h200", "nvl"): (835.0, 132),
    # "NVIDIA A100 Tensor Core GPU" datasheet: BF16 312 TFLOPS dense (624 with sparsity),
    # SXM4 and PCIe alike; 108 SMs ("NVIDIA A100 Tensor Core GPU Architecture" whitepaper).
    ("a100", None): (312.0, 108),
    ("a100", "sxm"): (312.0, 108),
    ("a100", "sxm4"): (312.0, 108),
    ("a100", "pcie"): (312.0, 108),
    ("a10", None): (125.0, None),  # "NVIDIA A10 Tensor Core GPU" datasheet: BF16 125 (250 sparse)
    ("l40s", None): (362.0, None),  # "NVIDIA L40S" datasheet: BF16 362.05 (733 sparse)
    ("l40", None): (181.0, None),  # "NVIDIA L40" datasheet: BF16 181.05 (362.1 sparse)
    ("l4", None): (121.0, None),  # "NVIDIA L4 Tensor Core GPU" datasheet: BF16 242 sparse
    ("t4", None): (65.0, None),  # "NVIDIA T4" datasheet: mixed precision (FP16/FP32) 65
    # "NVIDIA ADA GPU ARCHITECTURE" whitepaper, Appendix A, RTX 4090: BF16 Tensor TFLOPS
    # with FP32 accumulate (autocast's) 165.2, 330.4 with sparsity.
    ("rtx 4090", None): (165.2, None),
    # "NVIDIA V100 Tensor Core GPU" datasheet, Tensor Performance (fp16): 125 (SXM2),
    # 112 (PCIe), 130 (V100S PCIe). Volta has no sparsity, so these are dense.
    ("v100", "sxm2"): (125.0, None),
    ("v100", "pcie"): (112.0, None),
    ("v100s", "pcie"): (130.0, None),
}

_FORM_FACTORS = {"sxm", "sxm2", "sxm3", "sxm4", "sxm5", "pcie", "nvl"}


def _model_and_form_factor(name: str) -> tuple[str, str | None] | None:
    """("a100", "sxm4") for "NVIDIA A100-SXM4-40GB", whole words; a GeForce card is its whole
    name after "GeForce" ("RTX 4090 D" is another chip)."""
    words = name.lower().replace("-", " ").replace("_", " ").split()
    while words and words[0] in ("nvidia", "tesla"):
        words = words[1:]
    if not words:
        return None
    if words[0] == "geforce":
        return (" ".join(words[1:]), None) if words[1:] else None
    form_factor = next((w for w in words[1:] if w in _FORM_FACTORS), None)
    return words[0], form_factor


def peak_format(device: torch.device | str) -> str | None:
    """The format of :func:`peak_tflops`'s peak on ``device``: "bf16" from 8.0, "fp16" on 7.x,
    else None."""
    device = as_device(device)
    if device.type != "cuda":
        return None
    major, _ = torch.cuda.get_device_capability(device)
    return "bf16" if major >= 8 else "fp16" if major == 7 else None


def peak_tflops(device: torch.device | str) -> float | None:
    """The data-sheet dense Tensor Core peak of ``device``'s GPU, or None when unknown
    (chapter 7); a MIG slice gets its share of its parent's, by SMs."""
    device = as_device(device)
    if device.type != "cuda":
        return None
    device = require_cuda_device(device, "peak_tflops")
    key = _model_and_form_factor(torch.cuda.get_device_name(device))
    if key not in PEAK_TFLOPS:
        return None
    peak, full_sms = PEAK_TFLOPS[key]
    if full_sms is None:
        return peak
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if sms > full_sms:  # not the GPU the data sheet describes
        return None
    return peak * sms / full_sms
