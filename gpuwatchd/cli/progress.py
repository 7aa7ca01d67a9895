"""Progress of ``gpuwatchd tune``: what it waits for, then where the tuning stands.

Two events feed it: each poll while the gate is shut (:class:`GateWait`: the state, its
reasons, live clock, temperature and power) and the worker's progress messages (at most
one per 0.25 s: step, regime, round, candidates, time budget used, telemetry). A
terminal gets a live display drawn by rich (spinner, a bar over the whole time budget,
an ETA), redrawn in place; a log or a pipe gets plain lines: one per new step, gate
state or round, at most one every ``interval_s`` otherwise. rich is imported only for a
terminal, and only by the CLI: the daemon never imports this module.

Odd or missing message fields show as ``?`` or are left out: a progress display must
never break a tuning run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from gpuwatchd.validate import one_line

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

#: Plain (non-TTY) output: the longest silence while nothing but numbers changes.
DEFAULT_INTERVAL_S = 5.0
#: Plain output while waiting: a "still waiting" line at least this often.
STILL_WAITING_S = 30.0
#: Device seconds of evidence before an ETA is shown (wall time per device second).
MIN_RATE_EVIDENCE_S = 0.5


@dataclass(frozen=True, slots=True)
class GateWait:
    """One poll of a shut gate, as the waiting display shows it."""

    gpu: int
    state: str | None  # None: no reading yet
    reasons: tuple[str, ...]
    sm_clock_mhz: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    waited_s: float = 0.0  # on the backend's clock, the one the gate's thresholds use


class ProgressDisplay(Protocol):
    """What ``tune`` drives: ``on_progress`` for :meth:`TuneRunner.run_session` and more."""

    def __call__(self, msg: Mapping[str, Any]) -> None: ...

    def waiting(self, wait: GateWait) -> None:
        """The gate is still shut."""
        ...

    def gate_open(self, wait: GateWait) -> None:
        """The gate opened after ``wait.waited_s``; ends the waiting display."""
        ...

    def finish(self) -> None:
        """End the live display; call it before printing anything else."""
        ...


# -- formatting, shared by both displays ------------------------------------------------


def _number(msg: Mapping[str, Any], key: str) -> float | None:
    value = msg.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return None
    return float(value)


def _count(msg: Mapping[str, Any], key: str) -> int | None:
    value = msg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _name(msg: Mapping[str, Any], key: str) -> str:
    value = msg.get(key)
    return one_line(value) if isinstance(value, str) and value.strip() else "?"


def clock_text(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    s = max(0, int(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def telemetry_text(
    clock: float | None, temp: float | None, power: float | None, degree: str = "°"
) -> str:
    parts = (
        f"SM {clock:.0f} MHz" if clock is not None else "",
        f"{temp:.0f}{degree}C" if temp is not None else "",
        f"{power:.0f} W" if power is not None else "",
    )
    return " ".join(p for p in parts if p)


def wait_detail(wait: GateWait, degree: str = "°") -> str:
    """Why the gate is shut, the GPU's state and how long it has been waited for."""
    if wait.state is None:
        why = "no reading yet"
    else:
        why = wait.state + (f": {'; '.join(wait.reasons)}" if wait.reasons else "")
    tele = telemetry_text(wait.sm_clock_mhz, wait.temp_c, wait.power_w, degree)
    return " · ".join(p for p in (why, tele, f"waited {clock_text(wait.waited_s)}") if p)


@dataclass(frozen=True, slots=True)
class Step:
    """One worker progress message, checked field by field."""

    session: object
    step: int | None  # 1-based: the (workload, regime) pair under way
    total: int | None
    regime: str
    workload: str
    candidate: str
    round: int | None
    measured: int | None  # candidates with their minimum of accepted batches
    candidates: int | None
    elapsed_s: float | None  # device seconds into this regime
    budget_s: float | None  # the regime's budget, device seconds
    clock: float | None
    temp: float | None
    power: float | None

    @classmethod
    def of(cls, msg: Mapping[str, Any]) -> Step:
        done, total = _count(msg, "done"), _count(msg, "total")
        budget = _number(msg, "budget_s")
        return cls(
            session=msg.get("session_id"),
            step=done + 1 if done is not None and total is not None else None,
            total=total,
            regime=_name(msg, "regime"),
            workload=_name(msg, "workload"),
            candidate=_name(msg, "candidate"),
            round=_count(msg, "round") or None,
            measured=_count(msg, "candidates_done"),
            candidates=_count(msg, "candidates_total") or None,
            elapsed_s=_number(msg, "elapsed_s"),
            budget_s=budget if budget else None,
            clock=_number(msg, "sm_clock_mhz"),
            temp=_number(msg, "temp_c"),
            power=_number(msg, "power_w"),
        )

    @property
    def key(self) -> tuple[object, ...]:
        return (self.session, self.workload, self.regime, self.step, self.total)

    def title(self) -> str:
        """``step 1/2 unthrottled sim-gemm``: steps count from 1."""
        n = f"{self.step}/{self.total}" if self.step is not None else "?/?"
        return f"step {n} {self.regime} {self.workload}"

    def budget_used(self) -> float | None:
        """Device seconds of the whole session's budget spent so far."""
        if self.budget_s is None or self.elapsed_s is None or self.step is None:
            return None
        return (self.step - 1) * self.budget_s + min(self.elapsed_s, self.budget_s)

    def budget_total(self) -> float | None:
        return None if self.budget_s is None or self.total is None else self.budget_s * self.total

    def detail(self, degree: str = "°", eta_s: float | None = None) -> str:
        """Round, budget used, ETA, telemetry, candidates: most telling first (a narrow
        terminal cuts the end)."""
        parts = []
        if self.round is not None:
            parts.append(f"round {self.round}")
        if self.budget_s is not None and self.elapsed_s is not None:
            used = min(self.elapsed_s, self.budget_s)
            parts.append(f"budget {used:.0f}/{self.budget_s:.0f} s")
        if eta_s is not None:
            parts.append(f"ETA {'≤' if degree else '<='}{clock_text(eta_s)}")
        parts.append(telemetry_text(self.clock, self.temp, self.power, degree))
        if self.candidates is not None and self.measured is not None:
            parts.append(f"{self.measured}/{self.candidates} candidates measured")
        return " · ".join(p for p in parts if p)


class EtaEstimate:
    """Wall seconds left, from the budget still unspent and the wall time per device second.

    The budget is an upper bound (a regime ends early once its timings are stable), so
    the ETA is one too. A simulated session runs its device clock far faster than the
    wall clock; the rate measured in this session converts between the two.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._origin: tuple[object, float, float] | None = None  # session, wall, device

    def __call__(self, step: Step) -> float | None:
        used, total = step.budget_used(), step.budget_total()
        if used is None or total is None:
            return None
        now = self._clock()
        if self._origin is None or self._origin[0] != step.session:
            self._origin = (step.session, now, used)
            return None
        _, wall0, used0 = self._origin
        if used - used0 < MIN_RATE_EVIDENCE_S:
            return None
        return max(0.0, total - used) * (now - wall0) / (used - used0)


def _can_encode(out: TextIO, text: str) -> bool:
    try:
        text.encode(getattr(out, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _open_text(wait: GateWait, degree: str) -> str:
    why = f" ({'; '.join(wait.reasons)})" if wait.reasons else ""
    tele = telemetry_text(wait.sm_clock_mhz, wait.temp_c, wait.power_w, degree)
    tail = f" · {tele}" if tele else ""
    return f"GPU {wait.gpu}: gate open after {clock_text(wait.waited_s)}{why}{tail}"


# -- a terminal: rich ---------------------------------------------------------------------


class LiveProgress:
    """A rich live display: one line while waiting, one bar per session while tuning."""

    def __init__(self, out: TextIO, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out
        self._clock = clock
        self._degree = "°" if _can_encode(out, "°≤") else ""
        self._eta = EtaEstimate(clock)
        self._progress: Progress | None = None
        self._wait_task: TaskID | None = None
        self._tasks: dict[object, TaskID] = {}

    def _live(self) -> Progress:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn
            from rich.table import Column

            def text(field: str, ratio: int | None) -> TextColumn:
                column = Column(no_wrap=True, overflow="ellipsis", ratio=ratio)
                return TextColumn(field, markup=False, table_column=column)

            console = Console(file=self.out, highlight=False)
            self._progress = Progress(
                SpinnerColumn(),
                text("{task.description}", None),
                BarColumn(bar_width=12),
                text("{task.fields[detail]}", 1),  # takes the rest, cut at the end
                console=console,
                expand=True,
            )
            self._progress.start()
        return self._progress

    def waiting(self, wait: GateWait) -> None:
        live = self._live()
        detail = wait_detail(wait, self._degree)
        if self._wait_task is None:
            desc = f"GPU {wait.gpu} waiting for the gate"
            self._wait_task = live.add_task(desc, total=None, detail=detail)
        else:
            live.update(self._wait_task, detail=detail)

    def gate_open(self, wait: GateWait) -> None:
        if self._wait_task is not None:
            self.finish()
            print(_open_text(wait, self._degree), file=self.out, flush=True)

    def __call__(self, msg: Mapping[str, Any]) -> None:
        step = Step.of(msg)
        live = self._live()
        detail = step.detail(self._degree, self._eta(step))
        total, used = step.budget_total(), step.budget_used()
        task = self._tasks.get(step.session)
        if task is None:
            task = live.add_task(step.title(), total=total, detail=detail)
            self._tasks[step.session] = task
        live.update(task, description=step.title(), detail=detail, total=total, completed=used)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._progress, self._wait_task = None, None
        self._tasks.clear()


# -- a pipe or a log: plain lines -----------------------------------------------------------


class LineProgress:
    """Plain lines: each new step or gate state at once, else at most every ``interval_s``.

    Hand-written rather than rich: a line per event needs nothing but ``print``.
    """

    def __init__(
        self,
        out: TextIO,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        still_waiting_s: float = STILL_WAITING_S,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s!r}")
        self.out = out
        self._interval = interval_s
        self._still = still_waiting_s
        self._clock = clock
        self._degree = "°" if _can_encode(out, "°≤") else ""
        self._eta = EtaEstimate(clock)
        self._key: tuple[object, ...] | None = None
        self._unprinted: str | None = None  # the latest step detail, when rate-limited
        self._wait: tuple[str | None, tuple[str, ...]] | None = None
        self._last_at = -float("inf")

    def _print(self, text: str) -> None:
        print(text, file=self.out, flush=True)
        self._last_at = self._clock()

    def waiting(self, wait: GateWait) -> None:
        seen = (wait.state, wait.reasons)
        quiet = self._clock() - self._last_at
        new_state = self._wait is None or self._wait[0] != wait.state
        if new_state or (seen != self._wait and quiet >= self._interval) or quiet >= self._still:
            self._wait = seen
            self._print(f"GPU {wait.gpu} waiting for the gate: {wait_detail(wait, self._degree)}")

    def gate_open(self, wait: GateWait) -> None:
        if self._wait is not None:
            self._print(_open_text(wait, self._degree))
        self._wait = None

    def __call__(self, msg: Mapping[str, Any]) -> None:
        step = Step.of(msg)
        eta = self._eta(step)
        if step.key != self._key:
            if self._unprinted is not None:  # how the previous step ended
                self._print(f"  {self._unprinted}")
            self._key = step.key
            size = f"{step.candidates} candidates" if step.candidates else ""
            budget = f"budget {step.budget_s:g} s" if step.budget_s is not None else ""
            extra = ", ".join(p for p in (size, budget) if p)
            self._print(f"{step.title()}" + (f" ({extra})" if extra else ""))
        elif self._clock() - self._last_at < self._interval:
            self._unprinted = step.detail(self._degree)
            return
        self._print(f"  {step.detail(self._degree, eta)}")
        self._unprinted = None

    def finish(self) -> None:
        """Print where the session got to, if not yet shown; the next step prints at once."""
        if self._unprinted is not None:
            self._print(f"  {self._unprinted}")
        self._key, self._wait, self._unprinted = None, None, None


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
) -> LiveProgress | LineProgress:
    """The display that suits ``out``: live on a terminal, plain lines elsewhere."""
    if not interval_s > 0:
        raise ValueError(f"interval_s: must be > 0, got {interval_s!r}")
    if _isatty(out):
        return LiveProgress(out, clock=clock)
    return LineProgress(out, interval_s=interval_s, clock=clock)
