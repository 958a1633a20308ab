"""torch.distributed made safe to use from a notebook or a laptop.

* :func:`process_group` joins a process group (from torchrun's variables, or the
  arguments :func:`launch` passes), picks the backend, binds the rank to its GPU (with
  NCCL's peer-to-peer decision), and always leaves the group; a rank that never comes or
  never arrives ends in an error that names it, not in a hang.
* :func:`launch` runs ``fn(rank, *args)`` in fresh processes and returns rank 0's
  result; when a rank fails, the caller gets *that* rank's error.
* :func:`run_together` runs several command lines at once (pretend machines).
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from d2lgpu.runtime.checks import check_positive_float, check_positive_int, error_line
from d2lgpu.runtime.gpus import apply_nccl_p2p_decision, num_gpus

__all__ = [
    "DEFAULT_TIMEOUT_S", "CollectiveTimeout", "DistContext", "RemoteTraceback", "RankError",
    "all_reduce_sum", "choose_backend", "end_process", "find_free_port",
    "launch", "mark_progress", "process_group", "exit_status_of", "run_together",
    "CommandResult",
]

#: Seconds a collective waits for the other ranks: long enough for a slow first CUDA
#: call, short enough that a crashed peer is noticed.
DEFAULT_TIMEOUT_S = 300.0

LOOPBACK = "127.0.0.1"


# --- Progress marks: which rank never arrived ---
# When an exception last left a process_group() block in this process (time.time()).
_failed_at: float | None = None
# Where mark_progress() reports: the job's store, and launch()'s work directory.
_progress_store: dist.Store | None = None
_progress_rank: int = 0
_launch_dir: Path | None = None
_progress_count = 0


def mark_progress(label: str) -> None:
    """Note that this rank has reached ``label`` (a step, a collective), so that a timeout
    can name the rank that never arrived. Does nothing outside a group or a launched rank."""
    global _progress_count
    _progress_count += 1
    if _progress_store is not None:
        with suppress(Exception):  # the store is gone (rank 0 ended): only a message is lost
            _progress_store.set(f"label/{_progress_rank}", f"{_progress_count} {label}")
    if _launch_dir is not None:
        tmp = _launch_dir / f"progress-{_progress_rank}.tmp"
        tmp.write_text(f"{_progress_count} {label}")
        os.replace(tmp, _launch_dir / f"progress-{_progress_rank}.txt")


def _parse_progress(text: str | None) -> tuple[int, str]:
    if not text:
        return 0, "nothing yet"
    count, _, label = text.partition(" ")
    return int(count), label


def _laggards(progress: dict[int, tuple[int, str]]) -> list[int]:
    """The ranks that reported fewer steps than the rank furthest ahead."""
    furthest = max((count for count, _ in progress.values()), default=0)
    return [rank for rank, (count, _) in sorted(progress.items()) if count < furthest]


def _progress_lines(progress: dict[int, tuple[int, str]]) -> str:
    return "; ".join(f"rank {rank} at step {count} ({label})"
                     for rank, (count, label) in sorted(progress.items()))


def _plural(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


NCCL_ADVICE = ("On GPUs, run with NCCL_DEBUG=INFO to see what every rank's NCCL does; "
               "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (torchrun's default) ends the waiting ranks "
               "after the timeout (by SIGABRT) instead of letting them wait forever")


class CollectiveTimeout(TimeoutError):
    """A rank waited in a collective longer than the group's timeout; ``laggards`` are the
    ranks that never arrived (empty when unknown)."""

    def __init__(self, message: str, rank: int, laggards: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.laggards = list(laggards)

    def __reduce__(self):  # picklable, so launch can raise it in the caller
        return (type(self), (str(self), self.rank, self.laggards))


def _is_collective_timeout(exc: BaseException) -> bool:
    # gloo: "Timed out waiting 30000ms for recv operation"; NCCL with blocking wait:
    # "Watchdog caught collective operation timeout".
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


def _explain_timeout(
    exc: BaseException, rank: int, world_size: int, timeout_s: float
) -> CollectiveTimeout:
    """The error of a rank that timed out in a collective, naming the ranks that never came."""
    progress: dict[int, tuple[int, str]] = {}
    store = _progress_store
    try:
        for r in range(world_size):
            key = f"label/{r}"
            progress[r] = _parse_progress(store.get(key).decode() if store.check([key]) else None)
    except Exception:
        progress = {}  # the store went away with rank 0
    laggards = _laggards(progress) if progress else []
    if progress and not laggards:
        laggards = _ranks_not_in_the_collective(store, rank, world_size)
    if laggards:
        verb = "never arrived" if _laggards(progress) else "never entered the collective"
        missing = (f"{_plural(laggards)} {verb} ({_progress_lines(progress)}): stuck before it "
                   "(a loop, a deadlock, a slow step), or it skipped a collective the others made")
    elif progress:
        missing = (f"every rank had reached the same step ({_progress_lines(progress)}), so one "
                   "of them is stuck inside a collective or went a different way after it")
    else:
        missing = "which rank did not arrive is unknown (the job's store is gone)"
    return CollectiveTimeout(
        f"rank {rank} of {world_size} timed out in a collective after timeout_s={timeout_s:g} s: "
        f"{missing}. {NCCL_ADVICE}. ({error_line(exc)})",
        rank, laggards,
    )


#: Seconds a rank that timed out waits for its peers to time out too: the ranks in the
#: collective entered it together and time out within about this much of each other.
_TIMEOUT_GATHER_S = 5.0


def _ranks_not_in_the_collective(store: dist.Store | None, rank: int, world_size: int) -> list[int]:
    """The ranks that did not note, within the gather time, that they timed out too.
    (``dist.monitored_barrier`` runs on gloo only, and only rank 0 learns the list.)"""
    try:
        store.set(f"timed_out/{rank}", str(_progress_count))
        deadline = time.monotonic() + _TIMEOUT_GATHER_S
        while True:
            absent = [r for r in range(world_size) if not store.check([f"timed_out/{r}"])]
            if not absent or time.monotonic() > deadline:
                return absent
            time.sleep(0.1)
    except Exception:  # the store went away with rank 0
        return []


def end_process(status: int = 0) -> NoReturn:
    """End a command-line entry point with ``os._exit(status)`` after flushing its output:
    gloo's threads have been seen to abort a process at exit, and an NCCL group torn down
    after a failure waits for peers stuck waiting for this rank."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def exit_status_of(
    main: Callable[[], object], *, brief: tuple[type[Exception], ...] = ()
) -> int:
    """Run an entry point's ``main()``: 0 when it returns, 1 when it raises, with the traceback
    printed (for the ``brief`` exceptions, whose message says it all, only the message); pass
    it to :func:`end_process`, so that a failed rank leaves at once."""
    try:
        main()
    except brief as exc:
        print(f"{main.__module__}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


# --- Process groups ---
@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job (``rank`` across all machines, ``local_rank`` on this
    one) and where it computes."""

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
    """``"nccl"`` when every rank on this machine gets a GPU of its own, else ``"gloo"``,
    which runs on CPUs everywhere (chapter 5)."""
    check_positive_int("local_world_size", local_world_size)
    return "nccl" if num_gpus() >= local_world_size and dist.is_nccl_available() else "gloo"


def find_free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago, for a local job's rendezvous
    (chapter 5)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    except (OSError, TypeError) as exc:  # socket.gaierror for a name that does not resolve
        raise ValueError(
            f"cannot open a port on host {host!r} ({type(exc).__name__}: {exc}): pass an address "
            f"of this machine, such as the default {LOOPBACK!r}"
        ) from None


def _env_int(name: str) -> int:
    raw = os.environ.get(name, "")
    if not raw.isdigit():
        raise RuntimeError(
            f"environment variable {name}={raw!r} is not a rank number: start this program with "
            "torchrun (e.g. `torchrun --nproc_per_node=2 -m d2lgpu.ddp_train`), or pass rank=, "
            "world_size= and master_port= to process_group() explicitly"
        )
    return int(raw)


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:200]


def _this_process() -> str:
    return f"process {os.getpid()} on {socket.gethostname()}"


def _in_thread(target: Callable[[], None], host: str, port: int, wait_s: float) -> bool:
    """Run ``target`` (a TCPStore connection) in a thread for at most ``wait_s``; True when
    it is still blocked then. A TCPStore client that reaches a program speaking another
    protocol waits in native code, deaf to its timeout and to signals: its connection is
    shut down."""
    thread = threading.Thread(target=target, name="d2lgpu-rendezvous", daemon=True)
    thread.start()
    thread.join(wait_s)
    if not thread.is_alive():
        return False
    _shut_down_connections_to(host, port)
    thread.join(1.0)
    if thread.is_alive():
        atexit.register(thread.join, wait_s)
    return True


def _open_store(
    host: str, port: int, rank: int, world_size: int, *, serve: bool, timeout_s: float, fix: str
) -> dist.Store:
    """The job's rendezvous store at ``host:port`` (rank 0 serves it when ``serve``), within
    ``timeout_s``; ``fix`` says what to do about a bad port."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:  # else the client retries until the timeout
        raise ValueError(
            f"rank {rank}: the rendezvous host {host!r} does not resolve ({exc.strerror}): pass "
            "the address of the machine where rank 0 runs (master_addr=, MASTER_ADDR or "
            "torchrun's --rdzv-endpoint), e.g. 127.0.0.1 for one machine"
        ) from None
    outcome: dict[str, Any] = {}

    def connect() -> None:
        try:
            outcome["store"] = dist.TCPStore(
                host, port, world_size, is_master=serve,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,  # _meet waits, and names who is late
                multi_tenant=serve,  # several groups of one process may share the port
            )
        except Exception as exc:
            outcome["error"] = exc

    timed_out = _in_thread(connect, host, port, timeout_s + 2.0)
    if "store" in outcome and not timed_out:
        return outcome["store"]
    where = f"{host}:{port}"
    error = None if timed_out else outcome.get("error")
    reason = f" ({error_line(error)})" if error else ""
    if serve:
        raise RuntimeError(
            f"rank {rank} could not serve the rendezvous at {where}{reason}: another program, an "
            "earlier job or a second process started as rank 0 holds it (give every process its "
            f"own rank, 0 to world_size-1, as launch and torchrun do). {fix}"
        ) from error
    try:
        with socket.create_connection((host, port), timeout=1.0):
            why = "the port accepts connections, but no torch.distributed store answers there"
    except OSError:
        why = "nothing listens there: is rank 0 running, with the same address and port?"
    error_type = TimeoutError if error is None else RuntimeError
    raise error_type(f"rank {rank} could not join the rendezvous at {where} within "
                     f"timeout_s={timeout_s:g} s{reason}: {why}. {fix}") from error


def _shut_down_connections_to(host: str, port: int) -> None:
    """Shut down every TCP connection of this process to ``host:port`` (POSIX only)."""
    fd_dir = next((d for d in ("/proc/self/fd", "/dev/fd") if os.path.isdir(d)), None)
    if fd_dir is None:
        return
    # TCPStore connects over IPv6 where it can: 127.0.0.1 appears as ::ffff:127.0.0.1.
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = {info[4][0].removeprefix("::ffff:") for info in infos}
    for fd in map(int, os.listdir(fd_dir)):
        # Not connected, not an internet socket, or closed meanwhile: not the one.
        with suppress(OSError, TypeError):
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                with socket.socket(fileno=os.dup(fd)) as sock:  # shutdown() acts on the original
                    peer = sock.getpeername()
                    if peer[1] == port and peer[0].removeprefix("::ffff:") in addresses:
                        sock.shutdown(socket.SHUT_RDWR)


def _rendezvous(
    under_torchrun: bool, master_addr: str, master_port: int | None, rank: int, world_size: int,
    timeout_s: float,
) -> dist.Store:
    """The store the ranks meet at: torchrun's, or one rank 0 serves at ``master_addr:port``."""
    if not under_torchrun:
        return _open_store(
            master_addr, master_port, rank, world_size, serve=rank == 0, timeout_s=timeout_s,
            fix="Choose a free port in the parent with d2lgpu.runtime.distributed.find_free_port() "
            "and pass the same one to every rank",
        )
    addr = os.environ.get("MASTER_ADDR")
    if not addr:
        raise RuntimeError("MASTER_ADDR is not set: start this program with torchrun")
    store = _open_store(
        addr, _env_int("MASTER_PORT"), rank, world_size,
        # torchrun's agent serves the store itself when it says so; otherwise rank 0 does.
        serve=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0,
        timeout_s=timeout_s,
        fix="torchrun chose this address (MASTER_ADDR, MASTER_PORT): give it a free port "
        "with --master-port or --rdzv-endpoint, the same on every machine",
    )
    # torchrun keeps one store across --max-restarts: without a prefix per attempt, gloo
    # could read a dead peer's address from the previous attempt's keys.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"d2lgpu/attempt_{attempt}", store)


def _resolve_ranks(
    rank: int | None, world_size: int | None, master_port: int | None, master_addr: str,
    local_rank: int | None, local_world_size: int | None,
) -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from the arguments or torchrun's
    environment, checked."""
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size (spawned processes) or neither (torchrun)")
    if rank is None:
        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        local_rank = _env_int("LOCAL_RANK") if local_rank is None else local_rank
        if local_world_size is None:
            local_world_size = _env_int("LOCAL_WORLD_SIZE")
    elif master_port is None:
        raise ValueError(
            "master_port is required with an explicit rank: choose one in the parent with "
            "d2lgpu.runtime.distributed.find_free_port() and pass the same port to every rank"
        )
    else:
        local_rank = rank if local_rank is None else local_rank
        local_world_size = world_size if local_world_size is None else local_world_size
    numbers = {"rank": rank, "world_size": world_size, "local_rank": local_rank,
               "local_world_size": local_world_size, "master_port": master_port or 1}
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
            raise ValueError(f"{name} must be an int from 0 to 65535, got {value!r}")
    if not isinstance(master_addr, str) or not master_addr:
        raise ValueError(f"master_addr must be a host name or address, got {master_addr!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"need 0 <= local_rank < local_world_size, got {local_rank} and {local_world_size}"
        )
    return rank, world_size, local_rank, local_world_size


def _rank_device(backend: str, local_rank: int) -> torch.device:
    """Where this rank computes: its own GPU with NCCL (made the current one), the CPU with gloo."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo' (or None to choose), got {backend!r}")
    if backend == "gloo":
        return torch.device("cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= gpus:
        raise RuntimeError(
            f"backend 'nccl' needs one GPU per process, but local rank {local_rank} has no "
            f"GPU of its own ({gpus} visible): start fewer processes or use backend='gloo'"
        )
    # Bound before init, so that NCCL and every later CUDA call use this rank's GPU.
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


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
    """Join a process group for the ``with`` block, and always leave it (chapter 5).

    Under torchrun call it without arguments; a process :func:`launch` started passes
    ``rank``, ``world_size`` and ``master_port``. ``backend=None`` lets
    :func:`choose_backend` decide. ``timeout_s`` bounds the rendezvous and every collective.
    """
    global _progress_store, _progress_rank, _progress_count, _failed_at
    under_torchrun = rank is None and world_size is None
    rank, world_size, local_rank, local_world_size = _resolve_ranks(
        rank, world_size, master_port, master_addr, local_rank, local_world_size
    )
    timeout = datetime.timedelta(seconds=check_positive_float("timeout_s", timeout_s))
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a process group; leave it first "
            "(torch.distributed.destroy_process_group()) or reuse it"
        )
    backend = choose_backend(local_world_size) if backend is None else backend
    device = _rank_device(backend, local_rank)
    store = _rendezvous(under_torchrun, master_addr, master_port, rank, world_size, timeout_s)
    progress = dist.PrefixStore("d2lgpu/progress", store)
    _meet(progress, rank, world_size, timeout_s)
    if backend == "nccl":
        _agree_on_nccl_p2p(progress, local_rank)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    failed = False
    _progress_store, _progress_rank, _progress_count = progress, rank, 0
    try:
        yield DistContext(rank, world_size, local_rank, local_world_size, backend, device)
    except BaseException as exc:
        # When, before the teardown makes the peers fail too: launch tells cause from echoes.
        _failed_at = time.time()
        failed = True
        if _is_collective_timeout(exc):
            raise _explain_timeout(exc, rank, world_size, timeout_s) from exc
        raise
    finally:
        _progress_store = None
        # After an error the NCCL peers still wait in a collective for this rank, and an
        # orderly teardown would wait for them until the timeout: leave it to the process's
        # end (launch and torchrun end it).
        if not (failed and backend == "nccl" and world_size > 1):
            dist.destroy_process_group()


def _agree_on_nccl_p2p(store: dist.Store, local_rank: int) -> None:
    """Before NCCL connects the GPUs: local rank 0 makes the NCCL peer-to-peer decision of its
    machine (apply_nccl_p2p_decision; its check starts a process), the machine's other ranks
    take it. A NCCL_P2P_DISABLE set before the job stands."""
    key = f"nccl_p2p/{socket.gethostname()}"
    if local_rank == 0:
        apply_nccl_p2p_decision()
        store.set(key, os.environ.get("NCCL_P2P_DISABLE", ""))
    if value := store.get(key).decode():
        os.environ.setdefault("NCCL_P2P_DISABLE", value)


def _meet(progress: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Wait until every rank has arrived at the rendezvous; two claims of one rank, a
    different world size, or a rank that never comes each end in an error naming it."""
    me = _this_process()
    owner = progress.compare_set(f"claim/{rank}", "", me).decode()
    if owner != me:
        raise ValueError(
            f"two processes claim rank {rank}: {owner} joined as rank {rank} first, then "
            f"{me}. Give every process its own rank, 0 to world_size-1 (launch and torchrun do)"
        )
    progress.set(f"world_size/{rank}", str(world_size))
    keys = [f"world_size/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        arrived = [r for r, key in enumerate(keys) if progress.check([key])]
        other = {r: n for r in arrived if (n := int(progress.get(keys[r]).decode())) != world_size}
        if other:
            them = min(other)
            raise ValueError(
                f"world-size mismatch: rank {them} was started with world_size={other[them]}, "
                f"rank {rank} with world_size={world_size}; give every rank the same world size "
                "(with launch: launch(fn, nprocs, (nprocs, ...)); with torchrun it is --nnodes x "
                "--nproc_per_node)"
            )
        if len(arrived) == world_size:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    missing = [r for r in range(world_size) if r not in arrived]
    raise TimeoutError(
        f"only {len(arrived)} of {world_size} ranks arrived at the rendezvous within "
        f"timeout_s={timeout_s:g} s (arrived: {', '.join(map(str, arrived))}; never came: "
        f"{', '.join(map(str, missing))}). Start as many processes as the world size: "
        "with launch, nprocs must equal the world_size the ranks are given; with torchrun, "
        "every node must start (--nnodes) with --nproc_per_node processes"
    )


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Sum a few numbers (losses, counts) over all ranks, in float64 so counts stay exact."""
    mark_progress("all_reduce_sum")
    totals = torch.tensor([float(v) for v in values], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return totals.tolist()


# --- A launcher for notebooks: one process per rank ---
class RemoteTraceback(Exception):
    """A rank's traceback text: the ``__cause__`` of what launch raises, printed with it."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


class RankError(RuntimeError):
    """A rank failed without an exception to raise here; ``exitcode`` < 0 for a signal."""

    def __init__(self, message: str, rank: int, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


def _where(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame an exception passed through."""
    frame = (traceback.extract_tb(exc.__traceback__) or [None])[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}" if frame else "unknown"


def _run_rank(
    rank: int, fn: Callable[..., Any], args: tuple[Any, ...], workdir: str, threads: int,
    environment: dict[str, str],
) -> None:
    """Run ``fn(rank, *args)`` and leave its outcome in ``workdir``: rank 0's value, an
    exception, or where a ``sys.exit(0)`` happened."""
    global _launch_dir, _progress_rank
    # A forkserver child has the server's environment, from when it started.
    os.environ.clear()
    os.environ.update(environment)
    torch.set_num_threads(threads)
    work = Path(workdir)
    _launch_dir, _progress_rank = work, rank
    try:
        try:
            value = fn(rank, *args)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            (work / f"exit-{rank}.txt").write_text(_where(exc))
            value = None
        if rank == 0:
            try:
                torch.save(value, work / "result.pt.tmp")
            except Exception as exc:
                raise TypeError(
                    f"rank 0 returned a {type(value).__qualname__}, which cannot be pickled "
                    f"({type(exc).__name__}: {exc}) to send it to the caller: return plain data "
                    "(tensors, numbers, strings, and containers of them, a state_dict())"
                ) from exc
            os.replace(work / "result.pt.tmp", work / "result.pt")  # never read half-written
    except BaseException as exc:
        record = {
            "rank": rank, "time": _failed_at or time.time(), "type": type(exc).__name__,
            "message": str(exc), "traceback": traceback.format_exc(), "where": _where(exc),
            "sys_exit": repr(exc.code) if isinstance(exc, SystemExit) else None,
            "exception": None,
        }
        with suppress(Exception):  # some exceptions pickle but cannot be rebuilt
            pickled = pickle.dumps(exc)
            pickle.loads(pickled)
            record["exception"] = pickled
        (work / f"error-{rank}.pkl").write_bytes(pickle.dumps(record))
        end_process(1)  # no teardown can then delay the failure
    end_process(0)


# What usually ends a process with these signals, for the error message.
_LIKELY_CAUSES = {
    "SIGKILL": "running out of memory (the kernel's out-of-memory killer sends SIGKILL) or a "
    "`kill -9` from a user or a job scheduler",
    "SIGSEGV": "a crash in native code (a C++ or CUDA library or extension)",
    "SIGBUS": "a crash in native code, or shared memory (/dev/shm) running full",
    "SIGABRT": "a native library aborting: NCCL's watchdog ends a rank that timed out in a "
    "collective this way (look at the other ranks first), or a failed C++ assertion",
}


def _signal_name(code: int) -> str:
    return signal.Signals(-code).name if -code in signal.valid_signals() else "an unknown signal"


def _how_it_ended(code: int) -> str:
    return f"exited with code {code}" if code >= 0 else (
        f"was killed by signal {_signal_name(code)} ({-code})")


@dataclass(frozen=True)
class _Outcome:
    """How the ranks of a failed job ended, as launch saw them and as they recorded it."""

    exitcodes: list[int | None]
    first_seen: list[int]  # ranks seen failed at the first poll that saw any
    stopped: list[int]  # ranks launch stopped because they were still running
    records: dict[int, dict[str, Any]]  # exception records, by rank
    early_exits: dict[int, str]  # where each rank that called sys.exit(0) did
    progress: dict[int, tuple[int, str]]  # the last mark_progress of each rank

    @classmethod
    def read(
        cls, workdir: Path, exitcodes: list[int | None], first_seen: list[int], stopped: list[int]
    ) -> _Outcome:
        def by_rank(pattern: str) -> dict[int, Path]:
            return {int(p.stem.rsplit("-", 1)[1]): p for p in workdir.glob(pattern)}

        return cls(
            exitcodes, first_seen, stopped,
            {r: pickle.loads(p.read_bytes()) for r, p in by_rank("error-*.pkl").items()},
            {r: p.read_text() for r, p in by_rank("exit-*.txt").items()},
            {r: _parse_progress(p.read_text()) for r, p in by_rank("progress-*.txt").items()},
        )

    def hang_report(self, timeout_s: float) -> str:
        """Which ranks were still running at launch's timeout, and where each one was."""
        nprocs = len(self.exitcodes)
        finished = [r for r, code in enumerate(self.exitcodes) if code == 0]
        parts = [f"still running: {_plural(self.stopped)}"] if self.stopped else []
        if finished:
            parts.append(f"finished: {', '.join(map(str, finished))}")
        if self.progress:
            progress = {r: self.progress.get(r, (0, "nothing yet")) for r in range(nprocs)}
            parts.append(f"last steps: {_progress_lines(progress)}")
        return "\n  ".join([
            f"timed out: the {nprocs} ranks did not finish within timeout_s={timeout_s} s "
            f"and were stopped; {'; '.join(parts)}. Give them more time, or look for a rank "
            "that never reached a collective the others wait in (mark_progress before each "
            "collective shows where each rank was)", *self.early_exit_lines()])

    def early_exit_lines(self) -> list[str]:
        return [f"rank {rank} had already ended with sys.exit(0) ({where}) while the others were "
                "still running: its peers then fail in (or wait in) their next collective"
                for rank, where in sorted(self.early_exits.items())]

    def aftermath(self, cause: int) -> list[str]:
        """One line for each thing that happened to the other ranks."""
        lines = self.early_exit_lines()
        lines += [f"then rank {rank} failed with {record['type']}: "
                  f"{_first_line(record['message'])} (usually because a peer was gone)"
                  for rank, record in sorted(self.records.items()) if rank != cause]
        lines += [f"then rank {rank} {_how_it_ended(code)}"
                  for rank, code in enumerate(self.exitcodes)
                  if code and rank not in (cause, *self.records, *self.stopped)]
        if self.stopped:
            was = "was" if len(self.stopped) == 1 else "were"
            lines.append(f"launch stopped {_plural(self.stopped)}, which {was} still running")
        return lines


def _raise_first_failure(outcome: _Outcome) -> NoReturn:
    """Raise the exception of the rank that failed first, or say how it died."""
    nprocs, codes = len(outcome.exitcodes), outcome.exitcodes
    # The first ranks seen dead without an exception: the others' exceptions are what their
    # deaths did to them. Those NCCL's watchdog aborted (SIGABRT) come last.
    silent = sorted((r for r in outcome.first_seen if r not in outcome.records),
                    key=lambda r: codes[r] == -signal.SIGABRT)
    if silent and outcome.stopped and all(codes[r] == -signal.SIGABRT for r in silent):
        cause = outcome.stopped[0]  # the watchdog ended those that waited for it
        raise RankError(
            f"rank {cause} of {nprocs} never arrived: {_plural(silent)} timed out in a "
            "collective waiting for it, killed by SIGABRT (NCCL's watchdog), while rank "
            f"{cause} was still running (stopped by launch). (Had {_plural(silent)} aborted "
            "on its own, a failed assertion or a CUDA error, its output above shows it.) "
            f"{NCCL_ADVICE}\n  last steps "
            f"reported: {_progress_lines(outcome.progress)}", cause, codes[cause])
    records = outcome.records.values()
    cause = silent[0] if silent else min(records, key=lambda r: r["time"])["rank"]
    aftermath = outcome.aftermath(cause)
    record = outcome.records.get(cause)
    if record is None:
        code = codes[cause]
        likely = ("os._exit() or a native library ending the process" if code >= 0 else
                  _LIKELY_CAUSES.get(_signal_name(code), "a signal sent from outside the process"))
        raise RankError("\n  ".join([
            f"rank {cause} of {nprocs} {_how_it_ended(code)} without raising a Python exception; "
            f"the usual cause is {likely}. Its output above may say more.", *aftermath]),
            cause, code)
    remote = RemoteTraceback(record["traceback"])
    if record["sys_exit"] is not None:
        raise RankError("\n  ".join([
            f"rank {cause} of {nprocs} called sys.exit({record['sys_exit']}) ({record['where']}): "
            "launch takes any status but 0 or None as a failure", *aftermath]), cause) from remote
    notes = [f"raised by rank {cause} of {nprocs} started by d2lgpu.runtime.distributed.launch",
             *aftermath]
    exc = pickle.loads(record["exception"]) if record["exception"] is not None else None
    if isinstance(exc, Exception):
        exc.__notes__ = [*getattr(exc, "__notes__", []), *notes]  # add_note, on 3.10 too
        raise exc from remote
    raise RankError(f"{record['type']}: {record['message']} ({'; '.join(notes)})",
                    cause) from remote


def _rank_start_method(fn: Callable[..., Any]) -> str:
    """*forkserver* where the platform has it (Windows: *spawn*), preloading what every rank
    imports (seconds each); the list is fixed at the first launch."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    preload = ["torch", "torch._dynamo", "d2lgpu.runtime.distributed"]
    module = getattr(fn, "__module__", None)
    if module and module != "__main__" and module not in preload:
        preload.append(module)
    mp.get_context("forkserver").set_forkserver_preload(preload)
    return "forkserver"


def _rank_environment() -> dict[str, str]:
    """The ranks' environment: gloo on the loopback interface (a container's host name may
    resolve to an unreachable address)."""
    environment = dict(os.environ)
    loopback = {"linux": "lo", "darwin": "lo0"}.get(sys.platform)
    if loopback:
        environment.setdefault("GLOO_SOCKET_IFNAME", loopback)
    return environment


def _watch(processes: list, deadline: float | None, grace_s: float) -> tuple[list[int], bool]:
    """Wait for all to succeed, one to fail, or the deadline; return the ranks seen failed
    first and whether the deadline passed."""
    while True:
        codes = [p.exitcode for p in processes]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            return [], True
        time.sleep(0.05)
    # Give the other ranks a moment to record their own errors.
    end = time.monotonic() + grace_s
    while failed and any(p.is_alive() for p in processes) and time.monotonic() < end:
        time.sleep(0.05)
    return failed, False


def _check_launch(
    fn: object, nprocs: object, args: object, timeout_s: object, grace_s: object
) -> None:
    """Refuse what :func:`launch` cannot run, before any process starts."""
    if not callable(fn):
        raise TypeError(f"fn must be a function to run in every rank, got {fn!r}")
    check_positive_int("nprocs", nprocs)
    if timeout_s is not None:
        check_positive_float("timeout_s", timeout_s)
    if grace_s != 0:
        check_positive_float("grace_s", grace_s)
    name = getattr(fn, "__qualname__", fn)
    if getattr(fn, "__module__", None) == "__main__" or "<locals>" in str(name):
        raise ValueError(
            f"{name!r} is defined in __main__ (a notebook or script) or inside another "
            "function, so a spawned process cannot import it: move it into a .py module and "
            "import it from there"
        )
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of fn's arguments after the rank, got {args!r}")


def launch(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *,
           timeout_s: float | None = None, grace_s: float = 5.0) -> Any:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes and return rank 0's result
    (chapter 5). A failure raises the error of the rank that failed *first* (its exception,
    its traceback as ``__cause__``, or a :class:`RankError`); ranks still running ``grace_s``
    after a failure, or at ``timeout_s``, are stopped. ``fn`` must be importable."""
    # torch.distributed.elastic's start_processes stops the other ranks at the first failure,
    # before they record theirs, and cannot rebuild a rank's exception for the notebook.
    _check_launch(fn, nprocs, args, timeout_s, grace_s)
    # An equal share of the cores each, so that the ranks do not fight over them.
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="d2lgpu-launch-") as tmp:
        workdir = Path(tmp)
        processes = mp.start_processes(
            _run_rank, args=(fn, args, tmp, threads, _rank_environment()), nprocs=nprocs,
            join=False, start_method=_rank_start_method(fn),
        ).processes
        failed, timed_out = [], False
        try:  # whatever happens (the stop button too), leave no orphans behind
            failed, timed_out = _watch(processes, deadline, grace_s)
        finally:
            running = [rank for rank, p in enumerate(processes) if p.is_alive()]
            for rank in running:
                processes[rank].terminate()
            for p in processes:
                p.join(timeout=grace_s)
                if p.is_alive():
                    p.kill()
                    p.join()
        exitcodes = [p.exitcode for p in processes]
        stop_codes = {-signal.SIGTERM, -getattr(signal, "SIGKILL", signal.SIGTERM)}
        stopped = [rank for rank in running if exitcodes[rank] in stop_codes]
        outcome = _Outcome.read(workdir, exitcodes, failed, stopped)
        if failed:
            _raise_first_failure(outcome)
        if timed_out:
            raise TimeoutError(outcome.hang_report(timeout_s))
        if not (workdir / "result.pt").exists():
            raise RankError(
                f"rank 0 of {nprocs} ended with status 0 without returning from "
                f"{getattr(fn, '__qualname__', fn)} (os._exit(0), or a native library ending "
                "the process), so there is no value to return", 0, 0,
            )
        return torch.load(workdir / "result.pt", weights_only=False)


# --- Several command-line jobs at once (pretend machines on one computer) ---
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
    """Start every command at once (one torchrun per pretend machine), wait for all, and
    return their results (chapter 5). Output goes to files, so a chatty command cannot block
    on a full pipe; at ``timeout_s`` the commands still running are killed and named."""
    import subprocess

    if isinstance(commands, str) or not commands or any(
        isinstance(c, str) or not c or not all(isinstance(part, str) for part in c)
        for c in commands
    ):
        raise TypeError(f"commands must be a list of non-empty commands (lists of strings), "
                        f"got {commands!r}")
    check_positive_float("timeout_s", timeout_s)
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="d2lgpu-run-") as tmp:
        logs = [open(Path(tmp) / f"{i}.log", "w+", encoding="utf-8") for i in range(len(commands))]
        processes: list[subprocess.Popen] = []
        try:
            for command, log in zip(commands, logs, strict=True):
                processes.append(subprocess.Popen(
                    list(command), env=env, stdout=log, stderr=subprocess.STDOUT, text=True))
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
    return [CommandResult(tuple(command), process.returncode, output)
            for command, process, output in zip(commands, processes, outputs, strict=True)]
