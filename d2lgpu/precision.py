"""Which reduced precision a device runs fast, how to use it, and chapter 6's precision sweep.
The policy goes by compute capability (``torch.cuda.is_bf16_supported()`` says True on a T4,
where bf16 is emulated) and by the bf16 instructions a CPU reports."""

from __future__ import annotations

import contextlib
import gc
import statistics
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from d2lgpu.chips import native_tensor_core_formats
from d2lgpu.runtime.checks import loss_diverged
from d2lgpu.runtime.config import cpu_bf16_override
from d2lgpu.runtime.gpus import as_device
from d2lgpu.timing import timed_calls

__all__ = [
    "CPU_BF16_FLAGS", "PRECISIONS", "PRECISION_MODES", "PrecisionPolicy", "SavedActivations",
    "SweepComparison", "SweepRow", "amp_sweep_mode", "check_precision", "compare_sweep_modes",
    "cpu_flags", "cpu_has_native_bf16", "format_sweep_table", "has_fp32_precision_api",
    "mode_unavailable_reason", "precision_policy", "precision_sweep", "random_batch_maker",
    "saved_activation_bytes", "sweep_cnn", "sweep_mlp", "tf32_matmuls",
]

#: The one precision vocabulary every entry point that trains takes; "auto": the device decides.
PRECISIONS = ("auto", "fp32", "tf32", "fp16", "bf16")

def check_precision(precision: object, name: str = "precision") -> str:
    """``precision`` if it is a word of :data:`PRECISIONS`; else a ValueError naming them."""
    if isinstance(precision, str) and precision in PRECISIONS:
        return precision
    raise ValueError(f"{name}={precision!r} is not one of {', '.join(map(repr, PRECISIONS))}")


@dataclass(frozen=True)
class PrecisionPolicy:
    """How a training step runs: the autocast dtype (None: fp32), loss scaling, and TF32
    (None: PyTorch's settings as they are)."""

    device_type: str
    dtype: torch.dtype | None
    use_scaler: bool
    tf32: bool | None = None

    @property
    def name(self) -> str:
        """The policy's word ("fp16 + GradScaler" for scaled fp16)."""
        if self.dtype is None:
            return "tf32" if self.tf32 else "fp32"
        name = "fp16" if self.dtype == torch.float16 else "bf16"
        return name + (" + GradScaler" if self.use_scaler else "")

    def autocast(self) -> AbstractContextManager:
        """``torch.autocast`` for this policy, or a context that does nothing for fp32 (on
        any device type: ``torch.autocast`` refuses those it has no autocast for, even off)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def matmul_precision(self) -> AbstractContextManager:
        """TF32 on or off as ``tf32`` says (:func:`tf32_matmuls`); CUDA only has TF32."""
        if self.tf32 is None or self.device_type != "cuda":
            return contextlib.nullcontext()
        return tf32_matmuls(self.tf32)

    def make_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only when this policy needs loss scaling (fp16)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.use_scaler)


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{device} was asked for, but this process sees no CUDA GPU: pass "
                           "d2lgpu.try_gpu() to fall back to the CPU, or capability=(major, minor)")
    return torch.cuda.get_device_capability(device)


#: The /proc/cpuinfo flags of bf16 arithmetic: x86's AVX512-BF16 and AMX-BF16, Arm's bf16.
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's instruction-set flags (Linux), or None where unreadable (chapter 6)."""
    try:
        lines = Path(cpuinfo).read_text(errors="replace").splitlines()
    except OSError:  # not Linux, or a sandbox without /proc
        return None
    # x86 says flags, Arm says Features
    return frozenset(flag for key, _, value in (line.partition(":") for line in lines)
                     if key.strip().lower() in ("flags", "features") for flag in value.split())


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 instructions (chapter 6): without them bf16 autocast converts
    every operand and runs slower than fp32. ``D2LGPU_CPU_BF16=1`` or ``0`` overrides."""
    override = cpu_bf16_override()
    if override is not None:
        return override
    flags = cpu_flags(cpuinfo)
    return flags is not None and bool(flags & CPU_BF16_FLAGS)


def precision_policy(device: torch.device | str, precision: str = "auto",
                     capability: tuple[int, int] | None = None, cpu_native_bf16: bool | None = None,
) -> PrecisionPolicy:
    """A word of :data:`PRECISIONS` as how ``device`` trains (chapter 4). "auto": bf16 from
    capability 8.0 or on a CPU with bf16 instructions, fp16 + GradScaler on 7.x, else fp32."""
    device = as_device(device)
    precision = check_precision(precision)
    if precision == "auto":
        precision = None
        if device.type == "cuda":
            formats = native_tensor_core_formats(capability or _cuda_capability(device))
            precision = "bf16" if "bf16" in formats else "fp16" if "fp16" in formats else None
        elif device.type == "cpu":
            native = cpu_has_native_bf16() if cpu_native_bf16 is None else cpu_native_bf16
            precision = "bf16" if native else None
        if precision is None:  # fp32, TF32 left as PyTorch has it
            return PrecisionPolicy(device.type, None, False)
    return _word_policy(device.type, precision)


def _word_policy(device_type: str, word: str) -> PrecisionPolicy:
    """The policy of a word other than "auto"; only fp16's narrow range needs loss scaling."""
    if word in ("fp32", "tf32"):
        return PrecisionPolicy(device_type, None, False, tf32=word == "tf32")
    return PrecisionPolicy(device_type, torch.float16 if word == "fp16" else torch.bfloat16,
                           use_scaler=word == "fp16")


def has_fp32_precision_api() -> bool:
    """Whether this torch has the ``fp32_precision`` switches (torch 2.9 and newer) (chapter 6)."""
    return hasattr(torch.backends.cuda.matmul, "fp32_precision")


def set_tf32(matmul: str, conv: str, rnn: str | None = None) -> None:
    """Set CUDA's TF32 switches to the new API's words ("none", "ieee", "tf32"), the legacy
    flags agreeing: torch raises "mix of the legacy and new APIs" at a read of one that does not."""
    # The legacy setters write both values, so they go first.
    with _quiet_legacy_api():
        torch.set_float32_matmul_precision("high" if matmul == "tf32" else "highest")
        torch.backends.cudnn.allow_tf32 = conv == "tf32"
    torch.backends.cuda.matmul.fp32_precision = matmul
    torch.backends.cudnn.conv.fp32_precision = conv
    torch.backends.cudnn.rnn.fp32_precision = conv if rnn is None else rnn


@contextlib.contextmanager
def _quiet_legacy_api() -> Iterator[None]:
    """Silence torch's deprecation warning for the legacy switches the package keeps agreeing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use the new API settings")
        yield


@contextlib.contextmanager
def tf32_switches(matmul: str, conv: str) -> Iterator[None]:
    """:func:`set_tf32` in the body; on exit what was there comes back, "medium" included."""
    words = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
             torch.backends.cudnn.rnn.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
    legacy = None  # unreadable where the learner set only the new API: then it is moot
    with _quiet_legacy_api(), contextlib.suppress(RuntimeError):
        legacy = torch.get_float32_matmul_precision()
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
    """Allow (or forbid) TF32 in fp32 matmuls and cuDNN convolutions; restore on exit
    (chapter 6). The defaults differ (matmuls off, convolutions on): strict fp32 needs both."""
    word = "tf32" if enabled else "ieee"
    return tf32_switches(word, word)


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd saves for backward in a ``with`` block, each storage once and
    ``exclude`` (the parameters) not at all (chapter 6): a CPU has no peak-memory statistic."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        exclude = list(exclude)
        if not all(isinstance(t, torch.Tensor) for t in exclude):
            raise TypeError("exclude must hold tensors only, e.g. model.parameters()")
        self._excluded = {_storage_key(t)[0] for t in exclude}
        self._seen: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage_key(tensor)
        if key not in self._excluded:
            self._seen.setdefault(key, nbytes)
        return tensor

    def __enter__(self) -> SavedActivations:
        super().__enter__()
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages saved so far."""
        return sum(self._seen.values())


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(an id of the tensor's storage, its size in bytes); a tensor without one is its own."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr() or id(tensor), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without a storage
        return id(tensor), tensor.numel() * tensor.element_size()


def saved_activation_bytes(model: nn.Module, features: torch.Tensor, labels: torch.Tensor,
                           policy: PrecisionPolicy) -> int:
    """Bytes autograd saves for a forward pass and cross-entropy loss under ``policy``
    (chapter 6); batch norm's statistics update as in a training step."""
    with SavedActivations(model.parameters()) as counter, policy.autocast():
        nn.functional.cross_entropy(model(features), labels)  # the graph goes at once
    return counter.nbytes


#: The modes a sweep compares: strict fp32, fp32 with TF32, fp16 + GradScaler, bf16.
PRECISION_MODES = ("fp32", "tf32", "fp16", "bf16")
#: ``make_batch(batch_size, device) -> (features, labels)``: one fixed batch per size.
BatchMaker = Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SweepRow:
    """One cell of the sweep, a mode at a batch size: ``status`` is "ok", "OOM" or why the mode
    cannot run here; ``repeat_seconds`` holds each repeat's median step time."""

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
        return None if self.median_seconds is None else self.batch_size / self.median_seconds


def mode_unavailable_reason(mode: str, device: torch.device | str,
                            capability: tuple[int, int] | None = None) -> str | None:
    """Why ``mode`` cannot run (usefully) on ``device``, or None: a CPU has fp32 and bf16,
    and below compute capability 8.0 TF32 does not exist and bf16 is emulated."""
    device = as_device(device)
    if mode == "fp32":
        return None
    if device.type == "cpu":
        return None if mode == "bf16" else "needs CUDA"
    if device.type != "cuda":
        return f"not measured on {device.type}"
    major, minor = capability or _cuda_capability(device)
    if mode in ("tf32", "bf16") and mode not in native_tensor_core_formats((major, minor)):
        return f"needs compute capability 8.0 (this GPU: {major}.{minor})"
    return None


def amp_sweep_mode(device: torch.device | str, capability: tuple[int, int] | None = None) -> str:
    """The mode to set against fp32 (chapter 6): what "auto" picks on a GPU, but fp16 below 7.0
    too, and bf16 on every CPU (then the sweep shows how much slower emulated bf16 is)."""
    if as_device(device).type == "cpu":
        return "bf16"
    dtype = precision_policy(device, "auto", capability=capability).dtype
    return "bf16" if dtype == torch.bfloat16 else "fp16"


def _measure_one(model_fn: Callable[[], nn.Module], make_batch: BatchMaker, mode: str,
                 batch_size: int, device: torch.device, steps: int, warmup: int,
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> SweepRow:
    """Train a fresh model ``warmup + steps`` steps in one mode; time the last ``steps``."""
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)  # every mode starts from the same weights
    model = model_fn().to(device)
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise ValueError("model_fn() returned a model whose weights hold NaN or inf: fix its "
                         "initialisation before measuring it")
    optimizer = make_optimizer(list(model.parameters()))
    features, labels = make_batch(batch_size, device)
    if features.is_floating_point() and not torch.isfinite(features).all():
        raise ValueError(f"the batch of {batch_size} from make_batch holds NaN or inf: the data "
                         "is broken, not the precision; clean it before measuring")
    policy = _word_policy(device.type, mode)
    scaler = policy.make_scaler()  # a pass-through unless the mode is fp16
    losses: list[torch.Tensor] = []

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with policy.autocast():
            loss = nn.functional.cross_entropy(model(features), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped when the unscaled gradients hold inf/nan
        scaler.update()
        losses.append(loss.detach())

    counter = SavedActivations(model.parameters())
    with policy.matmul_precision():
        if warmup > 0:  # the first warm-up step also counts what the step saves
            with counter:
                train_step()
        else:  # no step to spare: count in a forward pass of its own
            with counter, policy.autocast():
                nn.functional.cross_entropy(model(features), labels)
        for _ in range(warmup - 1):
            train_step()
        times = timed_calls(train_step, device, steps).times  # the device is checked already
    peak = torch.cuda.max_memory_allocated(device) if on_cuda else None
    first, last = float(losses[0]), float(losses[-1])
    if loss_diverged(last, first):
        other = ("or use bf16 or fp32: fp16 overflows above 65504" if mode == "fp16"
                 else "or check that the model trains in fp32 at all")
        raise FloatingPointError(
            f"the {mode} run at batch {batch_size} ended with loss {last:.4g} after {len(losses)} "
            f"steps, from {first:.4g} at the first: training diverged. Try a smaller learning "
            f"rate, {other}.")
    median = statistics.median(times)
    return SweepRow(mode, batch_size, median, peak, last, len(losses), "ok", (median,),
                    counter.nbytes)


#: Running out of GPU memory where a library, not torch's allocator, failed first.
_LIBRARY_OUT_OF_MEMORY = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                          "GET was unable to find an engine", "Unable to find a valid cuDNN "
                          "algorithm", "CUDA error: out of memory")


def _is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and any(s in str(exc) for s in _LIBRARY_OUT_OF_MEMORY))


def _merge_repeats(rows: list[SweepRow]) -> SweepRow:
    """One row from a cell's repeats: their step times pooled, the highest peak."""
    if not rows[-1].ok:
        return rows[-1]
    times = tuple(t for r in rows for t in r.repeat_seconds)
    peaks = [r.peak_memory_bytes for r in rows if r.peak_memory_bytes is not None]
    return replace(rows[-1], median_seconds=statistics.median(times),
                   peak_memory_bytes=max(peaks, default=None), repeat_seconds=times)


def precision_sweep(
    model_fn: Callable[[], nn.Module], make_batch: BatchMaker, modes: Sequence[str],
    batch_sizes: Sequence[int], device: torch.device | str, *, steps: int = 10, warmup: int = 3,
    lr: float = 0.01, repeats: int = 1, progress: bool = False,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> list[SweepRow]:
    """Time ``steps`` steps (after ``warmup``) of a fresh ``model_fn()`` on one fixed batch per
    mode and batch size (chapter 6); repeats take turns (noise hits all alike); "OOM": no fit."""
    unknown = [m for m in modes if m not in PRECISION_MODES]
    if isinstance(modes, str) or not modes or unknown:
        raise ValueError(f"modes must be a non-empty list of {PRECISION_MODES}; unknown: {unknown}")
    if not batch_sizes or not all(isinstance(b, int) and b > 0 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be a non-empty list of positive ints: {batch_sizes}")
    if steps < 1:
        raise ValueError(f"need steps >= 1, got steps={steps}")
    make_optimizer = make_optimizer or (lambda parameters: torch.optim.SGD(parameters, lr=lr))
    device = as_device(device)
    reasons = {mode: mode_unavailable_reason(mode, device) for mode in modes}
    runnable = [mode for mode in modes if reasons[mode] is None]
    runs: dict[tuple[str, int], list[SweepRow]] = {}
    with warnings.catch_warnings():  # without ipywidgets tqdm.auto warns, then draws text
        warnings.simplefilter("ignore")
        from tqdm.auto import tqdm

    bar = tqdm(total=len(batch_sizes) * repeats * len(runnable), desc="sweep rows", unit="row",
               disable=not progress)
    for batch_size in batch_sizes:
        for _ in range(repeats):
            for mode in runnable:
                bar.update()
                done = runs.setdefault((mode, batch_size), [])
                if done and not done[-1].ok:
                    continue  # out of memory once: it will not fit the next time either
                try:
                    done.append(_measure_one(model_fn, make_batch, mode, batch_size, device,
                                             steps, warmup, make_optimizer))
                except RuntimeError as exc:  # torch.OutOfMemoryError is a RuntimeError
                    if not _is_out_of_memory(exc):
                        raise
                    done.append(SweepRow(mode, batch_size, None, None, None, 0, "OOM"))
                # Outside the except block (its traceback holds tensors); cycles collected first.
                if device.type == "cuda":
                    gc.collect()
                    torch.cuda.empty_cache()
    bar.close()
    return [_merge_repeats(runs[(mode, b)]) if reasons[mode] is None
            else SweepRow(mode, b, None, None, None, 0, reasons[mode])
            for mode in modes for b in batch_sizes]


@dataclass(frozen=True)
class SweepComparison:
    """A mode against a baseline at the largest batch both ran: ratios of step times (also
    paired repeat by repeat: their spread is the noise), peak memory and saved bytes."""

    baseline: str
    candidate: str
    batch_size: int
    speedup: float
    memory_ratio: float | None
    repeat_speedups: tuple[float, ...] = ()
    saved_ratio: float | None = None

    @property
    def paired_speedup(self) -> float:
        """The median of the paired ratios (the row medians' ratio without repeats)."""
        return statistics.median(self.repeat_speedups) if self.repeat_speedups else self.speedup

    def describe(self) -> str:
        text = (f"{self.candidate} vs {self.baseline} at batch {self.batch_size}: "
                f"{self.speedup:.2f}x speed-up")
        if self.repeat_speedups:
            text += f" (repeats {min(self.repeat_speedups):.2f}x-{max(self.repeat_speedups):.2f}x)"
        if self.saved_ratio is not None:
            change = "fewer" if self.saved_ratio <= 1 else "more"
            text += f", {abs(100 * (1 - self.saved_ratio)):.0f}% {change} saved-activation bytes"
        if self.memory_ratio is None:
            return text + "; peak memory not measured on this device"
        change = "lower" if self.memory_ratio <= 1 else "higher"
        return text + f", peak memory {abs(100 * (1 - self.memory_ratio)):.0f}% {change}"


def compare_sweep_modes(rows: Sequence[SweepRow], baseline: str = "fp32", candidate: str = "bf16",
) -> SweepComparison | None:
    """``candidate`` against ``baseline`` at the largest batch both ran, or None (chapter 6)."""
    for name, mode in (("baseline", baseline), ("candidate", candidate)):
        if mode not in PRECISION_MODES:
            raise ValueError(f"{name}={mode!r} is not a sweep mode; choose from {PRECISION_MODES}")
    ran = {m: {r.batch_size: r for r in rows if r.mode == m and r.ok}
           for m in (baseline, candidate)}
    shared = sorted(set(ran[baseline]) & set(ran[candidate]))
    if not shared:
        return None
    base, cand = ran[baseline][shared[-1]], ran[candidate][shared[-1]]

    def ratio(field: str) -> float | None:
        b, c = getattr(base, field), getattr(cand, field)
        return c / b if b and c is not None else None

    paired = tuple(b / c for b, c in zip(base.repeat_seconds, cand.repeat_seconds, strict=False))
    return SweepComparison(baseline, candidate, shared[-1],
                           base.median_seconds / cand.median_seconds, ratio("peak_memory_bytes"),
                           paired, ratio("saved_activation_bytes"))


def format_sweep_table(rows: Sequence[SweepRow]) -> str:
    """The sweep as a text table (chapter 6): "saved MiB" saved for backward, "peak MiB" peak."""
    header = ("mode", "batch", "step ms", "examples/s", "saved MiB", "peak MiB", "loss")
    lines = ["{:<5} {:>6} {:>9} {:>11} {:>10} {:>9} {:>8}  status".format(*header)]
    for r in rows:
        ms = None if r.median_seconds is None else 1000 * r.median_seconds
        saved, peak = (None if b is None else b / 2**20
                       for b in (r.saved_activation_bytes, r.peak_memory_bytes))
        cells = [format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))
                 for v, spec in ((ms, "9.2f"), (r.examples_per_second, "11.0f"), (saved, "10.2f"),
                                 (peak, "9.1f"), (r.loss, "8.4f"))]  # inf and nan show
        lines.append(f"{r.mode:<5} {r.batch_size:>6} {' '.join(cells)}  {r.status}")
    return "\n".join(lines)


def sweep_mlp(in_features: int, width: int, depth: int, num_classes: int = 10) -> nn.Sequential:
    """``depth`` wide Linear+ReLU layers (chapter 6): nearly all matmuls, Tensor Cores' case."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(in_features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def sweep_cnn(in_channels: int = 1, widths: Sequence[int] = (32, 64, 128),
              num_classes: int = 10) -> nn.Sequential:
    """A small CNN, conv + batch norm + ReLU per width with pooling between (chapter 6): its
    feature maps, not its weights, take the memory, so saved bytes grow with the batch."""
    layers: list[nn.Module] = []
    for i, (c_in, width) in enumerate(zip([in_channels, *widths], widths, strict=False)):
        layers += [nn.MaxPool2d(2)] if i > 0 else []
        layers += [nn.Conv2d(c_in, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], num_classes)]
    return nn.Sequential(*layers)


def random_batch_maker(input_shape: Sequence[int], num_classes: int = 10, seed: int = 0,
                       ) -> BatchMaker:
    """The sweep's ``make_batch``: one fixed random batch per size, the same on every device
    (drawn on the CPU) (chapter 6)."""

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        features = torch.randn(batch_size, *input_shape, generator=generator)
        labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
        return features.to(device), labels.to(device)

    return make_batch
