"""Between the store's rows and the tuning types: validate on the way in, parse on the way out.

Writes reject bad input with a one-line :class:`StoreError` naming the field. Reads
raise ``ValueError`` on a row they cannot parse; the store skips such a row with a
warning instead of failing the whole query.
"""

from __future__ import annotations

import json
import math
import sqlite3
from typing import Any, TypeVar

from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.rows import SessionMeta, SessionRow, StoredResult, WinnerRow
from gpuwatchd.tuning.types import (
    CandidateStats,
    Regime,
    RegimeResult,
    SessionStatus,
    Versions,
    Workload,
)


def dumps(value: Any, what: str) -> str:
    """Canonical JSON, or a StoreError naming ``what`` when the value is not JSON."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise StoreError(f"{what} is not JSON-serialisable: {e}") from e


def check_number(value: Any, what: str, *, integer: bool = False) -> None:
    """Finite, non-negative number (or None for floats); else a StoreError naming ``what``."""
    if value is None and not integer:
        return
    ok_type = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an integer" if integer else "a number or null"
        raise StoreError(f"{what} must be {kind}, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise StoreError(f"{what} must be finite and >= 0, got {value!r}")


def check_text(value: Any, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise StoreError(f"{what} must be a non-empty string, got {value!r}")


def check_meta(meta: SessionMeta) -> None:
    """Validate a session's meta before it is written."""
    for name in ("gpu_uuid", "gpu_model", "backend", "host"):
        check_text(getattr(meta, name), f"meta.{name}")
    check_number(meta.gpu_index, "meta.gpu_index", integer=True)
    if not isinstance(meta.versions, Versions):
        raise StoreError(f"meta.versions must be Versions, got {type(meta.versions).__name__}")
    for i, w in enumerate(meta.workloads):
        if not isinstance(w, Workload):
            raise StoreError(f"meta.workloads[{i}] must be a Workload, got {type(w).__name__}")
    for i, r in enumerate(meta.regimes):
        if not isinstance(r, Regime):
            raise StoreError(f"meta.regimes[{i}] must be a Regime, got {r!r}")
    for name in (
        "max_sm_clock_hz",
        "power_limit_w",
        "sm_clock_at_start_hz",
        "power_at_start_w",
    ):
        check_number(getattr(meta, name), f"meta.{name}")
    if meta.temp_at_start_c is not None and not _is_finite(meta.temp_at_start_c):
        raise StoreError(
            f"meta.temp_at_start_c must be a finite number, got {meta.temp_at_start_c!r}"
        )
    if meta.started_at is not None:
        check_number(meta.started_at, "meta.started_at")


def check_result(result: RegimeResult) -> None:
    """Validate a regime result before it is written; the message names the bad field."""
    check_text(result.workload, "result.workload")
    if not isinstance(result.regime, Regime):
        raise StoreError(f"result.regime must be a Regime, got {result.regime!r}")
    if not isinstance(result.tie, bool):
        raise StoreError(f"result.tie must be a bool, got {result.tie!r}")
    if result.margin is not None and not _is_finite(result.margin):
        raise StoreError(f"result.margin must be a finite number or null, got {result.margin!r}")
    check_number(result.noise, "result.noise")
    names: set[str] = set()
    for i, c in enumerate(result.candidates):
        where = f"result.candidates[{i}]"
        if not isinstance(c, CandidateStats):
            raise StoreError(f"{where} must be CandidateStats, got {type(c).__name__}")
        check_text(c.name, f"{where}.name")
        check_text(c.family, f"{where}.family")
        if c.name in names:
            raise StoreError(f"{where}.name {c.name!r} appears twice")
        names.add(c.name)
        if c.regime != result.regime:
            raise StoreError(f"{where}.regime is {c.regime!r}, the result's is {result.regime!r}")
        for name in ("median_s", "spread", "sm_clock_hz", "power_w", "energy_j_per_call"):
            check_number(getattr(c, name), f"{where}.{name}")
        if c.temp_c is not None and not _is_finite(c.temp_c):
            raise StoreError(f"{where}.temp_c must be a finite number, got {c.temp_c!r}")
        for name in ("samples", "rejected", "reasons"):
            check_number(getattr(c, name), f"{where}.{name}", integer=True)
        dumps(c.meta, f"{where}.meta")
    if result.winner is not None and result.winner not in names:
        raise StoreError(f"result.winner {result.winner!r} is not one of its candidates")


# -- reading -------------------------------------------------------------------------------


def _is_finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _opt_float(row: sqlite3.Row, col: str) -> float | None:
    v = row[col]
    if v is None:
        return None
    if not _is_finite(v):
        raise ValueError(f"{col} is not a finite number: {v!r}")
    return float(v)


def _float(row: sqlite3.Row, col: str) -> float:
    v = _opt_float(row, col)
    if v is None:
        raise ValueError(f"{col} is null")
    return v


def _int(row: sqlite3.Row, col: str) -> int:
    v = row[col]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{col} is not an integer: {v!r}")
    return v


def _text(row: sqlite3.Row, col: str) -> str:
    v = row[col]
    if not isinstance(v, str):
        raise ValueError(f"{col} is not text: {v!r}")
    return v


def _opt_text(row: sqlite3.Row, col: str) -> str | None:
    return None if row[col] is None else _text(row, col)


def _json(row: sqlite3.Row, col: str) -> Any:
    try:
        return json.loads(_text(row, col))
    except json.JSONDecodeError as e:
        raise ValueError(f"{col} is not JSON: {e}") from e


_E = TypeVar("_E", Regime, SessionStatus)


def _enum(cls: type[_E], value: Any, col: str) -> _E:
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{col} has unknown value {value!r}") from None


def _versions(row: sqlite3.Row, col: str = "versions_json") -> Versions:
    return Versions.from_json(_json(row, col))


def session_from_row(row: sqlite3.Row) -> SessionRow:
    workloads_raw = _json(row, "workloads_json")
    regimes_raw = _json(row, "regimes_json")
    extra = _json(row, "extra_json")
    if not isinstance(workloads_raw, list) or not isinstance(regimes_raw, list):
        raise ValueError("workloads_json and regimes_json must be lists")
    if not isinstance(extra, dict):
        raise ValueError("extra_json must be an object")
    try:
        workloads = tuple(Workload.from_json(w) for w in workloads_raw)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"workloads_json has a bad workload: {e!r}") from e
    meta = SessionMeta(
        gpu_uuid=_text(row, "gpu_uuid"),
        gpu_index=_int(row, "gpu_index"),
        gpu_model=_text(row, "gpu_model"),
        backend=_text(row, "backend"),
        workloads=workloads,
        regimes=tuple(_enum(Regime, r, "regimes_json") for r in regimes_raw),
        versions=_versions(row),
        host=_text(row, "host"),
        started_at=_float(row, "started_at"),
        max_sm_clock_hz=_opt_float(row, "max_sm_clock_hz"),
        power_limit_w=_opt_float(row, "power_limit_w"),
        sm_clock_at_start_hz=_opt_float(row, "sm_clock_at_start_hz"),
        temp_at_start_c=_opt_float(row, "temp_at_start_c"),
        power_at_start_w=_opt_float(row, "power_at_start_w"),
        extra=extra,
    )
    return SessionRow(
        id=_int(row, "id"),
        meta=meta,
        status=_enum(SessionStatus, row["status"], "status"),
        why=_opt_text(row, "why"),
        ended_at=_opt_float(row, "ended_at"),
    )


def candidate_from_row(row: sqlite3.Row, regime: Regime) -> CandidateStats:
    meta = _json(row, "meta_json")
    if not isinstance(meta, dict):
        raise ValueError("meta_json must be an object")
    return CandidateStats(
        name=_text(row, "candidate"),
        family=_text(row, "family"),
        regime=regime,
        median_s=_opt_float(row, "median_s"),
        spread=_opt_float(row, "spread"),
        samples=_int(row, "samples"),
        rejected=_int(row, "rejected"),
        sm_clock_hz=_opt_float(row, "sm_clock_hz"),
        power_w=_opt_float(row, "power_w"),
        temp_c=_opt_float(row, "temp_c"),
        energy_j_per_call=_opt_float(row, "energy_j_per_call"),
        reasons=_int(row, "reasons"),
        meta=meta,
    )


def result_regime(row: sqlite3.Row) -> Regime:
    return _enum(Regime, row["regime"], "regime")


def result_from_rows(row: sqlite3.Row, candidates: tuple[CandidateStats, ...]) -> StoredResult:
    """A result row (joined with its session's gpu_model, gpu_uuid, versions_json)."""
    return StoredResult(
        session_id=_int(row, "session_id"),
        gpu_model=_text(row, "gpu_model"),
        gpu_uuid=_text(row, "gpu_uuid"),
        versions=_versions(row),
        recorded_at=_float(row, "recorded_at"),
        result=RegimeResult(
            workload=_text(row, "workload"),
            regime=result_regime(row),
            candidates=candidates,
            winner=_opt_text(row, "winner"),
            tie=bool(_int(row, "tie")),
            margin=_opt_float(row, "margin"),
            noise=_opt_float(row, "noise"),
        ),
    )


def winner_from_row(row: sqlite3.Row) -> WinnerRow:
    return WinnerRow(
        gpu_model=_text(row, "gpu_model"),
        versions=_versions(row, "versions_key"),
        workload=_text(row, "workload"),
        regime=_enum(Regime, row["regime"], "regime"),
        candidate=_text(row, "candidate"),
        family=_text(row, "family"),
        median_s=_opt_float(row, "median_s"),
        sm_clock_hz=_opt_float(row, "sm_clock_hz"),
        margin=_opt_float(row, "margin"),
        tie=bool(_int(row, "tie")),
        session_id=_int(row, "session_id"),
        gpu_uuid=_text(row, "gpu_uuid"),
        measured_at=_float(row, "measured_at"),
    )
