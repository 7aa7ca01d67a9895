"""``gpuwatchd plot-timeline``: clock, temperature and power of a recorded trace.

Optionally shades a store's tuning sessions (placed by the trace's unix time at t=0)
and adds a strip with the gate replayed over the samples.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from gpuwatchd.cli.common import (
    EXIT_CONFIG,
    CliError,
    Subparsers,
    add_command,
    load_with_overrides,
    open_store,
)


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "plot-timeline",
        "draw clock/temperature/power of a trace",
        "Draw one GPU of a recorded trace: SM clock, temperature and power against their\n"
        "limits, the tuning sessions of a store (and the regimes each measured) shaded on\n"
        "top, and the gate replayed over the samples below. Needs matplotlib:\n"
        "pip install 'gpuwatchd[plot]'.",
        (
            "gpuwatchd plot-timeline --trace run.jsonl --out timeline.png",
            "gpuwatchd plot-timeline --trace run.jsonl --store /var/lib/gpuwatchd/gpuwatchd.db "
            "--out timeline.png",
        ),
    )
    p.add_argument("--config", metavar="FILE", help="gate thresholds for the gate strip")
    p.add_argument("--trace", required=True, metavar="FILE", help="a gpuwatchd-trace/1 file")
    p.add_argument("--out", required=True, metavar="FILE.png", help="picture (.png, .svg, .pdf)")
    p.add_argument(
        "--store",
        metavar="PATH|URL",
        help="shade this store's tuning sessions (a SQLite file or a PostgreSQL URL)",
    )
    p.add_argument("--gpu", type=int, default=0, metavar="N", help="GPU index in the trace")
    p.add_argument("--t0-unix", type=float, metavar="S", help="unix time of the trace's t=0")
    p.add_argument("--no-gate", action="store_true", help="leave out the replayed gate strip")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Clock, temperature and power of a recorded trace, with tuning sessions and the gate."""
    from gpuwatchd.report.figure import PlotError, save_figure
    from gpuwatchd.report.timeline_plot import build_timeline_figure, trace_t0_unix
    from gpuwatchd.telemetry.trace import TraceError, load_trace

    cfg, _ = load_with_overrides(args)
    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        raise CliError(str(exc)) from None
    if args.gpu not in trace.devices:
        raise CliError(
            f"--gpu {args.gpu}: not in {args.trace} (has {sorted(trace.devices)})", EXIT_CONFIG
        )
    try:
        t0 = args.t0_unix if args.t0_unix is not None else trace_t0_unix(args.trace)
    except PlotError as exc:  # a header t0_unix that is not unix seconds
        raise CliError(str(exc)) from None
    sessions = []
    results = {}
    if args.store:
        if t0 is None:
            raise CliError(
                "--t0-unix: the trace has no t0_unix; give the unix time of its t=0", EXIT_CONFIG
            )
        store = open_store(args.store, readonly=True)
        try:
            sessions = store.sessions(limit=10_000, gpu_uuid=trace.devices[args.gpu].uuid)
            # The regimes each session measured, for the sessions the trace covers.
            samples = trace.samples.get(args.gpu) or ()
            end = t0 + (samples[-1].t if samples else 0.0)
            results = {
                s.id: store.results(s.id)
                for s in sessions
                if s.started_at <= end and (s.ended_at is None or s.ended_at >= t0)
            }
        finally:
            store.close()
    try:
        fig = build_timeline_figure(
            trace,
            sessions,
            gpu=args.gpu,
            unix_at_t0=t0,
            gate_cfg=None if args.no_gate else cfg.gate,
            results=results,
        )
        save_figure(fig, args.out)
    except PlotError as exc:
        raise CliError(str(exc)) from None
    print(f"wrote {args.out}", file=out)
    return 0
