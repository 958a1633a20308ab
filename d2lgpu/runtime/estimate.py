"""How long will this take? The chapter's stated time, and one line before a long run.

:func:`start_chapter` states the chapter's time up front; :func:`announce` prints one line
before a long computation whose duration a chapter has estimated (e.g. chapter 6's sweeps),
and only when it is long enough to be worth announcing::

    precision sweep: about 4 min on this machine (timed on one step per row)

Training loops show tqdm's bar instead, whose ETA is measured as the run goes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from numbers import Real
from time import perf_counter

__all__ = [
    "MIN_SECONDS_TO_ANNOUNCE",
    "REFERENCE_MACHINE",
    "ChapterClock",
    "announce",
    "estimate_message",
    "start_chapter",
]

#: Runs estimated to take less than this print nothing: a short wait needs no warning.
MIN_SECONDS_TO_ANNOUNCE = 30.0


def format_duration(seconds: float) -> str:
    """A rounded, readable duration: ``"8 s"``, ``"4 min"``, ``"2.5 h"``."""
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"{round(seconds)} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def _check_seconds(name: str, seconds: object) -> float:
    """``seconds`` as a float if it is a number of seconds (finite, >= 0), else a clear error.

    Each wrong kind gets its own words: NaN is not "negative", and inf is not a duration.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(seconds).__name__} "
                        f"{seconds!r}")
    if math.isnan(seconds):
        raise ValueError(f"{name} is NaN (not a number): the time it was computed from is "
                         "missing or broken, e.g. 0/0 from a run with no steps")
    if math.isinf(seconds):
        raise ValueError(f"{name} is infinite ({seconds}): a rate of zero steps per second, "
                         "or a clock that did not move, went into it")
    if seconds < 0:
        raise ValueError(f"{name} must be a number >= 0, got {seconds!r}: a negative time "
                         "comes from subtracting clock readings the wrong way round")
    return float(seconds)


def _check_text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__} {value!r}")
    return value


def estimate_message(what: str, seconds: float, basis: str) -> str:
    """The one line an estimate prints: ``"<what>: about <duration> on this machine (<basis>)"``."""
    _check_text("what", what)
    _check_text("basis", basis)
    seconds = _check_seconds("seconds", seconds)
    about = "about " if seconds >= 1 else ""  # never "about under a second"
    return f"{what}: {about}{format_duration(seconds)} on this machine ({basis})"


def announce(
    what: str,
    seconds: float,
    basis: str,
    *,
    min_seconds: float = 0.0,
    out: Callable[[str], object] = print,
) -> bool:
    """Print :func:`estimate_message` when ``seconds >= min_seconds``; return whether it did."""
    seconds = _check_seconds("seconds", seconds)
    _check_seconds("min_seconds", min_seconds)
    if not callable(out):
        raise TypeError(f"out must be a function such as print, got {type(out).__name__}")
    if seconds < min_seconds:
        return False
    out(estimate_message(what, seconds, basis))
    return True


# --------------------------------------------------------------------------- #
# The whole chapter, up front
# --------------------------------------------------------------------------- #

#: The machine the committed notebooks ran on: the times a chapter states are its.
REFERENCE_MACHINE = "a 2-core x86 CPU without a GPU"


def _seconds_or_none(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or value == float("inf"):
        raise ValueError(f"{name} must be a number of seconds > 0 (or None), got {value!r}")
    return float(value)


class ChapterClock:
    """States up front how long a chapter takes, and says at the end how long it took here.

    ``cpu_seconds`` and ``quick_seconds`` are what the whole chapter took on
    :data:`REFERENCE_MACHINE` in CPU mode and in quick mode, in a plain Jupyter kernel;
    ``gpu_seconds`` what it took in full mode on ``gpu_name`` (None: no GPU run recorded).
    The figures are stated, not scaled to this machine: cells over 30 s show a progress
    bar with their own estimate. ``mode``, ``clock`` and ``out`` are there for tests.
    """

    def __init__(self, cpu_seconds: float, quick_seconds: float,
                 gpu_seconds: float | None = None, gpu_name: str | None = None, *,
                 mode: str | None = None, clock: Callable[[], float] = perf_counter,
                 out: Callable[[str], object] = print) -> None:
        from d2lgpu.runtime.config import workload

        if gpu_seconds is not None and not gpu_name:
            raise ValueError("gpu_seconds needs gpu_name: say which GPU it was measured on")
        self.reference = {"cpu": _seconds_or_none("cpu_seconds", cpu_seconds),
                          "quick": _seconds_or_none("quick_seconds", quick_seconds),
                          "full": _seconds_or_none("gpu_seconds", gpu_seconds)}
        if None in (self.reference["cpu"], self.reference["quick"]):
            raise ValueError("cpu_seconds and quick_seconds are both needed: the reference "
                             "machine runs both modes")
        self.mode = mode or workload()
        if self.mode not in self.reference:
            raise ValueError(f"mode must be 'quick', 'cpu' or 'full', got {self.mode!r}")
        self.expected = self.reference[self.mode]
        self.elapsed: float | None = None
        self._clock, self._out, self._start = clock, out, clock()
        cpu, quick, full = (format_duration(s) if s else None for s in self.reference.values())
        gpu = f"full mode on one {gpu_name}: {full}" if full else \
            "full mode on a GPU: no run recorded yet"
        out(f"This chapter on {REFERENCE_MACHINE}: CPU mode {cpu}, quick mode {quick}; {gpu}. "
            f"This process runs {self.mode} mode; cells over 30 s show a progress bar.")

    def finish(self) -> None:
        """Print how long the chapter took here (kept as ``elapsed``); returns nothing."""
        self.elapsed = self._clock() - self._start
        stated = f" (stated: {format_duration(self.expected)})" if self.expected else ""
        self._out(f"This chapter took {format_duration(self.elapsed)} here in {self.mode} mode"
                  f"{stated}.")


def start_chapter(
    cpu_seconds: float,
    quick_seconds: float,
    gpu_seconds: float | None = None,
    gpu_name: str | None = None,
) -> ChapterClock:
    """A chapter's first cell: the times it took on the reference machine, stated up front."""
    return ChapterClock(cpu_seconds, quick_seconds, gpu_seconds, gpu_name)


@contextlib.contextmanager
def elapsed_bar(desc: str) -> Iterator[None]:
    """A progress bar that counts the seconds while its body waits on other processes
    (``torchrun``, :func:`d2lgpu.runtime.distributed.launch`), which report no steps of their own::

        with elapsed_bar("torchrun, 2 ranks"):
            subprocess.run([...])

    A thread ticks the bar once a second; the body runs undisturbed in this one.
    """
    import threading

    from tqdm.auto import tqdm

    if not isinstance(desc, str) or not desc:
        raise TypeError(f"desc must be a non-empty str naming what runs, got {desc!r}")
    done = threading.Event()
    # tqdm keeps the elapsed time itself; the thread only redraws, once a second.
    with tqdm(desc=desc, bar_format="{desc}: {elapsed}") as bar:

        def tick() -> None:
            while not done.wait(1.0):
                bar.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
