"""Where the memory of a training step goes: predicted by formula, and counted.

A training step keeps four kinds of tensors alive:

* **parameters**, ``P`` numbers;
* **gradients**, one per parameter, ``P`` more;
* **optimizer state**: nothing for plain SGD, one buffer per parameter for SGD
  with momentum, two for Adam (the running mean and the running mean of squares);
* **activations**: what the forward pass saves for the backward pass. They are
  the only kind that grows with the batch, in proportion to it.

A GPU's caching allocator keeps statistics (``torch.cuda.memory_allocated``,
``max_memory_allocated``) from which these can be read. A CPU has no such
counters, so this module counts tensor bytes, which works on every device:

* ``SavedActivations`` (chapter 6's, in ``precision``) registers saved-tensor hooks
  for the ``with`` block and adds up every tensor autograd keeps for backward (each
  storage once, parameters and buffers left out: they exist anyway);
* :class:`LiveTensorBytes` watches every operation in the block, adds the bytes
  of each new tensor it creates and subtracts them when the tensor is freed,
  which gives the live bytes at any moment and their peak.

Two ways to spend less on activations live here too: gradient accumulation
(:func:`accumulated_gradients`: ``k`` micro-batches make the same gradient as one
batch ``k`` times larger) and activation checkpointing (:class:`Checkpointed`:
keep a stage's input only, and recompute the rest during backward).
"""

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

from d2lgpu.precision import SavedActivations, precision_policy, tf32_switches
from d2lgpu.runtime.checks import (
    check_module,
    check_positive_float,
    check_positive_int,
    check_tensor,
)
from d2lgpu.timing import format_table, time_fn

__all__ = [
    "OPTIMIZERS",
    "Checkpointed",
    "CheckpointRow",
    "LiveTensorBytes",
    "MemoryAnatomy",
    "accumulated_gradients",
    "checkpoint_stages",
    "checkpointing_tradeoff",
    "check_module",
    "check_tensor",
    "format_mib",
    "gradient_bytes",
    "make_optimizer",
    "measure_activations",
    "measure_training_memory",
    "mlp_activation_bytes",
    "optimizer_state_bytes",
    "optimizer_state_formula",
    "parameter_bytes",
    "resnet18_activation_bytes",
    "storage_bytes",
]

#: Optimizers of this chapter, and how many fp32 buffers of the parameters' size each keeps.
OPTIMIZERS: dict[str, int] = {"sgd": 0, "sgd_momentum": 1, "adam": 2}

_MIB = 2**20




def _check_batch(X: object, y: object) -> None:
    check_tensor("X", X)
    check_tensor("y", y)
    if len(X) != len(y):  # type: ignore[arg-type]
        raise ValueError(f"X holds {len(X)} examples but y {len(y)} labels")  # type: ignore[arg-type]


def format_mib(nbytes: float) -> str:
    """Bytes as MiB with one decimal, the unit ``torch.cuda`` memory reports are read in
    (chapter 8)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)):
        raise TypeError(f"nbytes must be a number of bytes, got {type(nbytes).__name__} {nbytes!r}")
    if nbytes != nbytes or nbytes in (float("inf"), float("-inf")):
        # Negative counts are allowed (a difference of two counts); NaN and inf are a bug.
        raise ValueError(f"nbytes must be a finite number of bytes, got {nbytes!r}")
    return f"{nbytes / _MIB:.1f} MiB"


# ---------------------------------------------------------------------------
# Counting bytes of tensors
# ---------------------------------------------------------------------------


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: views of one tensor count once."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Iterable):
        raise TypeError(
            "tensors must be an iterable of tensors (a list, or model.parameters()), got "
            f"{type(tensors).__name__}; for one tensor pass [tensor]"
        )
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        check_tensor("each of tensors", tensor)
        seen.setdefault(_storage_key(tensor), tensor.untyped_storage().nbytes())
    return sum(seen.values())


def parameter_bytes(model: nn.Module) -> int:
    """Bytes held by ``model``'s parameters (chapter 8)."""
    check_module("model", model)
    return storage_bytes(model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    """Bytes held by the ``.grad`` tensors of ``model``'s parameters (0 before backward)."""
    check_module("model", model)
    return storage_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (created by the first ``step()``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    return storage_bytes(
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def make_optimizer(
    name: str, params: Iterable[nn.Parameter], lr: float = 0.01
) -> torch.optim.Optimizer:
    """One of :data:`OPTIMIZERS` by name: ``"sgd"``, ``"sgd_momentum"`` (0.9) or ``"adam"``."""
    check_positive_float("lr", lr)
    if isinstance(params, (nn.Module, torch.Tensor)):
        raise TypeError(
            f"params must be an iterable of parameters: pass model.parameters(), not the "
            f"{type(params).__name__} itself"
        )
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {name!r}")


def optimizer_state_formula(name: str, model: nn.Module) -> int:
    """Predicted optimizer state: 0, 1 or 2 copies of the parameters (SGD, momentum, Adam).

    Adam also keeps a step counter per parameter tensor (a 4-byte scalar), which
    the formula leaves out: it is the difference the count shows.
    """
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name] * parameter_bytes(model)


class LiveTensorBytes(TorchDispatchMode):
    """Live and peak bytes of the tensors that operations create inside a ``with`` block
    (chapter 8).

    A CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``,
    so this counts: a dispatch mode sees every operation, adds the storage of
    each tensor an operation creates (not views or in-place results, which
    reuse an input's storage) and subtracts it when the storage is freed (a weak
    reference notices). Tensors that existed before the block (parameters, the
    batch, optimizer state from an earlier step) are not counted; ``peak`` is
    the most bytes that were alive at once on top of them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[tuple[str, int], weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        inputs = {
            _storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[tuple[str, int]]) -> None:
        storage = tensor.untyped_storage()
        key = _storage_key(tensor)
        nbytes = storage.nbytes()
        if nbytes == 0 or key in inputs or key in self._refs:
            return  # empty, a view or in-place result, or already counted
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._refs[key] = weakref.ref(storage, lambda _ref: self._freed(key, nbytes))

    def _freed(self, key: tuple[str, int], nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= nbytes


# ---------------------------------------------------------------------------
# Formulas for the activations of the course's models
# ---------------------------------------------------------------------------


def mlp_activation_bytes(
    batch: int, in_features: int, width: int, hidden: int, depth: int, element_size: int = 4
) -> int:
    """Activations a :func:`d2lgpu.models.residual_mlp` saves for backward, in bytes (chapter 8).

    Per example: the input (saved by the first linear layer), then per block the
    block's input (first linear layer), the GELU's input and the second linear
    layer's input (``width + 2 * hidden``), and the last block's output (saved by
    the classifier). Nothing else: the residual additions save nothing.
    """
    for name, value in dict(
        batch=batch, in_features=in_features, width=width, hidden=hidden, depth=depth,
        element_size=element_size,
    ).items():
        check_positive_int(name, value)
    per_example = in_features + depth * (width + 2 * hidden) + width
    return batch * per_example * element_size


def resnet18_activation_bytes(
    batch: int, image_size: int = 28, in_channels: int = 1, element_size: int = 4
) -> int:
    """Activations :func:`d2lgpu.models.resnet18` saves for backward in training mode, in bytes
    (chapter 8).

    Per example: the input image; in the stem, the convolution's output (saved
    by batch norm) and the ReLU's output (saved by the ReLU and by the next
    convolution); in each of the 8 residual blocks four feature maps (both
    convolutions' outputs and both ReLUs' outputs; the 1x1 shortcut's output and
    batch norm's outputs are used once and not kept); the pooled 512 features
    for the classifier. Per batch, each batch-norm layer keeps the mean and the
    inverse standard deviation of its channels.
    """
    for name, value in dict(batch=batch, image_size=image_size, in_channels=in_channels,
                            element_size=element_size).items():
        check_positive_int(name, value)
    size = image_size
    per_example = in_channels * size * size + 2 * 64 * size * size
    bn_channels = 64
    for stage, channels in enumerate((64, 128, 256, 512)):
        if stage > 0:
            size = (size + 1) // 2  # 3x3 convolution, stride 2, padding 1
        per_example += 2 * 4 * channels * size * size
        bn_channels += 4 * channels  # two blocks of two batch norms
    per_example += 512
    return (batch * per_example + 2 * bn_channels) * element_size


def measure_activations(model: nn.Module, X: torch.Tensor) -> int:
    """Bytes ``model`` saves for backward on the batch ``X`` (forward only, training mode)
    (chapter 8)."""
    check_module("model", model)
    check_tensor("X", X)
    model.train()
    exclude = [*model.parameters(), *model.buffers()]
    with SavedActivations(exclude) as saved:
        out = model(X)
    del out
    return saved.nbytes


# ---------------------------------------------------------------------------
# The anatomy of one training step
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryAnatomy:
    """Bytes of each kind of tensor in one training step: predicted and counted.

    ``peak`` is counted during a second, steady-state step (optimizer state
    already there): parameters plus optimizer state plus the most bytes the
    step's own tensors took at once. ``cuda_peak`` is the allocator's
    ``max_memory_allocated`` for that step on a GPU, ``None`` elsewhere.
    """

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
        """The four kinds added up. A step's peak differs: activations are freed during
        backward while gradients appear, and the optimizer's update makes temporaries."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def rows(self) -> list[tuple[str, str, str]]:
        """(component, formula, counted) rows for :meth:`table`."""
        act_formula = self.activations_formula
        return [
            ("parameters", format_mib(self.parameters), format_mib(self.parameters)),
            ("gradients", format_mib(self.parameters), format_mib(self.gradients)),
            (
                f"optimizer state ({self.optimizer})",
                format_mib(self.optimizer_state_formula),
                format_mib(self.optimizer_state),
            ),
            (
                f"activations (batch {self.batch})",
                "-" if act_formula is None else format_mib(act_formula),
                format_mib(self.activations),
            ),
        ]

    def table(self) -> str:
        return format_table(("component", "formula", "counted"), self.rows())


def _loss(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(X), y)


def measure_training_memory(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    optimizer: str = "adam",
    *,
    activations_formula: int | None = None,
    lr: float = 0.01,
) -> MemoryAnatomy:
    """Run two training steps of ``model`` on ``(X, y)`` and count where the bytes went (chapter 8).

    The first step is counted piece by piece: activations during forward
    (:class:`SavedActivations`), gradients after backward, optimizer state after
    ``step()``. The second step is watched by :class:`LiveTensorBytes` (and by the
    CUDA allocator on a GPU) for the peak. ``model`` is trained by the two steps.
    """
    check_module("model", model)
    _check_batch(X, y)
    if activations_formula is not None and (
        isinstance(activations_formula, bool) or not isinstance(activations_formula, int)
        or activations_formula < 0
    ):
        raise TypeError(f"activations_formula must be a number of bytes (an int >= 0) or None, "
                        f"got {type(activations_formula).__name__} {activations_formula!r}")
    model.train()
    opt = make_optimizer(optimizer, model.parameters(), lr=lr)
    opt.zero_grad(set_to_none=True)
    exclude = [*model.parameters(), *model.buffers()]
    with SavedActivations(exclude) as saved:  # the model's activations; not the loss's
        out = model(X)
    loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    grads = gradient_bytes(model)
    opt.step()
    state = optimizer_state_bytes(opt)

    opt.zero_grad(set_to_none=True)
    del loss, out
    on_cuda = X.device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(X.device)
        torch.cuda.reset_peak_memory_stats(X.device)
    with LiveTensorBytes() as live:
        _loss(model, X, y).backward()
        opt.step()
    cuda_peak = torch.cuda.max_memory_allocated(X.device) if on_cuda else None
    params = parameter_bytes(model)
    return MemoryAnatomy(
        optimizer=optimizer,
        batch=len(X),
        parameters=params,
        gradients=grads,
        optimizer_state=state,
        optimizer_state_formula=optimizer_state_formula(optimizer, model),
        activations=saved.nbytes,
        activations_formula=activations_formula,
        peak=params + state + live.peak,
        cuda_peak=cuda_peak,
    )


# ---------------------------------------------------------------------------
# Gradient accumulation
# ---------------------------------------------------------------------------


def accumulated_gradients(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, micro_batches: int
) -> list[torch.Tensor]:
    """Gradients of the mean cross-entropy over ``(X, y)``, computed in ``micro_batches`` pieces
    (chapter 8).

    Each piece's mean loss is weighted by its share of the batch before
    ``backward``, and ``backward`` adds into ``.grad``; so the sum is the gradient
    of the mean over the whole batch, with only one piece's activations alive at
    a time. ``micro_batches=1`` is the ordinary full-batch gradient. Returns
    copies, in ``model.parameters()`` order.
    """
    check_module("model", model)
    _check_batch(X, y)
    check_positive_int("micro_batches", micro_batches)
    if micro_batches > len(X):
        raise ValueError(
            f"cannot split a batch of {len(X)} into {micro_batches} micro-batches: "
            "use at most one micro-batch per example"
        )
    model.train()
    model.zero_grad(set_to_none=True)
    for X_part, y_part in zip(X.chunk(micro_batches), y.chunk(micro_batches), strict=True):
        (_loss(model, X_part, y_part) * (len(X_part) / len(X))).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


# ---------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """Run ``inner`` under activation checkpointing while training.

    Forward keeps only the input of ``inner``; backward runs ``inner``'s forward
    again to get the activations it needs. ``use_reentrant=False`` is the
    implementation PyTorch recommends (it works with inputs that do not require
    gradients and with ``torch.autograd.grad``). In eval mode or without
    gradients there is nothing to save, and ``inner`` runs as it is.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = check_module("inner", inner)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.inner, *args, use_reentrant=False)
        return self.inner(*args)


def checkpoint_stages(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """Wrap the child modules ``names`` of ``model`` in :class:`Checkpointed`, in place
    (chapter 8)."""
    check_module("model", model)
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
            f"names must be a list of child module names, e.g. [{names!r}], got "
            f"{type(names).__name__} {names!r}"
        )
    names = list(names)
    children = dict(model.named_children())
    for name in names:
        if name not in children:
            raise ValueError(f"model has no child module {name!r}; it has {list(children)}")
        setattr(model, name, Checkpointed(children[name]))
    return model


@dataclass(frozen=True)
class CheckpointRow:
    """One variant of :func:`checkpointing_tradeoff`."""

    variant: str
    #: Bytes created by forward that are still alive when backward starts.
    held_after_forward: int
    #: Most bytes alive at once during forward and backward (on top of parameters).
    peak: int
    #: The CUDA allocator's peak for the same step on a GPU; None elsewhere.
    cuda_peak: int | None
    #: Seconds of forward + backward: the fastest of the timed steps, the one least
    #: slowed down by whatever else the machine was doing. On a GPU wall-clock time (the
    #: GPU synchronised); on a CPU the process's CPU time (``time.process_time``), which
    #: other programs taking turns on the cores do not stretch.
    step_seconds: float
    #: Every timed step's seconds, in the order they ran: their spread is the clock's noise.
    step_times: tuple[float, ...] = ()


def _counted_step(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    model.zero_grad(set_to_none=True)
    with LiveTensorBytes() as live:
        loss = _loss(model, X, y)
        held = live.live
        loss.backward()
    return held, live.peak


def checkpointing_tradeoff(
    make_model: Callable[[], nn.Module],
    X: torch.Tensor,
    y: torch.Tensor,
    stages: Sequence[str],
    *,
    repeats: int = 3,
    progress: bool = False,
    precision: str = "fp32",
) -> tuple[list[CheckpointRow], float]:
    """Memory and time of forward + backward, without and with checkpointing of ``stages``
    (chapter 8).

    ``make_model()`` must build the same model every time (seed inside it); it
    is built on ``X``'s device. One counted step per variant (which also warms
    it up), then ``repeats`` timed steps of each, taken in turns so that a
    change in the machine's load hits both alike (on a CPU they are timed in CPU
    time of this process, see :class:`CheckpointRow`). ``progress`` shows a tqdm bar
    over all these steps. Returns the two rows and
    the largest difference between the two variants' gradients (checkpointing
    recomputes the same numbers, so it should be zero or rounding).

    ``precision`` is a word of :data:`d2lgpu.precision.PRECISIONS`; the default
    "fp32" is strict fp32: TF32 off for matmuls and for cuDNN's convolutions, in
    the counted steps as in the timed ones (``cudnn.flags`` would otherwise switch
    TF32 on, its default). "tf32" allows it; "bf16"/"fp16"/"auto" add autocast.
    """
    if not callable(make_model) or isinstance(make_model, nn.Module):
        raise TypeError(
            "make_model must be a function that builds the model (seeded inside), e.g. "
            f"lambda: resnet18(); got {type(make_model).__name__}"
        )
    _check_batch(X, y)
    check_positive_int("repeats", repeats)
    policy = precision_policy(X.device, precision)
    # None (a policy that leaves TF32 alone) keeps whatever cuDNN is set to now.
    # The new API's word, never the legacy flag: reading that raises once a learner has set
    # cudnn.conv.fp32_precision (torch's "mix of the legacy and new APIs").
    allow_tf32 = (torch.backends.cudnn.conv.fp32_precision != "ieee" if policy.tf32 is None
                  else policy.tf32)
    with policy.matmul_precision(), policy.autocast():
        return _checkpointing_tradeoff(make_model, X, y, stages, repeats, progress, allow_tf32)


@contextlib.contextmanager
def _deterministic_cudnn(conv_tf32: bool) -> Iterator[None]:
    """cuDNN on, deterministic, no autotuner, TF32 convolutions as asked; restored after.

    Not ``torch.backends.cudnn.flags``: it reads the legacy ``allow_tf32`` flag, which
    raises once a learner has set ``cudnn.conv.fp32_precision`` (chapter 6).
    """
    cudnn = torch.backends.cudnn
    saved = (cudnn.enabled, cudnn.benchmark, cudnn.deterministic)
    cudnn.enabled, cudnn.benchmark, cudnn.deterministic = True, False, True
    conv = "tf32" if conv_tf32 else "ieee"
    try:
        with tf32_switches(torch.backends.cuda.matmul.fp32_precision, conv):
            yield
    finally:
        cudnn.enabled, cudnn.benchmark, cudnn.deterministic = saved


def _checkpointing_tradeoff(
    make_model: Callable[[], nn.Module],
    X: torch.Tensor,
    y: torch.Tensor,
    stages: Sequence[str],
    repeats: int,
    progress: bool,
    allow_tf32: bool,
) -> tuple[list[CheckpointRow], float]:
    on_cuda = X.device.type == "cuda"
    bar = None
    if progress:
        import warnings

        with warnings.catch_warnings():  # without ipywidgets tqdm.auto warns, then draws text
            warnings.simplefilter("ignore")
            from tqdm.auto import tqdm

        bar = tqdm(total=2 * (1 + repeats), desc="steps", unit="step")
    models, counted, grads = {}, {}, []
    for variant in ("plain", "checkpointed"):
        model = make_model().to(X.device)
        if variant == "checkpointed":
            checkpoint_stages(model, stages)
        model.train()
        if on_cuda:
            torch.cuda.synchronize(X.device)
            torch.cuda.reset_peak_memory_stats(X.device)
        # cuDNN may pick convolution algorithms whose sums run in another order on every
        # call: deterministic ones make "the same gradients" a check of exact equality.
        with _deterministic_cudnn(conv_tf32=allow_tf32):
            held, peak = _counted_step(model, X, y)
        if bar is not None:
            bar.update(1)
        cuda_peak = torch.cuda.max_memory_allocated(X.device) if on_cuda else None
        counted[variant] = (held, peak, cuda_peak)
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        models[variant] = model

    times: dict[str, list[float]] = {variant: [] for variant in models}
    for _ in range(repeats):
        for variant, model in models.items():

            def step(model: nn.Module = model) -> None:
                model.zero_grad(set_to_none=True)
                _loss(model, X, y).backward()

            if X.device.type == "cpu":
                started = time.process_time()
                step()
                times[variant].append(time.process_time() - started)
            else:
                times[variant].append(time_fn(step, X.device, warmup=0, repeats=1).median)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    rows = [CheckpointRow(variant, *counted[variant], min(times[variant]), tuple(times[variant]))
            for variant in models]
    diff = max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))
    return rows, diff
