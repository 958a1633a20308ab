"""Tests of d2lgpu.plotting: line plots and history plots."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from d2lgpu.plotting import plot_history, plot_lines  # noqa: E402
from d2lgpu.training import History  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_plot_lines_draws_one_line_per_series_with_its_data():
    ax = plot_lines([1, 2, 3], [[1, 4, 9], [1, 8, 27]], legend=["square", "cube"],
                    xlabel="n", ylabel="value", yscale="log", title="powers")
    lines = ax.get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[1, 4, 9], [1, 8, 27]]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["square", "cube"]
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "n" and ax.get_title() == "powers"


def test_plot_lines_accepts_a_single_series_and_an_existing_axes():
    _, ax = plt.subplots()
    assert plot_lines([0, 1], [5, 6], ax=ax) is ax
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[5, 6]]


def test_plot_lines_rejects_mismatched_input():
    with pytest.raises(ValueError, match="one y per x"):
        plot_lines([1, 2], [[1, 2, 3]])
    with pytest.raises(ValueError, match="legend"):
        plot_lines([1, 2], [[1, 2]], legend=["a", "b"])


def test_plot_history_plots_the_three_curves_per_epoch():
    history = History([1.0, 0.5], [0.6, 0.8], [0.55, 0.7], [1.0, 1.0], [10.0, 10.0], "cpu")
    ax = plot_history(history)
    lines = ax.get_lines()
    assert [list(line.get_xdata()) for line in lines] == [[1, 2]] * 3
    assert [list(line.get_ydata()) for line in lines] == [[1.0, 0.5], [0.6, 0.8], [0.55, 0.7]]
    with pytest.raises(ValueError, match="no epochs"):
        plot_history(History(device="cpu"))


def test_a_one_epoch_history_is_visible_because_every_line_has_markers():
    # One point per line: without markers matplotlib draws nothing at all.
    ax = plot_history(History([2.3], [0.1], [0.1], [1.0], [10.0], "cpu"))
    assert [line.get_marker() for line in ax.get_lines()] == ["o"] * 3
    long = plot_history(History([2.3] * 30, [0.1] * 30, [0.1] * 30, [1.0] * 30, [10.0] * 30,
                                "cpu"))
    assert all(line.get_marker() == "o" and line.get_markersize() < 5
               for line in long.get_lines())  # long lines keep their markers, smaller


def test_plot_functions_name_what_they_need():
    with pytest.raises(TypeError, match=r"history must be the d2lgpu.History"):
        plot_history(None)
    with pytest.raises(TypeError, match=r"x must be a list of numbers, got None"):
        plot_lines(None, [1.0])
    with pytest.raises(TypeError, match=r"single string"):
        plot_lines([1, 2], [[1, 2], [3, 4]], legend="ab")
    from d2lgpu.plotting import plot_precision_sweep

    with pytest.raises(TypeError, match=r"rows must be the SweepRows"):
        plot_precision_sweep([1, 2])


@pytest.mark.parametrize("kwargs, name", [
    (dict(xscale=None), "xscale"),
    (dict(yscale="logarithmic"), "yscale"),
    (dict(yscale=True), "yscale"),
])
def test_plot_lines_names_a_bad_scale(kwargs, name):
    with pytest.raises(ValueError, match=name):
        plot_lines([1, 2], [1, 2], **kwargs)
    plt.close("all")
