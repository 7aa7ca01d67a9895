"""The control-socket operations that add, list and remove tuned workloads, and their files.

A job (``Capture.submit()``) or an operator (``gpuwatchd workloads add FILE``) hands the
daemon workloads to tune; the daemon keeps them beside the configured ones. One JSON
line each way on the control socket (op names and keys: :mod:`gpuwatchd.control.wire`)::

    {"op": "add_workloads", "workloads": [{"name": ..., "op": ..., "shape": {...},
     "dtype": ..., "families": [...], "params": {...}}, ...],
     "source": {"kind": "capture", "host": "...", "pid": 123, "torch": "2.11.0"}}
        -> {"ok": true, "added": ["model.gemm.bf16..."], "replaced": []}
    {"op": "list_workloads", "cursor": 0}
        -> {"ok": true, "workloads": [{...workload..., "origin": "added" | "config"}],
            "next": 256 | null}
    {"op": "remove_workloads", "names": ["model.gemm.bf16..."]}
        -> {"ok": true, "removed": ["model.gemm.bf16..."]}

The daemon validates a request with :func:`parse_add_request` /
:func:`parse_remove_request` (ValueError, one line naming the field) and answers
``{"ok": false, "error": LINE}``. Files an operator may add: a TOML file of
``[[workload]]`` tables (what :func:`workloads_toml` writes and the daemon config takes),
a ``gpuwatchd-capture/1`` JSON document, or JSON ``{"workloads": [...]}`` (see
:func:`read_workloads_file`). Plain data only: the daemon imports this.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatchd.control import wire
from gpuwatchd.tuning.submitted.regular_file import MAX_FILE_BYTES, read_regular_file
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.workloads import parse_workloads
from gpuwatchd.validate import fail, load_json, load_toml, need_text, one_line

#: The most workloads one request may add (a large model has a few hundred shapes).
MAX_WORKLOADS = 512
MAX_NAME_CHARS = 200
MAX_SOURCE_KEYS = 16
#: The longest text a ``source`` key or value may be (a host name, a torch version).
MAX_SOURCE_CHARS = 256
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]*")
_BARE_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Workloads to add, and where they came from (host, pid, torch version, ...)."""

    workloads: tuple[Workload, ...]
    source: dict[str, Any] = field(default_factory=dict)


# -- building requests (job side, CLI) -------------------------------------------------------


def add_request(
    workloads: Sequence[Workload], source: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``add_workloads`` request line's document; validated as the daemon will."""
    doc = wire.request(
        wire.ADD_WORKLOADS,
        workloads=[w.to_json() for w in workloads],
        source=dict(source) if source else None,
    )
    parse_add_request(doc)
    return doc


def list_request(cursor: int | None = None, limit: int | None = None) -> dict[str, Any]:
    return wire.request(wire.LIST_WORKLOADS, cursor=cursor, limit=limit)


def remove_request(names: Sequence[str]) -> dict[str, Any]:
    doc = wire.request(wire.REMOVE_WORKLOADS, names=list(names))
    parse_remove_request(doc)
    return doc


# -- validating requests (daemon side) -------------------------------------------------------


def parse_add_request(doc: Any) -> AddRequest:
    """Validate an ``add_workloads`` request; ValueError naming the bad field."""
    _check_op(doc, wire.ADD_WORKLOADS)
    items = doc.get("workloads")
    if not isinstance(items, list) or not items:
        raise fail("workloads", "expected a non-empty list of workloads", items)
    if len(items) > MAX_WORKLOADS:
        raise fail("workloads", f"expected at most {MAX_WORKLOADS} workloads", len(items))
    workloads = parse_workloads(items, where="workloads")
    for i, w in enumerate(workloads):
        check_workload_name(w.name, f"workloads[{i}].name")
    return AddRequest(workloads, _parse_source(doc.get("source")))


def parse_remove_request(doc: Any) -> tuple[str, ...]:
    """Validate a ``remove_workloads`` request; the names, repeats dropped."""
    _check_op(doc, wire.REMOVE_WORKLOADS)
    names = doc.get("names")
    if not isinstance(names, list) or not names:
        raise fail("names", "expected a non-empty list of workload names", names)
    if len(names) > MAX_WORKLOADS:
        raise fail("names", f"expected at most {MAX_WORKLOADS} names", len(names))
    for i, name in enumerate(names):
        check_workload_name(name, f"names[{i}]")
    return tuple(dict.fromkeys(names))


def check_workload_name(name: Any, where: str) -> str:
    """A workload name fit for a label, a file name part and a command line."""
    need_text(name, where)
    if len(name) > MAX_NAME_CHARS or not _NAME_RE.fullmatch(name):
        raise fail(
            where,
            f"expected at most {MAX_NAME_CHARS} letters, digits and . _ : @ / + = -",
            name,
        )
    return str(name)


def _check_op(doc: Any, op: str) -> None:
    if not isinstance(doc, Mapping):
        raise fail("request", "expected a JSON object", doc)
    if doc.get("op") != op:
        raise fail("op", f"expected {op!r}", doc.get("op"))
    wire.check_keys(doc, op)


def _parse_source(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or len(raw) > MAX_SOURCE_KEYS:
        raise fail("source", f"expected an object of at most {MAX_SOURCE_KEYS} keys", raw)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        ok = value is None or isinstance(value, str | bool | int) or _finite_float(value)
        if not ok:
            raise fail(f"source.{key}", "expected a string, number, boolean or null", value)
        if len(str(key)) > MAX_SOURCE_CHARS or (
            isinstance(value, str) and len(value) > MAX_SOURCE_CHARS
        ):
            raise fail(f"source.{key}", f"expected at most {MAX_SOURCE_CHARS} characters", value)
        out[str(key)] = value
    return out


def _finite_float(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


# -- files -----------------------------------------------------------------------------------


def read_workloads_file(path: str | Path) -> tuple[Workload, ...]:
    """Workloads from a ``.toml`` file of ``[[workload]]`` tables, or from JSON: a capture
    document, ``{"workloads": [...]}`` or a bare list. ValueError, one line, on anything
    wrong (the path is in it)."""
    p = Path(path)
    try:
        raw = read_regular_file(p, MAX_FILE_BYTES)
    except FileNotFoundError as e:
        raise ValueError(f"{p}: cannot read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not UTF-8 text") from None
    toml = p.suffix.lower() == ".toml"
    doc = load_toml(text, str(p)) if toml else load_json(text, str(p))
    try:
        items = _toml_items(doc) if toml else _json_items(doc)
        if not items:
            raise ValueError("holds no workloads")
        workloads = parse_workloads(items, where="workload")
        for i, w in enumerate(workloads):
            check_workload_name(w.name, f"workload[{i}].name")
    except ValueError as e:
        raise ValueError(f"{p}: {one_line(e)}") from None
    return workloads


def _toml_items(data: dict[str, Any]) -> list[Any]:
    items = data.get("workload")
    if not isinstance(items, list):
        raise ValueError("expected [[workload]] tables")
    return items


def _json_items(doc: Any) -> list[Any]:
    # the capture parser only when a request comes: a monitoring daemon never loads it
    from gpuwatchd.tuning.submitted.captured import CAPTURE_FORMAT, parse_capture

    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict) and doc.get("format") == CAPTURE_FORMAT:
        captured = parse_capture(doc)
        stated = doc.get("workloads")
        if stated is None:
            return [w.to_json() for w in captured.workloads()]
        if not isinstance(stated, list):
            raise fail("workloads", "expected a list", stated)
        return stated
    if isinstance(doc, dict) and isinstance(doc.get("workloads"), list):
        return list(doc["workloads"])
    raise ValueError(
        f'expected a {CAPTURE_FORMAT} document, {{"workloads": [...]}} or a list of workloads'
    )


def workloads_toml(workloads: Iterable[Workload], comment: str | None = None) -> str:
    """``[[workload]]`` tables for the daemon config (or ``gpuwatchd workloads add``)."""
    lines: list[str] = []
    if comment:
        lines += [f"# {line}".rstrip() for line in comment.splitlines()] + [""]
    for w in workloads:
        lines.append("[[workload]]")
        lines.append(f"name = {_toml_value(w.name)}")
        lines.append(f"op = {_toml_value(w.op)}")
        lines.append(f"dtype = {_toml_value(w.dtype)}")
        lines.append(f"families = {_toml_value(list(w.families))}")
        lines.append(f"shape = {_toml_value(w.shape)}")
        if w.params:
            lines.append(f"params = {_toml_value(w.params)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot write a non-finite number to TOML: {v!r}")
        return repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        parts = [f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items()]
        return "{ " + ", ".join(parts) + " }" if parts else "{}"
    raise ValueError(f"cannot write {type(v).__name__} to TOML: {v!r}")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY_RE.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    """A TOML basic string. JSON's escapes are a subset of TOML's, but TOML has no
    surrogate escapes (a character past U+FFFF is written as it is) and no raw DEL."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"cannot write a lone surrogate to TOML: {text!r}") from None
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")
