"""Tests of d2lgpu.runtime.estimate: the arithmetic and the message of run-time estimates."""

import re
import time

import pytest
import torch

import d2lgpu
from d2lgpu.runtime.estimate import (
    StepEstimate,
    announce,
    estimate_message,
    format_duration,
    training_estimate,
)
from d2lgpu.training import train


class FakeClock:
    """A clock that advances by a fixed amount per step the test says was taken."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_steps(estimate: StepEstimate, clock: FakeClock, seconds_per_step: list[float]) -> None:
    for seconds in seconds_per_step:
        clock.now += seconds
        estimate.step()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.2, "under a second"), (8.4, "8 s"), (89, "89 s"), (95, "2 min"), (240, "4 min"),
     (89 * 60, "89 min"), (2.5 * 3600, "2.5 h"), (16 * 3600, "16.0 h")],
)
def test_format_duration_rounds_to_a_readable_unit(seconds, text):
    assert format_duration(seconds) == text


def test_the_message_names_the_run_the_duration_and_the_basis():
    assert estimate_message("ResNet-18, 3 epochs x 235 batches", 240, "timed on batches 2-6") == (
        "ResNet-18, 3 epochs x 235 batches: about 4 min on this machine (timed on batches 2-6)"
    )


def test_a_run_under_a_second_is_not_about_under_a_second():
    assert estimate_message("sweep", 0.3, "from one step") == (
        "sweep: under a second on this machine (from one step)"
    )


def test_the_first_step_is_left_out_and_the_next_five_are_averaged():
    clock, lines = FakeClock(), []
    estimate = StepEstimate("3 epochs x 100 batches", 300, clock=clock, out=lines.append)
    # Step 1 is slow (one-off costs) and must not count; steps 2-6 take 1 s each.
    run_steps(estimate, clock, [30.0, 1.0, 1.0, 1.0, 1.0])
    assert estimate.seconds is None and lines == []  # only 4 timed steps so far
    run_steps(estimate, clock, [1.0])
    assert estimate.seconds == pytest.approx(300.0)
    assert lines == ["3 epochs x 100 batches: about 5 min on this machine (timed on batches 2-6)"]
    run_steps(estimate, clock, [50.0] * 10)  # it announces once, and does not change its mind
    assert len(lines) == 1 and estimate.seconds == pytest.approx(300.0)


def test_a_short_run_stays_silent_but_still_knows_its_estimate():
    clock, lines = FakeClock(), []
    estimate = StepEstimate("1 epoch x 8 batches", 8, clock=clock, out=lines.append)
    run_steps(estimate, clock, [0.5] * 8)
    assert estimate.seconds == pytest.approx(4.0)
    assert lines == []


def test_a_run_shorter_than_the_sample_is_timed_on_the_steps_it_has():
    clock, lines = FakeClock(), []
    estimate = StepEstimate("3 big steps", 3, "steps", clock=clock, out=lines.append)
    run_steps(estimate, clock, [100.0, 40.0, 40.0])
    assert estimate.seconds == pytest.approx(120.0)
    assert lines == ["3 big steps: about 2 min on this machine (timed on steps 2-3)"]


def test_an_unknown_length_never_estimates_and_sync_is_called_at_both_readings():
    clock, lines, syncs = FakeClock(), [], []
    silent = StepEstimate("unknown", None, clock=clock, out=lines.append)
    run_steps(silent, clock, [100.0] * 10)
    assert silent.seconds is None and lines == []
    synced = StepEstimate("run", 100, clock=clock, out=lines.append, sync=lambda: syncs.append(1))
    run_steps(synced, clock, [1.0] * 20)
    assert len(syncs) == 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="sample >= 1"):
        StepEstimate("x", 10, sample=0)
    with pytest.raises(ValueError, match="total_steps"):
        StepEstimate("x", -1)


def test_announce_respects_its_threshold():
    lines = []
    assert not announce("sweep", 10.0, "from one step", min_seconds=30.0, out=lines.append)
    assert announce("sweep", 45.0, "from one step", min_seconds=30.0, out=lines.append)
    assert lines == ["sweep: about 45 s on this machine (from one step)"]


def test_training_estimate_describes_the_run_from_the_loader():
    loader = [None] * 235
    estimate = training_estimate(loader, 3, torch.device("cpu"))
    assert estimate.what == "3 epochs x 235 batches" and estimate.total_steps == 705
    assert training_estimate(iter(loader), 1, torch.device("cpu")).total_steps is None


def test_train_announces_a_long_run_once(monkeypatch, capsys):
    # Every reading of the estimate's clock is 100 s after the one before: batches 2-6
    # then take 20 s each, 16 batches about 5 min, and train() must say so once.
    ticks = iter(range(0, 10_000, 100))
    monkeypatch.setattr("d2lgpu.runtime.estimate.perf_counter", lambda: float(next(ticks)))
    X, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=8)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))
    train(net, loader, loader, 2, 0.1, devices="cpu", seed=0, progress=False, plot=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if "on this machine" in line]
    assert lines == [
        "2 epochs x 8 batches: about 5 min on this machine (timed on batches 2-6)"
    ]


# --------------------------------------------------------------------------- #
# The chapter clock
# --------------------------------------------------------------------------- #


def _ticks(*values):
    it = iter(values)
    return lambda: next(it)


def test_announce_names_what_is_wrong_with_its_seconds():
    printed = []
    with pytest.raises(ValueError, match="is NaN"):
        announce("a run", float("nan"), "timed", out=printed.append)
    with pytest.raises(TypeError, match="number of seconds, got str"):
        announce("a run", "10", "timed", out=printed.append)
    with pytest.raises(TypeError, match="what must be a string"):
        estimate_message(None, 10, "timed")
    assert printed == []


@pytest.mark.parametrize("epochs", [0, -1, 1.5, None, True])
def test_training_estimate_needs_a_positive_int_of_epochs(epochs):
    with pytest.raises(ValueError, match=r"num_epochs must be a positive int"):
        training_estimate([1, 2, 3], epochs, torch.device("cpu"))


def test_training_estimate_needs_a_loader():
    with pytest.raises(TypeError, match=r"train_iter must be the loader"):
        training_estimate(None, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"total_steps must be an int >= 0 or None"):
        StepEstimate("x", "ten")


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
