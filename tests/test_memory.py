"""Memory accounting of a training step, gradient accumulation, activation checkpointing (CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from d2lgpu.memory import (
    OPTIMIZERS,
    LiveTensorBytes,
    accumulated_gradients,
    checkpoint_stages,
    checkpointing_tradeoff,
    format_mib,
    make_optimizer,
    measure_activations,
    measure_training_memory,
    mlp_activation_bytes,
    parameter_bytes,
    resnet18_activation_bytes,
    storage_bytes,
)
from d2lgpu.models import MLPBlock, residual_mlp, resnet18, small_cnn
from d2lgpu.precision import SavedActivations

SHAPE = dict(width=32, hidden=64, depth=3, in_features=784)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return residual_mlp(**SHAPE)


def _batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    assert storage_bytes([a, a.view(2, 5), a[3:]]) == 40
    assert storage_bytes([a, torch.zeros(5, dtype=torch.float64)]) == 80
    assert format_mib(3 * 2**20) == "3.0 MiB"


@pytest.mark.parametrize("batch", [1, 6])
def test_mlp_activations_match_the_formula(batch):
    X, _ = _batch(batch)
    assert measure_activations(_mlp(), X) == mlp_activation_bytes(batch, **SHAPE)


def test_resnet18_activations_match_the_formula():
    # 28 -> 14 -> 7 -> 4 (an odd size halves upwards) and 16 -> 8 -> 4 -> 2.
    torch.manual_seed(0)
    net = resnet18()
    for batch, size in ((1, 28), (2, 16)):
        X = torch.randn(batch, 1, size, size)
        assert measure_activations(net, X) == resnet18_activation_bytes(batch, size)
    # Linear in the batch size, apart from batch norm's per-channel statistics.
    per_example = resnet18_activation_bytes(2) - resnet18_activation_bytes(1)
    assert resnet18_activation_bytes(8) == resnet18_activation_bytes(1) + 7 * per_example


def test_saved_activations_leave_out_the_excluded_parameters():
    layer = nn.Linear(4, 3)
    # The input requires a gradient, so autograd saves the weight too (for the input's gradient).
    X = torch.randn(5, 4, requires_grad=True)
    with SavedActivations() as everything:
        layer(X).sum()
    with SavedActivations(layer.parameters()) as activations:
        layer(X).sum()
    assert activations.nbytes == X.numel() * 4  # the input, saved for the weight's gradient
    assert everything.nbytes == activations.nbytes + layer.weight.numel() * 4


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_training_memory_counted_against_the_formulas(name):
    X, y = _batch(8)
    model = _mlp()
    anatomy = measure_training_memory(
        model, X, y, name, activations_formula=mlp_activation_bytes(8, **SHAPE)
    )
    params = parameter_bytes(model)
    assert anatomy.parameters == anatomy.gradients == params
    assert anatomy.activations == anatomy.activations_formula
    assert anatomy.optimizer_state_formula == OPTIMIZERS[name] * params
    if name == "adam":  # plus one 4-byte step counter per parameter tensor
        extra = 4 * len(list(model.parameters()))
        assert anatomy.optimizer_state == anatomy.optimizer_state_formula + extra
    else:
        assert anatomy.optimizer_state == anatomy.optimizer_state_formula
    # The peak of a step holds at least the parameters, the optimizer state and the gradients.
    assert anatomy.peak >= params + anatomy.optimizer_state + anatomy.gradients
    assert "optimizer state" in anatomy.table()
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_optimizer("lamb", model.parameters())


def test_live_tensor_bytes_follows_allocations_and_frees():
    base = torch.ones(1000)
    with LiveTensorBytes() as live:
        doubled = base * 2  # new: 4000 bytes
        view = doubled.view(10, 100)  # a view: nothing new
        doubled.add_(1)  # in place: nothing new
        tripled = base * 3  # 4000 more
        assert live.live == 8000
        del doubled, view
        assert live.live == 4000
        del tripled
        assert live.live == 0
    assert live.peak == 8000


def test_accumulation_equals_the_full_batch_without_batch_norm():
    X, y = _batch(16)
    model = _mlp()
    full = accumulated_gradients(model, X, y, 1)
    for k in (2, 4, 3):  # 3 does not divide 16: pieces of 6, 6, 4 are weighted by size
        parts = accumulated_gradients(model, X, y, k)
        assert max((a - b).abs().max().item() for a, b in zip(full, parts, strict=True)) < 1e-6
    with pytest.raises(ValueError, match="micro-batches"):
        accumulated_gradients(model, X, y, 17)


def test_accumulation_changes_the_gradient_with_batch_norm():
    X, y = _batch(16)
    torch.manual_seed(0)
    model = small_cnn()
    full = accumulated_gradients(model, X, y, 1)
    parts = accumulated_gradients(model, X, y, 4)
    # Batch statistics over 4 examples instead of 16: a different computation.
    assert max((a - b).abs().max().item() for a, b in zip(full, parts, strict=True)) > 1e-3


def test_checkpointing_keeps_the_gradients_and_holds_less_after_forward():
    X, y = _batch(32)
    stages = ["3", "4"]  # the middle blocks of the residual MLP
    rows, diff = checkpointing_tradeoff(_mlp, X, y, stages, repeats=2)
    plain, checkpointed = rows
    assert diff == 0.0  # the recomputation repeats the same arithmetic
    # every timed step is kept, in order, and the fastest of them is the step's time
    assert all(len(r.step_times) == 2 and r.step_seconds == min(r.step_times) for r in rows)
    # A checkpointed block keeps only its input (width numbers per example), which is
    # kept anyway as the previous layer's output; its GELU's input and its second linear
    # layer's input (hidden numbers each) are dropped and recomputed in backward.
    dropped = len(stages) * 2 * SHAPE["hidden"] * 32 * 4
    assert plain.held_after_forward - checkpointed.held_after_forward == dropped
    model = checkpoint_stages(_mlp(), stages)
    assert isinstance(model[3].inner, MLPBlock)
    with pytest.raises(ValueError, match="no child module 'nine'"):
        checkpoint_stages(_mlp(), ["nine"])


def test_checkpointing_compares_gradients_with_deterministic_cudnn():
    seen = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)  # the same model for both variants
            self.stage = nn.Linear(784, 10)

        def forward(self, X: torch.Tensor) -> torch.Tensor:
            seen.append(torch.backends.cudnn.deterministic)
            return self.stage(X.flatten(1))

    X, y = _batch(4)
    assert torch.backends.cudnn.deterministic is False
    _, diff = checkpointing_tradeoff(Probe, X, y, ["stage"], repeats=1)
    assert diff == 0.0
    # the counted steps, whose gradients are compared, ran deterministically; the timed ones not
    assert seen[:2] == [True, True] and seen[-1] is False
    assert torch.backends.cudnn.deterministic is False


def test_checkpointing_keeps_cudnn_tf32_off_and_restores_it():
    # cudnn.flags() would switch TF32 on; the counted steps compare fp32 gradients exactly.
    seen = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.stage = nn.Linear(784, 10)

        def forward(self, X: torch.Tensor) -> torch.Tensor:
            seen.append(torch.backends.cudnn.conv.fp32_precision)
            return self.stage(X.flatten(1))

    X, y = _batch(4)
    before = torch.backends.cudnn.conv.fp32_precision
    checkpointing_tradeoff(Probe, X, y, ["stage"], repeats=1)
    assert seen[:2] == ["ieee", "ieee"]  # the two counted steps
    assert torch.backends.cudnn.conv.fp32_precision == before  # restored


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: checkpoint_stages(_mlp(), "fc"), r"names must be a list .*\['fc'\]"),
        (lambda: parameter_bytes(None), "model must be a torch.nn.Module"),
        (lambda: measure_activations(_mlp(), None), "X must be a torch.Tensor"),
        (lambda: measure_training_memory(None, *_batch(2)), "model must be"),
        (lambda: measure_training_memory(_mlp(), _batch(2)[0], None), "y must be"),
        (lambda: accumulated_gradients(_mlp(), _batch(4)[0], _batch(3)[1], 2), "4 examples"),
        (lambda: checkpointing_tradeoff(_mlp(), *_batch(2), ["0"]), "make_model must be"),
    ],
)
def test_bad_input_to_memory_names_the_fix(call, words):
    with pytest.raises((TypeError, ValueError), match=words):
        call()
