"""Tests of d2lgpu.runtime.progress: the elapsed-time bar."""

import re
import time

import pytest

import d2lgpu


def test_elapsed_bar_counts_the_seconds_of_its_body_and_stops_with_it(capsys):
    import threading

    with d2lgpu.elapsed_bar("two ranks"):
        time.sleep(2.3)
    frames = [int(s) for s in re.findall(r"two ranks: 00:(\d\d)", capsys.readouterr().err)]
    # Ticked while the body waited, and the last frame says how long it took.
    assert len(frames) >= 3 and frames[-1] == 2, frames
    assert frames == sorted(frames)
    threads = threading.active_count()
    with pytest.raises(RuntimeError, match="rank 1 failed"), d2lgpu.elapsed_bar("failing"):
        raise RuntimeError("rank 1 failed")
    assert threading.active_count() == threads  # the ticker ended with the body
