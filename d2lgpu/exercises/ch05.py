"""Checks for chapter 5's exercises, all in the notebook's own process (DDP itself on a
gloo group of world size 1 over a ``HashStore``)."""

from __future__ import annotations

import contextlib
import gc
import traceback
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from d2lgpu.exercises import (
    ExerciseWrong,
    attempt,
    expect,
    expect_close,
    expect_value_error,
    passed,
    refuse_stub_early,
)


def shard_indices(fn: Callable[..., list[int]]) -> None:
    """Exercise 5.1: ``fn(n, world, rank, shuffle, seed, epoch, drop_last)`` is a rank's
    share, as ``DistributedSampler`` yields it after ``set_epoch(epoch)``."""
    ex = "5.1"
    cases = [(n, world) for n in (8, 7, 10, 3) for world in (1, 2, 3, 4)] + [(3, 8), (1, 2)]
    for n, world in cases:
        for shuffle, seed, epoch in ((False, 0, 0), (True, 0, 0), (True, 0, 1), (True, 7, 2)):
            for drop_last in (False, True):
                for rank in range(world):
                    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank,
                                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
                    sampler.set_epoch(epoch)
                    want = list(sampler)
                    got = attempt(ex, fn, n, world, rank, shuffle=shuffle, seed=seed,
                                  epoch=epoch, drop_last=drop_last)
                    call = (f"shard_indices({n}, {world}, {rank}, shuffle={shuffle}, "
                            f"seed={seed}, epoch={epoch}, drop_last={drop_last})")
                    expect(ex, isinstance(got, (list, tuple)),
                           f"{call} returned a {type(got).__name__}; return a list of ints")
                    got = [int(i) for i in got]
                    hint = ("every rank takes every world-th position of one list: the "
                            "permutation (or range(n)), padded by repeating its start up to a "
                            "multiple of world, or cut down to one when drop_last is set")
                    if shuffle:
                        hint += ("; the permutation is torch.randperm(n, generator=g) with "
                                 "g = torch.Generator().manual_seed(seed + epoch), the same on "
                                 "every rank")
                    expect(ex, got == want, f"{call} gave {got}, DistributedSampler gives "
                                            f"{want}: {hint}")
    expect_value_error(ex, fn, (4, 2, 2, False, 0, 0, False), "rank 2 does not exist among 2 "
                       "ranks (they are 0 and 1), as DistributedSampler says")
    passed(ex, "10 examples on 4 ranks: rank 3 gets [3, 7, 1], padded with example 1; with "
               "drop_last, [3, 7]")


def _examples(n: int, features: int = 6, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(n)
    return (torch.randn(n, features, generator=generator),
            torch.randint(0, classes, (n,), generator=generator))


def _flat_gradient(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.flatten() for g in grads])


def _ddp_reference(model: nn.Module, X: torch.Tensor, y: torch.Tensor, world: int) -> torch.Tensor:
    """The gradient DDP leaves on every rank: the mean over ranks of each rank's mean loss."""
    per_rank = []
    for rank in range(world):
        share = list(DistributedSampler(range(len(X)), num_replicas=world, rank=rank,
                                        shuffle=False))
        per_rank.append(_flat_gradient(model, F.cross_entropy(model(X[share]), y[share])))
    return torch.stack(per_rank).mean(dim=0)


def ddp_gradient(fn: Callable[[nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor]) -> None:
    """Exercise 5.2: ``fn(model, features, labels, world)``, the gradient DDP's ranks agree
    on: the mean of the ranks' gradients, each of its ``DistributedSampler`` share."""
    ex = "5.2"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    before = [p.detach().clone() for p in model.parameters()]
    size = sum(p.numel() for p in model.parameters())
    differs = {}
    for n, world in ((8, 1), (8, 2), (8, 4), (7, 2), (7, 3), (5, 4)):
        X, y = _examples(n)
        want = _ddp_reference(model, X, y, world)
        model.zero_grad(set_to_none=True)
        got = attempt(ex, fn, model, X, y, world)
        call = f"ddp_gradient(model, {n} examples, world={world})"
        expect(ex, isinstance(got, torch.Tensor) and got.numel() == size,
               f"{call}: return one flat tensor of all {size} gradient entries (torch.cat of "
               f"each parameter's gradient, flattened, in model.parameters() order), got "
               f"{getattr(got, 'shape', type(got).__name__)}")
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        expect(ex, unchanged, f"{call} changed the model's parameters: compute gradients only, "
                              "no optimizer step")
        got = got.detach().flatten().to(want.dtype)
        whole = _flat_gradient(model, F.cross_entropy(model(X), y))
        err = (got - want).abs().max().item()
        if err > 1e-6 and torch.allclose(got, whole, atol=1e-6):
            raise ExerciseWrong(
                f"Exercise {ex}: {call} returned the whole batch's gradient; DDP averages the "
                "ranks' gradients, and each rank's loss is the mean over its own share, "
                "including the examples DistributedSampler repeats to even the shares out")
        expect(ex, err < 1e-6,
               f"{call} differs from DDP's average by up to {err:.2e}: split the examples "
               "with DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False), "
               "take each rank's gradient of F.cross_entropy on its share, and average them")
        differs[n, world] = (want - whole).abs().max().item() > 1e-6
    expect(ex, not differs[8, 2] and differs[7, 2],
           "internal: the reference should equal the whole batch for 8 examples on 2 ranks")
    passed(ex, "8 examples on 2 or 4 ranks give the whole batch's gradient; 7 on 2 do not "
               "(example 0 counts twice)")


def _count_all_reduces(state, bucket):
    # The chapter's hook: DDP calls it once per bucket of gradients it all-reduces. (No
    # annotations: DDP checks a hook's annotations, and this module's are strings.)
    state["calls"] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


@contextlib.contextmanager
def _one_rank_group(ex: str) -> Iterator[None]:
    """A gloo process group of world size 1 in this process, destroyed afterwards (a learner's
    own group of one rank is used, and left as it is)."""
    if dist.is_initialized():
        world = dist.get_world_size()
        expect(ex, world == 1, f"this kernel already has a process group of world size {world}; "
               "call torch.distributed.destroy_process_group() first (or restart the kernel)")
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _accumulation_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def accumulate(fn: Callable[[DDP, Sequence[tuple[torch.Tensor, torch.Tensor]]], float]) -> None:
    """Exercise 5.3: ``fn(model, micro_batches)`` accumulates gradients with one all-reduce:
    one forward and backward per micro-batch, the whole batch's gradient and loss."""
    ex = "5.3"
    refuse_stub_early(ex, fn, 2)
    with _one_rank_group(ex):
        try:
            _check_accumulation(ex, fn)
        except BaseException as exc:
            # The exception's frames hold the checks' DDP models: destroying one after its
            # gloo group was seen to block for good (torch 2.9), so they go now.
            seen: set[int] = set()
            while exc is not None and id(exc) not in seen:  # its cause and context too
                seen.add(id(exc))
                traceback.clear_frames(exc.__traceback__)
                exc = exc.__cause__ or exc.__context__
            raise
        finally:
            gc.collect()  # a model an answer tied into a reference cycle goes here too
    passed(ex, "4 micro-batches, 1 all-reduce, and the gradient of the whole batch")


def _check_accumulation(ex: str, fn: Callable[..., float]) -> None:
    """The checks of exercise 5.3, on the group of one rank that ``accumulate`` holds."""
    plain = DDP(_accumulation_model())
    counted = {"calls": 0}
    plain.register_comm_hook(counted, _count_all_reduces)
    X, y = _examples(8, features=8)
    F.cross_entropy(plain(X), y).backward()
    per_backward = counted["calls"]
    expect(ex, per_backward >= 1, "internal: the hook was not called by a plain backward")
    for k in (1, 2, 4):
        X, y = _examples(16, features=8)
        model = DDP(_accumulation_model())
        counted = {"calls": 0}
        model.register_comm_hook(counted, _count_all_reduces)
        micro_batches = list(zip(X.chunk(k), y.chunk(k), strict=True))
        # What the model saw: the rows of each forward, and each backward through it.
        forwards, backwards = [], []
        model.module.register_forward_pre_hook(
            lambda _, args, seen=forwards: seen.append(len(args[0])))
        next(model.module.parameters()).register_post_accumulate_grad_hook(
            lambda _, seen=backwards: seen.append(1))
        loss = attempt(ex, fn, model, micro_batches)
        batches = f"{k} micro-batch{'es' if k > 1 else ''}"
        sizes = [len(rows) for rows, _ in micro_batches]
        expect(ex, forwards == sizes,
               f"{batches} of {sizes} rows: the model's forward passes saw {forwards} rows. "
               "Run the model once on each micro-batch, in turn: one forward over the whole "
               "batch holds all its activations at once, which accumulation exists to avoid")
        expect(ex, len(backwards) == k,
               f"{batches}: backward ran {len(backwards)} time(s) through the model, expected "
               f"{k}: call backward on each micro-batch's loss right after its forward (one "
               "backward of the summed losses keeps every micro-batch's activations alive)")
        calls = counted["calls"] // per_backward
        expect(ex, calls != k or k == 1,
               f"{k} micro-batches made {k} all-reduces, one per backward: run forward "
               "AND backward of all but the last micro-batch inside `with "
               "model.no_sync():` (DDP decides in forward whether the next backward "
               "all-reduces)")
        expect(ex, calls != 0,
               f"{batches} made no all-reduce at all: the last micro-batch runs outside "
               "no_sync, so that the ranks share the summed gradient")
        expect(ex, calls == 1, f"{batches} made {calls} all-reduces, expected 1")
        reference = _accumulation_model()
        whole = _flat_gradient(reference, F.cross_entropy(reference(X), y))
        expect(ex, all(p.grad is not None for p in model.module.parameters()),
               f"with {k} micro-batches some parameters have no gradient: call backward "
               "on every micro-batch's loss")
        got = torch.cat([p.grad.flatten() for p in model.module.parameters()])
        err = (got - whole).abs().max().item()
        expect(ex, err < 1e-5,
               f"with {k} micro-batches the accumulated gradient differs from the whole "
               f"batch's by up to {err:.2e}: divide each micro-batch's mean loss by the "
               f"number of micro-batches ({k}) before backward, so the sum is the mean")
        expect_close(ex, loss, F.cross_entropy(reference(X), y).item(),
                     f"the loss returned for {k} micro-batches (the sum of the divided "
                     "losses: the whole batch's mean)", rel_tol=1e-5, abs_tol=1e-6)


def ring_all_reduce_seconds(fn: Callable[[float, int, float, float], float]) -> None:
    """Exercise 5.4: ``fn(nbytes, n, bandwidth, latency)``, the time of the chapter's ring:
    2(n - 1) steps of ``latency`` plus a chunk of ``nbytes / n`` over ``bandwidth``."""
    ex = "5.4"
    for nbytes in (4e3, 1 << 20, 25 * (1 << 20), 1e9):
        for n in (1, 2, 3, 8, 64):
            for bandwidth, latency in ((25e9, 10e-6), (100e9, 5e-6), (1e9, 0.0)):
                want = 2 * (n - 1) * (latency + nbytes / n / bandwidth)
                got = attempt(ex, fn, nbytes, n, bandwidth, latency)
                expect_close(ex, got, want,
                             f"ring_all_reduce_seconds(nbytes={nbytes:g}, n={n}, "
                             f"bandwidth={bandwidth:g}, latency={latency:g})", rel_tol=1e-9,
                             abs_tol=1e-15)
    expect_value_error(ex, fn, (1e6, 0, 25e9, 1e-5), "a ring of 0 ranks does not exist")
    mib = 1 << 20
    small = 2 * 63 * (10e-6 + mib / 64 / 25e9)
    big = 2 * 63 * (10e-6 + 25 * mib / 64 / 25e9)
    passed(ex, f"64 ranks, 25 GB/s, 10 us a step: 1 MiB takes {small * 1e3:.2f} ms, "
               f"25 MiB {big * 1e3:.2f} ms: {big / small:.1f}x the time for 25x the bytes")
