"""How long will this take? One line, measured on this machine, before a long run gets going.

A chapter that trains for minutes should say so before the learner waits. The
estimate is measured, not guessed: :class:`StepEstimate` times a few steps of the
run itself (leaving out the first, which pays one-off costs such as memory
allocation, cuDNN autotuning or worker start-up) and multiplies by the number of
steps. It prints once, and only when the whole run will take long enough to be
worth announcing::

    3 epochs x 235 batches: about 4 min on this machine (timed on batches 2-6)

:func:`d2lgpu.train` and :func:`d2lgpu.train_fast` create one per run through
:func:`training_estimate`; other long cells call :func:`announce` with an estimate
of their own.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from numbers import Real
from time import perf_counter

from d2lgpu.runtime.checks import check_positive_int

__all__ = [
    "MIN_SECONDS_TO_ANNOUNCE",
    "REFERENCE_MACHINE",
    "ChapterClock",
    "StepEstimate",
    "announce",
    "estimate_message",
    "start_chapter",
    "training_estimate",
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


class StepEstimate:
    """Times a few steps of a run and announces, once, how long all its steps will take.

    Call :meth:`step` after every step. Step 1 is not timed (``skip=1``): it pays
    one-off costs. The next ``sample`` steps are, and their mean time times
    ``total_steps`` is the estimate, printed only when it reaches ``min_seconds``.
    ``sync`` is called just before each clock reading where the work is
    asynchronous (``torch.cuda.synchronize`` on a GPU), so the clock sees finished
    steps, not queued ones. ``clock`` (default ``time.perf_counter``) and ``out`` are
    there for tests.
    ``total_steps=None`` (a run of unknown length) never estimates.
    """

    def __init__(
        self,
        what: str,
        total_steps: int | None,
        unit: str = "batches",
        *,
        sample: int = 5,
        skip: int = 1,
        min_seconds: float = MIN_SECONDS_TO_ANNOUNCE,
        sync: Callable[[], object] | None = None,
        clock: Callable[[], float] | None = None,
        out: Callable[[str], object] = print,
    ) -> None:
        _check_text("what", what)
        _check_text("unit", unit)
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
            raise ValueError(f"need sample >= 1 (an int), got {sample!r}")
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ValueError(f"skip must be an int >= 0, got {skip!r}")
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0
        ):
            raise ValueError(f"total_steps must be an int >= 0 or None, got {total_steps!r}")
        _check_seconds("min_seconds", min_seconds)
        for name, fn in (("sync", sync), ("clock", clock), ("out", out)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
        self.what = what
        self.total_steps = total_steps
        self.unit = unit
        self.skip = skip
        # A run shorter than skip + sample is timed on the steps it has.
        self.sample = sample if total_steps is None else min(sample, total_steps - skip)
        self.min_seconds = min_seconds
        self._sync = sync
        self._clock = clock or perf_counter
        self._out = out
        self.steps_done = 0
        self.seconds: float | None = None  # the estimate, once made
        self._started: float | None = None
        if total_steps is not None and self.sample >= 1 and skip == 0:
            self._started = self._now()

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return self._clock()

    def step(self) -> None:
        """Record one finished step; after the sampled ones, estimate (and maybe announce)."""
        self.steps_done += 1
        if self.seconds is not None or self.total_steps is None or self.sample < 1:
            return
        if self.steps_done == self.skip:
            self._started = self._now()
        elif self.steps_done == self.skip + self.sample and self._started is not None:
            per_step = (self._now() - self._started) / self.sample
            self.seconds = per_step * self.total_steps
            first, last = self.skip + 1, self.skip + self.sample
            steps = f"{self.unit} {first}-{last}" if last > first else f"{self.unit} {first}"
            announce(self.what, self.seconds, f"timed on {steps}",
                     min_seconds=self.min_seconds, out=self._out)


def training_estimate(train_iter: Iterable, num_epochs: int, device) -> StepEstimate:
    """The estimate of a training run of ``num_epochs`` over ``train_iter`` on ``device``.

    A loader without a length gives an estimate that stays silent. On a CUDA
    device the two clock readings synchronise, so they time finished steps.
    """
    check_positive_int("num_epochs", num_epochs)
    if device is not None:
        from d2lgpu.runtime.gpus import as_device  # imported here: this module stays light

        device = as_device(device)
    if train_iter is None or isinstance(train_iter, (str, bytes)) or not hasattr(
        train_iter, "__iter__"
    ):
        raise TypeError(
            f"train_iter must be the loader the run reads (e.g. a DataLoader), got "
            f"{type(train_iter).__name__}"
        )
    batches = len(train_iter) if hasattr(train_iter, "__len__") else None
    total = None if batches is None else batches * num_epochs
    sync = None
    if getattr(device, "type", None) == "cuda":
        import torch

        def sync() -> None:
            torch.cuda.synchronize(device)

    what = f"{num_epochs} epoch{'s' if num_epochs != 1 else ''} x {batches} batches"
    return StepEstimate(what, total, "batches", sync=sync)


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
