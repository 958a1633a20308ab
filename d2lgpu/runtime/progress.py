"""The elapsed-time bar of a cell that waits on other processes, which report no steps."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["elapsed_bar"]


@contextlib.contextmanager
def elapsed_bar(desc: str) -> Iterator[None]:
    """A bar that counts the seconds while its body waits (``torchrun``, ``launch``)."""
    from tqdm.auto import tqdm

    done = threading.Event()
    # tqdm keeps the elapsed time; the thread only redraws, once a second.
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
