"""The ``gpuwatchd`` command: assemble the subcommands' parsers and dispatch to one.

Each command is a module of this package exposing ``add_parser(subparsers)`` and
``run(args) -> int`` (see :class:`~gpuwatchd.cli.common.Command`); what they share is
in ``cli.common``, which never imports this module. A :class:`CliError` is printed here
as one line on stderr and becomes the exit status (2 bad configuration or arguments,
1 runtime failure); Ctrl-C exits 130. A reader that leaves early (``| head``) ends the
command quietly with 141, as a shell reports a process killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from gpuwatchd import __version__
from gpuwatchd.cli import (
    check_config,
    plot_timeline,
    record,
    report,
    retune,
    run,
    status,
    store,
    tune,
    workloads,
)
from gpuwatchd.cli.common import EXIT_BROKEN_PIPE, CliError, Command

#: The subcommands in the order ``gpuwatchd --help`` lists them.
COMMANDS: tuple[Command, ...] = (
    run,
    status,
    record,
    tune,
    report,
    plot_timeline,
    retune,
    workloads,
    store,
    check_config,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuwatchd",
        description="Thermal-aware GPU profiling daemon: telemetry, gate, gated autotuning.",
        epilog="`gpuwatchd COMMAND --help` describes a command, its defaults and examples.\n"
        "Try it without a GPU: gpuwatchd tune --backend sim --scenario power-cap "
        "--workload sim-gemm",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpuwatchd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _dispatch(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        # Nobody reads the rest: point stdout at /dev/null so the exit's flush is quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CliError as exc:
        print(f"gpuwatchd: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
