"""``gpuwatchd report --fleet``: the fleet as the shared store sees it.

Per GPU model and power limit, the group's median and its outliers (GPUs more than 5%
under it, in groups of 3 or more), groups with outliers first; ``--all`` lists every
host's learned sustained clock against its group's median; the winners
two hosts disagreed on; and tuning coverage (workloads with fresh winners per GPU model
and software stack). The numbers are those the daemons export and alert on
(:mod:`gpuwatchd.drift.fleet`), read from the store read-only.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from typing import Any

from gpuwatchd.drift.config import DriftConfig
from gpuwatchd.drift.fleet import (
    MIN_PEERS,
    OUTLIER_SHORTFALL,
    coverage,
    group_clocks,
)
from gpuwatchd.drift.fleet import clock_max_age_s as clock_age_rule
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.store import SqlStore
from gpuwatchd.store.rows import Disagreement, WinnerRow

FLEET_REPORT_FORMAT = "gpuwatchd-fleet-report/1"
#: Host clocks older than this are left out by default: the daemon's rule, default settings.
DEFAULT_CLOCK_MAX_AGE_S = clock_age_rule(DriftConfig(), FleetConfig())
#: Winners older than this do not count as coverage by default (``[fleet] max_winner_age_s``).
DEFAULT_WINNER_MAX_AGE_S = FleetConfig().max_winner_age_s
#: The most recent disagreements listed one by one (all are counted).
RECENT_DISAGREEMENTS = 20
TABLE_WIDTH = 100


def _disagreement_json(d: Disagreement) -> dict[str, Any]:
    doc = dataclasses.asdict(d)
    doc["regime"] = d.regime.value
    return doc


def build_fleet_report(
    store: SqlStore,
    *,
    clock_max_age_s: float = DEFAULT_CLOCK_MAX_AGE_S,
    winner_max_age_s: float = DEFAULT_WINNER_MAX_AGE_S,
    gpu_model: str | None = None,
) -> dict[str, Any]:
    """The JSON document of ``report --fleet --format json``. Raises StoreError."""
    rows = [
        r
        for r in store.host_clocks(max_age_s=clock_max_age_s)
        if gpu_model is None or r.gpu_model == gpu_model
    ]
    groups = []
    for group in group_clocks(rows).values():
        gpus = [
            {
                "host": c.host,
                "gpu_uuid": c.gpu_uuid,
                "sustained_clock_hz": c.sustained_clock_hz,
                "ratio_to_median": group.ratio(c.sustained_clock_hz),
                "outlier": group.is_outlier(c.sustained_clock_hz),
                "updated_at": c.updated_at,
            }
            for c in group.clocks
        ]
        groups.append(
            {
                "gpu_model": group.group.gpu_model,
                "power_limit_w": group.group.power_limit or None,
                "median_sustained_clock_hz": group.median_hz,
                "peers": group.peers,
                "gpus": gpus,
            }
        )
    counts = [
        {"gpu_model": m, "workload": w, "regime": r, "count": n}
        for (m, w, r), n in sorted(store.disagreement_counts().items())
        if gpu_model is None or m == gpu_model
    ]
    recent = [
        _disagreement_json(d)
        for d in store.disagreements(limit=RECENT_DISAGREEMENTS)
        if gpu_model is None or d.gpu_model == gpu_model
    ]
    models = sorted({gpu_model} if gpu_model else _models(store, rows))
    winners: list[WinnerRow] = []
    for model in models:
        winners += store.fleet_winners(model, winner_max_age_s)
    return {
        "format": FLEET_REPORT_FORMAT,
        "clock_max_age_s": clock_max_age_s,
        "winner_max_age_s": winner_max_age_s,
        "outlier_shortfall": OUTLIER_SHORTFALL,
        "min_peers": MIN_PEERS,
        "groups": groups,
        "disagreements": counts,
        "recent_disagreements": recent,
        "coverage": [
            {"gpu_model": m, "versions": v, "workloads": n}
            for (m, v), n in coverage(winners).items()
        ],
    }


def _models(store: SqlStore, rows: Sequence[Any]) -> set[str]:
    """Every GPU model with a winner or a fresh host clock."""
    return {w.gpu_model for w in store.winners()} | {r.gpu_model for r in rows}


# -- text -------------------------------------------------------------------------------


def _mhz(hz: float) -> str:
    return f"{hz / 1e6:.0f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> list[str]:
    """Rows laid out by rich in ``width`` columns (no colour, no box); the last column folds."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, show_edge=False, header_style="none")
    for i, name in enumerate(header):
        last = i == len(header) - 1
        table.add_column(name, no_wrap=not last, overflow="fold" if last else "ellipsis")
    for r in rows:
        table.add_row(*(Text(cell) for cell in r))
    buf = io.StringIO()
    Console(file=buf, width=width, no_color=True, highlight=False, emoji=False).print(table)
    return [line.rstrip() for line in buf.getvalue().splitlines()]


def _limit(power_limit_w: str | None) -> str:
    return "unknown power limit" if not power_limit_w else f"{power_limit_w} W"


def _group_name(g: dict[str, Any]) -> str:
    return f"{g['gpu_model']}, {_limit(g['power_limit_w'])}"


def _gpu_row(gpu: dict[str, Any], *model: str) -> list[str]:
    return [
        gpu["host"],
        gpu["gpu_uuid"],
        *model,
        _mhz(gpu["sustained_clock_hz"]),
        f"{gpu['ratio_to_median'] - 1:+.1%}",
        "<< OUTLIER" if gpu["outlier"] else "",
    ]


def _slowest_first(gpus: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Outliers first, then by how far under the median (a stable, readable order)."""
    return sorted(gpus, key=lambda g: (not g["outlier"], g["ratio_to_median"], g["host"]))


def _clock_lines(doc: dict[str, Any], width: int, all_gpus: bool) -> list[str]:
    """One line per group (groups with outliers first) and the outlier GPUs; with
    ``all_gpus`` every GPU of every group, outliers first."""
    shortfall = f"{doc['outlier_shortfall']:.0%}"
    lines = [f"Sustained SM clocks (<< OUTLIER: more than {shortfall} under the median)"]
    if not doc["groups"]:
        age = doc["clock_max_age_s"]
        return [*lines, f"  no host reported a learned sustained clock in the last {age:g} s", ""]
    groups = sorted(
        doc["groups"],
        key=lambda g: (-sum(gpu["outlier"] for gpu in g["gpus"]), _group_name(g)),
    )
    if all_gpus:
        for g in groups:
            few = "" if g["peers"] >= doc["min_peers"] else f"; outliers need {doc['min_peers']}+"
            lines.append(
                f"{_group_name(g)}: median {_mhz(g['median_sustained_clock_hz'])} MHz over"
                f" {g['peers']} GPU(s){few}"
            )
            rows = [_gpu_row(gpu) for gpu in _slowest_first(g["gpus"])]
            lines += _table(("HOST", "GPU", "SM MHz", "VS MEDIAN", ""), rows, width)
            lines.append("")
        return lines
    summary = []
    for g in groups:
        slowest = min(gpu["ratio_to_median"] for gpu in g["gpus"])
        outliers = sum(gpu["outlier"] for gpu in g["gpus"])
        few = g["peers"] < doc["min_peers"]
        shown = f"- (needs {doc['min_peers']}+)" if few else str(outliers)
        summary.append(
            [_group_name(g), str(g["peers"]), _mhz(g["median_sustained_clock_hz"]),
             f"{slowest - 1:+.1%}", shown]
        )  # fmt: skip
    lines += _table(("GROUP", "GPUS", "MEDIAN MHz", "SLOWEST", "OUTLIERS"), summary, width)
    outliers = [(g, gpu) for g in groups for gpu in g["gpus"] if gpu["outlier"]]
    total = sum(g["peers"] for g in groups)
    lines.append("")
    if outliers:
        lines.append(f"Outliers ({len(outliers)} of {total} GPUs), slowest first:")
        ordered = sorted(outliers, key=lambda o: (o[1]["ratio_to_median"], o[1]["host"]))
        rows = [_gpu_row(gpu, g["gpu_model"]) for g, gpu in ordered]
        lines += _table(("HOST", "GPU", "GPU MODEL", "SM MHz", "VS MEDIAN", ""), rows, width)
    else:
        lines.append(f"No outliers among {total} GPUs.")
    lines += ["(report --fleet --all lists every GPU)", ""]
    return lines


def _disagreement_lines(doc: dict[str, Any], width: int) -> list[str]:
    lines = ["Disagreements (two hosts picked different winners beyond noise)"]
    if not doc["disagreements"]:
        return [*lines, "  none recorded", ""]
    counts = [
        [d["gpu_model"], d["workload"], d["regime"], str(d["count"])] for d in doc["disagreements"]
    ]
    lines += _table(("GPU MODEL", "WORKLOAD", "REGIME", "COUNT"), counts, width)
    if doc["recent_disagreements"]:
        lines += ["", "Latest:"]
        recent = [
            [
                d["workload"],
                d["regime"],
                f"{d['kept_candidate']} ({d['kept_host']})",
                f"{d['new_candidate']} ({d['new_host']})",
                f"{d['gap']:+.1%}",
            ]
            for d in doc["recent_disagreements"]
        ]
        lines += _table(("WORKLOAD", "REGIME", "KEPT", "OTHER HOST'S PICK", "GAP"), recent, width)
    lines.append("")
    return lines


def _coverage_lines(doc: dict[str, Any], width: int) -> list[str]:
    days = doc["winner_max_age_s"] / 86400.0
    lines = [f"Tuning coverage (workloads with winners measured in the last {days:g} days)"]
    if not doc["coverage"]:
        return [*lines, "  no fresh winners"]
    rows = [[c["gpu_model"], str(c["workloads"]), c["versions"]] for c in doc["coverage"]]
    return lines + _table(("GPU MODEL", "WORKLOADS", "VERSIONS"), rows, width)


def format_fleet_report(
    doc: dict[str, Any], width: int = TABLE_WIDTH, *, all_gpus: bool = False
) -> str:
    """Clocks (a summary per group and the outliers; ``all_gpus``: every GPU),
    disagreements, coverage: one section each."""
    lines = _clock_lines(doc, width, all_gpus) + _disagreement_lines(doc, width)
    lines += _coverage_lines(doc, width)
    return "\n".join(lines).rstrip()
