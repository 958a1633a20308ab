"""Chapter 9's exercise checks refuse plausible wrong answers and pass the solutions."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from d2lgpu.exercises import ExerciseWrong
from d2lgpu.exercises import ch09 as check

# --- 9.1: the idle fraction with v stages per rank -----------------------------------------


def bubble_solution(p, m, v):
    return (p - 1) / (v * m + p - 1)


@pytest.mark.parametrize("wrong", [
    lambda p, m, v: (p - 1) / (m + p - 1),          # forgets the stages per rank
    lambda p, m, v: (p - 1) / (v * (m + p - 1)),    # divides the whole step by v
    lambda p, m, v: (p - 1) / (v * m),              # leaves the bubble out of the step
])
def test_interleaved_bubble_refuses_wrong_formulas(wrong):
    with pytest.raises(ExerciseWrong):
        check.interleaved_bubble(wrong)


def test_interleaved_bubble_passes_the_solution(capsys):
    check.interleaved_bubble(bubble_solution)
    assert "Exercise 9.1 passed" in capsys.readouterr().out


# --- 9.2: stages of unequal length -----------------------------------------------------------


def _sizes(depth, p, longer_first=True):
    sizes = [depth // p + (1 if s < depth % p else 0) for s in range(p)]
    return sizes if longer_first else sizes[::-1]


def _slices(model, sizes):
    stages, start = [], 0
    for size in sizes:
        stages.append(model[start:start + size])
        start += size
    return stages


def split_solution(model, p):
    if not 1 <= p <= len(model):
        raise ValueError(f"{len(model)} blocks cannot fill {p} stages")
    return _slices(model, _sizes(len(model), p))


def split_shorter_first(model, p):
    if not 1 <= p <= len(model):
        raise ValueError("empty stage")
    return _slices(model, _sizes(len(model), p, longer_first=False))


def split_copies(model, p):
    return [copy.deepcopy(stage) for stage in split_solution(model, p)]


def split_without_value_error(model, p):
    return _slices(model, _sizes(len(model), p))  # 2 blocks on 3 ranks: an empty stage


@pytest.mark.parametrize("wrong", [split_shorter_first, split_copies,
                                   split_without_value_error])
def test_split_into_stages_refuses_wrong_splits(wrong):
    with pytest.raises(ExerciseWrong):
        check.split_into_stages(wrong)


def test_split_into_stages_passes_the_solution(capsys):
    check.split_into_stages(split_solution)
    assert "Exercise 9.2 passed" in capsys.readouterr().out


# --- 9.3: tensor parallelism without DTensor ---------------------------------------------


def _refuse_uneven(block, n):
    if n < 1 or block.fc1.out_features % n:
        raise ValueError(f"{block.fc1.out_features} hidden units over {n} ranks")


def tp_solution(block, x, n):
    _refuse_uneven(block, n)
    partial_outputs = []
    for units in torch.arange(block.fc1.out_features).chunk(n):
        h = F.gelu(x @ block.fc1.weight[units].T + block.fc1.bias[units])
        partial_outputs.append(h @ block.fc2.weight[:, units].T)
    return x + torch.stack(partial_outputs).sum(0) + block.fc2.bias


def tp_whole_block(block, x, n):
    _refuse_uneven(block, n)
    return block(x)


def tp_whole_fc1_then_split(block, x, n):
    _refuse_uneven(block, n)
    h = F.gelu(block.fc1(x))  # every hidden unit on every "rank"
    return x + sum(h[..., u] @ block.fc2.weight[:, u].T
                   for u in torch.arange(h.shape[-1]).chunk(n)) + block.fc2.bias


def tp_einsum_over_all_ranks(block, x, n):
    _refuse_uneven(block, n)
    w1 = block.fc1.weight.view(n, -1, x.shape[-1])
    h = F.gelu(torch.einsum("bsd,nhd->nbsh", x, w1) + block.fc1.bias.view(n, 1, 1, -1))
    w2 = block.fc2.weight.view(x.shape[-1], n, -1)
    return x + torch.einsum("nbsh,dnh->bsd", h, w2) + block.fc2.bias


def tp_fc1_split_by_input_features(block, x, n):
    _refuse_uneven(block, n)
    out = 0
    for cols in torch.arange(x.shape[-1]).chunk(n):  # partial sums before gelu: wrong
        h = F.gelu(x[..., cols] @ block.fc1.weight[:, cols].T + block.fc1.bias / n)
        out = out + h @ block.fc2.weight.T
    return x + out + block.fc2.bias


def tp_bias_on_every_rank(block, x, n):
    _refuse_uneven(block, n)
    out = 0
    for units in torch.arange(block.fc1.out_features).chunk(n):
        h = F.gelu(x @ block.fc1.weight[units].T + block.fc1.bias[units])
        out = out + h @ block.fc2.weight[:, units].T + block.fc2.bias
    return x + out


def tp_no_value_error(block, x, n):
    partial_outputs = []
    for units in torch.arange(block.fc1.out_features).chunk(n):  # 3 ranks: uneven shares
        h = F.gelu(x @ block.fc1.weight[units].T + block.fc1.bias[units])
        partial_outputs.append(h @ block.fc2.weight[:, units].T)
    return x + torch.stack(partial_outputs).sum(0) + block.fc2.bias


@pytest.mark.parametrize("wrong", [tp_whole_block, tp_whole_fc1_then_split,
                                   tp_einsum_over_all_ranks, tp_fc1_split_by_input_features,
                                   tp_bias_on_every_rank, tp_no_value_error])
def test_tensor_parallel_mlp_refuses_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.tensor_parallel_mlp(wrong)


def test_tensor_parallel_mlp_names_the_whole_block():
    with pytest.raises(ExerciseWrong, match="all 64 hidden units at once"):
        check.tensor_parallel_mlp(tp_whole_block)


def test_tensor_parallel_mlp_passes_the_solution(capsys):
    check.tensor_parallel_mlp(tp_solution)
    assert "Exercise 9.3 passed" in capsys.readouterr().out


# --- 9.4: activations in flight -----------------------------------------------------------


def held_solution(schedule, p, m, stage):
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - stage)
    raise ValueError(f"unknown schedule {schedule!r}")


@pytest.mark.parametrize("wrong", [
    lambda s, p, m, stage: held_solution(s, p, m, stage) if s == "gpipe" else p - stage,
    lambda s, p, m, stage: held_solution(s, p, m, stage) if s == "gpipe" else min(m, stage + 1),
    lambda s, p, m, stage: m if s == "gpipe" else min(m, p - stage),  # no ValueError
])
def test_activations_held_refuses_wrong_rules(wrong):
    with pytest.raises(ExerciseWrong):
        check.activations_held(wrong)


def test_activations_held_passes_the_solution(capsys):
    check.activations_held(held_solution)
    assert "Exercise 9.4 passed" in capsys.readouterr().out

