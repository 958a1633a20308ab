"""PyTorch's own distributed engine, made safe to use from a notebook or a laptop.

Three pieces, each small enough to read in one go:

* :func:`process_group` joins a ``torch.distributed`` process group and always
  leaves it. It reads rank and world size from the variables ``torchrun`` sets,
  or takes them as arguments when the :func:`launch` launcher started the
  process. It picks the backend (:func:`choose_backend`: NCCL when every rank
  on this machine has a GPU of its own, gloo otherwise, so a CPU-only machine
  works), binds the rank to its GPU, and sets a timeout so that a dead peer
  ends the job with an error instead of leaving the others waiting forever.
* :func:`launch` starts one process per rank with a start method that is safe
  with CUDA (*forkserver* where the platform has it, *spawn* on Windows), waits
  for them, and returns what rank 0's function returned. When a rank raises,
  it stops the others and raises that rank's exception in the caller, with
  the traceback from the rank attached; when a rank dies without an exception
  (a signal, ``os._exit``), the error names that rank and how it ended, never
  a rank the launcher stopped itself.
  The function it runs must be importable (defined in a module, like the
  workers of this package): the new process finds the function by its module
  and name, and a function defined in a notebook cell has no module it can be
  imported from.
* :func:`run_together` runs several command lines at once (pretend machines on one
  computer) and keeps what each printed.

Chapter 5's demonstrations that run on them (a failing rank, Hogwild training,
DataParallel against DDP counted) are the lesson module ``d2lgpu.ddp_demos``.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import math
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
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from d2lgpu.runtime.checks import (
    check_positive_float,
    check_positive_int,
    positive_int_flag,
    positive_number_flag,
)
from d2lgpu.runtime.gpus import apply_nccl_p2p_decision, num_gpus

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CollectiveTimeout",
    "DistContext",
    "RemoteTraceback",
    "RankError",
    "add_job_flags",
    "all_reduce_sum",
    "choose_backend",
    "end_process",
    "find_free_port",
    "launch",
    "mark_progress",
    "process_group",
    "exit_status_of",
    "run_together",
    "CommandResult",
]

#: Seconds a collective waits for the other ranks before it fails. Long enough
#: for a slow first CUDA call, short enough that a crashed peer is noticed.
DEFAULT_TIMEOUT_S = 300.0


def add_job_flags(
    parser: argparse.ArgumentParser, *, crash_point: str, data: bool = True
) -> None:
    """The flags every torchrun trainer of the course shares: ``--data-root``,
    ``--quick``/``--full``, ``--timeout`` and ``--fail-after-epoch`` (the last rank
    crashes once after ``crash_point``, to try ``torchrun --max-restarts``).
    ``data=False`` leaves out the first three, for a trainer on synthetic data."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"parser must be an argparse.ArgumentParser, got {parser!r}")
    if not isinstance(crash_point, str):
        raise TypeError(f"crash_point must be a str such as 'this epoch', got {crash_point!r}")
    if data:
        parser.add_argument(
            "--data-root", default=None, help="directory holding FashionMNIST/raw"
        )
        mode = parser.add_mutually_exclusive_group()
        mode.add_argument(
            "--quick",
            dest="quick",
            action="store_true",
            default=None,
            help="small balanced data subset (default: follow D2LGPU_QUICK)",
        )
        mode.add_argument(
            "--full", dest="quick", action="store_false", help="the whole data set"
        )
    parser.add_argument(
        "--timeout",
        type=positive_number_flag,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a collective waits for the other ranks (default %(default)s)",
    )
    parser.add_argument(
        "--fail-after-epoch",
        type=positive_int_flag,
        default=None,
        help=f"make the last rank crash once after {crash_point} (to try --max-restarts)",
    )

#: The only address this module ever uses for single-machine jobs.
LOOPBACK = "127.0.0.1"

# When an exception last left a process_group() block in this process (time.time()).
_failed_at: float | None = None

# Where mark_progress() reports: the job's store (inside process_group), and the
# launch() work directory (in a rank that launch started).
_progress_store: dist.Store | None = None
_progress_rank: int = 0
_launch_dir: Path | None = None
_progress_count = 0


def mark_progress(label: str) -> None:
    """Note that this rank has reached ``label`` (a step, a collective), for error messages.

    Inside :func:`process_group` the count and label go to the job's rendezvous store,
    where a rank that times out in a collective reads them to name the rank that never
    arrived; in a rank started by :func:`launch` they also go to a file, so that
    launch's own timeout can say where each rank was. Elsewhere it does nothing.
    ``all_reduce_sum`` calls it; so can any worker, before each collective of its own.
    """
    global _progress_count
    if not isinstance(label, str):
        raise TypeError(f"label must be a str naming the step, got {label!r}")
    _progress_count += 1
    if _progress_store is not None:
        try:
            _progress_store.set(f"label/{_progress_rank}", f"{_progress_count} {label}")
        except Exception:  # the store is gone (rank 0 ended): only a message is lost
            pass
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
    return "; ".join(
        f"rank {rank} at step {count} ({label})"
        for rank, (count, label) in sorted(progress.items())
    )


#: Where to look when a collective times out on GPUs.
NCCL_ADVICE = (
    "On GPUs, run with NCCL_DEBUG=INFO to see what every rank's NCCL does; "
    "TORCH_NCCL_ASYNC_ERROR_HANDLING (torchrun sets 1; 0 turns it off) is what ends the "
    "waiting ranks after the timeout (by SIGABRT) instead of letting them wait forever"
)


class CollectiveTimeout(TimeoutError):
    """A rank waited in a collective longer than the process group's timeout.

    ``laggards`` are the ranks that had reported fewer steps (:func:`mark_progress`)
    than the others: the ones that never arrived. Empty when that is not known.
    """

    def __init__(self, message: str, rank: int, laggards: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.laggards = list(laggards)

    def __reduce__(self):  # picklable, so launch can raise it in the caller
        return (type(self), (str(self), self.rank, self.laggards))


def _is_collective_timeout(exc: BaseException) -> bool:
    # gloo: "Timed out waiting 30000ms for recv operation"; NCCL with blocking wait:
    # "Watchdog caught collective operation timeout".
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _explain_timeout(
    exc: BaseException, rank: int, world_size: int, timeout_s: float
) -> CollectiveTimeout:
    """The error of a rank that timed out in a collective, naming the ranks that never came."""
    progress: dict[int, tuple[int, str]] = {}
    store = _progress_store
    if store is not None:
        try:
            keys = [f"label/{r}" for r in range(world_size)]
            for r, key in enumerate(keys):
                text = store.get(key).decode() if store.check([key]) else None
                progress[r] = _parse_progress(text)
        except Exception:
            progress = {}  # the store went away with rank 0: no progress to show
    laggards = _laggards(progress) if progress else []
    absent = [] if laggards or not progress else _ranks_not_in_the_collective(
        store, rank, world_size
    )
    if absent:
        laggards = absent
        who = ", ".join(map(str, absent))
        missing = (
            f"every rank had reported the same step ({_progress_lines(progress)}), but "
            f"rank{'s' if len(absent) > 1 else ''} {who} never entered the collective: the "
            f"others timed out waiting in it, {'they' if len(absent) > 1 else 'it'} did not "
            "(stuck in its own work since that step: a loop, a deadlock, a slow step, or a "
            "collective the others do not make)"
        )
    elif laggards:
        who = ", ".join(map(str, laggards))
        missing = (
            f"rank{'s' if len(laggards) > 1 else ''} {who} never arrived "
            f"({_progress_lines(progress)}): stuck before it (a loop, a deadlock, a slow "
            "step), or it skipped a collective the others made"
        )
    elif progress:
        missing = (
            f"every rank had reached the same step ({_progress_lines(progress)}), so one of "
            "them is stuck inside a collective or went a different way after it"
        )
    else:
        missing = "which rank did not arrive is unknown (the job's store is gone)"
    return CollectiveTimeout(
        f"rank {rank} of {world_size} timed out in a collective after timeout_s={timeout_s:g} s: "
        f"{missing}. {NCCL_ADVICE}. ({type(exc).__name__}: {_first_line(str(exc))})",
        rank,
        laggards,
    )


#: Seconds a rank that timed out in a collective waits for its peers to time out too:
#: the ranks that entered the collective time out within about this much of each other
#: (they entered it at about the same time); one that never entered does not.
_TIMEOUT_GATHER_S = 5.0


def _ranks_not_in_the_collective(store: dist.Store | None, rank: int, world_size: int) -> list[int]:
    """The ranks that did not time out in the collective this rank timed out in.

    Every rank that waited in the collective times out after the same timeout and notes
    it in the job's store; after a few seconds, a rank without that note never entered
    the collective. Empty when the store is gone or every rank noted it.
    """
    if store is None or world_size < 2:
        return []
    try:
        count = _progress_count
        store.set(f"timed_out/{rank}", str(count))
        deadline = time.monotonic() + _TIMEOUT_GATHER_S
        keys = [f"timed_out/{r}" for r in range(world_size)]
        while True:
            absent = [r for r, key in enumerate(keys) if not store.check([key])]
            if not absent or time.monotonic() > deadline:
                return absent
            time.sleep(0.1)
    except Exception:  # the store went away with rank 0: nothing more to learn
        return []


def end_process(status: int = 0) -> NoReturn:
    """End a command-line entry point (``ddp_train``, ``healthcheck``, ``fsdp_train``) for sure.

    Flushes the output, then leaves with ``os._exit(status)``, skipping the
    interpreter's teardown. After a success, native libraries' destructors (gloo's
    threads) have been seen to abort a finished process at exit ("terminate called
    without an active exception", SIGABRT), turning a finished job into a failed one;
    after a failure, an NCCL group torn down at exit can wait for peers that are stuck
    waiting for this rank. Call it only when everything is written and closed.
    """
    if isinstance(status, bool) or not isinstance(status, int):
        raise TypeError(f"status must be an int exit status, got {status!r}")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def exit_status_of(main: Callable[[], object]) -> int:
    """Run an entry point's ``main()``: 0 when it returns, 1 when it raises.

    The traceback is printed first. Pass the status to :func:`end_process`, so that a
    rank that failed leaves at once: a process group left behind after an error can
    wait at teardown for peers stuck waiting for this rank, and torchrun would notice
    the failure only after the collective timeout.
    """
    try:
        main()
    except Exception:
        traceback.print_exc()
        return 1
    return 0


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
    if gpus == 1 and local_world_size > 1 and dist.is_nccl_available() and _bound_to_one_gpu():
        # Each rank may have been bound to its own GPU from outside (SLURM's
        # --gpus-per-task, a per-rank CUDA_VISIBLE_DEVICES), or all share one GPU:
        # from inside one rank the two look the same, and NCCL refuses the second.
        # Without CUDA_VISIBLE_DEVICES naming one GPU nothing bound the rank, the machine
        # has one GPU, and gloo is simply right: no warning then (it would come from every
        # rank). Where it names one, backend='nccl' works (_rank_device): say so.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        warnings.warn(
            f"this rank sees 1 GPU (CUDA_VISIBLE_DEVICES={visible!r}) "
            f"but its machine runs {local_world_size} ranks, so the group uses gloo on the CPU. "
            "If every rank was given its own GPU (SLURM --gpus-per-task=1, a CUDA_VISIBLE_DEVICES "
            "per rank), pass backend='nccl': each rank then computes on its cuda:0",
            stacklevel=2,
        )
    return "gloo"


def find_free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago, for the rendezvous of a local job.

    The operating system picks it (bind to port 0). Another program could take
    it before the job starts; that is unlikely, and it fails loudly if it happens.
    """
    if not isinstance(host, str) or not host:
        raise TypeError(f"host must be a host name or address (a str), got {host!r}")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    except OSError as exc:  # socket.gaierror for a name that does not resolve
        raise ValueError(
            f"cannot open a port on host {host!r} ({type(exc).__name__}: {exc}): pass an address "
            f"of this machine, such as the default {LOOPBACK!r}"
        ) from None


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


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


#: Seconds the rendezvous may take beyond ``timeout_s`` before it is given up: the
#: store's own timeout fires first when it can, with the more specific error.
_RENDEZVOUS_SLACK_S = 2.0


def _open_store(
    host: str, port: int, rank: int, world_size: int, *, serve: bool, timeout_s: float, fix: str
) -> dist.Store:
    """Open the job's rendezvous store at ``host:port``; rank 0 serves it unless ``serve`` is False.

    Bounded by ``timeout_s``, whatever answers on the port: a TCPStore client
    that reaches a program which accepts the connection but speaks another
    protocol waits inside native code for a reply that never comes, ignoring
    its own timeout and every signal. So the store is opened in a helper
    thread that the caller stops waiting for; the caller gets an error.
    ``fix`` says what to do about a port that does not work.
    """
    _check_resolves(host, port, rank)
    outcome: dict[str, Any] = {}

    def connect() -> None:
        try:
            outcome["store"] = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=serve,
                timeout=datetime.timedelta(seconds=timeout_s),
                # Rank 0 does not wait here for the others: _meet does, and names who is late.
                wait_for_workers=False,
                # Several groups of one process may share the port, as with init_method="tcp://".
                multi_tenant=serve,
            )
            if serve:  # who serves, for a second process that finds the port taken
                outcome["store"].set(_SERVED_BY, _this_process())
        except Exception as exc:  # raised again below, in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=connect, name="d2lgpu-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s + _RENDEZVOUS_SLACK_S)
    timed_out = thread.is_alive()
    if timed_out:
        _abandon(thread, host, port, timeout_s)
    where = f"{host}:{port}"
    if "store" in outcome and not timed_out:
        return outcome["store"]
    # After a timeout, the thread's own error (if any by now) is the one _abandon caused.
    error = None if timed_out else outcome.get("error")
    reason = f" ({type(error).__name__}: {_first_line(str(error))})" if error else ""
    if serve and error is not None and _address_in_use(error):
        holder = _rendezvous_holder(host, port)
        if holder is not None:
            raise RuntimeError(
                f"two processes claim rank 0 of the rendezvous at {where}: {holder} already "
                f"serves it as rank 0, and this process ({_this_process()}) was started as rank "
                f"0 too. Give every process its own rank, 0 to world_size-1 (launch and torchrun "
                f"do); or, if {holder} is an earlier job that still runs, end it or choose "
                f"another port. {fix}"
            ) from error
    if serve and error is not None:
        raise RuntimeError(
            f"rank {rank} could not serve the rendezvous at {where}{reason}; if the port is in "
            "use, another program or an earlier job still holds it; otherwise the other ranks "
            f"did not all join within timeout_s={timeout_s:g} s. {fix}"
        ) from error
    if serve:
        raise TimeoutError(
            f"rank {rank} serves the rendezvous at {where}, but the other ranks did not all join "
            f"within timeout_s={timeout_s:g} s: did every rank start, with the same port? {fix}"
        )
    if _accepts_connections(host, port):
        why = (
            "the port accepts connections, but no torch.distributed store answers there "
            "(another program may be listening on it)"
        )
    else:
        why = "nothing listens there: is rank 0 running, with the same address and port?"
    message = (
        f"rank {rank} could not join the rendezvous at {where} within timeout_s={timeout_s:g} s"
        f"{reason}: {why}. {fix}"
    )
    if error is None:
        raise TimeoutError(message)
    raise RuntimeError(message) from error


#: The store key where rank 0 writes who serves the rendezvous (host and process id).
_SERVED_BY = "d2lgpu/served_by"


def _this_process() -> str:
    return f"process {os.getpid()} on {socket.gethostname()}"


def _check_resolves(host: str, port: int, rank: int) -> None:
    """Refuse a rendezvous host whose name does not resolve, before waiting on it.

    Otherwise the client retries the connection until the timeout and reports a
    connect timeout, which reads as a rank 0 that never started.
    """
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(
            f"rank {rank}: the rendezvous host {host!r} does not resolve ({exc.strerror or exc}): "
            "pass the host name or IP address of the machine where rank 0 runs (master_addr=, "
            "MASTER_ADDR, or torchrun's --master-addr / --rdzv-endpoint), e.g. 127.0.0.1 for "
            "one machine"
        ) from None


def _address_in_use(error: BaseException) -> bool:
    text = str(error).lower()
    return "eaddrinuse" in text or "address already in use" in text


def _rendezvous_holder(host: str, port: int) -> str | None:
    """Who serves a d2lgpu rendezvous at ``host:port`` (its rank 0), or None when nothing
    there is one: another program holds the port, or nothing answers in a second or two."""
    found: dict[str, str] = {}

    def ask() -> None:
        try:
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=2))
            # The server writes its name just after it starts listening: on a busy machine
            # this process can ask in between, so wait for the name rather than check once.
            store.wait([_SERVED_BY], datetime.timedelta(seconds=2))
            found["holder"] = store.get(_SERVED_BY).decode()
        except Exception:  # no store there, or no name within the wait: not a d2lgpu rank 0
            pass

    thread = threading.Thread(target=ask, name="d2lgpu-rendezvous-probe", daemon=True)
    thread.start()
    thread.join(5.0)
    if thread.is_alive():
        _abandon(thread, host, port, 4.0)
    return found.get("holder")


def _abandon(thread: threading.Thread, host: str, port: int, timeout_s: float) -> None:
    """Let a rendezvous thread that is still blocked end without harm.

    Left alone, it could wake up (its peer closes the connection, or its retries
    run out) while the interpreter shuts down, and a native exception raised
    then aborts the process. So its connection is shut down now, which makes it
    fail at once, and the interpreter waits for it at exit for at most ``timeout_s``.
    """
    _shut_down_connections_to(host, port)
    thread.join(1.0)
    if thread.is_alive():
        atexit.register(thread.join, timeout_s)


def _shut_down_connections_to(host: str, port: int) -> None:
    """Shut down every TCP connection of this process to ``host:port`` (POSIX; no-op elsewhere)."""
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        fds = [int(name) for name in os.listdir(fd_dir)]
    except OSError:
        return
    addresses = {_plain_ip(info[4][0]) for info in infos}
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            copy = os.dup(fd)
        except OSError:
            continue  # closed meanwhile
        # A duplicate of the descriptor: shutdown() acts on the connection both share.
        try:
            sock = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            continue
        with sock:
            try:
                peer = sock.getpeername()
                if peer[1] == port and _plain_ip(peer[0]) in addresses:
                    sock.shutdown(socket.SHUT_RDWR)
            except (OSError, TypeError):
                pass  # not connected, or not an internet socket


def _plain_ip(address: str) -> str:
    # TCPStore connects over IPv6 where it can: 127.0.0.1 appears as ::ffff:127.0.0.1.
    return address.removeprefix("::ffff:")


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _torchrun_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
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
    store = _open_store(
        addr,
        port,
        rank,
        world_size,
        serve=not agent_serves and rank == 0,
        timeout_s=timeout_s,
        fix="torchrun chose this address (MASTER_ADDR, MASTER_PORT): give it a free port "
        "with --master-port or --rdzv-endpoint, the same on every machine",
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"d2lgpu/attempt_{attempt}", store)


def _check_int(name: str, value: object) -> int:
    # The same wording as d2lgpu.runtime.checks; bool is refused although it is an int.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _resolve_ranks(
    rank: int | None,
    world_size: int | None,
    master_port: int | None,
    master_addr: str,
    local_rank: int | None,
    local_world_size: int | None,
) -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size), from the arguments or torchrun's
    environment, checked; the arguments are :func:`process_group`'s."""
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size (spawned processes) or neither (torchrun)")
    if rank is None:
        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        local_rank = _env_int("LOCAL_RANK") if local_rank is None else local_rank
        if local_world_size is None:
            local_world_size = _env_int("LOCAL_WORLD_SIZE")
    else:
        _check_int("rank", rank)
        _check_int("world_size", world_size)
        if master_port is None:
            raise ValueError(
                "master_port is required with an explicit rank: choose one in the parent with "
                "d2lgpu.runtime.distributed.find_free_port() and pass the same port to every rank"
            )
        if _check_int("master_port", master_port) not in range(1, 65536):
            raise ValueError(f"master_port must be in 1..65535, got {master_port}")
        if not isinstance(master_addr, str) or not master_addr:
            raise ValueError(f"master_addr must be a host name or address, got {master_addr!r}")
        local_rank = rank if local_rank is None else local_rank
        local_world_size = world_size if local_world_size is None else local_world_size
    assert world_size is not None and local_world_size is not None  # for the type checker
    _check_int("local_rank", local_rank)
    _check_int("local_world_size", local_world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"need 0 <= local_rank < local_world_size, got {local_rank} and {local_world_size}"
        )
    return rank, world_size, local_rank, local_world_size


def _as_timeout(timeout_s: float) -> datetime.timedelta:
    """``timeout_s`` as the timedelta torch.distributed takes, refusing what is not one."""
    check_positive_float("timeout_s", timeout_s)
    try:
        return datetime.timedelta(seconds=timeout_s)
    except OverflowError:
        raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}") from None


def _bound_to_one_gpu() -> bool:
    """True when CUDA_VISIBLE_DEVICES names exactly one GPU (a rank bound from outside)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()]) == 1


def _rank_device(backend: str, local_rank: int) -> torch.device:
    """Where this rank computes: its own GPU with NCCL (made the current one), the CPU with gloo."""
    if not isinstance(backend, str) or backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo' (or None to choose), got {backend!r}")
    if backend == "gloo":
        return torch.device("cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 1 and local_rank >= 1 and _bound_to_one_gpu():
        # Bound from outside: this rank's one visible GPU is its own (see choose_backend).
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    if local_rank >= gpus:
        raise RuntimeError(
            f"backend 'nccl' needs one GPU per process, but local rank {local_rank} has no "
            f"GPU of its own ({gpus} visible): start fewer processes or use backend='gloo'"
        )
    device = torch.device("cuda", local_rank)
    # Bind before init so NCCL and every later CUDA call use this rank's GPU,
    # not GPU 0 for everyone.
    torch.cuda.set_device(device)
    return device


def _rendezvous(
    under_torchrun: bool,
    master_addr: str,
    master_port: int | None,
    rank: int,
    world_size: int,
    timeout_s: float,
) -> dist.Store:
    """The store the ranks meet at: torchrun's, or one rank 0 serves at ``master_addr:port``."""
    if under_torchrun:
        return _torchrun_store(rank, world_size, timeout_s)
    assert master_port is not None  # _resolve_ranks refused None with an explicit rank
    return _open_store(
        master_addr,
        master_port,
        rank,
        world_size,
        serve=rank == 0,
        timeout_s=timeout_s,
        fix="Choose a free port in the parent with d2lgpu.runtime.distributed.find_free_port() and "
        "pass the same one to every rank",
    )


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

    ``backend=None`` lets :func:`choose_backend` decide. ``timeout_s`` bounds the
    rendezvous (joining the group; a port held by another program ends in an
    error that names it) and how long any collective waits for the other ranks.
    After an error in a multi-rank NCCL group the group is not torn down here
    (that would wait for the stuck peers): end the process, as :func:`launch`
    and torchrun do.
    """
    under_torchrun = rank is None and world_size is None
    rank, world_size, local_rank, local_world_size = _resolve_ranks(
        rank, world_size, master_port, master_addr, local_rank, local_world_size
    )
    timeout = _as_timeout(timeout_s)
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a process group; leave it first "
            "(torch.distributed.destroy_process_group()) or reuse it"
        )
    backend = choose_backend(local_world_size) if backend is None else backend
    device = _rank_device(backend, local_rank)
    store = _rendezvous(under_torchrun, master_addr, master_port, rank, world_size, timeout_s)
    global _progress_store, _progress_rank, _progress_count
    progress = dist.PrefixStore("d2lgpu/progress", store)
    _meet(progress, rank, world_size, timeout_s)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        # Tells NCCL the device up front (no guessing in barrier()).
        device_id=device if backend == "nccl" else None,
    )
    global _failed_at
    failed = False
    _progress_store, _progress_rank, _progress_count = progress, rank, 0
    if _launch_dir is not None:  # for launch: how long this rank waits in a collective
        (_launch_dir / f"group-timeout-{rank}.txt").write_text(repr(float(timeout_s)))
    try:
        yield DistContext(rank, world_size, local_rank, local_world_size, backend, device)
    except BaseException as exc:
        # Remember when the error happened, before the teardown below makes the
        # peers fail too: launch() uses it to tell the cause from its echoes.
        _failed_at = time.time()
        failed = True
        if _is_collective_timeout(exc):
            raise _explain_timeout(exc, rank, world_size, timeout_s) from exc
        raise
    finally:
        _progress_store = None
        # NCCL's orderly teardown flushes and destroys the communicator together
        # with the other ranks. After an error here they are still waiting in a
        # collective for this rank, so it would wait for them until the timeout
        # and the error would surface minutes late. Let the error propagate
        # instead; the process is about to end (launch() and torchrun end it),
        # and its end releases the GPU and the communicator.
        if not (failed and backend == "nccl" and world_size > 1):
            dist.destroy_process_group()


def _meet(progress: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Wait until every rank of the job has arrived at the rendezvous, naming what is wrong.

    Each rank claims its rank number, writes its world size and waits for the others'.
    Two processes with one rank number, a rank given another world size than rank 0, or
    fewer ranks started than the world size (a missing rank) each end in an error that
    says so, instead of the backend's raw timeout, which names nothing.
    """
    me = _this_process()
    owner = progress.compare_set(f"claim/{rank}", "", me).decode()
    if owner != me:
        progress.set(f"claim/{rank}/again", me)  # for the error of the rank waiting for others
        raise ValueError(
            f"two processes claim rank {rank}: {owner} joined as rank {rank} first, then "
            f"{me}. Give every process its own rank, 0 to world_size-1 (launch and torchrun do)"
        )
    progress.set(f"world_size/{rank}", str(world_size))
    keys = [f"world_size/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        arrived = [r for r, key in enumerate(keys) if progress.check([key])]
        sizes = {r: int(progress.get(keys[r]).decode()) for r in arrived}
        other = {r: n for r, n in sizes.items() if n != world_size}
        if other:
            them = min(other)  # rank 0 when it is among them
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
    doubled = [r for r in range(world_size) if progress.check([f"claim/{r}/again"])]
    extra = (f"; a second process also claimed rank{'s' if len(doubled) > 1 else ''} "
             f"{', '.join(map(str, doubled))}" if doubled else "")
    raise TimeoutError(
        f"only {len(arrived)} of {world_size} ranks arrived at the rendezvous within "
        f"timeout_s={timeout_s:g} s (arrived: {', '.join(map(str, arrived))}; never came: "
        f"{', '.join(map(str, missing))}{extra}). Start as many processes as the world size: "
        "with launch, nprocs must equal the world_size the ranks are given; with torchrun, "
        "every node must start (--nnodes) with --nproc_per_node processes"
    )


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Sum a few numbers (losses, counts) over all ranks; every rank gets the totals.

    In float64 so that counts stay exact and sums of many losses lose nothing.
    """
    if not isinstance(ctx, DistContext):
        raise TypeError(
            f"ctx must be the DistContext that process_group() yields, got {type(ctx).__name__}"
        )
    try:
        numbers = [float(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(f"values must be a sequence of numbers, got {values!r}") from None
    mark_progress("all_reduce_sum")
    totals = torch.tensor(numbers, dtype=torch.float64, device=ctx.device)
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
    """A rank failed and its own exception cannot be raised here: it died without one, or called
    ``sys.exit`` with a failure status, or its exception could not be rebuilt.

    ``rank`` is the rank that failed first. ``exitcode`` is its exit status when
    it ended without a Python exception (negative: killed by that signal), else None.
    """

    def __init__(self, message: str, rank: int, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


def _loopback_interface() -> str | None:
    # gloo finds its network interface through the host name, which on some
    # containers resolves to an address that is not reachable. A one-machine
    # job only needs the loopback interface.
    return {"linux": "lo", "darwin": "lo0"}.get(sys.platform)


def _where(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame an exception passed through."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "unknown place"
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


def _type_name(value: object) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _run_rank(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    workdir: str,
    nprocs: int,
    threads: int,
    environment: dict[str, str],
) -> None:
    """What every spawned process runs: ``fn(rank, *args)``, recording the outcome in ``workdir``.

    Rank 0's return value goes to ``result.pt``; an exception of any rank goes
    to ``error-<rank>.pkl`` with the time it happened, so that the parent can
    tell the first failure (the cause) from the ranks that failed because a
    peer was gone. ``sys.exit(0)`` ends the rank successfully and leaves a note
    in ``exit-<rank>.txt``, in case its peers then fail waiting for it.
    """
    # A rank forked from the forkserver has the server's environment, from when the
    # server started; the caller's may have changed since (CUDA_VISIBLE_DEVICES, say).
    # The server never touched CUDA, so CUDA reads the variables set here.
    global _launch_dir, _progress_rank
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
                raise  # a failure status: recorded below like an exception
            (work / f"exit-{rank}.txt").write_text(_where(exc))
            value = None
        if rank == 0:
            _save_result(value, work)
    except BaseException as exc:
        _record_error(rank, exc, work)
        # The parent rebuilds the error from the record. Exit at once, like a
        # finished rank below, so that no teardown (an NCCL communicator whose
        # peers are stuck waiting for this rank) can delay the failure.
        end_process(1)
    # The rank's work is done and recorded. Leave now rather than through the
    # interpreter's normal shutdown: native libraries' destructors (gloo's
    # threads among them) have been seen to abort a finished process there,
    # which would turn a successful job into a failed one.
    end_process(0)


def _save_result(value: Any, workdir: Path) -> None:
    """Pickle rank 0's return value for the parent; say what is wrong if it cannot be pickled."""
    tmp = workdir / "result.pt.tmp"
    try:
        torch.save(value, tmp)
    except Exception as exc:
        raise TypeError(
            f"rank 0 returned a {_type_name(value)}, which cannot be pickled "
            f"({type(exc).__name__}: {exc}); launch pickles rank 0's return value to send it to "
            "the caller, so return plain data: tensors, numbers, strings, and lists, tuples, "
            "dicts or dataclasses of them (a model's state_dict() rather than an object that "
            "holds functions, locks or open files)"
        ) from exc
    # Write then rename: the parent never reads a half-written file.
    os.replace(tmp, workdir / "result.pt")


def _record_error(rank: int, exc: BaseException, workdir: Path) -> None:
    record: dict[str, Any] = {
        "rank": rank,
        # Inside a process group, the moment the error left it; otherwise now.
        "time": _failed_at if _failed_at is not None else time.time(),
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": traceback.format_exc(),
        "where": _where(exc),
        "sys_exit": repr(exc.code) if isinstance(exc, SystemExit) else None,
        "exception": None,
    }
    try:
        record["exception"] = pickle.dumps(exc)
        pickle.loads(record["exception"])  # some exceptions pickle but cannot be rebuilt
    except Exception:
        record["exception"] = None
    with open(workdir / f"error-{rank}.pkl", "wb") as fh:
        pickle.dump(record, fh)


# What usually ends a process with these signals, for the error message.
_LIKELY_CAUSES = {
    "SIGKILL": "running out of memory (the kernel's out-of-memory killer sends SIGKILL) or a "
    "`kill -9` from a user or a job scheduler",
    "SIGSEGV": "a crash in native code (a C++ or CUDA library or extension)",
    "SIGBUS": "a crash in native code, or shared memory (/dev/shm) running full",
    "SIGABRT": "a native library aborting: NCCL's watchdog ends a rank that timed out in a "
    "collective this way (a peer never arrived: look at the other ranks first, and run with "
    "NCCL_DEBUG=INFO), or a failed assertion or uncaught C++ exception",
}


def _how_it_ended(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by signal {name} ({-code})"


def _likely_cause(code: int) -> str:
    if code >= 0:
        return "os._exit() or a native library ending the process"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = ""
    return _LIKELY_CAUSES.get(name, "a signal sent from outside the process")


@dataclass(frozen=True)
class _Outcome:
    """How the ranks of a failed job ended, as the parent saw them and as they recorded it."""

    exitcodes: list[int | None]
    #: Ranks seen failed at the first poll that saw any failure.
    first_seen: list[int]
    #: Ranks launch itself stopped because they were still running.
    stopped: list[int]
    #: Exception records by rank (ranks that raised).
    records: dict[int, dict[str, Any]]
    #: Where each rank that called sys.exit(0) did so, by rank.
    early_exits: dict[int, str]
    #: The last step each rank reported with mark_progress: (count, label), by rank.
    progress: dict[int, tuple[int, str]]
    #: When each rank last reported progress (time.time()), by rank.
    progress_times: dict[int, float] = field(default_factory=dict)
    #: The process-group timeout each rank waited in its collectives with, by rank.
    group_timeouts: dict[int, float] = field(default_factory=dict)
    #: When launch first saw a rank dead (time.time()).
    seen_dead_at: float | None = None

    @classmethod
    def read(
        cls, workdir: Path, exitcodes: list[int | None], first_seen: list[int], stopped: list[int],
        seen_dead_at: float | None = None,
    ) -> _Outcome:
        records = {}
        for path in workdir.glob("error-*.pkl"):
            with open(path, "rb") as fh:
                record = pickle.load(fh)
            records[record["rank"]] = record
        early = {
            int(path.stem.split("-")[1]): path.read_text() for path in workdir.glob("exit-*.txt")
        }
        progress, times = {}, {}
        for path in workdir.glob("progress-*.txt"):
            rank = int(path.stem.split("-")[1])
            progress[rank] = _parse_progress(path.read_text())
            times[rank] = path.stat().st_mtime  # written at each mark, replaced atomically
        timeouts = {
            int(path.stem.rsplit("-", 1)[1]): float(path.read_text())
            for path in workdir.glob("group-timeout-*.txt")
        }
        return cls(exitcodes, first_seen, stopped, records, early, progress, times, timeouts,
                   seen_dead_at)

    def hang_summary(self) -> str:
        """Which ranks were still running at launch's timeout, and where each one was."""
        running = self.stopped
        finished = [r for r, code in enumerate(self.exitcodes) if code == 0 and r not in running]
        parts = []
        if running:
            parts.append(f"still running: rank{'s' if len(running) > 1 else ''} "
                         f"{', '.join(map(str, running))}")
        if finished:
            parts.append(f"finished: {', '.join(map(str, finished))}")
        if self.progress:
            progress = {r: self.progress.get(r, (0, "nothing yet"))
                        for r in range(len(self.exitcodes))}
            laggards = _laggards(progress)
            if laggards:
                parts.append(
                    f"rank{'s' if len(laggards) > 1 else ''} {', '.join(map(str, laggards))} "
                    f"never arrived where the others were ({_progress_lines(progress)})"
                )
            else:
                parts.append(f"all at the same step ({_progress_lines(progress)})")
        else:
            parts.append(
                "no rank reported its progress (call d2lgpu.runtime.distributed.mark_progress "
                "before each collective to see where each rank was)"
            )
        return "; ".join(parts) + ". Give them more time, or look for a rank that never reached "\
            "a collective the others wait in"

    def aborted_waiting_for_a_peer(self, rank: int) -> bool:
        """True when ``rank`` looks killed by NCCL's watchdog after waiting for a peer.

        The watchdog ends a rank with SIGABRT once it has waited a whole process-group
        timeout in a collective. So a SIGABRT counts as such a victim only when it came at
        least that timeout after the rank's last progress report: sooner, the rank
        aborted of its own (a sticky CUDA error, a failed assertion, its own watchdog on
        a collective it alone got wrong) and is a culprit like any crash. Without the
        times (no progress reported) every SIGABRT is taken for a victim.
        """
        if self.exitcodes[rank] != -getattr(signal, "SIGABRT", 6):
            return False
        last, timeout = self.progress_times.get(rank), self.group_timeouts.get(rank)
        if last is None or timeout is None or self.seen_dead_at is None:
            return True
        # 0.9: the poll and the file times are a little apart; a victim waited the whole timeout.
        return self.seen_dead_at - last >= 0.9 * timeout

    def aborted_waiting(self) -> bool:
        """True when every rank seen dead first was killed by the watchdog while others ran.

        The dead ranks are then the ones that waited, and the culprit is a rank that never
        arrived, one that launch found still running (or that crashed later, quietly).
        """
        silent = [r for r in self.first_seen if r not in self.records]
        return (
            bool(silent)
            and all(self.aborted_waiting_for_a_peer(r) for r in silent)
            and bool(self.stopped)
        )

    def cause(self) -> int:
        """The rank that failed first.

        A rank that died without an exception (a signal, ``os._exit``) and was
        among the first seen dead is the cause: the exceptions of the others
        ("connection closed by peer") are what its death did to them. Otherwise
        the rank whose exception came first, by the time it recorded.
        """
        silent = [r for r in self.first_seen if r not in self.records]
        if self.aborted_waiting():
            return self.stopped[0]  # the one that never arrived
        # A rank the watchdog ended after waiting is a victim; of the others, the one whose
        # progress stopped first is the likelier first failure.
        silent.sort(key=lambda r: (self.aborted_waiting_for_a_peer(r),
                                   self.progress_times.get(r, math.inf)))
        if silent:
            return silent[0]
        return min(self.records.values(), key=lambda record: record["time"])["rank"]

    def early_exit_lines(self) -> list[str]:
        return [
            f"rank {rank} had already ended with sys.exit(0) ({where}) while the others were "
            "still running: a rank that leaves early makes its peers fail in their next "
            "collective (or wait in it until the timeout)"
            for rank, where in sorted(self.early_exits.items())
        ]

    def aftermath(self, cause: int) -> list[str]:
        """One line for each thing that happened to the other ranks."""
        lines = self.early_exit_lines()
        for rank, record in sorted(self.records.items()):
            if rank != cause:
                lines.append(
                    f"then rank {rank} failed with {record['type']}: "
                    f"{_first_line(record['message'])} (usually because a peer was gone)"
                )
        for rank, code in enumerate(self.exitcodes):
            if code and rank != cause and rank not in self.records and rank not in self.stopped:
                lines.append(f"then rank {rank} {_how_it_ended(code)}")
        if len(self.stopped) == 1:
            lines.append(f"launch stopped rank {self.stopped[0]}, which was still running")
        elif self.stopped:
            ranks = ", ".join(map(str, self.stopped))
            lines.append(f"launch stopped ranks {ranks}, which were still running")
        return lines


def _raise_first_failure(outcome: _Outcome) -> NoReturn:
    """Raise the exception of the rank that failed first (the cause), or say how it died."""
    nprocs = len(outcome.exitcodes)
    cause = outcome.cause()
    aftermath = outcome.aftermath(cause)
    record = outcome.records.get(cause)
    if outcome.aborted_waiting():
        waiting = [r for r in outcome.first_seen if r not in outcome.records]
        who = ", ".join(map(str, waiting))
        lines = [
            f"rank {cause} of {nprocs} never arrived: rank{'s' if len(waiting) > 1 else ''} "
            f"{who} timed out in a collective waiting for it and "
            f"{'were' if len(waiting) > 1 else 'was'} "
            "killed by SIGABRT, which is how NCCL's watchdog ends a rank after a collective "
            f"timeout, while rank {cause} was still running (stopped by launch). {NCCL_ADVICE}",
        ]
        if outcome.progress:
            lines.append(f"last steps reported: {_progress_lines(outcome.progress)}")
        raise RankError("\n  ".join(lines), cause, outcome.exitcodes[cause])
    if record is None:
        code = outcome.exitcodes[cause]
        assert code is not None  # it was seen failed
        raise RankError(
            "\n  ".join(
                [
                    f"rank {cause} of {nprocs} {_how_it_ended(code)} without raising a Python "
                    f"exception; the usual cause is {_likely_cause(code)}. Its output above "
                    "may say more.",
                    *aftermath,
                ]
            ),
            cause,
            code,
        )
    remote = RemoteTraceback(record["traceback"])
    if record["sys_exit"] is not None:
        raise RankError(
            "\n  ".join(
                [
                    f"rank {cause} of {nprocs} called sys.exit({record['sys_exit']}) "
                    f"({record['where']}): launch takes any status but 0 or None as a failure",
                    *aftermath,
                ]
            ),
            cause,
        ) from remote
    notes = [f"raised by rank {cause} of {nprocs} started by d2lgpu.runtime.distributed.launch",
             *aftermath]
    exc = pickle.loads(record["exception"]) if record["exception"] is not None else None
    if isinstance(exc, Exception):
        if hasattr(exc, "add_note"):
            for note in notes:
                exc.add_note(note)
        else:  # Python 3.10: the notes are kept (not printed) where 3.11 keeps them
            exc.__notes__ = [*getattr(exc, "__notes__", []), *notes]
        raise exc from remote
    summary = "; ".join(notes)
    raise RankError(f"{record['type']}: {record['message']} ({summary})", cause) from remote


def _check_times(timeout_s: float | None, grace_s: float, poll_s: float) -> None:
    if timeout_s is not None:
        try:
            check_positive_float("timeout_s", timeout_s)
        except ValueError:
            raise ValueError(
                f"timeout_s must be a positive finite number of seconds, or None for no limit, "
                f"got {timeout_s!r}"
            ) from None
    if isinstance(grace_s, bool) or not isinstance(grace_s, Real) or not math.isfinite(grace_s):
        raise ValueError(f"grace_s must be a finite number of seconds >= 0, got {grace_s!r}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be a finite number of seconds >= 0, got {grace_s!r}")
    check_positive_float("poll_s", poll_s)


def _rank_start_method(fn: Callable[..., Any]) -> str:
    """How :func:`launch` starts ranks: *forkserver* where the platform has it, else *spawn*.

    Both are safe with CUDA: neither copies a process that has used it. spawn starts
    a fresh interpreter per rank, which imports torch again (seconds each); the
    forkserver imports once, in a server process that never touches CUDA, and forks
    every later rank from it, ready in a fraction of a second. What it imports: torch;
    ``torch._dynamo``, which the first optimizer of a process imports (an optimizer's
    ``add_param_group`` is wrapped by ``torch._disable_dynamo``: about 5 s of CPU, in
    every rank without this); and the module of the first launched function.
    The server starts at the first launch and keeps that list for the whole process.
    """
    if "forkserver" not in mp.get_all_start_methods():  # Windows
        return "spawn"
    preload = ["torch", "torch._dynamo", "d2lgpu.runtime.distributed"]
    module = getattr(fn, "__module__", None)
    if module and module != "__main__" and module not in preload:
        preload.append(module)
    mp.get_context("forkserver").set_forkserver_preload(preload)
    return "forkserver"


def _check_launch(
    fn: object, nprocs: object, args: object, timeout_s: float | None, grace_s: float,
    poll_s: float,
) -> None:
    """Refuse what :func:`launch` cannot run, before any process starts."""
    if not callable(fn):
        raise TypeError(f"fn must be a function to run in every rank, got {fn!r}")
    check_positive_int("nprocs", nprocs)
    _check_times(timeout_s, grace_s, poll_s)
    if getattr(fn, "__module__", None) == "__main__" or "<locals>" in getattr(
        fn, "__qualname__", ""
    ):
        raise ValueError(
            f"{getattr(fn, '__qualname__', fn)!r} is defined in __main__ (a notebook or script) "
            "or inside another function, so a spawned process cannot import it: move it into a "
            ".py module and import it from there"
        )
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of fn's arguments after the rank, got {args!r}")


def _rank_environment() -> dict[str, str]:
    """The ranks' environment: this process's, plus the loopback interface for gloo and
    the NCCL peer-to-peer decision of :func:`d2lgpu.runtime.gpus.apply_nccl_p2p_decision`.

    Set for the ranks only, not in this process, whose later children inherit it.
    """
    environment = dict(os.environ)
    if "GLOO_SOCKET_IFNAME" not in environment and _loopback_interface():
        environment["GLOO_SOCKET_IFNAME"] = _loopback_interface() or ""
    # NCCL_P2P_DISABLE=1 where peer copies between the GPUs are broken (Kaggle's T4s);
    # a value the user set stays. A no-op with fewer than two GPUs.
    apply_nccl_p2p_decision(environment)
    return environment


def _watch(
    processes: list, deadline: float | None, grace_s: float, poll_s: float
) -> tuple[list[int], bool, float | None]:
    """Wait until every rank succeeded, one failed, or the deadline passed.

    Returns the ranks seen failed at the first poll that saw any (empty when
    none failed), whether the deadline passed, and when (time.time()) the first
    failure was seen.
    """
    first_seen: list[int] = []
    while True:
        codes = [p.exitcode for p in processes]
        # A dead process's status is there at once, so the ranks seen failed
        # at the first poll that sees any include the one that failed first.
        first_seen = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if first_seen or all(c == 0 for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            return [], True, None
        time.sleep(poll_s)
    seen_at = time.time() if first_seen else None
    if first_seen:
        # Give the other ranks a moment to notice and record their own errors.
        end = time.monotonic() + grace_s
        while any(p.is_alive() for p in processes) and time.monotonic() < end:
            time.sleep(poll_s)
    return first_seen, False, seen_at


def _stop_the_rest(processes: list, grace_s: float) -> list[int]:
    """Terminate the ranks still running (kill them after ``grace_s``); return which they were."""
    still_running = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for rank in still_running:
        processes[rank].terminate()
    for p in processes:
        p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join()
    return still_running


def _rank0_result(workdir: Path, fn: Callable[..., Any], nprocs: int) -> Any:
    """The value rank 0 returned, read back from the file it wrote."""
    result = workdir / "result.pt"
    if not result.exists():
        raise RankError(
            f"rank 0 of {nprocs} ended with status 0 without returning from "
            f"{getattr(fn, '__qualname__', fn)} (os._exit(0), or a native library ending "
            "the process), so there is no value to return",
            0,
            0,
        )
    try:
        return torch.load(result, weights_only=False)
    except Exception as exc:
        raise RuntimeError(
            f"rank 0's return value was pickled but cannot be unpickled here "
            f"({type(exc).__name__}: {exc}): return plain data (tensors, numbers, strings "
            "and containers of them) whose classes this process can import"
        ) from exc


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

    Like ``torch.multiprocessing.spawn`` (same calling convention; the start method
    is :func:`_rank_start_method`'s) with three differences a notebook needs: it
    returns rank 0's value; when a rank fails, the caller hears about *that* rank (the first
    one, not the "connection closed" errors it causes on the other ranks); and
    it never waits forever: ranks that are still running ``grace_s`` seconds
    after a failure, or when ``timeout_s`` runs out, are terminated and then killed.

    How a failure is reported: a rank that raised gives the caller its own
    exception, with the rank's traceback as ``__cause__`` and notes on what
    happened to the other ranks. A rank that died without an exception (killed
    by a signal, such as SIGKILL from the out-of-memory killer, or a crash in
    native code, or ``os._exit``) gives a :class:`RankError` naming it and its
    exit code or signal. Ranks that launch stopped itself are never blamed.

    ``sys.exit(0)`` (or ``sys.exit()``) in a rank ends that rank successfully,
    as under torchrun; if it is rank 0, ``launch`` returns None. If its peers
    then fail waiting for it in a collective, the error says which rank left
    early and where. ``sys.exit`` with any other status is a failure of that
    rank (a :class:`RankError`).

    ``fn`` must be importable by module and name (defined in a ``.py`` file),
    and ``args`` and the result must be picklable (an unpicklable result is a
    ``TypeError`` naming its type). Each process gets an equal share of the CPU
    cores for its intra-op threads, so two ranks on two cores do not fight over them.
    """
    _check_launch(fn, nprocs, args, timeout_s, grace_s, poll_s)
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="d2lgpu-launch-") as tmp:
        workdir = Path(tmp)
        # Start the workers.
        processes = mp.start_processes(
            _run_rank,
            args=(fn, args, str(workdir), nprocs, threads, _rank_environment()),
            nprocs=nprocs,
            join=False,
            start_method=_rank_start_method(fn),
        ).processes
        # Watch them; whatever happens (KeyboardInterrupt too: the stop button), leave
        # no orphans behind.
        first_seen: list[int] = []
        timed_out, seen_dead_at = False, None
        try:
            first_seen, timed_out, seen_dead_at = _watch(processes, deadline, grace_s, poll_s)
        finally:
            still_running = _stop_the_rest(processes, grace_s)
        exitcodes = [p.exitcode for p in processes]
        # Ended by launch's own terminate() or kill(), not by something of their own.
        stop_codes = {-signal.SIGTERM, -getattr(signal, "SIGKILL", signal.SIGTERM)}
        stopped = [rank for rank in still_running if exitcodes[rank] in stop_codes]
        # Blame the failing rank.
        if first_seen:
            _raise_first_failure(
                _Outcome.read(workdir, exitcodes, first_seen, stopped, seen_dead_at)
            )
        if timed_out:
            outcome = _Outcome.read(workdir, exitcodes, [], stopped)
            raise TimeoutError(
                "\n  ".join(
                    [
                        f"timed out: the {nprocs} ranks did not finish within "
                        f"timeout_s={timeout_s} s and were stopped; {outcome.hang_summary()}",
                        *outcome.early_exit_lines(),
                    ]
                )
            )
        # Collect rank 0's result.
        return _rank0_result(workdir, fn, nprocs)


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

    if isinstance(commands, str) or not isinstance(commands, Sequence) or any(
        isinstance(c, str) or not isinstance(c, Sequence) for c in commands
    ):
        raise TypeError(
            f"commands must be a list of commands, each a list of strings, got {commands!r}"
        )
    if not commands or any(not command for command in commands):
        raise ValueError("commands must be a non-empty list of non-empty commands")
    if any(not isinstance(part, str) for command in commands for part in command):
        raise TypeError(f"every part of a command must be a str, got {commands!r}")
    if env is not None and not isinstance(env, dict):
        raise TypeError(f"env must be a dict of environment variables or None, got {env!r}")
    try:
        check_positive_float("timeout_s", timeout_s)
    except ValueError:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}") from None
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
