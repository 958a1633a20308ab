"""Chapter 5's demonstrations: a rank that fails on purpose, Hogwild training (processes
updating one model in shared memory without locks), and DataParallel against DDP counted
in bytes over the busiest GPU's link."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from d2lgpu.runtime.checks import (
    check_finite_tensors,
    check_module,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_tensor,
    check_training_loss,
)
from d2lgpu.runtime.distributed import process_group

__all__ = ["busiest_gpu_bytes", "faulty_worker", "hogwild_train"]


def faulty_worker(
    rank: int, world_size: int, master_port: int, bad_rank: int, timeout_s: float = 30.0
) -> float:
    """Rank ``bad_rank`` raises before the all-reduce its peers wait in, to show what
    :func:`launch` does with a failure (chapter 5)."""
    with process_group(rank, world_size, master_port=master_port, timeout_s=timeout_s) as ctx:
        if ctx.rank == bad_rank:
            raise ValueError(f"rank {ctx.rank} found a bad batch (raised on purpose)")
        value = torch.ones(1, device=ctx.device)
        dist.all_reduce(value)
        return value.item()


# --- Hogwild: several processes, one model in shared memory ---
def _hogwild_worker(
    rank: int, model: nn.Module, features: torch.Tensor, targets: torch.Tensor, nprocs: int,
    epochs: int, batch_size: int, lr: float, seed: int,
) -> None:
    """One Hogwild process: SGD on its own shard, writing straight into the shared parameters."""
    torch.manual_seed(seed + rank)
    shard_x, shard_y = features[rank::nprocs], targets[rank::nprocs]
    # The optimizer holds the shared tensors themselves: step() writes where all processes read.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.MSELoss()
    for _ in range(epochs):
        order = torch.randperm(len(shard_x))
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            optimizer.zero_grad()
            loss_fn(model(shard_x[idx]), shard_y[idx]).backward()
            optimizer.step()


def _run_workers(fn: Callable[..., None], nprocs: int, args: tuple, timeout_s: float) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes. Hogwild's workers wait for no peer, so
    torch.multiprocessing's own report of a failure (that process's traceback, or its signal)
    says all there is; at ``timeout_s`` the workers still running are stopped."""
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    workers = mp.start_processes(fn, args, nprocs, join=False, start_method=method)
    deadline = time.monotonic() + timeout_s
    while not workers.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in workers.processes:
                process.kill()
            raise TimeoutError(f"hogwild_train's {nprocs} processes did not finish within "
                               f"timeout_s={timeout_s:g} s and were stopped: pass a larger "
                               "timeout_s, or fewer epochs")


def hogwild_train(
    model: nn.Module, features: torch.Tensor, targets: torch.Tensor, nprocs: int = 2, *,
    epochs: int = 1, batch_size: int = 32, lr: float = 0.05, seed: int = 0,
    timeout_s: float = 300.0,
) -> nn.Module:
    """Train a CPU model (MSE loss) with ``nprocs`` processes that all update its shared
    parameters in place, without locks (chapter 5); ``model`` then holds everybody's updates.
    A diverged run raises ``FloatingPointError``."""
    check_module("model", model)
    for name, tensor in (("features", features), ("targets", targets)):
        check_tensor(name, tensor, dtype="floating")
        check_finite_tensors(name, [tensor], fix="Clean the data before training.")
    for name, value in (("nprocs", nprocs), ("epochs", epochs), ("batch_size", batch_size)):
        check_positive_int(name, value)
    check_positive_float("lr", lr)
    check_seed(seed)
    check_positive_float("timeout_s", timeout_s)
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("hogwild_train shares CPU memory between processes; move the model to "
                         "the CPU first")
    if len(features) != len(targets):
        raise ValueError(f"{len(features)} feature rows but {len(targets)} targets")
    with torch.no_grad():
        before = nn.functional.mse_loss(model(features), targets).item()
    model.share_memory()
    args = (model, features, targets, nprocs, epochs, batch_size, lr, seed)
    _run_workers(_hogwild_worker, nprocs, args, timeout_s)
    # The ranks' steps race: the loss over all the data, before and after, is what is judged.
    with torch.no_grad():
        after = nn.functional.mse_loss(model(features), targets).item()
    check_training_loss(after, when=f"hogwild training ({epochs} epoch(s))", lr=lr,
                        first_loss=before, advice="or a smaller batch_size")
    return model


# --- DataParallel against DDP, counted: the bytes over the busiest GPU's link in one step ---
def busiest_gpu_bytes(
    param_bytes: int, world_size: int, input_bytes: int = 0, output_bytes: int = 0,
    buffer_bytes: int = 0,
) -> dict[str, float]:
    """The fewest bytes the busiest GPU's link carries in one training step, for
    DataParallel and DDP (chapter 5, which derives both).

    DataParallel passes everything through GPU 0: ``2 * param_bytes + buffer_bytes +
    (N - 1)/N * (input_bytes + 2 * output_bytes)``. DDP all-reduces the gradients and
    broadcasts the buffers: ``2 (N - 1)/N * param_bytes + buffer_bytes``.
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
