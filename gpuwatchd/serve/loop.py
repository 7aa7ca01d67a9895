"""The servers' one event loop: an asyncio loop in one daemon thread, shared by its users.

The HTTP server and the control socket both hold their connections here (so an idle or
slow client of either costs a file descriptor, never a thread; bench/RESULTS.md, "One
server model"). Each server :meth:`~ServeLoop.acquire` s the loop when it starts and
:meth:`~ServeLoop.release` s it when it stops, after its own connections are closed on
the loop (:meth:`~ServeLoop.run`); the thread starts with the first user and ends with
the last, so servers stop in any order and one built alone gets a loop of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import ssl
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class ServeLoop:
    """One asyncio loop run by one daemon thread while anybody holds it."""

    def __init__(self, name: str = "gpuwatchd-serve") -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_log_loop_error)
        self._thread: threading.Thread | None = None
        self._users = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        """Count a user in; the first one starts the loop's thread."""
        with self._lock:
            if self.loop.is_closed():
                raise RuntimeError("the serve loop has ended")
            self._users += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def release(self, timeout: float = 1.0) -> None:
        """Count a user out; the last one stops the loop and waits up to ``timeout`` s."""
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._thread is None:
                return
            thread, self._thread = self._thread, None
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self.loop.call_soon_threadsafe(self.loop.stop)
        thread.join(timeout)

    def run(self, fn: Callable[[], T], timeout: float = 1.0) -> T | None:
        """``fn()`` on the loop's thread, waited for up to ``timeout`` s (None if the loop
        is not running or did not get to it in time); called from the loop, it runs now."""
        if self.in_loop():
            return fn()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        try:
            self.loop.call_soon_threadsafe(call)
        except RuntimeError:  # closed
            return None
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            return None

    def call_every(self, interval_s: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Run ``fn`` on the loop every ``interval_s`` (errors are logged, never raised);
        returns what cancels it (call it on the loop)."""
        handle: list[asyncio.TimerHandle] = []

        def tick() -> None:
            try:
                fn()
            except Exception:
                log.exception("periodic server task failed")
            handle[:] = [self.loop.call_later(interval_s, tick)]

        self.loop.call_soon_threadsafe(
            lambda: handle.append(self.loop.call_later(interval_s, tick))
        )

        def cancel() -> None:
            for h in handle:
                h.cancel()

        return cancel

    def in_loop(self) -> bool:
        """Whether the caller is the loop's own thread."""
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        finally:
            loop.close()


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """One line per unexpected loop error; client-caused socket errors only at DEBUG."""
    exc = context.get("exception")
    message = context.get("message", "error")
    if isinstance(exc, OSError | ssl.SSLError | asyncio.CancelledError):
        log.debug("server loop: %s: %r", message, exc)
        return
    log.error("server loop: %s: %r", message, exc)
    if exc is not None:
        log.debug("server loop error detail", exc_info=exc)
