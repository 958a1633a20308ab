"""Execute a notebook in place and keep its outputs (``--timeout S`` per cell).

Cells tagged ``raises-exception`` (the exercises' checks, which fail until the learner
has written the stub above them) are run and left without output.

Uses nbclient (installed by the ``dev`` extra), so a machine needs no full Jupyter to
refresh a chapter's committed outputs. The outputs written so far are saved even when a
cell fails, so the error can be read in the notebook.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbclient
import nbformat

# tqdm.auto draws a widget bar where ipywidgets is installed (a learner's JupyterLab with the
# course extra) and a text bar where it is not, warning once. The committed outputs keep the
# text bars, which show the final count on GitHub; the warning is about this machine. Only
# cells whose output nbval ignores lose it: a checked cell must show what CI's run shows.
_WIDGET_WARNING = ("TqdmWarning: IProgress not found",
                   "from .autonotebook import tqdm as notebook_tqdm")


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
    nb = nbformat.read(args.notebook, as_version=4)
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
        nbformat.write(nb, args.notebook)
    print(f"executed {args.notebook} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
