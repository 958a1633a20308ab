"""Tests of d2lgpu.plotting: line plots."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from d2lgpu.plotting import plot_lines  # noqa: E402


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


def test_every_line_has_markers_so_a_one_point_line_is_visible():
    # One point per line: without markers matplotlib draws nothing at all.
    ax = plot_lines([1], [[2.3], [0.1]])
    assert [line.get_marker() for line in ax.get_lines()] == ["o"] * 2
    long = plot_lines(list(range(30)), [[0.1] * 30])
    assert all(line.get_marker() == "o" and line.get_markersize() < 5
               for line in long.get_lines())  # long lines keep their markers, smaller
