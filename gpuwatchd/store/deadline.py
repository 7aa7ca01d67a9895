"""A bound on each call to a store across the network, kept by the client's own clock.

A frozen server (its processes stopped, its VM paused) keeps the TCP connection open and
its kernel acknowledges what it is sent, so neither TCP keepalives nor
``tcp_user_timeout`` notice, and a server-side ``statement_timeout`` never runs. Only the
client can bound the wait: :class:`Watchdog` runs an action (hanging up the call's
connection, which fails the blocked call at once) when a call overruns. One thread
serves every armed call, so arming costs no thread per call. Hand-written: the standard
library's ``threading.Timer`` starts a thread per call, and ``sched`` blocks its caller.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable

#: The longest one call to a PostgreSQL store (a transaction with its statements) may
#: wait for the server before it fails with :class:`~gpuwatchd.store.errors.StoreError`.
CALL_TIMEOUT_S = 30.0


class Alarm:
    """One armed call: ``action`` runs at ``due`` (monotonic seconds) unless disarmed."""

    __slots__ = ("action", "disarmed", "due", "fired")

    def __init__(self, due: float, action: Callable[[], None]) -> None:
        self.due = due
        self.action = action
        self.fired = False
        self.disarmed = False


class Watchdog:
    """Runs each armed alarm's action once its time is up, on one daemon thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, action: Callable[[], None]) -> Alarm:
        """Run ``action`` in ``seconds`` unless :meth:`disarm` comes first; it must be
        quick (a syscall): every alarm waits for it."""
        alarm = Alarm(self._clock() + seconds, action)
        with self._cond:
            heapq.heappush(self._heap, (alarm.due, next(self._order), alarm))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="gpuwatchd-store-deadline", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return alarm

    def disarm(self, alarm: Alarm) -> bool:
        """Cancel ``alarm``; whether its action ran (it has finished when this returns)."""
        with self._cond:
            alarm.disarmed = True
            return alarm.fired

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].disarmed:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - self._clock()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                alarm = heapq.heappop(self._heap)[2]
                alarm.fired = True
                # Under the lock: disarm() returns only once the action is done, so the
                # caller never closes the connection while it is being hung up on.
                with contextlib.suppress(Exception):  # a hang-up of a closed connection
                    alarm.action()


#: The process's one watchdog: every store shares its thread.
WATCHDOG = Watchdog()
