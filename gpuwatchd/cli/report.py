"""``gpuwatchd report``: the latest winners per workload and regime, as a table or JSON.

Opens the store read-only, so it is safe against a live daemon's database; ``--plot``
also draws the candidates' times (matplotlib, imported only then). The store and the
report modules are imported when the command runs (see :mod:`gpuwatchd.cli.common`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

from gpuwatchd.cli.common import (
    CONFIG_HELP,
    CliError,
    Subparsers,
    add_command,
    load_with_overrides,
    open_configured_store,
    open_store,
)


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "report",
        "per workload and regime: winners, times, clocks",
        "The latest winners per workload, unthrottled regime first, from the store (opened\n"
        "read-only: safe beside a running daemon). --plot draws every candidate's time per\n"
        "regime; it needs matplotlib: pip install 'gpuwatchd[plot]'.",
        (
            "gpuwatchd report",
            "gpuwatchd report --format json --gpu-model 'NVIDIA H200'",
            "gpuwatchd report --plot report.png",
        ),
    )
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.add_argument(
        "--store",
        metavar="PATH",
        help="SQLite store file (default: [store] url, else STATE_DIR/gpuwatchd.db)",
    )
    p.add_argument("--state-dir", metavar="DIR", help="state directory holding the store")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output")
    p.add_argument("--gpu-model", metavar="NAME", help="only this GPU model")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw the candidates' times per regime (.png, .svg or .pdf; needs the "
        "[plot] extra)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from gpuwatchd.report.text import build_report, format_report
    from gpuwatchd.store import StoreError

    if args.store:
        store = open_store(Path(args.store), readonly=True)
    else:
        cfg, _ = load_with_overrides(args)
        store = open_configured_store(cfg, readonly=True)
    try:
        doc = build_report(store, gpu_model=args.gpu_model)
    except StoreError as exc:
        raise CliError(str(exc)) from None
    finally:
        store.close()
    if args.plot:
        from gpuwatchd.report.figure import PlotError
        from gpuwatchd.report.results_plot import plot_report

        try:
            written = plot_report(doc, args.plot)
        except PlotError as exc:
            raise CliError(str(exc)) from None
        # On stderr: stdout may be the JSON document.
        print(f"wrote {written}", file=sys.stderr)
    if args.format == "json":
        print(json.dumps(doc, indent=2, sort_keys=True), file=out)
    else:
        print(format_report(doc), file=out)
    return 0
