"""A progress bar for a cell that waits on other processes.

Every cell that takes longer than about 30 s shows a tqdm bar, whose ETA tqdm measures as
the work goes. A cell that is one long call into other processes (``torchrun``,
:func:`d2lgpu.runtime.distributed.launch`) has no steps to count: :func:`elapsed_bar` shows
its elapsed time instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["elapsed_bar"]


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
