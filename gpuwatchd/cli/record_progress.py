"""Progress of ``gpuwatchd record``: time recorded of the duration, and the latest reading.

A terminal gets a rich bar redrawn in place; a log or a pipe gets a plain line at most
every ``interval_s``, so a long recording is never silent until it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from gpuwatchd.cli.progress import DEFAULT_INTERVAL_S, clock_text, telemetry_text

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from gpuwatchd.telemetry.types import Sample


class RecordProgress:
    """``on_sample`` for :func:`~gpuwatchd.telemetry.record.record_trace`, plus ``finish``."""

    def __init__(
        self,
        out: TextIO,
        duration_s: float,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        live: bool | None = None,
    ) -> None:
        self.out = out
        self.duration_s = duration_s
        self._interval = interval_s
        self._clock = clock
        self._start = clock()
        self._live = _isatty(out) if live is None else live
        self._count = 0
        self._last_at = -float("inf")  # the first sample prints at once
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def _detail(self, sample: Sample) -> str:
        tele = telemetry_text(sample.sm_clock_mhz, sample.temp_c, sample.power_w)
        return f"{self._count} samples · GPU {sample.gpu}: {tele}" if tele else ""

    @property
    def count(self) -> int:
        """Samples heard of so far."""
        return self._count

    @property
    def elapsed_s(self) -> float:
        """Seconds since the recording started, at most its duration."""
        return min(self._clock() - self._start, self.duration_s)

    def __call__(self, sample: Sample) -> None:
        self._count += 1
        now = self._clock()
        elapsed = min(now - self._start, self.duration_s)
        if self._live:
            self._show_live(elapsed, self._detail(sample))
        elif now - self._last_at >= self._interval:
            self._last_at = now
            done = f"{clock_text(elapsed)} of {clock_text(self.duration_s)}"
            print(f"recording: {done} · {self._detail(sample)}", file=self.out, flush=True)

    def _show_live(self, elapsed: float, detail: str) -> None:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("recording"),
                BarColumn(bar_width=20),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[detail]}", markup=False),
                console=Console(file=self.out, highlight=False),
            )
            self._progress.start()
            self._task = self._progress.add_task("record", total=self.duration_s, detail=detail)
        assert self._task is not None
        self._progress.update(self._task, completed=elapsed, detail=detail)

    def finish(self) -> None:
        """End the live bar; the caller prints the summary line."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _isatty(out: TextIO) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError, OSError):
        return False
