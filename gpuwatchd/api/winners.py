"""``/api/v1/winners``: the recorded winners a job should run, produced and parsed here.

The daemon serves the document from its store; the client builds the same document from
the store file when no daemon serves it, and both go through :func:`parse_winners`, so a
winner reads the same whichever way it came. A winner's own fields are those of
:class:`~gpuwatchd.store.rows.WinnerRow`, listed once, there: this module writes and
reads each of them by its type.
"""

from __future__ import annotations

import json
import time
import typing
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from gpuwatchd.api.document import DocReader
from gpuwatchd.api.errors import GpuwatchdError
from gpuwatchd.store import SqlStore
from gpuwatchd.store.rows import WinnerRow
from gpuwatchd.tuning.types import CandidateStats, Regime, Versions

#: Where the daemon serves the document.
WINNERS_PATH = "/api/v1/winners"
#: Identifies the document shape; bump on an incompatible change.
WINNERS_FORMAT = "gpuwatchd-winners/1"
#: The query parameters the document can be filtered by.
WINNER_FILTERS = ("gpu_model", "workload", "regime")

JsonDict = dict[str, Any]


@dataclass(frozen=True, slots=True)
class RankedCandidate:
    """One candidate of the result a winner came from, fastest first."""

    name: str
    family: str
    median_s: float | None
    spread: float | None
    samples: int
    sm_clock_hz: float | None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Winner(WinnerRow):
    """A stored :class:`WinnerRow` (newest stack) as a job reads it.

    On a tie ``candidate`` is the nominal fastest and ``tie`` is true. ``meta`` is the
    winning candidate's (``kernels``, ``config`` for Triton, ...); ``ranked`` is every
    candidate of the same result, fastest first. ``source`` says where it was read.
    """

    meta: dict[str, Any]
    ranked: tuple[RankedCandidate, ...]
    source: str

    @property
    def kernels(self) -> tuple[str, ...]:
        """GPU kernel names the winner launched, where the family recorded them."""
        names = self.meta.get("kernels")
        return tuple(str(n) for n in names) if isinstance(names, list) else ()

    @property
    def config(self) -> dict[str, Any] | None:
        """The family's config of the winner (a Triton tile config), if it has one."""
        cfg = self.meta.get("config")
        return cfg if isinstance(cfg, dict) else None


def parse_regime(value: Regime | str | None) -> Regime | None:
    """A regime filter: None (any), a :class:`Regime` or its name; ValueError otherwise."""
    if value is None or isinstance(value, Regime):
        return value
    try:
        return Regime(value)
    except ValueError:
        allowed = ", ".join(r.value for r in Regime)
        raise ValueError(f"regime: expected one of {allowed}, got {value!r}") from None


# -- producing the document -------------------------------------------------------------------


def winners_json(
    store: SqlStore,
    *,
    gpu_model: str | None = None,
    workload: str | None = None,
    regime: Regime | str | None = None,
    prefer_host: str | None = None,
    now: Callable[[], float] = time.time,
) -> JsonDict:
    """The document: the newest winner per (GPU model, workload, regime).

    Each winner carries its candidate's meta and every candidate of the result it came
    from, fastest first (what :mod:`gpuwatchd.triton_configs` turns into configs).
    ``prefer_host`` (the daemon's own host on a shared store) takes that host's own
    winner of a key where it measured one, and the fleet's otherwise.
    Read-only; safe on the daemon's store from HTTP threads.
    """
    rows = store.winners(
        gpu_model, workload, parse_regime(regime), latest=True, prefer_host=prefer_host
    )
    by_session = {
        sid: {(s.result.workload, s.result.regime): list(s.result.candidates) for s in results}
        for sid, results in store.session_results([r.session_id for r in rows]).items()
    }  # one read for every winner's session
    out = []
    for row in rows:
        cands = by_session.get(row.session_id, {}).get((row.workload, row.regime), [])
        out.append(_winner_json(row, cands))
    return {"format": WINNERS_FORMAT, "generated_unix": now(), "winners": out}


def parse_winners_query(target: str) -> dict[str, Any]:
    """``/api/v1/winners?workload=W&regime=R&gpu_model=M`` -> keyword arguments of
    :func:`winners_json`. ValueError naming the bad parameter (answer it with a 400)."""
    query = urllib.parse.urlsplit(target).query
    out: dict[str, Any] = {}
    for key, values in urllib.parse.parse_qs(query, keep_blank_values=True).items():
        if key not in WINNER_FILTERS:
            raise ValueError(f"query parameter {key!r} is not one of {', '.join(WINNER_FILTERS)}")
        if len(values) != 1 or not values[0]:
            raise ValueError(f"query parameter {key!r} must be given once, non-empty")
        out[key] = values[0]
    if "regime" in out:
        out["regime"] = parse_regime(out["regime"])
    return out


def _winner_json(row: WinnerRow, candidates: list[CandidateStats]) -> JsonDict:
    ranked = sorted(candidates, key=lambda c: (c.median_s is None, c.median_s or 0.0))
    meta = next((c.meta for c in candidates if c.name == row.candidate), {})
    doc = {f.name: _field_json(getattr(row, f.name)) for f in fields(WinnerRow)}
    return {**doc, "meta": meta, "ranked": [_ranked_json(c) for c in ranked]}


def _field_json(value: object) -> object:
    """A :class:`WinnerRow` field as JSON: enums by value, versions as an object."""
    if isinstance(value, Regime):
        return value.value
    if isinstance(value, Versions):
        return json.loads(value.key())
    return value


def _ranked_json(c: CandidateStats) -> JsonDict:
    return {
        "name": c.name,
        "family": c.family,
        "median_s": c.median_s,
        "spread": c.spread,
        "samples": c.samples,
        "sm_clock_hz": c.sm_clock_hz,
        "meta": c.meta,
    }


# -- reading the document ---------------------------------------------------------------------


def parse_winners(doc: Any, source: str = "winners") -> list[Winner]:
    """The winners of a ``gpuwatchd-winners/1`` document; GpuwatchdError naming the field."""
    d = DocReader(source, "winners")
    if not isinstance(doc, dict) or doc.get("format") != WINNERS_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else doc
        raise d.bad("format", repr(WINNERS_FORMAT), got)
    items = doc.get("winners")
    if not isinstance(items, list):
        raise d.bad("winners", "a list", items)
    return [_parse_winner(d, item, f"winners[{i}]") for i, item in enumerate(items)]


def _parse_winner(d: DocReader, w: Any, where: str) -> Winner:
    if not isinstance(w, dict):
        raise d.bad(where, "an object", w)
    row = {name: read(d, w, name, where) for name, read in _ROW_READERS.items()}
    ranked_raw = w.get("ranked", [])
    if not isinstance(ranked_raw, list):
        raise d.bad(f"{where}.ranked", "a list", ranked_raw)
    ranked = tuple(_parse_ranked(d, c, f"{where}.ranked[{i}]") for i, c in enumerate(ranked_raw))
    meta = d.obj(w, "meta", where, optional=True)
    return Winner(**row, meta=meta, ranked=ranked, source=d.source)


def _parse_ranked(d: DocReader, c: Any, where: str) -> RankedCandidate:
    if not isinstance(c, dict):
        raise d.bad(where, "an object", c)
    return RankedCandidate(
        name=d.text(c, "name", where),
        family=d.text(c, "family", where),
        median_s=d.num(c, "median_s", where),
        spread=d.num(c, "spread", where),
        samples=d.integer(c, "samples", where),
        sm_clock_hz=d.num(c, "sm_clock_hz", where),
        meta=d.obj(c, "meta", where, optional=True),
    )


def _read_regime(d: DocReader, w: Mapping[str, Any], name: str, where: str) -> Regime:
    raw = w.get(name)
    allowed = tuple(r.value for r in Regime)
    if raw not in allowed:
        raise d.bad(f"{where}.{name}", "one of " + ", ".join(allowed), raw)
    return Regime(raw)


def _read_versions(d: DocReader, w: Mapping[str, Any], name: str, where: str) -> Versions:
    try:
        return Versions.from_json(w.get(name))
    except ValueError as e:  # its message starts with the field's name
        raise GpuwatchdError(d.at(f"{where}.{e}")) from None


def _read_required_number(d: DocReader, w: Mapping[str, Any], name: str, where: str) -> float:
    value = d.num(w, name, where)
    if value is None:
        raise d.bad(f"{where}.{name}", "a number", None)
    return value


def _read_optional_text(d: DocReader, w: Mapping[str, Any], name: str, where: str) -> str | None:
    return None if w.get(name) is None else d.text(w, name, where)


_FieldReader = Callable[[DocReader, Mapping[str, Any], str, str], Any]
#: How a field of each type :class:`WinnerRow` uses is read.
_READ_BY_TYPE: dict[object, _FieldReader] = {
    str: DocReader.text,
    str | None: _read_optional_text,
    int: DocReader.integer,
    bool: DocReader.flag,
    float: _read_required_number,
    float | None: DocReader.num,
    Regime: _read_regime,
    Versions: _read_versions,
}
#: One reader per :class:`WinnerRow` field, in field order (a new type fails at import).
_ROW_READERS: dict[str, _FieldReader] = {
    name: _READ_BY_TYPE[hint] for name, hint in typing.get_type_hints(WinnerRow).items()
}
