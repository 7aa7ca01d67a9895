"""``gpuwatchd record``: write a gpuwatchd-trace/1 file from any telemetry backend.

The trace replays later with ``--backend replay`` and draws with ``plot-timeline``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuwatchd.cli.common import (
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    CliError,
    Subparsers,
    add_backend_args,
    add_command,
    load_with_overrides,
)


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "record",
        "record a gpuwatchd-trace/1 file from any backend",
        "Sample every GPU of the backend for --duration seconds of real time and write a\n"
        "trace: replay it with --backend replay, draw it with plot-timeline. Shows its\n"
        "progress on stderr while it records.",
        (
            "gpuwatchd record --duration 60 --out run.jsonl",
            "gpuwatchd record --backend sim --scenario heat-soak --speed 30 --duration 20 "
            "--out soak.jsonl",
        ),
    )
    add_backend_args(p)
    p.add_argument("--out", required=True, metavar="FILE", help="trace file to write")
    p.add_argument("--duration", type=float, required=True, metavar="S", help="seconds to record")
    p.add_argument("--interval", type=float, default=0.05, metavar="S", help="sample period")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from gpuwatchd.telemetry.backend import BackendUnavailable
    from gpuwatchd.telemetry.factory import open_backend
    from gpuwatchd.telemetry.record import record_trace
    from gpuwatchd.telemetry.trace import TraceError
    from gpuwatchd.validate import need_duration

    cfg, _ = load_with_overrides(args)
    parent = Path(args.out).parent
    if not parent.is_dir():  # a typo must not create directories anywhere, / included
        raise CliError(f"--out {args.out}: no directory {parent}; create it first", EXIT_CONFIG)
    for flag, value, least in (
        ("--duration", args.duration, 0.0),
        ("--interval", args.interval, 0.001),
    ):
        try:
            need_duration(value, flag, minimum=least)
        except ValueError as exc:
            raise CliError(str(exc), EXIT_CONFIG) from None
        if not value > 0:
            raise CliError(f"{flag}: must be > 0, got {value}", EXIT_CONFIG)
    try:
        backend = open_backend(cfg.backend_spec())
    except TraceError as exc:  # a bad --trace is a bad argument
        raise CliError(str(exc), EXIT_CONFIG) from None
    except BackendUnavailable as exc:
        raise CliError(str(exc)) from None
    from gpuwatchd.cli.progress import clock_text
    from gpuwatchd.cli.record_progress import RecordProgress

    progress = RecordProgress(sys.stderr, args.duration)
    try:
        n = record_trace(
            backend,
            args.out,
            duration_s=args.duration,
            period_s=args.interval,
            on_sample=progress,
        )
    except OSError as exc:
        raise CliError(f"{args.out}: {exc.strerror or exc}") from None
    except KeyboardInterrupt:
        progress.finish()
        print(
            f"recording cut short after {clock_text(progress.elapsed_s)} of "
            f"{clock_text(args.duration)}: wrote {progress.count} samples to {args.out}",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    finally:
        progress.finish()
        backend.close()
    print(f"wrote {n} samples to {args.out}", file=sys.stderr)
    return 0
