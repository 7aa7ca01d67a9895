"""The aggregator: runs every sub-collector timed and isolated, like node_exporter's execute().

Each sub-collector gets a ``gpuwatchd_scrape_collector_success`` and a
``gpuwatchd_scrape_collector_duration_seconds`` series under its name. One that raises
has all of its families dropped (half a family set would look like real absences) and
the rest of the scrape is still served; the failure is logged once per failure streak.

Every sub-collector runs in a worker thread of its own under one deadline per scrape, so
one that hangs (a lock held by a stuck writer, a store on a dead disk) is reported as
failed and the scrape still answers. A worker still busy with an earlier run is not given
another: concurrent scrapes share the run in progress (until its deadline),
and a run already past its deadline is reported failed at once, so a hung collector
costs one thread and no scrape waits on it twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

#: Seconds a scrape waits for its sub-collectors, all together. Well under Prometheus'
#: default 10 s scrape timeout; every sub-collector reads in-memory state in milliseconds.
COLLECTOR_DEADLINE_S = 2.0


class SubCollector(Protocol):
    """A named source of metric families; ``name`` becomes the ``collector`` label."""

    name: str

    def collect(self) -> Iterable[Metric]: ...


class _Run:
    """One call of a sub-collector's ``collect()``: its families, or how it failed."""

    __slots__ = ("done", "error", "families", "started")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.done = threading.Event()
        self.families: list[Metric] | None = None
        self.error: BaseException | None = None


class _Worker:
    """A daemon thread that runs one sub-collector, one run at a time.

    :meth:`start` returns the run in progress when there is one, so a hung collector is
    never called again until it returns. Daemon, so a hung collector cannot hold up exit.
    """

    def __init__(self, sub: SubCollector) -> None:
        self.sub = sub
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._current: _Run | None = None
        self._pending = False
        self._thread: threading.Thread | None = None

    def start(self) -> tuple[_Run, bool]:
        """The run to wait for, and whether it was already in progress (a hang or a share)."""
        with self._lock:
            if self._current is not None and not self._current.done.is_set():
                return self._current, True
            run = self._current = _Run()
            self._pending = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"gpuwatchd-collector-{self.sub.name}", daemon=True
                )
                self._thread.start()
            else:
                self._wake.notify()
            return run, False

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._wake.wait()
                self._pending = False
                run = self._current
            assert run is not None
            try:
                run.families = list(self.sub.collect())
            except Exception as exc:
                run.error = exc
            run.done.set()


class GpuwatchdCollector:
    """Every sub-collector in order, then their success and duration self-metrics.

    ``deadline_s`` bounds how long one scrape waits for all sub-collectors together.
    """

    def __init__(
        self,
        subcollectors: Sequence[SubCollector],
        timer: Callable[[], float] = time.perf_counter,
        deadline_s: float = COLLECTOR_DEADLINE_S,
    ) -> None:
        names = [sub.name for sub in subcollectors]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"subcollectors: duplicate collector name(s) {duplicates}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self._workers = tuple(_Worker(sub) for sub in subcollectors)
        self._timer = timer
        self._deadline_s = deadline_s
        self._failing: set[str] = set()
        self._failing_lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        success = GaugeMetricFamily(
            "gpuwatchd_scrape_collector_success",
            "1 if the named gpuwatchd collector succeeded during this scrape, else 0 (its "
            "metrics are then missing).",
            labels=("collector",),
        )
        duration = GaugeMetricFamily(
            "gpuwatchd_scrape_collector_duration_seconds",
            "Seconds the named gpuwatchd collector took during this scrape.",
            labels=("collector",),
            unit="seconds",
        )
        start = self._timer()
        runs = [(worker, *worker.start()) for worker in self._workers]
        for worker, run, stuck in runs:
            timeout = run.started + self._deadline_s - time.monotonic()
            finished = run.done.wait(max(0.0, timeout))
            elapsed = self._timer() - start
            families = self._outcome(worker.sub.name, run, finished, stuck)
            yield from families or ()
            success.add_metric([worker.sub.name], float(families is not None))
            duration.add_metric([worker.sub.name], elapsed)
        yield success
        yield duration

    def _outcome(self, name: str, run: _Run, finished: bool, stuck: bool) -> list[Metric] | None:
        """The run's families, or None if it failed or missed the deadline (logged once)."""
        if finished and run.error is None:
            with self._failing_lock:
                recovered = name in self._failing
                self._failing.discard(name)
            if recovered:
                log.info("collector %r recovered", name)
            return run.families
        with self._failing_lock:
            first = name not in self._failing
            self._failing.add(name)
        if first and finished:
            log.error(
                "collector %r failed; its metrics are missing",
                name,
                exc_info=(type(run.error), run.error, run.error.__traceback__)
                if run.error is not None
                else None,
            )
        elif first:
            why = "is still stuck in an earlier scrape" if stuck else "missed the deadline"
            log.error(
                "collector %r %s (%.3g s); its metrics are missing until it returns",
                name,
                why,
                self._deadline_s,
            )
        return None
