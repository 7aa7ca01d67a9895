"""Typed reads of one field of a JSON document, failing with the field's full path.

Every message has the shape of :func:`gpuwatchd.validate.field_error`, prefixed with
where the document came from: ``URL: bad state document: gpus[gpu=0].sample.temp_c:
expected a number or null, got 'hot'``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuwatchd.api.errors import GpuwatchdError
from gpuwatchd.validate import field_error, is_finite, need_bool, need_int, need_text


class DocReader:
    """Reads fields of a document from ``source`` (a URL or a file) of one ``kind``."""

    def __init__(self, source: str, kind: str) -> None:
        self.source = source
        self.kind = kind

    def at(self, path: str) -> str:
        """The prefix of every error about ``path``: the source, the kind, the field."""
        return f"{self.source}: bad {self.kind} document: {path}"

    def bad(self, path: str, want: str, got: object) -> GpuwatchdError:
        """The error for field ``path``: expected ``want``, got ``got``."""
        return GpuwatchdError(field_error(self.at(path), f"expected {want}", got))

    def obj(self, d: Any, key: str, where: str, *, optional: bool = False) -> dict[str, Any]:
        """An object; with ``optional``, a missing or null one reads as ``{}``."""
        v = d.get(key) if isinstance(d, dict) else None
        if v is None and optional:
            return {}
        if not isinstance(v, dict):
            raise self.bad(_join(where, key), "an object", v)
        return v

    def num(self, d: Mapping[str, Any], key: str, where: str) -> float | None:
        """A finite number as float, or None for a missing or null field."""
        v = d.get(key)
        if v is None:
            return None
        if not is_finite(v):
            raise self.bad(_join(where, key), "a number or null", v)
        return float(v)

    def text(self, d: Mapping[str, Any], key: str, where: str, *, optional: bool = False) -> str:
        """A string; with ``optional``, a missing or null one reads as ``""``."""
        v = d.get(key)
        if v is None and optional:
            return ""
        return need_text(v, self.at(_join(where, key)), empty_ok=True, error=GpuwatchdError)

    def flag(self, d: Mapping[str, Any], key: str, where: str, default: bool = False) -> bool:
        """``true`` or ``false``; a missing field reads as ``default``."""
        return need_bool(d.get(key, default), self.at(_join(where, key)), GpuwatchdError)

    def integer(self, d: Mapping[str, Any], key: str, where: str) -> int:
        """An integer (a bool is not one)."""
        return need_int(d.get(key), self.at(_join(where, key)), error=GpuwatchdError)

    def texts(self, d: Mapping[str, Any], key: str, where: str) -> tuple[str, ...] | None:
        """A list of strings as a tuple, or None for a missing or null field."""
        v = d.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.bad(_join(where, key), "a list of strings", v)
        return tuple(v)

    def ints(self, d: Mapping[str, Any], key: str, where: str) -> tuple[int, ...] | None:
        """A list of integers as a tuple, or None for a missing or null field."""
        v = d.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in v
        ):
            raise self.bad(_join(where, key), "a list of integers", v)
        return tuple(v)


def _join(where: str, key: str) -> str:
    """``where.key``, or ``key`` alone at the top of the document (``where`` empty)."""
    return f"{where}.{key}" if where else key
