"""PyTorch's own distributed engine, made safe to use from a notebook or a laptop.

Three pieces, each small enough to read in one go:

* :func:`process_group` joins a ``torch.distributed`` process group and always
  leaves it. It reads rank and world size from the variables ``torchrun`` sets,
  or takes them as arguments when the :func:`launch` launcher started the
  process. It picks the backend (:func:`choose_backend`: NCCL when every rank
  on this machine has a GPU of its own, gloo otherwise, so a CPU-only machine
  works), binds the rank to its GPU, and sets a timeout so that a dead peer
  ends the job with an error instead of leaving the others waiting forever.
* :func:`launch` starts one process per rank with the *spawn* start method (the
  only one that is safe with CUDA), waits for them, and returns what rank 0's
  function returned. When any rank raises, it stops the others and raises that
  rank's exception in the caller, with the traceback from the rank attached.
  The function it runs must be importable (defined in a module, like the
  workers of this package): spawn starts a fresh interpreter that finds the
  function by its module and name, and a function defined in a notebook cell
  has no module it can be imported from.
* :func:`hogwild_train`: several processes training one model whose tensors
  live in shared memory (``share_memory_()``), each updating it in place
  without locks ("Hogwild!"), the pattern of PyTorch's own MNIST Hogwild example.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from d2lgpu.checks import check_positive_int
from d2lgpu.devices import num_gpus

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistContext",
    "RemoteTraceback",
    "RankError",
    "all_reduce_sum",
    "choose_backend",
    "faulty_worker",
    "find_free_port",
    "hogwild_train",
    "launch",
    "process_group",
]

#: Seconds a collective waits for the other ranks before it fails. Long enough
#: for a slow first CUDA call, short enough that a crashed peer is noticed.
DEFAULT_TIMEOUT_S = 300.0

#: The only address this module ever uses for single-machine jobs.
LOOPBACK = "127.0.0.1"

# When an exception last left a process_group() block in this process (time.time()).
_failed_at: float | None = None


# ---------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job, and where it computes.

    ``rank`` is unique across the whole job (all machines); ``local_rank`` is
    unique on this machine and picks the GPU. ``device`` is ``cuda:local_rank``
    with NCCL and the CPU with gloo.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on rank 0, the one rank that logs and writes files."""
        return self.rank == 0


def choose_backend(local_world_size: int) -> str:
    """``"nccl"`` when CUDA works and every rank on this machine gets its own GPU, else ``"gloo"``.

    NCCL is the fast GPU backend but needs one GPU per process; gloo runs on
    CPUs everywhere (Linux, macOS, Windows), so it is the fallback that keeps
    the code runnable on a laptop or a CI machine without GPUs.
    """
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int):
        raise TypeError(f"local_world_size must be an int, got {local_world_size!r}")
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be at least 1, got {local_world_size}")
    gpus = num_gpus()
    if gpus >= local_world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def find_free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago, for the rendezvous of a local job.

    The operating system picks it (bind to port 0). Another program could take
    it before the job starts; that is unlikely, and it fails loudly if it happens.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise RuntimeError(
            f"environment variable {name} is not set: start this program with torchrun "
            "(e.g. `torchrun --nproc_per_node=2 -m d2lgpu.ddp_train`), or pass rank=, "
            "world_size= and master_port= to process_group() explicitly"
        )
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={raw!r} is not an integer") from None


def _torchrun_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store of a torchrun worker, with keys private to this restart attempt.

    ``init_method="env://"`` would do the same without the prefix. But torchrun
    keeps one store for the whole job, so after ``--max-restarts`` restarts the
    workers, the keys written by the dead workers of the previous attempt are
    still there, and gloo can read a dead peer's address from them ("Connection
    refused" on restart). A prefix per attempt gives every attempt fresh keys.
    """
    addr, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT")
    if not addr:
        raise RuntimeError("MASTER_ADDR is not set: start this program with torchrun")
    # torchrun's agent serves the store itself when it says so; otherwise rank 0 does.
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        addr, port, world_size, is_master=not agent_serves and rank == 0, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"d2lgpu/attempt_{attempt}", store)


@contextmanager
def process_group(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    master_port: int | None = None,
    master_addr: str = LOOPBACK,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Iterator[DistContext]:
    """Join a process group for the ``with`` block, and always leave it afterwards.

    Under ``torchrun`` call it without arguments: rank, world size, local rank
    and the rendezvous address come from the environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``). Processes started by :func:`launch` pass ``rank``,
    ``world_size`` and ``master_port`` (one machine, so local rank = rank).

    ``backend=None`` lets :func:`choose_backend` decide. ``timeout_s`` bounds how
    long any collective waits for the other ranks. After an error in a multi-rank
    NCCL group the group is not torn down here (that would wait for the stuck
    peers): end the process, as :func:`launch` and torchrun do.
    """
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size (spawned processes) or neither (torchrun)")
    if rank is None:
        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        local_rank = _env_int("LOCAL_RANK") if local_rank is None else local_rank
        if local_world_size is None:
            local_world_size = _env_int("LOCAL_WORLD_SIZE")
        init_method = None  # a store of our own, below
    else:
        if master_port is None:
            raise ValueError(
                "master_port is required with an explicit rank: choose one in the parent with "
                "d2lgpu.distributed.find_free_port() and pass the same port to every rank"
            )
        if not 0 < master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {master_port}")
        local_rank = rank if local_rank is None else local_rank
        local_world_size = world_size if local_world_size is None else local_world_size
        init_method = f"tcp://{master_addr}:{master_port}"
    assert world_size is not None and local_world_size is not None  # for the type checker
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"need 0 <= local_rank < local_world_size, got {local_rank} and {local_world_size}"
        )
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a process group; leave it first "
            "(torch.distributed.destroy_process_group()) or reuse it"
        )

    backend = choose_backend(local_world_size) if backend is None else backend
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo' (or None to choose), got {backend!r}")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local_rank >= gpus:
            raise RuntimeError(
                f"backend 'nccl' needs one GPU per process, but local rank {local_rank} has no "
                f"GPU of its own ({gpus} visible): start fewer processes or use backend='gloo'"
            )
        device = torch.device("cuda", local_rank)
        # Bind before init so NCCL and every later CUDA call use this rank's GPU,
        # not GPU 0 for everyone.
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        store=_torchrun_store(rank, world_size, timeout) if init_method is None else None,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        # Tells NCCL the device up front (no guessing in barrier()).
        device_id=device if backend == "nccl" else None,
    )
    global _failed_at
    failed = False
    try:
        yield DistContext(rank, world_size, local_rank, local_world_size, backend, device)
    except BaseException:
        # Remember when the error happened, before the teardown below makes the
        # peers fail too: launch() uses it to tell the cause from its echoes.
        _failed_at = time.time()
        failed = True
        raise
    finally:
        # NCCL's orderly teardown flushes and destroys the communicator together
        # with the other ranks. After an error here they are still waiting in a
        # collective for this rank, so it would wait for them until the timeout
        # and the error would surface minutes late. Let the error propagate
        # instead; the process is about to end (launch() and torchrun end it),
        # and its end releases the GPU and the communicator.
        if not (failed and backend == "nccl" and world_size > 1):
            dist.destroy_process_group()


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Sum a few numbers (losses, counts) over all ranks; every rank gets the totals.

    In float64 so that counts stay exact and sums of many losses lose nothing.
    """
    totals = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return totals.tolist()


# ---------------------------------------------------------------------------
# A launcher for notebooks: one spawned process per rank
# ---------------------------------------------------------------------------


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in another process.

    Attached as ``__cause__`` of the re-raised exception, so Python prints the
    place in the rank's code where it happened.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


class RankError(RuntimeError):
    """A rank failed and its own exception could not be rebuilt here (or it was killed)."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def _loopback_interface() -> str | None:
    # gloo finds its network interface through the host name, which on some
    # containers resolves to an address that is not reachable. A one-machine
    # job only needs the loopback interface.
    return {"linux": "lo", "darwin": "lo0"}.get(sys.platform)


def _run_rank(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    workdir: str,
    nprocs: int,
    threads: int,
) -> None:
    """What every spawned process runs: ``fn(rank, *args)``, recording the outcome in ``workdir``.

    Rank 0's return value goes to ``result.pt``; an exception of any rank goes
    to ``error-<rank>.pkl`` with the time it happened, so that the parent can
    tell the first failure (the cause) from the ranks that failed because a
    peer was gone.
    """
    torch.set_num_threads(threads)
    try:
        value = fn(rank, *args)
    except BaseException as exc:
        record: dict[str, Any] = {
            "rank": rank,
            # Inside a process group, the moment the error left it; otherwise now.
            "time": _failed_at if _failed_at is not None else time.time(),
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc(),
            "exception": None,
        }
        try:
            record["exception"] = pickle.dumps(exc)
            pickle.loads(record["exception"])  # some exceptions pickle but cannot be rebuilt
        except Exception:
            record["exception"] = None
        with open(Path(workdir) / f"error-{rank}.pkl", "wb") as fh:
            pickle.dump(record, fh)
        # The parent rebuilds the error from the record. Exit at once, like a
        # finished rank below, so that no teardown (an NCCL communicator whose
        # peers are stuck waiting for this rank) can delay the failure.
        _exit_now(1)
    if rank == 0:
        # Write then rename: the parent never reads a half-written file.
        tmp = Path(workdir) / "result.pt.tmp"
        torch.save(value, tmp)
        os.replace(tmp, Path(workdir) / "result.pt")
    # The rank's work is done and recorded. Leave now rather than through the
    # interpreter's normal shutdown: native libraries' destructors (gloo's
    # threads among them) have been seen to abort a finished process there,
    # which would turn a successful job into a failed one.
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """End this process with ``code`` after flushing its output, skipping interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _raise_first_failure(workdir: Path, processes: Sequence[Any]) -> None:
    """Raise the exception of the rank that failed first (the cause), or say how it died."""
    records = []
    for path in workdir.glob("error-*.pkl"):
        with open(path, "rb") as fh:
            records.append(pickle.load(fh))
    if not records:
        codes = {rank: p.exitcode for rank, p in enumerate(processes) if p.exitcode}
        rank = min(codes) if codes else 0
        code = codes.get(rank)
        how = f"was killed by signal {-code}" if code and code < 0 else f"exited with code {code}"
        raise RankError(
            f"rank {rank} {how} without raising a Python exception (out of memory, a crash in "
            "native code, or os._exit); its output above may say more",
            rank,
        )
    first = min(records, key=lambda r: r["time"])
    others = sorted(r["rank"] for r in records if r is not first)
    note = f"raised by rank {first['rank']} of {len(processes)} started by d2lgpu.launch"
    if others:
        note += f"; ranks {others} failed after it (usually because a peer was gone)"
    remote = RemoteTraceback(first["traceback"])
    exc = pickle.loads(first["exception"]) if first["exception"] is not None else None
    if isinstance(exc, Exception):
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        raise exc from remote
    raise RankError(f"{first['type']}: {first['message']} ({note})", first["rank"]) from remote


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    poll_s: float = 0.05,
) -> Any:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes and return rank 0's result.

    Like ``torch.multiprocessing.spawn`` (same start method and calling
    convention) with three differences a notebook needs: it returns rank 0's
    value; when a rank raises, the caller gets *that* exception (the first one,
    not the "connection closed" errors it causes on the other ranks) with the
    rank's traceback as its cause; and it never waits forever: ranks that are
    still running ``grace_s`` seconds after a failure, or when ``timeout_s``
    runs out, are terminated and then killed.

    ``fn`` must be importable by module and name (defined in a ``.py`` file),
    and ``args`` and the result must be picklable. Each process gets an equal
    share of the CPU cores for its intra-op threads, so two ranks on two cores
    do not fight over them.
    """
    check_positive_int("nprocs", nprocs)
    if getattr(fn, "__module__", None) == "__main__" or "<locals>" in getattr(
        fn, "__qualname__", ""
    ):
        raise ValueError(
            f"{getattr(fn, '__qualname__', fn)!r} is defined in __main__ (a notebook or script) "
            "or inside another function, so a spawned process cannot import it: move it into a "
            ".py module and import it from there"
        )
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    if "GLOO_SOCKET_IFNAME" not in os.environ and _loopback_interface():
        os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface() or ""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    with tempfile.TemporaryDirectory(prefix="d2lgpu-launch-") as tmp:
        workdir = Path(tmp)
        context = mp.start_processes(
            _run_rank,
            args=(fn, args, str(workdir), nprocs, threads),
            nprocs=nprocs,
            join=False,
            start_method="spawn",
        )
        processes = context.processes
        failed = timed_out = False
        try:
            while True:
                codes = [p.exitcode for p in processes]
                if any(c not in (None, 0) for c in codes):
                    failed = True
                    break
                if all(c == 0 for c in codes):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(poll_s)
            if failed:
                # Give the other ranks a moment to notice and record their own errors.
                end = time.monotonic() + grace_s
                while any(p.is_alive() for p in processes) and time.monotonic() < end:
                    time.sleep(poll_s)
        finally:
            # Also reached on KeyboardInterrupt (the stop button): no orphans left behind.
            for p in processes:
                if p.is_alive():
                    p.terminate()
            for p in processes:
                p.join(timeout=grace_s)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failed:
            _raise_first_failure(workdir, processes)
        if timed_out:
            raise TimeoutError(
                f"the {nprocs} processes did not finish within timeout_s={timeout_s} s and were "
                "stopped; give them more time, or look for a rank waiting on a collective the "
                "others never reached"
            )
        return torch.load(workdir / "result.pt", weights_only=False)


def faulty_worker(
    rank: int, world_size: int, master_port: int, bad_rank: int, timeout_s: float = 30.0
) -> float:
    """A worker that goes wrong on purpose, to show what :func:`launch` does with a failure.

    Rank ``bad_rank`` raises ``ValueError`` before the all-reduce; the other
    ranks are already waiting in it and would wait until ``timeout_s`` if the
    launcher did not notice the failure and stop them.
    """
    with process_group(rank, world_size, master_port=master_port, timeout_s=timeout_s) as ctx:
        if ctx.rank == bad_rank:
            raise ValueError(f"rank {ctx.rank} found a bad batch (raised on purpose)")
        value = torch.ones(1, device=ctx.device)
        dist.all_reduce(value)
        return value.item()


# ---------------------------------------------------------------------------
# Hogwild: several processes, one model in shared memory
# ---------------------------------------------------------------------------


def _hogwild_worker(
    rank: int,
    model: nn.Module,
    features: torch.Tensor,
    targets: torch.Tensor,
    nprocs: int,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> None:
    """One Hogwild process: SGD on its own shard, writing straight into the shared parameters."""
    torch.manual_seed(seed + rank)
    shard_x, shard_y = features[rank::nprocs], targets[rank::nprocs]
    # The optimizer holds the shared parameter tensors themselves, so step()
    # updates the memory every process reads from; no copy, no lock.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.MSELoss()
    for _ in range(epochs):
        order = torch.randperm(len(shard_x))
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            optimizer.zero_grad()
            loss_fn(model(shard_x[idx]), shard_y[idx]).backward()
            optimizer.step()


def hogwild_train(
    model: nn.Module,
    features: torch.Tensor,
    targets: torch.Tensor,
    nprocs: int = 2,
    *,
    epochs: int = 1,
    batch_size: int = 32,
    lr: float = 0.05,
    seed: int = 0,
    timeout_s: float = 300.0,
) -> nn.Module:
    """Train a CPU model with ``nprocs`` processes that all update the same shared parameters.

    Regression (MSE loss). The model's tensors are moved into shared memory
    (``model.share_memory()``, which calls
    ``share_memory_()`` on every parameter and buffer), then every process gets a handle to that
    memory, not a copy: when the call returns, ``model`` in the caller holds
    the result of everybody's updates. The updates race (no locks); for sparse
    or small updates that costs little accuracy, which is the point of Hogwild.
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError(
            "hogwild_train shares CPU memory between processes; move the model to the CPU first"
        )
    if len(features) != len(targets):
        raise ValueError(f"{len(features)} feature rows but {len(targets)} targets")
    model.share_memory()
    launch(
        _hogwild_worker,
        nprocs,
        (model, features, targets, nprocs, epochs, batch_size, lr, seed),
        timeout_s=timeout_s,
    )
    return model


# ---------------------------------------------------------------------------
# Several command-line jobs at once (pretend machines on one computer)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CommandResult:
    """How one command of :func:`run_together` ended: its exit status and its output."""

    command: tuple[str, ...]
    returncode: int
    output: str  # stdout and stderr interleaved, as a terminal would show them


def run_together(
    commands: Sequence[Sequence[str]],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> list[CommandResult]:
    """Start every command at the same time, wait for all of them, and return their results.

    For jobs whose parts must run concurrently, such as one ``torchrun`` per
    pretend machine: run one after the other, the first would wait at the
    rendezvous for a second that never starts. Output goes to temporary files,
    not pipes, so a chatty command cannot block on a full pipe while another is
    waited for. When ``timeout_s`` runs out, every command still running is
    killed and ``TimeoutError`` says which; nothing is left running afterwards,
    also not after an interrupt (the notebook's stop button).
    """
    import subprocess  # imported here: only this helper starts command-line programs

    if not commands or any(not command for command in commands):
        raise ValueError("commands must be a non-empty list of non-empty commands")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="d2lgpu-run-") as tmp:
        logs = [open(Path(tmp) / f"{i}.log", "w+", encoding="utf-8") for i in range(len(commands))]
        processes: list[subprocess.Popen] = []
        try:
            for command, log in zip(commands, logs, strict=True):
                processes.append(subprocess.Popen(
                    list(command), env=env, stdout=log, stderr=subprocess.STDOUT, text=True
                ))
            for process in processes:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    running = [" ".join(p.args) for p in processes if p.poll() is None]
                    raise TimeoutError(
                        f"still running after timeout_s={timeout_s} s, and killed: {running}. "
                        "Give them more time, or look for one waiting for a peer that never came"
                    ) from None
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            outputs = []
            for log in logs:
                log.seek(0)
                outputs.append(log.read())
                log.close()
    return [
        CommandResult(tuple(command), process.returncode, output)
        for command, process, output in zip(commands, processes, outputs, strict=True)
    ]
