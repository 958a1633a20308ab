"""Chapter 1's exercise checks fail on the stubs and on plausible wrong answers."""

from __future__ import annotations

import math

import pytest

from d2lgpu.chips import GPU_DATASHEETS
from d2lgpu.exercises import ExerciseNotDone, ExerciseWrong
from d2lgpu.exercises import ch01 as check

MiB = 2**20


def stub(*args):
    raise NotImplementedError


def _version(entry: str) -> tuple[int, int]:
    return divmod(int(entry.split("_")[1]), 10)


def exact_match_only(capability, arch_list):
    entry = f"sm_{capability[0]}{capability[1]}"
    return entry if entry in arch_list else None


def newest_as_strings(capability, arch_list):
    # Compares the names as strings: "sm_90" sorts after "sm_100".
    mine = f"sm_{capability[0]}{capability[1]}"
    fitting = [e for e in arch_list if e.startswith("sm_") and e <= mine]
    return max(fitting) if fitting else None


def two_characters_as_versions(capability, arch_list):
    # Reads "sm_100" as major 1, minor 0.
    for entry in sorted(arch_list, reverse=True):
        digits = entry.split("_")[1]
        major, minor = int(digits[0]), int(digits[1])
        if entry.startswith("sm_") and major == capability[0] and minor <= capability[1]:
            return entry
    return None


def any_older_machine_code(capability, arch_list):
    # Forgets that machine code runs only within its own generation.
    fitting = [(_version(e), e) for e in arch_list if _version(e) <= tuple(capability)]
    return max(fitting)[1] if fitting else None


def ptx_first(capability, arch_list):
    for kind in ("compute", "sm"):
        fitting = [(_version(e), e) for e in arch_list if e.startswith(kind)
                   and _version(e) <= tuple(capability)
                   and (kind == "compute" or _version(e)[0] == capability[0])]
        if fitting:
            return max(fitting)[1]
    return None


@pytest.mark.parametrize("wrong", [exact_match_only, newest_as_strings,
                                   two_characters_as_versions, any_older_machine_code,
                                   ptx_first])
def test_kernel_image_refuses_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.kernel_image(wrong)


def test_kernel_image_refuses_the_stub():
    with pytest.raises(ExerciseNotDone):
        check.kernel_image(stub)


def elements_times_size(tensors):
    return sum(t.nelement() * t.element_size() for t in tensors)


def storages_counted_per_tensor(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("wrong", [elements_times_size, storages_counted_per_tensor])
def test_storage_bytes_refuses_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.storage_bytes(wrong)


def exactly_what_was_asked(nbytes):
    if nbytes < 0:
        raise ValueError(nbytes)
    return nbytes, nbytes


def rounded_without_segments(nbytes):
    if nbytes < 0:
        raise ValueError(nbytes)
    rounded = 512 * math.ceil(nbytes / 512)
    return rounded, rounded


def always_split(nbytes):
    # Leaves the rest of a large segment free even when 1 MiB or less remains.
    if nbytes < 0:
        raise ValueError(nbytes)
    if nbytes == 0:
        return 0, 0
    rounded = max(512, 512 * math.ceil(nbytes / 512))
    if rounded <= MiB:
        return rounded, 2 * MiB
    segment = 20 * MiB if rounded < 10 * MiB else 2 * MiB * math.ceil(rounded / (2 * MiB))
    return rounded, segment


@pytest.mark.parametrize("wrong", [exactly_what_was_asked, rounded_without_segments,
                                   always_split])
def test_allocator_footprint_refuses_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.allocator_footprint(wrong)


def threads_not_warps(blocks, threads_per_block, chip):
    if not 1 <= threads_per_block <= 1024 or blocks < 1:
        raise ValueError("bad launch")
    sheet = GPU_DATASHEETS[chip]
    return blocks * threads_per_block / (sheet["max threads per SM"] * sheet["SMs"])


def no_value_errors(blocks, threads_per_block, chip):
    sheet = GPU_DATASHEETS[chip]
    warp = sheet["warp size (threads)"]
    slots = sheet["max threads per SM"] // warp * sheet["SMs"]
    return blocks * math.ceil(threads_per_block / warp) / slots


@pytest.mark.parametrize("wrong", [threads_not_warps, no_value_errors])
def test_warp_waves_refuses_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.warp_waves(wrong)


def test_every_check_refuses_its_stub():
    for name in ("storage_bytes", "allocator_footprint", "warp_waves"):
        with pytest.raises(ExerciseNotDone):
            getattr(check, name)(stub)
