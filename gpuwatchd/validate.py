"""One-line errors for everything read from outside: config, requests, trace files, the wire.

Every parser names the bad field the same way (``where: what, got value``) and folds
exception text onto one line, so an operator sees one readable line, never a traceback.
The ``need_*`` checks return the value they accept and raise ``error`` (each parser's
own exception type) with that one message shape. :func:`from_table` builds a config
section's frozen dataclass from a TOML table with the same checks; it lives here,
below every component, so a component can define its own section.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

#: The longest value shown back in an error; longer ones are cut with an ellipsis.
SHOW_MAX = 80

#: The deepest nesting of arrays and objects taken in a document from outside; requests,
#: spooled files and workload tables need a handful of levels.
MAX_DEPTH = 32

#: What a check raises: an exception class (or any callable) taking the one-line message.
ErrorType = Callable[[str], Exception]


def one_line(text: object, limit: int | None = None) -> str:
    """``text`` with every run of whitespace (newlines included) folded to one space."""
    out = " ".join(str(text).split())
    if limit is not None and len(out) > limit:
        out = out[: max(0, limit - 1)] + "…"
    return out


def describe(exc: BaseException, *, with_type: bool = True, limit: int | None = None) -> str:
    """An exception as one line: ``Type: message``, or the type alone when it has no text.

    ``with_type=False`` gives the bare message for errors whose text is written for
    people already (our own ``ValueError``s), falling back to the type name.
    """
    text = one_line(exc, limit)
    name = type(exc).__name__
    if not with_type:
        return text or name
    return f"{name}: {text}" if text else name


def load_json(
    text: str | bytes,
    what: str,
    *,
    max_bytes: int | None = None,
    max_depth: int = MAX_DEPTH,
    error: ErrorType = ValueError,
) -> Any:
    """Parse untrusted JSON text: at most ``max_bytes`` and ``max_depth`` levels deep.

    Every failure (too big, not UTF-8, not JSON, nested too deeply, ``NaN`` and the
    other non-JSON constants) is ``error`` with one line starting ``what:``.
    """
    if max_bytes is not None and len(text) > max_bytes:
        raise error(f"{what}: larger than {max_bytes} bytes")

    try:
        doc = json.loads(text, parse_constant=_no_constant)
    except _NonJsonConstant as e:
        raise error(f"{what}: {e} is not allowed in JSON") from None
    except RecursionError:  # the C decoder recurses once per level
        raise error(f"{what}: not valid JSON (nested deeper than {max_depth} levels)") from None
    except UnicodeDecodeError:
        raise error(f"{what}: not UTF-8 text") from None
    except ValueError as e:
        raise error(f"{what}: not valid JSON ({one_line(e)})") from None
    check_depth(doc, what, max_depth, error)
    return doc


class _NonJsonConstant(Exception):
    """``NaN``, ``Infinity`` or ``-Infinity`` met in JSON text."""


def _no_constant(name: str) -> Any:
    raise _NonJsonConstant(name)


def load_toml(
    text: str,
    what: str,
    *,
    max_depth: int = MAX_DEPTH,
    error: ErrorType = ValueError,
) -> dict[str, Any]:
    """Parse untrusted TOML text, at most ``max_depth`` levels deep; ``error`` (one line
    starting ``what:``) on anything wrong."""
    too_deep = f"{what}: invalid TOML: arrays or tables nested too deeply (over {max_depth})"
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{what}: invalid TOML: {one_line(e)}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays and tables
        raise error(too_deep) from None
    if nested_over(doc, max_depth):
        raise error(too_deep)
    return doc


def check_depth(
    doc: Any, what: str, max_depth: int = MAX_DEPTH, error: ErrorType = ValueError
) -> None:
    """``error`` when lists and dicts in ``doc`` nest deeper than ``max_depth``."""
    if nested_over(doc, max_depth):
        raise error(f"{what}: nested deeper than {max_depth} levels")


def nested_over(doc: Any, max_depth: int) -> bool:
    """Whether lists and dicts in ``doc`` nest deeper than ``max_depth``; walks with a
    stack of its own, so any depth is measured without recursion."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def show(value: Any) -> str:
    """``repr`` of a value, cut to :data:`SHOW_MAX` characters."""
    return one_line(repr(value), SHOW_MAX)


def key_path(where: str, key: object) -> str:
    """``where.key`` for a message; a key that is not printable text (a newline in a quoted
    TOML or JSON key) is quoted, so the message stays one line."""
    text = str(key)
    return f"{where}.{text if text.isprintable() else show(text)}"


def field_error(where: str, what: str, value: Any) -> str:
    """The one shape of every validation message: ``where: what, got value``."""
    return f"{where}: {what}, got {show(value)}"


def fail(where: str, what: str, value: Any, error: ErrorType = ValueError) -> Exception:
    """The exception to raise for a bad field, its text made by :func:`field_error`."""
    return error(field_error(where, what, value))


def require(ok: bool, where: str, what: str, value: Any, error: ErrorType = ValueError) -> None:
    """Raise :func:`fail`'s exception unless ``ok``: for range and consistency checks."""
    if not ok:
        raise fail(where, what, value, error)


def is_number(value: Any) -> bool:
    """A real int or float (bools are not numbers in config files)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """A number that is neither NaN nor infinite."""
    return is_number(value) and math.isfinite(value)


def need_bool(value: Any, where: str, error: ErrorType = ValueError) -> bool:
    """A real ``bool`` (``1`` and ``"yes"`` are not)."""
    require(isinstance(value, bool), where, "expected true or false", value, error)
    return typing.cast(bool, value)


def need_int(
    value: Any, where: str, *, minimum: int | None = None, error: ErrorType = ValueError
) -> int:
    """An ``int`` (not a bool, not a float), at least ``minimum`` when given."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if minimum is None:
        require(ok, where, "expected an integer", value, error)
    else:
        require(ok and value >= minimum, where, f"expected an integer >= {minimum}", value, error)
    return typing.cast(int, value)


def need_number(
    value: Any,
    where: str,
    *,
    finite: bool = True,
    minimum: float | None = None,
    error: ErrorType = ValueError,
) -> float:
    """An int or float as ``float``: finite unless ``finite=False``, at least ``minimum``."""
    if finite:
        require(is_finite(value), where, "expected a finite number", value, error)
    else:
        require(is_number(value), where, "expected a number", value, error)
    if minimum is not None:
        require(value >= minimum, where, f"expected a number >= {minimum:g}", value, error)
    return float(value)


#: The longest duration any setting takes: a year. A longer one is a typo or an attempt
#: to switch a safeguard off, and the timers built from it overflow (periodic intervals,
#: datetimes, ``threading`` waits).
MAX_DURATION_S = 366 * 86400.0


def need_duration(
    value: Any,
    where: str,
    *,
    minimum: float = 0.0,
    maximum: float = MAX_DURATION_S,
    error: ErrorType = ValueError,
) -> float:
    """Seconds as ``float``: a finite number in ``[minimum, maximum]`` (at most a year)."""
    ok = is_finite(value) and minimum <= value <= maximum
    require(ok, where, f"expected seconds from {minimum:g} to {_span(maximum)}", value, error)
    return float(value)


def _span(seconds: float) -> str:
    """``366 days`` for whole days, else ``2.5 s``: limits read as people write them."""
    days, rest = divmod(seconds, 86400.0)
    return f"{days:g} days" if days >= 1 and rest == 0 else f"{seconds:g} s"


def is_duration_key(name: str) -> bool:
    """Every duration setting's name ends in ``_s`` (seconds); nothing else's does."""
    return name.endswith("_s")


def check_durations(section: Any, where: str, error: ErrorType = ValueError) -> None:
    """Apply :func:`need_duration` to every ``*_s`` field of a dataclass instance.

    The one rule for every duration key of every config section, whichever way the
    section was built: the per-key checks say how small a value may be, this one
    that it is finite and at most :data:`MAX_DURATION_S`.
    """
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if is_duration_key(f.name) and value is not None:
            need_duration(value, f"{where}.{f.name}", error=error)


def need_text(
    value: Any, where: str, *, empty_ok: bool = False, error: ErrorType = ValueError
) -> str:
    """A ``str``; unless ``empty_ok``, one with something besides whitespace in it."""
    if empty_ok:
        require(isinstance(value, str), where, "expected a string", value, error)
    else:
        ok = isinstance(value, str) and bool(value.strip())
        require(ok, where, "expected a non-empty string", value, error)
    return typing.cast(str, value)


def need_object(
    value: Any,
    where: str,
    required: tuple[str, ...],
    optional: tuple[str, ...] = (),
    *,
    error: ErrorType = ValueError,
) -> dict[str, Any]:
    """A JSON object with every required key and no key outside required + optional."""
    require(isinstance(value, dict), where, "expected an object", value, error)
    for key in value:
        if key not in required and key not in optional:
            known = ", ".join((*required, *optional))
            raise error(f"{key_path(where, key)}: unknown key (known: {known})")
    for key in required:
        if key not in value:
            raise error(f"{where}.{key}: missing")
    return typing.cast(dict[str, Any], value)


# -- config sections: a TOML table -> a frozen dataclass ------------------------------------

#: Per-field checks: ``metadata={"check": (predicate, "must be > 0")}``.
Check = tuple[Callable[[Any], bool], str]


def check(pred: Callable[[Any], bool], message: str) -> dict[str, Check]:
    """Field metadata for a value check, e.g. ``field(metadata=check(lambda v: v > 0, "> 0"))``.

    A predicate may raise ``ValueError`` itself when it has a better message to give.
    """
    return {"check": (pred, message)}


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if hint is bool:
        return need_bool(value, key)
    if hint is int:
        return need_int(value, key)
    if hint is float:
        number = need_number(value, key, finite=False)
        require(math.isfinite(number), key, "expected a finite number", value)
        return number
    if hint is str:
        return need_text(value, key, empty_ok=True)
    if origin is tuple:
        require(isinstance(value, list | tuple), key, "expected a list", value)
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
        full = key_path(section, key)
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
            require(ok, full, message, value)
        kwargs[key] = coerced
    section_obj = cls(**kwargs)
    check_durations(section_obj, section)
    return section_obj
