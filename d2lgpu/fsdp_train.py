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
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from d2lgpu.precision import PRECISIONS, precision_policy
from d2lgpu.runtime.checkpoints import (
    CheckpointError,
    check_resumable,
    latest_checkpoint,
    load_checkpoint,
    prepare_checkpoint_root,
    read_checkpoint_extra,
    save_checkpoint,
)
from d2lgpu.runtime.checks import positive_int_flag, positive_number_flag
from d2lgpu.runtime.config import small_data
from d2lgpu.runtime.distributed import DistContext, add_job_flags, process_group
from d2lgpu.sharding import FSDPResult, FSDPRun, MLPShape, TrainPlan

__all__ = ["main"]


@dataclass
class ResumableFSDPRun:
    """An :class:`FSDPRun` as the command line trains it: it resumes from ``resume_from`` (a
    checkpoint, or a root whose latest one to take; none yet: step 0), logs the loss and the
    test accuracy every ``log_every`` steps, writes a checkpoint with its settings to
    ``checkpoint_root`` every ``save_every`` steps, and makes rank ``fail_rank`` raise in step
    ``fail_at_step``, to show what a failure does."""

    fsdp: FSDPRun
    checkpoint_root: str | None = None
    save_every: int | None = None
    resume_from: str | None = None
    log_every: int | None = None
    test_data: tuple[torch.Tensor, torch.Tensor] | None = None  # float images, labels
    fail_rank: int | None = None
    fail_at_step: int = 0
    test_acc: list[tuple[int, float]] = field(default_factory=list)
    _since: float = field(default=0.0, init=False, repr=False)  # when the last log line ended

    def run(self, ctx: DistContext) -> FSDPResult:
        return self.fsdp.run(ctx, self)

    def _config(self, ctx: DistContext) -> dict[str, Any]:
        """The settings a checkpoint records and a resumed run must repeat, by their words."""
        plan = self.fsdp.plan
        dtype = precision_policy(ctx.device, self.fsdp.precision).dtype or torch.float32
        return {"model shape (width, hidden, depth, in, classes)": list(astuple(plan.shape)),
                "global batch size": plan.batch_size, "learning rate": plan.lr,
                "optimizer": plan.optimizer, "seed": plan.seed, "shuffle": plan.shuffle,
                "training examples": len(plan.labels), "precision": self.fsdp.precision,
                "compute dtype": str(dtype).removeprefix("torch.")}

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer,
               ctx: DistContext) -> tuple[int, list[float]]:
        """The step and loss history to continue from: those of ``resume_from``, if any."""
        self._since = time.perf_counter()
        if self.resume_from is None:
            return 0, []
        path = Path(self.resume_from)
        if not path.name.startswith("step-") and not (path / ".metadata").exists():
            path = latest_checkpoint(path)  # a root
            if path is None:
                return 0, []
        extra = read_checkpoint_extra(path)
        check_resumable(extra, self._config(ctx), path)
        if extra["step"] >= self.fsdp.plan.steps:
            raise CheckpointError(
                f"checkpoint {path} is at step {extra['step']} and this run ends at step "
                f"{self.fsdp.plan.steps}: nothing left to train. Ask for more steps (more "
                "epochs: they count from the start, not from the checkpoint); or, to start "
                f"fresh, delete {path.parent} or pass another checkpoint directory")
        load_checkpoint(path, model, optimizer)
        if ctx.is_main and self.log_every:
            print(f"resuming from {path} (step {extra['step']})", flush=True)
        return extra["step"], list(extra.get("losses", []))

    def after_forward(self, step: int, ctx: DistContext) -> None:
        if (self.fail_rank, self.fail_at_step) == (ctx.rank, step):
            raise RuntimeError(f"rank {ctx.rank} failed on purpose in step {step} (the others "
                               "wait in backward)")

    def after_step(self, done: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   losses: list[float], ctx: DistContext) -> None:
        if self.log_every and done % self.log_every == 0:
            line = f"step {done}/{self.fsdp.plan.steps}: loss {losses[-1]:.4f}"
            if self.test_data is not None:
                self.test_acc.append((done, self._test_accuracy(model, ctx)))
                line += f", test acc {self.test_acc[-1][1]:.3f}"
            if ctx.is_main:
                print(f"{line}, {time.perf_counter() - self._since:.1f} s", flush=True)
            self._since = time.perf_counter()
        if self.save_every and done % self.save_every == 0:
            extra = {"losses": losses, "world_size": ctx.world_size, "config": self._config(ctx)}
            path = save_checkpoint(self.checkpoint_root, done, model, optimizer, extra)
            if ctx.is_main and self.log_every:
                print(f"saved checkpoint {path}", flush=True)

    def _test_accuracy(self, model: nn.Module, ctx: DistContext) -> float:
        """Accuracy on the test data; each rank takes one slice, counts are summed."""
        images, labels = self.test_data
        n = len(labels)
        lo, hi = n * ctx.rank // ctx.world_size, n * (ctx.rank + 1) // ctx.world_size
        model.eval()
        with torch.no_grad():  # every rank runs one forward, so the all-gathers match up
            predicted = model(images[lo:hi].to(ctx.device)).argmax(dim=1)
        model.train()
        total = (predicted.cpu() == labels[lo:hi]).sum().double().to(ctx.device)
        dist.all_reduce(total)
        return total.item() / n


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
        # Crash on the first attempt only: a restarted job (torchrun counts) runs through.
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        fail = args.fail_after_epoch is not None and first_attempt
        run = ResumableFSDPRun(FSDPRun(plan, precision=args.precision),
                               checkpoint_root=args.checkpoint_dir,
                               save_every=epoch if args.checkpoint_dir else None,
                               resume_from=args.checkpoint_dir, log_every=epoch,
                               test_data=test_data, fail_rank=ctx.world_size - 1 if fail else None,
                               fail_at_step=(args.fail_after_epoch or 0) * epoch)
        if ctx.is_main:
            print(f"{ctx.world_size} ranks, backend {ctx.backend}; residual MLP with "
                  f"{plan.shape.num_parameters():,} parameters, 1/{ctx.world_size} of them on "
                  f"each rank\nglobal batch {plan.batch_size} ({plan.batch_size // ctx.world_size}"
                  f" per rank), {epoch} steps per epoch, {plan.steps} in all", flush=True)
            if args.precision != "fp32":
                dtype = precision_policy(ctx.device, args.precision).dtype or torch.float32
                print(f"precision {args.precision}: layers compute in {dtype}", flush=True)
        result = run.run(ctx)
        if ctx.is_main:
            print(f"done: {plan.steps} steps, final loss {result.losses[-1]:.4f}, "
                  f"test acc {run.test_acc[-1][1]:.3f}", flush=True)
        return result


if __name__ == "__main__":
    from d2lgpu.runtime.distributed import end_process, exit_status_of

    end_process(exit_status_of(main))  # never through interpreter teardown: see end_process
