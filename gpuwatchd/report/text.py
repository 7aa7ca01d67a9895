"""``gpuwatchd report``: per workload and regime, the winner and how sure we are.

Reads the store read-only (never creates or migrates it), so it is safe to point at
a live daemon's database.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from gpuwatchd.store import Store
from gpuwatchd.store.rows import StoredResult
from gpuwatchd.telemetry.types import ThrottleReason
from gpuwatchd.tuning.jobspec import stats_to_json
from gpuwatchd.tuning.types import CandidateStats, Regime
from gpuwatchd.tuning.winners import winners_differ

REPORT_FORMAT = "gpuwatchd-report/1"


def _candidate_json(c: CandidateStats) -> dict[str, Any]:
    """The worker's wire form of the statistics, plus the throttle reasons by name."""
    return {**stats_to_json(c), "throttle_reasons": ThrottleReason.decode(c.reasons).names()}


def _result_json(s: StoredResult) -> dict[str, Any]:
    r = s.result
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


def build_report(store: Store, gpu_model: str | None = None) -> dict[str, Any]:
    """The JSON document of ``report --format json``: the latest result per regime."""
    return report_from(store.latest_results(gpu_model=gpu_model))


def report_from(results: list[StoredResult]) -> dict[str, Any]:
    """The report document for these stored results (one session's, or the latest)."""
    return {
        "format": REPORT_FORMAT,
        "results": [_result_json(s) for s in results],
        "winners_differ": _differ(results),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g} ms"


def _mhz(hz: float | None) -> str:
    return "-" if hz is None else f"{hz / 1e6:.0f} MHz"


def format_report(doc: dict[str, Any]) -> str:
    """A table per workload: each regime's winner, time, margin, clock, and the flip."""
    if not doc["results"]:
        return "no tuning results yet (run `gpuwatchd tune`)"
    lines: list[str] = []
    by_workload: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in doc["results"]:
        by_workload[(r["workload"])].append(r)
    header = ["REGIME", "WINNER", "TIME", "MARGIN", "SM CLOCK", "POWER", "SAMPLES", "RUNNER-UP"]
    for workload, rows in by_workload.items():
        gpu = rows[0]["gpu_model"]
        differ = doc["winners_differ"].get(workload, False)
        flag = "  << WINNERS DIFFER BETWEEN REGIMES" if differ else ""
        lines.append(f"{workload}  ({gpu}){flag}")
        table = [header]
        for r in rows:
            cands = r["candidates"]
            best = cands[0] if cands else {}
            runner = cands[1] if len(cands) > 1 else {}
            if r["tie"]:
                winner = f"tie: {best.get('name', '-')} ~ {runner.get('name', '-')}"
            else:
                winner = r["winner"] or "-"
            margin = "-" if r["margin"] is None else f"{r['margin'] * 100:+.1f}%"
            if r["noise"] is not None:
                margin += f" (noise {r['noise'] * 100:.1f}%)"
            power = best.get("power_w")
            table.append(
                [
                    r["regime"],
                    winner,
                    _ms(best.get("median_s")),
                    margin,
                    _mhz(best.get("sm_clock_hz")),
                    "-" if power is None else f"{power:.0f} W",
                    f"{best.get('samples', 0)}/{best.get('rejected', 0)} rej",
                    f"{runner.get('name', '-')} {_ms(runner.get('median_s'))}",
                ]
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        for row in table:
            cells = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
            lines.append(("  " + cells).rstrip())
        lines.append("")
    return "\n".join(lines).rstrip()
