"""What this machine offers, and why CUDA is missing when it is (chapter 1).

:func:`diagnose_cuda` is a pure function of the facts, so every branch is tested without a GPU.
Nothing here starts a subprocess or waits, so a report cannot hang.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from d2lgpu.chips import CUDA_13_DROPPED_BELOW, GPU_DATASHEETS, native_tensor_core_formats
from d2lgpu.runtime.checks import error_line
from d2lgpu.runtime.config import describe_mode
from d2lgpu.runtime.gpus import (
    as_device,
    build_runs_on,
    capability_or_none,
    cuda_arch_list,
    num_gpus,
    require_cuda_device,
)

__all__ = [
    "CudaDiagnosis", "CudaProblem", "EnvironmentReport", "GpuInfo", "GpuMemory",
    "NvmlGpuReading", "NvmlView", "diagnose_cuda", "diagnose_this_machine",
    "environment_report", "device_numbers", "format_report", "gpu_in_numbers", "gpu_memory",
    "nccl_version", "parse_cuda_visible_devices", "print_report", "print_setup", "read_nvml",
]

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
_MIB = 2**20
_GIB = 2**30


def print_setup() -> None:
    """Print the versions, what runs where and, without a GPU, why; then the workload (chapter 1;
    every chapter's first cell calls it)."""
    import d2lgpu
    from d2lgpu.runtime.config import workload

    usable = num_gpus()  # one look at the GPUs, for every line below
    mode = {"quick": "quick mode", "cpu": "CPU mode", "full": "full mode"}[workload(usable > 0)]
    lines = [f"d2lgpu {d2lgpu.__version__}, torch {torch.__version__}, "
             f"Python {platform.python_version()}"]
    if usable:
        lines.append(f"{usable} CUDA GPU{'s' if usable > 1 else ''} here: the chapters run on "
                     f"them, in {mode}.")
        for i in range(usable):
            major, minor = torch.cuda.get_device_capability(i)
            lines.append(f"  cuda:{i}  {torch.cuda.get_device_name(i)}  "
                         f"(compute capability {major}.{minor})")
    else:
        listed = torch.cuda.device_count() if torch.version.cuda else 0
        head = (f"CUDA lists {listed} GPU(s), but this torch cannot use them" if listed
                else "No CUDA GPU here")
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "this torch has no kernels for a GPU here" if listed
               else "CUDA finds no usable GPU")
        lines += [f"{head}: everything runs on the CPU, in {mode}; {why}.",
                  "  Why, and how to get a GPU: `python -m d2lgpu info` (chapter 1)."]
    lines.append(describe_mode(usable > 0))
    print("\n".join(lines))


def parse_cuda_visible_devices(value: str | None) -> list[int] | list[str] | None:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value leaves visible (None: unset, all), as CUDA
    reads it: up to the first entry that is no number or UUID; a repeat hides all (chapter 1)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"a {VISIBLE_DEVICES_ENV} value is a string such as '0,1' (or None when "
                        f"unset), got {type(value).__name__} {value!r}; write str({value!r})")
    prefix = value[:4] if value.startswith(("GPU-", "MIG-")) else None
    visible: list = []
    for entry in value.split(","):
        number = re.match(r"[+-]?\d+", entry.strip())  # what C's strtoul reads
        item = entry if prefix else int(number.group()) if number else None
        if item in visible:
            return []
        valid = entry.startswith(prefix) if prefix else item is not None and item >= 0
        if not valid:
            break
        visible.append(item)
    return visible


@dataclass(frozen=True)
class CudaProblem:
    """One reason CUDA is unusable (or less usable than intended), and its fix."""

    code: str
    why: str
    fix: str


@dataclass(frozen=True)
class CudaDiagnosis:
    """Whether CUDA is usable, and every problem found, most fundamental first."""

    usable: bool
    device_count: int
    problems: tuple[CudaProblem, ...] = ()

    @property
    def cause(self) -> str:  # the first problem's code
        return self.problems[0].code if self.problems else "ok"

    def __str__(self) -> str:
        if self.usable:
            head = f"CUDA is usable: {self.device_count} GPU(s) visible."
        elif self.device_count:
            head = (f"CUDA is NOT usable: it lists {self.device_count} GPU(s), but this torch "
                    "cannot run on all of them, so the course runs everything on the CPU.")
        else:
            head = "CUDA is NOT usable: torch will run everything on the CPU."
        lines = [head]
        for problem in self.problems:
            lines += [f"  why: {problem.why}", f"  fix: {problem.fix}"]
        return "\n".join(lines)


def _visible_devices_problems(visible_devices_env: str | None,
                              physical_gpu_count: int | None) -> list[CudaProblem]:
    """What is wrong with ``CUDA_VISIBLE_DEVICES``: it hides every GPU, or it is malformed."""
    visible = parse_cuda_visible_devices(visible_devices_env)
    if visible is None:
        return []
    shown = f"{VISIBLE_DEVICES_ENV}={visible_devices_env!r}"
    # CUDA stops at the first index that does not exist: a first one past the end hides all.
    n = physical_gpu_count
    if not visible or (n is not None and isinstance(visible[0], int) and visible[0] >= n):
        seen = "" if n is None else f" (the driver sees only {n} GPU(s))"
        why = (f"{shown} hides every GPU: CUDA reads GPU indices or UUIDs separated by commas, "
               f"stops at the first entry that is neither or past the last GPU{seen}, and hides "
               "all if one is repeated.")
        return [CudaProblem("hidden_by_env", why, (
            f"unset it (`unset {VISIBLE_DEVICES_ENV}` in the shell; in Python "
            f"`os.environ.pop('{VISIBLE_DEVICES_ENV}', None)` before anything touches CUDA, so "
            "in a notebook restart the kernel first) or set it to GPU indices such as `0` or "
            "`0,1`."))]
    if [str(item) for item in visible] != [e.strip() for e in visible_devices_env.split(",")]:
        why = (f"{shown} is malformed: CUDA reads only the number each entry starts with and "
               f"stops at the first entry without one, so it sees only {visible}.")
        return [CudaProblem("malformed_env", why, "write the indices you mean separated by "
                            "commas, without gaps or spaces, e.g. `0,1`.")]
    return []


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in str(version).split(".")[:2])
    except ValueError:
        return None


def _arch_missing(index: int, capability: tuple[int, int], arch_list: Sequence[str],
                  cuda_build: str | None) -> CudaProblem:
    major, minor = capability
    listed = " ".join(arch_list) or "(empty)"
    why = (f"cuda:{index} has compute capability {major}.{minor} (sm_{major}{minor}), which "
           f"this torch build has no kernels for: torch.cuda.get_arch_list() is {listed}. CUDA "
           "sees the GPU, but every kernel fails with 'no kernel image is available for "
           "execution on the device', so the course runs on the CPU instead.")
    if (major, minor) < CUDA_13_DROPPED_BELOW:
        if (_version_tuple(cuda_build) or ()) >= (13,):
            why += " CUDA 13 dropped GPUs below compute capability 7.5 (V100, P100, ...)."
        # torch 2.15's release wheels (PYTORCH_RELEASES_CODE_CC in torch/cuda/__init__.py)
        which = ("a cu126 wheel, the only one of torch's current release wheels that still "
                 "carries kernels below sm_75 (its list runs from sm_50 to sm_90): "
                 "`pip install torch torchvision --index-url "
                 "https://download.pytorch.org/whl/cu126`; not just any CUDA 12 build")
    else:
        which = ("a newer torch, or one built for a newer CUDA (the selector at "
                 "https://pytorch.org/get-started/locally/ lists them)")
    return CudaProblem(
        "arch_missing", why,
        f"install a torch build that lists sm_{major}{minor} or older sm_{major}x: {which}; "
        "check with `torch.cuda.get_arch_list()`. Where other GPUs here do have kernels, "
        f"hiding this one with {VISIBLE_DEVICES_ENV} (listing only the others) lets the course "
        "use them.",
    )


#: The two problems whose words need no facts: a CPU-only torch, and no NVIDIA driver.
_CPU_BUILD = CudaProblem(
    "cpu_build", "this torch is a CPU-only build (torch.version.cuda is None): it cannot use a "
    "GPU even if one is present.",
    "install a CUDA build of torch (on Linux PyPI's default is one): `pip uninstall -y torch "
    "torchvision`, then `pip install torch torchvision --index-url https://download.pytorch.org/"
    "whl/cu126` (https://pytorch.org/get-started/locally/ names the CUDA versions), then restart "
    "the Python process or kernel.",
)
_NO_DRIVER = CudaProblem(
    "no_driver", "no NVIDIA driver was found (NVML cannot load and /proc/driver/nvidia is "
    "missing): this machine, VM or container has no usable NVIDIA GPU.",
    "on Colab: Runtime > Change runtime type > choose a GPU (e.g. T4), then rerun. On Kaggle: "
    "Settings > Accelerator > GPU (e.g. 'GPU T4 x2'; needs a phone-verified account). Locally: "
    "install the NVIDIA driver (check with `nvidia-smi`); in a container, start it with GPUs "
    "passed through (e.g. `docker run --gpus all`, which needs the NVIDIA Container Toolkit).",
)


def diagnose_cuda(
    *, cuda_build: str | None, visible_devices_env: str | None, driver_found: bool,
    device_count: int, physical_gpu_count: int | None = None,
    driver_cuda_version: str | None = None,
    gpu_capabilities: Sequence[tuple[int, int] | None] = (), arch_list: Sequence[str] | None = None,
) -> CudaDiagnosis:
    """Whether CUDA is usable and, if not, why and the fix, from the facts alone (chapter 1)."""
    env_problems = _visible_devices_problems(visible_devices_env, physical_gpu_count)
    if device_count > 0:
        arch_problems = [_arch_missing(i, tuple(cap), arch_list, cuda_build)
                         for i, cap in enumerate(gpu_capabilities) if arch_list is not None
                         and cap is not None and not build_runs_on(tuple(cap), arch_list)]
        return CudaDiagnosis(not arch_problems, device_count, tuple(arch_problems + env_problems))

    # Most fundamental first: the build, then the driver, then the variable.
    problems = [_CPU_BUILD] if cuda_build is None else []
    problems += [] if driver_found else [_NO_DRIVER]
    problems += env_problems
    driver, build = _version_tuple(driver_cuda_version), _version_tuple(cuda_build)
    if not problems and driver and build and driver < build:
        problems.append(CudaProblem(
            "driver_too_old",
            f"the NVIDIA driver supports CUDA up to {driver_cuda_version} (the header of "
            f"`nvidia-smi` shows it too), older than the CUDA {cuda_build} this torch is built "
            "for, and CUDA did not start.",
            "install the torch built for a CUDA this driver supports, from PyTorch's wheel index "
            f"for it: e.g. `pip install torch torchvision --index-url "
            f"https://download.pytorch.org/whl/cu126` for a driver of CUDA 12.x (the selector at "
            "https://pytorch.org/get-started/locally/ lists the indices); on Colab or Kaggle, "
            "keep the torch the platform installed, which matches its driver. Or update the "
            f"driver to one of CUDA {cuda_build.split('.')[0]}.x or newer.",
        ))
    if not problems:
        problems.append(CudaProblem(
            "no_usable_device",
            f"an NVIDIA driver is present and torch is built for CUDA {cuda_build}, yet CUDA "
            "finds no usable GPU: the driver may be too old for it, the GPU taken by another "
            "process in exclusive mode, or a container may lack the device files.",
            "check `nvidia-smi` (its header names the newest CUDA the driver supports; it lists "
            "the processes holding the GPU); update the driver or install a torch for an older "
            "CUDA (https://pytorch.org/get-started/locally/).",
        ))
    return CudaDiagnosis(False, 0, tuple(problems))


def diagnose_this_machine(nvml: NvmlView | None = None) -> CudaDiagnosis:
    """:func:`diagnose_cuda` of this process and machine (chapter 1); ``nvml``: a view read."""
    nvml = read_nvml() if nvml is None else nvml
    # Not num_gpus(), which is 0 without kernels for the GPUs: the diagnosis explains that.
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return diagnose_cuda(
        cuda_build=torch.version.cuda,
        visible_devices_env=os.environ.get(VISIBLE_DEVICES_ENV),
        driver_found=nvml.error is None or Path("/proc/driver/nvidia").exists(),
        device_count=count,
        physical_gpu_count=len(nvml.gpus) if nvml.error is None else None,
        driver_cuda_version=nvml.cuda_driver_version,
        gpu_capabilities=[capability_or_none(i) for i in range(count)],
        arch_list=cuda_arch_list() if count else None,
    )


@dataclass(frozen=True)
class NvmlGpuReading:
    """One physical GPU as the driver sees it now; None: unsupported or failed (``error``)."""

    index: int
    name: str
    uuid: str
    utilization_percent: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: int | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    error: str | None = None
    memory_free_bytes: int | None = None


@dataclass(frozen=True)
class NvmlView:
    """The driver's version and every physical GPU in NVML's order, or why NVML is unavailable."""

    driver_version: str | None
    gpus: tuple[NvmlGpuReading, ...]
    error: str | None
    #: The newest CUDA version the driver supports (``nvidia-smi``'s header), e.g. "12.4".
    cuda_driver_version: str | None = None


def read_nvml() -> NvmlView:
    """The driver's version and live per-GPU readings through NVML; never raises (chapter 1)."""
    import pynvml  # nvidia-ml-py, a dependency; loading NVML itself is what can fail

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        why = str(exc)
        if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
            why += " (NVML ships with the NVIDIA driver, so no driver is installed here)"
        return NvmlView(None, (), f"NVML cannot start: {why}")
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # 12040 for CUDA 12.4
        gpus = tuple(_read_nvml_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount()))
        return NvmlView(pynvml.nvmlSystemGetDriverVersion(), gpus, None,
                        f"{cuda // 1000}.{cuda % 1000 // 10}")
    except pynvml.NVMLError as exc:
        return NvmlView(None, (), f"NVML query failed: {exc}")
    finally:
        with contextlib.suppress(pynvml.NVMLError):  # a GPU lost meanwhile fails this too
            pynvml.nvmlShutdown()


def _read_nvml_gpu(pynvml, index: int) -> NvmlGpuReading:  # type: ignore[no-untyped-def]
    """One GPU's readings: None for a query it refuses, noted in ``error`` unless unsupported."""
    errors: list[str] = []

    def read(what: str, call, *args):  # type: ignore[no-untyped-def]
        try:
            return call(*args)
        except pynvml.NVMLError as exc:
            if not isinstance(exc, getattr(pynvml, "NVMLError_NotSupported", ())):
                errors.append(f"{what}: {exc}")
            return None

    handle = read("NVML cannot reach this GPU", pynvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return NvmlGpuReading(index, "?", "", error="; ".join(errors))
    name = read("name", pynvml.nvmlDeviceGetName, handle)
    uuid = read("uuid", pynvml.nvmlDeviceGetUUID, handle)
    memory = read("memory", pynvml.nvmlDeviceGetMemoryInfo, handle)
    rates = read("utilization", pynvml.nvmlDeviceGetUtilizationRates, handle)
    power_mw = read("power", pynvml.nvmlDeviceGetPowerUsage, handle)
    limit_mw = read("power limit", pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    temperature = read("temperature", pynvml.nvmlDeviceGetTemperature, handle,
                       pynvml.NVML_TEMPERATURE_GPU)
    return NvmlGpuReading(  # x and x.field: None where the query failed
        index, name or "?", uuid or "", utilization_percent=rates and rates.gpu,
        memory_used_bytes=memory and memory.used, memory_total_bytes=memory and memory.total,
        memory_free_bytes=memory and memory.free, temperature_c=temperature,
        power_watts=power_mw and power_mw / 1000, power_limit_watts=limit_mw and limit_mw / 1000,
        error="; ".join(errors) or None,
    )


@dataclass(frozen=True)
class GpuInfo:
    """One GPU visible to torch, as ``cuda:index``; ``error`` says what could not be read."""

    index: int
    name: str
    capability: tuple[int, int]
    total_memory_bytes: int | None
    free_memory_bytes: int | None
    multiprocessor_count: int
    native_formats: tuple[str, ...]
    uuid: str
    pycuda_attributes: dict[str, int] | None = None
    error: str | None = None


@dataclass(frozen=True)
class EnvironmentReport:
    """Everything about this machine that decides how (and whether) torch uses GPUs."""

    python_version: str
    platform: str
    torch_version: str
    cuda_build: str | None
    cudnn_version: str | None
    nccl_version: str | None
    visible_devices_env: str | None
    gpus: tuple[GpuInfo, ...]
    nvml: NvmlView
    pycuda_status: str
    diagnosis: CudaDiagnosis


def _format_cudnn(version: int) -> str:
    """cuDNN encodes its version as one int: 9.x as MMmmpp (92400), 8.x as Mmpp (8902)."""
    step = 10000 if version >= 90000 else 1000
    return f"{version // step}.{version % step // 100}.{version % 100}"


def _cudnn_version() -> str | None:
    built = torch.version.cuda is not None and torch.backends.cudnn.is_available()
    return _format_cudnn(torch.backends.cudnn.version()) if built else None


def nccl_version() -> str | None:
    """The NCCL version this PyTorch build ships (e.g. ``"2.21.5"``), or None if it has none."""
    if torch.version.cuda is None:
        return None
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (RuntimeError, AttributeError):  # builds without NCCL (Windows, macOS)
        return None


def _pycuda_attributes(count: int) -> tuple[str, list[dict[str, int] | None]]:
    """pycuda's raw device attributes per visible GPU, or a note on why there are none."""
    try:
        import pycuda.driver as pycuda_driver
    except ImportError:
        return ("pycuda is not installed (optional: `pip install pycuda` or `pip install "
                "'d2lgpu[pycuda]'`; building it needs the CUDA toolkit)", [None] * count)
    try:
        pycuda_driver.init()
        attributes = [{str(k): int(v) for k, v in pycuda_driver.Device(i).get_attributes().items()}
                      for i in range(count)]
    except pycuda_driver.Error as exc:
        return f"pycuda is installed but cannot query the GPUs: {exc}", [None] * count
    return "pycuda is installed", attributes


def _read_gpu(index: int, pycuda_attributes: dict[str, int] | None, nvml: NvmlView) -> GpuInfo:
    """``cuda:index``, read without a CUDA context (free memory is NVML's); failures: ``error``."""
    try:
        props = torch.cuda.get_device_properties(index)
    except Exception as exc:  # any failure of one GPU is reported, not raised
        return GpuInfo(index, "?", (0, 0), None, None, 0, (), "", pycuda_attributes,
                       error=f"properties: {error_line(exc)}")
    uuid, capability = str(props.uuid), (props.major, props.minor)
    free, total = None, props.total_memory
    for reading in nvml.gpus if uuid else ():  # an empty UUID would match every GPU
        if reading.uuid.lower().endswith(uuid.lower()) and reading.memory_free_bytes is not None:
            free, total = reading.memory_free_bytes, reading.memory_total_bytes
    return GpuInfo(index, props.name, capability, total, free, props.multi_processor_count,
                   tuple(native_tensor_core_formats(capability)), uuid, pycuda_attributes)


def environment_report() -> EnvironmentReport:
    """Collect the :class:`EnvironmentReport` of this process (chapter 1)."""
    nvml = read_nvml()
    diagnosis = diagnose_this_machine(nvml)
    count = diagnosis.device_count  # the GPUs torch lists, with or without kernels for them
    pycuda_status, pycuda_attrs = _pycuda_attributes(count)
    return EnvironmentReport(
        sys.version.split()[0], platform.platform(), torch.__version__, torch.version.cuda,
        _cudnn_version(), nccl_version(), os.environ.get(VISIBLE_DEVICES_ENV),
        tuple(_read_gpu(i, pycuda_attrs[i], nvml) for i in range(count)), nvml, pycuda_status,
        diagnosis,
    )


# pycuda exposes ~100 attributes; these are the ones the course talks about.
_PYCUDA_SHOWN = ("MAX_THREADS_PER_BLOCK", "WARP_SIZE", "MAX_SHARED_MEMORY_PER_BLOCK",
                 "L2_CACHE_SIZE", "GLOBAL_MEMORY_BUS_WIDTH", "ASYNC_ENGINE_COUNT", "ECC_ENABLED")


def _or_na(value: object, unit: str = "") -> str:
    return "n/a" if value is None else f"{value}{unit}"


def _describe_mode_or_error() -> str:
    """The mode line, or the configuration error: a report must not fail on a bad setting."""
    try:
        return describe_mode()
    except ValueError as exc:
        return f"configuration error: {exc}"


def format_report(report: EnvironmentReport) -> str:
    """The report as readable text, with the workload this process runs (what ``python -m d2lgpu
    info`` prints) (chapter 1)."""
    lines = [
        "== d2lgpu environment report ==",
        f"python {report.python_version} on {report.platform}",
        f"torch {report.torch_version}; built with CUDA {_or_na(report.cuda_build)}, "
        f"cuDNN {_or_na(report.cudnn_version)}, NCCL {_or_na(report.nccl_version)}",
        f"{VISIBLE_DEVICES_ENV}: "
        + ("unset (all GPUs visible)" if report.visible_devices_env is None
           else repr(report.visible_devices_env)),
        _describe_mode_or_error(),
        "",
        f"-- GPUs visible to torch: {len(report.gpus)} --",
    ]
    for gpu in report.gpus:
        if gpu.name == "?" and gpu.error is not None:
            lines += [f"cuda:{gpu.index}  cannot be read: {gpu.error}",
                      "  fix: check `nvidia-smi` for this GPU (lost, or held by another "
                      "process in exclusive mode); the other GPUs are unaffected"]
            continue
        if gpu.free_memory_bytes is None or gpu.total_memory_bytes is None:
            total = ("?" if gpu.total_memory_bytes is None
                     else f"{gpu.total_memory_bytes / _GIB:.2f}")
            memory = f"  memory: free unknown, {total} GiB in all"
        else:
            memory = (f"  memory: {gpu.free_memory_bytes / _GIB:.2f} GiB free of "
                      f"{gpu.total_memory_bytes / _GIB:.2f} GiB")
        major, minor = gpu.capability
        lines += [
            f"cuda:{gpu.index}  {gpu.name}  (compute capability {major}.{minor}, "
            f"{gpu.multiprocessor_count} SMs)",
            memory,
            "  Tensor Core formats (native): "
            + (", ".join(gpu.native_formats) or "none (fp32 only)"),
        ]
        if "bf16" not in gpu.native_formats:
            lines.append("  note: no bf16 Tensor Cores on this GPU, so bf16 runs emulated "
                         "(correct, slow); use fp16 with a GradScaler. "
                         "torch.cuda.is_bf16_supported() counts emulation as support: do not "
                         "go by it.")
        if gpu.pycuda_attributes:
            shown = {k: v for k, v in gpu.pycuda_attributes.items() if k in _PYCUDA_SHOWN}
            lines.append("  pycuda: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    if not report.gpus:
        lines.append("(none)")
    lines += ["", "-- NVML (the driver's live view, all physical GPUs) --",
              format_nvml_view(report.nvml), "", "-- pycuda --", report.pycuda_status, "",
              "-- diagnosis --", str(report.diagnosis)]
    return "\n".join(lines)


def print_report(report: EnvironmentReport | None = None) -> None:
    """Print :func:`format_report` of ``report`` (by default, of this machine) (chapter 1)."""
    print(format_report(environment_report() if report is None else report))


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory in bytes: held by tensors, by the caching allocator, the peak since
    ``reset_peak_memory_stats``, and the driver's free and total for the whole GPU."""

    allocated: int
    reserved: int
    peak_allocated: int
    free: int
    total: int

    def __str__(self) -> str:
        return (f"allocated {self.allocated / _MIB:8.1f} MiB | reserved "
                f"{self.reserved / _MIB:8.1f} MiB | peak {self.peak_allocated / _MIB:8.1f} MiB | "
                f"driver: free {self.free / _MIB:8.0f} of {self.total / _MIB:.0f} MiB")


def _gpu_only(device: torch.device | str | int, what: str, why: str) -> torch.device:
    device = as_device(device)
    if device.type != "cuda":
        raise ValueError(f"{what} needs a CUDA device, got {device}: {why}. Pass "
                         "d2lgpu.try_gpu() and check that it is a CUDA device first.")
    return require_cuda_device(device, what)


def gpu_memory(device: torch.device | str | int = 0) -> GpuMemory:
    """Read :class:`GpuMemory` for a CUDA device (chapter 1)."""
    device = _gpu_only(device, "gpu_memory", "the CPU has no caching allocator statistics")
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                     torch.cuda.max_memory_allocated(device), int(free), int(total))


def format_nvml_view(view: NvmlView, mark_uuid: str | None = None,
                     mark: str = "<- this GPU") -> str:
    """NVML's readings as text, one line per physical GPU (chapter 1); ``mark`` follows the
    GPU whose UUID ends with ``mark_uuid`` (torch's, which lacks NVML's ``GPU-``)."""
    if view.error is not None:
        return view.error
    lines = [f"driver {view.driver_version}, {len(view.gpus)} GPU(s)"]
    for r in view.gpus:
        memory = (
            "n/a" if r.memory_used_bytes is None or r.memory_total_bytes is None
            else f"{r.memory_used_bytes / _GIB:.1f}/{r.memory_total_bytes / _GIB:.1f} GiB"
        )
        power = "n/a" if r.power_watts is None else f"{r.power_watts:.0f} W"
        if r.power_watts is not None and r.power_limit_watts is not None:
            power += f" of {r.power_limit_watts:.0f} W"
        tail = f"  {mark}" if mark_uuid and r.uuid.endswith(mark_uuid) else ""
        lines.append(
            f"nvml:{r.index} {r.name}: utilisation {_or_na(r.utilization_percent, '%')}, "
            f"memory {memory}, temperature {_or_na(r.temperature_c, ' C')}, "
            f"power {power}{tail}"
        )
        if r.error is not None:  # what this GPU would not say (permissions, a lost GPU)
            lines.append(f"  failed: {r.error}")
    return "\n".join(lines)


def read_nvml_while_busy(device: torch.device | str | int) -> NvmlView:
    """Read NVML while ``device`` works through matrix products queued for about 3 s
    (chapter 1): launches are asynchronous, so Python reads meanwhile."""
    dev = _gpu_only(device, "read_nvml_while_busy", "NVML watches NVIDIA GPUs only")
    a = torch.randn(8192, 8192, device=dev)
    b = a @ a  # the first product also starts cuBLAS, so it is not timed
    torch.cuda.synchronize(dev)
    start = time.perf_counter()
    b = a @ a
    torch.cuda.synchronize(dev)
    for _ in range(math.ceil(3.0 / (time.perf_counter() - start))):
        b = a @ a  # queued: Python goes on while the GPU computes
    time.sleep(1.0)
    view = read_nvml()
    torch.cuda.synchronize(dev)
    del a, b
    return view


def wrapped(text: str, width: int = 100) -> str:
    """``text`` with long lines wrapped at spaces, continuations indented four more (chapter 1)."""
    out = []
    for line in text.splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        out += textwrap.wrap(line, width=width, subsequent_indent=indent + "    ",
                             break_long_words=False, break_on_hyphens=False) or [""]
    return "\n".join(out)


#: The rows of :func:`gpu_in_numbers`, in the order of the lesson.
GPU_NUMBERS_ROWS = (
    "compute capability", "SMs", "warp size (threads)", "max threads per SM",
    "registers per SM (32-bit)", "shared memory per SM, max", "L1 + shared memory per SM",
    "L2 cache", "memory", "memory bandwidth", "Tensor Cores",
)


def device_numbers(props: object) -> dict[str, object]:
    """The figures of :data:`GPU_NUMBERS_ROWS` that ``torch.cuda.get_device_properties(i)``
    gives, keyed like :data:`GPU_DATASHEETS`; fields newer than torch 2.9 may be missing."""
    out: dict[str, object] = {
        "compute capability": f"{props.major}.{props.minor}",
        "SMs": int(props.multi_processor_count),
        "memory": f"{props.total_memory / 1e9:.1f} GB",
    }
    optional = {
        "warp size (threads)": ("warp_size", int),
        "max threads per SM": ("max_threads_per_multi_processor", int),
        "registers per SM (32-bit)": ("regs_per_multiprocessor", int),
        "shared memory per SM, max": ("shared_memory_per_multiprocessor",
                                      lambda b: f"{b / 2**10:g} KiB"),
        "L2 cache": ("L2_cache_size", lambda b: f"{b / 1e6:.1f} MB"),
    }
    for key, (attr, show) in optional.items():
        value = getattr(props, attr, None)
        if value:
            out[key] = show(value)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:  # two transfers per clock, bus_width / 8 bytes each
        out["memory bandwidth"] = f"{2 * clock_khz * 1e3 * bus_bits / 8 / 1e9:.0f} GB/s"
    return {key: out[key] for key in GPU_NUMBERS_ROWS if key in out}


def gpu_in_numbers(props: object | None = None) -> str:
    """A table: this GPU's figures (``props`` from ``get_device_properties``, or None
    without a GPU) beside :data:`GPU_DATASHEETS` (chapter 1). "-" marks a figure not known."""
    columns = dict(GPU_DATASHEETS)
    if props is not None:
        columns = {f"yours: {getattr(props, 'name', '?')}": device_numbers(props), **columns}
    headers = ["", *columns]
    rows = [[key, *(str(col.get(key, "-")) for col in columns.values())]
            for key in GPU_NUMBERS_ROWS]
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
             for row in [headers, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
