"""Checks for chapter 10's exercises (a small GPT)."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from d2lgpu.exercises import attempt, expect, expect_close, expect_tensor_close, passed


def causal_attention(fn: Callable[..., torch.Tensor]) -> None:
    """Exercise 10.1: ``fn(q, k, v)`` is causal attention written out, SDPA's answer."""
    ex = "10.1"
    generator = torch.Generator().manual_seed(0)
    for B, H, T, hd in ((1, 1, 1, 4), (2, 3, 5, 4), (1, 2, 7, 16)):
        q, k, v = (torch.randn(B, H, T, hd, generator=generator) for _ in range(3))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        got = attempt(ex, fn, q, k, v)
        expect_tensor_close(ex, got, want, f"with {T} positions of {hd} numbers per head", 1e-5,
                            "each position attends to itself and the positions before it (not "
                            "after), scores scaled by 1/sqrt(size of one head), softmax over "
                            "the keys")
    passed(ex, "your attention equals F.scaled_dot_product_attention(..., is_causal=True)")


def _reference_count(vocab: int, context: int, layers: int, d: int, tied: bool, bias: bool) -> int:
    per_block = 12 * d * d + (13 * d if bias else 2 * d)  # biases: 9d in Linears, 2d in norms
    head = 0 if tied else vocab * d
    return vocab * d + context * d + layers * per_block + (2 * d if bias else d) + head


def param_count(fn: Callable[..., int]) -> None:
    """Exercise 10.2: ``fn(vocab, context, layers, width, tied, bias)`` counts parameters."""
    ex = "10.2"
    cases = [(65, 256, 6, 384), (65, 64, 4, 128), (50304, 1024, 12, 768), (10, 8, 0, 4)]
    for vocab, context, layers, width in cases:
        for tied in (True, False):
            for bias in (True, False):
                got = attempt(ex, fn, vocab, context, layers, width, tied, bias)
                want = _reference_count(vocab, context, layers, width, tied, bias)
                expect_close(ex, got, want,
                             f"param_count(vocab={vocab}, context={context}, layers={layers}, "
                             f"width={width}, tied={tied}, bias={bias})", rel_tol=0, abs_tol=0)
    passed(ex, "GPT-2 small (vocab 50,304, tied, with biases) has "
               f"{_reference_count(50304, 1024, 12, 768, True, True):,} parameters")


class _ToyLanguageModel(nn.Module):
    """Scores the next token from every token in its window, and refuses a longer window."""

    def __init__(self, vocab: int = 11, context: int = 4) -> None:
        super().__init__()
        self.cfg = SimpleNamespace(context=context, vocab=vocab)
        self.table = nn.Parameter(torch.randn(vocab, vocab,
                                              generator=torch.Generator().manual_seed(0)))

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        assert T <= self.cfg.context, f"{T} tokens, but the context is {self.cfg.context}"
        # position t's logits mix all tokens up to t, weighted by how recent they are
        weights = torch.tril(torch.ones(T, T)) * torch.arange(1, T + 1).float()
        return weights @ self.table[idx], None


def _greedy_reference(model, idx, new_tokens):
    for _ in range(new_tokens):
        logits, _ = model(idx[:, -model.cfg.context:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def greedy_generate(fn: Callable[[nn.Module, torch.Tensor, int], torch.Tensor]) -> None:
    """Exercise 10.3: ``fn(model, idx, new_tokens)`` appends the most likely token each step."""
    ex = "10.3"
    model = _ToyLanguageModel()
    cases = [(torch.tensor([[1]]), 6), (torch.tensor([[3, 1, 4, 1, 5, 9]]), 5),
             (torch.tensor([[2, 7], [1, 8]]), 7), (torch.tensor([[5, 5, 5]]), 0)]
    for idx, n in cases:
        with torch.no_grad():
            got = attempt(ex, fn, model, idx.clone(), n)
        want = _greedy_reference(model, idx, n)
        expect(ex, isinstance(got, torch.Tensor) and got.shape == want.shape,
               f"from a prompt of shape {tuple(idx.shape)} and {n} new tokens, expected shape "
               f"{tuple(want.shape)}, got {getattr(got, 'shape', type(got).__name__)}")
        expect(ex, torch.equal(got, want),
               f"from the prompt {idx.tolist()}, {n} new tokens gave {got.tolist()}, expected "
               f"{want.tolist()}: take the last position's logits, the most likely token, and "
               "feed the model at most its context's worth of the latest tokens")
    passed(ex, f"greedy decoding crops the window to the last {model.cfg.context} tokens and "
               "re-reads it every step: no cache, so the cost per token grows with the window")


def math_backend_crossover(fn: Callable[[int, int], float]) -> None:
    """Exercise 10.5: ``fn(width, heads)``: the context where the T x T weights equal a block."""
    ex = "10.5"
    for width, heads in ((384, 6), (128, 4), (768, 12), (64, 2)):
        got = attempt(ex, fn, width, heads)
        want = (16 * width + heads + 4) / heads
        expect_close(ex, got, want, f"the crossover context for width {width}, {heads} heads",
                     rel_tol=1e-9)
    passed(ex, "for the full model (width 384, 6 heads) the math backend's weights outweigh "
               f"the rest of a block's activations from T = {math.ceil((16 * 384 + 10) / 6)}")
