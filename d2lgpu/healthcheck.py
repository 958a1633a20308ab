"""Is the distributed setup healthy? Every rank all-reduces, waits at a barrier, and reports.
Run it before a long job with the job's torchrun flags (chapter 5)::

    torchrun --standalone --nproc_per_node=2 -m d2lgpu.healthcheck
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from d2lgpu.report import nccl_version
from d2lgpu.runtime.cli import add_job_flags
from d2lgpu.runtime.distributed import (
    DistContext,
    all_reduce_sum,
    end_process,
    mark_progress,
    process_group,
)

__all__ = ["health_check", "main"]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({os.cpu_count()} cores)"


def health_check(ctx: DistContext) -> tuple[bool, list[str]]:
    """Run the checks in the current process group; every rank gets the same (all OK?,
    report lines), so that every rank exits with the same status."""
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    got = all_reduce_sum([ctx.rank + 1], ctx)[0]
    mark_progress("health check: barrier")
    dist.barrier()
    mine = {"rank": ctx.rank, "local_rank": ctx.local_rank, "host": socket.gethostname(),
            "pid": os.getpid(), "device": _device_name(ctx.device), "all_reduce": got}
    everyone: list[dict | None] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)

    lines = [
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda or 'n/a'}, NCCL {nccl_version() or 'n/a'}",
        f"backend {ctx.backend}, world size {ctx.world_size}, "
        f"all_reduce of rank+1 must give {expected:g}",
    ]
    healthy = True
    for info in everyone:
        ok = info["all_reduce"] == expected
        healthy &= ok
        verdict = "OK" if ok else f"WRONG: all_reduce gave {info['all_reduce']:g}"
        lines.append(f"rank {info['rank']} (local {info['local_rank']}) on {info['host']} "
                     f"pid {info['pid']}, {info['device']}: all_reduce {verdict}, barrier OK")
    return healthy, lines


def main(argv: Sequence[str] | None = None) -> int:
    """Command line for torchrun; returns the exit status (0 healthy, 1 not)."""
    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m d2lgpu.healthcheck",
                                     description=__doc__.split("\n")[0])
    add_job_flags(parser, data=False, timeout_s=60.0)
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    try:
        with process_group(timeout_s=args.timeout) as ctx:
            healthy, lines = health_check(ctx)
            if ctx.is_main:
                print("\n".join(lines))
                print("HEALTHY" if healthy else "UNHEALTHY: see the WRONG lines above", flush=True)
    except Exception as exc:  # report what broke on this rank, then fail the job
        print(f"rank {rank}: health check FAILED: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return 1
    return 0 if healthy else 1


if __name__ == "__main__":
    end_process(main())  # never through interpreter teardown: see end_process
