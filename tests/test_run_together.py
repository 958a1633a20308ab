"""Tests of d2lgpu.runtime.distributed.run_together: command-line jobs started side by side."""

import sys
import time

import pytest

from d2lgpu.runtime.distributed import run_together

# Each side creates its own file, then waits for the other's: run one after the other,
# the first would wait forever; run together, both finish at once.
RENDEZVOUS = """
import pathlib, sys, time
mine, theirs = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
mine.touch()
end = time.monotonic() + 20
while not theirs.exists():
    if time.monotonic() > end:
        sys.exit("the other side never came")
    time.sleep(0.02)
print("met", mine.name)
"""


def test_commands_run_at_the_same_time_and_report_output_and_status(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    results = run_together(
        [[sys.executable, "-c", RENDEZVOUS, a, b], [sys.executable, "-c", RENDEZVOUS, b, a],
         [sys.executable, "-c", "import sys; print('to stderr', file=sys.stderr); sys.exit(3)"]],
        timeout_s=60,
    )
    assert [r.returncode for r in results] == [0, 0, 3]
    assert results[0].output == "met a\n" and results[1].output == "met b\n"
    assert results[2].output == "to stderr\n"  # stderr is captured with stdout
    assert results[0].command[0] == sys.executable


def test_a_command_past_the_timeout_is_killed_and_named(tmp_path):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="sleep"):
        run_together([[sys.executable, "-c", "import time; time.sleep(60)  # sleep"]],
                     timeout_s=1.0)
    assert time.monotonic() - started < 30


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="non-empty"):
        run_together([])
    with pytest.raises(TypeError, match="non-empty"):
        run_together([[]])
    with pytest.raises(ValueError, match="timeout_s"):
        run_together([["true"]], timeout_s=0)
