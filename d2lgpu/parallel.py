"""Data parallelism by hand: split a batch, copy the parameters, sum the gradients.

These are the pieces of "Dive into Deep Learning" section 13.5, rebuilt so they
run anywhere and are correct:

* Every function takes a *list of devices* (or of replicas), never assumes a
  second GPU exists. A list may name the same device several times, e.g.
  ``[torch.device("cpu")] * 2``: that simulates two devices on one, so the
  logic of data parallelism can be run and checked on a laptop.
* :func:`allreduce` writes the sum *into* every tensor with ``copy_``. Writing
  ``t = total`` in a loop only rebinds a local name and leaves the gradients
  on the other devices untouched, which silently trains diverging replicas.
* :func:`data_parallel_step` divides every shard's *summed* loss by the global
  batch size, so that the summed gradients equal the gradient of the mean loss
  over the whole batch, even when the shards have different sizes. Averaging
  per-shard mean losses is only right when all shards are equally large.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from d2lgpu.runtime.checks import (
    check_positive_float,
    check_sequence,
    check_tensor,
    check_training_loss,
)
from d2lgpu.runtime.gpus import require_cuda_device

__all__ = [
    "allreduce",
    "choose_cpu_threads",
    "data_parallel_step",
    "max_abs_difference",
    "replicate_params",
    "split_batch",
]

#: A functional network: ``forward(X, params) -> outputs``.
Forward = Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]
#: A loss that returns one value per example (``reduction="none"``).
PerExampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_batch(
    X: torch.Tensor, y: torch.Tensor, devices: Sequence[torch.device | str]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split a minibatch along its first dimension into one shard per device (chapter 3).

    Shard ``i`` of ``X`` and of ``y`` is moved to ``devices[i]``. The shards are
    as even as possible, as :func:`torch.tensor_split` makes them: with ``n``
    examples and ``k`` devices the first ``n % k`` shards hold ``n // k + 1``
    examples and the rest ``n // k``. Devices may repeat (``[cpu, cpu]``
    simulates two devices on the CPU); a shard that is already on its device is
    not copied.

    Raises ``ValueError`` for an empty device list, for ``X`` and ``y`` with
    different numbers of examples, and for fewer examples than devices (a
    device with an empty shard would have nothing to compute a gradient from).
    """
    check_tensor("X", X)
    check_tensor("y", y)
    devices = [require_cuda_device(_device(d), "split_batch") for d in _devices(devices)]
    if X.dim() == 0 or y.dim() == 0:
        raise ValueError(
            f"X and y must have a batch dimension first; got shapes {tuple(X.shape)} "
            f"and {tuple(y.shape)}"
        )
    if X.shape[0] != y.shape[0]:
        raise ValueError(
            f"X has {X.shape[0]} examples but y has {y.shape[0]}; "
            "pass features and labels of the same minibatch"
        )
    if X.shape[0] < len(devices):
        raise ValueError(
            f"cannot split {X.shape[0]} examples across {len(devices)} devices: every device "
            "needs at least one example; use a batch size of at least the number of devices"
        )
    X_shards = [
        shard.to(device)
        for shard, device in zip(X.tensor_split(len(devices)), devices, strict=True)
    ]
    y_shards = [
        shard.to(device)
        for shard, device in zip(y.tensor_split(len(devices)), devices, strict=True)
    ]
    return X_shards, y_shards


def allreduce(tensors: Sequence[torch.Tensor]) -> None:
    """Sum tensors that live on (possibly) different devices, in place (chapter 3).

    Afterwards every tensor in ``tensors`` holds the sum of all of them, on its
    own device: the sum is accumulated on the device of ``tensors[0]`` and then
    copied back into each tensor with ``copy_``, so the caller's tensors (for
    example every replica's ``p.grad``) really change. Returns None, like other
    in-place operations.

    Raises ``ValueError`` for an empty list, or for tensors whose shapes or
    dtypes differ (summing those would broadcast or round silently).
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError(
            "allreduce takes a list of tensors, one per device, got one tensor: "
            "pass e.g. [p.grad for p in params_of_each_replica]"
        )
    try:
        tensors = check_sequence("tensors", tensors, of="tensors, one per device")
    except ValueError:
        raise ValueError("allreduce needs at least one tensor; got an empty list") from None
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"allreduce sums tensors; item {i} is {type(t).__name__}. If it is a "
                "gradient that is None, run backward() on every replica first"
            )
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"allreduce needs tensors of one shape and dtype: tensor 0 is "
                f"{tuple(first.shape)} {first.dtype}, tensor {i} is {tuple(t.shape)} {t.dtype}"
            )
    # no_grad: the tensors may be parameters (leaves that require grad), and
    # summing them is bookkeeping, not part of any model's computation.
    with torch.no_grad():
        total = first.clone()
        for t in tensors[1:]:
            total += t.to(total.device)
        for t in tensors:
            t.copy_(total)


def replicate_params(
    params: Sequence[torch.Tensor], device: torch.device | str
) -> list[torch.Tensor]:
    """Independent copies of ``params`` on ``device``, each a leaf that requires grad (chapter 3).

    The copies never share memory with the originals, even on the same device,
    so replicas on ``[cpu, cpu]`` behave like replicas on two GPUs.
    """
    params = check_sequence("params", params, of="parameter tensors")
    for i, p in enumerate(params):
        check_tensor(f"params[{i}]", p)
    device = require_cuda_device(_device(device), "replicate_params")
    return [p.detach().to(device, copy=True).requires_grad_(True) for p in params]


def choose_cpu_threads(speeds: dict[int, Sequence[float]]) -> int:
    """The thread count to train with on a CPU, from interleaved repeats of the same steps.

    ``speeds`` maps a thread count to its repeats' speeds (examples/s, higher is
    better). The choice is the count whose *slowest* repeat is fastest: a busy spell
    of other programs is what makes a repeat slow, and a team of threads suffers far
    more from it than one thread (every operation split over the team waits for its
    descheduled member),
    so the worst repeat says which setting survives a busy machine. A tie goes to
    fewer threads.
    """
    if not isinstance(speeds, dict) or not speeds:
        raise ValueError(f"speeds must be a non-empty dict {{threads: [examples/s, ...]}}, "
                         f"got {speeds!r}")
    for threads, runs in speeds.items():
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"thread counts must be ints >= 1, got {threads!r}")
        runs = check_sequence(f"speeds[{threads}]", runs, of="speeds")
        if not runs or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            for v in runs
        ):
            raise ValueError(f"speeds[{threads}] must hold positive finite speeds, got {runs!r}")
    return max(sorted(speeds), key=lambda threads: (min(speeds[threads]), -threads))


def max_abs_difference(
    tensors_a: Sequence[torch.Tensor], tensors_b: Sequence[torch.Tensor]
) -> float:
    """The largest absolute element-wise difference between two lists of tensors (chapter 3).

    Use it to check that replicas agree, or that two training runs followed the
    same trajectory. Tensors may be on different devices; ``b`` is moved to ``a``'s.

    A NaN anywhere (in either list, even at the same place in both) makes the result
    ``math.inf``: NaN equals nothing, so replicas holding one do not "hold equal
    values", and ``result < tolerance`` is False as it should be. Empty tensors are
    an error, because there is nothing in them to compare.
    """
    tensors_a = check_sequence("tensors_a", tensors_a, of="tensors", allow_empty=True)
    tensors_b = check_sequence("tensors_b", tensors_b, of="tensors", allow_empty=True)
    for name, tensors in (("tensors_a", tensors_a), ("tensors_b", tensors_b)):
        for i, t in enumerate(tensors):
            check_tensor(f"{name}[{i}]", t)
    if len(tensors_a) != len(tensors_b):
        raise ValueError(f"the lists hold {len(tensors_a)} and {len(tensors_b)} tensors")
    if len(tensors_a) == 0:
        raise ValueError("max_abs_difference needs at least one pair of tensors")
    worst = 0.0
    for i, (a, b) in enumerate(zip(tensors_a, tensors_b, strict=True)):
        if a.shape != b.shape:
            raise ValueError(
                f"tensor {i} has shape {tuple(a.shape)} in one list, {tuple(b.shape)} in the other"
            )
        if a.numel() == 0:
            raise ValueError(
                f"tensor {i} is empty (shape {tuple(a.shape)}): there are no values to compare"
            )
        gap = (a.detach() - b.detach().to(a.device)).abs().max().item()
        # torch's max propagates NaN, but Python's max(0.0, nan) would keep 0.0.
        if math.isnan(gap):
            return math.inf
        worst = max(worst, gap)
    return worst


def _device(device: object) -> torch.device:
    """``device`` as a torch.device, or a TypeError that says what a device is."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        return torch.device(device)
    raise TypeError(
        f"a device must be a torch.device or a string such as 'cpu' or 'cuda:0', got "
        f"{type(device).__name__} {device!r}"
    )


def _devices(devices: object) -> list[torch.device]:
    """A non-empty list of devices, with the fix when it is not one."""
    if isinstance(devices, (torch.device, str)):
        raise TypeError(
            f"devices must be a list of devices, got the single device {devices!r}: "
            f"wrap it in a list, e.g. [{devices!r}]"
        )
    try:
        return [_device(d) for d in check_sequence("devices", devices, of="devices")]
    except ValueError:
        raise ValueError(
            "split_batch needs at least one device; pass e.g. d2lgpu.try_all_gpus(), "
            "or [torch.device('cpu')] * 2 to simulate two devices on the CPU"
        ) from None


def _per_example_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none")


def _check_replicas(
    forward: object, loss_fn: object, replicas: object
) -> list[Sequence[torch.Tensor]]:
    """Refuse what :func:`data_parallel_step` cannot step; return the replicas as a list."""
    if not callable(forward):
        raise TypeError(
            f"forward must be a function forward(X, params) -> outputs, got "
            f"{type(forward).__name__}"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function, got {type(loss_fn).__name__}")
    if isinstance(replicas, torch.Tensor):
        raise TypeError("replicas must be a list of parameter lists (one per device), got a tensor")
    try:
        replicas = check_sequence("replicas", replicas, of="parameter lists (one per device)")
        replicas = [
            check_sequence(f"replicas[{d}]", r, of="parameter tensors") for d, r in
            enumerate(replicas)
        ]
    except ValueError:
        raise ValueError("data_parallel_step needs at least one replica with parameters; "
                         "see replicate_params") from None
    if any(len(r) != len(replicas[0]) for r in replicas):
        raise ValueError(
            "every replica must hold the same, non-empty list of parameters; "
            f"got lengths {[len(r) for r in replicas]}"
        )
    for d, params in enumerate(replicas):
        for i, p in enumerate(params):
            check_tensor(f"replicas[{d}][{i}]", p)
            if not p.requires_grad:
                raise ValueError(
                    f"replicas[{d}][{i}] does not require grad: make replicas with "
                    "d2lgpu.replicate_params(params, device)"
                )
    return replicas


def _backward_on_every_shard(
    forward: Forward,
    loss_fn: PerExampleLoss,
    replicas: Sequence[Sequence[torch.Tensor]],
    X_shards: Sequence[torch.Tensor],
    y_shards: Sequence[torch.Tensor],
    batch_size: int,
) -> list[torch.Tensor]:
    """Step 2: each device's forward and backward on its shard; returns the shards' losses."""
    shard_losses = []
    for params, X_shard, y_shard in zip(replicas, X_shards, y_shards, strict=True):
        losses = loss_fn(forward(X_shard, params), y_shard)
        if losses.shape != (X_shard.shape[0],):
            raise ValueError(
                f"loss_fn must return one loss per example (shape ({X_shard.shape[0]},)), got "
                f"shape {tuple(losses.shape)}; use reduction='none'"
            )
        shard_loss = losses.sum() / batch_size
        # On GPUs, backward is queued asynchronously: the devices work side by side
        # while Python moves on to the next shard.
        shard_loss.backward()
        shard_losses.append(shard_loss.detach())
    return shard_losses


def data_parallel_step(
    forward: Forward,
    replicas: Sequence[Sequence[torch.Tensor]],
    X: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    loss_fn: PerExampleLoss = _per_example_cross_entropy,
) -> float:
    """One step of minibatch SGD, data parallel over the devices of ``replicas`` (chapter 3).

    ``replicas[d]`` is the list of parameters on device ``d`` (made with
    :func:`replicate_params`; all replicas must hold equal values). The step:

    1. split ``X, y`` into one shard per replica (:func:`split_batch`);
    2. on every device, run ``forward`` on its shard and backpropagate the
       shard's *summed* per-example loss divided by the *global* batch size;
    3. :func:`allreduce` each parameter's gradient over the replicas, so every
       device holds the gradient of the mean loss over the whole batch;
    4. apply the same SGD update ``p -= lr * p.grad`` on every device, which
       keeps the replicas equal without copying parameters around.

    ``loss_fn(outputs, y)`` must return one loss per example (default: cross
    entropy with ``reduction="none"``). Returns the mean loss over the batch.

    Before the update is applied, one host read checks what a training loop checks
    (:func:`d2lgpu.runtime.checks.check_training_loss`): the replicas still agree, the inputs
    and loss are finite (NaN in ``X`` is blamed on the data, not on ``lr``), and the
    update is not absurdly large (more than :data:`MAX_UPDATE_RATIO` times the
    size of the weights, plus one). On an error no replica has been changed.
    """
    replicas = _check_replicas(forward, loss_fn, replicas)
    lr = check_positive_float("lr", lr)
    devices = [r[0].device for r in replicas]
    X_shards, y_shards = split_batch(X, y, devices)  # 1.
    shard_losses = _backward_on_every_shard(  # 2.
        forward, loss_fn, replicas, X_shards, y_shards, X.shape[0]
    )
    for i in range(len(replicas[0])):  # 3.
        allreduce([params[i].grad for params in replicas])

    # One host synchronisation, after all the work is queued: the loss, and what the
    # checks need, before any replica changes.
    loss = sum(loss.to(devices[0]) for loss in shard_losses)
    health = _step_health(replicas, X, lr, devices[0])
    value, bad_inputs, replica_gap, update, size = torch.stack([loss.float(), *health]).tolist()
    try:
        _check_step(value, bad_inputs, replica_gap, update, size, lr)
    except (ValueError, FloatingPointError):
        for params in replicas:  # as after a step: no gradient is left to add up with the next
            for p in params:
                p.grad = None
        raise
    with torch.no_grad():  # 4.
        for params in replicas:
            for p in params:
                p -= lr * p.grad
                p.grad = None
    return value


#: A step that would move the weights by more than this times their size (plus one) has
#: diverged: SGD that learns moves them by a small fraction of it.
MAX_UPDATE_RATIO = 1e3


def _step_health(
    replicas: Sequence[Sequence[torch.Tensor]], X: torch.Tensor, lr: float, device: torch.device
) -> list[torch.Tensor]:
    """On ``device``, without a host read: NaN/inf count in ``X``, the largest gap between
    replica 0 and the others, and the norms of the update and of the weights."""
    with torch.no_grad():
        first = replicas[0]
        if X.dtype.is_floating_point:
            bad_inputs = (~torch.isfinite(X)).sum().float().to(device)
        else:
            bad_inputs = torch.zeros((), device=device)
        gaps = [
            (p.detach().to(device) - q.detach().to(device)).abs().max()
            for other in replicas[1:] for p, q in zip(first, other, strict=True) if p.numel()
        ]
        replica_gap = torch.stack(gaps).max().float() if gaps else torch.zeros((), device=device)
        update = lr * torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in first])
        ).to(device)
        size = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.detach().float()) for p in first])
        ).to(device)
    return [bad_inputs, replica_gap, update, size]


def _check_step(
    loss: float, bad_inputs: float, replica_gap: float, update: float, size: float, lr: float
) -> None:
    if not math.isfinite(size):
        raise ValueError(
            "the parameters of replica 0 hold NaN or inf: an earlier step diverged, or they "
            "were made from broken weights. Start again from fresh parameters (with a "
            "smaller lr if a step diverged)"
        )
    if not replica_gap <= 1e-6 * (size + 1):  # nan too
        raise ValueError(
            f"the replicas hold different values (largest gap {replica_gap:.3g}): every "
            "replica must start equal. Make them with d2lgpu.replicate_params from one set "
            "of parameters, and update them only through data_parallel_step"
        )
    if bad_inputs:
        raise ValueError(
            f"X holds {int(bad_inputs)} NaN or inf value(s): the data are broken, not the "
            "training. Clean or drop those examples (e.g. torch.nan_to_num)"
        )
    if math.isfinite(loss) and math.isfinite(size) and not math.isfinite(update):
        raise FloatingPointError(
            f"the gradients hold NaN or inf at lr {lr:g} with a finite loss: the step was not "
            "applied. Try a smaller lr, or check forward for operations that overflow"
        )
    check_training_loss(loss, when="this step", lr=lr,
                        advice="(the step was not applied: the replicas are unchanged)")
    if update > MAX_UPDATE_RATIO * (size + 1):
        raise FloatingPointError(
            f"this step would move the weights by {update:.3g}, {update / (size + 1):.3g} "
            f"times their size ({size:.3g}) plus one: training diverges at lr {lr:g}. Try a "
            "smaller lr (the step was not applied: the replicas are unchanged)"
        )


def nn_parallel_on_devices(
    module: torch.nn.Module, X: torch.Tensor, devices: Sequence[torch.device | str]
) -> dict[str, Exception | None]:
    """Try each piece of ``nn.DataParallel``'s forward pass on ``devices``; None where it works.

    The pieces are ``torch.nn.parallel``'s ``replicate(module, devices)``,
    ``scatter(X, devices)``, ``parallel_apply`` (one forward pass per replica,
    each in its own thread) and ``gather`` (onto ``devices[0]``). Each is tried on
    its own with inputs already on the right devices, and the exception it raises
    is returned rather than raised, so that one call shows which of them accept
    the devices: they are written for CUDA GPUs, and this tells what the installed
    PyTorch does with anything else.
    """
    import copy

    from torch.nn import parallel

    devices = [torch.device(d) for d in devices]
    if not devices:
        raise ValueError("nn_parallel_on_devices needs at least one device")
    if X.dim() == 0 or X.shape[0] < len(devices):
        raise ValueError(
            f"X must hold at least one example per device: {len(devices)} devices, "
            f"X of shape {tuple(X.shape)}"
        )
    shards = [shard.to(d) for shard, d in zip(X.tensor_split(len(devices)), devices, strict=True)]
    replicas = [copy.deepcopy(module).to(d) for d in devices]
    attempts = {
        "replicate": lambda: parallel.replicate(module, devices),
        "scatter": lambda: parallel.scatter(X, devices),
        "parallel_apply": lambda: parallel.parallel_apply(replicas, shards, devices=devices),
        "gather": lambda: parallel.gather(shards, devices[0]),
    }
    outcome: dict[str, Exception | None] = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except Exception as err:  # returned to the caller, who shows it
            outcome[name] = err
        else:
            outcome[name] = None
    return outcome
