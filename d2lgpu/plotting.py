"""Plots for the course: lines, and the precision sweep, on explicit axes (never pyplot's
"current" ones), so plots do not leak into each other between cells."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from d2lgpu.precision import SweepRow

__all__ = ["plot_lines", "plot_precision_sweep"]


def _label_axes(ax, xlabel=None, ylabel=None, title=None, xscale="linear",
                yscale="linear") -> None:
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xscale=xscale, yscale=yscale)
    ax.grid(True, alpha=0.3)


def plot_lines(x: Sequence[float], ys: Sequence[float] | Sequence[Sequence[float]],
               legend: Sequence[str] | None = None, xlabel: str | None = None,
               ylabel: str | None = None, xscale: str = "linear", yscale: str = "linear",
               title: str | None = None, ax=None):
    """Plot one line (``ys`` a list of numbers) or several (a list of lists) against ``x``
    (chapter 2); returns the axes, or draws into ``ax``."""
    ys = list(ys)
    if ys and not hasattr(ys[0], "__len__"):
        ys = [ys]
    if ax is None:
        import matplotlib.pyplot as plt  # imported here: pyplot costs a second at import

        _, ax = plt.subplots(figsize=(5.0, 3.2))
    for i, y in enumerate(ys):
        # Markers, so that a one-point line shows; smaller on long lines, not to hide them.
        ax.plot(list(x), list(y), marker="o", markersize=5.0 if len(x) < 20 else 2.0,
                label=None if legend is None else legend[i])
    _label_axes(ax, xlabel, ylabel, title, xscale, yscale)
    if legend is not None:
        ax.legend()
    return ax


def plot_precision_sweep(rows: Sequence[SweepRow], title: str | None = None):
    """Median step time, bytes saved for backward and peak GPU memory (where rows have them)
    against batch size, one line per mode that ran (chapter 6). Returns the figure."""
    import matplotlib.pyplot as plt  # imported here: pyplot costs a second at import

    # (what a panel shows, its y label, its title), each drawn only where some row has it.
    def mib(n: int | None) -> float | None:
        return None if n is None else n / 2**20

    panels = [(lambda r: 1e3 * r.median_seconds, "median step time (ms)", "time per training step"),
              (lambda r: mib(r.saved_activation_bytes), "MiB", "saved for the backward pass"),
              (lambda r: mib(r.peak_memory_bytes), "MiB", "peak GPU memory")]
    ran = [r for r in rows if r.ok]
    panels = [panel for i, panel in enumerate(panels)
              if i == 0 or any(panel[0](r) is not None for r in ran)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 1.0, 3.5),
                             squeeze=False)
    for ax, (value, ylabel, panel_title) in zip(axes[0], panels, strict=True):
        for mode in dict.fromkeys(r.mode for r in rows):  # modes in sweep order
            points = sorted((r.batch_size, value(r)) for r in ran
                            if r.mode == mode and value(r) is not None)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=mode)
        _label_axes(ax, "batch size", ylabel, panel_title,
                    yscale="log" if ax is axes[0][0] else "linear")
        ax.set_xscale("log", base=2)  # batch sizes double from point to point
        if ax.lines:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
