"""Chapter 4's helpers for ``nn.DataParallel``: k replicas on one device, the learning
rate for k devices, and the verdict of a comparison across seeds.

:class:`ReplicasOnOneDevice` does what ``nn.DataParallel`` does in a training step, with
every replica on one device: it splits the batch along dimension 0 with ``chunk`` (as
DataParallel's scatter does), runs one replica per chunk, one after another, and
concatenates the outputs (the gather). All replicas use the module's parameters, so
backward sums their gradients into them, as DataParallel's broadcast does. Replica 0
uses the module's own buffers and the others copies of them, so batch-norm running
statistics end up computed from chunk 0 alone, which is what DataParallel keeps too (its
replica on ``device_ids[0]`` shares storage with the module; the others are thrown away).
``torch.nn.parallel``'s pieces refuse CPU devices (chapter 3), so on a machine without
two GPUs this is what stands in for k devices.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from d2lgpu.runtime.checks import check_module, check_positive_float, check_positive_int

__all__ = [
    "MAX_LR_FACTOR",
    "ReplicasOnOneDevice",
    "SeedComparison",
    "compare_across_seeds",
    "scaled_learning_rate",
]

#: The most :func:`scaled_learning_rate` multiplies the one-device rate by, whatever k:
#: the linear rule's premise (the gradient changes little over k small steps) fails first
#: on random weights, where a step of k times the rate can overshoot. A rule of thumb,
#: not a law: chapter 4's study trains k = 8 at 1, 4 and 8 times the rate.
MAX_LR_FACTOR = 4


class ReplicasOnOneDevice(nn.Module):
    """``nn.DataParallel``'s forward pass with ``k`` replicas that all run on one device
    (chapter 4).

    In training mode the batch is cut into ``X.chunk(k)`` (fewer chunks when the
    batch has fewer than ``k`` rows, as DataParallel's scatter does), replica ``i``
    computes chunk ``i`` and the outputs are concatenated in order. Parameters are
    shared, so gradients add up as under DataParallel; replicas 1 to k-1 update copies
    of the buffers that are then dropped, so the module's batch-norm statistics come
    from chunk 0. In eval mode the batch is split the same way (DataParallel splits test
    batches too); batch norm reads its running statistics, so each row's output is what
    the module computes for it on the whole batch (up to the last bits of float sums).
    """

    def __init__(self, module: nn.Module, k: int) -> None:
        super().__init__()
        check_module("module", module)
        check_positive_int("k", k)
        self.module = module
        self.k = k

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if not isinstance(X, torch.Tensor) or X.dim() == 0:
            raise ValueError(
                "ReplicasOnOneDevice splits a batch along dimension 0: pass one tensor with "
                f"at least one dimension, got {type(X).__name__}"
            )
        chunks = X.chunk(self.k)
        if not self.training:  # running statistics: nothing to copy, nothing updated
            return torch.cat([self.module(chunk) for chunk in chunks])
        # Copies taken before replica 0 updates the module's buffers in place: every
        # replica starts from the same state, as DataParallel's replicas do.
        buffers = dict(self.module.named_buffers())
        copies = [{name: b.clone() for name, b in buffers.items()} for _ in chunks[1:]]
        params = dict(self.module.named_parameters())
        outputs = [self.module(chunks[0])]
        for chunk, own_buffers in zip(chunks[1:], copies, strict=True):
            outputs.append(functional_call(self.module, {**params, **own_buffers}, (chunk,)))
        return torch.cat(outputs)

    def extra_repr(self) -> str:
        return f"k={self.k}"


def scaled_learning_rate(base_lr: float, k: int, max_factor: int = MAX_LR_FACTOR) -> float:
    """``base_lr * k`` (the linear scaling rule for k devices), but at most
    ``base_lr * max_factor``: the cap is relative to the one-device rate (chapter 4)."""
    check_positive_float("base_lr", base_lr)
    check_positive_int("k", k)
    check_positive_int("max_factor", max_factor)
    return base_lr * min(k, max_factor)


@dataclass(frozen=True)
class SeedComparison:
    """Configuration a minus configuration b, seed by seed: the mean of the differences,
    its margin (twice its standard error, from how the differences vary across seeds),
    and ``verdict``: ``"higher"`` or ``"lower"`` when the mean difference is larger than
    the margin, else ``"tie"``."""

    difference: float
    margin: float
    verdict: str

    @property
    def decided(self) -> bool:
        return self.verdict != "tie"


def compare_across_seeds(a: Sequence[float], b: Sequence[float]) -> SeedComparison:
    """Compare two configurations trained with the same seeds, one score per seed, in order
    (chapter 4).

    The runs of one seed share their initial weights, so the comparison is paired: the
    differences ``a[i] - b[i]`` count when their mean exceeds twice its standard error
    (``stdev / sqrt(n)``). At least two seeds are needed to measure that spread.
    """
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) != len(b):
        raise ValueError(
            f"compare_across_seeds pairs the scores seed by seed: got {len(a)} and {len(b)} "
            "scores; train both configurations with the same seeds"
        )
    if len(a) < 2:
        raise ValueError(
            f"compare_across_seeds needs at least 2 seeds to measure the spread across seeds, "
            f"got {len(a)}: train more seeds"
        )
    if not all(math.isfinite(v) for v in a + b):
        raise ValueError("compare_across_seeds got a score that is NaN or inf")
    differences = [x - y for x, y in zip(a, b, strict=True)]
    difference = statistics.fmean(differences)
    margin = 2 * statistics.stdev(differences) / math.sqrt(len(differences))
    if abs(difference) <= margin:
        verdict = "tie"
    else:
        verdict = "higher" if difference > 0 else "lower"
    return SeedComparison(difference, margin, verdict)
