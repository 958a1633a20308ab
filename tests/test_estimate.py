"""Tests of d2lgpu.estimate: the arithmetic and the message of run-time estimates."""

import pytest
import torch

from d2lgpu.estimate import (
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


def test_format_duration_rejects_nonsense():
    with pytest.raises(ValueError, match=">= 0"):
        format_duration(-1.0)
    # NaN is named as NaN: calling it negative would send the reader after a sign error.
    with pytest.raises(ValueError, match="is NaN") as info:
        format_duration(float("nan"))
    assert ">= 0" not in str(info.value)
    with pytest.raises(ValueError, match="infinite"):
        format_duration(float("inf"))
    with pytest.raises(TypeError, match="number of seconds, got NoneType"):
        format_duration(None)


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
    monkeypatch.setattr("d2lgpu.estimate.perf_counter", lambda: float(next(ticks)))
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


def test_chapter_clock_scales_the_reference_by_the_calibration():
    from d2lgpu.estimate import REFERENCE_CALIBRATION_SECONDS, ChapterClock

    lines = []
    # This machine runs the calibration twice as slowly: expect twice the reference time.
    clock = ChapterClock(60, 10, mode="cpu", calibration=2 * REFERENCE_CALIBRATION_SECONDS,
                         clock=_ticks(0.0, 150.0), out=lines.append, load_average=0.0)
    assert clock.expected == pytest.approx(120)
    assert "CPU mode 60 s, quick mode 10 s" in lines[0]
    assert "no run recorded yet" in lines[0]
    assert "2.0x slower than" in lines[1] and "about 2 min" in lines[1]
    assert clock.finish() is None and clock.elapsed == 150.0
    assert lines[-1] == "This chapter took 2 min here in cpu mode (expected about 2 min)."


def test_chapter_clock_quick_mode_uses_the_quick_figure_and_full_mode_does_not_scale():
    from d2lgpu.estimate import REFERENCE_CALIBRATION_SECONDS, ChapterClock

    lines = []
    quick = ChapterClock(300, 20, mode="quick", calibration=REFERENCE_CALIBRATION_SECONDS / 2,
                         out=lines.append, load_average=0.0)
    assert quick.expected == pytest.approx(10)
    assert "2.0x as fast as" in lines[1]
    lines.clear()
    full = ChapterClock(300, 20, 45, "NVIDIA H100", mode="full", calibration=1.0,
                        out=lines.append)
    assert full.expected is None
    assert "full mode on one NVIDIA H100: 45 s" in lines[0]
    assert "announces its own estimate" in lines[1]


@pytest.mark.parametrize("kwargs, match", [
    ({"cpu_seconds": 0, "quick_seconds": 1}, "cpu_seconds"),
    ({"cpu_seconds": 1, "quick_seconds": float("nan")}, "quick_seconds"),
    ({"cpu_seconds": "60", "quick_seconds": 1}, "cpu_seconds"),
    ({"cpu_seconds": True, "quick_seconds": 1}, "cpu_seconds"),
    ({"cpu_seconds": 1, "quick_seconds": 1, "gpu_seconds": 5}, "gpu_name"),
    ({"cpu_seconds": 1, "quick_seconds": 1, "mode": "fast"}, "mode"),
])
def test_chapter_clock_refuses_bad_figures(kwargs, match):
    from d2lgpu.estimate import ChapterClock

    with pytest.raises(ValueError, match=match):
        ChapterClock(**kwargs, calibration=1.0, out=lambda line: None)


def test_calibration_is_the_fastest_repeat():
    from d2lgpu.estimate import calibration_seconds

    ticks = iter([0, 5, 10, 11, 20, 23])  # repeats of 5, 1 and 3 s: the fastest is 1
    assert calibration_seconds(3, clock=lambda: next(ticks), pause=0) == 1
    with pytest.raises(ValueError, match="repeats"):
        calibration_seconds(0)


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


@pytest.mark.parametrize("kwargs, name", [
    (dict(gpu_name=True), "gpu_name"),
    (dict(calibration="fast"), "calibration"),
    (dict(calibration=float("nan")), "calibration"),
    (dict(clock="no"), "clock"),
    (dict(out=None), "out"),
])
def test_chapter_clock_names_a_bad_argument(kwargs, name):
    from d2lgpu.estimate import ChapterClock

    with pytest.raises((TypeError, ValueError), match=name):
        ChapterClock(cpu_seconds=60.0, quick_seconds=20.0, **kwargs)


def test_calibration_names_a_bad_clock():
    from d2lgpu.estimate import calibration_seconds

    with pytest.raises(TypeError, match="clock"):
        calibration_seconds(clock=3)


def test_calibration_runs_one_thread_pauses_between_repeats_and_restores_threads():
    from d2lgpu.estimate import calibration_seconds

    before = torch.get_num_threads()
    threads_seen, pauses = [], []
    ticks = iter([0, 4, 10, 12, 20, 27])  # repeats of 4, 2 and 7 s

    def fake_step():
        threads_seen.append(torch.get_num_threads())

    reading = calibration_seconds(3, clock=lambda: next(ticks), pause=0.01,
                                  sleep=pauses.append, step=fake_step)
    assert reading == 2
    assert threads_seen == [1] * 6  # 3 warm-up steps and 3 timed ones, all on one thread
    assert pauses == [0.01] * 3  # a pause before every timed repeat
    assert torch.get_num_threads() == before


def test_calibration_restores_threads_when_the_step_fails():
    from d2lgpu.estimate import calibration_seconds

    before = torch.get_num_threads()

    def broken_step():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        calibration_seconds(3, pause=0, step=broken_step)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("reading, factor", [
    (1.0, 1.0),  # as fast as the reference
    (1.5, 1.5),  # inside the bound: taken as read
    (0.6, 0.6),
    (2.0, 2.0),  # on the bound, both sides
    (0.5, 0.5),
    (2.5, 2.0),  # beyond it: clipped
    (77.0, 2.0),  # the reading a loaded machine once gave with two threads
    (0.1, 0.5),
])
def test_speed_factor_is_the_reading_within_the_bound(reading, factor):
    from d2lgpu.estimate import REFERENCE_CALIBRATION_SECONDS, speed_factor

    assert speed_factor(reading * REFERENCE_CALIBRATION_SECONDS) == pytest.approx(factor)


def test_speed_factor_refuses_bad_arguments():
    from d2lgpu.estimate import speed_factor

    with pytest.raises(ValueError, match="calibration"):
        speed_factor(0.0)
    with pytest.raises(ValueError, match="bound must be >= 1"):
        speed_factor(1.0, bound=0.5)


@pytest.mark.parametrize("reading, expected_seconds, bounded", [
    (77.0, 120, True),  # an unlucky slow reading: at most twice the reference's 60 s
    (1.5, 90, False),
    (0.7, 42, False),
    (0.05, 30, True),  # an implausibly fast reading: at least half the reference
])
def test_chapter_clock_bounds_the_expectation_on_both_sides(reading, expected_seconds, bounded):
    from d2lgpu.estimate import REFERENCE_CALIBRATION_SECONDS, ChapterClock

    lines = []
    clock = ChapterClock(60, 10, mode="cpu", calibration=reading * REFERENCE_CALIBRATION_SECONDS,
                         out=lines.append, load_average=0.0)
    assert clock.expected == pytest.approx(expected_seconds)
    assert ("at most 2x either way" in lines[1]) == bounded
    assert f"about {round(expected_seconds)} s" in lines[1] or "about 2 min" in lines[1]


@pytest.mark.parametrize("load, factor", [
    (None, 1.0),  # no load average (Windows): nothing added
    (0.3, 1.0), (2.0, 1.0),  # up to one runnable process per core: nothing added
    (4.0, 2 ** 0.5),  # two per core
    (13.0, 6.5 ** 0.5),
    (50.0, 3.0),  # bounded
])
def test_load_factor_is_the_root_of_the_load_per_core_within_its_bound(load, factor):
    from d2lgpu.estimate import load_factor

    assert load_factor(load, 2) == pytest.approx(factor)


def test_load_factor_refuses_bad_arguments():
    from d2lgpu.estimate import load_factor

    with pytest.raises(ValueError, match="cores"):
        load_factor(1.0, 0)
    with pytest.raises(ValueError, match="load_average"):
        load_factor(-1.0, 2)


@pytest.mark.parametrize("load, expected_seconds, says_busy", [
    (0.5, 60, False), (2.0, 60, False), (8.0, 120, True), (40.0, 180, True)])
def test_chapter_clock_scales_by_the_load_and_says_so(load, expected_seconds, says_busy):
    from d2lgpu.estimate import REFERENCE_CALIBRATION_SECONDS, ChapterClock

    lines = []
    clock = ChapterClock(60, 10, mode="cpu", calibration=REFERENCE_CALIBRATION_SECONDS,
                         out=lines.append, load_average=load, cores=2)
    assert clock.expected == pytest.approx(expected_seconds)
    assert ("other programs are running here too" in lines[1]) == says_busy
