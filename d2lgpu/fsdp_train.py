"""Train a residual MLP on Fashion-MNIST with FSDP2: the torchrun entry point of chapter 8.

One machine, two processes (GPUs with NCCL when there are two, CPUs with gloo
otherwise)::

    torchrun --standalone --nproc_per_node=2 -m d2lgpu.fsdp_train --epochs 3 \\
        --checkpoint-dir checkpoints

Two machines: the same line on both, with ``--node-rank`` 0 and 1 and the
address of machine 0 in ``--rdzv-endpoint``; the checkpoint directory must be
on a file system both machines see::

    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=8 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400 \\
        -m d2lgpu.fsdp_train --checkpoint-dir /shared/checkpoints

Every rank builds the same model (same seed), shards it with ``fully_shard``
per block and on the root (:func:`d2lgpu.sharding.shard_model`), and trains on
its slice of every global batch (:func:`d2lgpu.sharding.train_fsdp`). After
every epoch all ranks write a distributed checkpoint together (each its own
shards; a temporary directory renamed when complete). A job started again with
the same ``--checkpoint-dir``, by hand or by ``torchrun --max-restarts``,
continues from the latest complete checkpoint, with any number of ranks.
Every checkpoint records its settings and the checksums of its files: resuming
with another learning rate, batch size, model or ``--precision``, or from a
damaged checkpoint, is refused with the reason. A loss that stops being finite,
or rises to ten times the first step's, stops the job (training diverged).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch

from d2lgpu.precision import PRECISIONS
from d2lgpu.runtime.checks import positive_int_flag, positive_number_flag
from d2lgpu.runtime.config import small_data
from d2lgpu.runtime.distributed import add_job_flags, process_group
from d2lgpu.sharding import (
    CheckpointError,
    FSDPResult,
    FSDPRun,
    MLPShape,
    TrainPlan,
    fsdp_param_dtype,
    prepare_checkpoint_root,
    train_fsdp,
)

__all__ = ["main"]


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m d2lgpu.fsdp_train",
        description="Train a residual MLP on Fashion-MNIST with FSDP2 (fully_shard).",
    )
    parser.add_argument("--epochs", type=positive_int_flag, default=3)
    parser.add_argument(
        "--batch-size",
        type=positive_int_flag,
        default=240,
        help="global batch size, split evenly over the ranks (default %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=positive_number_flag,
        default=1e-3,
        help="Adam's learning rate (default %(default)s)",
    )
    parser.add_argument("--width", type=positive_int_flag, default=MLPShape.width)
    parser.add_argument("--hidden", type=positive_int_flag, default=MLPShape.hidden)
    parser.add_argument(
        "--depth", type=positive_int_flag, default=MLPShape.depth, help="residual blocks"
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="resume from the latest checkpoint here, and write one after every epoch",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32 (strict, the default); tf32 (TF32 matmuls on CUDA); bf16 or fp16: the layers "
        "compute in it and reduce gradients in fp32 (MixedPrecisionPolicy; fp16 with loss "
        "scaling); auto: the device's rule (bf16 from sm80, fp16 before; on a CPU bf16 where "
        "it runs natively, else fp32)",
    )
    parser.add_argument(
        "--keep-gathered",
        action="store_true",
        help="reshard_after_forward=False: more memory, one all-gather less per block",
    )
    add_job_flags(parser, crash_point="this epoch's checkpoint")
    args = parser.parse_args(argv)
    if args.fail_after_epoch is not None and args.checkpoint_dir is None:
        parser.error("--fail-after-epoch needs --checkpoint-dir, to resume from after the crash")
    if args.checkpoint_dir is not None:
        try:  # before any work: not after the first epoch
            prepare_checkpoint_root(args.checkpoint_dir)
        except (CheckpointError, TypeError) as exc:  # TypeError: an empty path
            parser.error(f"argument --checkpoint-dir: {exc}")
    return args


def _plan(args: argparse.Namespace) -> TrainPlan:
    from d2lgpu.data import fashion_mnist_tensors

    quick = small_data() if args.quick is None else args.quick
    images, labels = fashion_mnist_tensors(train=True, root=args.data_root, quick=quick)
    test_images, test_labels = fashion_mnist_tensors(train=False, root=args.data_root, quick=quick)
    steps_per_epoch = max(len(labels) // args.batch_size, 1)
    return TrainPlan(
        shape=MLPShape(args.width, args.hidden, args.depth),
        images=images,
        labels=labels,
        batch_size=args.batch_size,
        steps=args.epochs * steps_per_epoch,
        lr=args.lr,
        shuffle=True,
        test_images=test_images,
        test_labels=test_labels,
    )


def main(argv: Sequence[str] | None = None) -> FSDPResult:
    """Command line: every process started by torchrun joins the group and trains its shard."""
    args = _parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit(
            "d2lgpu.fsdp_train shards a model over processes: start it with torchrun, e.g. "
            "`torchrun --standalone --nproc_per_node=2 -m d2lgpu.fsdp_train`"
        )
    plan = _plan(args)
    with process_group(timeout_s=args.timeout) as ctx:
        fail_rank = None
        if args.fail_after_epoch is not None:
            # The first attempt only: a restarted job (torchrun counts attempts) runs through.
            if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
                fail_rank = ctx.world_size - 1
        run = FSDPRun(
            plan,
            reshard_after_forward=not args.keep_gathered,
            precision=args.precision,
            checkpoint_root=args.checkpoint_dir,
            save_every=plan.steps_per_epoch if args.checkpoint_dir else None,
            resume_from=args.checkpoint_dir,
            log_every=plan.steps_per_epoch,
            fail_rank=fail_rank,
            fail_at_step=(args.fail_after_epoch or 0) * plan.steps_per_epoch,
        )
        if ctx.is_main:
            params = plan.shape.num_parameters()
            print(
                f"{ctx.world_size} ranks, backend {ctx.backend}; residual MLP with {params:,} "
                f"parameters, 1/{ctx.world_size} of them on each rank",
                flush=True,
            )
            print(
                f"global batch {plan.batch_size} ({plan.batch_size // ctx.world_size} per rank), "
                f"{plan.steps_per_epoch} steps per epoch, {plan.steps} in all",
                flush=True,
            )
            if args.precision != "fp32":
                dtype = fsdp_param_dtype(ctx.device, args.precision)
                print(
                    f"precision {args.precision}: layers compute in {dtype or torch.float32}",
                    flush=True,
                )
        result = train_fsdp(run, ctx)
        if ctx.is_main:
            print(
                f"done: {plan.steps} steps, final loss {result.losses[-1]:.4f}, "
                f"test acc {result.test_acc[-1][1]:.3f}",
                flush=True,
            )
        return result


if __name__ == "__main__":
    from d2lgpu.runtime.distributed import end_process, exit_status_of

    end_process(exit_status_of(main))  # never through interpreter teardown: see end_process
