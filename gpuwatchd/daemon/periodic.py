"""The daemon's periodic tasks (tuning, spool rescans, drift, fleet sync, pruning), timed on
the monotonic clock.

APScheduler 3's interval triggers keep each next run time on the wall clock, so a step
back (an NTP step, a VM resume) stalls every task for as long as the step, silently;
``time.monotonic`` never steps, and one small loop on it is simpler than correcting the
library's run times from outside. Each task runs on a worker thread, one run at a time;
runs missed meanwhile collapse into one. A task not started within ``grace_s`` of when it
was due (its last run hangs, or the loop does) is overdue: logged once, counted
(``gpuwatchd_periodic_overdue_total``), and :meth:`Periodic.stalled` withholds the
systemd watchdog's pings while it lasts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gpuwatchd.validate import describe

log = logging.getLogger(__name__)

#: The loop looks again at least this often (a stop, a task added), in seconds.
MAX_WAIT_S = 1.0
#: How late a task may start before it counts as overdue (APScheduler's misfire grace).
GRACE_S = 30.0

Submit = Callable[[Callable[[], None]], object]


@dataclass(slots=True)
class _Task:
    name: str
    fn: Callable[[], object]
    interval_s: float
    due: float  # monotonic seconds
    running: bool = False
    overdue: bool = False
    error: str | None = None  # the last run's failure, logged once while it repeats


class Periodic:
    """Named tasks run every ``interval_s`` seconds of the monotonic ``clock``.

    ``submit`` runs a task's call (a thread pool's; tests pass their own).
    """

    def __init__(
        self,
        *,
        grace_s: float = GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        submit: Submit | None = None,
    ) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self._pool = None if submit is not None else ThreadPoolExecutor(8, "periodic")
        self._submit: Submit = submit if submit is not None else self._pool.submit  # type: ignore[union-attr]
        self._tasks: dict[str, _Task] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Overdue episodes per task (the counter's values).
        self.overdue_total: dict[str, int] = {}

    def add(self, name: str, fn: Callable[[], object], interval_s: float,
            *, first_in_s: float | None = None) -> None:  # fmt: skip
        """Run ``fn`` every ``interval_s``, first after ``first_in_s`` (default: one interval)."""
        first = interval_s if first_in_s is None else first_in_s
        with self._lock:
            self._tasks[name] = _Task(name, fn, interval_s, self._clock() + first)
            self.overdue_total.setdefault(name, 0)
        self._wake.set()

    def interval_s(self, name: str) -> float | None:
        task = self._tasks.get(name)
        return None if task is None else task.interval_s

    def reschedule(self, name: str, interval_s: float) -> None:
        """A new interval for a task, counted from now (nothing when it is not added)."""
        with self._lock:
            task = self._tasks.get(name)
            if task is not None:
                task.interval_s = interval_s
                task.due = self._clock() + interval_s
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="periodic", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop starting tasks; runs in progress are not waited for."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            wait = self.run_due()
            self.check()
            self._wake.wait(min(wait, MAX_WAIT_S))
            self._wake.clear()

    def run_due(self) -> float:
        """Start every task that is due and not running; seconds until the next is due."""
        now = self._clock()
        with self._lock:
            starting = [t for t in self._tasks.values() if not t.running and t.due <= now]
            for task in starting:
                task.running = True
                task.due = now + task.interval_s
            waiting = [t.due - now for t in self._tasks.values() if not t.running]
        for task in starting:
            self._submit(lambda task=task: self._run(task))  # type: ignore[misc]
        return max(0.0, min(waiting, default=MAX_WAIT_S))

    def _run(self, task: _Task) -> None:
        try:
            task.fn()
        except Exception as e:  # one failing run must not stop the task's later runs
            if describe(e) != task.error:
                log.exception("periodic task %s failed (logged again only when it changes)",
                              task.name)  # fmt: skip
            task.error = describe(e)
        else:
            task.error = None
        finally:
            with self._lock:
                task.running = False
            self._wake.set()

    def check(self) -> list[str]:
        """Tasks that just became overdue: each logged and counted once per episode."""
        now = self._clock()
        late: list[tuple[_Task, float]] = []
        with self._lock:
            for task in self._tasks.values():
                behind = now - task.due
                if behind > self.grace_s and not task.overdue:
                    task.overdue = True
                    self.overdue_total[task.name] += 1
                    late.append((task, behind))
                elif behind <= self.grace_s and task.overdue:
                    task.overdue = False
                    log.info("periodic task %s runs on time again", task.name)
        for task, behind in late:
            what = "its last run has not finished" if task.running else "it has not started"
            log.warning("periodic task %s is %.0f s overdue: %s", task.name, behind, what)
        return [task.name for task, _ in late]

    def overdue_counts(self) -> dict[str, int]:
        """Overdue episodes per task so far (``gpuwatchd_periodic_overdue_total``)."""
        with self._lock:
            return dict(self.overdue_total)

    def stalled(self, limit_s: float) -> list[str]:
        """Tasks more than ``limit_s`` past when they were due (stuck, not just late)."""
        now = self._clock()
        with self._lock:
            return [t.name for t in self._tasks.values() if now - t.due > limit_s]
