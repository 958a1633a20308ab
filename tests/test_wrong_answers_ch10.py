"""Chapter 10's checks fail on wrong answers that look right."""

import math

import pytest
import torch

from d2lgpu.exercises import ExerciseCheckFailed
from d2lgpu.exercises import ch10 as check


def _attention(mask_diagonal: int = 1, scale_by: str = "head", masked: bool = True):
    def attention(q, k, v):
        T, hd = q.shape[-2], q.shape[-1]
        size = hd if scale_by == "head" else hd * q.shape[1]  # the model's width instead
        scores = q @ k.transpose(-2, -1) / math.sqrt(size)
        if masked:
            future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=mask_diagonal)
            scores = scores.masked_fill(future, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v
    return attention


@pytest.mark.parametrize("wrong", [
    _attention(masked=False),  # no mask: every position sees the future
    _attention(mask_diagonal=0),  # the diagonal hidden too: the first row is all -inf
    _attention(scale_by="width"),  # scaled by the model's width, not one head's
    lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v,  # no scaling, no mask
])
def test_attention_checks_fail_on_wrong_answers(wrong):
    with pytest.raises(ExerciseCheckFailed):
        check.causal_attention(wrong)


def test_attention_check_passes_the_right_answer(capsys):
    check.causal_attention(_attention())
    assert "Exercise 10.1 passed" in capsys.readouterr().out


def _count(bias_per_block=13, final=2, untied_adds=True, bias_aware=True):
    def count(vocab, context, layers, width, tied, bias):
        d = width
        per_block = 12 * d * d + ((bias_per_block if bias or not bias_aware else 2) * d)
        head = 0 if tied or not untied_adds else vocab * d
        return vocab * d + context * d + layers * per_block + (final if bias else 1) * d + head
    return count


@pytest.mark.parametrize("wrong", [
    _count(untied_adds=False),  # an untied output layer counted as if tied
    _count(final=0),  # the final LayerNorm forgotten
    _count(bias_per_block=11),  # LayerNorm biases forgotten
    _count(bias_aware=False),  # bias=False ignored
    lambda vocab, context, layers, width, tied, bias: (  # the tied matrix counted twice
        2 * vocab * width + context * width + layers * (12 * width**2 + 13 * width) + 2 * width),
])
def test_param_count_check_fails_on_wrong_answers(wrong):
    with pytest.raises(ExerciseCheckFailed):
        check.param_count(wrong)


def test_param_count_check_passes_the_right_answer(capsys):
    check.param_count(_count())
    assert "Exercise 10.2 passed" in capsys.readouterr().out


def _greedy(crop=True, position=-1, sample=False):
    def greedy(model, idx, new_tokens):
        for _ in range(new_tokens):
            window = idx[:, -model.cfg.context:] if crop else idx
            logits, _ = model(window)
            scores = logits[:, position]
            if sample:
                token = torch.multinomial(torch.softmax(scores, -1), 1)
            else:
                token = scores.argmax(-1, keepdim=True)
            idx = torch.cat([idx, token], dim=1)
        return idx
    return greedy


@pytest.mark.parametrize("wrong", [
    _greedy(crop=False),  # the window grows past the context: the model refuses it
    _greedy(position=0),  # the first position's prediction, not the last
    _greedy(sample=True),  # sampling, not the most likely token
    lambda model, idx, new_tokens: idx,  # nothing appended
])
def test_greedy_check_fails_on_wrong_answers(wrong):
    torch.manual_seed(0)
    with pytest.raises((ExerciseCheckFailed, AssertionError)):
        check.greedy_generate(wrong)


def test_greedy_check_passes_the_right_answer(capsys):
    check.greedy_generate(_greedy())
    assert "Exercise 10.3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [
    lambda width, heads: 16 * width / heads,  # the + H + 4 left out
    lambda width, heads: (16 * width + heads + 4),  # not divided by the heads
    lambda width, heads: math.sqrt(16 * width + heads + 4),  # T^2 against T confused
])
def test_crossover_check_fails_on_wrong_answers(wrong):
    with pytest.raises(ExerciseCheckFailed):
        check.math_backend_crossover(wrong)
