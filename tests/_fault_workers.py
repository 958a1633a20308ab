"""Workers that fail in the ways real jobs fail, for the launcher tests.

They live in a module of their own (not in a test file) so that the processes
:func:`d2lgpu.runtime.distributed.launch` spawns can import them by name; pytest puts
this directory on ``sys.path`` and spawned processes inherit it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from d2lgpu.runtime.distributed import all_reduce_sum, mark_progress, process_group


def return_rank(rank: int) -> int:
    return rank


def die_without_exception(rank: int, flag_dir: str) -> None:
    """Rank 1 ends with ``os._exit(3)``; then rank 2 crashes (SIGSEGV); rank 0 is healthy.

    Rank 0 would run for a minute: it is still running when the others are
    gone, so launch has to stop it, and must not blame it for the failure.
    Rank 2 waits for rank 1's flag file, so the order of the two deaths is fixed.
    """
    flag = Path(flag_dir) / "rank1-exiting"
    if rank == 1:
        flag.touch()
        os._exit(3)
    if rank == 2:
        while not flag.exists():
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)


def killed_in_collective(rank: int, world_size: int, master_port: int) -> float:
    """Rank 1 is killed (SIGKILL, as the OOM killer does) while rank 0 waits in an all-reduce."""
    with process_group(rank, world_size, master_port=master_port, timeout_s=30):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        value = torch.ones(1)
        dist.all_reduce(value)
        return value.item()


def return_unpicklable(rank: int):
    """Returns a lambda, which pickle cannot send back to the caller."""
    return lambda x: x + rank


def exit_early(rank: int, exiting_rank: int, code: int | str | None) -> str:
    """Rank ``exiting_rank`` calls ``sys.exit(code)``; every other rank returns a string."""
    if rank == exiting_rank:
        sys.exit(code)
    time.sleep(0.5)  # still running when the other rank has already left
    return f"rank {rank} returned"


def exit_early_in_collective(rank: int, world_size: int, master_port: int) -> float:
    """Rank 1 calls ``sys.exit(0)`` inside the group while rank 0 waits for it in an all-reduce."""
    with process_group(rank, world_size, master_port=master_port, timeout_s=30):
        if rank == 1:
            sys.exit(0)
        value = torch.ones(1)
        dist.all_reduce(value)
        return value.item()


def read_env(rank: int, name: str) -> str | None:
    """The value of environment variable ``name`` in the rank (None when unset)."""
    return os.environ.get(name)


def hang_before_the_collective(rank: int, world_size: int, master_port: int) -> list[float]:
    """Rank 1 is stuck (a long sleep) while rank 0 waits for it in an all-reduce (timeout 3 s)."""
    with process_group(rank, world_size, master_port=master_port, timeout_s=3) as ctx:
        if rank == 1:
            time.sleep(60)
        return all_reduce_sum([1.0], ctx)


def rank_1_never_ends(rank: int) -> int:
    """Rank 0 returns at once; rank 1 sleeps far past launch's timeout."""
    if rank == 1:
        time.sleep(60)
    return rank


def mismatched_world_size(rank: int, master_port: int) -> None:
    """Rank 0 is told the job has 2 ranks, rank 1 that it has 3."""
    with process_group(rank, 2 if rank == 0 else 3, master_port=master_port, timeout_s=20):
        pass


def hang_after_its_mark(rank: int, world_size: int, master_port: int) -> float:
    """Both ranks report step 1; then rank 1 is stuck in its own work while rank 0 waits in
    an all-reduce (timeout 3 s): the progress marks alone cannot tell them apart."""
    with process_group(rank, world_size, master_port=master_port, timeout_s=3):
        mark_progress("step 1")
        if rank == 1:
            time.sleep(60)
        value = torch.ones(1)
        dist.all_reduce(value)
        return value.item()


def claim_rank(rank: int, ranks: list[int], world_size: int, master_port: int) -> None:
    """Process ``rank`` joins the group as rank ``ranks[rank]``: two processes may claim one."""
    with process_group(ranks[rank], world_size, master_port=master_port, timeout_s=5):
        pass


class FailsInAWorker(torch.nn.Linear):
    """A layer that works in the parent process; in a Hogwild worker it raises, or with
    ``hang=True`` never returns."""

    def __init__(self, *args, hang: bool = False) -> None:
        super().__init__(*args)
        self.hang = hang

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            if self.hang:
                time.sleep(3600)
            raise ValueError("failed in a worker (raised on purpose)")
        return super().forward(x)
