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
