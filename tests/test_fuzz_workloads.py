"""Fuzzing workload definitions: ``[[workload]]`` tables in the config, workload files
(TOML or JSON) and added workloads. Anything is parsed or refused with one line
(ValueError, ConfigError), and what parses survives the trip through the TOML and JSON
the tools write."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gpuwatchd.config import ConfigError, parse_config
from gpuwatchd.tuning.intake.workload_requests import (
    check_workload_name,
    read_workloads_file,
    workloads_toml,
)
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS, parse_workloads
from gpuwatchd.validate import load_toml

#: Bounded, and the same examples every run (CI stays green and fast); a failure prints
#: the example to keep as a plain test.
FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=15,
)
#: Values a field plausibly holds, so that generated tables get past the first check.
plausible: dict[str, st.SearchStrategy[Any]] = {
    "name": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,30}", fullmatch=True)
    | st.text(max_size=30),
    "op": st.sampled_from(["matmul", "conv2d", "bmm", "softmax", ""]),
    "dtype": st.sampled_from(["float16", "bfloat16", "fp32", "float1024", "int8", ""]),
    "families": st.lists(
        st.sampled_from(sorted({f for w in DEFAULT_WORKLOADS for f in w.families} | {"nope"})),
        max_size=3,
    ),
    "shape": st.dictionaries(
        st.sampled_from(["m", "n", "k", "input", "weight", "stride", "padding", "b"]),
        st.integers(min_value=-2, max_value=2**40) | st.lists(st.integers(-1, 4096), max_size=5),
        max_size=5,
    ),
    "params": st.dictionaries(st.text(max_size=10), json_values, max_size=3),
}


@st.composite
def workload_tables(draw: st.DrawFn) -> dict[str, Any]:
    """A shipped workload's table with some fields replaced, dropped or added."""
    table = draw(st.sampled_from(DEFAULT_WORKLOADS)).to_json()
    for key in draw(st.lists(st.sampled_from(sorted(plausible)), max_size=4, unique=True)):
        how = draw(st.sampled_from(["plausible", "any", "drop"]))
        if how == "drop":
            table.pop(key, None)
        else:
            table[key] = draw(plausible[key] if how == "plausible" else json_values)
    table.update(draw(st.dictionaries(st.text(max_size=8), json_values, max_size=1)))
    return table


def _one_line(exc: Exception) -> None:
    assert str(exc) and "\n" not in str(exc), str(exc)


@FUZZ
@given(st.lists(workload_tables(), min_size=1, max_size=3))
def test_workload_tables_parse_or_are_refused_and_round_trip(tables: list[dict[str, Any]]) -> None:
    try:
        workloads = parse_workloads(tables, "workload")
    except ValueError as exc:
        _one_line(exc)
        return
    again = parse_workloads(json.loads(json.dumps([w.to_json() for w in workloads])), "workload")
    assert again == workloads
    try:
        for w in workloads:
            check_workload_name(w.name, "name")
    except ValueError:
        return  # only added workloads are written as TOML, and their names are checked
    try:
        text = workloads_toml(workloads, comment="fuzz")
    except ValueError as exc:  # JSON's null in params: TOML has no way to write it
        _one_line(exc)
        assert "cannot write NoneType" in str(exc)
        return
    assert parse_workloads(load_toml(text, "written")["workload"], "workload") == workloads


@FUZZ
@given(
    st.lists(workload_tables(), max_size=2),
    st.dictionaries(st.text(max_size=8), json_values, max_size=2),
)
def test_a_config_with_any_workloads_loads_or_is_one_config_error(
    tables: list[dict[str, Any]], other: dict[str, Any]
) -> None:
    try:
        cfg = parse_config({**other, "workload": tables}, "fuzz.toml")
    except ConfigError as exc:
        _one_line(exc)
        assert str(exc).startswith("fuzz.toml: ")
        return
    names = {w.name for w in cfg.workloads}
    assert {t["name"] for t in tables} <= names


toml_text = st.text(max_size=300) | st.lists(
    st.sampled_from(
        ['[[workload]]', 'name = "a"', 'op = "matmul"', 'dtype = "float16"',
         'families = ["torch.matmul"]', "shape = { m = 64, n = 64, k = 64 }", "shape = 1",
         "[workload]", "x = [[[[1]]]]", 'name = """\n"""', "params = { a = 1e400 }", "="]
    ),
    max_size=12,
).map("\n".join)  # fmt: skip


@FUZZ
@given(toml_text | st.text(max_size=200).map(lambda t: t), st.sampled_from([".toml", ".json"]))
def test_a_workloads_file_of_any_text_reads_or_is_one_line(text: str, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"w{suffix}"
        path.write_text(text if suffix == ".toml" else text.replace("\n", " "), encoding="utf-8")
        try:
            workloads = read_workloads_file(path)
        except ValueError as exc:
            _one_line(exc)
            assert str(path) in str(exc)
            return
    assume(workloads)
    for w in workloads:
        check_workload_name(w.name, "name")


def test_a_key_holding_a_newline_is_named_on_one_line() -> None:
    """Found by this fuzzer: a quoted TOML key with a newline split the config error."""
    table = DEFAULT_WORKLOADS[0].to_json()
    for data in (
        {"workload": [{**table, "\n": 1}]},
        {"\n": {}},
        {"gate": {"a\nb": 1}},
        {"tuning": {"a\nb": 1}},
        {"workload": [{**table, "shape": {**table["shape"], "x\ny": 1}}]},
    ):
        try:
            parse_config(data, "c.toml")
        except ConfigError as exc:
            _one_line(exc)
        else:
            raise AssertionError(f"{data} was accepted")


def test_text_past_u_ffff_and_del_are_written_as_toml_reads_them() -> None:
    """Found by this fuzzer: a param key past U+FFFF was written as a JSON surrogate pair,
    which TOML refuses, so a captured workloads file could not be read back."""
    (shipped, *_) = DEFAULT_WORKLOADS
    table = {**shipped.to_json(), "params": {"\U00010000": ["a\x7fb\x00\n\u2028é"]}}
    (workload,) = parse_workloads([table], "workload")
    text = workloads_toml([workload])
    assert parse_workloads(load_toml(text, "written")["workload"], "workload") == (workload,)
