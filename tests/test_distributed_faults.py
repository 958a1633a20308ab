"""Faults in distributed jobs: bad arguments, a blocked rendezvous, ranks that die or leave.

Every failure must end in bounded time with an error that names the rank that
failed first and what happened to it. The launches start real processes, so
each costs a few seconds; they are kept to one per behaviour.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import _fault_workers as workers
import pytest
import torch

from d2lgpu.distributed import RankError, find_free_port, hogwild_train, launch, process_group

CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


# --- process_group: arguments and rendezvous --------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"timeout_s": math.nan}, "timeout_s"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"timeout_s": -1.0}, "timeout_s"),
        ({"timeout_s": "30"}, "timeout_s"),
        ({"rank": "0"}, "rank"),
        ({"world_size": "2"}, "world_size"),
        ({"rank": True}, "rank"),
        ({"master_port": "29500"}, "master_port"),
        ({"local_rank": "0"}, "local_rank"),
        ({"master_addr": ""}, "master_addr"),
    ],
)
def test_process_group_refuses_bad_values_by_name(kwargs, name):
    args = {"rank": 0, "world_size": 1, "master_port": 29500, "timeout_s": 5.0, **kwargs}
    rank, world_size = args.pop("rank"), args.pop("world_size")
    with pytest.raises(ValueError, match=rf"\b{name}\b"), process_group(rank, world_size, **args):
        pass
    assert not torch.distributed.is_initialized()


# Another program holds the port: it accepts connections and never says a word.
_PORT_HOLDER_SCRIPT = """
import socket, time
holder = socket.socket()
holder.bind(("127.0.0.1", 0))
holder.listen()
print(holder.getsockname()[1], flush=True)
time.sleep(120)
"""

# Run in a child process too: before the fix the rendezvous blocked in native code,
# deaf even to SIGALRM, so only an outside timeout could end it.
_RENDEZVOUS_SCRIPT = """
import sys, time
from d2lgpu.distributed import find_free_port, process_group
held = int(sys.argv[1])
for name, rank, port, timeout_s in [
    ("held", 1, held, 3), ("held", 0, held, 3), ("unused", 1, find_free_port(), 1)
]:
    started = time.monotonic()
    try:
        with process_group(rank, 2, master_port=port, timeout_s=timeout_s):
            print(f"{name} port, rank {rank} joined")
    except Exception as exc:
        seconds = time.monotonic() - started
        print(f"{name} port, rank {rank} after {seconds:.1f} s: {type(exc).__name__}: {exc}")
"""


def test_rendezvous_on_a_port_held_by_another_program_ends_within_the_timeout():
    holder = subprocess.Popen(
        [sys.executable, "-c", _PORT_HOLDER_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    try:
        port = holder.stdout.readline().strip()
        proc = subprocess.run(
            [sys.executable, "-c", _RENDEZVOUS_SCRIPT, port],
            env=CHILD_ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for name, rank, seconds, message in re.findall(
        r"^(\w+) port, rank (\d) after ([\d.]+) s: (.*)$", proc.stdout, re.M
    ):
        results[name, int(rank)] = float(seconds), message
        assert "find_free_port" in message, message
    assert results.keys() == {("held", 1), ("held", 0), ("unused", 1)}, proc.stdout
    # Rank 1 connects to the holder and hears nothing; rank 0 cannot listen on its port.
    for rank in (1, 0):
        seconds, message = results["held", rank]
        assert seconds < 3 + 5, f"rank {rank} took {seconds} s with timeout_s=3"
        assert f"127.0.0.1:{port}" in message, message
    assert "no torch.distributed store answers" in results["held", 1][1]
    assert "address already in use" in results["held", 0][1]
    # Nobody at all on the port: rank 0 never started, or has another port.
    seconds, message = results["unused", 1]
    assert seconds < 1 + 5 and "nothing listens there" in message, message


# --- launch: arguments ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"timeout_s": math.nan}, "timeout_s"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": "60"}, "timeout_s"),
        ({"poll_s": -1}, "poll_s"),
        ({"poll_s": 0}, "poll_s"),
        ({"poll_s": math.nan}, "poll_s"),
        ({"grace_s": -1}, "grace_s"),
        ({"grace_s": math.nan}, "grace_s"),
    ],
)
def test_launch_refuses_bad_times_by_name(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        launch(workers.return_rank, 1, **kwargs)


# --- launch: which rank is blamed -------------------------------------------------------


def test_a_rank_that_dies_without_an_exception_is_blamed_not_the_rank_launch_stopped(tmp_path):
    # Rank 1: os._exit(3). Then rank 2: SIGSEGV. Rank 0: healthy, stopped by launch.
    with pytest.raises(RankError) as info:
        launch(workers.die_without_exception, 3, (str(tmp_path),), timeout_s=120, grace_s=1.5)
    message = str(info.value)
    assert info.value.rank == 1, message
    assert message.startswith("rank 1 of 3 exited with code 3"), message
    assert "then rank 2 was killed by signal SIGSEGV" in message, message
    assert "launch stopped rank 0, which was still running" in message, message
    assert "SIGTERM" not in message and "signal 15" not in message, message


def test_a_rank_killed_in_a_collective_is_named_and_its_peer_error_is_a_consequence():
    with pytest.raises(RankError) as info:
        launch(workers.killed_in_collective, 2, (2, find_free_port()), timeout_s=120)
    message = str(info.value)
    assert info.value.rank == 1, message
    assert message.startswith("rank 1 of 2 was killed by signal SIGKILL"), message
    assert "out of memory" in message  # the usual reason for a SIGKILL
    assert "then rank 0 failed" in message, message  # the survivor, as a consequence


def test_an_unpicklable_return_value_is_reported_with_its_type():
    with pytest.raises(TypeError) as info:
        launch(workers.return_unpicklable, 1, timeout_s=120)
    message = str(info.value)
    assert "rank 0 returned a function" in message, message
    assert "cannot be pickled" in message, message


# --- launch: sys.exit in a rank ---------------------------------------------------------


def test_sys_exit_0_ends_a_rank_successfully_and_rank_0_then_returns_none():
    # Another rank leaving early with status 0 has finished; rank 0's value still arrives.
    assert launch(workers.exit_early, 2, (1, 0), timeout_s=120) == "rank 0 returned"
    # Rank 0 leaving with sys.exit() has no value to return.
    assert launch(workers.exit_early, 1, (0, None), timeout_s=120) is None


def test_sys_exit_with_a_failure_status_is_a_failure_of_that_rank():
    with pytest.raises(RankError, match=r"^rank 0 of 1 called sys\.exit\(3\)") as info:
        launch(workers.exit_early, 1, (0, 3), timeout_s=120)
    assert info.value.rank == 0


def test_an_early_sys_exit_0_is_named_when_its_peers_fail_for_want_of_it():
    with pytest.raises(Exception) as info:
        launch(workers.exit_early_in_collective, 2, (2, find_free_port()), timeout_s=120)
    notes = " ".join(getattr(info.value, "__notes__", []))
    text = f"{info.value} {notes}"
    assert "raised by rank 0 of 2" in text, text
    assert "rank 1 had already ended with sys.exit(0)" in text, text


# --- hogwild ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"lr": math.inf}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"lr": 0.0}, "lr"),
        ({"epochs": 0}, "epochs"),
        ({"batch_size": 0}, "batch_size"),
        ({"seed": -1}, "seed"),
        ({"timeout_s": math.nan}, "timeout_s"),
    ],
)
def test_hogwild_refuses_bad_settings_before_starting_processes(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        hogwild_train(torch.nn.Linear(2, 1), torch.zeros(4, 2), torch.zeros(4, 1), **kwargs)
