"""Chapter 4's helpers for ``nn.DataParallel``: k replicas on one device (``torch.nn.parallel``
refuses CPU devices), the learning rate for k devices, and a comparison across seeds."""

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
#: a step of k times the rate can overshoot (a rule of thumb).
MAX_LR_FACTOR = 4


class ReplicasOnOneDevice(nn.Module):
    """``nn.DataParallel``'s forward pass with ``k`` replicas on one device (chapter 4): chunk
    ``i`` of ``X.chunk(k)`` through replica ``i``, parameters shared; as under DataParallel only
    replica 0's batch-norm statistics are kept."""

    def __init__(self, module: nn.Module, k: int) -> None:
        super().__init__()
        self.module = module
        self.k = k

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        chunks = X.chunk(self.k)
        if not self.training:  # running statistics: nothing to copy, nothing updated
            return torch.cat([self.module(chunk) for chunk in chunks])
        # Copied before replica 0 updates the buffers in place: all start from the same state.
        buffers = dict(self.module.named_buffers())
        copies = [{name: b.clone() for name, b in buffers.items()} for _ in chunks[1:]]
        params = dict(self.module.named_parameters())
        outputs = [self.module(chunks[0])]
        for chunk, own_buffers in zip(chunks[1:], copies, strict=True):
            outputs.append(functional_call(self.module, {**params, **own_buffers}, (chunk,)))
        return torch.cat(outputs)

    def extra_repr(self) -> str:
        return f"k={self.k}"


def scaled_learning_rate(base_lr: float, k: int) -> float:
    """``base_lr * k``, the linear scaling rule for k devices, capped at ``base_lr *
    MAX_LR_FACTOR`` (chapter 4)."""
    return base_lr * min(k, MAX_LR_FACTOR)


@dataclass(frozen=True)
class SeedComparison:
    """Configuration a minus b over paired seeds: the mean difference, its margin (twice its
    standard error) and ``verdict``, "higher" or "lower" beyond the margin, else "tie"."""

    difference: float
    margin: float
    verdict: str


def compare_across_seeds(a: Sequence[float], b: Sequence[float]) -> SeedComparison:
    """Compare two configurations trained with the same seeds, one score per seed, in order
    (chapter 4): the runs of one seed share their initial weights, so the differences pair."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) != len(b):
        raise ValueError(f"got {len(a)} and {len(b)} scores: train both configurations with the "
                         "same seeds")
    if len(a) < 2:
        raise ValueError(f"need at least 2 seeds to measure the spread, got {len(a)}")
    if not all(math.isfinite(v) for v in a + b):
        raise ValueError("compare_across_seeds got a score that is NaN or inf")
    differences = [x - y for x, y in zip(a, b, strict=True)]
    difference = statistics.fmean(differences)
    margin = 2 * statistics.stdev(differences) / math.sqrt(len(differences))
    verdict = "tie" if abs(difference) <= margin else "higher" if difference > 0 else "lower"
    return SeedComparison(difference, margin, verdict)
