"""Data parallelism by hand (chapter 3), d2l's section 13.5 made to run anywhere: a list of
devices may repeat (``[cpu, cpu]`` simulates two devices on one)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from d2lgpu.runtime.checks import check_positive_float, check_training_loss
from d2lgpu.runtime.gpus import require_cuda_device

__all__ = [
    "allreduce", "choose_cpu_threads", "data_parallel_step", "max_abs_difference",
    "nn_parallel_on_devices", "replicate_params", "split_batch",
]

def split_batch(X: torch.Tensor, y: torch.Tensor, devices: Sequence[torch.device | str],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split a minibatch into one shard per device, as even as ``torch.tensor_split`` cuts
    (chapter 3): the first ``n % k`` shards hold one example more."""
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} examples but y has {y.shape[0]}; "
                         "pass features and labels of the same minibatch")
    if X.shape[0] < len(devices):
        raise ValueError(f"cannot split {X.shape[0]} examples across {len(devices)} devices: "
                         "every device needs at least one example; use a batch size of at "
                         "least the number of devices")
    devices = [require_cuda_device(d, "split_batch") for d in devices]
    X_shards = [s.to(d) for s, d in zip(X.tensor_split(len(devices)), devices, strict=True)]
    y_shards = [s.to(d) for s, d in zip(y.tensor_split(len(devices)), devices, strict=True)]
    return X_shards, y_shards


def allreduce(tensors: Sequence[torch.Tensor]) -> None:
    """Sum tensors on (possibly) different devices into every one of them, in place
    (chapter 3): ``copy_`` changes the caller's tensors, where ``t = total`` would not."""
    if any(t is None for t in tensors):
        raise TypeError("allreduce got None for a tensor: if it is a gradient, run backward() "
                        "on every replica first")
    with torch.no_grad():  # the tensors may be parameters; summing them is bookkeeping
        total = tensors[0].clone()
        for t in tensors[1:]:
            total += t.to(total.device)
        for t in tensors:
            t.copy_(total)


def replicate_params(params: Sequence[torch.Tensor], device: torch.device | str,
) -> list[torch.Tensor]:
    """Independent copies of ``params`` on ``device``, leaves that require grad (chapter 3);
    never sharing memory, so replicas on ``[cpu, cpu]`` behave like replicas on two GPUs."""
    device = require_cuda_device(device, "replicate_params")
    return [p.detach().to(device, copy=True).requires_grad_(True) for p in params]


def choose_cpu_threads(speeds: dict[int, Sequence[float]]) -> int:
    """The thread count whose slowest repeat is fastest (chapter 3): a busy spell of other
    programs stalls a team of threads far more than one thread. A tie goes to fewer."""
    return max(sorted(speeds), key=lambda threads: (min(speeds[threads]), -threads))


def max_abs_difference(tensors_a: Sequence[torch.Tensor], tensors_b: Sequence[torch.Tensor],
) -> float:
    """The largest element-wise gap between two lists of tensors (chapter 3); a NaN anywhere
    makes it ``inf``, so replicas holding one never read as equal."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(tensors_a, tensors_b, strict=True)):
        if a.shape != b.shape:  # a - b would broadcast
            raise ValueError(f"tensor {i} has shape {tuple(a.shape)} and {tuple(b.shape)}")
        gap = (a.detach() - b.detach().to(a.device)).abs().max().item()
        if math.isnan(gap):  # Python's max(0.0, nan) would keep 0.0
            return math.inf
        worst = max(worst, gap)
    return worst


def data_parallel_step(
    forward: Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor],
    replicas: Sequence[Sequence[torch.Tensor]], X: torch.Tensor, y: torch.Tensor, lr: float,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda logits, y:
        F.cross_entropy(logits, y, reduction="none"),
) -> float:
    """One SGD step, data parallel over the devices of ``replicas`` (chapter 3): each shard's
    summed per-example loss over the whole batch's size (right for uneven shards too), the
    gradients all-reduced; returns the batch's mean loss. On an error no replica changes."""
    check_positive_float("lr", lr)
    devices = [r[0].device for r in replicas]
    X_shards, y_shards = split_batch(X, y, devices)
    shard_losses = []
    for params, X_shard, y_shard in zip(replicas, X_shards, y_shards, strict=True):
        losses = loss_fn(forward(X_shard, params), y_shard)
        if losses.shape != (X_shard.shape[0],):
            raise ValueError(f"loss_fn must return one loss per example, got shape "
                             f"{tuple(losses.shape)}; use reduction='none'")
        shard_loss = losses.sum() / X.shape[0]
        shard_loss.backward()  # queued on the shard's device: the devices work side by side
        shard_losses.append(shard_loss.detach())
    for i in range(len(replicas[0])):
        allreduce([params[i].grad for params in replicas])
    loss = sum(loss.to(devices[0]) for loss in shard_losses)
    try:
        value = _check_step(replicas, X, lr, loss, devices[0])
    except (ValueError, FloatingPointError):
        for params in replicas:  # no gradient is left to add up with the next step
            for p in params:
                p.grad = None
        raise
    with torch.no_grad():
        for params in replicas:
            for p in params:
                p -= lr * p.grad
                p.grad = None
    return value


def _check_step(replicas: Sequence[Sequence[torch.Tensor]], X: torch.Tensor, lr: float,
                loss: torch.Tensor, device: torch.device) -> float:
    """The loss, read with one host read, after checks for NaN in ``X``, replicas that differ,
    broken weights or loss, and an update of over 1000 times the weights' size."""
    with torch.no_grad():
        first = replicas[0]
        bad = (~torch.isfinite(X)).sum() if X.is_floating_point() else torch.zeros(())
        gaps = [(p.to(device) - q.to(device)).abs().max() for other in replicas[1:]
                for p, q in zip(first, other, strict=True) if p.numel()]
        gap = torch.stack(gaps).max() if gaps else torch.zeros(())
        # The norm of the norms: no step-long copy of every gradient and weight.
        update = lr * torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in first]))
        size = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.float())
                                                     for p in first]))
        numbers = [t.float().to(device) for t in (loss, bad, gap, update, size)]
        value, bad, gap, update, size = torch.stack(numbers).tolist()
    if not math.isfinite(size):
        raise ValueError("the parameters of replica 0 hold NaN or inf: start again from fresh "
                         "parameters (with a smaller lr if a step diverged)")
    if not gap <= 1e-6 * (size + 1):
        raise ValueError(f"the replicas hold different values (largest gap {gap:.3g}): make "
                         "them with d2lgpu.replicate_params from one set of parameters")
    if bad:
        raise ValueError(f"X holds {int(bad)} NaN or inf value(s): the data are broken, not "
                         "the training. Clean or drop those examples")
    unchanged = "(the step was not applied: the replicas are unchanged)"
    check_training_loss(value, when="this step", lr=lr, advice=unchanged)
    if not update <= 1e3 * (size + 1):
        raise FloatingPointError(f"this step would move the weights by {update:.3g}, "
                                 f"{update / (size + 1):.3g} times their size ({size:.3g}) "
                                 f"plus one: training diverges at lr {lr:g}. Try a smaller lr "
                                 f"{unchanged}")
    return value


def nn_parallel_on_devices(
    module: torch.nn.Module, X: torch.Tensor, devices: Sequence[torch.device | str]
) -> dict[str, Exception | None]:
    """Try each piece of ``nn.DataParallel``'s forward pass on ``devices`` (chapter 3), inputs
    already in place: the exception each raises, or None where it works."""
    from torch.nn import parallel

    devices = [torch.device(d) for d in devices]
    if not 0 < len(devices) <= X.shape[0]:
        raise ValueError(f"need at least one device and one example per device: "
                         f"{len(devices)} devices, X of shape {tuple(X.shape)}")
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
            outcome[name] = None
        except Exception as err:  # returned to the caller, who shows it
            outcome[name] = err
    return outcome
