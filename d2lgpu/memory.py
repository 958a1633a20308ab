"""Where the memory of a training step goes, predicted by formula and counted in tensor bytes,
which works on every device (chapter 8)."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from d2lgpu.precision import SavedActivations, tf32_switches
from d2lgpu.runtime.checks import check_module, check_positive_int, check_tensor
from d2lgpu.timing import format_table, timed_calls

#: Optimizers of this chapter, and how many fp32 buffers of the parameters' size each keeps.
OPTIMIZERS: dict[str, int] = {"sgd": 0, "sgd_momentum": 1, "adam": 2}


def _check_batch(X: object, y: object) -> None:
    check_tensor("X", X)
    check_tensor("y", y)
    if len(X) != len(y):  # type: ignore[arg-type]
        raise ValueError(f"X holds {len(X)} examples but y {len(y)} labels")  # type: ignore[arg-type]


def format_mib(nbytes: float) -> str:
    """Bytes as MiB with one decimal, the unit ``torch.cuda`` memory reports are read in
    (chapter 8)."""
    return f"{nbytes / 2**20:.1f} MiB"


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors``: views of one tensor count once."""
    seen = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(seen.values())


def parameter_bytes(model: nn.Module) -> int:
    """Bytes held by ``model``'s parameters (chapter 8)."""
    check_module("model", model)
    return storage_bytes(model.parameters())


def check_optimizer(name: object) -> str:
    """``name`` if it is one of :data:`OPTIMIZERS`; else a ValueError listing them."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {name!r}")
    return name


def make_optimizer(name: str, params: Iterable[nn.Parameter],
                   lr: float = 0.01) -> torch.optim.Optimizer:
    """One of :data:`OPTIMIZERS` by name: ``"sgd"``, ``"sgd_momentum"`` (0.9) or ``"adam"``."""
    check_optimizer(name)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9 if name == "sgd_momentum" else 0.0)


class LiveTensorBytes(TorchDispatchMode):
    """Live and peak bytes of the tensors that operations create inside a ``with`` block
    (chapter 8): a dispatch mode adds each new storage, and a weak reference subtracts it
    once freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[tuple[str, int], weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        flat = tree_flatten((args, kwargs))[0]
        inputs = {_storage_key(t) for t in flat if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[tuple[str, int]]) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = _storage_key(tensor), storage.nbytes()
        if nbytes == 0 or key in inputs or key in self._refs:
            return  # empty, a view or in-place result, or already counted
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._refs[key] = weakref.ref(storage, lambda _ref: self._freed(key, nbytes))

    def _freed(self, key: tuple[str, int], nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= nbytes


def mlp_activation_bytes(batch: int, in_features: int, width: int, hidden: int, depth: int,
                         element_size: int = 4) -> int:
    """Activations a :func:`d2lgpu.models.residual_mlp` saves for backward, in bytes (chapter 8):
    per example the input, per block its input, the GELU's and fc2's inputs, the last output."""
    return batch * (in_features + depth * (width + 2 * hidden) + width) * element_size


def resnet18_activation_bytes(batch: int, image_size: int = 28, in_channels: int = 1,
                              element_size: int = 4) -> int:
    """Activations :func:`d2lgpu.models.resnet18` saves for backward in training mode, in bytes
    (chapter 8): per example the input, the stem's two outputs, four maps per residual block and
    the 512 pooled features; per batch norm its channels' mean and inverse std."""
    size = image_size
    per_example = in_channels * size * size + 2 * 64 * size * size + 512
    bn_channels = 64
    for stage, channels in enumerate((64, 128, 256, 512)):
        if stage > 0:
            size = (size + 1) // 2  # 3x3 convolution, stride 2, padding 1
        per_example += 2 * 4 * channels * size * size
        bn_channels += 4 * channels  # two blocks of two batch norms
    return (batch * per_example + 2 * bn_channels) * element_size


def measure_activations(model: nn.Module, X: torch.Tensor) -> int:
    """Bytes ``model`` saves for backward on the batch ``X`` (forward only, training mode)
    (chapter 8)."""
    check_module("model", model)
    check_tensor("X", X)
    model.train()
    with SavedActivations([*model.parameters(), *model.buffers()]) as saved:
        out = model(X)
    del out
    return saved.nbytes


@dataclass(frozen=True)
class MemoryAnatomy:
    """Bytes of each kind of tensor in one training step: predicted and counted. ``peak``: the
    parameters, optimizer state and most bytes a steady-state step's tensors took at once."""

    optimizer: str
    batch: int
    parameters: int
    gradients: int
    optimizer_state: int
    optimizer_state_formula: int
    activations: int
    activations_formula: int | None
    peak: int
    cuda_peak: int | None

    @property
    def total(self) -> int:
        """The four kinds added up: not the peak (backward frees activations as gradients come)."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def table(self) -> str:
        mib = format_mib
        formula = "-" if self.activations_formula is None else mib(self.activations_formula)
        rows = [("parameters", mib(self.parameters), mib(self.parameters)),
                ("gradients", mib(self.parameters), mib(self.gradients)),
                (f"optimizer state ({self.optimizer})", mib(self.optimizer_state_formula),
                 mib(self.optimizer_state)),
                (f"activations (batch {self.batch})", formula, mib(self.activations))]
        return format_table(("component", "formula", "counted"), rows)


def _loss(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(X), y)


def measure_training_memory(model: nn.Module, X: torch.Tensor, y: torch.Tensor,
                            optimizer: str = "adam", *,
                            activations_formula: int | None = None) -> MemoryAnatomy:
    """Count where the bytes of two training steps of ``model`` on ``(X, y)`` went (chapter 8):
    the first piece by piece, the steady-state second for its peak."""
    check_module("model", model)
    _check_batch(X, y)
    model.train()
    opt = make_optimizer(optimizer, model.parameters())
    with SavedActivations([*model.parameters(), *model.buffers()]) as saved:
        out = model(X)  # the model's activations; not the loss's
    nn.functional.cross_entropy(out, y).backward()
    grads = storage_bytes(p.grad for p in model.parameters())
    opt.step()
    state = storage_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))

    opt.zero_grad(set_to_none=True)
    del out
    on_cuda = X.device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(X.device)
        torch.cuda.reset_peak_memory_stats(X.device)
    with LiveTensorBytes() as live:
        _loss(model, X, y).backward()
        opt.step()
    params = parameter_bytes(model)
    return MemoryAnatomy(optimizer, len(X), params, grads, state, OPTIMIZERS[optimizer] * params,
                         saved.nbytes, activations_formula, params + state + live.peak,
                         torch.cuda.max_memory_allocated(X.device) if on_cuda else None)


def accumulated_gradients(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, micro_batches: int
) -> list[torch.Tensor]:
    """Copies of the gradients of the mean cross-entropy over ``(X, y)``, computed in
    ``micro_batches`` pieces, each weighted by its share of the batch (chapter 8)."""
    check_module("model", model)
    _check_batch(X, y)
    check_positive_int("micro_batches", micro_batches)
    if micro_batches > len(X):
        raise ValueError(f"cannot split a batch of {len(X)} into {micro_batches} micro-batches: "
                         "use at most one micro-batch per example")
    model.train()
    model.zero_grad(set_to_none=True)
    for X_part, y_part in zip(X.chunk(micro_batches), y.chunk(micro_batches), strict=True):
        (_loss(model, X_part, y_part) * (len(X_part) / len(X))).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


class Checkpointed(nn.Module):
    """Run ``inner`` under activation checkpointing while training: forward keeps only its
    input, and backward runs its forward again."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.inner, *args, use_reentrant=False)
        return self.inner(*args)


def checkpoint_stages(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """Wrap the child modules ``names`` of ``model`` in :class:`Checkpointed`, in place
    (chapter 8)."""
    check_module("model", model)
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(f"names must be a list of child module names, e.g. [{names!r}], got "
                        f"{type(names).__name__} {names!r}")
    children = dict(model.named_children())
    for name in names:
        if name not in children:
            raise ValueError(f"model has no child module {name!r}; it has {list(children)}")
        setattr(model, name, Checkpointed(children[name]))
    return model


@dataclass(frozen=True)
class CheckpointRow:
    """One variant of :func:`checkpointing_tradeoff`; ``step_seconds``: the fastest timed step,
    wall-clock on a GPU, this process's CPU time (not stretched by other programs) on a CPU."""

    variant: str
    held_after_forward: int  # bytes created by forward, still alive when backward starts
    peak: int  # most bytes alive at once during forward and backward
    cuda_peak: int | None
    step_seconds: float
    step_times: tuple[float, ...] = ()  # every timed step: their spread is the clock's noise


@contextlib.contextmanager
def _deterministic_cudnn() -> Iterator[None]:
    """Deterministic cuDNN in strict fp32, so that "the same gradients" is exact equality (not
    ``cudnn.flags``: its legacy TF32 flag raises once ``fp32_precision`` is set, chapter 6)."""
    cudnn = torch.backends.cudnn
    saved = (cudnn.enabled, cudnn.benchmark, cudnn.deterministic)
    cudnn.enabled, cudnn.benchmark, cudnn.deterministic = True, False, True
    try:
        with tf32_switches(torch.backends.cuda.matmul.fp32_precision, "ieee"):
            yield
    finally:
        cudnn.enabled, cudnn.benchmark, cudnn.deterministic = saved


def _timed_step(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds of forward + backward: CPU time on a CPU (immune to a busy neighbour), the
    course's synchronised clock (chapter 2's ``time_fn`` loop) on a GPU."""
    model.zero_grad(set_to_none=True)
    if X.device.type != "cuda":
        started = time.process_time()
        _loss(model, X, y).backward()
        return time.process_time() - started
    return timed_calls(lambda: _loss(model, X, y).backward(), X.device, 1).times[0]


def checkpointing_tradeoff(make_model: Callable[[], nn.Module], X: torch.Tensor, y: torch.Tensor,
                           stages: Sequence[str], *, repeats: int = 3,
                           progress: bool = False) -> tuple[list[CheckpointRow], float]:
    """Memory and time of forward + backward, without and with checkpointing of ``stages``
    (chapter 8): one counted step each, then ``repeats`` timed steps in turns, so that a change
    in load hits both alike. Returns the rows and the largest difference of their gradients."""
    from tqdm.auto import tqdm

    if not callable(make_model) or isinstance(make_model, nn.Module):
        raise TypeError("make_model must be a function that builds the model (seeded inside), "
                        f"e.g. lambda: resnet18(); got {type(make_model).__name__}")
    _check_batch(X, y)
    check_positive_int("repeats", repeats)
    on_cuda = X.device.type == "cuda"
    bar = tqdm(total=2 * (1 + repeats), desc="steps", unit="step", disable=not progress)
    models, counted, grads = {}, {}, []
    for variant in ("plain", "checkpointed"):
        model = make_model().to(X.device).train()
        if variant == "checkpointed":
            checkpoint_stages(model, stages)
        if on_cuda:
            torch.cuda.synchronize(X.device)
            torch.cuda.reset_peak_memory_stats(X.device)
        with _deterministic_cudnn(), LiveTensorBytes() as live:
            loss = _loss(model, X, y)
            held = live.live  # what forward left for backward
            loss.backward()
        bar.update(1)
        cuda_peak = torch.cuda.max_memory_allocated(X.device) if on_cuda else None
        counted[variant] = (held, live.peak, cuda_peak)
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        models[variant] = model
    times: dict[str, list[float]] = {variant: [] for variant in models}
    for _ in range(repeats):
        for variant, model in models.items():
            times[variant].append(_timed_step(model, X, y))
            bar.update(1)
    bar.close()
    rows = [CheckpointRow(variant, *counted[variant], min(times[variant]), tuple(times[variant]))
            for variant in models]
    diff = max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))
    return rows, diff
