"""Share one in-flight computation between concurrent callers asking for the same key.

Rendering /metrics for 8 GPUs costs milliseconds of GIL-bound Python. When several
scrapers (an HA Prometheus pair, Grafana, a curl loop) arrive together, rendering once
per request would queue them behind each other; sharing the render in flight bounds
the CPU to one render at a time and the latency to about one render. Nothing is cached:
a caller arriving after a render finished starts a fresh one, so a shared result is at
most one render old.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedFailure(RuntimeError):
    """The computation a caller joined failed in another thread (the cause is chained)."""


class _Flight(Generic[T]):
    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class SingleFlight(Generic[T]):
    """``run(key, fn)``: the first caller runs ``fn``; callers arriving meanwhile wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Hashable, _Flight[T]] = {}

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise SharedFailure(f"shared computation for {key!r} failed") from flight.error
            return flight.result  # type: ignore[return-value]  # set whenever error is None
        return self._lead(key, flight, fn)

    def lead(self, key: Hashable, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """``(True, fn())`` with callers arriving meanwhile sharing it, or ``(False, None)``
        at once, running nothing, when a computation for ``key`` is in flight."""
        with self._lock:
            if key in self._flights:
                return False, None
            flight = self._flights[key] = _Flight()
        return True, self._lead(key, flight, fn)

    def _lead(self, key: Hashable, flight: _Flight[T], fn: Callable[[], T]) -> T:
        try:
            flight.result = fn()
            return flight.result
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()
