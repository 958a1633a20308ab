"""Chapter 8's exercise checks pass on a right answer and fail on plausible wrong ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.checkpoint import checkpoint

from d2lgpu.exercises import ExerciseWrong
from d2lgpu.exercises import ch08 as check
from d2lgpu.models import MLPBlock

# --- 8.1 training_bytes -------------------------------------------------------------------

BUFFERS = {"sgd": 0, "sgd_momentum": 1, "adam": 2}


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def training_bytes(model, optimizer):
    if optimizer not in BUFFERS:
        raise ValueError(f"optimizer must be one of {tuple(BUFFERS)}, got {optimizer!r}")
    counters = 4 * len(list(model.parameters())) if optimizer == "adam" else 0
    return (2 + BUFFERS[optimizer]) * _param_bytes(model) + counters


def bytes_without_step_counters(model, optimizer):
    if optimizer not in BUFFERS:
        raise ValueError(optimizer)
    return (2 + BUFFERS[optimizer]) * _param_bytes(model)


def bytes_at_four_a_number(model, optimizer):
    if optimizer not in BUFFERS:
        raise ValueError(optimizer)
    numbers = sum(p.numel() for p in model.parameters())
    counters = 4 * len(list(model.parameters())) if optimizer == "adam" else 0
    return (2 + BUFFERS[optimizer]) * 4 * numbers + counters


def bytes_accepting_any_optimizer(model, optimizer):
    counters = 4 * len(list(model.parameters())) if optimizer == "adam" else 0
    return (2 + BUFFERS.get(optimizer, 2)) * _param_bytes(model) + counters


def test_training_bytes_passes_the_right_answer(capsys):
    check.training_bytes(training_bytes)
    assert "Exercise 8.1 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [bytes_without_step_counters, bytes_at_four_a_number,
                                   bytes_accepting_any_optimizer])
def test_training_bytes_fails_a_wrong_answer(wrong):
    with pytest.raises(ExerciseWrong):
        check.training_bytes(wrong)


# --- 8.2 shard_rows -----------------------------------------------------------------------

def shard_rows(rows, world_size):
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    per_rank = -(-rows // world_size)
    return [min(per_rank, max(0, rows - r * per_rank)) for r in range(world_size)]


def rows_spread_evenly(rows, world_size):  # numpy.array_split's rule, not torch.chunk's
    if world_size < 1:
        raise ValueError(world_size)
    return [rows // world_size + (r < rows % world_size) for r in range(world_size)]


def rows_without_the_check(rows, world_size):
    per_rank = -(-rows // max(world_size, 1))
    return [min(per_rank, max(0, rows - r * per_rank)) for r in range(world_size)]


def test_shard_rows_passes_the_right_answer(capsys):
    check.shard_rows(shard_rows)
    assert "Exercise 8.2 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [rows_spread_evenly, rows_without_the_check])
def test_shard_rows_fails_a_wrong_answer(wrong):
    with pytest.raises(ExerciseWrong):
        check.shard_rows(wrong)


# --- 8.3 forward_in_segments --------------------------------------------------------------

def _blocks(net):
    return [i for i, layer in enumerate(net) if isinstance(layer, MLPBlock)]


def forward_in_segments(net, x, segments):
    blocks = _blocks(net)
    if segments < 1 or len(blocks) % segments:
        raise ValueError(f"{len(blocks)} blocks do not split into {segments} equal segments")
    first, length = blocks[0], len(blocks) // segments
    for layer in net[:first]:
        x = layer(x)
    for s in range(segments):
        x = checkpoint(net[first + s * length : first + (s + 1) * length], x,
                       use_reentrant=False)
    for layer in net[blocks[-1] + 1 :]:
        x = layer(x)
    return x


def every_block_on_its_own(net, x, segments):  # ignores `segments`
    if segments < 1 or len(_blocks(net)) % segments:
        raise ValueError(segments)
    for layer in net:
        x = checkpoint(layer, x, use_reentrant=False) if isinstance(layer, MLPBlock) else layer(x)
    return x


def segments_without_checkpointing(net, x, segments):
    if segments < 1 or len(_blocks(net)) % segments:
        raise ValueError(segments)
    return net(x)


def test_forward_in_segments_passes_the_right_answer(capsys):
    check.forward_in_segments(forward_in_segments)
    assert "Exercise 8.3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [every_block_on_its_own, segments_without_checkpointing])
def test_forward_in_segments_fails_a_wrong_answer(wrong):
    with pytest.raises(ExerciseWrong):
        check.forward_in_segments(wrong)


# --- 8.5 save_and_restore -----------------------------------------------------------------

def save_and_restore(model, optimizer, new_model, new_optimizer, directory):
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    model_state, optim_state = get_state_dict(new_model, new_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(new_model, new_optimizer,
                   model_state_dict=state["model"], optim_state_dict=state["optim"])
    return new_model


def model_only(model, optimizer, new_model, new_optimizer, directory):  # forgets the momentum
    dcp.save({"model": model.state_dict()}, checkpoint_id=directory)
    state = {"model": new_model.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    new_model.load_state_dict(state["model"])
    return new_model


def returns_the_old_model(model, optimizer, new_model, new_optimizer, directory):
    save_and_restore(model, optimizer, new_model, new_optimizer, directory)
    return model


def test_save_and_restore_passes_the_right_answer(capsys):
    check.save_and_restore(save_and_restore)
    assert "Exercise 8.5 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [model_only, returns_the_old_model])
def test_save_and_restore_fails_a_wrong_answer(wrong):
    with pytest.raises(ExerciseWrong):
        check.save_and_restore(wrong)


def test_a_wrong_answer_is_wrong_on_its_own_terms():
    # The wrong answers above differ from the right ones where the checks look, not by accident.
    model = nn.Linear(6, 5, bias=False).to(torch.bfloat16)
    assert bytes_at_four_a_number(model, "sgd") != training_bytes(model, "sgd")
    assert rows_spread_evenly(10, 3) == [4, 3, 3] != shard_rows(10, 3)
