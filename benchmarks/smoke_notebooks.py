"""Execute notebooks on copies, keep going past errors, and report every cell's wall time.

    D2LGPU_SMOKE=1 python benchmarks/smoke_notebooks.py notebooks/0*.ipynb --out smoke.md

Each notebook runs in a fresh kernel from a temporary copy (the committed one is not
touched), with ``--timeout`` seconds allowed per cell. A cell that raises is recorded
and the notebook goes on, so one run shows every failure, not just the first. Cells
tagged ``raises-exception`` (the exercises' checks, which fail until the stub above
them is written) are expected to raise and are not counted as failures.

The report (Markdown) lists per notebook its wall time, its failures with the last
lines of their tracebacks, and its slowest cells. The exit status is 1 when any
notebook had a failure, so CI and scripts can rely on it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbclient
import nbformat

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class NotebookRun:
    path: Path
    seconds: float = 0.0
    cell_seconds: list[tuple[int, float]] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)  # (cell index, last lines)
    stopped: str = ""  # why execution stopped early (a timeout, a dead kernel)


def _error_text(cell, lines: int = 6) -> str | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            trace = _ANSI.sub("", "\n".join(output.get("traceback", [])))
            tail = [line for line in trace.splitlines() if line.strip()][-lines:]
            return "\n".join(tail)
    return None


def run_notebook(path: Path, timeout: int, done: list[NotebookRun] | None = None,
                 out: Path | None = None) -> NotebookRun:
    """Execute ``path`` on a copy; after every cell, rewrite ``out`` with ``done`` + this run,
    so that a run killed from outside (``timeout``) still reports the cells it finished."""
    result = NotebookRun(path)
    started: dict[int, float] = {}

    def before(cell, cell_index, **_):
        started[cell_index] = time.perf_counter()

    def after(cell, cell_index, **_):
        result.cell_seconds.append((cell_index, time.perf_counter() - started[cell_index]))
        error = _error_text(cell)
        if error and "raises-exception" not in cell.get("metadata", {}).get("tags", []):
            result.failures.append((cell_index, error))
        result.seconds = time.perf_counter() - begin
        if out is not None:
            out.write_text(report([*(done or []), result]))

    with tempfile.TemporaryDirectory(prefix="smoke-") as scratch:
        # Run beside a copy of the notebook's folder, so relative paths and files
        # the chapter writes stay out of the checkout.
        work = Path(scratch) / path.parent.name
        shutil.copytree(path.parent, work, ignore=shutil.ignore_patterns("*.ipynb"))
        nb = nbformat.read(path, as_version=4)
        client = nbclient.NotebookClient(
            nb, timeout=timeout, kernel_name="python3", allow_errors=True,
            resources={"metadata": {"path": str(work)}},
            on_cell_execute=before, on_cell_executed=after,
        )
        begin = time.perf_counter()
        try:
            client.execute()
        except Exception as error:  # a cell timeout or a dead kernel ends the notebook
            text = str(error).strip().splitlines() or [""]
            result.stopped = f"{type(error).__name__}: {text[0][:300]}"
        result.seconds = time.perf_counter() - begin
    return result


def report(runs: list[NotebookRun], slowest: int = 3) -> str:
    lines = ["| notebook | wall s | last cell run | failures | slowest cells (index: s) |",
             "|---|---|---|---|---|"]
    for run in runs:
        top = sorted(run.cell_seconds, key=lambda c: -c[1])[:slowest]
        cells = ", ".join(f"[{i}] {s:.1f}" for i, s in top)
        failed = len(run.failures) + bool(run.stopped)
        last = f"[{run.cell_seconds[-1][0]}]" if run.cell_seconds else "none"
        lines.append(f"| {run.path.name} | {run.seconds:.0f} | {last} | {failed} | {cells} |")
    for run in runs:
        if run.stopped:
            lines += ["", f"**{run.path.name} stopped:** {run.stopped}"]
        for index, text in run.failures:
            lines += ["", f"**{run.path.name} [{index}]**", "```", text, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", type=Path, nargs="+")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell")
    parser.add_argument("--out", type=Path, help="write the Markdown report here too")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        parser.error(f"not a file: {', '.join(missing)}")
    if args.timeout < 1:
        parser.error(f"--timeout must be >= 1 second, got {args.timeout}")
    runs: list[NotebookRun] = []
    for path in args.notebooks:
        run = run_notebook(path, args.timeout, runs, args.out)
        print(f"{path.name}: {run.seconds:.0f} s, {len(run.failures)} failing cell(s)"
              + (f", stopped: {run.stopped}" if run.stopped else ""), file=sys.stderr, flush=True)
        runs.append(run)
        if args.out:  # written after every notebook, so a killed run keeps what it had
            args.out.write_text(report(runs))
    text = report(runs)
    print(text)
    return 1 if any(r.failures or r.stopped for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
