"""``gpuwatchd report``: per workload and regime, the winner and how sure we are.

Reads the store read-only (never creates or migrates it), so it is safe to point at
a live daemon's database. Regimes are always listed unthrottled first, then sustained,
in the JSON as in the table. The table is laid out by rich (imported when one is
printed) to fit ``width`` columns: long candidate names wrap inside their cell.
"""

from __future__ import annotations

import dataclasses
import io
from collections import defaultdict
from typing import Any

from gpuwatchd.store import SqlStore
from gpuwatchd.store.rows import StoredResult
from gpuwatchd.telemetry.types import ThrottleReason
from gpuwatchd.tuning.session_spec import stats_to_json
from gpuwatchd.tuning.types import CandidateStats, Regime
from gpuwatchd.tuning.winners import job_default, winners_differ

REPORT_FORMAT = "gpuwatchd-report/1"
#: The table's width: fits an 100-column terminal or a code block in the README.
TABLE_WIDTH = 100
_REGIME_ORDER = {r.value: i for i, r in enumerate(Regime)}  # unthrottled, then sustained


def _candidate_json(c: CandidateStats) -> dict[str, Any]:
    """The worker's wire form of the statistics, plus the throttle reasons by name."""
    return {**stats_to_json(c), "throttle_reasons": ThrottleReason.decode(c.reasons).names()}


def _result_json(s: StoredResult) -> dict[str, Any]:
    r = s.result
    default, kept = job_default(r)
    return {
        "workload": r.workload,
        "regime": r.regime.value,
        "gpu_model": s.gpu_model,
        "gpu_uuid": s.gpu_uuid,
        "versions": dataclasses.asdict(s.versions),
        "session_id": s.session_id,
        "recorded_at": s.recorded_at,
        "winner": r.winner,
        "tie": r.tie,
        "margin": r.margin,
        "noise": r.noise,
        # what the job runs without gpuwatchd, and whether it stays (it won, or nothing
        # beat it beyond the noise)
        "job_default": default,
        "kept_default": kept,
        "candidates": [_candidate_json(c) for c in r.candidates],
    }


def _differ(results: list[StoredResult]) -> dict[str, bool]:
    """Per workload: do the regimes' winners differ? A tie counts as 'no evidence'."""
    by_workload: dict[str, dict[Regime, StoredResult]] = defaultdict(dict)
    for s in results:
        by_workload[s.result.workload][s.result.regime] = s
    out: dict[str, bool] = {}
    for workload, regimes in by_workload.items():
        cool = regimes.get(Regime.UNTHROTTLED)
        hot = regimes.get(Regime.SUSTAINED)
        out[workload] = winners_differ(
            cool.result.winner if cool else None, hot.result.winner if hot else None
        )
    return out


def build_report(store: SqlStore, gpu_model: str | None = None) -> dict[str, Any]:
    """The JSON document of ``report --format json``: the latest result per regime."""
    return report_from(store.latest_results(gpu_model=gpu_model))


def report_from(results: list[StoredResult]) -> dict[str, Any]:
    """The report document for these stored results (one session's, or the latest).

    Workloads keep the order they come in; within one, unthrottled comes first.
    """
    first_seen: dict[tuple[str, str], int] = {}
    for s in results:
        first_seen.setdefault((s.gpu_model, s.result.workload), len(first_seen))
    ordered = sorted(
        results,
        key=lambda s: (
            first_seen[(s.gpu_model, s.result.workload)],
            _REGIME_ORDER.get(s.result.regime.value, len(_REGIME_ORDER)),
        ),
    )
    return {
        "format": REPORT_FORMAT,
        "results": [_result_json(s) for s in ordered],
        "winners_differ": _differ(results),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g}"


def _mhz(hz: float | None) -> str:
    return "-" if hz is None else f"{hz / 1e6:.0f}"


def _row(r: dict[str, Any]) -> list[str]:
    cands = r["candidates"]
    best = cands[0] if cands else {}
    runner = cands[1] if len(cands) > 1 else {}
    # A tie: the fastest, within noise of the runner-up shown in the last column; where
    # nothing beat the job's default beyond the noise, the default it keeps.
    winner = f"tie: {best.get('name', '-')}" if r["tie"] else r["winner"] or "-"
    if r.get("kept_default"):
        winner = f"default: {r['job_default']}"
    margin = "-" if r["margin"] is None else f"{r['margin'] * 100:+.1f}%"
    if r["noise"] is not None:
        margin += f" ±{r['noise'] * 100:.1f}%"
    power = best.get("power_w")
    rejected = best.get("rejected", 0)
    return [
        r["regime"],
        winner,
        _ms(best.get("median_s")),
        margin,
        _mhz(best.get("sm_clock_hz")),
        "-" if power is None else f"{power:.0f} W",
        f"{best.get('samples', 0)}" + (f" +{rejected}" if rejected else ""),
        runner.get("name", "-"),
    ]


#: Units in the header keep the cells short; BATCHES: accepted (+rejected) of the winner.
_HEADER = ("REGIME", "WINNER", "TIME ms", "MARGIN", "SM MHz", "POWER", "BATCHES", "RUNNER-UP")
_NAMES = {"WINNER", "RUNNER-UP"}  # the only columns that wrap (folded) when space runs out


def _table(rows: list[dict[str, Any]], width: int) -> str:
    """One workload's rows, laid out by rich in ``width`` columns (no colour, no box)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, show_edge=False, header_style="none")
    for name in _HEADER:
        fold = name in _NAMES
        table.add_column(name, no_wrap=not fold, overflow="fold" if fold else "ellipsis")
    ordered = sorted(rows, key=lambda r: _REGIME_ORDER.get(r["regime"], len(_REGIME_ORDER)))
    for r in ordered:
        table.add_row(*(Text(cell) for cell in _row(r)))
    buf = io.StringIO()
    console = Console(file=buf, width=width, no_color=True, highlight=False, emoji=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def format_report(doc: dict[str, Any], width: int = TABLE_WIDTH) -> str:
    """A table per workload: each regime's winner, time, margin, clock, and the flip."""
    if not doc["results"]:
        return "no tuning results yet (run `gpuwatchd tune`)"
    lines: list[str] = []
    by_workload: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in doc["results"]:
        by_workload[r["workload"]].append(r)
    for workload, rows in by_workload.items():
        gpu = rows[0]["gpu_model"]
        differ = doc["winners_differ"].get(workload, False)
        flag = "  << WINNERS DIFFER BETWEEN REGIMES" if differ else ""
        lines.append(f"{workload}  ({gpu}){flag}")
        lines.extend(_table(rows, width).splitlines())
        lines.append("")
    return "\n".join(lines).rstrip()
