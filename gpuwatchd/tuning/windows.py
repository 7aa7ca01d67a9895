"""Quiet-hours windows such as ``"22:00-06:00"`` (local time; may wrap midnight)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable


def _minutes(text: str, where: str) -> int:
    try:
        hh, mm = text.split(":")
        h, m = int(hh), int(mm)
    except ValueError:
        raise ValueError(f"{where}: expected HH:MM, got {text!r}") from None
    if not (0 <= h <= 24 and 0 <= m < 60) or (h == 24 and m):
        raise ValueError(f"{where}: {text!r} is not a time of day")
    return h * 60 + m


def parse_windows(windows: Iterable[str]) -> list[tuple[int, int]]:
    """``["22:00-06:00"]`` -> ``[(1320, 360)]`` (minutes since midnight)."""
    out = []
    for i, w in enumerate(windows):
        where = f"tuning.windows[{i}]"
        start, sep, end = w.partition("-")
        if not sep:
            raise ValueError(f"{where}: expected HH:MM-HH:MM, got {w!r}")
        a, b = _minutes(start.strip(), where), _minutes(end.strip(), where)
        if a == b:
            raise ValueError(f"{where}: empty window {w!r}")
        out.append((a, b))
    return out


def in_windows(windows: list[tuple[int, int]], when: dt.datetime) -> bool:
    """True when ``when`` (local time) falls in any window; no windows means always."""
    if not windows:
        return True
    m = when.hour * 60 + when.minute
    return any((a <= m < b) if a < b else (m >= a or m < b) for a, b in windows)
