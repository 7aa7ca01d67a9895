"""The daemon's link to its store: reconnects in the background, tells who waits for it.

The daemon starts and runs without its store (telemetry, the gate and /metrics need
none of it). A periodic task calls :class:`StoreLink` every second: while the store
is down (or never opened) it probes it; once it answers again, the listeners hear of
it (the scheduler records the sessions an outage cut off, the winners cache refreshes).
The store itself logs one line when it goes down and one when it is back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpuwatchd.store import SqlStore, StoreError
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

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def __call__(self) -> None:
        if not self._store.up:
            try:
                self._store.probe()
            except StoreUnavailable:
                pass  # logged once per outage by the store
            except StoreError as exc:
                if str(exc) != self._refused:
                    self._refused = str(exc)
                    log.error("%s; tuning waits until this is fixed", exc)
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
