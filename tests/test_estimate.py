"""Tests of d2lgpu.runtime.estimate: the arithmetic and the message of run-time estimates."""

import re
import time

import pytest

import d2lgpu
from d2lgpu.runtime.estimate import format_duration


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.2, "under a second"), (8.4, "8 s"), (89, "89 s"), (95, "2 min"), (240, "4 min"),
     (89 * 60, "89 min"), (2.5 * 3600, "2.5 h"), (16 * 3600, "16.0 h")],
)
def test_format_duration_rounds_to_a_readable_unit(seconds, text):
    assert format_duration(seconds) == text


# --------------------------------------------------------------------------- #
# The chapter clock
# --------------------------------------------------------------------------- #


def _ticks(*values):
    it = iter(values)
    return lambda: next(it)


def test_chapter_clock_states_the_reference_times_and_the_elapsed_time():
    from d2lgpu.runtime.estimate import ChapterClock

    lines = []
    clock = ChapterClock(60, 10, mode="cpu", clock=_ticks(0.0, 150.0), out=lines.append)
    assert clock.expected == 60
    assert "CPU mode 60 s, quick mode 10 s" in lines[0]
    assert "no run recorded yet" in lines[0] and "runs cpu mode" in lines[0]
    assert clock.finish() is None and clock.elapsed == 150.0
    assert lines[-1] == "This chapter took 2 min here in cpu mode (stated: 60 s)."


def test_chapter_clock_full_mode_names_the_gpu_or_says_none_was_recorded():
    from d2lgpu.runtime.estimate import ChapterClock

    lines = []
    full = ChapterClock(300, 20, 45, "NVIDIA H100", mode="full", out=lines.append,
                        clock=_ticks(0.0, 50.0))
    assert full.expected == 45 and "full mode on one NVIDIA H100: 45 s" in lines[0]
    lines.clear()
    bare = ChapterClock(300, 20, mode="full", out=lines.append, clock=_ticks(0.0, 50.0))
    assert bare.expected is None
    bare.finish()
    assert lines[-1] == "This chapter took 50 s here in full mode."


@pytest.mark.parametrize("kwargs, match", [
    ({"cpu_seconds": 0, "quick_seconds": 1}, "cpu_seconds"),
    ({"cpu_seconds": 1, "quick_seconds": float("nan")}, "quick_seconds"),
    ({"cpu_seconds": "60", "quick_seconds": 1}, "cpu_seconds"),
    ({"cpu_seconds": True, "quick_seconds": 1}, "cpu_seconds"),
    ({"cpu_seconds": 1, "quick_seconds": 1, "gpu_seconds": 5}, "gpu_name"),
    ({"cpu_seconds": 1, "quick_seconds": 1, "mode": "fast"}, "mode"),
])
def test_chapter_clock_refuses_bad_figures(kwargs, match):
    from d2lgpu.runtime.estimate import ChapterClock

    with pytest.raises(ValueError, match=match):
        ChapterClock(**kwargs, out=lambda line: None)



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
    with pytest.raises(TypeError, match="desc must be a non-empty str"):
        with d2lgpu.elapsed_bar(""):
            pass
