"""Execute a notebook in place and keep its outputs (``--timeout S`` per cell).

Cells tagged ``raises-exception`` (the exercises' checks, which fail until the learner
has written the stub above them) are run and left without output.

Uses nbclient (installed by the ``dev`` extra), so a machine needs no full Jupyter to
refresh a chapter's committed outputs. The outputs written so far are saved even when a
cell fails, so the error can be read in the notebook.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import sys
import time
from pathlib import Path

import nbclient
import nbformat
from tqdm.std import Bar

# tqdm.auto draws a widget bar where ipywidgets is installed (a learner's JupyterLab with the
# course extra, Colab, Kaggle) and a text bar on stderr where it is not, warning once. Run
# with ipywidgets (the course extra), the committed notebook keeps the widgets' final state
# (nbclient's store_widget_state), so JupyterLab redraws each bar as it ended; readers that
# draw no widgets (GitHub) show the output's text/plain, which final_bar_text sets to the
# bar's last frame instead of the 0 % frame it was displayed with. Without ipywidgets only
# ignored cells lose the warning: a checked cell must show what CI's run shows.
_WIDGET_WARNING = ("TqdmWarning: IProgress not found",
                   "from .autonotebook import tqdm as notebook_tqdm")
_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def final_bar_text(hbox: str, states: dict) -> str | None:
    """The text a finished tqdm widget bar shows: its left label, the bar drawn as tqdm draws
    it on a terminal, and its right label (tqdm.notebook splits the same frame into three
    widgets). None when the model is not tqdm's three-part box."""
    children = states.get(hbox, {}).get("state", {}).get("children", [])
    parts = [states.get(child.removeprefix("IPY_MODEL_"), {}) for child in children]
    if [p.get("model_name") for p in parts] != ["HTMLModel", "FloatProgressModel", "HTMLModel"]:
        return None
    left, progress, right = (p["state"] for p in parts)
    def text(label):
        return html.unescape(label.get("value", "")).replace("\u2007", " ")
    if not text(left):  # a bar_format without {bar}, e.g. "{desc}: {elapsed}"
        return text(right)
    fraction = progress["value"] / progress["max"] if progress.get("max") else 0.0
    return f"{text(left)}|{Bar(min(max(fraction, 0.0), 1.0), 10)}|{text(right)}"


def finish_widget_bars(nb) -> None:
    """Give every stored widget bar its final frame as text/plain; drop the output of a bar
    whose state is gone (closed with leave=False: JupyterLab shows nothing there)."""
    states = nb.metadata.get("widgets", {}).get(_WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.outputs:
            view = output.get("data", {}).get(_WIDGET_VIEW)
            if view is None:
                kept.append(output)
                continue
            box = states.get(view["model_id"], {}).get("state", {})
            layout = states.get(box.get("layout", "").removeprefix("IPY_MODEL_"), {})
            if not box or layout.get("state", {}).get("visibility") == "hidden":
                continue
            final = final_bar_text(view["model_id"], states)
            if final is not None:
                output["data"]["text/plain"] = final
            kept.append(output)
        cell["outputs"] = kept


def drop_widget_warning(cell) -> None:
    """Remove tqdm's "IProgress not found" warning from the stderr of a cell tagged
    ``nbval-ignore-output``."""
    if "nbval-ignore-output" not in cell.get("metadata", {}).get("tags", []):
        return
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream" and output.get("name") == "stderr":
            text = output["text"] if isinstance(output["text"], str) else "".join(output["text"])
            kept = [line for line in text.splitlines(keepends=True)
                    if not any(marker in line for marker in _WIDGET_WARNING)]
            output["text"] = "".join(kept)
    cell["outputs"] = [o for o in cell.get("outputs", [])
                       if not (o.get("output_type") == "stream" and not o.get("text"))]


def _last_frame(line: str) -> str:
    """What a terminal shows of one line: the text after its last carriage return. A line
    that ends in "\r\n" (a shell command's output, through a pseudo-terminal) ends there."""
    body, end = line, ""
    for ending in ("\r\n", "\n"):
        if line.endswith(ending):
            body, end = line[: -len(ending)], "\n"
            break
    return body.rsplit("\r", 1)[-1] + end


def _frames(text: str) -> str:
    return "".join(_last_frame(line) for line in text.splitlines(keepends=True))


def keep_last_frame(cell) -> None:
    """Keep only the last frame of each text progress bar in an ignored cell's output.

    A text bar redraws itself after a carriage return, and the kernel may deliver each frame
    as an output of its own, between the outputs of the other stream (a shell command's
    lines, say); a reader of the committed notebook that does not redraw (GitHub) would show
    every frame, from 0 % on. An output that starts with a carriage return redraws the line
    its stream left open; one that does not continues it (one print can arrive in two
    parts, "the model lives on" and " cpu\n", and both parts stay)."""
    if "nbval-ignore-output" not in cell.get("metadata", {}).get("tags", []):
        return
    kept = []
    unfinished = {}  # stream name -> its last output, when that ends inside a line
    for output in cell.get("outputs", []):
        if output.get("output_type") != "stream":
            kept.append(output)
            continue
        raw = output["text"] if isinstance(output["text"], str) else "".join(output["text"])
        earlier = unfinished.pop(output["name"], None)
        if earlier is not None and not raw.startswith("\r"):
            earlier["text"] = _frames(earlier["text"] + raw)  # the rest of its open line
            last = earlier
        else:
            if earlier is not None:  # a bar's new frame: the open line's old frame goes
                earlier["text"] = earlier["text"][: earlier["text"].rfind("\n") + 1]
            output["text"] = _frames(raw)
            kept.append(output)
            last = output
        if last["text"] and not last["text"].endswith("\n"):
            unfinished[last["name"]] = last
    cell["outputs"] = [o for o in kept if o.get("output_type") != "stream" or o["text"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per cell")
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        parser.error(f"{args.notebook} is not a file: pass a notebook such as "
                     "notebooks/01_cuda_checks.ipynb")
    if args.timeout < 1:
        parser.error(f"--timeout must be >= 1 second, got {args.timeout}")
    if importlib.util.find_spec("ipywidgets") is None:
        print("note: ipywidgets is not installed, so the progress bars are committed as text "
              "on stderr; install the course extra for widget bars", file=sys.stderr)
    nb = nbformat.read(args.notebook, as_version=4)
    nb.metadata.pop("widgets", None)  # the last run's; this run stores its own
    client = nbclient.NotebookClient(
        nb, timeout=args.timeout, kernel_name="python3",
        resources={"metadata": {"path": str(args.notebook.parent)}},
    )
    start = time.perf_counter()
    try:
        client.execute()
    finally:
        for cell in nb.cells:
            # An exercise's check cell (tagged raises-exception) fails until the learner
            # writes the stub above it: the chapter is committed as the learner finds it,
            # the check not yet run. tests/test_exercises.py runs it and expects the failure.
            if "raises-exception" in cell.get("metadata", {}).get("tags", []):
                cell.outputs, cell.execution_count = [], None
            drop_widget_warning(cell)
            keep_last_frame(cell)
        finish_widget_bars(nb)
        nbformat.write(nb, args.notebook)
    print(f"executed {args.notebook} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
