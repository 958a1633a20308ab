"""How long every chapter takes in full mode on one T4 and on one H100, estimated from counts.

Full mode is what a chapter runs by default on a CUDA GPU (``d2lgpu.pick(full=...)``).
Its workloads are written below as data, per chapter, from the ``pick(full=...)`` values
in the notebooks and the package functions they call (the notebooks as of 2026-11-25:
chapters 1 and 3 at commit ba03ec2, 5 at 6b1715b, 6 at f6054cd, 7 at f706881, 9 at
32fe467, the others at 1685919). When a chapter's sizes change, change its entry.
For each workload the script counts the work (FLOPs with
:func:`d2lgpu.chips.training_flops_per_example`, which runs torch's ``FlopCounterMode``
over one forward and backward pass on the CPU; bytes by hand where the work is
memory-bound) and turns it into seconds with data-sheet peaks, a stated share of
each peak, and stated host-side costs (kernel launches, data loading, process starts,
compiling). Nothing here runs on a GPU: these are estimates, not measurements.

    python benchmarks/full_mode_estimate.py            # the table (markdown)
    python benchmarks/full_mode_estimate.py --detail   # and every workload's line

Runs on a CPU in well under a minute (the FLOP counts run small batches).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import d2lgpu
from d2lgpu import chips
from d2lgpu.memory import measure_activations
from d2lgpu.models import residual_mlp

# --------------------------------------------------------------------------------------
# The two GPUs and the machines around them
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chip:
    """A GPU's data-sheet peaks and the host it usually sits in."""

    name: str
    tflops: dict[str, float]  # dense peak per precision, TFLOP/s
    gbps: float  # memory bandwidth, GB/s
    memory_gib: float  # what torch reports as total memory
    pcie_gbps: float  # host-to-device copies, assumed average of pageable and pinned
    # The host, assumed (see RESULTS.md for why each figure):
    launch_us: float  # host time per eager PyTorch operator (one kernel launch)
    loader_images_per_s: float  # d2l's DataLoader (PIL decode + ToTensor) with its workers
    cpu_gflops_per_process: float  # small fp32 matmuls/convs, one thread per process
    cpu_gflops_total: float  # the whole host
    cpu_gbps: float  # one thread streaming through memory
    cpu_step_s: float  # fixed host cost of one step of a gloo (CPU) distributed job
    process_start_s: float  # a Python process that imports torch (and CUDA where used)
    compile_s: float  # torch.compile of a ResNet-18 training step, inductor
    small_compile_s: float  # torch.compile of one elementwise function or a small CNN
    autotune_s: float  # the same with mode="max-autotune"
    overhead_s: float  # per chapter: kernel start, imports, reading data, plots

    def peak(self, precision: str) -> float:
        """TFLOP/s of ``precision`` on this chip; "amp" is autocast's fast format here."""
        return self.tflops[self.amp if precision == "amp" else precision]

    @property
    def amp(self) -> str:
        """What ``precision_policy(device, "auto")`` picks: bf16 from 8.0, fp16 on 7.x."""
        return "bf16" if "bf16" in self.tflops else "fp16"


T4 = Chip(
    "T4",
    # "NVIDIA T4 Tensor Core GPU" datasheet: FP32 8.1 TFLOPS, mixed precision (FP16/FP32)
    # 65 TFLOPS (Tensor Cores, dense: Turing has no sparsity), GDDR6 320+ GB/s, 16 GB; the
    # same 65 and 320 GB/s as d2lgpu.chips.PEAK_TFLOPS and GPU_DATASHEETS. No TF32 and no
    # native bf16 (compute capability 7.5): "tf32" runs as fp32, bf16 is not used.
    tflops={"fp32": 8.1, "tf32": 8.1, "fp16": 65.0},
    gbps=320.0,
    memory_gib=14.7,  # torch reports 14.7 GiB of the 16 GB (ECC and the driver take some)
    pcie_gbps=6.0,  # PCIe 3.0 x16 on Colab: about 12 pinned, 3 to 6 pageable
    # Colab's free tier gives the T4 a VM of 2 vCPUs (one physical core, Xeon 2.2 GHz).
    launch_us=20.0,
    loader_images_per_s=8_000,  # 2 workers (default_num_workers: at most the cores)
    cpu_gflops_per_process=7.0,
    cpu_gflops_total=10.0,  # one physical core: two processes share it
    cpu_gbps=5.0,
    cpu_step_s=0.005,
    process_start_s=8.0,
    compile_s=90.0,
    small_compile_s=30.0,
    autotune_s=240.0,
    overhead_s=60.0,
)

H100 = Chip(
    "H100",
    # "NVIDIA H100 Tensor Core GPU" datasheet, SXM: FP32 67 TFLOPS (CUDA cores), TF32 Tensor
    # Core 989 and BF16/FP16 1,979 TFLOPS *with sparsity*, i.e. 495 and 989 dense;
    # 3.35 TB/s (the whitepaper's 3352 GB/s, as in d2lgpu.chips.GPU_DATASHEETS); 80 GB.
    # 989 is d2lgpu.chips.PEAK_TFLOPS[("h100", "sxm5")].
    tflops={"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0},
    gbps=3352.0,
    memory_gib=79.1,
    pcie_gbps=20.0,  # PCIe 5.0 x16: about 50 pinned, less pageable
    # A server host: many cores, a faster core each.
    launch_us=10.0,
    loader_images_per_s=40_000,  # 8 workers (default_num_workers' cap)
    cpu_gflops_per_process=7.0,
    cpu_gflops_total=100.0,
    cpu_gbps=10.0,
    cpu_step_s=0.002,
    process_start_s=4.0,
    compile_s=40.0,
    small_compile_s=15.0,
    autotune_s=120.0,
    overhead_s=30.0,
)

CHIPS = (T4, H100)

#: Share of the data-sheet peak a workload reaches, by (chip, precision, kind), all in:
#: the kernels at the peak's format plus the memory-bound ones (batch norm, ReLU, the
#: optimizer) between them. "conv": convolutional nets on 28 to 96 pixel images, batch
#: 32 to 256, eager PyTorch; "gemm": wide MLPs and large square matmuls. Anchors, from
#: NVIDIA's DeepLearningExamples (PyTorch ResNet-50 v1.5 README), with ResNet-50 at 8.2
#: GFLOP forward and 24.6 per training image: a T4 infers 420 img/s in FP32 (42 % of
#: 8.1) and 1,190 img/s in mixed precision (15 % of 65); one A100 trains 938 img/s in
#: TF32 (15 % of 156) and 2,470 img/s in mixed precision (19 % of 312). Small images give
#: small matrices, so the conv shares below are lower than those; "gemm" follows what
#: cuBLAS reaches on large matrices (the T4's 70 W cap keeps its clock below boost).
UTILISATION: dict[tuple[str, str, str], float] = {
    ("T4", "fp32", "conv"): 0.25,  # chapter 4's own assumption, also 25 %
    ("T4", "tf32", "conv"): 0.25,
    ("T4", "fp16", "conv"): 0.10,
    ("T4", "fp32", "gemm"): 0.55,
    ("T4", "tf32", "gemm"): 0.55,
    ("T4", "fp16", "gemm"): 0.35,
    ("H100", "fp32", "conv"): 0.25,
    ("H100", "tf32", "conv"): 0.06,
    ("H100", "bf16", "conv"): 0.05,
    ("H100", "fp16", "conv"): 0.05,
    ("H100", "fp32", "gemm"): 0.60,
    ("H100", "tf32", "gemm"): 0.50,
    ("H100", "bf16", "gemm"): 0.50,
    ("H100", "fp16", "gemm"): 0.50,
}
#: Share of the memory bandwidth a streaming kernel (copy, add, multiply) reaches.
BANDWIDTH_SHARE = 0.7
#: Forward-only (evaluation) FLOPs per example as a share of a training step's.
EVAL_SHARE = 1 / 3
#: A sweep row that runs out of memory costs about this much (a partial forward pass).
OOM_SECONDS = 1.0

# --------------------------------------------------------------------------------------
# Models the chapters train, and what one training step of each costs
# --------------------------------------------------------------------------------------


def lenet() -> nn.Module:
    """Chapter 3's LeNet (written with functional calls there), as a module to count."""
    return nn.Sequential(
        nn.Conv2d(1, 6, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    )


def mlp_block_stack(width: int, hidden: int, depth: int) -> nn.Module:
    """Chapter 9's halves, put together: ``depth`` MLPBlocks on [batch, width] inputs."""
    from d2lgpu.models import MLPBlock

    return nn.Sequential(*[MLPBlock(width, hidden) for _ in range(depth)])


MODELS: dict[str, Callable[[], nn.Module]] = {
    "lenet": lenet,
    "small_cnn": d2lgpu.small_cnn,
    "resnet18": d2lgpu.resnet18,
    "sweep_mlp 4096x8": lambda: d2lgpu.sweep_mlp(28 * 28, 4096, 8),
    "residual_mlp 256/1024/4": lambda: residual_mlp(width=256, hidden=1024, depth=4),
    "residual_mlp 2048/8192/8": lambda: residual_mlp(width=2048, hidden=8192, depth=8),
    "mlp blocks 2048/8192/8": lambda: mlp_block_stack(2048, 8192, 8),
    "mlp blocks 256/1024/4": lambda: mlp_block_stack(256, 1024, 4),
}


class _OpCount(TorchDispatchMode):
    """Counts the ATen operators a piece of code dispatches: about one kernel launch each."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class StepCost:
    flops_per_example: float  # forward + backward, FlopCounterMode
    ops_per_step: int  # ATen operators of forward, loss and backward, plus a foreach SGD
    activation_bytes_per_example: float  # saved for backward, fp32
    parameter_bytes: int


@cache
def step_cost(model: str, shape: tuple[int, ...]) -> StepCost:
    """Count one training step of ``MODELS[model]`` on inputs of ``shape``, on the CPU."""
    torch.manual_seed(0)
    net = MODELS[model]()
    flops = chips.training_flops_per_example(net, shape, batch_size=2)
    X = torch.zeros(2, *shape)
    net.train()
    with _OpCount() as counter:
        out = net(X)
        loss = out.float().pow(2).mean() if out.shape[-1] != 10 else F.cross_entropy(
            out, torch.zeros(2, dtype=torch.long))
        loss.backward()
    activations = measure_activations(net, X) / 2  # the same model: building one is slow
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    # A CUDA SGD step runs foreach kernels: a handful of launches for all parameters.
    return StepCost(flops, counter.ops + 4, activations, params)


# --------------------------------------------------------------------------------------
# Workloads: what a chapter runs, as data
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """Seconds of one workload on one chip: estimated, and its GPU work at 100 % of peak."""

    seconds: float
    at_peak: float
    gpu_flops: float
    note: str = ""


@dataclass(frozen=True)
class Train:
    """Training (and evaluation) of a model: forward + backward per training example."""

    what: str
    model: str
    shape: tuple[int, ...]
    examples: int  # per epoch
    batch: int
    epochs: int = 1
    runs: int = 1  # seeds, configurations, repeats: each a whole run
    precision: str = "tf32"  # "fp32" strict; "tf32": PyTorch's default (cuDNN TF32 on)
    eval_examples: int = 0  # forward only, per epoch
    kind: str = "conv"
    loader: str = "device"  # "pil": d2l's DataLoader, decoding images in workers
    on: str = "gpu"  # "cpu": gloo processes on the host (1 GPU, 2+ ranks)
    processes: int = 1
    extra_ops_per_step: int = 0  # beyond one forward/backward/SGD (e.g. replicas, all-reduce)
    ops_factor: int = 1  # forward/backward passes per step (replicas run one after another)
    check_memory: bool = False
    skip_on: tuple[str, ...] = ()  # chips where the chapter skips it (e.g. TF32 on a T4)

    def cost(self, chip: Chip) -> Cost:
        if chip.name in self.skip_on:
            return Cost(0.0, 0.0, 0.0, "skipped on this GPU")
        c = step_cost(self.model, self.shape)
        per_run = self.examples * self.epochs
        evals = self.eval_examples * self.epochs
        flops = self.runs * (per_run + EVAL_SHARE * evals) * c.flops_per_example
        steps = self.runs * self.epochs * (
            math.ceil(self.examples / self.batch)
            + math.ceil(self.eval_examples / self.batch) / 3)
        if self.on == "cpu":
            rate = min(self.processes * chip.cpu_gflops_per_process, chip.cpu_gflops_total)
            seconds = flops / (rate * 1e9) + steps * chip.cpu_step_s
            return Cost(seconds, 0.0, 0.0, "on the host (gloo)")
        if self.check_memory:
            scale = 0.5 if self.precision in ("amp", "fp16", "bf16") else 1.0
            need = 1.5 * scale * c.activation_bytes_per_example * self.batch + 4 * c.parameter_bytes
            if need > chip.memory_gib * 2**30:
                # The sweep tries a row that ran out of memory once, not again.
                return Cost(OOM_SECONDS, 0.0, 0.0,
                            f"out of memory (needs about {need / 2**30:.0f} GiB)")
        precision = chip.amp if self.precision == "amp" else self.precision
        peak = chip.peak(precision) * 1e12
        gpu = flops / (peak * UTILISATION[(chip.name, precision, self.kind)])
        launches = steps * (self.ops_factor * c.ops_per_step + self.extra_ops_per_step)
        host = launches * chip.launch_us * 1e-6
        if self.loader == "pil":
            host = max(host, self.runs * (per_run + evals) / chip.loader_images_per_s)
        bound = "GPU" if gpu >= host else "host"
        return Cost(max(gpu, host), flops / peak, flops, f"{bound}-bound")


@dataclass(frozen=True)
class Matmuls:
    """Timing loops of matrix products: ``repeats`` x ``flops``."""

    what: str
    flops: float
    repeats: int
    precision: str = "fp32"

    def cost(self, chip: Chip) -> Cost:
        precision = chip.amp if self.precision == "amp" else self.precision
        peak = chip.peak(precision) * 1e12
        total = self.flops * self.repeats
        return Cost(total / (peak * UTILISATION[(chip.name, precision, "gemm")]), total / peak,
                    total)


@dataclass(frozen=True)
class Traffic:
    """Memory-bound timing loops: ``repeats`` x ``nbytes`` moved, on the GPU, the host's
    memory (one thread) or the PCIe link."""

    what: str
    nbytes: float
    repeats: int
    where: str = "gpu"

    def cost(self, chip: Chip) -> Cost:
        total = self.nbytes * self.repeats
        if self.where == "gpu":
            return Cost(total / (chip.gbps * 1e9 * BANDWIDTH_SHARE), total / (chip.gbps * 1e9),
                        0.0)
        rate = chip.cpu_gbps if self.where == "cpu" else chip.pcie_gbps
        return Cost(total / (rate * 1e9), 0.0, 0.0, f"on the {self.where}")


@dataclass(frozen=True)
class Fixed:
    """Work whose time is not counted in FLOPs or bytes: timers that run for a set time,
    sleeps, process starts (one after another), torch.compile."""

    what: str
    seconds: float = 0.0
    process_starts: int = 0
    compiles: int = 0
    small_compiles: int = 0
    autotunes: int = 0

    def cost(self, chip: Chip) -> Cost:
        return Cost(self.seconds + self.process_starts * chip.process_start_s
                    + self.compiles * chip.compile_s + self.small_compiles * chip.small_compile_s
                    + self.autotunes * chip.autotune_s, 0.0, 0.0)


Workload = Train | Matmuls | Traffic | Fixed

MiB = 2**20
#: The CPU copy buffer of chapter 2 on Colab: twice the 55 MiB last-level cache its
#: Xeon reports (d2lgpu.benchmarking.copy_buffer_bytes), rounded up to MiB.
COLAB_CPU_BUFFER = 110 * MiB
#: On a GPU the buffer is max(256 MiB, twice the L2): 256 MiB on a T4 (4 MB L2) and on
#: an H100 (50 MB L2).
GPU_BUFFER = 256 * MiB
#: chapter 2's multiply-add: 2**24 float32 elements, 100 steps, 6 tensor passes unfused.
MULTIPLY_ADD_LOOP = 6 * 4 * 2**24 * 100
FUSION_STUDY = 10 * 10 * (2 + 3 + 4 + 6 + 6)  # rounds (1 warm-up + 9) x steps x passes
H2D_SIZES = sum(2**k for k in range(12, 29, 2))  # 4 KiB to 256 MiB, every 4x
SWEEP_MODES = ("fp32", "tf32", "fp16", "bf16")  # d2lgpu.PRECISION_MODES
SKIPPED_ON = {"fp32": (), "tf32": ("T4",), "fp16": (), "bf16": ("T4",)}


@dataclass(frozen=True)
class Chapter:
    number: int
    dominant: str  # the work that takes the most time, in words
    workloads: tuple[Workload, ...] = field(default_factory=tuple)


CHAPTERS: tuple[Chapter, ...] = (
    Chapter(1, "fresh Python processes; a 3 s busy GPU for NVML", (
        Fixed("6 fresh Python processes (CUDA_VISIBLE_DEVICES, PCI order, d2lgpu info)",
              process_starts=6),
        Fixed("nvidia-smi", seconds=1.0),
        Fixed("read_nvml_while_busy: 3 s of queued 8192^2 matmuls, NVML read after 1 s",
              seconds=4.0),
    )),
    Chapter(2, "timing loops on the CPU and the GPU; torch.compile on both", (
        Traffic("naive vs synchronised, 3 loops (GPU)", MULTIPLY_ADD_LOOP, 3),
        Traffic("naive vs synchronised, 3 loops (CPU)", MULTIPLY_ADD_LOOP, 3, "cpu"),
        Traffic("compare_timers: 1 + 2 x 5 loops (GPU)", MULTIPLY_ADD_LOOP, 11),
        Traffic("compare_timers: 1 + 2 x 5 loops (CPU)", MULTIPLY_ADD_LOOP, 11, "cpu"),
        Traffic("CUDA events 5 + time_fn 7 loops", MULTIPLY_ADD_LOOP, 12),
        Fixed("Timer.blocked_autorange: 1 + 3 rounds of min_run_time 0.5 s", seconds=2.0),
        Traffic("time_fn in 3 rounds of 6 calls, 20 fused steps", 4 * 4 * 2**24 * 20, 18),
        Traffic("profiler trace, 2 + 100 steps", MULTIPLY_ADD_LOOP / 100, 102),
        Traffic("copy by hand, 6 copies (GPU)", 2 * GPU_BUFFER, 6),
        Traffic("copy by hand, 6 copies (CPU)", 2 * COLAB_CPU_BUFFER, 6, "cpu"),
        Fixed("measure_copy_bandwidth (GPU): 11 timings of at least 50 ms", seconds=0.6),
        Traffic("measure_copy_bandwidth (CPU): 12 copies", 2 * COLAB_CPU_BUFFER, 12, "cpu"),
        Fixed("torch.compile of the multiply-add on the CPU and the GPU", small_compiles=2),
        Traffic("fusion study (GPU): 10 rounds x 10 steps x 21 passes", GPU_BUFFER, FUSION_STUDY),
        Traffic("fusion study (CPU), one thread", COLAB_CPU_BUFFER, FUSION_STUDY, "cpu"),
        Traffic("host-to-device, 9 sizes x 36 copies", H2D_SIZES, 36, "pcie"),
        Traffic("copy || matmul: 36 copies of 256 MiB", 256 * MiB, 36, "pcie"),
        Matmuls("copy || matmul: 36 matmuls 4096^2, fp32", 2 * 4096**3, 36),
        Fixed("2 fresh processes (CUDA_LAUNCH_BLOCKING)", process_starts=2),
    )),
    Chapter(3, "LeNet by hand, 10 epochs, 2 replicas on one GPU", (
        # Two replicas on the one GPU run one after the other; per step also 10 all-reduces
        # (clone, add, 2 copies) and 20 in-place updates, about 60 more operators.
        Train("LeNet by hand: 10 epochs of 60,000, batch 256, 2 replicas", "lenet", (1, 28, 28),
              60_000, 256, epochs=10, precision="fp32", eval_examples=10_000, loader="pil",
              ops_factor=2, extra_ops_per_step=60),
    )),
    Chapter(4, "ResNet-18, 3 epochs; 15 short small-CNN runs", (
        Train("ResNet-18: 3 epochs of 60,000, batch 256", "resnet18", (1, 28, 28), 60_000, 256,
              epochs=3, eval_examples=10_000, loader="tensor"),
        # 3 configurations x 5 seeds, 4 epochs of 3,000; k=8 runs 8 chunks of 32 one after
        # another, as many launches as batch 32.
        Train("seeds study: small CNN, 15 runs x 4 epochs of 3,000", "small_cnn", (1, 28, 28),
              3_000, 32, epochs=4, runs=15, eval_examples=2_000, loader="tensor"),
    )),
    Chapter(5, "DDP on 2 gloo ranks on the CPU (one GPU: no NCCL); torchrun --full", (
        # 500 training images (the quick subset in every mode), batch 16 over 2 ranks:
        # the script under torchrun and under mp.spawn, the package in one process, each
        # 12 epochs; 2 more epochs in one process; 2 epochs with batch norm, 2 ranks and 1.
        Train("lesson script x2 and the package: 12 epochs of the 500-image subset, x3",
              "small_cnn", (1, 28, 28), 500, 16, epochs=12, runs=3, eval_examples=200,
              on="cpu", processes=2),
        Train("2 more epochs; batch norm: 2 epochs on 2 ranks and on 1", "small_cnn",
              (1, 28, 28), 500, 16, epochs=2, runs=3, eval_examples=200, on="cpu",
              processes=2),
        Train("torchrun ddp_train --full: 3 epochs of 60,000 (one restart)", "small_cnn",
              (1, 28, 28), 60_000, 32, epochs=3, eval_examples=10_000, on="cpu", processes=2),
        # One start after another: torchrun's agent then its workers (2 each for the lesson
        # script and ddp_details.py, 3 for ddp_train with its restart), python then
        # mp.spawn's children (2), launch for batch norm and for the failing rank (2), the
        # 2-node healthcheck (2), hogwild.py and its children (2), hogwild_train (1).
        Fixed("16 process starts, one after another", process_starts=16),
    )),
    Chapter(6, "precision sweeps: an MLP of width 4096 and ResNet-18 at 96x96", (
        # Every mode of d2lgpu.PRECISION_MODES; a T4 (compute capability 7.5) skips tf32
        # and bf16 (mode_unavailable_reason). "fp32" is strict: TF32 off in matmuls and cuDNN.
        *(Train(f"MLP sweep, {mode}, batch {b}: 3 x (2 + 5) steps", "sweep_mlp 4096x8",
                (1, 28, 28), b, b, runs=21, precision=mode, kind="gemm", check_memory=True,
                skip_on=SKIPPED_ON[mode])
          for mode in SWEEP_MODES for b in (256, 1024, 4096, 16384, 65536)),
        *(Train(f"ResNet-18 sweep, {mode}, batch {b}: 3 x (2 + 5) steps", "resnet18",
                (1, 96, 96), b, b, runs=21, precision=mode, check_memory=True,
                skip_on=SKIPPED_ON[mode])
          for mode in SWEEP_MODES for b in (32, 128, 512, 1024, 2048)),
    )),
    Chapter(7, "the ablation: ResNet-18, 8 rows x 2 repeats x 3 epochs", (
        # Rows without the precision technique train in strict fp32 (Techniques.precision
        # "fp32": d2lgpu.train turns TF32 off for matmuls and cuDNN).
        Train("ablation, d2l-style row (DataLoader): 2 x 3 epochs", "resnet18", (1, 28, 28),
              15_000, 256, epochs=3, runs=2, precision="fp32", eval_examples=10_000,
              loader="pil"),
        Train("ablation, 2 fp32 rows on device data: 2 x 3 epochs each", "resnet18", (1, 28, 28),
              15_000, 256, epochs=3, runs=4, precision="fp32", eval_examples=10_000),
        Train("ablation, 5 autocast rows: 2 x 3 epochs each", "resnet18", (1, 28, 28), 15_000,
              256, epochs=3, runs=10, precision="amp", eval_examples=10_000),
        Fixed("compile and CUDA-graph rows: ResNet-18 compiled 4 times", compiles=4),
        Fixed("small CNN compiled: first call, then default, reduce-overhead, max-autotune",
              small_compiles=3, autotunes=1),
        Matmuls("roofline: 6 matmuls 8192^2, autocast's format (T4 fp16, H100 bf16)",
                2 * 8192**3, 6, precision="amp"),
        Traffic("roofline: copies and adds of 2**27 floats", 12 * 2**27, 30),
        Train("CUDA graphs and memory snapshot: small CNN, 3 passes over 60,000", "small_cnn",
              (1, 28, 28), 60_000, 256, epochs=3),
    )),
    Chapter(8, "2-node FSDP torchrun --full on the CPU; checkpointing ResNet-18", (
        Train("checkpointing trade-off: ResNet-18, batch 128, 2 + 2 x 10 steps", "resnet18",
              (1, 28, 28), 128, 128, runs=26, precision="fp32"),
        Train("training memory: ResNet-18 batch 128; MLP 2048/8192/8 batch 64, 3 optimizers",
              "residual_mlp 2048/8192/8", (1, 28, 28), 64, 64, runs=12, kind="gemm"),
        Fixed("launch (2 ranks) and the FSDP2 lesson script (3 ranks)", process_starts=4),
        Train("2-node fsdp_train --full: 3 epochs of 60,000, batch 60, on the CPU",
              "residual_mlp 256/1024/4", (1, 28, 28), 60_000, 60, epochs=3,
              eval_examples=10_000, on="cpu", processes=2),
        Fixed("2 agents, 2 workers, 2 restarted workers", process_starts=3),
    )),
    Chapter(9, "pipeline, tensor-parallel and bubble jobs on 2 and 4 gloo ranks (CPU)", (
        Train("two halves of an MLP 2048/8192/8: 6 steps of 32, 5 timed of 256",
              "mlp blocks 2048/8192/8", (2048,), 1472, 1472, precision="fp32", kind="gemm"),
        Fixed("torchrun lesson (4 ranks), launch 2 and 4 ranks", process_starts=4),
        # Fixed-cost stages sleep 3 x 0.04 s per microbatch: a step of m microbatches on
        # 2 stages lasts about 0.12 (m + 1) s; m = 2, 4, 8, 2 repeats, 3 schedules.
        Fixed("fixed-cost pipeline schedules", seconds=3 * 2 * 0.12 * (3 + 5 + 9)),
        # The bubble: microbatches of 8 x 16 tokens through 4 blocks of 256/1024, 2 stages,
        # m = 2..32 (62 in all), 7 repeats, each step timed again stage by stage.
        Train("bubble: 7 x 62 microbatches of 128 tokens, timed twice", "mlp blocks 256/1024/4",
              (256,), 62 * 128, 8 * 16, runs=14, on="cpu", processes=2),
    )),
)

# --------------------------------------------------------------------------------------
# The arithmetic and the table
# --------------------------------------------------------------------------------------

BUDGET_SECONDS = 30 * 60


def estimate_seconds(flops: float, peak_tflops: float, utilisation: float,
                     overhead_s: float) -> float:
    """time = FLOPs / (peak x utilisation) + overhead: the rule every estimate here follows."""
    if not (peak_tflops > 0 and 0 < utilisation <= 1 and flops >= 0 and overhead_s >= 0):
        raise ValueError("need flops >= 0, peak > 0, 0 < utilisation <= 1, overhead >= 0")
    return flops / (peak_tflops * 1e12 * utilisation) + overhead_s


@dataclass(frozen=True)
class ChapterEstimate:
    chapter: Chapter
    chip: Chip
    costs: tuple[Cost, ...]

    @property
    def seconds(self) -> float:
        return self.chip.overhead_s + sum(c.seconds for c in self.costs)

    @property
    def at_peak(self) -> float:
        return sum(c.at_peak for c in self.costs)

    @property
    def gpu_flops(self) -> float:
        return sum(c.gpu_flops for c in self.costs)


def estimate_chapter(chapter: Chapter, chip: Chip) -> ChapterEstimate:
    return ChapterEstimate(chapter, chip, tuple(w.cost(chip) for w in chapter.workloads))


def fits(seconds: float, budget: float = BUDGET_SECONDS) -> str:
    """"yes" when ``seconds`` is within the budget (30 minutes), else "no"."""
    return "yes" if seconds <= budget else "no"


def _minutes(seconds: float) -> str:
    if seconds == 0:
        return "-"
    if seconds < 1:
        return "<1 s"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _flops(flops: float) -> str:
    return "-" if flops == 0 else f"{flops / 1e15:.2f} PFLOP" if flops >= 1e14 else \
        f"{flops / 1e12:.1f} TFLOP"


def table(estimates: dict[int, dict[str, ChapterEstimate]]) -> str:
    rows = ["| ch | dominant work | GPU FLOPs, T4 / H100 | T4: GPU work at peak | T4 estimate "
            "| H100: GPU work at peak | H100 estimate | fits 30 min on a T4 |",
            "|---|---|---|---|---|---|---|---|"]
    for number, by_chip in estimates.items():
        t4, h100 = by_chip["T4"], by_chip["H100"]
        flops = _flops(t4.gpu_flops)
        if _flops(h100.gpu_flops) != flops:  # the H100 runs sweep rows a T4 skips
            flops += f" / {_flops(h100.gpu_flops)}"
        rows.append(f"| {number} | {t4.chapter.dominant} | {flops} "
                    f"| {_minutes(t4.at_peak)} | {_minutes(t4.seconds)} "
                    f"| {_minutes(h100.at_peak)} | {_minutes(h100.seconds)} "
                    f"| {fits(t4.seconds)} |")
    return "\n".join(rows)


def detail(estimates: dict[int, dict[str, ChapterEstimate]]) -> str:
    lines = []
    for number, by_chip in estimates.items():
        t4, h100 = by_chip["T4"], by_chip["H100"]
        lines.append(f"\nchapter {number}: {t4.chapter.dominant}")
        for w, a, b in zip(t4.chapter.workloads, t4.costs, h100.costs, strict=True):
            lines.append(f"  {w.what[:78]:78} T4 {_minutes(a.seconds):>9} {a.note:22} "
                         f"H100 {_minutes(b.seconds):>9} {b.note}")
        lines.append(f"  {'fixed per chapter (kernel, imports, data, plots)':78} "
                     f"T4 {_minutes(T4.overhead_s):>9} {'':22} H100 {_minutes(H100.overhead_s):>9}")
    return "\n".join(lines)


def estimate_all() -> dict[int, dict[str, ChapterEstimate]]:
    return {ch.number: {chip.name: estimate_chapter(ch, chip) for chip in CHIPS}
            for ch in CHAPTERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--detail", action="store_true", help="print every workload too")
    args = parser.parse_args()
    torch.set_num_threads(1)  # small counts: one thread is enough and leaves the rest alone
    estimates = estimate_all()
    print(table(estimates))
    if args.detail:
        print(detail(estimates))


if __name__ == "__main__":
    main()
