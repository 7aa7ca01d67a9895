"""Stored values are untrusted input: a row whoever can write the store planted (deeply
nested JSON, a text where a number belongs, code-shaped text in an Inductor entry) is
skipped with one warning by every reader (report, /api/v1/winners, drift and fleet ticks,
a job's Inductor table), never a traceback, a 500 or a tick that raises."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from builders import SettableClock, candidate, h200, seed_session, session_meta
from store_backends import Backend, make_backend
from test_fleet_views import fleet_sync

from gpuwatchd.api.winners import parse_winners, winners_json
from gpuwatchd.api.winners_cache import WinnersCache
from gpuwatchd.drift.seed import reference_from_store
from gpuwatchd.jobside.inductor import site_choices
from gpuwatchd.report.fleet import build_fleet_report
from gpuwatchd.report.text import build_report
from gpuwatchd.store import SqlStore, row_values
from gpuwatchd.store.transactions import MAX_SKIP_WARNINGS
from gpuwatchd.tuning.submitted.inductor_sites import EXCLUSIVE_ID, FAMILY
from gpuwatchd.tuning.types import Regime, RegimeResult

U, S = Regime.UNTHROTTLED, Regime.SUSTAINED
DEEP = "[" * 100_000 + "]" * 100_000
KEY = "((torch.bfloat16, [64, 128], [128, 1]), (torch.bfloat16, [128, 256], [256, 1]))+mm"
ENTRY = {
    "template_id": "triton::mm",
    "EVEN_K": True,
    "ALLOW_TF32": False,
    "USE_FAST_ACCUM": False,
    "ACC_TYPE": "tl.float32",
    "num_stages": 3,
    "num_warps": 4,
    "BLOCK_M": 64,
    "BLOCK_N": 128,
    "BLOCK_K": 64,
    "GROUP_M": 8,
    "hint_override": None,
    "template_hash": "0123abcd",
}


def inductor_meta(entry: dict[str, Any]) -> dict[str, Any]:
    return {"site_keys": [KEY], "lookup_key": KEY, "lookup_entry": entry, "kernels": []}


def regime_result(regime: Regime, entry: dict[str, Any] | None = None) -> RegimeResult:
    fast = candidate("cublas", regime, 1e-3)
    if entry is not None:
        fast = replace(fast, name="inductor[pick]", family=FAMILY, meta=inductor_meta(entry))
    slow = candidate("triton[128x256]", regime, 2e-3)
    return RegimeResult("gemm_8192", regime, (fast, slow), fast.name, False, 0.5, 0.01)


@pytest.fixture
def clock() -> SettableClock:
    return SettableClock(1_700_000_000.0)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return make_backend(request, tmp_path / "tune.db")


@pytest.fixture
def store(backend: Backend, clock: SettableClock) -> Iterator[SqlStore]:
    s = backend.open(now=clock)
    yield s
    s.close()


#: Every reader of stored rows, as the daemon, the report and the job call it.
READERS: dict[str, Callable[[SqlStore], object]] = {
    "report": build_report,
    "fleet report": build_fleet_report,
    "winners document": lambda s: parse_winners(winners_json(s)),
    "winners route": lambda s: WinnersCache(s, host="box").document("/api/v1/winners"),
    "drift": lambda s: reference_from_store(s, h200(), host="box"),
    "fleet": lambda s: fleet_sync(s, now=lambda: 1_700_000_100.0)(),
    "session": lambda s: s.sessions(),
}

#: Rows a writer of the store can plant, each in a column one reader or another parses.
PLANTED = {
    "deep candidate meta": "UPDATE candidate_stats SET meta_json = '{DEEP}'",
    "deep winner versions": "UPDATE winners SET versions_key = '{DEEP}'",
    "deep session workloads": "UPDATE sessions SET workloads_json = '{DEEP}'",
    "deep session versions": "UPDATE sessions SET versions_json = '{DEEP}'",
    "text number in meta": "UPDATE candidate_stats SET meta_json = '{{\"x\": 1e999}}'",
    "huge integer in meta": "UPDATE candidate_stats SET meta_json = '{{\"x\": {BIG}}}'",
    "control characters in a name": "UPDATE winners SET workload = 'gemm' || chr(10) || 'x'",
    "text in a number column": "UPDATE candidate_stats SET median_s = '0.5ms'",
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_planted_row_is_skipped_by_every_reader_with_one_warning(
    store: SqlStore, backend: Backend, clock: SettableClock, planted: str,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    seed_session(store, session_meta(), [regime_result(U), regime_result(S)])
    sql = PLANTED[planted].format(DEEP=DEEP, BIG="9" * 40)
    if backend.kind == "sqlite":
        sql = sql.replace("chr(10)", "char(10)")
    elif "'0.5ms'" in sql:
        pytest.skip("PostgreSQL's typed columns refuse the text itself")
    backend.execute(sql)
    with caplog.at_level(logging.WARNING):
        for read in READERS.values():
            read(store)  # raises nothing
            read(store)  # the same rows again: no new warnings
    unreadable = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert unreadable, "the planted row was read as if it were good"
    assert len(unreadable) == len(set(unreadable))  # one warning per row and problem
    assert all("\n" not in m and len(m) < 500 for m in unreadable)
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failed == []  # the fleet tick did its work


def test_code_in_a_stored_inductor_entry_never_reaches_a_jobs_table(
    store: SqlStore, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    seed_session(store, session_meta(), [regime_result(S, ENTRY)])
    picks = site_choices(parse_winners(winners_json(store)), None)
    assert [p.entry for p in picks] == [ENTRY]  # the recorded shape is served as it is
    evil = inductor_meta({**ENTRY, "BLOCK_M": "64\nimport os; os.system('id')"})
    backend.execute(
        "UPDATE candidate_stats SET meta_json = ? WHERE family = ?", (json.dumps(evil), FAMILY)
    )
    with caplog.at_level(logging.WARNING):
        (winner,) = parse_winners(winners_json(store))
        assert winner.meta == {} and winner.ranked == ()  # nothing of its result is served
        assert site_choices([winner], None) == []
        assert site_choices([replace(winner, meta=evil)], None) == []  # a job checks too
    warned = [r.getMessage() for r in caplog.records]
    assert any("meta_json.lookup_entry" in m and "BLOCK_M" in m for m in warned)
    assert any("Inductor winner" in m for m in warned)


@pytest.mark.parametrize(
    "change",
    [
        {"BLOCK_M": "64\nimport os"},
        {"BLOCK_M": 64.0},
        {"BLOCK_M": True},
        {"BLOCK_M": -1},
        {"BLOCK_M": 1 << 40},
        {"EVEN_K": 1},
        {"ACC_TYPE": "tl.float32; import os"},
        {"ACC_TYPE": ["tl.float32"]},
        {"template_id": "triton::mm\nimport os"},
        {"template_id": "my_template"},
        {"template_id": EXCLUSIVE_ID},
        {"template_hash": "../../etc"},
        {"template_hash": 12},
        {"epilogue_fn": "lambda x: x"},
        {"hint_override": "0"},
    ],
    ids=repr,
)
def test_an_inductor_entry_outside_the_recorded_shape_is_refused(
    change: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    meta = inductor_meta({**ENTRY, **change})
    with pytest.raises(ValueError):
        row_values.inductor_choice(meta)
    from gpuwatchd.jobside.inductor import _choice_from_meta

    with caplog.at_level(logging.WARNING):
        assert _choice_from_meta(meta) is None
    assert len([r for r in caplog.records if "Inductor winner" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    "meta",
    [
        {"site_keys": KEY, "lookup_key": KEY, "lookup_entry": ENTRY},
        {"site_keys": [], "lookup_key": KEY, "lookup_entry": ENTRY},
        {"site_keys": [KEY], "lookup_key": "other", "lookup_entry": ENTRY},
        {"site_keys": [KEY + "\x1b[2J"], "lookup_key": KEY + "\x1b[2J", "lookup_entry": ENTRY},
        {"site_keys": [KEY], "lookup_key": KEY, "lookup_entry": [ENTRY]},
        {"site_keys": [KEY] * 17, "lookup_key": KEY, "lookup_entry": ENTRY},
    ],
    ids=repr,
)
def test_inductor_site_keys_are_names_of_the_recorded_shape(meta: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        row_values.inductor_choice(meta)


def test_every_recorded_entry_shape_loads() -> None:
    choice = row_values.inductor_choice(inductor_meta(ENTRY))
    assert choice.entry == ENTRY and choice.key == KEY and choice.site_keys == (KEY,)
    aten = row_values.inductor_choice(inductor_meta({"template_id": "aten::addmm"}))
    assert aten.entry == {"template_id": "aten::addmm"}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (DEEP, "nested deeper"),
        ("[" * 17 + "]" * 17, "nested deeper"),
        ('{"x": 1e999}', "finite"),
        ('{"x": NaN}', "NaN"),
        ('{"x": ' + "9" * 20 + "}", "64-bit"),
        ('{"x": "' + "a" * (row_values.MAX_JSON_STRING + 1) + '"}', "at most"),
        ("{broken", "not valid JSON"),
        (" " * (row_values.MAX_JSON_CHARS + 1), "larger than"),
        (b"{}", "expected JSON text"),
        (None, "expected JSON text"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_json_columns_are_bounded(text: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        row_values.json_value(text, "meta_json")


def test_json_within_bounds_loads_as_is() -> None:
    nested = "[" * 16 + "]" * 16
    assert row_values.json_value(nested, "x") is not None
    doc = '{"a": [1, -2.5, "s", true, null], "b": {"c": -9223372036854775808}}'
    assert row_values.json_value(doc, "x") == {
        "a": [1, -2.5, "s", True, None],
        "b": {"c": -(1 << 63)},
    }
    assert row_values.json_value('{"x": 9223372036854775807}', "x") == {"x": (1 << 63) - 1}
    with pytest.raises(ValueError, match="64-bit"):
        row_values.json_value('{"x": 9223372036854775808}', "x")
    with pytest.raises(ValueError, match="a JSON object"):
        row_values.json_object("[]", "x")
    with pytest.raises(ValueError, match="a JSON list"):
        row_values.json_list("{}", "x")
    assert row_values.json_list("[1]", "x") == [1]


def test_names_are_printable_and_bounded() -> None:
    assert row_values.name("NVIDIA H200", "gpu_model") == "NVIDIA H200"
    assert row_values.name("a" * row_values.MAX_NAME, "x") == "a" * row_values.MAX_NAME
    too_long = "a" * (row_values.MAX_NAME + 1)
    for bad in ("a\nb", "a\x1bb", "a\x85b", "a\u2028b", "a\u202eb", too_long, 7, None):
        with pytest.raises(ValueError, match="printable name"):
            row_values.name(bad, "x")
    assert row_values.text("why\nit failed", "why") == "why\nit failed"
    for bad in ("a" * (row_values.MAX_TEXT + 1), 3):
        with pytest.raises(ValueError, match="text of at most"):
            row_values.text(bad, "why")


def test_unreadable_rows_warn_a_bounded_number_of_times(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.store"):
        for i in range(MAX_SKIP_WARNINGS + 50):
            store._tx.skip("winners", f"row{i}\x1b[31m", ValueError("bad"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == MAX_SKIP_WARNINGS + 2  # then one line saying the rest are quiet
    assert "without a warning" in lines[-1]
    assert all("\x1b" not in line for line in lines)


def test_the_bounds_are_these_numbers() -> None:
    """The limits as written in row_values' docstring: 1 MiB of JSON text, 16 levels,
    64 Ki characters per string and text column, 1024 per name."""
    assert row_values.json_value(" " * (1_048_576 - 2) + "{}", "x") == {}
    with pytest.raises(ValueError, match="larger than 1048576"):
        row_values.json_value(" " * 1_048_575 + "{}", "x")
    assert row_values.json_value('["' + "a" * 65_536 + '"]', "x") == ["a" * 65_536]
    with pytest.raises(ValueError, match="at most 65536"):
        row_values.json_value('["' + "a" * 65_537 + '"]', "x")
    assert row_values.text("a" * 65_536, "why") == "a" * 65_536
    with pytest.raises(ValueError, match="at most 65536"):
        row_values.text("a" * 65_537, "why")
    assert row_values.name("a" * 1024, "x") == "a" * 1024
    with pytest.raises(ValueError, match="at most 1024"):
        row_values.name("a" * 1025, "x")


@pytest.mark.parametrize(
    ("load", "text"),
    [
        (row_values.json_value, '{"x": 1e999}'),
        (row_values.json_value, "{broken"),
        (row_values.json_object, '{"x": 1e999}'),
        (row_values.json_object, "[]"),
        (row_values.json_list, "[1e999]"),
        (row_values.json_list, "{}"),
    ],
)
def test_a_json_column_error_names_the_column(load: Callable[[Any, str], Any], text: str) -> None:
    with pytest.raises(ValueError, match=r"^meta_json: "):
        load(text, "meta_json")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: row_values.json_value(b"{}", "m"), "m: expected JSON text, got b'{}'"),
        (lambda: row_values.json_object("[1]", "m"), "m: expected a JSON object, got [1]"),
        (lambda: row_values.json_list('{"a": 1}', "m"), "m: expected a JSON list, got {'a': 1}"),
        (lambda: row_values.json_value("[1e999]", "m"), "m: expected finite numbers, got inf"),
        (
            lambda: row_values.json_value("[9223372036854775808]", "m"),
            "m: expected 64-bit integers, got 9223372036854775808",
        ),
        (
            lambda: row_values.json_value('["' + "a" * 65_537 + '"]', "m"),
            "m: expected strings of at most 65536 characters, got 'aaa",
        ),
        (
            lambda: row_values.json_value('{"' + "k" * 65_537 + '": 1}', "m"),
            "m: expected strings of at most 65536 characters, got 'kkk",
        ),
        (
            lambda: row_values.text(3, "why"),
            "why: expected text of at most 65536 characters, got 3",
        ),
        (
            lambda: row_values.name(7, "g"),
            "g: expected a printable name of at most 1024 characters, got 7",
        ),
        (lambda: row_values.inductor_entry([1], "e"), "e: expected an object, got [1]"),
        (
            lambda: row_values.inductor_entry({"template_id": "x"}, "e"),
            "e.template_id: expected a known GEMM template, got 'x'",
        ),
        (
            lambda: row_values.inductor_entry({**ENTRY, "BLOCK_M": -1}, "e"),
            "e: unknown key or value for key 'BLOCK_M', got -1",
        ),
        (
            lambda: row_values.inductor_choice({"site_keys": "k"}, "m"),
            "m.site_keys: expected 1 to 16 lookup keys, got 'k'",
        ),
        (
            lambda: row_values.inductor_choice({"site_keys": ["k"], "lookup_key": "j"}, "m"),
            "m.lookup_key: expected one of its site_keys, got 'j'",
        ),
        (
            lambda: row_values.inductor_choice(
                {
                    "site_keys": ["k"],
                    "lookup_key": "k",
                    "lookup_entry": {"template_id": EXCLUSIVE_ID},
                },
                "m",
            ),
            f"m.lookup_entry.template_id: expected a choice, not the marker, got '{EXCLUSIVE_ID}'",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_each_error_names_the_field_and_shows_the_value(
    call: Callable[[], object], message: str
) -> None:
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value).startswith(message)


def test_the_limits_of_an_inductor_entry_and_its_site_are_inclusive() -> None:
    assert row_values.inductor_entry({**ENTRY, "BLOCK_M": 1_048_576}, "e")["BLOCK_M"] == 1_048_576
    with pytest.raises(ValueError, match="BLOCK_M"):
        row_values.inductor_entry({**ENTRY, "BLOCK_M": 1_048_577}, "e")
    assert row_values.inductor_entry({**ENTRY, "hint_override": 0}, "e")["hint_override"] == 0
    keys = [f"k{i}" for i in range(16)]
    meta = {"site_keys": keys, "lookup_key": "k0", "lookup_entry": ENTRY}
    assert row_values.inductor_choice(meta).site_keys == tuple(keys)
