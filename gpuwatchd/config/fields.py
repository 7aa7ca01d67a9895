"""Strict conversion of a TOML table into a frozen dataclass.

Every unknown key, wrong type or out-of-range value becomes one :class:`ValueError`
line that names the key, so ``gpuwatchd`` can print it and exit 2.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

#: Per-field checks: ``metadata={"check": (predicate, "must be > 0")}``.
Check = tuple[Callable[[Any], bool], str]


def check(pred: Callable[[Any], bool], message: str) -> dict[str, Check]:
    """Field metadata for a value check, e.g. ``field(metadata=check(lambda v: v > 0, "> 0"))``."""
    return {"check": (pred, message)}


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)[:1]
        return tuple(_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"{key}: unsupported config type {hint!r}")  # a bug, not user input


def from_table(cls: type[T], table: Mapping[str, Any], section: str) -> T:
    """Build dataclass ``cls`` from ``table``; keys are ``section.key`` in errors."""
    if not isinstance(table, Mapping):
        raise ValueError(f"[{section}]: expected a table, got {type(table).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        full = f"{section}.{key}"
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ValueError(f"{full}: unknown key (known keys: {known})")
        coerced = _coerce(value, hints[key], full)
        pred_msg = fields[key].metadata.get("check")
        if pred_msg is not None and coerced is not None:
            pred, message = pred_msg
            try:
                ok = pred(coerced)
            except ValueError as exc:  # a check that explains itself
                raise ValueError(str(exc)) from None
            if not ok:
                raise ValueError(f"{full}: {message}, got {value!r}")
        kwargs[key] = coerced
    return cls(**kwargs)
