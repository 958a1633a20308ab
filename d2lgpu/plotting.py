"""Plots for the course: line plots, a training history, and the precision sweep.

Everything draws with matplotlib on an explicit figure and axes (never pyplot's
"current" ones), so plots do not leak into each other between cells.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from d2lgpu.runtime.checks import check_sequence, check_str_list

#: The axis scales matplotlib offers (``ax.set_xscale``).
_SCALES = ("linear", "log", "symlog", "asinh", "logit")

if TYPE_CHECKING:
    from d2lgpu.precision import SweepRow

__all__ = ["plot_history", "plot_lines", "plot_precision_sweep"]


def _check_labels(**labels: object) -> None:
    """Axis labels and titles are text (or None): anything else would be drawn as its repr."""
    for name, value in labels.items():
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a string (or None), got {type(value).__name__} "
                            f"{value!r}")


def _check_ax(ax: object) -> None:
    if ax is not None and not hasattr(ax, "plot"):
        raise TypeError(f"ax must be a matplotlib Axes (e.g. from plt.subplots()) or None, got "
                        f"{type(ax).__name__}")


def _marker_size(points: int) -> float:
    """Every line gets markers, so that a one-point line (a one-epoch history) shows up;
    they shrink on long lines, where they would hide the line itself."""
    return 5.0 if points < 20 else 2.0


def _label_axes(ax, xlabel=None, ylabel=None, xlim=None, ylim=None, title=None,
                xscale="linear", yscale="linear") -> None:
    ax.set_xscale(xscale)
    ax.set_yscale(yscale)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if xlim:
        ax.set_xlim(*xlim)
    if ylim:
        ax.set_ylim(*ylim)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)


def plot_lines(
    x: Sequence[float],
    ys: Sequence[float] | Sequence[Sequence[float]],
    legend: Sequence[str] | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    xscale: str = "linear",
    yscale: str = "linear",
    title: str | None = None,
    ax=None,
):
    """Plot one line (``ys`` a list of numbers) or several (a list of lists) against ``x``
    (chapter 2).

    Returns the axes; pass ``ax`` to draw into an existing one (e.g. a subplot).
    """
    _check_labels(xlabel=xlabel, ylabel=ylabel, title=title)
    _check_ax(ax)
    for name, scale in (("xscale", xscale), ("yscale", yscale)):
        if not isinstance(scale, str) or scale not in _SCALES:
            raise ValueError(f"{name} must be one of {_SCALES}, got {scale!r}")
    x = check_sequence("x", x, of="numbers")
    ys_list = check_sequence("ys", ys, of="numbers (one line) or lists of numbers")
    if legend is not None:
        legend = check_str_list("legend", legend, fix="One name per line.")
    if ys_list and not isinstance(ys_list[0], (Sequence,)) and not hasattr(ys_list[0], "__len__"):
        ys_list = [ys_list]
    for y in ys_list:
        if len(y) != len(x):
            raise ValueError(f"every line needs one y per x: got {len(y)} values for {len(x)} x")
    if legend is not None and len(legend) != len(ys_list):
        raise ValueError(f"legend has {len(legend)} names for {len(ys_list)} lines")
    if ax is None:
        import matplotlib.pyplot as plt  # imported here: pyplot costs a second at import

        _, ax = plt.subplots(figsize=(5.0, 3.2))
    for i, y in enumerate(ys_list):
        ax.plot(list(x), list(y), marker="o", markersize=_marker_size(len(x)),
                label=None if legend is None else legend[i])
    _label_axes(ax, xlabel, ylabel, title=title, xscale=xscale, yscale=yscale)
    if legend is not None:
        ax.legend()
    return ax


def plot_history(history, ax=None, title: str | None = None):
    """Train loss, train accuracy and test accuracy per epoch of a :class:`d2lgpu.History`."""
    if not all(hasattr(history, f) for f in ("train_loss", "train_acc", "test_acc", "device")):
        raise TypeError(
            f"history must be the d2lgpu.History that d2lgpu.train returns, got "
            f"{type(history).__name__}"
        )
    _check_labels(title=title)
    _check_ax(ax)
    if not history.train_loss:
        raise ValueError("the history has no epochs to plot")
    epochs = list(range(1, len(history.train_loss) + 1))
    return plot_lines(
        epochs,
        [history.train_loss, history.train_acc, history.test_acc],
        legend=["train loss", "train acc", "test acc"],
        xlabel="epoch",
        title=title or history.device,
        ax=ax,
    )


def plot_precision_sweep(rows: Sequence[SweepRow], title: str | None = None):
    """Step time and memory against batch size, one line per precision mode (chapter 6).

    The classic mixed-precision figure, drawn from the rows of
    :func:`d2lgpu.precision_sweep`: a panel of median step times, a panel of the
    bytes one step saved for the backward pass (counted on every device, the CPU
    included) where any row has them, and a panel of peak GPU memory where any row
    has one (CUDA only: a CPU keeps no peak statistic). Rows that did not run
    (``"OOM"``, ``"needs CUDA"``) have no point. Returns the figure.
    """
    _check_labels(title=title)
    rows = check_sequence("rows", rows, of="SweepRow (from d2lgpu.precision_sweep)",
                          allow_empty=True)
    if not rows:
        raise ValueError("no sweep rows to plot: run d2lgpu.precision_sweep first")
    wrong = [r for r in rows if not all(
        hasattr(r, f) for f in ("mode", "ok", "batch_size", "median_seconds", "peak_memory_bytes",
                                "saved_activation_bytes")
    )]
    if wrong:
        raise TypeError(
            f"rows must be the SweepRows that d2lgpu.precision_sweep returns, got "
            f"{type(wrong[0]).__name__}"
        )
    import matplotlib.pyplot as plt  # imported here: pyplot costs a second at import

    # (what a panel shows, its y label, its title), each drawn only where some row has it.
    panels = [
        (lambda r: 1000 * r.median_seconds, "median step time (ms)", "time per training step"),
        (lambda r: None if r.saved_activation_bytes is None else r.saved_activation_bytes / 2**20,
         "MiB", "saved for the backward pass"),
        (lambda r: None if r.peak_memory_bytes is None else r.peak_memory_bytes / 2**20,
         "MiB", "peak GPU memory"),
    ]
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
        _label_axes(ax, "batch size", ylabel, title=panel_title,
                    yscale="log" if ax is axes[0][0] else "linear")
        ax.set_xscale("log", base=2)  # batch sizes double from point to point
        if ax.lines:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
