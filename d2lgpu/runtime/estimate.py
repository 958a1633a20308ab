"""How long will this take? The chapter's time, stated up front, and the elapsed-time bar.

:func:`start_chapter` states the chapter's time on the reference machine in its first cell;
every cell that takes longer than about 30 s shows a tqdm bar, whose ETA is measured as the
work goes (:func:`elapsed_bar` for a cell that is one long call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from time import perf_counter

__all__ = ["REFERENCE_MACHINE", "ChapterClock", "elapsed_bar", "format_duration", "start_chapter"]

def format_duration(seconds: float) -> str:
    """A rounded, readable duration: ``"8 s"``, ``"4 min"``, ``"2.5 h"``."""
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"{round(seconds)} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


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
