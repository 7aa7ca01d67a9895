"""The servers' one event loop: an asyncio loop in one daemon thread, shared by its users.

The HTTP server and the control socket both hold their connections here (so an idle or
slow client of either costs a file descriptor, never a thread; bench/RESULTS.md, "One
server model"). Each server :meth:`~ServeLoop.acquire` s the loop when it starts and
:meth:`~ServeLoop.release` s it when it stops, after its own connections are closed on
the loop (:meth:`~ServeLoop.run`); the thread starts with the first user and ends with
the last, so servers stop in any order and one built alone gets a loop of its own.
Both accept their connections through one :class:`Acceptor`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
#: After a failed accept() (out of fds), how long accepting pauses: never spin on a
#: listener that stays readable.
ACCEPT_BACKOFF_S = 0.1


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


class Acceptor:
    """Accepts connections on a listening socket from the serve loop, for a server.

    At most ``batch`` per wake-up, so a flood of connections cannot starve the loop; a
    connection reset before it was taken is skipped. A failed accept() (out of file
    descriptors) calls ``on_failure`` (which may shed a connection and returns a note for
    the log), pauses accepting for :data:`ACCEPT_BACKOFF_S` and is logged once, until
    accepting works again. ``admit`` gets each accepted socket and its peer address.
    """

    def __init__(
        self,
        serve_loop: ServeLoop,
        listener: socket.socket,
        admit: Callable[[socket.socket, Any], None],
        *,
        name: str,
        batch: int,
        logger: logging.Logger = log,
        on_failure: Callable[[OSError], str] = lambda exc: "",
    ) -> None:
        self.listener = listener
        self._serve_loop = serve_loop
        self._admit = admit
        self._name = name
        self._batch = batch
        self._log = logger
        self._on_failure = on_failure
        self._failing = False

    def start(self) -> None:
        """Start accepting (from any thread; the loop must be running or about to)."""
        self.listener.setblocking(False)
        loop = self._serve_loop.loop
        loop.call_soon_threadsafe(loop.add_reader, self.listener.fileno(), self._accept)

    def close(self) -> None:
        """On the loop: stop accepting and close the listener."""
        with contextlib.suppress(ValueError, OSError):
            self._serve_loop.loop.remove_reader(self.listener.fileno())
        self.listener.close()

    def _accept(self) -> None:
        if self.listener.fileno() < 0:
            return
        for _ in range(self._batch):
            try:
                conn, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return  # none left, or the client gave up between wake-up and accept
            except ConnectionError:  # reset before we got to it
                continue
            except OSError as exc:
                self._failed(exc)
                return
            if self._failing:
                self._failing = False
                self._log.info("%s: accepting connections again", self._name)
            self._admit(conn, address)

    def _failed(self, exc: OSError) -> None:
        note = self._on_failure(exc)
        if not self._failing:
            self._failing = True
            self._log.warning(
                "%s: accept failed (%s)%s; pausing accept for %g s",
                self._name,
                exc.strerror or exc,
                note,
                ACCEPT_BACKOFF_S,
            )
        loop = self._serve_loop.loop
        loop.remove_reader(self.listener.fileno())
        loop.call_later(ACCEPT_BACKOFF_S, self._resume)

    def _resume(self) -> None:
        if self.listener.fileno() >= 0:
            self._serve_loop.loop.add_reader(self.listener.fileno(), self._accept)


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
