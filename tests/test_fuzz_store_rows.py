"""Fuzzing the store-row loaders (Hypothesis): whatever a writer of the store puts in a row,
reading it returns checked values or a one-line ValueError/TypeError the store turns into
a skipped row; nothing else escapes, and an Inductor entry that loads holds only the
recorded shape. Bounded: a few hundred examples per property."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.store import codec, row_values
from gpuwatchd.store.rows import HostClock, WinnerRow
from gpuwatchd.tuning.submitted.inductor_sites import FAMILY
from gpuwatchd.tuning.types import Regime
from gpuwatchd.validate import nested_over

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=30,
)
#: What a column can hold: any scalar the drivers return, or JSON text of anything.
cells = st.one_of(
    scalars,
    st.binary(max_size=20),
    json_values.map(lambda v: json.dumps(v)),
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
)


def _safe(value: Any) -> bool:
    """No NaN, no infinity, no integer past 64 bits anywhere in ``value``."""
    if isinstance(value, dict):
        return all(_safe(k) and _safe(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_safe(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return -(1 << 63) <= value < (1 << 63)
    return True


@FUZZ
@given(st.one_of(st.text(max_size=200), cells))
def test_a_json_column_loads_checked_or_fails_with_a_value_error(text: Any) -> None:
    try:
        value = row_values.json_value(text, "meta_json")
    except ValueError as e:
        assert str(e).startswith("meta_json")
        return
    assert _safe(value) and not nested_over(value, row_values.MAX_JSON_DEPTH)


@FUZZ
@given(json_values)
def test_json_within_the_bounds_loads_as_written(value: Any) -> None:
    text = json.dumps(value)
    try:
        loaded = row_values.json_value(text, "x")
    except ValueError:
        assert not _safe(value)  # NaN, infinity or a too large integer: refused
        return
    assert loaded == value


entry_values = st.one_of(
    scalars, st.sampled_from(sorted(row_values.TEMPLATE_IDS)), st.just("tl.float32")
)
entry_keys = st.one_of(
    st.sampled_from(
        [
            *sorted(row_values.INT_KEYS | row_values.FLAG_KEYS | set(row_values.ENUM_KEYS)),
            "template_id",
            "template_hash",
            "hint_override",
        ]
    ),
    st.text(max_size=10),
)
entries = st.dictionaries(entry_keys, entry_values, max_size=8)


@FUZZ
@given(entries, st.lists(st.text(max_size=30), max_size=3), st.text(max_size=30))
def test_an_inductor_entry_that_loads_has_only_the_recorded_shape(
    entry: dict[str, Any], keys: list[str], key: str
) -> None:
    meta = {"site_keys": [*keys, key], "lookup_key": key, "lookup_entry": entry}
    try:
        choice = row_values.inductor_choice(meta)
    except ValueError:
        return
    assert choice.entry["template_id"] in row_values.TEMPLATE_IDS
    for k, v in choice.entry.items():
        if isinstance(v, str):  # the only strings torch may see: known ids and enums
            assert v in row_values.TEMPLATE_IDS or k in ("ACC_TYPE", "template_hash")
            assert v.isprintable() and "\n" not in v
        else:
            assert v is None or isinstance(v, bool | int)
    assert all(k.isprintable() for k in choice.site_keys)


#: A good candidate row: each column of a fuzzed row is this three times in four.
GOOD_CANDIDATE = {
    "candidate": "inductor[pick]", "family": "torch.matmul", "median_s": 1e-3, "spread": 0.01,
    "samples": 12, "rejected": 0, "sm_clock_hz": 1.9e9, "power_w": 690.0, "temp_c": 55.0,
    "energy_j_per_call": 1.2, "reasons": 0,
    "meta_json": json.dumps({"site_keys": ["k"], "lookup_key": "k",
                             "lookup_entry": {"template_id": "aten::mm"}}),
}  # fmt: skip


def mostly(good: Any) -> st.SearchStrategy[Any]:
    return st.one_of(st.just(good), st.just(good), st.just(good), cells)


@FUZZ
@given(st.fixed_dictionaries({c: mostly(v) for c, v in GOOD_CANDIDATE.items()}), st.booleans())
def test_a_candidate_row_parses_or_is_skipped(row: dict[str, Any], inductor: bool) -> None:
    if inductor:
        row["family"] = FAMILY
    try:
        c = codec.candidate_from_row(row, Regime.SUSTAINED)
    except (ValueError, TypeError):
        return
    assert isinstance(c.meta, dict) and _safe(c.meta)
    assert c.name.isprintable() and c.family.isprintable()


def _columns(cls: type) -> list[str]:
    renamed = codec.RENAMED[cls]
    return [renamed.get(f.name, f.name) for f in fields(cls)]


@FUZZ
@given(st.data())
def test_winner_and_clock_rows_parse_or_are_skipped(data: st.DataObject) -> None:
    for cls, parse in ((WinnerRow, codec.winner_from_row), (HostClock, codec.host_clock_from_row)):
        row = data.draw(st.fixed_dictionaries({c: cells for c in _columns(cls)}))
        try:
            parse(row)
        except (ValueError, TypeError):
            continue


session_columns = {
    "id": st.integers(), "gpu_uuid": cells, "gpu_index": cells, "gpu_model": cells,
    "backend": cells, "host": cells, "versions_json": cells, "workloads_json": cells,
    "regimes_json": cells, "extra_json": cells, "started_at": cells, "ended_at": cells,
    "status": st.sampled_from(["completed", "failed", "running", "x"]), "why": cells,
    "max_sm_clock_hz": cells, "power_limit_w": cells, "sm_clock_at_start_hz": cells,
    "temp_at_start_c": cells, "power_at_start_w": cells,
}  # fmt: skip


@FUZZ
@given(st.fixed_dictionaries(session_columns))
def test_a_session_row_parses_or_is_skipped(row: dict[str, Any]) -> None:
    try:
        s = codec.session_from_row(row)
    except (ValueError, TypeError):
        return
    assert _safe(s.meta.extra)
