"""Command line: ``python -m d2lgpu info`` (or ``d2lgpu info``) prints the environment
report: versions, every visible GPU, the driver's readings, and why CUDA is unusable if it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

import d2lgpu
from d2lgpu.report import environment_report, format_report


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``d2lgpu`` command."""
    parser = argparse.ArgumentParser(
        prog="d2lgpu", description="Helpers of the d2lgpu course. Start with `d2lgpu info`."
    )
    parser.add_argument("--version", action="version", version=f"d2lgpu {d2lgpu.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = commands.add_parser("info", description="Print the environment report of this machine.",
                               help="print versions, GPUs, driver readings, why CUDA is unusable")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.add_argument("--require-gpu", action="store_true",
                      help="exit with status 1 when CUDA is not usable (for scripts)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (1: ``--require-gpu`` found no usable GPU)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and usage errors (2): returned
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("d2lgpu: error: a command is required, e.g. `d2lgpu info`", file=sys.stderr)
        return 2
    report = environment_report()
    print(json.dumps(dataclasses.asdict(report), indent=2) if args.json else format_report(report))
    return 1 if args.require_gpu and not report.diagnosis.usable else 0


if __name__ == "__main__":
    sys.exit(main())
