"""Checks for chapter 8's exercises (memory, checkpointing, FSDP2's shards, DCP)."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from d2lgpu.exercises import ExerciseWrong, attempt, expect, expect_value_error, passed
from d2lgpu.memory import OPTIMIZERS, make_optimizer, storage_bytes
from d2lgpu.models import residual_mlp
from d2lgpu.precision import SavedActivations
from d2lgpu.sharding import MLPShape


def _counted_after_one_step(model: nn.Module, optimizer: str, in_features: int) -> int:
    """Parameters + gradients + optimizer state, counted after a real training step."""
    dtype = next(model.parameters()).dtype
    opt = make_optimizer(optimizer, model.parameters())
    X = torch.randn(4, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    model(X).float().sum().backward()
    opt.step()
    state = [v for s in opt.state.values() for v in s.values()]
    return storage_bytes([*model.parameters(), *(p.grad for p in model.parameters()), *state])


def training_bytes(fn: Callable[[nn.Module, str], int]) -> None:
    """Exercise 8.1: ``fn(model, optimizer)`` predicts the bytes of training state after a step."""
    ex = "8.1"
    models = {
        "residual_mlp(width=32, hidden=64, depth=2) in fp32":
            (lambda: residual_mlp(width=32, hidden=64, depth=2), 784),
        "nn.Linear(6, 5, bias=False), one parameter tensor":
            (lambda: nn.Linear(6, 5, bias=False), 6),
        "residual_mlp(width=32, hidden=64, depth=2).to(torch.bfloat16)":
            (lambda: residual_mlp(width=32, hidden=64, depth=2).to(torch.bfloat16), 784),
    }
    for what, (build, in_features) in models.items():
        for name in OPTIMIZERS:
            torch.manual_seed(0)
            got = attempt(ex, fn, build(), name)
            torch.manual_seed(0)
            model = build()
            want = _counted_after_one_step(model, name, in_features)
            expect(ex, isinstance(got, int) and not isinstance(got, bool),
                   f"training_bytes(..., {name!r}) should return a whole number of bytes (an "
                   f"int), got {got!r}")
            if got == want:
                continue
            tensors = len(list(model.parameters()))
            hint = ""
            if name == "adam" and want - got == 4 * tensors:
                hint = (f" The difference is 4 bytes for each of the {tensors} parameter "
                        "tensors: Adam's step counter.")
            elif "bfloat16" in what:
                hint = (" The state has the parameters' dtype: count p.numel() * "
                        "p.element_size(), not 4 bytes a number.")
            raise ExerciseWrong(
                f"Exercise {ex}: {what} with {name!r}: a real step leaves {want:,} bytes of "
                f"parameters, gradients and optimizer state; you predicted {got:,}.{hint}")
    expect_value_error(ex, fn, (residual_mlp(width=8, hidden=8, depth=1), "adamw"),
                       f"'adamw' is not one of {tuple(OPTIMIZERS)}")
    passed(ex, "8, 12 and 16 bytes a parameter in fp32 (plus Adam's step counters), half of it "
               "in bf16")


def shard_rows(fn: Callable[[int, int], list[int]]) -> None:
    """Exercise 8.2: ``fn(rows, world_size)``, the rows FSDP2 gives each rank (torch.chunk's)."""
    ex = "8.2"
    cases = [(10, 2), (10, 3), (4, 3), (5, 4), (7, 4), (1, 4), (10, 8), (1024, 3), (256, 1),
             (9, 3)]
    for rows, world in cases:
        got = attempt(ex, fn, rows, world)
        # FSDP2 cuts a parameter with torch.chunk and gives the ranks past the last chunk an
        # empty one (_chunk_with_empty in torch/distributed/fsdp/_fully_shard/_fsdp_common.py).
        chunks = [len(c) for c in torch.arange(rows).chunk(world)]
        want = chunks + [0] * (world - len(chunks))
        expect(ex, isinstance(got, (list, tuple)) and len(got) == world,
               f"shard_rows({rows}, {world}) should give one number per rank ({world}), "
               f"got {got!r}")
        expect(ex, [int(r) for r in got] == want,
               f"{rows} rows on {world} ranks: FSDP2 keeps {want} rows per rank, you gave "
               f"{list(got)}. Every chunk has ceil(rows / world_size) rows except the last, "
               "and the ranks after the last chunk hold none")
    expect_value_error(ex, fn, (10, 0), "shard_rows(10, 0) has no ranks to hold the rows")
    passed(ex, "10 rows on 3 ranks: 4, 4 and 2; 5 rows on 4 ranks: 2, 2, 1 and none")


def _net_and_batch(depth: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = residual_mlp(width=16, hidden=64, depth=depth, in_features=20)
    gen = torch.Generator().manual_seed(1)
    return net, torch.randn(8, 20, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def _saved_and_grads(net: nn.Sequential, forward: Callable[[], torch.Tensor],
                     y: torch.Tensor) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
    net.zero_grad(set_to_none=True)
    with SavedActivations(exclude=net.parameters()) as saved:
        out = forward()
    if isinstance(out, torch.Tensor) and out.requires_grad:
        F.cross_entropy(out, y).backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in net.parameters()]
    return out, saved.nbytes, grads


def forward_in_segments(fn: Callable[[nn.Sequential, torch.Tensor, int], torch.Tensor]) -> None:
    """Exercise 8.3: ``fn(net, x, segments)`` checkpoints the blocks in ``segments`` runs."""
    ex = "8.3"
    depth, width, hidden, batch = 6, 16, 64, 8
    net, x, y = _net_and_batch(depth)
    plain_out, plain_bytes, plain_grads = _saved_and_grads(net, lambda: net(x), y)
    for segments in (6, 3, 2, 1):
        out, nbytes, grads = _saved_and_grads(
            net, lambda s=segments: attempt(ex, fn, net, x, s), y)
        call = f"forward_in_segments(net, x, segments={segments}) on {depth} blocks"
        expect(ex, isinstance(out, torch.Tensor) and out.shape == plain_out.shape,
               f"{call} should return the model's output, shape {tuple(plain_out.shape)}, got "
               f"{getattr(out, 'shape', type(out).__name__)}")
        expect(ex, torch.allclose(out, plain_out, atol=1e-6),
               f"{call} does not compute net(x): run every layer, the blocks in order")
        expect(ex, all(g is not None for g in grads),
               f"after {call}, backward left some parameters without a gradient: pass the "
               "segment's input through checkpoint(..., use_reentrant=False)")
        same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, plain_grads,
                                                                    strict=True))
        expect(ex, same, f"{call} gives other gradients than net(x)")
        # Every block's hidden activations (gelu's input and fc2's input) are dropped, and of
        # the blocks' inputs only the first of each segment is kept.
        want = (plain_bytes - depth * batch * 2 * hidden * 4
                - (depth - segments) * batch * width * 4)
        expect(ex, nbytes == want,
               f"{call} leaves {nbytes:,} bytes saved for backward; {segments} checkpointed "
               f"runs of {depth // segments} blocks keep {want:,} (the plain model: "
               f"{plain_bytes:,}). Wrap each run of blocks, as one nn.Sequential slice, in a "
               "single checkpoint call")
    for bad in (4, 0):
        expect_value_error(ex, fn, (net, x, bad),
                           f"{depth} blocks do not split into {bad} equal segments")
    passed(ex, "6 blocks in 2 checkpointed segments keep 2 inputs for backward, not 6 blocks' "
               "activations, and give the same gradients")


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        X = torch.rand(8, 784, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(X), y).backward()
        optimizer.step()


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def save_and_restore(fn: Callable[..., nn.Module]) -> None:
    """Exercise 8.5: ``fn(model, optimizer, new_model, new_optimizer, directory)`` via DCP."""
    import torch.distributed.checkpoint as dcp

    ex = "8.5"
    shape = MLPShape(width=16, hidden=32, depth=2)
    model = shape.build(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, optimizer, steps=2, seed=1)
    new_model = shape.build(seed=5)  # other weights, and no momentum yet
    new_optimizer = torch.optim.SGD(new_model.parameters(), lr=0.1, momentum=0.9)
    with tempfile.TemporaryDirectory(prefix="d2lgpu-ex8-") as name, warnings.catch_warnings():
        directory = Path(name)
        warnings.simplefilter("ignore")  # DCP warns that it assumes a single process: it is one
        got = attempt(ex, fn, model, optimizer, new_model, new_optimizer, str(directory))
        expect(ex, got is new_model, "return new_model, the model you loaded into")
        expect(ex, (directory / ".metadata").is_file(),
               f"the directory holds {sorted(p.name for p in directory.iterdir())}, no "
               "'.metadata': save with dcp.save(state, checkpoint_id=directory)")
        expect(ex, _same_weights(new_model, model),
               "new_model's weights differ from model's: load the checkpoint into the "
               "state dicts of new_model and new_optimizer, then put them back "
               "(set_state_dict)")
        buffers = [(new_optimizer.state.get(q, {}).get("momentum_buffer"),
                    optimizer.state[p]["momentum_buffer"])
                   for p, q in zip(model.parameters(), new_model.parameters(), strict=True)]
        expect(ex, all(a is not None and torch.equal(a, b) for a, b in buffers),
               "new_optimizer's momentum buffers differ from optimizer's: save and load "
               "the optimizer's state too (get_state_dict(model, optimizer))")
        third = shape.build(seed=7)
        state = {"model": third.state_dict()}
        dcp.load(state, checkpoint_id=str(directory))
        third.load_state_dict(state["model"])
        expect(ex, _same_weights(third, model),
               "the checkpoint has no 'model' entry the chapter's way of loading can read: "
               "save {'model': model_state, 'optim': optim_state}")
    _train(model, optimizer, steps=1, seed=2)
    _train(new_model, new_optimizer, steps=1, seed=2)
    expect(ex, _same_weights(new_model, model),
           "one more step of the restored model and optimizer does not match the original's")
    passed(ex, "weights and momentum back from DCP's files in one process; training goes on "
               "exactly as if never stopped")
