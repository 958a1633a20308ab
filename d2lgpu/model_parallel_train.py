"""FSDP2 x tensor parallel on a 2-D mesh, with checkpoints: chapter 9's torchrun entry point.

``torchrun --standalone --nproc_per_node=4 -m d2lgpu.model_parallel_train --dp 2 --tp 2``.
Started again with the same ``--checkpoint-dir``, a job continues from the latest checkpoint
on any mesh shape: DCP gives each rank the pieces it now holds.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from d2lgpu.model_parallel import ModelSpec, TrainResult, TwoDRun, check_2d
from d2lgpu.precision import PRECISIONS, precision_policy
from d2lgpu.runtime.checkpoints import Checkpoints, Resumed
from d2lgpu.runtime.cli import (
    add_job_flags,
    add_training_flags,
    check_checkpoint_flags,
    positive_int_flag,
)
from d2lgpu.runtime.distributed import process_group
from d2lgpu.sharding import fsdp2_unavailable_reason

__all__ = ["main"]

_COMMAND = "torchrun --standalone --nproc_per_node=N -m d2lgpu.model_parallel_train"


@dataclass
class EntryHooks(Checkpoints):
    """:class:`Checkpoints` as the command line trains on the mesh ``mesh_shape``: it says
    where it resumed from and when it saved, and kills the last rank (SIGKILL, as the
    out-of-memory killer does) after the forward of step ``kill_at_step`` (from 0), while the
    others wait for it."""

    mesh_shape: tuple[int, int] = (1, 1)
    kill_at_step: int | None = None

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler,
               settings: dict, end: int) -> Resumed:
        resumed = super().resume(model, optimizer, scaler, settings, end)
        if resumed.path is not None and dist.get_rank() == 0:
            print(f"resuming from {resumed.path} (step {resumed.step})", flush=True)
            if (saved := tuple(resumed.extra["mesh"])) != self.mesh_shape:
                print(f"the checkpoint was written on a mesh (dp, tp) = {saved}, this run has "
                      f"{self.mesh_shape}: each rank reads its own pieces", flush=True)
        return resumed

    def after_forward(self, step: int) -> None:
        rank = dist.get_rank()
        if (dist.get_world_size() - 1, self.kill_at_step) == (rank, step):
            print(f"rank {rank} is killed (SIGKILL) in step {step + 1}, after its forward; the "
                  "others wait for it in backward", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, done: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler, settings: dict, end: int, extra: dict) -> Path | None:
        path = super().after_step(done, model, optimizer, scaler, settings, end, extra)
        if path is not None and dist.get_rank() == 0:
            print(f"step {done}/{end}: loss {extra['losses'][-1]:.4f}; saved {path}", flush=True)
        return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_COMMAND, description="Train a stack of blocks with "
                                     "FSDP2 over dp and tensor parallel over tp, with checkpoints.")
    add = parser.add_argument
    add("--dp", type=positive_int_flag, help="data-parallel (FSDP2) ranks (default: ranks / --tp)")
    add("--tp", type=positive_int_flag, help="tensor-parallel ranks per data-parallel group "
        "(default: ranks / --dp, or 2 when neither is given and the ranks are even, else 1)")
    add("--steps", type=positive_int_flag, default=40)
    add("--save-every", type=positive_int_flag, default=10, help="steps between checkpoints")
    add("--kind", choices=("mlp", "attention"), default=ModelSpec.kind)
    add("--width", type=positive_int_flag, default=ModelSpec.width)
    add("--hidden", type=positive_int_flag, default=ModelSpec.hidden, help="MLP hidden units")
    add("--depth", type=positive_int_flag, default=ModelSpec.depth)
    add("--heads", type=positive_int_flag, default=ModelSpec.heads)
    add("--seq-len", type=positive_int_flag, default=16)
    add_training_flags(parser, batch_size=16, lr=0.05, seed=0, precisions=PRECISIONS,
                       precision="auto", lr_help="SGD's learning rate (momentum 0.9)",
                       checkpoint_help="resume from its latest checkpoint; save every "
                       "--save-every steps")
    add_job_flags(parser, data=False,
                  crash_point="this epoch's checkpoint (an epoch here is --save-every steps)")
    return parser


def _mesh(args: argparse.Namespace, world_size: int) -> tuple[int, int]:
    """``(dp, tp)`` from the flags, filling in what is not given."""
    dp, tp = args.dp, args.tp
    if tp is None:
        tp = max(world_size // dp, 1) if dp else 2 if world_size % 2 == 0 else 1
    return dp or max(world_size // tp, 1), tp


def _parse_args(argv: Sequence[str] | None,
                world_size: int | None = None) -> tuple[argparse.Namespace, TwoDRun | None]:
    """The flags, and (given the job's ``world_size``) the checked run they describe."""
    parser = _parser()
    args = parser.parse_args(argv)
    # before any work, not after the first checkpoint; an epoch here is --save-every steps
    check_checkpoint_flags(parser, args, -(-args.steps // args.save_every))
    try:
        spec = ModelSpec(args.width, args.hidden, args.depth, args.kind, args.heads)
    except ValueError as exc:  # e.g. a width that does not split into the heads
        parser.error(f"{exc} (--width, --heads)")
    if world_size is None:
        return args, None
    mesh = _mesh(args, world_size)
    try:
        check_2d(spec, mesh, world_size, args.batch_size)
    except ValueError as exc:
        parser.error(f"--dp {mesh[0]} --tp {mesh[1]} on {world_size} ranks, {args.kind} blocks of "
                     f"--hidden {args.hidden} / --heads {args.heads}, --batch-size "
                     f"{args.batch_size}: {exc}")
    return args, TwoDRun(spec, mesh, args.batch_size, args.seq_len, args.steps, args.lr, args.seed)


def main(argv: Sequence[str] | None = None) -> TrainResult:
    """Command line: every process started by torchrun joins the group and trains its part."""
    under_torchrun = "RANK" in os.environ
    # Usage errors first, also outside torchrun; the run itself needs the job's world size.
    args, two_d = _parse_args(argv, int(os.environ["WORLD_SIZE"]) if under_torchrun else None)
    if not under_torchrun:
        raise SystemExit("d2lgpu.model_parallel_train splits a model over processes: start it "
                         f"with torchrun, e.g. `{_COMMAND.replace('=N', '=4')} --dp 2 --tp 2`")
    with process_group(timeout_s=args.timeout) as ctx:
        if reason := fsdp2_unavailable_reason(ctx.device.type):
            raise RuntimeError(reason)
        policy = precision_policy(ctx.device, args.precision)
        two_d = replace(two_d, param_dtype=policy.dtype)
        if args.checkpoint_dir is not None:
            # A crash on the first attempt only: a restarted job (torchrun counts them) runs on.
            crash = args.fail_after_epoch is not None and os.environ.get(
                "TORCHELASTIC_RESTART_COUNT", "0") == "0"
            hooks = EntryHooks(args.checkpoint_dir, args.save_every, {"precision": policy.name},
                               two_d.mesh_shape,
                               args.fail_after_epoch * args.save_every if crash else None)
            two_d = replace(two_d, hooks=hooks)
        if ctx.is_main:
            params = sum(p.numel() for p in two_d.spec.build().parameters())
            print(f"{ctx.world_size} ranks, backend {ctx.backend}; mesh (dp, tp) = "
                  f"{two_d.mesh_shape}; {two_d.spec.depth} {two_d.spec.kind} blocks, {params:,} "
                  f"parameters; precision {policy.name}; global batch {two_d.batch_size} x "
                  f"{two_d.seq_len} positions, {two_d.steps} steps", flush=True)
        with policy.matmul_precision():  # TF32 on or off
            result = two_d.run(ctx)
        if ctx.is_main:
            print(f"done: {two_d.steps} steps, final loss {result.losses[-1]:.4f}", flush=True)
        return result


if __name__ == "__main__":
    from d2lgpu.runtime.distributed import end_process, exit_status_of

    end_process(exit_status_of(main))  # never through interpreter teardown: see end_process
