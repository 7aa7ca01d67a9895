"""A stop flag that periodic threads sleep on between their turns.

``threading.Event.wait`` builds a lock, a waiter-list entry and a Condition round trip
at every call; a daemon thread that wakes ten times a second pays that at every turn.
:class:`StopSignal` sleeps on one lock acquire with a timeout instead (hand-written:
the standard library has no cheaper interruptible sleep), and once set it wakes every
sleeper, at once and for good. Safe to set from any thread or a signal handler.
"""

from __future__ import annotations

import contextlib
import threading


class StopSignal:
    """``set()`` once; ``wait(timeout)`` sleeps until then (True) or the timeout (False)."""

    __slots__ = ("_gate", "_set")

    def __init__(self) -> None:
        self._set = False
        self._gate = threading.Lock()  # held while unset: a sleeper blocks acquiring it
        self._gate.acquire()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        self._open()

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds (None: until set); whether the signal is set."""
        if self._set:
            return True
        limit = -1.0 if timeout is None else min(max(0.0, timeout), threading.TIMEOUT_MAX)
        if self._gate.acquire(True, limit):
            self._open()  # pass it on: the other sleepers wake too
            return True
        return self._set

    def _open(self) -> None:
        # Any thread may release a Lock; a second release (set twice, or set while a
        # woken sleeper passes it on) finds it open already, which is the state wanted.
        with contextlib.suppress(RuntimeError):
            self._gate.release()
