"""Chapter 5's demonstrations: a rank that fails on purpose, Hogwild training (several
processes training one model whose tensors live in shared memory, each updating it in
place without locks, the pattern of PyTorch's own MNIST Hogwild example), and
DataParallel against DDP counted in bytes over the busiest GPU's link.

They run on the runtime's launcher and process groups (``d2lgpu.runtime.distributed``);
the chapter's own cells write the techniques in plain PyTorch first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from d2lgpu.runtime.checks import (
    check_module,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_training_loss,
)
from d2lgpu.runtime.distributed import launch, process_group

__all__ = [
    "busiest_gpu_bytes",
    "faulty_worker",
    "hogwild_train",
]


def faulty_worker(
    rank: int, world_size: int, master_port: int, bad_rank: int, timeout_s: float = 30.0
) -> float:
    """A worker that goes wrong on purpose, to show what :func:`launch` does with a failure
    (chapter 5).

    Rank ``bad_rank`` raises ``ValueError`` before the all-reduce; the other
    ranks are already waiting in it and would wait until ``timeout_s`` if the
    launcher did not notice the failure and stop them.
    """
    with process_group(rank, world_size, master_port=master_port, timeout_s=timeout_s) as ctx:
        if ctx.rank == bad_rank:
            raise ValueError(f"rank {ctx.rank} found a bad batch (raised on purpose)")
        value = torch.ones(1, device=ctx.device)
        dist.all_reduce(value)
        return value.item()


# ---------------------------------------------------------------------------
# Hogwild: several processes, one model in shared memory
# ---------------------------------------------------------------------------


def _hogwild_worker(
    rank: int,
    model: nn.Module,
    features: torch.Tensor,
    targets: torch.Tensor,
    nprocs: int,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> None:
    """One Hogwild process: SGD on its own shard, writing straight into the shared parameters."""
    torch.manual_seed(seed + rank)
    shard_x, shard_y = features[rank::nprocs], targets[rank::nprocs]
    # The optimizer holds the shared parameter tensors themselves, so step()
    # updates the memory every process reads from; no copy, no lock.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.MSELoss()
    for _ in range(epochs):
        order = torch.randperm(len(shard_x))
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            optimizer.zero_grad()
            loss_fn(model(shard_x[idx]), shard_y[idx]).backward()
            optimizer.step()


def hogwild_train(
    model: nn.Module,
    features: torch.Tensor,
    targets: torch.Tensor,
    nprocs: int = 2,
    *,
    epochs: int = 1,
    batch_size: int = 32,
    lr: float = 0.05,
    seed: int = 0,
    timeout_s: float = 300.0,
) -> nn.Module:
    """Train a CPU model with ``nprocs`` processes that all update the same shared parameters
    (chapter 5).

    Regression (MSE loss). The model's tensors are moved into shared memory
    (``model.share_memory()``, which calls
    ``share_memory_()`` on every parameter and buffer), then every process gets a handle to that
    memory, not a copy: when the call returns, ``model`` in the caller holds
    the result of everybody's updates. The updates race (no locks); for sparse
    or small updates that costs little accuracy, which is the point of Hogwild.
    Like ``d2lgpu.training.train``, it refuses data or weights holding nan or inf, and
    raises ``FloatingPointError`` when training diverged (the loss over the data is not
    finite afterwards, or ten times what it was) instead of returning exploded weights.
    """
    check_module("model", model)
    for name, tensor in (("features", features), ("targets", targets)):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point torch.Tensor, got "
                f"{tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__}"
            )
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name} hold nan or inf: clean the data before training")
    check_positive_int("nprocs", nprocs)
    check_positive_int("epochs", epochs)
    check_positive_int("batch_size", batch_size)
    check_positive_float("lr", lr)
    check_seed(seed)
    check_positive_float("timeout_s", timeout_s)
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError(
            "hogwild_train shares CPU memory between processes; move the model to the CPU first"
        )
    if any(not torch.isfinite(p).all() for p in model.parameters()):
        raise ValueError("the model's weights hold nan or inf before training: initialise it anew")
    if len(features) != len(targets):
        raise ValueError(f"{len(features)} feature rows but {len(targets)} targets")
    with torch.no_grad():
        before = nn.functional.mse_loss(model(features), targets).item()
    model.share_memory()
    launch(
        _hogwild_worker,
        nprocs,
        (model, features, targets, nprocs, epochs, batch_size, lr, seed),
        timeout_s=timeout_s,
    )
    # The course's one divergence rule (d2lgpu.runtime.checks): a loss that is not finite, or ten
    # times the one training started from, is a diverged run, never a result. The ranks'
    # steps race, so the loss over all the data, before and after, is what can be read.
    with torch.no_grad():
        after = nn.functional.mse_loss(model(features), targets).item()
    check_training_loss(after, when=f"hogwild training ({epochs} epoch(s))", lr=lr,
                        first_loss=before, advice="or a smaller batch_size")
    return model


# --- DataParallel against DDP, counted: the bytes over the busiest GPU's link in one step ---


def busiest_gpu_bytes(
    param_bytes: int,
    world_size: int,
    input_bytes: int = 0,
    output_bytes: int = 0,
    buffer_bytes: int = 0,
) -> dict[str, float]:
    """The fewest bytes the busiest GPU's link carries in one training step, for both wrappers
    (chapter 5).

    Counted are the bytes that must cross one GPU's link, one phase after another, when
    every collective runs as fast as its link allows. Divided by the link's bandwidth (one
    direction) they give the least time the step's communication takes, by the bounds in
    NVIDIA's nccl-tests (``doc/PERFORMANCE.md``): a broadcast must send all ``S`` bytes out
    of its root and a reduce must bring ``S`` bytes into its root, ``t >= S/B`` each; an
    all-reduce over ``N`` ranks needs ``t >= 2 (N - 1)/N * S/B`` on every rank.

    ``DataParallel`` (``torch/nn/parallel/data_parallel.py``; the batch starts on GPU 0):
    everything passes GPU 0. Per step it scatters ``(N - 1)/N`` of the input out, broadcasts
    the parameters and buffers to the replicas (``replicate`` -> ``comm.broadcast_coalesced``,
    an NCCL broadcast), gathers ``(N - 1)/N`` of the outputs in and sends their gradient back
    out (``Gather`` and its backward), and reduces the replicas' gradients into GPU 0
    (``Broadcast``'s backward -> ``comm.reduce_add_coalesced``, an NCCL reduce)::

        2 * param_bytes + buffer_bytes + (N - 1)/N * (input_bytes + 2 * output_bytes)

    ``DDP`` (``torch/nn/parallel/distributed.py``): each rank loads its own share of the
    batch; the gradients are all-reduced, and rank 0's buffers are broadcast before every
    forward (``forward_sync_buffers``, formerly ``broadcast_buffers``, True by default)::

        2 (N - 1)/N * param_bytes + buffer_bytes

    The parameter terms differ by a factor ``N/(N - 1)`` (2 on two GPUs, 8/7 on eight): what
    makes DataParallel slower is less the bytes than when and how they move (chapters 4 and
    5). One device moves nothing.
    """
    check_positive_int("world_size", world_size)
    for name, value in (("param_bytes", param_bytes), ("input_bytes", input_bytes),
                        ("output_bytes", output_bytes), ("buffer_bytes", buffer_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a whole number of bytes, 0 or more, got {value!r}")
    n = world_size
    if n == 1:  # DataParallel on one device calls the module; DDP has no peer
        return {"DataParallel": 0, "DDP": 0}
    share = (n - 1) / n
    return {
        "DataParallel": 2 * param_bytes + buffer_bytes + share * (input_bytes + 2 * output_bytes),
        "DDP": 2 * share * param_bytes + buffer_bytes,
    }
