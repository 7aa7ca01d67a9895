# asyncio, not cheroot/waitress: only it kept /metrics up under 1000 slow clients (bench/RESULTS.md)
"""The HTTP server's event loop: accepting, the connection cap, deadlines, TLS, framing.

One asyncio loop in one thread holds every connection, so an idle or dripping client
costs a file descriptor and a few hundred bytes, never a thread. A request that needs no
waiting (a liveness probe, a /metrics body kept or rendered from in-memory state, a
cached login) is answered in the callback that completed it, with no task or thread;
other routes run on a small thread pool, bcrypt on its own
(:mod:`gpuwatchd.serve.web.logins`). Limits:

* at most ``max_connections`` at once (and at most half the fd limit); at the cap, or when
  ``accept()`` runs out of file descriptors, the connection waiting longest for a request
  is closed to make room, and accepting pauses briefly after an fd failure (never spins);
* whole-request deadlines: a request's head and body must arrive within
  ``request_timeout_s`` of its first byte (so a byte every 5 s does not hold a connection),
  a kept-alive connection may idle ``idle_timeout_s`` between requests, a TLS client must
  finish its handshake within ``handshake_timeout_s``, and a response not taken by the
  client within ``write_timeout_s`` drops the connection.

Malformed requests get a 4xx and the connection closes; nothing a client sends is
logged above DEBUG or with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import resource
import socket
import ssl
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from gpuwatchd.serve.http_wire import (
    MAX_BODY,
    MAX_HEAD,
    HeadScanner,
    HttpError,
    RequestHead,
    frame_response,
    parse_head,
)
from gpuwatchd.serve.loop import Acceptor, ServeLoop
from gpuwatchd.serve.routes import Request, Response, Routes, error_response

if TYPE_CHECKING:  # the web-config modules load with the first request under a web config
    from gpuwatchd.serve.web.logins import LoginPool
    from gpuwatchd.serve.web.security import Admission, WebSecurity

log = logging.getLogger("gpuwatchd.serve.http")

#: What a plain-HTTP client on the TLS port gets (the words Go's net/http uses).
PLAIN_HTTP_ON_TLS = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
)
_TLS_HANDSHAKE_RECORD = 0x16
_FD_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ACCEPT_BATCH = 64  # accepts per wake-up, so a SYN flood cannot starve the loop
_MAX_BUFFERED = MAX_HEAD + MAX_BODY  # request bytes kept while a response is in progress
#: A response and whether the connection may stay open.
Answer = tuple[Response, bool]
#: An answer that needs waiting for (a bcrypt check, a route off the loop).
Pending = Coroutine[Any, Any, Answer]


@dataclass(frozen=True, slots=True)
class Limits:
    """Connection cap and deadlines; see the module docstring."""

    max_connections: int = 1024
    request_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    handshake_timeout_s: float = 10.0
    write_timeout_s: float = 10.0
    route_workers: int = 4


DEFAULT_LIMITS = Limits()


def connection_cap(max_connections: int) -> int:
    """``max_connections``, but at most half the soft fd limit: the rest of the daemon
    (store, worker pipes, NVML) keeps its file descriptors under a connection flood."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft // 2))


class _State(enum.Enum):
    PEEK = "peek"  # TLS port: waiting for the first byte (TLS record or plain HTTP?)
    HANDSHAKE = "handshake"  # TLS handshake (or the transport being set up)
    IDLE = "idle"  # waiting for the first byte of a request
    READING = "reading"  # part of a request has arrived
    BUSY = "busy"  # a request is being answered
    WRITING = "writing"  # the answer waits for the client to take it
    LINGER = "linger"  # answered and half-closed; discarding what the client still sends
    CLOSED = "closed"


_EVICTABLE = (_State.PEEK, _State.HANDSHAKE, _State.IDLE, _State.READING, _State.LINGER)
#: After a last answer, how long to discard what the client still sends before closing:
#: closing with unread bytes makes the kernel send a reset that can destroy the answer.
_LINGER_S = 2.0


class LoopServer:
    """Serves ``routes`` on a bound listening socket, on ``serve_loop`` (shared with the
    control socket; None: a loop of its own).

    ``security`` is read once per connection (TLS) and once per request (auth, headers),
    so swapping it (a reload) never gives a request half of each config.
    """

    def __init__(
        self,
        listener: socket.socket,
        routes: Routes,
        security: Callable[[], WebSecurity | None],
        limits: Limits = DEFAULT_LIMITS,
        serve_loop: ServeLoop | None = None,
    ) -> None:
        self.listener = listener
        self.routes = routes
        self.security = security
        self.limits = limits
        self.cap = connection_cap(limits.max_connections)
        self._conns: OrderedDict[_Connection, None] = OrderedDict()  # oldest wait first
        self._workers = ThreadPoolExecutor(limits.route_workers, "gpuwatchd-http")
        self._logins: LoginPool | None = None  # made by the first request with a web config
        self._serve_loop = serve_loop if serve_loop is not None else ServeLoop("gpuwatchd-http")
        self._loop = self._serve_loop.loop
        self._acceptor = Acceptor(
            self._serve_loop,
            listener,
            self._admit,
            name="HTTP",
            batch=_ACCEPT_BATCH,
            logger=log,
            on_failure=self._accept_failed,
        )
        self._started = False
        self._periodic: list[Callable[[], None]] = []

    # -- lifecycle (any thread) --------------------------------------------------------

    def start(self) -> None:
        self._serve_loop.acquire()
        self._started = True
        self._acceptor.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop accepting, cut every connection and let go of the loop."""
        if not self._started:
            return
        self._started = False
        self._serve_loop.run(self._shutdown, timeout)
        self._serve_loop.release(timeout)
        self._workers.shutdown(wait=False, cancel_futures=True)
        if self._logins is not None:
            self._logins.close()

    def call_every(self, interval_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop every ``interval_s`` (errors are logged, never raised)."""
        self._periodic.append(self._serve_loop.call_every(interval_s, fn))

    def connection_count(self) -> int:
        return len(self._conns)

    # -- the loop's thread -----------------------------------------------------------

    def _shutdown(self) -> None:
        self._acceptor.close()
        for cancel in self._periodic:
            cancel()
        for conn in list(self._conns):
            conn.close(abort=True)

    def _accept_failed(self, exc: OSError) -> str:
        """Out of fds: shed the connection waiting longest (the note for the log)."""
        open_now = len(self._conns)
        if exc.errno in _FD_EXHAUSTED:
            self._evict_one()
        return f" with {open_now} connections open; closing the longest-waiting one"

    def _admit(self, sock: socket.socket, address: Any) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self._conns) >= self.cap and not self._evict_one():
            log.debug("HTTP: %d connections, all busy; refusing %s", len(self._conns), address)
            sock.close()
            return
        security = self.security()
        ctx = security.ssl_context if security is not None else None
        conn = _Connection(self, sock, str(address[0]) if address else "", security)
        self._conns[conn] = None
        if ctx is not None:
            conn.peek(ctx)
        else:
            conn.setup(None)

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest without a request in progress."""
        for conn in self._conns:
            if conn.state in _EVICTABLE:
                log.debug("HTTP: at the connection cap, closing %s (%s)", conn.peer, conn.state)
                conn.close(abort=True)
                return True
        return False

    def released(self, conn: _Connection) -> None:
        self._conns.pop(conn, None)

    def waiting_again(self, conn: _Connection) -> None:
        """A connection became idle: it moves behind every connection waiting longer."""
        if conn in self._conns:
            self._conns.move_to_end(conn)

    # -- answering -------------------------------------------------------------------

    def answer(self, head: RequestHead, conn: _Connection) -> Answer | Pending:
        """The response to one request and whether the connection may stay open; where
        that needs waiting (a bcrypt check, a route off the loop), what to await for it."""
        security = self.security()
        request = Request(
            method=head.method,
            target=head.target,
            accept=head.header("accept"),
            accept_encoding=head.header("accept-encoding"),
        )
        if security is None:
            return self._route(request, head)
        from gpuwatchd.serve.web.logins import LoginPool
        from gpuwatchd.serve.web.security import Admission

        if self._logins is None:  # on the loop's thread only, as every request
            self._logins = LoginPool()
        admission = self._logins.admit_at_once(security, head.header("authorization"), conn.peer)
        if isinstance(admission, Admission):
            return self._admitted(admission, request, head, conn)
        check = self._logins.check(security, admission, conn.peer)  # counted from now on
        return self._after_check(check, request, head, conn)

    async def _after_check(
        self,
        check: asyncio.Future[str | None],
        request: Request,
        head: RequestHead,
        conn: _Connection,
    ) -> Answer:
        from gpuwatchd.serve.web.security import Admission

        user = await check
        admission = Admission.ALLOW if user is not None else Admission.UNAUTHORIZED
        answer = self._admitted(admission, request, head, conn)
        return answer if isinstance(answer, tuple) else await answer

    def _admitted(
        self, admission: Admission, request: Request, head: RequestHead, conn: _Connection
    ) -> Answer | Pending:
        from gpuwatchd.serve.web.auth import WWW_AUTHENTICATE
        from gpuwatchd.serve.web.security import Admission

        if admission is Admission.UNAUTHORIZED:
            log.debug("HTTP: unauthorized request from %s", conn.peer)
            challenge = (("WWW-Authenticate", WWW_AUTHENTICATE),)
            return error_response(401, "unauthorized", headers=challenge), head.keep_alive
        if admission is Admission.RATE_LIMITED:
            return error_response(429, "too many requests"), head.keep_alive
        return self._route(request, head)

    def _route(self, request: Request, head: RequestHead) -> Answer | Pending:
        at_once = self.routes.handle_at_once(request)  # no thread hop when nothing to wait for
        if at_once is not None:
            return at_once, head.keep_alive
        return self._route_off_loop(request, head)

    async def _route_off_loop(self, request: Request, head: RequestHead) -> Answer:
        loop = asyncio.get_running_loop()
        try:
            response = await loop.run_in_executor(self._workers, self.routes.handle, request)
        except RuntimeError:  # the pool is shut down: the server or the process is stopping
            return error_response(503, "shutting down"), False
        return response, head.keep_alive

    def frame(
        self, response: Response, head: RequestHead | None, keep_alive: bool, conn: _Connection
    ) -> bytes:
        security = self.security()
        extra = security.headers if security is not None else ()
        headers = (
            ("Server", "gpuwatchd"),
            ("Content-Type", response.content_type),
            *response.headers,
            *extra,
        )
        return frame_response(
            response.status,
            headers,
            response.body,
            head_only=head is not None and head.method == "HEAD",
            keep_alive=keep_alive,
            http10_keep_alive=keep_alive and head is not None and head.version == (1, 0),
        )


class _Connection(asyncio.Protocol):
    """One client connection: a small state machine driven by the loop's callbacks."""

    def __init__(
        self, server: LoopServer, sock: socket.socket, peer: str, security: WebSecurity | None
    ) -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.security = security  # the config this connection was accepted under
        self.state = _State.HANDSHAKE
        self.transport: asyncio.Transport | None = None
        self._loop = server._loop
        self._buf = bytearray()
        self._scanner = HeadScanner()
        self._head: RequestHead | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._setup: asyncio.Task[Any] | None = None
        self._task: asyncio.Task[Answer] | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._close_after = False

    # -- setup -----------------------------------------------------------------------

    def peek(self, ctx: ssl.SSLContext) -> None:
        """TLS port: look at the first byte before the handshake, to answer plain HTTP."""
        self.state = _State.PEEK
        self._loop.add_reader(self.sock.fileno(), self._peeked, ctx)
        self._arm(self.server.limits.handshake_timeout_s)

    def _peeked(self, ctx: ssl.SSLContext) -> None:
        try:
            first = self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            first = b""
        self._loop.remove_reader(self.sock.fileno())
        if first and first[0] == _TLS_HANDSHAKE_RECORD:
            self.setup(ctx)
            return
        if first[:1].isalpha():  # a plain HTTP request line
            with contextlib.suppress(OSError):
                self.sock.recv(MAX_HEAD)  # read it, so closing does not reset the answer
                self.sock.send(PLAIN_HTTP_ON_TLS)
                self.sock.shutdown(socket.SHUT_WR)
            log.debug("HTTP: plain HTTP from %s on the TLS port", self.peer)
        self.close(abort=True)

    def setup(self, ctx: ssl.SSLContext | None) -> None:
        """Hand the socket to asyncio (with the TLS handshake when ``ctx`` is given)."""
        self.state = _State.HANDSHAKE
        timeout = self.server.limits.handshake_timeout_s
        if ctx is not None:
            self._arm(timeout + 1.0)  # asyncio's own handshake timeout fires first
            coro = self._loop.connect_accepted_socket(
                lambda: self, self.sock, ssl=ctx, ssl_handshake_timeout=timeout
            )
        else:
            coro = self._loop.connect_accepted_socket(lambda: self, self.sock)
        self._setup = self._loop.create_task(coro)
        self._setup.add_done_callback(self._setup_done)

    def _setup_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():
                log.debug("HTTP: TLS with %s failed: %s", self.peer, task.exception())
            self._release()
            with contextlib.suppress(OSError):
                self.sock.close()

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=0)  # pause_writing whenever anything waits
        security = self.security
        if security is not None and security.ssl_context is not None:
            peer_cert = transport.get_extra_info("peercert")
            if not security.peer_allowed(peer_cert):
                log.info("HTTP: TLS from %s: client certificate has no allowed SAN", self.peer)
                self.close(abort=True)
                return
        self._become_idle()

    def data_received(self, data: bytes) -> None:
        if self.state in (_State.LINGER, _State.CLOSED):
            return
        self._buf += data
        self._flow()
        if self.state not in (_State.BUSY, _State.WRITING):
            self._process()

    def eof_received(self) -> bool:
        if self.state is _State.LINGER:
            self._disarm()
            return False  # the client has everything and is done: close now
        if self.state not in (_State.BUSY, _State.WRITING):
            return False
        self._close_after = True
        # Half-closed: still answer the request in progress (TLS transports cannot).
        return self.transport is None or self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _State.CLOSED
        self._disarm()
        if self._task is not None:
            self._task.cancel()
        self._release()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self.state is _State.WRITING:
            self._after_response()

    # -- requests --------------------------------------------------------------------

    def _process(self) -> None:
        """Parse what has arrived; start answering once a whole request is in."""
        if self.state is _State.IDLE:
            blank = 0
            while blank < len(self._buf) and self._buf[blank] in b"\r\n":
                blank += 1
            del self._buf[:blank]  # empty lines before a request line are allowed
            if not self._buf:
                return
            self.state = _State.READING
            self._arm(self.server.limits.request_timeout_s)
        if self.state is not _State.READING:
            return
        try:
            if self._head is None:
                end = self._scanner.end(self._buf)
                if end is None:
                    return
                self._head = parse_head(bytes(self._buf[:end]))
                del self._buf[:end]
            if len(self._buf) < self._head.body_length:
                return
        except HttpError as exc:
            log.debug("HTTP: %s from %s: %s", exc.status, self.peer, exc.message)
            self._send_error(exc.status, exc.message)
            return
        head, self._head = self._head, None
        del self._buf[: head.body_length]
        self._flow()
        self._scanner.reset()
        self._disarm()
        self.state = _State.BUSY
        try:
            answer = self.server.answer(head, self)
        except Exception as exc:
            self._respond(None, exc, head)
            return
        if isinstance(answer, tuple):  # answered on the loop: no task, no thread
            self._respond(answer, None, head)
            return
        self._task = self._loop.create_task(answer)
        self._task.add_done_callback(lambda task: self._answered(task, head))

    def _answered(self, task: asyncio.Task[Answer], head: RequestHead) -> None:
        self._task = None
        if self.state is _State.CLOSED or task.cancelled():
            return
        error = task.exception()
        self._respond(task.result() if error is None else None, error, head)

    def _respond(
        self, answer: Answer | None, error: BaseException | None, head: RequestHead
    ) -> None:
        if answer is None:
            log.error("HTTP: answering %s %s failed: %r", head.method, head.target[:200], error)
            response, keep_alive = error_response(500, "internal error"), False
        else:
            response, keep_alive = answer
        keep_alive = keep_alive and not self._close_after
        self._write(self.server.frame(response, head, keep_alive, self), keep_alive)

    def _send_error(self, status: int, message: str) -> None:
        phrase = _phrase(status)
        response = error_response(status, phrase, detail=message[:200])
        self._write(self.server.frame(response, None, False, self), keep_alive=False)

    def _write(self, data: bytes, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        self._close_after = self._close_after or not keep_alive
        self.state = _State.WRITING
        if self._writing_paused:
            self._arm(self.server.limits.write_timeout_s)
        else:
            self._after_response()

    def _after_response(self) -> None:
        if self._close_after:
            self.close(abort=False)
            return
        self._become_idle()
        if self._buf:  # pipelined: next turn of the loop, so answers at once do not recurse
            self._loop.call_soon(self._process)

    def _become_idle(self) -> None:
        self.state = _State.IDLE
        self.server.waiting_again(self)
        self._arm(self.server.limits.idle_timeout_s)

    def _flow(self) -> None:
        """Stop reading while a pipelining client is far ahead of us; go on once we catch up."""
        if self.transport is None or self.transport.is_closing():
            return
        if not self._reading_paused and len(self._buf) > _MAX_BUFFERED:
            self._reading_paused = True
            self.transport.pause_reading()
        elif self._reading_paused and len(self._buf) <= _MAX_BUFFERED // 2:
            self._reading_paused = False
            self.transport.resume_reading()

    # -- deadlines and closing -------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self._loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.state is _State.READING:
            log.debug("HTTP: request from %s not complete in time", self.peer)
            self._send_error(408, "request not complete within the deadline")
            return
        self.close(abort=True)

    def close(self, *, abort: bool) -> None:
        """Close in whatever state; ``abort`` drops unsent data (an eviction or a deadline)."""
        previous, self.state = self.state, _State.CLOSED
        self._disarm()
        if previous is _State.PEEK:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self._release()
        elif self.transport is not None:
            if abort:
                self.server.released(self)  # off the cap now; asyncio closes the fd next tick
                self.transport.abort()
            elif self.transport.can_write_eof():
                self.transport.write_eof()  # after the answer leaves; then linger
                self.state = _State.LINGER
                self._buf.clear()
                self._arm(max(_LINGER_S, self.server.limits.write_timeout_s))
            else:
                self.transport.close()
                self._arm(self.server.limits.write_timeout_s)  # a reader that never reads
        elif self._setup is not None:
            self.server.released(self)
            self._setup.cancel()
        else:
            self.sock.close()
            self._release()

    def _release(self) -> None:
        self.state = _State.CLOSED
        self.server.released(self)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower()
    except ValueError:
        return "error"
