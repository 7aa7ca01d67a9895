"""The ``gpuwatchd`` command: assemble the subcommands' parsers and dispatch to one.

Each command is a module of this package, named after the command (``check-config`` is
``cli.check_config``), exposing ``add_parser(subparsers)`` and ``run(args) -> int`` (see
:class:`~gpuwatchd.cli.common.Command`); what they share is in ``cli.common``, which
never imports this module. A command line that names a command imports and builds only
that command's parser (the daemon pays for no other command's modules or help texts);
``--help``, ``--version`` and an unknown command build them all. A :class:`CliError` is
printed here as one line on stderr and becomes the exit status (2 bad configuration or
arguments, 1 runtime failure); Ctrl-C exits 130. A reader that leaves early (``| head``) ends the
command quietly with 141, as a shell reports a process killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import cast

from gpuwatchd import __version__
from gpuwatchd.cli.common import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, CliError, Command

#: The subcommands in the order ``gpuwatchd --help`` lists them.
COMMANDS: tuple[str, ...] = (
    "run",
    "status",
    "record",
    "tune",
    "report",
    "plot-timeline",
    "retune",
    "workloads",
    "store",
    "check-config",
)


def command_module(name: str) -> Command:
    """The module that implements command ``name`` (one of :data:`COMMANDS`)."""
    return cast(Command, importlib.import_module(f"gpuwatchd.cli.{name.replace('-', '_')}"))


def commands_for(argv: Sequence[str]) -> tuple[str, ...]:
    """The commands whose parsers ``argv`` needs: the one it names first, else all."""
    return (argv[0],) if argv and argv[0] in COMMANDS else COMMANDS


def build_parser(commands: Sequence[str] = COMMANDS) -> argparse.ArgumentParser:
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
    for name in commands:
        command_module(name).add_parser(sub)
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
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(commands_for(argv))
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CliError as exc:
        print(f"gpuwatchd: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
