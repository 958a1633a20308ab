"""Faults in distributed jobs: bad arguments, a blocked rendezvous, ranks that die or leave.

Every failure must end in bounded time with an error that names the rank that
failed first and what happened to it. The launches start real processes, so
each costs a few seconds; they are kept to one per behaviour.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import _fault_workers as workers
import pytest
import torch

from d2lgpu import ddp_demos
from d2lgpu.ddp_demos import hogwild_train
from d2lgpu.runtime import distributed
from d2lgpu.runtime.distributed import (
    CollectiveTimeout,
    RankError,
    _Outcome,
    _raise_first_failure,
    find_free_port,
    launch,
    process_group,
    run_together,
)

# Each test starts processes (ranks, torchrun, scripts): `pytest` leaves them out, CI runs
# them (pyproject.toml's "slow" marker).
pytestmark = pytest.mark.slow

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
#
# The same child first checks end_process by repetition (it pays for one import of torch
# for both): ten two-rank gloo jobs, forked while this process is still single-threaded,
# each rank ending through end_process after its group is destroyed. Every rank must end
# with status 0 and its unflushed output printed.
_RENDEZVOUS_SCRIPT = """
import os, sys, time
from d2lgpu.runtime.distributed import all_reduce_sum, end_process, find_free_port, process_group
jobs, statuses = 10, []
for job in range(jobs):
    port, children = find_free_port(), []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            with process_group(rank, 2, master_port=port, timeout_s=30) as ctx:
                total = all_reduce_sum([1.0], ctx)[0]
            print(f"job {job} rank {rank} done: {total:g}")  # not flushed: end_process must
            end_process(0)
        children.append(pid)
    statuses += [os.waitpid(pid, 0)[1] for pid in children]
print("statuses", sorted(set(statuses)), "of", len(statuses), flush=True)

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


@pytest.fixture(scope="module")
def rendezvous_child():
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
            timeout=240,
        )
    finally:
        holder.kill()
        holder.wait()
    return proc, port


def test_end_process_ends_finished_jobs_cleanly_every_time(rendezvous_child):
    proc, _ = rendezvous_child
    assert "statuses [0] of 20" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("done: 2") == 20, proc.stdout
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]


def test_rendezvous_on_a_port_held_by_another_program_ends_within_the_timeout(rendezvous_child):
    proc, port = rendezvous_child
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


# --- launch: whom to blame when ranks hang or abort ---------------------------------------


def test_the_ranks_get_the_loopback_interface_and_the_caller_keeps_its_environment(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    seen = launch(workers.read_env, 1, ("GLOO_SOCKET_IFNAME",), timeout_s=60)
    if sys.platform == "linux":
        assert seen == "lo"
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # not leaked to this process's children


def test_a_rank_that_never_reaches_the_collective_is_named_and_it_says_timed_out():
    with pytest.raises(CollectiveTimeout) as info:
        launch(workers.hang_before_the_collective, 2, (2, find_free_port()), timeout_s=60)
    message = str(info.value)
    assert "rank 0 of 2 timed out in a collective" in message, message
    assert "rank 1 never arrived" in message, message
    assert info.value.laggards == [1]
    assert "NCCL_DEBUG=INFO" in message and "TORCH_NCCL_ASYNC_ERROR_HANDLING" in message


def test_launch_timeout_names_the_rank_still_running():
    with pytest.raises(TimeoutError) as info:
        launch(workers.rank_1_never_ends, 2, timeout_s=2.0, grace_s=1.0)
    message = str(info.value)
    assert message.startswith("timed out") and "still running: rank 1" in message, message
    assert "finished: 0" in message, message


def test_a_world_size_mismatch_is_named():
    # Whichever rank reaches the rendezvous first names the other: both orders are right.
    either = r"world-size mismatch: rank (0 .*world_size=2, rank 1|1 .*world_size=3, rank 0) "
    with pytest.raises(ValueError, match=either):
        launch(workers.mismatched_world_size, 2, (find_free_port(),), timeout_s=60)


def test_a_rank_stuck_after_the_last_mark_is_named_as_never_entering_the_collective():
    with pytest.raises(CollectiveTimeout) as info:
        launch(workers.hang_after_its_mark, 2, (2, find_free_port()), timeout_s=60, grace_s=1)
    message = str(info.value)
    assert "rank 1 never entered the collective" in message, message
    assert info.value.laggards == [1]


def test_the_ranks_that_did_not_time_out_are_found_within_the_gather_time(monkeypatch):
    class Store(dict):
        def set(self, key, value):
            self[key] = value

        def check(self, keys):
            return all(k in self for k in keys)

    monkeypatch.setattr(distributed, "_TIMEOUT_GATHER_S", 0.3)
    store = Store({"timed_out/2": "1"})
    start = time.monotonic()
    assert distributed._ranks_not_in_the_collective(store, 0, 3) == [1]
    assert 0.3 <= time.monotonic() - start < 2  # waited the gather time, not longer
    start = time.monotonic()
    store["timed_out/1"] = "1"
    assert distributed._ranks_not_in_the_collective(store, 0, 3) == []
    assert time.monotonic() - start < 0.3  # everyone noted: no wait


def test_two_processes_that_claim_rank_0_are_named_as_a_cause():
    # The second rank 0 finds the port taken.
    with pytest.raises(RuntimeError, match=r"a second process started as rank 0 holds it "
                                           r"\(give every process its own rank, 0 to "
                                           r"world_size-1"):
        launch(workers.claim_rank, 2, ([0, 0], 2, find_free_port()), timeout_s=60)


def test_a_second_claim_of_any_rank_is_named(monkeypatch):
    # The claims of the rendezvous, with two processes faked in this one (no process starts).
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    monkeypatch.setattr(distributed, "_this_process", lambda: "process 1 on a")
    with pytest.raises(TimeoutError):  # rank 1 claimed; ranks 0 and 2 never come
        distributed._meet(store, 1, 3, timeout_s=0.2)
    monkeypatch.setattr(distributed, "_this_process", lambda: "process 2 on a")
    with pytest.raises(ValueError, match=r"two processes claim rank 1: process 1 on a joined "
                                         r"as rank 1 first, then process 2 on a"):
        distributed._meet(store, 1, 3, timeout_s=0.2)


def test_fewer_processes_than_the_world_size_says_how_many_arrived(monkeypatch):
    # The rendezvous's own wait, with rank 1 already there and rank 2 never started (no
    # processes: test_two_processes_that_claim_rank_0 runs the real rendezvous).
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    store.set("world_size/1", "3")
    store.set("claim/1", "process 1 on a")
    with pytest.raises(TimeoutError, match=r"only 2 of 3 ranks arrived at the rendezvous within "
                                           r"timeout_s=0.2 s \(arrived: 0, 1; never came: 2\)"):
        distributed._meet(store, 0, 3, timeout_s=0.2)


def test_a_rendezvous_host_that_does_not_resolve_is_named_at_once():
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"rendezvous host 'no-such-host.invalid' does not "
                                         r"resolve .*machine where rank 0 runs"):
        with process_group(0, 2, master_port=find_free_port(),
                           master_addr="no-such-host.invalid", timeout_s=30):
            pass
    assert time.monotonic() - start < 10  # not the 30 s connect timeout


def _outcome(exitcodes, first_seen, stopped, progress=None):
    return _Outcome(exitcodes, first_seen, stopped, {}, {}, progress or {})


def test_ranks_aborted_by_the_nccl_watchdog_blame_the_rank_that_never_arrived():
    # Rank 0 died by SIGABRT (NCCL's watchdog after a collective timeout) while rank 1
    # was still running: rank 1 is the one to look at, not rank 0.
    outcome = _outcome([-signal.SIGABRT, -signal.SIGTERM], [0], [1], {0: (3, "all_reduce_sum")})
    with pytest.raises(RankError) as info:
        _raise_first_failure(outcome)
    message = str(info.value)
    assert info.value.rank == 1 and "rank 1 of 2 never arrived" in message, message
    assert "rank 0 timed out in a collective" in message and "SIGABRT" in message, message
    # A rank that aborts of its own looks the same from outside: the message says where to look.
    assert "Had rank 0 aborted on its own" in message, message
    assert "NCCL_DEBUG=INFO" in message and "TORCH_NCCL_ASYNC_ERROR_HANDLING" in message


def test_a_native_crash_is_blamed_before_the_peers_the_watchdog_aborted():
    outcome = _outcome([-signal.SIGABRT, -signal.SIGSEGV], [0, 1], [])
    with pytest.raises(RankError, match=r"rank 1 of 2 was killed by signal SIGSEGV") as info:
        _raise_first_failure(outcome)
    assert info.value.rank == 1
    # Alone, SIGABRT is described with the watchdog as one likely cause.
    with pytest.raises(RankError, match=r"SIGABRT.*NCCL's watchdog"):
        _raise_first_failure(_outcome([-signal.SIGABRT, 0], [0], []))


def test_local_rank_0_makes_the_nccl_p2p_decision_and_the_other_ranks_take_it(monkeypatch):
    store = torch.distributed.HashStore()
    decided = []

    def decide():  # what apply_nccl_p2p_decision does on two T4s
        decided.append(True)
        os.environ["NCCL_P2P_DISABLE"] = "1"

    monkeypatch.setattr(distributed, "apply_nccl_p2p_decision", decide)
    # setenv first: it records the value to restore (a delenv of an unset variable records
    # nothing, and the "1" set below would outlive the test).
    monkeypatch.setenv("NCCL_P2P_DISABLE", "")
    monkeypatch.delenv("NCCL_P2P_DISABLE")
    distributed._agree_on_nccl_p2p(store, 0)
    monkeypatch.delenv("NCCL_P2P_DISABLE")  # another rank of the machine: its own process
    distributed._agree_on_nccl_p2p(store, 1)
    assert decided == [True] and os.environ["NCCL_P2P_DISABLE"] == "1"
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")  # set before the job: it stands
    distributed._agree_on_nccl_p2p(store, 1)
    assert os.environ["NCCL_P2P_DISABLE"] == "0"


def test_nccl_refuses_a_local_rank_without_a_gpu_of_its_own(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="needs one GPU per process"):
        distributed._rank_device("nccl", 3)


# --- a clean exit for every command-line entry point --------------------------------------

@pytest.mark.parametrize(
    "module", ["ddp_train", "healthcheck", "fsdp_train", "model_parallel_train"]
)
def test_every_entry_point_ends_through_end_process(module):
    import ast
    import importlib.util

    # Read, not imported: importing fsdp_train alone would cost seconds.
    source = Path(importlib.util.find_spec(f"d2lgpu.{module}").origin).read_text()
    main_guard = next(
        node for node in ast.parse(source).body
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
    )
    text = ast.unparse(main_guard)
    assert "end_process(" in text and "os._exit" not in text and "sys.exit" not in text, text


# --- bad input to the public helpers names the fix -------------------------------------------


def test_find_free_port_names_a_host_it_cannot_use():
    with pytest.raises(ValueError, match=r"cannot open a port on host 'no-such-host\.invalid'"):
        find_free_port("no-such-host.invalid")
    with pytest.raises(ValueError, match="cannot open a port on host None"):
        find_free_port(None)


def test_helpers_refuse_wrong_types_naming_what_they_take():
    with pytest.raises(TypeError, match="fn must be a function"):
        launch(None, 2)
    with pytest.raises(TypeError, match="args must be a tuple"):
        launch(workers.return_rank, 1, [1])
    with pytest.raises(TypeError, match="commands must be a list"):
        run_together("echo hi")


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((None, torch.zeros(4, 2), torch.zeros(4, 1)), TypeError, "model must be"),
        ((torch.nn.Linear(2, 1), None, torch.zeros(4, 1)), TypeError, "features must be"),
        ((torch.nn.Linear(2, 1), torch.full((4, 2), math.nan), torch.zeros(4, 1)), ValueError,
         r"features hold \d+ NaN"),
    ],
)
def test_hogwild_refuses_bad_input_naming_it(args, error, match):
    with pytest.raises(error, match=match):
        hogwild_train(*args)


def test_hogwild_that_diverges_raises_instead_of_returning_exploded_weights(monkeypatch):
    # The ranks run one after the other in this process: the check after training is
    # what is tested, not the processes (test_distributed.py starts real ones).
    def in_process(fn, nprocs, args, timeout_s):
        for rank in range(nprocs):
            fn(rank, *args)

    monkeypatch.setattr(ddp_demos, "_run_workers", in_process)
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(64, 2, generator=gen)
    y = X @ torch.tensor([[2.0], [-3.0]])
    with pytest.raises(FloatingPointError, match=r"diverged.*smaller lr \(this run: 1e\+06\)"):
        hogwild_train(torch.nn.Linear(2, 1), X, y, lr=1e6)
    # Finite but tenfold the start is divergence too (the course's one rule).
    with pytest.raises(FloatingPointError, match=r"more than 10 times .*diverged at lr 1\.2"):
        hogwild_train(torch.nn.Linear(2, 1), X, y, lr=1.2, epochs=2, batch_size=64)
    model = hogwild_train(torch.nn.Linear(2, 1), X, y, lr=0.1, epochs=10, batch_size=8)  # sane
    assert torch.allclose(model.weight.detach(), torch.tensor([[2.0, -3.0]]), atol=0.1)


def test_a_failing_hogwild_worker_is_reported_with_its_traceback():
    with pytest.raises(Exception, match=r"(?s)Process \d terminated.*failed in a worker"):
        hogwild_train(workers.FailsInAWorker(2, 1), torch.zeros(8, 2), torch.zeros(8, 1),
                      timeout_s=120)


def test_hogwild_workers_still_running_at_the_timeout_are_stopped_and_named():
    model = workers.FailsInAWorker(2, 1, hang=True)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"2 processes did not finish within timeout_s=3 s"):
        hogwild_train(model, torch.zeros(8, 2), torch.zeros(8, 1), timeout_s=3)
    assert time.monotonic() - started < 60


def test_exit_status_of_is_0_after_a_return_and_1_after_a_raise_with_the_traceback(capsys):
    from d2lgpu.runtime.distributed import exit_status_of

    assert exit_status_of(lambda: None) == 0

    def broken():
        raise ValueError("the checkpoint directory is not writable")

    assert exit_status_of(broken) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "the checkpoint directory is not writable" in err
