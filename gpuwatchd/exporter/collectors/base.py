"""The aggregator: runs every sub-collector timed and isolated, like node_exporter's execute().

Each sub-collector gets a ``gpuwatchd_scrape_collector_success`` and a
``gpuwatchd_scrape_collector_duration_seconds`` series under its name. One that raises
has all of its families dropped (half a family set would look like real absences) and
the rest of the scrape is still served; the failure is logged once per failure streak.

A sub-collector that may block (a lock, a store) runs in a worker thread of its own under
one deadline per scrape, so one that hangs (a lock held by a stuck writer, a store on a
dead disk) is reported as failed and the scrape still answers. A worker still busy with
an earlier run is not given another: concurrent scrapes share the run in progress (until
its deadline), and a run already past its deadline is reported failed at once, so a hung
collector costs one thread and no scrape waits on it twice. One that only reads
immutable in-memory snapshots says so (``runs_inline = True``) and runs in the scrape's
own thread: it cannot hang, and a thread hand-off costs more than most such collectors.

:meth:`GpuwatchdCollector.render` also keeps each sub-collector's encoded families: one
with a ``version()`` (equal versions, equal output) is re-run only when its version
changed or its text is ``max_age_s`` old, so a scrape after a poll re-renders the GPU
families and reuses the tuning, drift and fleet ones. A sub-collector whose output is
read from its versioned sources alone, never from a clock (``timeless = True``), keeps
its text until its version changes, however old: at one scrape a second, the age limit
alone would re-run every collector at every other scrape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

#: Seconds a scrape waits for its sub-collectors, all together. Well under Prometheus'
#: default 10 s scrape timeout; every sub-collector reads in-memory state in milliseconds.
COLLECTOR_DEADLINE_S = 2.0


class SubCollector(Protocol):
    """A named source of metric families; ``name`` becomes the ``collector`` label.

    Optional, read with ``getattr``: ``version()`` returns a value that compares equal
    whenever the output would (the objects its data comes from: an identity check
    first, so an unchanged snapshot costs nothing); ``runs_inline = True`` says
    ``collect`` reads only immutable in-memory state and cannot block; ``timeless =
    True`` says its output is made from what ``version()`` versions and nothing else (no
    clock), so a kept text never goes stale while the version holds.
    """

    name: str

    def collect(self) -> Iterable[Metric]: ...


class Versioned:
    """A sub-collector given a version (and the right to run inline) from outside.

    For a collector whose data sources its owner knows better than the collector does
    (the daemon wires the fleet collector this way).
    """

    def __init__(
        self, sub: SubCollector, version: Callable[[], object], runs_inline: bool = False
    ) -> None:
        self.name = sub.name
        self._sub = sub
        self.version = version
        self.runs_inline = runs_inline

    def collect(self) -> Iterable[Metric]:
        return self._sub.collect()


#: Encodes a list of families (one sub-collector's) in the scrape's format.
Encode = Callable[[list[Metric]], bytes]
_UNVERSIONED = object()


class _Part:
    """One sub-collector's encoded families, and what they were made from."""

    __slots__ = ("body", "created", "version")

    def __init__(self, version: object, created: float, body: bytes) -> None:
        self.version = version
        self.created = created
        self.body = body


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
        self.inline = bool(getattr(sub, "runs_inline", False))
        self.timeless = bool(getattr(sub, "timeless", False))
        self._version: Callable[[], object] | None = getattr(sub, "version", None)
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

    def version(self) -> object:
        """The sub-collector's version now; a fresh object (never equal) if it has none."""
        if self._version is None:
            return _UNVERSIONED
        try:
            return self._version()
        except Exception:
            log.exception("collector %r: version() failed; rendering it afresh", self.sub.name)
            return _UNVERSIONED

    def run_here(self) -> _Run:
        """Run an inline sub-collector in the calling thread."""
        run = _Run()
        self._collect_into(run)
        return run

    def _collect_into(self, run: _Run) -> None:
        """Collect into ``run``: its families, or the error; then it is done."""
        try:
            run.families = list(self.sub.collect())
        except Exception as exc:
            run.error = exc
        run.done.set()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._wake.wait()
                self._pending = False
                run = self._current
            assert run is not None
            self._collect_into(run)


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
        self._parts: dict[tuple[str, Hashable], _Part] = {}  # (collector, format) -> text

    def collect(self) -> Iterator[Metric]:
        start = self._timer()
        runs = self._start(self._workers)
        results: list[tuple[str, bool, float]] = []
        for worker, run, stuck in runs:
            families = self._finish(worker, run, stuck)
            yield from families or ()
            results.append((worker.sub.name, families is not None, self._timer() - start))
        yield from self._self_metrics(results)

    def render(
        self, encode: Encode, fmt: Hashable, max_age_s: float, now: float, *, wait: bool = True
    ) -> bytes | None:
        """Everything :meth:`collect` yields, encoded, reusing each sub-collector's text
        while its version is unchanged and younger than ``max_age_s`` (``now``, monotonic;
        a ``timeless`` one's at any age).

        ``fmt`` names the encoding (texts of different formats are kept apart). The
        version is read before the sub-collector runs, so a kept text is never older
        than what its version says. ``wait=False``: None, having run nothing, when a
        sub-collector that runs in its own thread would have to run (the caller must not
        wait for one, e.g. an event loop).
        """
        start = self._timer()
        bodies: list[bytes | None] = [None] * len(self._workers)
        versions: list[object] = []
        results: list[tuple[str, bool, float]] = []
        todo: list[_Worker] = []
        for i, worker in enumerate(self._workers):
            version = worker.version()
            versions.append(version)
            part = self._parts.get((worker.sub.name, fmt))
            if (
                part is not None
                and version is not _UNVERSIONED
                and (worker.timeless or 0 <= now - part.created < max_age_s)
                and part.version == version
            ):
                bodies[i] = part.body
            else:
                todo.append(worker)
        if not wait and not all(w.inline for w in todo):
            return None
        ran = {id(w): (run, stuck) for w, run, stuck in self._start(todo)}
        for i, worker in enumerate(self._workers):
            name = worker.sub.name
            if bodies[i] is None:
                run, stuck = ran[id(worker)]
                body = self._finish_encoded(worker, run, stuck, encode)
                if body is not None:
                    bodies[i] = body
                    if versions[i] is not _UNVERSIONED:
                        self._parts[(name, fmt)] = _Part(versions[i], now, body)
            results.append((name, bodies[i] is not None, self._timer() - start))
        return b"".join(b for b in bodies if b) + encode(self._self_metrics(results))

    def _start(self, workers: Sequence[_Worker]) -> list[tuple[_Worker, _Run, bool]]:
        """Start the threaded runs first (they overlap), then run the inline ones here."""
        started = {id(w): w.start() for w in workers if not w.inline}
        out = []
        for worker in workers:
            run, stuck = started[id(worker)] if not worker.inline else (worker.run_here(), False)
            out.append((worker, run, stuck))
        return out

    def _finish(self, worker: _Worker, run: _Run, stuck: bool) -> list[Metric] | None:
        timeout = run.started + self._deadline_s - time.monotonic()
        finished = run.done.wait(max(0.0, timeout))
        return self._outcome(worker.sub.name, run, finished, stuck)

    def _finish_encoded(
        self, worker: _Worker, run: _Run, stuck: bool, encode: Encode
    ) -> bytes | None:
        """:meth:`_finish`, encoded: a sample the format cannot write (a value that is not
        a number) fails the collector as an exception in its ``collect()`` does."""
        timeout = run.started + self._deadline_s - time.monotonic()
        finished = run.done.wait(max(0.0, timeout))
        body = b""
        if finished and run.error is None:
            try:
                body = encode(run.families or [])
            except Exception as exc:
                failed = _Run()  # not the shared run: another format may encode it fine
                failed.error = exc
                failed.done.set()
                run = failed
        families = self._outcome(worker.sub.name, run, finished, stuck)
        return None if families is None else body

    @staticmethod
    def _self_metrics(results: Iterable[tuple[str, bool, float]]) -> list[Metric]:
        """Success and duration per sub-collector (duration: seconds into the scrape
        when its families were ready; ~0 for a reused text)."""
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
        for name, ok, elapsed in results:
            success.add_metric([name], float(ok))
            duration.add_metric([name], elapsed)
        return [success, duration]

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
