"""``gpuwatchd report``: the latest winners per workload and regime, as a table or JSON.

Opens the store read-only, so it is safe against a live daemon's database; ``--plot``
also draws the candidates' times (matplotlib, imported only then); ``--fleet`` reports
the shared store's fleet instead: hosts' sustained clocks against their fleet's median,
disagreements, tuning coverage. The store and the report modules are imported when the
command runs (see :mod:`gpuwatchd.cli.common`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from gpuwatchd.cli.common import (
    CONFIG_HELP,
    EXIT_CONFIG,
    CliError,
    Subparsers,
    add_command,
    load_with_overrides,
    open_configured_store,
    open_store,
    open_store_to_read,
)


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "report",
        "per workload and regime: winners, times, clocks",
        "The latest winners per workload, unthrottled regime first, from the store (opened\n"
        "read-only: safe beside a running daemon). --plot draws every candidate's time per\n"
        "regime; it needs matplotlib: pip install 'gpuwatchd[plot]'. --fleet reports the\n"
        "fleet instead: per GPU model and power limit each host's sustained clock against\n"
        "the median (outliers marked), winners two hosts disagreed on, tuning coverage.",
        (
            "gpuwatchd report",
            "gpuwatchd report --format json --gpu-model 'NVIDIA H200'",
            "gpuwatchd report --plot report.png",
            "gpuwatchd report --fleet",
            "gpuwatchd report --fleet --all",
            "PGPASSWORD=... gpuwatchd report --fleet --store postgresql://gpuwatchd@db/gpuwatchd",
        ),
    )
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.add_argument(
        "--store",
        metavar="PATH|URL",
        help="SQLite store file, or a PostgreSQL URL or key=value string without a password "
        "(libpq reads it from PGPASSWORD or ~/.pgpass; default: $GPUWATCHD_STORE, [store] "
        "url, else the first of STATE_DIR/gpuwatchd.db, /var/lib/gpuwatchd/gpuwatchd.db and "
        "a simulated daemon's store)",
    )
    p.add_argument("--state-dir", metavar="DIR", help="state directory holding the store")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output")
    p.add_argument("--gpu-model", metavar="NAME", help="only this GPU model")
    p.add_argument(
        "--fleet",
        action="store_true",
        help="report the fleet: hosts' sustained clocks vs the median, disagreements, coverage",
    )
    p.add_argument(
        "--all",
        action="store_true",
        dest="all_gpus",
        help="with --fleet: list every GPU's clock (default: a line per group and the outliers)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw the candidates' times per regime (.png, .svg or .pdf; needs the "
        "[plot] extra)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from gpuwatchd.report.text import build_report, format_report
    from gpuwatchd.store import StoreError

    out = out if out is not None else sys.stdout  # looked up now: tests replace it

    if args.fleet:
        return run_fleet(args, out)
    if args.store:
        store = open_store(args.store, readonly=True)
    else:
        cfg, _ = load_with_overrides(args)
        store = open_store_to_read(cfg)
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


def run_fleet(args: argparse.Namespace, out: TextIO) -> int:
    """``report --fleet``: the fleet document, with the ages the daemon's config uses."""
    from gpuwatchd.drift.fleet import clock_max_age_s
    from gpuwatchd.report.fleet import (
        DEFAULT_CLOCK_MAX_AGE_S,
        DEFAULT_WINNER_MAX_AGE_S,
        build_fleet_report,
        format_fleet_report,
    )
    from gpuwatchd.store import StoreError

    if args.plot:
        raise CliError(
            "--plot draws one host's candidates; it does not combine with --fleet", EXIT_CONFIG
        )
    clock_age, winner_age = DEFAULT_CLOCK_MAX_AGE_S, DEFAULT_WINNER_MAX_AGE_S
    if args.store:
        store = open_store(args.store, readonly=True)
    else:
        cfg, _ = load_with_overrides(args)
        clock_age = clock_max_age_s(cfg.drift, cfg.fleet)
        winner_age = cfg.fleet.max_winner_age_s
        store = open_configured_store(cfg, readonly=True)
    try:
        doc = build_fleet_report(
            store,
            clock_max_age_s=clock_age,
            winner_max_age_s=winner_age,
            gpu_model=args.gpu_model,
        )
    except StoreError as exc:
        raise CliError(str(exc)) from None
    finally:
        store.close()
    if args.format == "json":
        print(json.dumps(doc, indent=2, sort_keys=True), file=out)
    else:
        print(format_fleet_report(doc, all_gpus=args.all_gpus), file=out)
    return 0
