"""Which reduced precision a device really runs fast, how to use it, and how to measure it.

Tensor Cores run fp16 from compute capability 7.0 (Volta, Turing) and bf16
and tf32 from 8.0 (Ampere, Ada, Hopper). ``torch.cuda.is_bf16_supported()``
is not enough to decide: on a 7.x GPU such as Kaggle's T4 it can say True
because bf16 is *emulated*, which is correct but slow. The policy here goes
by compute capability instead. On a CPU it goes by the instructions the CPU
reports (:func:`cpu_has_native_bf16`): bf16 where it has bf16 instructions, fp32
where bf16 would be emulated.

The second half of the module is the precision sweep of chapter 6: the same
model trained for a few steps in strict FP32, TF32, fp16 autocast with a
GradScaler and bf16 autocast, over a range of batch sizes, recording step
time, peak memory and the loss reached. A batch size that does not fit is
recorded as ``"OOM"`` and the sweep goes on. Repeats, with the modes taking
turns, let :func:`compare_sweep_modes` tell a difference from the machine's noise.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from d2lgpu.chips import native_tensor_core_formats
from d2lgpu.runtime.checks import (
    check_bool,
    check_capability,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_sequence,
    loss_diverged,
)
from d2lgpu.runtime.config import cpu_bf16_override
from d2lgpu.runtime.gpus import as_device
from d2lgpu.timing import time_fn

__all__ = [
    "CPU_BF16_FLAGS",
    "PRECISIONS",
    "PRECISION_MODES",
    "PrecisionPolicy",
    "SavedActivations",
    "SweepComparison",
    "SweepRow",
    "amp_sweep_mode",
    "check_precision",
    "compare_sweep_modes",
    "cpu_flags",
    "cpu_has_native_bf16",
    "format_sweep_table",
    "has_fp32_precision_api",
    "mode_unavailable_reason",
    "precision_policy",
    "precision_sweep",
    "random_batch_maker",
    "saved_activation_bytes",
    "sweep_cnn",
    "sweep_mlp",
    "tf32_matmuls",
]


def _check_cpuinfo(cpuinfo: object) -> None:
    """A TypeError naming ``cpuinfo`` unless it is a path (an int would open a descriptor)."""
    if isinstance(cpuinfo, bool) or not isinstance(cpuinfo, (str, os.PathLike)):
        raise TypeError(f"cpuinfo must be a path such as '/proc/cpuinfo', "
                        f"got {type(cpuinfo).__name__} {cpuinfo!r}")


#: The one precision vocabulary of the course. Every entry point that trains takes
#: ``precision=`` with one of these: "auto" lets the device decide
#: (:func:`precision_policy`), "fp32" is strict fp32 (TF32 off), "tf32" is fp32 with
#: TF32 Tensor Core matmuls and convolutions (compute capability 8.0+), "fp16" is fp16
#: autocast with a GradScaler, and "bf16" is bf16 autocast.
PRECISIONS = ("auto", "fp32", "tf32", "fp16", "bf16")

# What people write instead, and the word of the vocabulary that means it.
_SPELLINGS: dict[object, str] = {
    True: "auto", False: "fp32", None: "fp32",
    "off": "fp32", "float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
}


def check_precision(precision: object, name: str = "precision") -> str:
    """Return ``precision`` if it is a word of :data:`PRECISIONS`; raise naming the fix if not."""
    if isinstance(precision, str) and precision in PRECISIONS:
        return precision
    choices = ", ".join(repr(p) for p in PRECISIONS)
    if isinstance(precision, torch.dtype):
        hint = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(precision)
    elif isinstance(precision, str):
        hint = _SPELLINGS.get(precision.lower(), precision.lower())
    elif isinstance(precision, bool) or precision is None:
        hint = _SPELLINGS[precision]
    else:
        hint = None
    fix = f": write {name}={hint!r}" if hint in PRECISIONS else ""
    raise ValueError(f"{name}={precision!r} is not one of {choices}{fix}")


@dataclass(frozen=True)
class PrecisionPolicy:
    """How to run a training step: autocast dtype (None: fp32), loss scaling, and TF32.

    ``tf32``: True allows TF32 in fp32 matmuls and convolutions, False forbids it
    (strict fp32), None leaves PyTorch's settings as they are.
    """

    device_type: str
    dtype: torch.dtype | None
    use_scaler: bool
    tf32: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device_type, str) or not self.device_type:
            raise TypeError(
                "device_type must be a device type such as 'cuda' or 'cpu', "
                f"got {self.device_type!r}"
            )
        if self.dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(
                "PrecisionPolicy.dtype must be torch.float16, torch.bfloat16 or None (plain "
                f"fp32), got {self.dtype!r}; autocast has no other dtype. "
                "d2lgpu.precision_policy(device, precision) builds a valid policy"
            )
        check_bool("use_scaler", self.use_scaler)
        check_bool("tf32", self.tf32, none_means="leave PyTorch's TF32 settings alone")

    @property
    def name(self) -> str:
        """The policy's word of :data:`PRECISIONS` ("fp16 + GradScaler" for scaled fp16)."""
        names = {torch.float16: "fp16", torch.bfloat16: "bf16"}
        if self.dtype is None:
            return "tf32" if self.tf32 else "fp32"
        return names[self.dtype] + (" + GradScaler" if self.use_scaler else "")

    def autocast(self) -> AbstractContextManager:
        """``torch.autocast`` for this policy, or a context that does nothing for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def matmul_precision(self) -> AbstractContextManager:
        """TF32 on or off for fp32 matmuls and convolutions, as ``tf32`` says.

        The switch is :func:`tf32_matmuls`. Only CUDA has TF32; on other devices the
        flags are left alone (torch 2.9 warns when its old TF32 flags are touched).
        """
        if self.tf32 is None or self.device_type != "cuda":
            return contextlib.nullcontext()
        return tf32_matmuls(self.tf32)

    def make_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only when this policy needs loss scaling (fp16)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.use_scaler)


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, with an error that says what to do without one."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{device} was asked for, but this process sees no CUDA GPU: pass d2lgpu.try_gpu() "
            "as the device to fall back to the CPU, or pass capability=(major, minor)"
        )
    return torch.cuda.get_device_capability(device)


#: The /proc/cpuinfo flags of bf16 arithmetic instructions: x86's AVX512-BF16 (AMD Zen 4 and
#: later, Intel Cooper Lake and Sapphire Rapids) and AMX-BF16 (Intel Sapphire Rapids and later),
#: and ``bf16`` in an Arm CPU's Features line (Armv8.6-A: Graviton 3, Neoverse V1 and later).
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The instruction-set flags the CPU advertises (Linux), or None where they cannot be read
    (chapter 6)."""
    _check_cpuinfo(cpuinfo)
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:  # not Linux (macOS, Windows), or a sandbox without /proc
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):  # x86 says flags, Arm says Features
            flags.update(value.split())
    return frozenset(flags)


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 arithmetic instructions (AVX512-BF16, AMX-BF16, Arm BF16).

    The rule for ``precision="auto"`` on a CPU: bf16 where the CPU *offers* bf16
    instructions, read from the flags the kernel reports in ``/proc/cpuinfo``, and
    fp32 elsewhere. Without them bf16 autocast converts every operand and runs
    slower than fp32; with them oneDNN's bf16 matmuls and convolutions beat fp32.
    Where the flags cannot be read (macOS, Windows) the answer is False: fp32 is
    never the slow choice. ``D2LGPU_CPU_BF16=1`` or ``0`` overrides the reading
    (CI runs both). Chapter 6 measures how the two compare on the machine that
    runs it.
    """
    _check_cpuinfo(cpuinfo)
    override = cpu_bf16_override()  # D2LGPU_CPU_BF16: tests run both branches on any CPU
    if override is not None:
        return override
    flags = cpu_flags(cpuinfo)
    return flags is not None and bool(flags & CPU_BF16_FLAGS)


def precision_policy(
    device: torch.device | str,
    precision: str = "auto",
    capability: tuple[int, int] | None = None,
    cpu_native_bf16: bool | None = None,
) -> PrecisionPolicy:
    """Turn a word of :data:`PRECISIONS` into how ``device`` trains (chapter 4).

    "fp32" is strict fp32 (TF32 off), "tf32" fp32 with TF32 allowed, "fp16" fp16
    autocast with a GradScaler, "bf16" bf16 autocast. "auto" lets the device
    decide: bf16 from compute capability 8.0, fp16 with a GradScaler on 7.x, and
    fp32 below 7.0, where there are no Tensor Cores to gain from (a GTX 10xx runs
    fp16 arithmetic far slower than fp32). On the CPU "auto" means bf16 autocast
    where the CPU computes bf16 natively (:func:`cpu_has_native_bf16`: AVX512-BF16
    or AMX) and fp32 elsewhere, where bf16 is emulated and slower than fp32. On
    other device types it means fp32, because there is no rule here for what they
    run fast. This is the one rule for "auto" in the course: every entry point
    that takes ``precision=`` uses it. ``capability`` overrides the one read from
    the device, and ``cpu_native_bf16`` what :func:`cpu_has_native_bf16` says about
    this CPU (for tests, and for tables of machines you do not have).
    """
    device = as_device(device)
    precision = check_precision(precision)
    if capability is not None:
        check_capability(capability)
    check_bool("cpu_native_bf16", cpu_native_bf16, none_means="ask this CPU")
    if precision in ("fp32", "tf32"):
        return PrecisionPolicy(device.type, None, False, tf32=precision == "tf32")
    if precision == "auto":
        fp32 = PrecisionPolicy(device.type, None, False)
        if device.type == "cuda":
            if capability is None:
                capability = _cuda_capability(device)
            formats = native_tensor_core_formats(capability)
            if "bf16" in formats:
                precision = "bf16"
            elif "fp16" in formats:
                precision = "fp16"
            else:
                return fp32
        elif device.type == "cpu":
            native = cpu_has_native_bf16() if cpu_native_bf16 is None else cpu_native_bf16
            if not native:
                return fp32
            precision = "bf16"
        else:
            return fp32
    # fp16 has a narrow range: small gradients underflow to zero without loss scaling.
    # bf16 has fp32's range, so it needs none.
    if precision == "fp16":
        return PrecisionPolicy(device.type, torch.float16, use_scaler=True)
    return PrecisionPolicy(device.type, torch.bfloat16, use_scaler=False)


def has_fp32_precision_api() -> bool:
    """Whether this torch has the ``fp32_precision`` switches (torch 2.9 and newer do) (chapter 6).

    torch 2.9 recommends them and warns (once, a UserWarning) when the older
    ``allow_tf32`` flags or ``torch.get_float32_matmul_precision`` are used; newer
    versions raise an error when code reads an old flag after setting a new one.
    """
    return hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(
        getattr(torch.backends.cudnn, "conv", None), "fp32_precision")


def set_tf32(matmul: str, conv: str, rnn: str | None = None) -> None:
    """Set CUDA's TF32 switches from the new API's words ("none", "ieee", "tf32"), with the
    legacy flags made to agree: torch raises "mix of the legacy and new APIs" at any read
    of a legacy flag (``allow_tf32``, ``get_float32_matmul_precision``) that disagrees
    with the new one, on every device (the check is in ATen's Context, not in CUDA code).
    ``rnn`` (cuDNN's RNNs) defaults to ``conv``: the legacy cuDNN flag needs the two equal."""
    # The legacy setters write the legacy value and the new one together, so they go first.
    with _quiet_legacy_api():
        torch.set_float32_matmul_precision("high" if matmul == "tf32" else "highest")
        torch.backends.cudnn.allow_tf32 = conv == "tf32"
    torch.backends.cuda.matmul.fp32_precision = matmul
    torch.backends.cudnn.conv.fp32_precision = conv
    torch.backends.cudnn.rnn.fp32_precision = conv if rnn is None else rnn


@contextlib.contextmanager
def _quiet_legacy_api() -> Iterator[None]:
    """Torch 2.9 warns (once per process) that the legacy TF32 switches will be deprecated,
    also where the package touches them only to keep them in agreement with the new ones:
    a learner would see a warning about code they did not write."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use the new API settings")
        yield


def _legacy_or_none(read: Callable[[], object]) -> object:
    try:
        with _quiet_legacy_api():
            return read()
    except RuntimeError:  # the learner set only the new API: the legacy value is moot
        return None


@contextlib.contextmanager
def tf32_switches(matmul: str, conv: str) -> Iterator[None]:
    """Set the TF32 switches to the new API's words (:func:`set_tf32`) while the body runs,
    and put back what was there on exit, also if the body raises, with the legacy flags
    agreeing with it: a learner's new-API-only setting is kept, and "medium" is kept too."""
    words = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
             torch.backends.cudnn.rnn.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
    legacy = _legacy_or_none(torch.get_float32_matmul_precision)
    set_tf32(matmul, conv)
    try:
        yield
    finally:
        set_tf32(*words[:3])
        if legacy is not None and (legacy == "highest") == (words[0] != "tf32"):
            with _quiet_legacy_api():
                torch.set_float32_matmul_precision(legacy)  # "medium" and "high" both mean TF32
            torch.backends.cuda.matmul.fp32_precision = words[0]
        torch.backends.mkldnn.matmul.fp32_precision = words[3]


def tf32_matmuls(enabled: bool) -> AbstractContextManager:
    """Allow (or forbid) TF32 in fp32 matmuls and cuDNN convolutions; restore on exit (chapter 6).

    TF32 keeps fp32's 8-bit exponent but rounds the mantissa to 10 bits inside
    Tensor Core matmuls on compute capability 8.0 and newer. PyTorch's defaults
    differ per library (matmuls: off; cuDNN convolutions: on), so "strict fp32"
    has to switch off both. Both APIs are set so that they agree (:func:`set_tf32`),
    and the previous settings come back on exit, also if the body raises. A learner
    who set ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` (the new API
    alone) keeps that setting, and the legacy flags agree with it afterwards. On a
    CPU or a GPU older than 8.0 the flags change nothing.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"tf32_matmuls(enabled) takes True or False, got {enabled!r}")
    word = "tf32" if enabled else "ieee"
    return tf32_switches(word, word)


# ---------------------------------------------------------------------------
# Memory a CPU can count: bytes saved for the backward pass
# ---------------------------------------------------------------------------


class SavedActivations:
    """Counts the bytes autograd saves for the backward pass inside a ``with`` block.

    A context manager around ``torch.autograd.graph.saved_tensors_hooks``: every
    tensor an op saves for its backward passes through the pack hook, which notes
    its storage and hands the tensor back unchanged. Each storage counts once (a
    ReLU's output saved by two ops is one buffer), and the storages of ``exclude``
    (pass the model's parameters: they exist whether or not a graph is built) count
    not at all. Under autocast the 16-bit copies of the weights that the matmuls save
    do count: they are memory the step allocates. This is the activation memory that
    grows with the batch, counted exactly and on any device, where a CPU has no
    peak-memory statistic. Chapter 6 counts with it; chapter 8 uses it again.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        if isinstance(exclude, (str, bytes, torch.Tensor)) or not hasattr(exclude, "__iter__"):
            raise TypeError(f"exclude must be an iterable of tensors, e.g. "
                            f"list(model.parameters()), got {type(exclude).__name__} {exclude!r}")
        exclude = list(exclude)
        for t in exclude:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"exclude must hold tensors only, got {type(t).__name__} {t!r}")
        self._excluded = {_storage_key(t)[0] for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks: AbstractContextManager | None = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage_key(tensor)
        if key not in self._excluded:
            self._seen.setdefault(key, nbytes)
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc_info)

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages saved so far."""
        return sum(self._seen.values())

    @property
    def tensors(self) -> int:
        """How many distinct storages were saved."""
        return len(self._seen)


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(an id of the tensor's storage, its size in bytes); a tensor without one is its own."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr() or id(tensor), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without a storage
        return id(tensor), tensor.numel() * tensor.element_size()


def saved_activation_bytes(
    model: nn.Module,
    features: torch.Tensor,
    labels: torch.Tensor,
    policy: PrecisionPolicy,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
) -> int:
    """Bytes autograd saves for one forward pass and loss of ``model`` under ``policy`` (chapter 6).

    The forward pass runs once (batch norm layers in training mode update their
    running statistics, as a training step would); no backward pass runs.
    """
    if not isinstance(policy, PrecisionPolicy):
        raise TypeError(f"policy must be a PrecisionPolicy (d2lgpu.precision_policy(device, "
                        f"precision)), got {type(policy).__name__}")
    counter = SavedActivations(exclude=list(model.parameters()))
    with counter, policy.autocast():
        loss = loss_fn(model(features), labels)
    del loss  # frees the graph and what it saved
    return counter.nbytes


# ---------------------------------------------------------------------------
# The precision sweep
# ---------------------------------------------------------------------------

#: The modes a sweep can compare: strict fp32 (TF32 off), fp32 with TF32 matmuls,
#: fp16 autocast with a GradScaler, and bf16 autocast (no scaler needed).
PRECISION_MODES = ("fp32", "tf32", "fp16", "bf16")


@dataclass(frozen=True)
class SweepRow:
    """One cell of the sweep: a mode at a batch size.

    ``status`` is ``"ok"`` when measured, ``"OOM"`` when the batch did not fit,
    or the reason the mode cannot run on this device (then the numbers are None).
    ``peak_memory_bytes`` is None on the CPU, where PyTorch keeps no peak statistic;
    on a GPU it also counts whatever else the process held there during the row.
    ``loss`` is the training loss of the last step, after ``steps_run`` steps.
    ``repeat_seconds`` holds the median step time of each repeat (the sweep runs
    the modes of one batch size in turn, repeat after repeat); ``median_seconds``
    is their median. ``saved_activation_bytes`` counts what autograd saved for the
    backward pass of one step (:class:`SavedActivations`), on every device:
    the part of training memory that grows with the batch and that autocast shrinks.
    """

    mode: str
    batch_size: int
    median_seconds: float | None
    peak_memory_bytes: int | None
    loss: float | None
    steps_run: int
    status: str
    repeat_seconds: tuple[float, ...] = ()
    saved_activation_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def examples_per_second(self) -> float | None:
        if self.median_seconds is None:
            return None
        return self.batch_size / self.median_seconds


def mode_unavailable_reason(
    mode: str, device: torch.device | str, capability: tuple[int, int] | None = None
) -> str | None:
    """Why ``mode`` cannot run (usefully) on ``device``, or None when it can.

    On the CPU only fp32 and bf16 autocast exist as fast paths; TF32 and the
    fp16 + GradScaler recipe are CUDA features. On a GPU below compute
    capability 8.0 TF32 does not exist and bf16 is only emulated, so measuring
    them would say nothing about Tensor Cores.
    """
    if mode not in PRECISION_MODES:
        raise ValueError(f"unknown precision mode {mode!r}; choose from {PRECISION_MODES}")
    device = as_device(device)
    if capability is not None:
        check_capability(capability)
    if mode == "fp32":
        return None
    if device.type == "cpu":
        return None if mode == "bf16" else "needs CUDA"
    if device.type != "cuda":
        return f"not measured on {device.type}"
    if capability is None:
        capability = _cuda_capability(device)
    formats = native_tensor_core_formats(capability)
    major, minor = capability
    if mode in ("tf32", "bf16") and mode not in formats:
        return f"needs compute capability 8.0 (this GPU: {major}.{minor})"
    return None


def amp_sweep_mode(device: torch.device | str, capability: tuple[int, int] | None = None) -> str:
    """The sweep mode to set against fp32: the one ``precision_policy(device, "auto")`` picks
    (chapter 6).

    That is "bf16" from compute capability 8.0, "fp16" on 7.x, and also "fp16" below
    7.0, where "auto" stays in fp32 but fp16 is still worth measuring. On a CPU it is
    "bf16", the only reduced format a CPU runs, also where "auto" stays in fp32
    because bf16 is emulated: the sweep then measures how much slower it is.
    """
    if capability is not None:
        check_capability(capability)
    if as_device(device).type == "cpu":
        return "bf16"
    dtype = precision_policy(device, "auto", capability=capability).dtype
    return "bf16" if dtype == torch.bfloat16 else "fp16"


def _mode_policy(mode: str, device: torch.device) -> PrecisionPolicy:
    """The autocast policy of a sweep mode (fp32 and tf32 both run without autocast)."""
    return precision_policy(device, mode)


def _measure_one(
    model_fn: Callable[[], nn.Module],
    make_batch: Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]],
    mode: str,
    batch_size: int,
    device: torch.device,
    steps: int,
    warmup: int,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    seed: int,
) -> SweepRow:
    """Train a fresh model for ``warmup + steps`` steps in one mode; time the last ``steps``."""
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(seed)  # every mode starts from the same weights
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn() must return an nn.Module, got {type(model).__name__}")
    model = model.to(device)
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise ValueError("model_fn() returned a model whose weights hold NaN or inf: fix its "
                         "initialisation before measuring it")
    optimizer = make_optimizer(list(model.parameters()))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("make_optimizer(parameters) must return a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    batch = make_batch(batch_size, device)
    if not (isinstance(batch, tuple) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise TypeError("make_batch(batch_size, device) must return a (features, labels) tuple of "
                        f"tensors, got {type(batch).__name__}; d2lgpu.random_batch_maker makes one")
    features, labels = batch
    if features.is_floating_point() and not torch.isfinite(features).all():
        raise ValueError(f"the batch of {batch_size} from make_batch holds NaN or inf: the data "
                         "is broken, not the precision; clean it before measuring")
    policy = _mode_policy(mode, device)
    scaler = policy.make_scaler()  # disabled (a pass-through) unless the mode is fp16
    losses: list[torch.Tensor] = []

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with policy.autocast():
            loss = loss_fn(model(features), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped when the unscaled gradients hold inf/nan
        scaler.update()
        losses.append(loss.detach())

    counter = SavedActivations(exclude=list(model.parameters()))
    with policy.matmul_precision():  # TF32 on for "tf32", off for "fp32"; CUDA only
        if warmup > 0:  # the first warm-up step also counts what the step saves
            with counter:
                train_step()
        else:  # no step to spare: count in a forward pass of its own
            with counter, policy.autocast():
                loss_fn(model(features), labels)
        timing = time_fn(train_step, device, warmup=max(warmup - 1, 0), repeats=steps)
    peak = torch.cuda.max_memory_allocated(device) if on_cuda else None
    last_loss = float(losses[-1])
    # The course's one divergence rule (d2lgpu.runtime.checks): not finite, or ten times the start.
    if loss_diverged(last_loss, float(losses[0])):
        other = ("or use bf16 or fp32: fp16 overflows above 65504" if mode == "fp16"
                 else "or check that the model trains in fp32 at all")
        raise FloatingPointError(
            f"the {mode} run at batch {batch_size} ended with loss {last_loss:.4g} after "
            f"{len(losses)} steps, from {float(losses[0]):.4g} at the first: training "
            f"diverged. Try a smaller learning rate, {other}."
        )
    return SweepRow(
        mode=mode,
        batch_size=batch_size,
        median_seconds=timing.median,
        peak_memory_bytes=peak,
        loss=last_loss,
        steps_run=len(losses),
        status="ok",
        repeat_seconds=(timing.median,),
        saved_activation_bytes=counter.nbytes,
    )


#: How running out of GPU memory shows when a library, not torch's allocator, is the
#: one that failed: cuBLAS and cuDNN cannot allocate a workspace, cuDNN finds no
#: algorithm (engine) whose workspace fits, or the CUDA runtime cannot create a
#: handle. Near the memory limit one of these, not torch.OutOfMemoryError, can be the
#: first error. (cuDNN's two "unable to find" messages can in principle also mean an
#: unsupported layer configuration; such a model then shows OOM at every batch size.)
_LIBRARY_OUT_OF_MEMORY = (
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "GET was unable to find an engine to execute this computation",
    "Unable to find a valid cuDNN algorithm to run convolution",
    "CUDA error: out of memory",
)


def _is_out_of_memory(exc: BaseException) -> bool:
    """True for running out of GPU memory, however the allocation that failed reports it."""
    # torch.OutOfMemoryError is recent (about 2.5); torch.cuda.OutOfMemoryError is older.
    out_of_memory = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    if isinstance(exc, out_of_memory):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _LIBRARY_OUT_OF_MEMORY)


def _release_memory(device: torch.device) -> None:
    """On a GPU, give cached blocks back so the next row starts from an empty allocator.

    Reference cycles can keep GPU tensors alive after a row, so they are collected
    first. On the CPU freed tensors go straight back to the system and a full
    ``gc.collect()`` (a fraction of a second with torch loaded) would only cost time.
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _check_sweep_arguments(
    model_fn: object,
    make_batch: object,
    modes: object,
    batch_sizes: object,
    steps: object,
    warmup: object,
    lr: object,
    loss_fn: object,
    seed: object,
    repeats: object,
    make_optimizer: object = None,
) -> None:
    """Refuse what cannot be a sweep, naming the argument and what it takes."""
    for name, fn in (("model_fn", model_fn), ("make_batch", make_batch), ("loss_fn", loss_fn)):
        if not callable(fn):
            raise TypeError(f"{name} must be a function, got {type(fn).__name__} {fn!r}")
    if isinstance(modes, str) or not isinstance(modes, Sequence):
        raise TypeError(f"modes must be a list of mode names such as {list(PRECISION_MODES)}, "
                        f"got {modes!r}")
    unknown = [m for m in modes if m not in PRECISION_MODES]
    if not modes or unknown:
        raise ValueError(
            f"modes must be a non-empty list; unknown: {unknown}; choose from {PRECISION_MODES}"
        )
    if (isinstance(batch_sizes, str) or not isinstance(batch_sizes, Sequence) or not batch_sizes
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes)):
        raise ValueError(
            f"batch_sizes must be a non-empty list of positive ints, got {batch_sizes!r}"
        )
    if (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
            or isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0):
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    check_positive_float("lr", lr)
    check_seed(seed)
    check_positive_int("repeats", repeats)
    if make_optimizer is not None and not callable(make_optimizer):
        raise TypeError("make_optimizer must be a function of the parameters (or None: SGD with "
                        f"lr), got {type(make_optimizer).__name__} {make_optimizer!r}")


def _optimizer_maker(make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None,
                     lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``make_optimizer``, or plain SGD with ``lr`` where it is None."""
    if make_optimizer is not None:
        return make_optimizer
    return lambda parameters: torch.optim.SGD(parameters, lr=lr)


def precision_sweep(
    model_fn: Callable[[], nn.Module],
    make_batch: Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]],
    modes: Sequence[str],
    batch_sizes: Sequence[int],
    device: torch.device | str,
    *,
    steps: int = 10,
    warmup: int = 3,
    lr: float = 0.01,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
    seed: int = 0,
    repeats: int = 1,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    progress: bool = False,
) -> list[SweepRow]:
    """Train ``model_fn()`` briefly in each mode at each batch size and measure it (chapter 6).

    For every (mode, batch size) a fresh model (same seed, so same weights) is
    trained with SGD on one fixed batch from ``make_batch(batch_size, device)``
    for ``warmup`` untimed and ``steps`` timed steps. Each row holds the median
    step time (synchronised, via :func:`d2lgpu.time_fn`), the peak memory on a
    GPU (``torch.cuda.max_memory_allocated`` after resetting the peak) and the
    loss of the last step. A ``torch.OutOfMemoryError`` (or cuBLAS, cuDNN or CUDA
    failing to allocate a workspace or handle) becomes an ``"OOM"`` row, the memory
    is released, and the sweep goes on; modes the device cannot run become rows
    whose status says why (see :func:`mode_unavailable_reason`).

    With ``repeats`` > 1 every row is measured that many times, and the modes of
    one batch size take turns (fp32, bf16, fp32, bf16, ...), so a burst of other
    work on the machine hits every mode alike. A row's time is then the median of
    its repeats, and :func:`compare_sweep_modes` can tell a difference from noise.
    A loss that becomes NaN or inf stops the sweep with a ``FloatingPointError``,
    as in :func:`d2lgpu.train`; so do NaN in the batch or the initial weights.

    ``make_optimizer(parameters)`` builds each row's optimizer (None: SGD with
    ``lr``). ``progress=True`` shows a ``tqdm`` bar over the rows as they run.
    """
    _check_sweep_arguments(model_fn, make_batch, modes, batch_sizes, steps, warmup, lr, loss_fn,
                           seed, repeats, make_optimizer)
    check_bool("progress", progress)
    optimizer_maker = _optimizer_maker(make_optimizer, lr)
    device = as_device(device)
    reasons = {mode: mode_unavailable_reason(mode, device) for mode in modes}
    measured: dict[tuple[str, int], SweepRow] = {}
    runnable = [mode for mode in modes if reasons[mode] is None]
    bar = None
    if progress:
        with warnings.catch_warnings():  # without ipywidgets tqdm.auto warns, then draws text
            warnings.simplefilter("ignore")
            from tqdm.auto import tqdm  # a widget bar in Jupyter, a text bar elsewhere

        bar = tqdm(total=len(batch_sizes) * repeats * len(runnable), desc="sweep rows",
                   unit="row")
    for batch_size in batch_sizes:
        for _ in range(repeats):
            for mode in runnable:
                previous = measured.get((mode, batch_size))
                if previous is not None and not previous.ok:
                    if bar is not None:
                        bar.update()
                    continue  # out of memory once: it will not fit the next time either
                try:
                    row = _measure_one(model_fn, make_batch, mode, batch_size, device, steps,
                                       warmup, optimizer_maker, loss_fn, seed)
                except RuntimeError as exc:  # torch.OutOfMemoryError is a RuntimeError
                    # Only running out of memory is expected; any other error is a bug.
                    if not _is_out_of_memory(exc):
                        raise
                    row = SweepRow(mode, batch_size, None, None, None, 0, "OOM")
                # Outside the except block the traceback (and the tensors its frames hold) is gone.
                _release_memory(device)
                if previous is not None and row.ok:
                    times = previous.repeat_seconds + row.repeat_seconds
                    peak = row.peak_memory_bytes
                    if previous.peak_memory_bytes is not None and peak is not None:
                        peak = max(peak, previous.peak_memory_bytes)
                    row = SweepRow(mode, batch_size, statistics.median(times), peak, row.loss,
                                   row.steps_run, "ok", times, row.saved_activation_bytes)
                measured[(mode, batch_size)] = row
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    rows = []
    for mode in modes:
        for batch_size in batch_sizes:
            reason = reasons[mode]
            if reason is not None:
                rows.append(SweepRow(mode, batch_size, None, None, None, 0, reason))
            else:
                rows.append(measured[(mode, batch_size)])
    return rows


@dataclass(frozen=True)
class SweepComparison:
    """A reduced-precision mode against a baseline at the largest batch where both ran.

    ``speedup`` is the ratio of the two rows' median step times; ``repeat_speedups``
    pairs the repeats (repeat i of the baseline against repeat i of the candidate,
    measured one after the other), so their spread shows how far the machine's noise
    moves the ratio. ``memory_ratio`` is candidate over baseline peak GPU memory,
    ``saved_ratio`` candidate over baseline bytes saved for the backward pass.
    """

    baseline: str
    candidate: str
    batch_size: int
    speedup: float
    memory_ratio: float | None  # candidate peak / baseline peak; None where not measured
    repeat_speedups: tuple[float, ...] = ()
    saved_ratio: float | None = None

    @property
    def paired_speedup(self) -> float:
        """The median of the paired ratios (the row medians' ratio without repeats)."""
        if not self.repeat_speedups:
            return self.speedup
        return statistics.median(self.repeat_speedups)

    def describe(self) -> str:
        text = (
            f"{self.candidate} vs {self.baseline} at batch {self.batch_size}: "
            f"{self.speedup:.2f}x speed-up"
        )
        if self.repeat_speedups:
            text += f" (repeats {min(self.repeat_speedups):.2f}x-{max(self.repeat_speedups):.2f}x)"
        if self.saved_ratio is not None:
            change = "fewer" if self.saved_ratio <= 1 else "more"
            text += f", {abs(100 * (1 - self.saved_ratio)):.0f}% {change} saved-activation bytes"
        if self.memory_ratio is None:
            return text + "; peak memory not measured on this device"
        change = "lower" if self.memory_ratio <= 1 else "higher"
        return text + f", peak memory {abs(100 * (1 - self.memory_ratio)):.0f}% {change}"


def compare_sweep_modes(
    rows: Sequence[SweepRow], baseline: str = "fp32", candidate: str = "bf16"
) -> SweepComparison | None:
    """Speed-up and memory ratio of ``candidate`` over ``baseline`` at the largest shared batch
    (chapter 6).

    Returns None when no batch size ran in both modes (e.g. the candidate needs CUDA).
    """
    _check_rows(rows)
    for name, mode in (("baseline", baseline), ("candidate", candidate)):
        if mode not in PRECISION_MODES:
            raise ValueError(f"{name}={mode!r} is not a sweep mode; choose from {PRECISION_MODES}")
    times = {
        m: {r.batch_size: r for r in rows if r.mode == m and r.ok} for m in (baseline, candidate)
    }
    shared = sorted(set(times[baseline]) & set(times[candidate]))
    if not shared:
        return None
    base, cand = times[baseline][shared[-1]], times[candidate][shared[-1]]
    memory_ratio = None
    if base.peak_memory_bytes and cand.peak_memory_bytes is not None:
        memory_ratio = cand.peak_memory_bytes / base.peak_memory_bytes
    saved_ratio = None
    if base.saved_activation_bytes and cand.saved_activation_bytes is not None:
        saved_ratio = cand.saved_activation_bytes / base.saved_activation_bytes
    paired = tuple(b / c for b, c in zip(base.repeat_seconds, cand.repeat_seconds, strict=False))
    return SweepComparison(
        baseline, candidate, shared[-1], base.median_seconds / cand.median_seconds, memory_ratio,
        paired, saved_ratio,
    )


def _check_rows(rows: object) -> None:
    """A TypeError naming ``rows`` unless it is a list of SweepRow."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not all(
        isinstance(r, SweepRow) for r in rows
    ):
        raise TypeError(f"rows must be the list of SweepRow that precision_sweep returns, "
                        f"got {type(rows).__name__}")


def format_sweep_table(rows: Sequence[SweepRow]) -> str:
    """The sweep as a fixed-width text table, one line per row (chapter 6).

    "saved MiB" is what one step saved for its backward pass (counted on every
    device), "peak MiB" the peak GPU memory (CUDA only).
    """
    _check_rows(rows)
    header = ("mode", "batch", "step ms", "examples/s", "saved MiB", "peak MiB", "loss")
    lines = ["{:<5} {:>6} {:>9} {:>11} {:>10} {:>9} {:>8}  status".format(*header)]
    for r in rows:
        seconds, peak, eps = r.median_seconds, r.peak_memory_bytes, r.examples_per_second
        ms = f"{1000 * seconds:9.2f}" if seconds is not None else f"{'-':>9}"
        rate = f"{eps:11.0f}" if eps is not None else f"{'-':>11}"
        saved = r.saved_activation_bytes
        saved_mib = f"{saved / 2**20:10.2f}" if saved is not None else f"{'-':>10}"
        mib = f"{peak / 2**20:9.1f}" if peak is not None else f"{'-':>9}"
        # A diverged run prints its loss as inf or nan, never as a dash.
        loss = f"{r.loss:8.4f}" if r.loss is not None else f"{'-':>8}"
        lines.append(f"{r.mode:<5} {r.batch_size:>6} {ms} {rate} {saved_mib} {mib} {loss}  "
                     f"{r.status}")
    return "\n".join(lines)


def sweep_mlp(in_features: int, width: int, depth: int, num_classes: int = 10) -> nn.Sequential:
    """A matmul-heavy model: ``depth`` wide Linear+ReLU layers, where Tensor Cores matter most
    (chapter 6).

    Almost all its time is spent in (batch x width) @ (width x width) matmuls,
    so it shows the raw speed-up of a precision more clearly than a CNN does.
    """
    for name, value in (("in_features", in_features), ("width", width), ("depth", depth),
                        ("num_classes", num_classes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if min(in_features, width, depth, num_classes) < 1:
        raise ValueError("in_features, width, depth and num_classes must all be at least 1")
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(in_features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def sweep_cnn(in_channels: int = 1, widths: Sequence[int] = (32, 64, 128),
              num_classes: int = 10) -> nn.Sequential:
    """A small convolutional net: one conv + batch norm + ReLU block per width, pooling between
    (chapter 6).

    Its feature maps, not its weights, take the memory: at 28x28 a 32-channel map
    holds 25,088 numbers per example, against about 93,000 weights in the whole
    default net. So the bytes saved for the backward pass grow steeply with the
    batch, which is what autocast halves.
    """
    widths = check_sequence("widths", widths, of="positive ints (channels per block)")
    for value in (in_channels, num_classes, *widths):
        check_positive_int("in_channels, num_classes and widths", value)
    layers: list[nn.Module] = []
    channels = in_channels
    for i, width in enumerate(widths):
        if i > 0:
            layers.append(nn.MaxPool2d(2))
        layers += [nn.Conv2d(channels, width, kernel_size=3, padding=1), nn.BatchNorm2d(width),
                   nn.ReLU()]
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def random_batch_maker(
    input_shape: Sequence[int], num_classes: int = 10, seed: int = 0
) -> Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
    """A ``make_batch(batch_size, device)`` for the sweep: a fixed random batch per size
    (chapter 6).

    The batch is drawn on the CPU from its own generator, then moved, so every
    mode and every device sees exactly the same data.
    """
    shape = check_sequence("input_shape", input_shape, of="positive ints (one example's shape)")
    for size in shape:
        check_positive_int("input_shape entries", size)
    check_positive_int("num_classes", num_classes)
    check_seed(seed)

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        features = torch.randn(batch_size, *input_shape, generator=generator)
        labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
        return features.to(device), labels.to(device)

    return make_batch


# ---------------------------------------------------------------------------
# Reading a sweep: checks that hold on every machine, the headline
# ---------------------------------------------------------------------------
