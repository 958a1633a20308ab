"""benchmarks/run_notebook.py keeps committed outputs free of tqdm's note about this machine."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "run_notebook.py"
_spec = importlib.util.spec_from_file_location("run_notebook", _PATH)
run_notebook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebook)


def test_the_ipywidgets_warning_goes_and_the_bar_stays():
    warning = ("/venv/lib/python3.11/site-packages/tqdm/auto.py:21: TqdmWarning: IProgress not "
               "found. Please update jupyter and ipywidgets.\n"
               "  from .autonotebook import tqdm as notebook_tqdm\n")
    bar = "training: 100%|##########| 200/200 [00:14<00:00, 13.6it/s]\n"
    cell = {"metadata": {"tags": ["nbval-ignore-output"]},
            "outputs": [{"output_type": "stream", "name": "stderr", "text": [warning, bar]},
                        {"output_type": "stream", "name": "stderr", "text": warning},
                        {"output_type": "stream", "name": "stdout", "text": "done\n"}]}
    run_notebook.drop_widget_warning(cell)
    assert cell["outputs"] == [{"output_type": "stream", "name": "stderr", "text": bar},
                               {"output_type": "stream", "name": "stdout", "text": "done\n"}]
    checked = {"metadata": {}, "outputs": [{"output_type": "stream", "name": "stderr",
                                            "text": warning}]}
    run_notebook.drop_widget_warning(checked)  # nbval compares it with CI's run: it stays
    assert checked["outputs"][0]["text"] == warning


def test_a_text_bar_keeps_only_its_last_frame():
    frames = ("train:   0%|          | 0/3\rtrain:  33%|###3      | 1/3\r"
              "train: 100%|##########| 3/3\n")
    cell = {"metadata": {"tags": ["nbval-ignore-output"]},
            "outputs": [{"output_type": "stream", "name": "stderr", "text": [frames, "done\n"]}]}
    run_notebook.keep_last_frame(cell)
    assert cell["outputs"][0]["text"] == "train: 100%|##########| 3/3\ndone\n"
    # Frames delivered as outputs of their own (tqdm writes "\r" before each): the last stays.
    cell["outputs"] = [{"output_type": "stream", "name": "stderr", "text": "\rx:   0%| 0/3"},
                       {"output_type": "stream", "name": "stderr", "text": "\rx: 100%| 3/3"},
                       {"output_type": "stream", "name": "stderr", "text": "\n"},
                       {"output_type": "stream", "name": "stdout", "text": "loss 1.9\n"}]
    run_notebook.keep_last_frame(cell)
    assert [o["text"] for o in cell["outputs"]] == ["x: 100%| 3/3\n", "loss 1.9\n"]
    # A shell command's lines end in "\r\n" and stay whole; a bar's frames between them go.
    cell["outputs"] = [{"output_type": "stream", "name": "stderr", "text": "run: 1 s"},
                       {"output_type": "stream", "name": "stdout", "text": "step 1\r\n"},
                       {"output_type": "stream", "name": "stderr", "text": "\rrun: 2 s"},
                       {"output_type": "stream", "name": "stdout", "text": "done\r\n\r\n"},
                       {"output_type": "stream", "name": "stderr", "text": "\rrun: 3 s"},
                       {"output_type": "stream", "name": "stderr", "text": "\n"}]
    run_notebook.keep_last_frame(cell)
    assert [o["text"] for o in cell["outputs"]] == ["step 1\n", "done\n\n", "run: 3 s\n"]
    # One print in two parts, another stream's output between them: nothing is lost.
    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "the model lives on"},
                       {"output_type": "stream", "name": "stderr", "text": "note\n"},
                       {"output_type": "stream", "name": "stdout", "text": " cpu\n"}]
    run_notebook.keep_last_frame(cell)
    assert [o["text"] for o in cell["outputs"]] == ["the model lives on cpu\n", "note\n"]
    # A redraw replaces only the open line: the finished lines before it stay.
    cell["outputs"] = [{"output_type": "stream", "name": "stderr", "text": "start\nbar 1/2"},
                       {"output_type": "stream", "name": "stderr", "text": "\rbar 2/2\n"}]
    run_notebook.keep_last_frame(cell)
    assert [o["text"] for o in cell["outputs"]] == ["start\n", "bar 2/2\n"]


def _widget_bar_notebook(left: str, value: float, total: float, right: str, hidden=False):
    """A notebook holding one tqdm widget bar as nbclient stores it: a display of an HBox
    whose final state (an HTML label, a FloatProgress, an HTML label) sits in the metadata."""
    import nbformat

    states = {
        "box": {"model_name": "HBoxModel", "state": {
            "children": ["IPY_MODEL_left", "IPY_MODEL_bar", "IPY_MODEL_right"],
            "layout": "IPY_MODEL_layout"}},
        "layout": {"model_name": "LayoutModel",
                   "state": {"visibility": "hidden" if hidden else None}},
        "left": {"model_name": "HTMLModel", "state": {"value": left}},
        "bar": {"model_name": "FloatProgressModel", "state": {"value": value, "max": total}},
        "right": {"model_name": "HTMLModel", "state": {"value": right}},
    }
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": states}}
    nb.cells = [nbformat.v4.new_code_cell("for _ in tqdm(range(20)): ..."),
                nbformat.v4.new_markdown_cell("A markdown cell has no outputs, and gets none.")]
    nb.cells[0].outputs = [nbformat.v4.new_output(
        "display_data", data={"text/plain": "study runs:   0%|          | 0/20 [00:00<?, ?it/s]",
                              "application/vnd.jupyter.widget-view+json": {"model_id": "box"}})]
    return nb


def test_a_widget_bar_is_committed_with_its_last_frame_as_text():
    # tqdm.notebook writes spaces as U+2007 and escapes HTML; the text is the terminal's bar.
    nb = _widget_bar_notebook("study\u2007runs:\u2007100%", 20.0, 20.0,
                              "\u200720/20\u2007[00:49&lt;00:00,\u2007\u20072.48s/it]")
    run_notebook.finish_widget_bars(nb)
    assert nb.cells[0].outputs[0]["data"]["text/plain"] == (
        "study runs: 100%|██████████| 20/20 [00:49<00:00,  2.48s/it]")
    assert "outputs" not in nb.cells[1]
    import nbformat

    nbformat.validate(nb)
    # A bar stopped part way (an error) shows where it stopped.
    nb = _widget_bar_notebook("broken:\u2007\u200740%", 4.0, 10.0, "\u20074/10")
    run_notebook.finish_widget_bars(nb)
    assert nb.cells[0].outputs[0]["data"]["text/plain"] == "broken:  40%|████      | 4/10"
    # A bar_format without {bar} (elapsed_bar's) has only its right-hand label.
    nb = _widget_bar_notebook("", 0.0, 1.0, "torchrun,\u20072\u2007ranks:\u200700:13")
    run_notebook.finish_widget_bars(nb)
    assert nb.cells[0].outputs[0]["data"]["text/plain"] == "torchrun, 2 ranks: 00:13"


def test_a_closed_widget_bar_leaves_no_output():
    # leave=False hides the bar when it ends (JupyterLab draws nothing there) ...
    nb = _widget_bar_notebook("x:\u2007100%", 1.0, 1.0, "\u20071/1", hidden=True)
    run_notebook.finish_widget_bars(nb)
    assert nb.cells[0].outputs == []
    # ... and a bar whose state was not stored would show its 0 % frame forever.
    nb = _widget_bar_notebook("x:\u2007100%", 1.0, 1.0, "\u20071/1")
    nb.metadata["widgets"] = {}
    run_notebook.finish_widget_bars(nb)
    assert nb.cells[0].outputs == []
