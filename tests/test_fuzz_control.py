"""Fuzzing the control socket's request line: whatever a peer sends, the server decodes it
or refuses it with its one-line :class:`RequestError` (an error answer), never another
exception (an "internal error" and a traceback in the daemon's log)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.config import Config
from gpuwatchd.control import wire
from gpuwatchd.daemon.job_gate import job_ops
from gpuwatchd.daemon.ops import Op, OpTable
from gpuwatchd.daemon.retune import retune_ops
from gpuwatchd.daemon.user_ops import user_ops
from gpuwatchd.serve.control import PeerCred, RequestError, decode_request

#: Bounded, and the same examples every run (CI stays green and fast); a failure prints
#: the example to keep as a plain test.
FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
ME = PeerCred(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=25,
)


def _ok(_request: dict[str, Any], _peer: PeerCred) -> dict[str, Any]:
    return {"ok": True}


def _daemon_parsers() -> OpTable:
    """The daemon's ops with their real parsers; every handler answers ok (the parsers
    are what takes the peer's input apart)."""
    ops = [
        *user_ops(SimpleNamespace(), tuple),  # type: ignore[arg-type]
        *retune_ops(SimpleNamespace(), Config(), list, tuple),  # type: ignore[arg-type]
        *job_ops(SimpleNamespace(registry=None)),  # type: ignore[arg-type]
    ]
    return OpTable(Op(op.name, _ok, op.parse, op.keys) for op in ops)


TABLE = _daemon_parsers()
OPS = sorted(TABLE.names)


def requests() -> st.SearchStrategy[dict[str, Any]]:
    """An object naming a real op (mostly) with some of its keys and values of any shape."""
    return st.builds(
        lambda op, known, extra: {"op": op, **known, **extra},
        st.sampled_from(OPS) | json_values,
        st.sampled_from(OPS).flatmap(
            lambda op: st.dictionaries(
                st.sampled_from(sorted(wire.op_keys(op)) or ["x"]), json_values, max_size=4
            )
        ),
        st.dictionaries(st.text(max_size=8), json_values, max_size=2),
    )


def _one_line(exc: RequestError) -> None:
    assert str(exc) and "\n" not in str(exc), str(exc)


@FUZZ
@given(st.binary(max_size=512) | st.text(max_size=256).map(str.encode))
def test_any_bytes_decode_or_are_refused_in_one_line(line: bytes) -> None:
    try:
        doc = decode_request(line)
    except RequestError as exc:
        _one_line(exc)
        return
    assert isinstance(doc, dict)


@FUZZ
@given(st.dictionaries(st.text(max_size=12), json_values, max_size=6))
def test_a_json_object_round_trips_through_the_line(doc: dict[str, Any]) -> None:
    line = json.dumps(doc, separators=(",", ":")).encode()
    assert decode_request(line) == doc


@settings(FUZZ, max_examples=40)
@given(st.integers(min_value=33, max_value=5_000), st.booleans())
def test_deep_nesting_is_refused_not_a_recursion_error(depth: int, in_objects: bool) -> None:
    text = '{"a":' * depth + "1" + "}" * depth if in_objects else "[" * depth + "]" * depth
    try:
        decode_request(text.encode())
    except RequestError as exc:
        _one_line(exc)
        assert "nested deeper" in str(exc)
    else:
        raise AssertionError(f"{depth} levels accepted")


@FUZZ
@given(requests())
def test_every_op_parser_answers_or_refuses_in_one_line(doc: dict[str, Any]) -> None:
    try:
        answer = TABLE(doc, ME)
    except RequestError as exc:
        _one_line(exc)
        return
    assert answer == {"ok": True}


def test_an_unknown_key_holding_a_newline_is_named_on_one_line() -> None:
    """Found by this fuzzer: ``{"op": "add_workloads", "\\n": null}`` split the error."""
    try:
        TABLE({"op": "add_workloads", "\n": None}, ME)
    except RequestError as exc:
        _one_line(exc)
        assert str(exc).startswith("'\\n': unknown key")
    else:
        raise AssertionError("an unknown key was accepted")
