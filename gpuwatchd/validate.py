"""One-line errors for everything read from outside: config, requests, trace files.

Every parser names the bad field the same way (``where: what, got value``) and folds
exception text onto one line, so an operator sees one readable line, never a traceback.
"""

from __future__ import annotations

import math
from typing import Any

#: The longest value shown back in an error; longer ones are cut with an ellipsis.
SHOW_MAX = 80


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


def show(value: Any) -> str:
    """``repr`` of a value, cut to :data:`SHOW_MAX` characters."""
    return one_line(repr(value), SHOW_MAX)


def field_error(where: str, what: str, value: Any) -> str:
    """The one shape of every validation message: ``where: what, got value``."""
    return f"{where}: {what}, got {show(value)}"


def is_number(value: Any) -> bool:
    """A real int or float (bools are not numbers in config files)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """A number that is neither NaN nor infinite."""
    return is_number(value) and math.isfinite(value)
