"""FSDP2 x tensor parallel on a 2-D mesh, with checkpoints: chapter 9's torchrun entry point.

Four processes on one machine (GPUs with NCCL when there are four, CPUs with gloo
otherwise), as 2 data-parallel groups of 2 tensor-parallel ranks::

    torchrun --standalone --nproc_per_node=4 -m d2lgpu.model_parallel_train \\
        --dp 2 --tp 2 --steps 40 --checkpoint-dir checkpoints

Every rank builds the same stack of blocks (:class:`d2lgpu.model_parallel.ModelSpec`,
same seed), splits each block's matmuls over its ``tp`` group (``parallelize_module``,
column-wise then row-wise), shards the pieces over its ``dp`` group (``fully_shard``),
and trains on its ``dp`` group's share of every batch
(:func:`d2lgpu.model_parallel.train_2d`). The data are a fixed random regression, the
same on every machine, so a run can be checked against one process
(:func:`d2lgpu.model_parallel.train_reference`).

Every ``--save-every`` steps, and after the last, all ranks write a distributed
checkpoint together (a temporary directory renamed when complete). Started again with
the same ``--checkpoint-dir``, by hand or by ``torchrun --max-restarts``, a job
continues from the latest complete checkpoint, **on any mesh shape**: saved on
``--dp 2 --tp 1``, it resumes on ``--dp 1 --tp 2``, and DCP gives each rank the
pieces of the saved tensors it now holds. Model, batch, sequence length, learning
rate, seed and precision are recorded and must match; a different mesh is announced.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import replace

from d2lgpu.model_parallel import (
    ModelSpec,
    ResumableTwoDRun,
    TrainResult,
    TwoDRun,
    check_2d,
)
from d2lgpu.precision import PRECISIONS, check_precision, precision_policy
from d2lgpu.runtime.checks import flag_type, positive_int_flag, positive_number_flag, seed_flag
from d2lgpu.runtime.distributed import add_job_flags, process_group
from d2lgpu.sharding import CheckpointError, fsdp2_unavailable_reason, prepare_checkpoint_root

__all__ = ["main"]

_COMMAND = "torchrun --standalone --nproc_per_node=N -m d2lgpu.model_parallel_train"
_precision_flag = flag_type(lambda _name, value: check_precision(value, "--precision"), str)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_COMMAND,
        description="Train a stack of blocks with FSDP2 over one mesh dimension (dp) and "
        "tensor parallel over the other (tp), with distributed checkpoints.",
    )
    parser.add_argument(
        "--dp",
        type=positive_int_flag,
        default=None,
        help="data-parallel (FSDP2) ranks (default: the ranks / --tp)",
    )
    parser.add_argument(
        "--tp",
        type=positive_int_flag,
        default=None,
        help="tensor-parallel ranks per data-parallel group (default: 2 when the number of "
        "ranks is even, else 1; the ranks / --dp when --dp is given)",
    )
    parser.add_argument("--steps", type=positive_int_flag, default=40)
    parser.add_argument(
        "--save-every",
        type=positive_int_flag,
        default=10,
        help="steps between checkpoints; the last step is always saved (default %(default)s)",
    )
    parser.add_argument("--kind", choices=("mlp", "attention"), default=ModelSpec.kind)
    parser.add_argument("--width", type=positive_int_flag, default=ModelSpec.width)
    parser.add_argument(
        "--hidden", type=positive_int_flag, default=ModelSpec.hidden, help="MLP hidden units"
    )
    parser.add_argument("--depth", type=positive_int_flag, default=ModelSpec.depth)
    parser.add_argument("--heads", type=positive_int_flag, default=ModelSpec.heads)
    parser.add_argument(
        "--batch-size",
        type=positive_int_flag,
        default=16,
        help="global batch size, split evenly over the dp groups (default %(default)s)",
    )
    parser.add_argument("--seq-len", type=positive_int_flag, default=16)
    parser.add_argument(
        "--lr", type=positive_number_flag, default=0.05, help="SGD's learning rate (momentum 0.9)"
    )
    parser.add_argument("--seed", type=seed_flag, default=0)
    parser.add_argument(
        "--precision",
        type=_precision_flag,
        metavar="{" + ",".join(PRECISIONS) + "}",
        default="auto",
        help="auto: the device's rule (bf16 from compute capability 8.0, fp16 on 7.x; on a "
        "CPU bf16 where it runs natively, else fp32); bf16/fp16: FSDP2 computes in it and "
        "reduces gradients in fp32 (default %(default)s)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="resume from the latest checkpoint here, and write one every --save-every steps",
    )
    add_job_flags(
        parser,
        crash_point="this epoch's checkpoint (an epoch here is --save-every steps)",
        data=False,
    )
    return parser


def _mesh(args: argparse.Namespace, world_size: int) -> tuple[int, int]:
    """``(dp, tp)`` from the flags, filling in what is not given."""
    dp, tp = args.dp, args.tp
    if dp is None and tp is None:
        tp = 2 if world_size % 2 == 0 else 1
    if dp is None:
        dp = max(world_size // tp, 1)
    if tp is None:
        tp = max(world_size // dp, 1)
    return dp, tp


def _parse_args(
    argv: Sequence[str] | None, world_size: int | None = None
) -> tuple[argparse.Namespace, ResumableTwoDRun | TwoDRun | None]:
    """The flags, and (given the job's ``world_size``) the checked job they describe."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.fail_after_epoch is not None and args.checkpoint_dir is None:
        parser.error("--fail-after-epoch needs --checkpoint-dir, to resume from after the crash")
    try:
        spec = ModelSpec(args.width, args.hidden, args.depth, args.kind, args.heads)
    except ValueError as exc:  # e.g. a width that does not split into the heads
        parser.error(f"{exc} (--width, --heads)")
    if args.checkpoint_dir is not None:
        try:  # before any work: not after the first checkpoint's
            prepare_checkpoint_root(args.checkpoint_dir)
        except (CheckpointError, TypeError) as exc:  # TypeError: an empty path
            parser.error(f"argument --checkpoint-dir: {exc}")
    if world_size is None:
        return args, None
    mesh = _mesh(args, world_size)
    try:
        check_2d(spec, mesh, world_size, args.batch_size)
    except ValueError as exc:
        parser.error(
            f"--dp {mesh[0]} --tp {mesh[1]} on {world_size} ranks, {args.kind} blocks of "
            f"--hidden {args.hidden} / --heads {args.heads}, --batch-size {args.batch_size}: "
            f"{exc}"
        )
    two_d = TwoDRun(spec, mesh, args.batch_size, args.seq_len, args.steps, args.lr, args.seed,
                    args.precision)
    if args.checkpoint_dir is None:
        return args, two_d
    return args, ResumableTwoDRun(two_d, args.checkpoint_dir, args.save_every, log=True)


def main(argv: Sequence[str] | None = None) -> TrainResult:
    """Command line: every process started by torchrun joins the group and trains its part."""
    _parse_args(argv)  # usage errors first, also outside torchrun
    if "RANK" not in os.environ:
        raise SystemExit(
            "d2lgpu.model_parallel_train splits a model over processes: start it with "
            f"torchrun, e.g. `{_COMMAND.replace('=N', '=4')} --dp 2 --tp 2`"
        )
    args, job = _parse_args(argv, int(os.environ["WORLD_SIZE"]))
    assert job is not None
    with process_group(timeout_s=args.timeout) as ctx:
        reason = fsdp2_unavailable_reason(ctx.device.type)
        if reason is not None:
            raise RuntimeError(reason)
        two_d = job.two_d if isinstance(job, ResumableTwoDRun) else job
        if isinstance(job, ResumableTwoDRun) and args.fail_after_epoch is not None:
            # The first attempt only: a restarted job (torchrun counts attempts) runs through.
            if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
                job = replace(
                    job,
                    kill_rank=ctx.world_size - 1,
                    kill_at_step=args.fail_after_epoch * job.save_every,
                )
        if ctx.is_main:
            dp, tp = two_d.mesh_shape
            params = sum(p.numel() for p in two_d.spec.build().parameters())
            policy = precision_policy(ctx.device, two_d.precision)
            print(
                f"{ctx.world_size} ranks, backend {ctx.backend}; mesh (dp, tp) = ({dp}, {tp}); "
                f"{two_d.spec.depth} {two_d.spec.kind} blocks, {params:,} parameters; "
                f"precision {policy.name}",
                flush=True,
            )
            print(f"global batch {two_d.batch_size} ({two_d.batch_size // dp} per dp group) x "
                  f"{two_d.seq_len} positions, {two_d.steps} steps", flush=True)
        result = job.run(ctx)
        if ctx.is_main:
            print(f"done: {two_d.steps} steps, final loss {result.losses[-1]:.4f}", flush=True)
        return result


if __name__ == "__main__":
    from d2lgpu.runtime.distributed import end_process, exit_status_of

    end_process(exit_status_of(main))  # never through interpreter teardown: see end_process
