"""Checks for chapter 1's exercises (CUDA checks)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from d2lgpu.chips import GPU_DATASHEETS
from d2lgpu.exercises import attempt, expect, expect_close, expect_value_error, passed

MiB = 2**20


def _kernel_image(capability: tuple[int, int], arch_list: Sequence[str]) -> str | None:
    """The entry of ``arch_list`` a GPU of ``capability`` runs: the newest ``sm_XY`` of its
    major X with a minor Y no higher than its own, else the newest PTX no newer than it."""
    mine = tuple(capability)
    machine, ptx = [], []
    for entry in arch_list:
        kind, number = entry.split("_")
        version = divmod(int(number), 10)  # sm_120 -> (12, 0): the last digit is the minor
        if kind == "sm" and version[0] == mine[0] and version[1] <= mine[1]:
            machine.append((version, entry))
        elif kind == "compute" and version <= mine:
            ptx.append((version, entry))
    for found in (machine, ptx):
        if found:
            return max(found)[1]
    return None


def kernel_image(fn: Callable[[tuple[int, int], list[str]], str | None]) -> None:
    """Exercise 1.1: ``fn(capability, arch_list)``, the entry of ``torch.cuda.get_arch_list()``
    whose code a GPU of that compute capability runs, or None where none can run."""
    ex = "1.1"
    cuda13 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    cases = [
        ((9, 0), cuda13, "an H100 (9.0) finds machine code built for it"),
        ((8, 9), cuda13, "an L4 (8.9) runs sm_86: its generation (8), a lower minor version"),
        ((7, 0), cuda13, "a V100 (7.0): sm_75 needs 7.5, sm_80 is another generation, no PTX"),
        ((10, 3), ["sm_90", "sm_100"], "sm_100 is 10.0 (the last digit is the minor version)"),
        ((12, 0), ["sm_90", "sm_100", "compute_100"], "the driver compiles compute_100's PTX"),
        ((8, 6), ["sm_80", "sm_86", "compute_86"], "machine code that fits wins over PTX"),
        ((8, 0), ["sm_86", "compute_86"], "an A100 (8.0) runs neither: both need 8.6"),
        ((9, 0), ["sm_80", "compute_70", "compute_80"], "of the PTX, the newest that fits"),
        ((7, 5), [], "an empty list (a CPU-only build) has nothing to run"),
    ]
    @functools.wraps(fn)  # keeps fn's name for the "not done yet" message
    def boxed(*args: object) -> tuple[str | None]:
        return (fn(*args),)  # None is an answer here, not a forgotten return

    for capability, arch_list, why in cases:
        want = _kernel_image(capability, arch_list)
        (got,) = attempt(ex, boxed, capability, list(arch_list))
        expect(ex, got == want,
               f"kernel_image({capability}, {arch_list}) returned {got!r}, expected "
               f"{want!r}: {why}")
    passed(ex, "an L4 runs a CUDA 13 build through its sm_86 code, a V100 finds nothing, and a "
               "GPU newer than every sm_ entry waits for the driver to compile PTX")


def storage_bytes(fn: Callable[[Sequence[torch.Tensor]], int]) -> None:
    """Exercise 1.3: ``fn(tensors)``, the bytes of memory the tensors keep alive (each storage
    counted once, whole)."""
    ex = "1.3"
    x = torch.arange(1000, dtype=torch.float32)
    m = torch.zeros(30, 40)
    cases = [
        ("[x], x = torch.arange(1000, dtype=torch.float32)", [x], 4000),
        ("[x[:10]]: a view keeps all of x's storage alive", [x[:10]], 4000),
        ("[x, x[::2], x.view(2, 500)]: one storage, three tensors",
         [x, x[::2], x.view(2, 500)], 4000),
        ("[x, x.clone()]: a clone has a storage of its own", [x, x.clone()], 8000),
        ("[x[:10].clone()]: the clone holds only its 10 floats", [x[:10].clone()], 40),
        ("[x.to(torch.bfloat16)]: 2 bytes per element", [x.to(torch.bfloat16)], 2000),
        ("[x.to(torch.int8)]: a new tensor of 1 byte per element", [x.to(torch.int8)], 1000),
        ("[x.view(torch.int8)]: the same 4,000 bytes read as int8", [x.view(torch.int8)], 4000),
        ("[x, x.view(torch.int8)]: still one storage", [x, x.view(torch.int8)], 4000),
        ("[torch.zeros(3).expand(1000, 3)]: expand repeats 3 floats without copying",
         [torch.zeros(3).expand(1000, 3)], 12),
        ("[m.T, m[:, 0]], m = torch.zeros(30, 40)", [m.T, m[:, 0]], 4800),
        ("[torch.empty(0)]", [torch.empty(0)], 0),
        ("[] (no tensors)", [], 0),
    ]
    for what, tensors, want in cases:
        got = attempt(ex, fn, tensors)
        expect(ex, isinstance(got, int) and not isinstance(got, bool),
               f"return the number of bytes as an int, got {type(got).__name__} {got!r} "
               f"for {what}")
        expect(ex, got == want,
               f"{what}: {got:,} bytes, expected {want:,}. Count each tensor's whole storage "
               "(t.untyped_storage().nbytes()), not its elements, and a storage shared by "
               "several tensors once (t.untyped_storage().data_ptr() tells storages apart)")
    passed(ex, "x[:10] keeps all 4,000 bytes of a 1,000-float x alive; x[:10].clone() lets them go")


def _footprint(nbytes: int) -> tuple[int, int]:
    """(memory_allocated, memory_reserved) after allocating ``nbytes`` on an empty caching
    allocator, as c10/cuda/CUDACachingAllocator.cpp (torch 2.9 to 2.15) does it."""
    if nbytes == 0:
        return 0, 0  # no allocation at all: the tensor's data pointer is null
    rounded = max(512, 512 * math.ceil(nbytes / 512))
    if rounded <= MiB:
        return rounded, 2 * MiB  # small pool: the rest of the segment is always split off
    segment = 20 * MiB if rounded < 10 * MiB else 2 * MiB * math.ceil(rounded / (2 * MiB))
    split = segment - rounded > MiB  # large pool: split only when more than 1 MiB remains
    return (rounded if split else segment), segment


_FOOTPRINT_RULE = ("0 bytes ask for nothing; else round up to 512 bytes; up to 1 MiB, cut from a "
                   "2 MiB segment; below 10 MiB a 20 MiB segment, else one rounded up to 2 MiB, "
                   "taken whole unless more than 1 MiB would stay free.")


def allocator_footprint(fn: Callable[[int], tuple[int, int]]) -> None:
    """Exercise 1.4: ``fn(nbytes)``, (memory_allocated, memory_reserved) after one tensor of
    ``nbytes`` bytes on an empty caching allocator."""
    ex = "1.4"
    sizes = [(1, ""), (4, "one float32"), (512, ""), (513, ""),
             (4000, "1,000 float32"), (MiB, "1 MiB"), (MiB + 1, "1 MiB + 1 B"),
             (3 * MiB, "3 MiB"), (10 * MiB - 1, "10 MiB - 1 B"), (10 * MiB + 1, "10 MiB + 1 B"),
             (11 * MiB - 512, "11 MiB - 512 B"), (11 * MiB, "11 MiB"),
             (256 * MiB, "256 MiB"), (0, "torch.empty(0)")]
    for nbytes, what in sizes:
        tensor = f"a tensor of {nbytes:,} byte{'' if nbytes == 1 else 's'}" + (
            f" ({what})" if what else "")
        got = attempt(ex, fn, nbytes)
        expect(ex, isinstance(got, (tuple, list)) and len(got) == 2,
               f"return a pair (allocated, reserved), got {got!r} for {tensor}")
        want = _footprint(nbytes)
        allocated, reserved = got
        expect(ex, (allocated, reserved) == want,
               f"{tensor}: got allocated {allocated:,}, reserved {reserved:,}; expected "
               f"allocated {want[0]:,}, reserved {want[1]:,}. {_FOOTPRINT_RULE}")
    expect_value_error(ex, fn, (-1,), "a tensor cannot have -1 bytes")
    passed(ex, "one float32 on the GPU: 512 bytes allocated in a 2 MiB segment; 3 MiB "
               "reserve 20 MiB, and 11 MiB take a whole 12 MiB segment")


def warp_waves(fn: Callable[[int, int, str], float]) -> None:
    """Exercise 1.6: ``fn(blocks, threads_per_block, chip)``, how many times a kernel's warps
    fill the resident warp slots of a chip of ``chips.GPU_DATASHEETS``."""
    ex = "1.6"
    cases = [(1, 1, "H100 SXM5"), (1000, 256, "H100 SXM5"), (1000, 256, "T4"),
             (132 * 8, 256, "H100 SXM5"), (1000, 33, "T4"), (4096, 1024, "H100 SXM5"),
             (40, 1024, "T4")]
    for blocks, threads, chip in cases:
        sheet = GPU_DATASHEETS[chip]
        warp = int(sheet["warp size (threads)"])
        slots = int(sheet["max threads per SM"]) // warp * int(sheet["SMs"])
        want = blocks * math.ceil(threads / warp) / slots
        got = attempt(ex, fn, blocks, threads, chip)
        warps = math.ceil(threads / warp)
        expect_close(ex, got, want,
                     f"warp_waves({blocks}, {threads}, {chip!r}) ({slots:,} warp slots; a "
                     f"block of {threads} thread{'' if threads == 1 else 's'} takes {warps} "
                     f"whole warp{'' if warps == 1 else 's'})")
    for blocks, threads, why in [(10, 0, "a block has at least 1 thread"),
                                 (10, 1025, "a block has at most 1,024 threads"),
                                 (0, 256, "a kernel launches at least one block")]:
        expect_value_error(ex, fn, (blocks, threads, "T4"),
                            f"warp_waves({blocks}, {threads}, 'T4'): {why}")
    passed(ex, "1,000 blocks of 256 threads fill 95% of an H100's warp slots, and a T4's "
               "6.25 times over")
