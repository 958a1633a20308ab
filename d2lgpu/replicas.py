"""Chapter 4's helpers for ``nn.DataParallel``: k replicas on one device, the learning rate
for k devices, and a comparison across seeds.

``torch.nn.parallel``'s pieces refuse CPU devices (chapter 3), so on a machine without two
GPUs :class:`ReplicasOnOneDevice` stands in for k devices: it splits, runs and gathers as
DataParallel does, and like DataParallel keeps the batch-norm statistics of chunk 0 alone
(its replica on ``device_ids[0]`` shares the module's buffers; the others are thrown away).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

__all__ = [
    "MAX_LR_FACTOR", "ReplicasOnOneDevice", "SeedComparison", "compare_across_seeds",
    "scaled_learning_rate",
]

#: The most :func:`scaled_learning_rate` multiplies the one-device rate by: on random weights
#: a step of k times the rate can overshoot. A rule of thumb; chapter 4 trains k = 8 at 1, 4
#: and 8 times the rate.
MAX_LR_FACTOR = 4


class ReplicasOnOneDevice(nn.Module):
    """``nn.DataParallel``'s forward pass with ``k`` replicas on one device (chapter 4).

    The batch is cut into ``X.chunk(k)``, replica ``i`` computes chunk ``i`` and the outputs
    are concatenated. Parameters are shared, so gradients add up as under DataParallel;
    replicas 1 to k-1 update copies of the buffers that are then dropped.
    """

    def __init__(self, module: nn.Module, k: int) -> None:
        super().__init__()
        self.module = module
        self.k = k

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        chunks = X.chunk(self.k)
        if not self.training:  # running statistics: nothing to copy, nothing updated
            return torch.cat([self.module(chunk) for chunk in chunks])
        # Copies taken before replica 0 updates the buffers in place: every replica starts
        # from the same state, as DataParallel's do.
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
    """``base_lr * k``, the linear scaling rule for k devices, capped at ``base_lr *
    max_factor`` (chapter 4)."""
    return base_lr * min(k, max_factor)


@dataclass(frozen=True)
class SeedComparison:
    """Configuration a minus b over paired seeds: the mean difference, its margin (twice its
    standard error) and ``verdict``, "higher" or "lower" beyond the margin, else "tie"."""

    difference: float
    margin: float
    verdict: str

    @property
    def decided(self) -> bool:
        return self.verdict != "tie"


def compare_across_seeds(a: Sequence[float], b: Sequence[float]) -> SeedComparison:
    """Compare two configurations trained with the same seeds, one score per seed, in order
    (chapter 4): the runs of one seed share their initial weights, so the differences pair."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) != len(b):
        raise ValueError(f"compare_across_seeds pairs the scores seed by seed: got {len(a)} and "
                         f"{len(b)} scores; train both configurations with the same seeds")
    if len(a) < 2:
        raise ValueError(f"compare_across_seeds needs at least 2 seeds to measure the spread "
                         f"across seeds, got {len(a)}: train more seeds")
    if not all(math.isfinite(v) for v in a + b):
        raise ValueError("compare_across_seeds got a score that is NaN or inf")
    differences = [x - y for x, y in zip(a, b, strict=True)]
    difference = statistics.fmean(differences)
    margin = 2 * statistics.stdev(differences) / math.sqrt(len(differences))
    if abs(difference) <= margin:
        return SeedComparison(difference, margin, "tie")
    return SeedComparison(difference, margin, "higher" if difference > 0 else "lower")
