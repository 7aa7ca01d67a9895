"""The one validation helper: every parser's one-line ``where: what, got value`` errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpuwatchd.validate import (
    check,
    describe,
    fail,
    from_table,
    need_bool,
    need_int,
    need_number,
    need_text,
    one_line,
    require,
)


class WireError(ValueError):
    """Stands in for a parser's own error type (SessionSpecError, StoreError, ...)."""


def test_one_line_folds_whitespace_and_cuts_at_the_limit() -> None:
    assert one_line("a\n  b\tc") == "a b c"
    cut = one_line("x" * 600, limit=500)
    assert len(cut) == 500 and cut.endswith("…")
    assert one_line("short", limit=500) == "short"


def test_describe_with_and_without_the_type() -> None:
    assert describe(RuntimeError("out of\nmemory")) == "RuntimeError: out of memory"
    assert describe(RuntimeError()) == "RuntimeError"
    assert describe(ValueError("bad x"), with_type=False) == "bad x"
    assert describe(ValueError(), with_type=False) == "ValueError"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: need_bool(1, "a.b"), "a.b: expected true or false, got 1"),
        (lambda: need_int(True, "a.n"), "a.n: expected an integer, got True"),
        (lambda: need_int(2.0, "a.n"), "a.n: expected an integer, got 2.0"),
        (lambda: need_int(-1, "a.n", minimum=0), "a.n: expected an integer >= 0, got -1"),
        (lambda: need_number("1", "a.x"), "a.x: expected a finite number, got '1'"),
        (lambda: need_number(math.nan, "a.x"), "a.x: expected a finite number, got nan"),
        (lambda: need_number(-0.5, "a.x", minimum=0), "a.x: expected a number >= 0, got -0.5"),
        (lambda: need_number(None, "a.x", finite=False), "a.x: expected a number, got None"),
        (lambda: need_text("\t", "a.s"), "a.s: expected a non-empty string, got '\\t'"),
        (lambda: need_text(3, "a.s", empty_ok=True), "a.s: expected a string, got 3"),
        (lambda: require(False, "a.r", "must be > 0", 0), "a.r: must be > 0, got 0"),
    ],
)
def test_checks_give_one_message_shape(call: Any, message: str) -> None:
    with pytest.raises(ValueError) as plain:
        call()
    assert str(plain.value) == message


def test_checks_return_what_they_accept_and_raise_the_given_type() -> None:
    assert need_int(3, "n", minimum=1) == 3
    assert need_number(2, "x") == 2.0 and isinstance(need_number(2, "x"), float)
    assert need_number(math.inf, "x", finite=False) == math.inf
    assert need_text("", "s", empty_ok=True) == ""
    assert need_bool(False, "b") is False
    with pytest.raises(WireError, match=r"^job\.gpu: expected an integer >= 0, got -2$"):
        need_int(-2, "job.gpu", minimum=0, error=WireError)
    err = fail("w", "too long", "x" * 200, WireError)
    assert isinstance(err, WireError) and len(str(err)) < 120 and str(err).endswith("…")


@dataclass(frozen=True, slots=True)
class Section:
    count: int = field(default=1, metadata=check(lambda v: v >= 1, "must be >= 1"))
    ratio: float = 0.5
    name: str = ""
    on: bool = True
    tags: tuple[str, ...] = ()
    limit: float | None = None


def test_from_table_builds_the_section_and_coerces_ints_to_floats() -> None:
    got = from_table(Section, {"count": 3, "ratio": 1, "tags": ["a", "b"], "limit": None}, "s")
    assert got == Section(count=3, ratio=1.0, tags=("a", "b"))
    assert isinstance(got.ratio, float)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"cont": 1}, "s.cont: unknown key (known keys: count, limit, name, on, ratio, tags)"),
        ({"count": 0}, "s.count: must be >= 1, got 0"),
        ({"count": "2"}, "s.count: expected an integer, got '2'"),
        ({"ratio": True}, "s.ratio: expected a number, got True"),
        ({"name": 5}, "s.name: expected a string, got 5"),
        ({"on": "yes"}, "s.on: expected true or false, got 'yes'"),
        ({"tags": "a"}, "s.tags: expected a list, got 'a'"),
        ({"tags": ["a", 1]}, "s.tags[1]: expected a string, got 1"),
        ({"limit": "x"}, "s.limit: expected a number, got 'x'"),
    ],
)
def test_from_table_names_the_bad_key(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        from_table(Section, table, "s")
    assert str(exc.value) == message
