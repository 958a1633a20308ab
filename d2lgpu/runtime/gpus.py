"""What CUDA can use in this process (device spellings, GPU counts, whether this torch
build has kernels for its GPUs), the checks of a device a learner passes in, and the NCCL
peer-to-peer decision made before a job starts. Chapter 1 explains the checks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "P2PDecision", "apply_nccl_p2p_decision", "as_device", "build_runs_on",
    "capability_or_none", "cuda_arch_list", "cuda_usable", "gpus_without_kernels",
    "nccl_p2p_decision", "num_gpus", "require_cuda_device",
]


def as_device(device: torch.device | str | int) -> torch.device:
    """``torch.device(device)``, with an error that names the spellings the course uses
    (torch's lists twenty device types)."""
    if isinstance(device, torch.device):
        return device
    hint = "use 'cpu', 'cuda', 'cuda:0' or torch.device('cuda', 0)"
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(f"{device!r} is not a device ({type(device).__name__}); {hint}")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{device!r} is not a device PyTorch understands; {hint}") from err


def build_runs_on(capability: tuple[int, int], arch_list: Sequence[str]) -> bool:
    """Whether a build with ``arch_list`` has kernels for a GPU of ``capability``: ``sm_XY``
    (or ``sm_XYa``) runs on X.Y and later minor versions of X, PTX (``compute_XY``) on X.Y
    and later."""
    mine = capability[0] * 10 + capability[1]
    parsed = [re.fullmatch(r"(sm|compute)_(\d+)[a-z]*", str(entry)) for entry in arch_list]
    return any(int(p[2]) <= mine and (p[1] == "compute" or int(p[2]) // 10 == capability[0])
               for p in parsed if p)


def cuda_arch_list() -> list[str] | None:
    """``torch.cuda.get_arch_list()``; None for a ROCm build or a build that recorded no
    list (the cases torch's own start-up check skips)."""
    if torch.version.cuda is None:  # a ROCm or CPU-only build
        return None
    return torch.cuda.get_arch_list() or None


def capability_or_none(index: int) -> tuple[int, int] | None:
    """GPU ``index``'s compute capability; None for a GPU that cannot be read."""
    try:
        return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - a lost or busy GPU must not stop the others
        return None


def gpus_without_kernels() -> list[int]:
    """The visible GPUs this torch build has no kernels for ("no kernel image is available")."""
    arch_list = cuda_arch_list() if torch.cuda.is_available() else None
    if arch_list is None:
        return []
    capabilities = [capability_or_none(i) for i in range(torch.cuda.device_count())]
    return [i for i, c in enumerate(capabilities) if c and not build_runs_on(c, arch_list)]


def cuda_usable() -> bool:
    """True when torch finds CUDA and this build has kernels for every visible GPU (work is
    spread over all of them, and one without kernels fails the whole step)."""
    return torch.cuda.is_available() and not gpus_without_kernels()


def num_gpus() -> int:
    """How many CUDA GPUs this process can use: 0 without CUDA, or where this build has no
    kernels for them (the course then runs on the CPU)."""
    return torch.cuda.device_count() if cuda_usable() else 0


@dataclass(frozen=True)
class P2PDecision:
    """Whether NCCL should copy through host memory (``NCCL_P2P_DISABLE=1``), and why."""

    disable: bool
    reason: str
    user_set: bool = False

    def __str__(self) -> str:
        verdict = "NCCL_P2P_DISABLE=1" if self.disable else "NCCL peer-to-peer left on"
        return f"{verdict}: {self.reason}"


#: Run in a fresh interpreter, so that a copy that hangs cannot hang the caller: "CANNOT
#: START" when the GPUs cannot be prepared, then "STARTED", the copies between every pair
#: that reports peer access, and the pairs that came out wrong.
_PEER_COPY_CHECK = """
import torch
try:
    n = torch.cuda.device_count()
    pairs = [(i, j) for i in range(n) for j in range(n)
             if i != j and torch.cuda.can_device_access_peer(i, j)]
    expected = torch.arange(1 << 20, dtype=torch.float32)
    sources = {i: expected.to(f"cuda:{i}") for i, _ in pairs}
    targets = {(i, j): torch.empty_like(expected, device=f"cuda:{j}") for i, j in pairs}
    for gpu in {g for pair in pairs for g in pair}:
        torch.cuda.synchronize(gpu)
except Exception as exc:
    lines = str(exc).strip().splitlines()
    print("CANNOT START", type(exc).__name__ + ":", lines[0] if lines else "")
    raise SystemExit(0)
print("STARTED", flush=True)
bad = []
for i, j in pairs:
    targets[(i, j)].copy_(sources[i])
    torch.cuda.synchronize(j)
    if not torch.equal(targets[(i, j)].cpu(), expected):
        bad.append(f"{i}->{j}")
print("BAD " + " ".join(bad) if bad else "OK")
"""


def _peer_copies_correct(timeout_s: float = 120.0) -> tuple[bool | None, str]:
    """(True, ''): intact; (False, why): wrong, hung or crashed; (None, why): untested."""
    try:
        run = subprocess.run([sys.executable, "-c", _PEER_COPY_CHECK], capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""  # the output so far: bytes even with text=True (str on Windows)
        if "STARTED" in (out.decode(errors="replace") if isinstance(out, bytes) else out):
            return False, f"a peer copy did not finish within {timeout_s:g} s"
        return None, f"the peer copy check did not get to its first copy within {timeout_s:g} s"
    lines = run.stdout.strip().splitlines()
    if lines and lines[0].startswith("CANNOT START"):
        return None, ("the peer copy check could not prepare its GPUs "
                      f"({lines[0].removeprefix('CANNOT START').strip()})")
    tail = f"exit {run.returncode}: {(run.stderr.strip().splitlines() or ['no output'])[-1]}"
    if "STARTED" not in lines:
        return None, f"the peer copy check failed before its first copy ({tail})"
    if run.returncode != 0 or lines[-1] == "STARTED":
        return False, f"the peer copy check crashed during the copies ({tail})"
    if lines[-1] != "OK":
        return False, f"peer copies arrived wrong ({lines[-1][4:]})"
    return True, ""


#: The peer copy check's verdicts, by CUDA_VISIBLE_DEVICES: the answer does not change
#: while the process lives, and the check costs a process and a CUDA context per GPU.
_PEER_COPY_VERDICTS: dict[str | None, tuple[bool, str]] = {}


def nccl_p2p_decision(environ: MutableMapping[str, str] | None = None) -> P2PDecision:
    """Whether NCCL's direct GPU-to-GPU copies should be off here: some machines (Kaggle's
    two T4s) report peer access that hangs or sums wrong. A value the user set stands."""
    environ = os.environ if environ is None else environ
    if "NCCL_P2P_DISABLE" in environ:
        value = environ["NCCL_P2P_DISABLE"]
        return P2PDecision(value.strip() not in ("", "0"),
                           f"NCCL_P2P_DISABLE={value} was already set, and is kept", True)
    count = num_gpus()
    if count < 2:
        return P2PDecision(False, f"{count} GPU(s) here: no peer for NCCL to copy to")
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    t4s = [i for i, name in enumerate(names) if "T4" in name.split()]
    if len(t4s) >= 2:
        return P2PDecision(True, f"{len(t4s)} T4s without NVLink: their PCIe peer copies "
                           "are known to hang or sum wrong (as on Kaggle)")
    pairs = [(i, j) for i in range(count) for j in range(count)
             if i != j and torch.cuda.can_device_access_peer(i, j)]
    if not pairs:
        return P2PDecision(False, "no pair of GPUs reports peer access: NCCL copies through "
                           "host memory already")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ok, problem = _PEER_COPY_VERDICTS.get(visible) or _peer_copies_correct()
    if ok is None:
        return P2PDecision(False, f"peer access is reported and left on, untested: {problem}. "
                           "Set NCCL_P2P_DISABLE=1 yourself if NCCL then hangs")
    _PEER_COPY_VERDICTS[visible] = (ok, problem)
    if not ok:
        return P2PDecision(True, f"peer access is reported, but {problem}")
    return P2PDecision(False, f"peer copies between all {count} GPUs arrive intact")


def apply_nccl_p2p_decision(environ: MutableMapping[str, str] | None = None) -> P2PDecision:
    """:func:`nccl_p2p_decision`, setting ``NCCL_P2P_DISABLE=1`` in ``environ`` where it
    says so, before any process group starts (chapter 5)."""
    environ = os.environ if environ is None else environ
    decision = nccl_p2p_decision(environ)
    if decision.disable and not decision.user_set:
        environ["NCCL_P2P_DISABLE"] = "1"
    return decision


def require_cuda_device(device: torch.device | str | int, what: str) -> torch.device:
    """``device`` with its GPU index filled in, once it is clear that CUDA can use it here;
    otherwise an error naming the caller (``what``) and the fix. Other devices pass as they are."""
    device = as_device(device)
    if device.type != "cuda":
        return device
    count = num_gpus()
    index = torch.cuda.current_device() if count and device.index is None else device.index
    if count and index < count:
        return torch.device("cuda", index)
    if count:
        cause = f"{device} does not exist: this process sees {count} GPU(s), numbered from 0"
    else:
        cause = "this process cannot use CUDA: this PyTorch " + (
            "is a CPU-only build" if torch.version.cuda is None
            else "has no kernels for a GPU here" if torch.cuda.is_available()
            else "finds no usable GPU")
    raise RuntimeError(
        f"{what} was given {device}, but {cause}.\nRun `python -m d2lgpu info` (or "
        "print(d2lgpu.diagnose_this_machine())) to see why and how to fix it.\nTo run on the "
        "CPU instead, pass d2lgpu.try_gpu() (it is the CPU when there is no GPU)."
    )
