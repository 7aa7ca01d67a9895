"""The daemon's link to its store: reconnects in the background, tells who waits for it.

The daemon starts and runs without its store (telemetry, the gate and /metrics need
none of it). One call of :class:`StoreLink` is one look: while the store is down (or
never opened) it probes it; once it answers again, the listeners hear of it (the
scheduler records the sessions an outage cut off, the winners cache refreshes). The
daemon's main loop calls :meth:`StoreLink.poke` at every turn (at least once a
second), which starts a look on a thread of its own only when a look has something to
do, at most once per :data:`CHECK_EVERY_S`: a store that stays up costs no thread
wake-up at all. A down (or refusing) one is probed without holding up the main loop,
each failed probe waiting longer before the next, with jitter, up to a minute
(:class:`~gpuwatchd.store.backoff.Backoff`): a fleet does not knock in step on a
database coming back, nor keeps failing logins with a wrong password. The store itself
logs one line when it goes down and one when it is back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpuwatchd.store import SqlStore, StoreError
from gpuwatchd.store.backoff import Backoff
from gpuwatchd.store.errors import StoreUnavailable

log = logging.getLogger(__name__)

#: How often the link looks at the store (a probe only while it is down).
CHECK_EVERY_S = 1.0


class StoreLink:
    """One call = one look at the store; ``listeners`` run when it comes back."""

    def __init__(self, store: SqlStore) -> None:
        self._store = store
        self._listeners: list[Callable[[], None]] = []
        self._was_up = store.up
        self._refused: str | None = None  # a non-transient error, logged once
        self._looking = threading.Lock()  # held by the look in progress
        self._last_look = -CHECK_EVERY_S  # time.monotonic() when the last poked look began
        self._backoff = Backoff(first_s=CHECK_EVERY_S)
        self._wait_s = CHECK_EVERY_S  # before the next look: longer after failed probes

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def due(self) -> bool:
        """Whether a look has anything to do: the store is down, or it came back and
        the listeners have not heard yet."""
        return not (self._store.up and self._was_up)

    def poke(self) -> None:
        """Start a look on a thread of its own if one is due, none is in progress and
        the last began long enough ago (:data:`CHECK_EVERY_S`, more after failed
        probes). Never blocks."""
        now = time.monotonic()
        if now - self._last_look < self._wait_s or not self.due():
            return
        if not self._looking.acquire(blocking=False):
            return  # a probe of an unreachable store still waiting: not doubled
        self._last_look = now
        try:
            threading.Thread(target=self._look, name="gpuwatchd-store-link", daemon=True).start()
        except RuntimeError as exc:  # no thread to be had (a cgroup's limit): the next turn tries
            self._looking.release()
            log.warning("looking at the store: cannot start a thread: %s", exc)
        except BaseException:
            self._looking.release()
            raise

    def _look(self) -> None:
        try:
            self()
        except Exception:  # the look's own bug: logged, and the next poke looks again
            log.exception("looking at the store failed")
        finally:
            self._looking.release()

    def __call__(self) -> None:
        if not self._store.up:
            try:
                self._store.probe()
            except StoreUnavailable:
                self._wait_s = self._backoff.failed()  # logged once per outage by the store
            except StoreError as exc:
                self._wait_s = self._backoff.failed()
                if str(exc) != self._refused:
                    self._refused = str(exc)
                    log.error("%s; tuning waits until this is fixed", exc)
            else:
                self._backoff.reset()
                self._wait_s = CHECK_EVERY_S
        up = self._store.up
        if up and not self._was_up:
            self._refused = None
            up = self._tell_listeners()
        self._was_up = up

    def _tell_listeners(self) -> bool:
        """Run the listeners; False when the store went away again meanwhile (they all
        run again once it is back: each must be safe to repeat)."""
        for listener in self._listeners:
            try:
                listener()
            except StoreUnavailable:
                return False
            except Exception:  # one listener's bug must not keep the others waiting
                log.exception("a listener for the store's return failed")
        return True
