"""The command lines of the torchrun entry points: one parser's flags, shared.

* :func:`add_training_flags`: ``--epochs``, ``--batch-size``, ``--lr``, ``--seed``,
  ``--precision`` and ``--checkpoint-dir``, with each trainer's own defaults;
* :func:`add_job_flags`: ``--data-root``, ``--quick``/``--full``, ``--timeout`` and
  ``--fail-after-epoch``;
* :func:`check_checkpoint_flags`: the usage errors of the checkpoint flags, before any work.

A value the flags refuse is a usage error (exit status 2) that names the flag and the rule.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from d2lgpu.runtime.checkpoints import CheckpointError, prepare_checkpoint_root
from d2lgpu.runtime.checks import check_positive_float, check_positive_int, check_seed
from d2lgpu.runtime.distributed import DEFAULT_TIMEOUT_S

__all__ = [
    "add_job_flags", "add_training_flags", "check_checkpoint_flags", "flag_type",
    "positive_int_flag", "positive_number_flag", "seed_flag",
]

def flag_type(check: Callable[[str, object], object], parse: type) -> Callable[[str], object]:
    """An argparse ``type=`` that parses with ``parse`` and checks with ``check`` (a usage
    error, exit 2, when either refuses)."""

    def convert(text: str) -> object:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'an int' if parse is int else 'a number'}, got {text!r}"
            ) from None
        try:
            return check("value", value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None

    convert.__name__ = check.__name__.removeprefix("check_")
    return convert


positive_int_flag = flag_type(check_positive_int, int)
seed_flag = flag_type(lambda _name, value: check_seed(value), int)
positive_number_flag = flag_type(check_positive_float, float)


def add_training_flags(
    parser: argparse.ArgumentParser, *, batch_size: int, lr: float, precisions: Sequence[str],
    precision: str, epochs: int | None = None, seed: int | None = None, lr_help: str = "",
    checkpoint_help: str = "resume from the latest checkpoint here, and write one every epoch",
) -> None:
    """A trainer's flags with its defaults; ``--epochs`` and ``--seed`` only when given one.
    ``precisions`` is d2lgpu.precision.PRECISIONS (the runtime imports no lesson module)."""
    if epochs is not None:
        parser.add_argument("--epochs", type=positive_int_flag, default=epochs,
                            help="total epochs, including those a checkpoint already holds")
    parser.add_argument("--batch-size", type=positive_int_flag, default=batch_size,
                        help="global batch size, split evenly over the data-parallel replicas "
                        "(default %(default)s)")
    parser.add_argument("--lr", type=positive_number_flag, default=lr,
                        help=f"{lr_help} (default %(default)s)".lstrip())
    if seed is not None:
        parser.add_argument("--seed", type=seed_flag, default=seed)
    parser.add_argument("--precision", choices=precisions, default=precision,
                        help="fp32 (strict), tf32, bf16, fp16 (with loss scaling), or auto: the "
                        "device's fast format (d2lgpu.precision_policy); default %(default)s")
    parser.add_argument("--checkpoint-dir", default=None, help=checkpoint_help)


def add_job_flags(
    parser: argparse.ArgumentParser, *, crash_point: str | None = None, data: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """The flags of a torchrun job: ``--data-root`` and ``--quick``/``--full`` (with
    ``data``), ``--timeout``, and ``--fail-after-epoch`` (given a ``crash_point``)."""
    if data:
        parser.add_argument("--data-root", default=None, help="directory holding FashionMNIST/raw")
        mode = parser.add_mutually_exclusive_group()
        mode.add_argument("--quick", dest="quick", action="store_true", default=None,
                          help="small balanced data subset (default: follow D2LGPU_QUICK)")
        mode.add_argument("--full", dest="quick", action="store_false", help="the whole data set")
    parser.add_argument("--timeout", type=positive_number_flag, default=timeout_s,
                        help="seconds a collective waits for the other ranks (default %(default)s)")
    if crash_point is not None:
        parser.add_argument("--fail-after-epoch", type=positive_int_flag, default=None,
                            help=f"make the last rank crash once after {crash_point} "
                            "(to try --max-restarts)")


def check_checkpoint_flags(parser: argparse.ArgumentParser, args: argparse.Namespace,
                           epochs: int | None = None) -> None:
    """Usage errors, before any work: ``--fail-after-epoch`` without ``--checkpoint-dir`` to
    resume from, or not before the run's last epoch (of ``epochs``: a restart would find
    nothing left to train, or the crash would never come), or a checkpoint directory that
    cannot be written (created here)."""
    fail = getattr(args, "fail_after_epoch", None)
    if fail is not None and args.checkpoint_dir is None:
        parser.error("--fail-after-epoch needs --checkpoint-dir, to resume from after the crash")
    if fail is not None and epochs is not None and fail >= epochs:
        parser.error(f"--fail-after-epoch {fail} is not before the run's last epoch ({epochs}): "
                     "the crash would come after the last checkpoint, where a restarted job has "
                     "nothing left to train, or never. Pass a smaller number, or make the run "
                     "longer")
    if args.checkpoint_dir is not None:
        try:
            prepare_checkpoint_root(args.checkpoint_dir)
        except CheckpointError as exc:
            parser.error(f"argument --checkpoint-dir: {exc}")
