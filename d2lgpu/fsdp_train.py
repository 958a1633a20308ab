"""Train a residual MLP on Fashion-MNIST with FSDP2: the torchrun entry point of chapter 8.

    torchrun --standalone --nproc_per_node=2 -m d2lgpu.fsdp_train --checkpoint-dir ckpt

It writes a distributed checkpoint every epoch; started again with the same directory (by
hand or by ``torchrun --max-restarts``), on any number of ranks, it resumes from the latest.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from d2lgpu.precision import PRECISIONS, precision_policy
from d2lgpu.runtime.checkpoints import Checkpoints, Resumed
from d2lgpu.runtime.cli import add_job_flags, add_training_flags, check_checkpoint_flags
from d2lgpu.runtime.config import small_data
from d2lgpu.runtime.distributed import process_group
from d2lgpu.sharding import FSDPResult, FSDPRun, MLPShape, TrainPlan

__all__ = ["main"]


@dataclass
class EntryHooks(Checkpoints):
    """:class:`Checkpoints` (``root`` None: none) as the command line trains: it also logs
    the loss and the test accuracy every ``log_every`` steps, and makes rank ``fail_rank``
    raise in step ``fail_at_step``, to show what a failure does."""

    log_every: int | None = None
    test_data: tuple[torch.Tensor, torch.Tensor] | None = None  # float images, labels
    fail_rank: int | None = None
    fail_at_step: int = 0
    test_acc: list[tuple[int, float]] = field(default_factory=list)
    _since: float = field(default=0.0, init=False, repr=False)  # when the last log line ended

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler,
               settings: dict, end: int) -> Resumed:
        resumed = super().resume(model, optimizer, scaler, settings, end)
        if resumed.path is not None and self.log_every and dist.get_rank() == 0:
            print(f"resuming from {resumed.path} (step {resumed.step})", flush=True)
        self._since = time.perf_counter()
        return resumed

    def after_forward(self, step: int) -> None:
        if (self.fail_rank, self.fail_at_step) == (dist.get_rank(), step):
            raise RuntimeError(f"rank {self.fail_rank} failed on purpose in step {step} (the "
                               "others wait in backward)")

    def after_step(self, done: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler, settings: dict, end: int, extra: dict) -> Path | None:
        main = dist.get_rank() == 0
        if self.log_every and done % self.log_every == 0:
            line = f"step {done}/{end}: loss {extra['losses'][-1]:.4f}"
            if self.test_data is not None:
                self.test_acc.append((done, self._test_accuracy(model)))
                line += f", test acc {self.test_acc[-1][1]:.3f}"
            if main:
                print(f"{line}, {time.perf_counter() - self._since:.1f} s", flush=True)
            self._since = time.perf_counter()
        path = super().after_step(done, model, optimizer, scaler, settings, end, extra)
        if path is not None and main and self.log_every:
            print(f"saved checkpoint {path}", flush=True)
        return path

    def _test_accuracy(self, model: nn.Module) -> float:
        """Accuracy on the test data; each rank takes one slice, counts are summed."""
        images, labels = self.test_data
        rank, world = dist.get_rank(), dist.get_world_size()
        device = next(model.parameters()).device
        n = len(labels)
        lo, hi = n * rank // world, n * (rank + 1) // world
        model.eval()
        with torch.no_grad():  # every rank runs one forward, so the all-gathers match up
            predicted = model(images[lo:hi].to(device)).argmax(dim=1)
        model.train()
        total = (predicted.cpu() == labels[lo:hi]).sum().double().to(device)
        dist.all_reduce(total)
        return total.item() / n


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m d2lgpu.fsdp_train",
        description="Train a residual MLP on Fashion-MNIST with FSDP2 (fully_shard).",
    )
    add_training_flags(parser, epochs=3, batch_size=240, lr=1e-3, lr_help="Adam's learning rate",
                       precisions=PRECISIONS, precision="fp32")
    add_job_flags(parser, crash_point="this epoch's checkpoint")
    args = parser.parse_args(argv)
    check_checkpoint_flags(parser, args, args.epochs)  # before any work: not after epoch 1
    return args


def _data(args: argparse.Namespace) -> tuple[TrainPlan, tuple[torch.Tensor, torch.Tensor]]:
    from d2lgpu.data import fashion_mnist_tensors

    quick = small_data() if args.quick is None else args.quick
    images, labels = fashion_mnist_tensors(train=True, root=args.data_root, quick=quick)
    test_images, test_labels = fashion_mnist_tensors(train=False, root=args.data_root, quick=quick)
    steps = args.epochs * max(len(labels) // args.batch_size, 1)
    plan = TrainPlan(MLPShape(), images, labels, args.batch_size, steps, lr=args.lr, shuffle=True)
    return plan, (test_images.float() / 255, test_labels)


def main(argv: Sequence[str] | None = None) -> FSDPResult:
    """Command line: every process started by torchrun joins the group and trains its shard."""
    args = _parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit(
            "d2lgpu.fsdp_train shards a model over processes: start it with torchrun, e.g. "
            "`torchrun --standalone --nproc_per_node=2 -m d2lgpu.fsdp_train`"
        )
    plan, test_data = _data(args)
    epoch = plan.steps_per_epoch
    with process_group(timeout_s=args.timeout) as ctx:
        policy = precision_policy(ctx.device, args.precision)
        # Crash on the first attempt only: a restarted job (torchrun counts) runs through.
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        fail = args.fail_after_epoch is not None and first_attempt
        hooks = EntryHooks(args.checkpoint_dir, epoch, {"precision": args.precision},
                           log_every=epoch, test_data=test_data,
                           fail_rank=ctx.world_size - 1 if fail else None,
                           fail_at_step=(args.fail_after_epoch or 0) * epoch)
        if ctx.is_main:
            print(f"{ctx.world_size} ranks, backend {ctx.backend}; residual MLP with "
                  f"{plan.shape.num_parameters():,} parameters, 1/{ctx.world_size} of them on "
                  f"each rank\nglobal batch {plan.batch_size} ({plan.batch_size // ctx.world_size}"
                  f" per rank), {epoch} steps per epoch, {plan.steps} in all", flush=True)
            if args.precision != "fp32":
                print(f"precision {args.precision}: layers compute in "
                      f"{policy.dtype or torch.float32}", flush=True)
        with policy.matmul_precision():  # TF32 on or off for fp32 matmuls (CUDA only)
            result = FSDPRun(plan, param_dtype=policy.dtype, hooks=hooks).run(ctx)
        if ctx.is_main:
            print(f"done: {plan.steps} steps, final loss {result.losses[-1]:.4f}, "
                  f"test acc {hooks.test_acc[-1][1]:.3f}", flush=True)
        return result


if __name__ == "__main__":
    from d2lgpu.runtime.distributed import end_process, exit_status_of

    end_process(exit_status_of(main))  # never through interpreter teardown: see end_process
