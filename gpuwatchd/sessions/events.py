"""Session events: whoever cares is told when a tuning session ends, instead of polling the store.

Listener style: :class:`SessionEvents` keeps a list of callables and the
runner calls :meth:`SessionEvents.notify` once per session it ends, right after the
store has accepted the final status. Listeners run on the session's thread, one after
another: each must be quick and must not block on a GPU. One that raises is logged
and the others are still called.

On a store shared by a fleet, pending work can also end without a session here: the
scheduler skips work whose fresh winners identical hosts measured, and tells its skip
listeners (:class:`WorkSkipped`) the same way, so what waits on that work's winners
(drift references, users' requests) learns they exist.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatchd.tuning.types import SessionStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionFinished:
    """A tuning session ended; its row in the store is final (results, winners, totals)."""

    session_id: int
    gpu_index: int
    gpu_uuid: str
    gpu_model: str
    status: SessionStatus
    why: str | None = None
    #: The workloads the session was asked to tune (completed: each has its results).
    workloads: tuple[str, ...] = ()

    @property
    def completed(self) -> bool:
        """Completed sessions are the ones that change winners and drift references."""
        return self.status is SessionStatus.COMPLETED


SessionListener = Callable[[SessionFinished], None]


@dataclass(frozen=True, slots=True)
class WorkSkipped:
    """Pending work taken off one GPU's list unmeasured: identical hosts measured fresh
    winners for it in every regime tuned, and they are in the shared store now."""

    gpu_index: int
    gpu_uuid: str
    gpu_model: str
    workloads: tuple[str, ...]
    reason: str  # gpuwatchd_fleet_work_skipped_total's label (fresh_fleet_winner)


SkipListener = Callable[[WorkSkipped], None]


class SessionEvents:
    """The listeners told about finished sessions and skipped work. Thread-safe to add,
    remove and notify."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: tuple[SessionListener, ...] = ()
        self._skip_listeners: tuple[SkipListener, ...] = ()

    def add_listener(self, fn: SessionListener) -> None:
        """Call ``fn`` for every session that ends from now on."""
        with self._lock:
            self._listeners = (*self._listeners, fn)

    def remove_listener(self, fn: SessionListener) -> None:
        """Stop calling ``fn``; ValueError if it was never added."""
        with self._lock:
            listeners = list(self._listeners)
            listeners.remove(fn)
            self._listeners = tuple(listeners)

    def notify(self, event: SessionFinished) -> None:
        """Tell every listener, in the order added; a failing one is logged and skipped."""
        for fn in self._listeners:
            try:
                fn(event)
            except Exception:
                log.exception("session listener %r failed on session %d", fn, event.session_id)

    def add_skip_listener(self, fn: SkipListener) -> None:
        """Call ``fn`` for all work skipped from now on (one call per GPU and decision)."""
        with self._lock:
            self._skip_listeners = (*self._skip_listeners, fn)

    def notify_skipped(self, event: WorkSkipped) -> None:
        """Tell every skip listener, in the order added; a failing one is logged and skipped."""
        for fn in self._skip_listeners:
            try:
                fn(event)
            except Exception:
                log.exception(
                    "skip listener %r failed on GPU %d's %s", fn, event.gpu_index,
                    ", ".join(event.workloads),
                )  # fmt: skip
