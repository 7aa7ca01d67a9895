"""Between the store's rows and the tuning types: validate on the way in, parse on the way out.

Writes reject bad input with a one-line :class:`StoreError` naming the field. Reads
raise ``ValueError`` on a row they cannot parse; the store skips such a row with a
warning instead of failing the whole query.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

from gpuwatchd.store import row_values
from gpuwatchd.store.disagreement import Incumbent
from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.rows import (
    Claim,
    Disagreement,
    HostClock,
    SessionMeta,
    SessionRow,
    StoredResult,
    WinnerRow,
)
from gpuwatchd.tuning.families.inductor_mm import FAMILY as INDUCTOR_FAMILY
from gpuwatchd.tuning.types import (
    CandidateStats,
    Regime,
    RegimeResult,
    SessionStatus,
    Versions,
    Workload,
)
from gpuwatchd.validate import (
    fail,
    field_error,
    is_finite,
    need_bool,
    need_int,
    need_number,
    need_text,
    one_line,
    require,
)

#: Called with (table, key, error) for a stored row that cannot be parsed: the store
#: skips it with a warning (:meth:`~gpuwatchd.store.transactions.Transactions.skip`).
Skip = Callable[[str, object, Exception], None]


def dumps(value: Any, what: str) -> str:
    """Canonical JSON, or a StoreError naming ``what`` when the value is not JSON."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise StoreError(f"{what}: not JSON-serialisable ({one_line(e)})") from e


def check_number(value: Any, what: str, *, integer: bool = False) -> None:
    """Finite, non-negative number (or None for floats); else a StoreError naming ``what``."""
    if integer:
        need_int(value, what, minimum=0, error=StoreError)
    elif value is not None:
        need_number(value, what, minimum=0, error=StoreError)


def check_signed(value: Any, what: str) -> None:
    """A finite number of either sign, or None (temperatures, margins)."""
    if value is not None:
        need_number(value, what, error=StoreError)


def check_text(value: Any, what: str) -> None:
    need_text(value, what, error=StoreError)


def _fail(what: str, expected: str, value: Any) -> StoreError:
    return StoreError(field_error(what, expected, value))


def check_meta(meta: SessionMeta) -> None:
    """Validate a session's meta before it is written."""
    for name in ("gpu_uuid", "gpu_model", "backend", "host"):
        check_text(getattr(meta, name), f"meta.{name}")
    check_number(meta.gpu_index, "meta.gpu_index", integer=True)
    if not isinstance(meta.versions, Versions):
        raise _fail("meta.versions", "expected Versions", meta.versions)
    for i, w in enumerate(meta.workloads):
        if not isinstance(w, Workload):
            raise _fail(f"meta.workloads[{i}]", "expected a Workload", w)
    for i, r in enumerate(meta.regimes):
        if not isinstance(r, Regime):
            raise _fail(f"meta.regimes[{i}]", "expected a Regime", r)
    for name in (
        "max_sm_clock_hz",
        "power_limit_w",
        "sm_clock_at_start_hz",
        "power_at_start_w",
    ):
        check_number(getattr(meta, name), f"meta.{name}")
    check_signed(meta.temp_at_start_c, "meta.temp_at_start_c")
    if meta.started_at is not None:
        check_number(meta.started_at, "meta.started_at")


def check_result(result: RegimeResult) -> None:
    """Validate a regime result before it is written; the message names the bad field."""
    check_text(result.workload, "result.workload")
    if not isinstance(result.regime, Regime):
        raise _fail("result.regime", "expected a Regime", result.regime)
    need_bool(result.tie, "result.tie", error=StoreError)
    check_signed(result.margin, "result.margin")
    check_number(result.noise, "result.noise")
    names: set[str] = set()
    for i, c in enumerate(result.candidates):
        where = f"result.candidates[{i}]"
        if not isinstance(c, CandidateStats):
            raise _fail(where, "expected CandidateStats", c)
        check_text(c.name, f"{where}.name")
        check_text(c.family, f"{where}.family")
        if c.name in names:
            raise _fail(f"{where}.name", "appears twice in the result", c.name)
        names.add(c.name)
        if c.regime != result.regime:
            raise _fail(f"{where}.regime", f"expected the result's {result.regime!r}", c.regime)
        for name in ("median_s", "spread", "sm_clock_hz", "power_w", "energy_j_per_call"):
            check_number(getattr(c, name), f"{where}.{name}")
        check_signed(c.temp_c, f"{where}.temp_c")
        for name in ("samples", "rejected", "reasons"):
            check_number(getattr(c, name), f"{where}.{name}", integer=True)
        dumps(c.meta, f"{where}.meta")
    if result.winner is not None and result.winner not in names:
        raise _fail("result.winner", "expected null or one of its candidates", result.winner)


def check_host_clock(clock: HostClock) -> None:
    """Validate a host's clock report before it is written."""
    if not isinstance(clock, HostClock):
        raise _fail("clock", "expected a HostClock", clock)
    for name in ("host", "gpu_uuid", "gpu_model"):
        check_text(getattr(clock, name), f"clock.{name}")
    check_number(clock.power_limit_w, "clock.power_limit_w")
    need_number(clock.sustained_clock_hz, "clock.sustained_clock_hz", minimum=0, error=StoreError)
    need_number(clock.updated_at, "clock.updated_at", minimum=0, error=StoreError)


def check_stored(stored: StoredResult, where: str) -> None:
    """Validate a stored result handed back to the store (carried into another session)."""
    if not isinstance(stored, StoredResult):
        raise _fail(where, "expected a StoredResult", stored)
    check_text(stored.gpu_uuid, f"{where}.gpu_uuid")
    need_number(stored.recorded_at, f"{where}.recorded_at", minimum=0, error=StoreError)
    check_result(stored.result)


# -- reading -------------------------------------------------------------------------------


def _opt_float(row: sqlite3.Row, col: str) -> float | None:
    v = row[col]
    if v is None:
        return None
    require(is_finite(v), col, "expected a finite number", v)
    return float(v)


def _float(row: sqlite3.Row, col: str) -> float:
    v = _opt_float(row, col)
    if v is None:
        raise fail(col, "expected a number", v)
    return v


def _int(row: sqlite3.Row, col: str) -> int:
    return need_int(row[col], col)


def _text(row: sqlite3.Row, col: str) -> str:
    """A name (identifiers only are stored in text columns but ``why``)."""
    return row_values.name(row[col], col)


def _opt_text(row: sqlite3.Row, col: str) -> str | None:
    return None if row[col] is None else _text(row, col)


def _json(row: sqlite3.Row, col: str) -> Any:
    return row_values.json_value(row[col], col)


_E = TypeVar("_E", Regime, SessionStatus)


def _enum(cls: type[_E], value: Any, col: str) -> _E:
    try:
        return cls(value)
    except ValueError:
        raise fail(col, f"expected one of {', '.join(m.value for m in cls)}", value) from None


def _versions(row: sqlite3.Row, col: str = "versions_json") -> Versions:
    versions = Versions.from_json(_json(row, col))
    for f in fields(versions):
        value = getattr(versions, f.name)
        if value is not None:
            row_values.name(value, f"{col}.{f.name}")
    return versions


def session_from_row(row: sqlite3.Row) -> SessionRow:
    workloads_raw = row_values.json_list(row["workloads_json"], "workloads_json")
    regimes_raw = row_values.json_list(row["regimes_json"], "regimes_json")
    extra = row_values.json_object(row["extra_json"], "extra_json")
    try:
        workloads = tuple(Workload.from_json(w) for w in workloads_raw)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"workloads_json has a bad workload: {e!r}") from e
    for i, w in enumerate(workloads):
        row_values.name(w.name, f"workloads_json[{i}].name")
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
        why=None if row["why"] is None else row_values.text(row["why"], "why"),
        ended_at=_opt_float(row, "ended_at"),
    )


def candidate_from_row(row: sqlite3.Row, regime: Regime) -> CandidateStats:
    meta = row_values.json_object(row["meta_json"], "meta_json")
    family = _text(row, "family")
    if family == INDUCTOR_FAMILY and any(k in meta for k in row_values.INDUCTOR_META_KEYS):
        row_values.inductor_choice(meta, "meta_json")  # a job's lookup table is built from it
    return from_row(CandidateStats, row, family=family, regime=regime, meta=meta)


def result_regime(row: sqlite3.Row) -> Regime:
    return _enum(Regime, row["regime"], "regime")


def result_from_rows(row: sqlite3.Row, candidates: tuple[CandidateStats, ...]) -> StoredResult:
    """A result row (joined with its session's gpu_model, gpu_uuid, versions_json)."""
    result = from_row(RegimeResult, row, candidates=candidates)
    return from_row(StoredResult, row, result=result)


def incumbent_from_row(row: sqlite3.Row) -> Incumbent:
    """A fleet winner joined with its session's host, as the disagreement rule reads it."""
    return Incumbent(
        candidate=_text(row, "candidate"),
        host=_text(row, "host"),
        gpu_uuid=_text(row, "gpu_uuid"),
        median_s=_opt_float(row, "median_s"),
    )


#: How a column is read, by the type of the dataclass field it fills.
_READERS: dict[str, Callable[[Any, str], Any]] = {
    "str": _text,
    "str | None": _opt_text,
    "float": _float,
    "float | None": _opt_float,
    "int": _int,
    "bool": lambda row, col: bool(_int(row, col)),
    "Versions": _versions,
    "Regime": lambda row, col: _enum(Regime, row[col], col),
}

_D = TypeVar(
    "_D", WinnerRow, Disagreement, Claim, HostClock, CandidateStats, RegimeResult, StoredResult
)

#: The row types read field for field, each with the columns its fields are not named as.
RENAMED: dict[type, dict[str, str]] = {
    WinnerRow: {"versions": "versions_key"},
    Disagreement: {"versions": "versions_key"},
    Claim: {"key": "claim_key"},
    HostClock: {},
    CandidateStats: {"name": "candidate"},
    RegimeResult: {},
    StoredResult: {"versions": "versions_json"},
}


def from_row(cls: type[_D], row: Any, **given: Any) -> _D:
    """A ``cls`` whose every field but those ``given`` is read from the column of its name
    (or the one :data:`RENAMED` gives), by the reader of its type: the row mapping follows
    the dataclass and the table's columns (:mod:`gpuwatchd.store.columns`), written once."""
    names = RENAMED[cls]
    return cls(
        **{
            f.name: given[f.name]
            if f.name in given
            else _READERS[str(f.type)](row, names.get(f.name, f.name))
            for f in fields(cls)
        }
    )


def winner_from_row(row: Any) -> WinnerRow:
    return from_row(WinnerRow, row)


def disagreement_from_row(row: Any) -> Disagreement:
    return from_row(Disagreement, row)


def claim_from_row(row: Any) -> Claim:
    return from_row(Claim, row)


def host_clock_from_row(row: Any) -> HostClock:
    return from_row(HostClock, row)
