"""Train a residual MLP on Fashion-MNIST with FSDP2: the torchrun entry point of chapter 8.

    torchrun --standalone --nproc_per_node=2 -m d2lgpu.fsdp_train --checkpoint-dir ckpt

It writes a distributed checkpoint every epoch; started again with the same directory (by
hand or by ``torchrun --max-restarts``), on any number of ranks, it resumes from the latest.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch

from d2lgpu.precision import PRECISIONS, precision_policy
from d2lgpu.runtime.checks import positive_int_flag, positive_number_flag
from d2lgpu.runtime.config import small_data
from d2lgpu.runtime.distributed import add_job_flags, process_group
from d2lgpu.sharding import (
    CheckpointError,
    FSDPResult,
    FSDPRun,
    MLPShape,
    TrainPlan,
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
    parser.add_argument("--batch-size", type=positive_int_flag, default=240,
                        help="global batch size, split evenly over the ranks (default %(default)s)")
    parser.add_argument("--lr", type=positive_number_flag, default=1e-3,
                        help="Adam's learning rate (default %(default)s)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="resume from the latest checkpoint here, and write one every epoch")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32 (the default), tf32, bf16 or fp16 (the layers compute in it, "
                        "gradients are reduced in fp32), or auto (the device's rule)")
    add_job_flags(parser, crash_point="this epoch's checkpoint")
    args = parser.parse_args(argv)
    if args.fail_after_epoch is not None and args.checkpoint_dir is None:
        parser.error("--fail-after-epoch needs --checkpoint-dir, to resume from after the crash")
    if args.checkpoint_dir is not None:
        try:  # before any work: not after the first epoch
            prepare_checkpoint_root(args.checkpoint_dir)
        except CheckpointError as exc:
            parser.error(f"argument --checkpoint-dir: {exc}")
    return args


def _plan(args: argparse.Namespace) -> TrainPlan:
    from d2lgpu.data import fashion_mnist_tensors

    quick = small_data() if args.quick is None else args.quick
    images, labels = fashion_mnist_tensors(train=True, root=args.data_root, quick=quick)
    test_images, test_labels = fashion_mnist_tensors(train=False, root=args.data_root, quick=quick)
    steps = args.epochs * max(len(labels) // args.batch_size, 1)
    return TrainPlan(MLPShape(), images, labels, args.batch_size, steps, lr=args.lr,
                     shuffle=True, test_images=test_images, test_labels=test_labels)


def main(argv: Sequence[str] | None = None) -> FSDPResult:
    """Command line: every process started by torchrun joins the group and trains its shard."""
    args = _parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit(
            "d2lgpu.fsdp_train shards a model over processes: start it with torchrun, e.g. "
            "`torchrun --standalone --nproc_per_node=2 -m d2lgpu.fsdp_train`"
        )
    plan = _plan(args)
    epoch = plan.steps_per_epoch
    with process_group(timeout_s=args.timeout) as ctx:
        # Crash on the first attempt only: a restarted job (torchrun counts) runs through.
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        fail = args.fail_after_epoch is not None and first_attempt
        run = FSDPRun(plan, precision=args.precision, checkpoint_root=args.checkpoint_dir,
                      resume_from=args.checkpoint_dir,
                      save_every=epoch if args.checkpoint_dir else None, log_every=epoch,
                      fail_rank=ctx.world_size - 1 if fail else None,
                      fail_at_step=(args.fail_after_epoch or 0) * epoch)
        if ctx.is_main:
            print(f"{ctx.world_size} ranks, backend {ctx.backend}; residual MLP with "
                  f"{plan.shape.num_parameters():,} parameters, 1/{ctx.world_size} of them on "
                  f"each rank\nglobal batch {plan.batch_size} ({plan.batch_size // ctx.world_size}"
                  f" per rank), {epoch} steps per epoch, {plan.steps} in all", flush=True)
            if args.precision != "fp32":
                dtype = precision_policy(ctx.device, args.precision).dtype or torch.float32
                print(f"precision {args.precision}: layers compute in {dtype}", flush=True)
        result = train_fsdp(run, ctx)
        if ctx.is_main:
            print(f"done: {plan.steps} steps, final loss {result.losses[-1]:.4f}, "
                  f"test acc {result.test_acc[-1][1]:.3f}", flush=True)
        return result


if __name__ == "__main__":
    from d2lgpu.runtime.distributed import end_process, exit_status_of

    end_process(exit_status_of(main))  # never through interpreter teardown: see end_process
