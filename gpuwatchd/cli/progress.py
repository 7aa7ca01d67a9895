"""Progress of ``gpuwatchd tune``: one live status line on a terminal, plain lines elsewhere.

The worker sends a progress message at most every 0.25 s and alternates candidates
batch by batch (so drift favours none of them), so a new candidate is no news. A
terminal gets one status line rewritten in place; a log or pipe gets a line when the
step (workload, regime) changes and otherwise at most one every ``interval_s``.

A message is the runner's progress payload: ``workload``, ``regime``, ``candidate``,
``done`` and ``total`` (the (workload, regime) steps finished and planned), ``batches``,
``sm_clock_mhz``, ``temp_c``, ``power_w``, ``session_id``. Missing or odd values show
as ``?`` or are left out: a progress line must never break a tuning run.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TextIO

#: Plain (non-TTY) output: the longest silence while the step stays the same.
DEFAULT_INTERVAL_S = 5.0
#: Names are shortened to no fewer characters than this before the line is cut.
MIN_NAME_CHARS = 8
_CLEAR_EOL = "\x1b[K"


class ProgressDisplay(Protocol):
    """``on_progress`` for :meth:`TuneRunner.run_session`, plus ``finish``."""

    def __call__(self, msg: Mapping[str, Any]) -> None: ...

    def finish(self) -> None:
        """End the current status line; call it before printing anything else."""
        ...


def _number(msg: Mapping[str, Any], key: str) -> float | None:
    value = msg.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return None
    return float(value)


def _name(msg: Mapping[str, Any], key: str) -> str:
    value = msg.get(key)
    return " ".join(value.split()) if isinstance(value, str) and value.strip() else "?"


def _elapsed(seconds: float) -> str:
    s = max(0, int(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _can_encode(out: TextIO, text: str) -> bool:
    try:
        text.encode(getattr(out, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


class _Fields:
    """The pieces of one status line, already formatted."""

    def __init__(self, msg: Mapping[str, Any], elapsed_s: float, degree: str) -> None:
        done, total = msg.get("done"), msg.get("total")
        ok = isinstance(done, int) and isinstance(total, int)
        self.step = f"[{done}/{total}]" if ok else "[?/?]"
        c_done, c_total = msg.get("candidates_done"), msg.get("candidates_total")
        if isinstance(c_done, int) and isinstance(c_total, int) and c_total > 0:
            self.step += f" {c_done}/{c_total} candidates"
        self.regime = _name(msg, "regime")
        self.workload = _name(msg, "workload")
        self.candidate = _name(msg, "candidate")
        clock, temp, power = (_number(msg, k) for k in ("sm_clock_mhz", "temp_c", "power_w"))
        self.telemetry = "  ".join(
            part
            for part in (
                f"SM {clock:.0f} MHz" if clock is not None else "",
                f"{temp:.0f}{degree}C" if temp is not None else "",
                f"{power:.0f} W" if power is not None else "",
            )
            if part
        )
        self.elapsed = _elapsed(elapsed_s)

    def line(self, workload: str, candidate: str) -> str:
        head = f"{self.step} {self.regime} {workload}: {candidate}"
        tail = f"  {self.telemetry}" if self.telemetry else ""
        return f"{head}{tail}  {self.elapsed}"


def _shorten(text: str, n: int, ellipsis: str) -> str:
    if len(text) <= n:
        return text
    if n <= len(ellipsis):
        return text[: max(n, 0)]
    return text[: n - len(ellipsis)] + ellipsis


def fit_line(fields: _Fields, width: int, ellipsis: str = "…") -> str:
    """The status line in ``width`` columns: shorten the candidate, then the workload,
    then cut the end (elapsed time, then power go first)."""
    line = fields.line(fields.workload, fields.candidate)
    excess = len(line) - width
    if excess <= 0:
        return line
    cand, work = fields.candidate, fields.workload
    cut = min(excess, max(0, len(cand) - MIN_NAME_CHARS))
    cand = _shorten(cand, len(cand) - cut, ellipsis)
    excess -= cut
    cut = min(excess, max(0, len(work) - MIN_NAME_CHARS))
    work = _shorten(work, len(work) - cut, ellipsis)
    return _shorten(fields.line(work, cand), width, ellipsis)


class TtyProgress:
    """A single self-rewriting status line: carriage return, text, clear to end of line."""

    def __init__(
        self,
        out: TextIO,
        *,
        clock: Callable[[], float] = time.monotonic,
        columns: Callable[[], int] | None = None,
        ansi: bool | None = None,
    ) -> None:
        self.out = out
        self._clock = clock
        self._start = clock()
        self._columns = columns or (lambda: shutil.get_terminal_size((80, 24)).columns)
        self._ansi = os.environ.get("TERM", "") != "dumb" if ansi is None else ansi
        unicode = _can_encode(out, "…°")
        self._ellipsis, self._degree = ("…", "°") if unicode else ("...", "")
        self._shown = 0  # length of the line on screen; 0: no open status line

    def __call__(self, msg: Mapping[str, Any]) -> None:
        fields = _Fields(msg, self._clock() - self._start, self._degree)
        # One column spare: writing the last column makes some terminals wrap.
        line = fit_line(fields, max(self._columns() - 1, 10), self._ellipsis)
        # Without ANSI (TERM=dumb), blanks overwrite what a longer old line left.
        pad = _CLEAR_EOL if self._ansi else " " * max(0, self._shown - len(line))
        self.out.write(f"\r{line}{pad}")
        self.out.flush()
        self._shown = len(line)

    def finish(self) -> None:
        if self._shown:
            self.out.write("\n")
            self.out.flush()
            self._shown = 0


class LineProgress:
    """Plain lines for logs and pipes: on each new step, else at most every ``interval_s``."""

    def __init__(
        self,
        out: TextIO,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s!r}")
        self.out = out
        self._interval = interval_s
        self._clock = clock
        self._start = clock()
        self._degree = "°" if _can_encode(out, "°") else ""
        self._step: tuple[Any, ...] | None = None
        self._last_at = -float("inf")

    def __call__(self, msg: Mapping[str, Any]) -> None:
        now = self._clock()
        step = tuple(msg.get(k) for k in ("session_id", "workload", "regime", "done", "total"))
        if step == self._step and now - self._last_at < self._interval:
            return
        self._step, self._last_at = step, now
        fields = _Fields(msg, now - self._start, self._degree)
        print(fields.line(fields.workload, fields.candidate), file=self.out, flush=True)

    def finish(self) -> None:
        """Nothing to close; the next step prints at once."""
        self._step = None


def _isatty(out: TextIO) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def make_progress(
    out: TextIO,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
) -> TtyProgress | LineProgress:
    """The progress display that suits ``out``: a live line on a terminal, else lines."""
    if _isatty(out):
        return TtyProgress(out, clock=clock)
    return LineProgress(out, interval_s=interval_s, clock=clock)
