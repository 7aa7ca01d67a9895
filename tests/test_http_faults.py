"""Hostile HTTP clients: malformed requests, slow and idle connections, floods, fd exhaustion.

Every malformed request gets a 4xx or a closed connection, never a 5xx or a traceback
in the log, and the server keeps answering /metrics quickly while hundreds of idle or
dripping connections are held (bench/http_faults.py holds 1000).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import resource
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from builders import DAEMON_INFO, board_of, full_h200
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from gpuwatchd.exporter import GpuwatchdCollector, build_registry
from gpuwatchd.exporter.collectors.gpu import GpuCollector
from gpuwatchd.exporter.render import MetricsRenderer
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.serve import HttpServer
from gpuwatchd.serve.http import Limits
from gpuwatchd.serve.http_loop import LoopServer
from gpuwatchd.serve.routes import Routes

FAST = Limits(request_timeout_s=1.0, idle_timeout_s=2.0, handshake_timeout_s=1.0)


@pytest.fixture
def board() -> StateBoard:
    return board_of(full_h200())


@pytest.fixture
def server(board: StateBoard) -> Iterator[HttpServer]:
    with HttpServer(
        board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0), limits=FAST
    ) as srv:
        yield srv


@pytest.fixture
def quiet_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Everything gpuwatchd logs, to check that nothing a client sends makes a traceback."""
    caplog.set_level(logging.DEBUG, logger="gpuwatchd")
    caplog.set_level(logging.DEBUG, logger="asyncio")
    yield caplog
    loud = [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage() for r in loud]


def exchange(address: tuple[str, int], data: bytes, *, close_write: bool = False) -> bytes:
    """Send ``data``, read until the server closes (or 5 s pass)."""
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(data)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (a clean FIN or, after an abort, a reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def get(address: tuple[str, int], path: str = "/healthz") -> tuple[int, float]:
    """Status of one GET on a fresh connection and the seconds it took."""
    started = time.monotonic()
    reply = exchange(
        address, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )
    return int(reply.split(b" ", 2)[1]), time.monotonic() - started


H = b"Host: x\r\n"
MALFORMED: dict[str, tuple[bytes, int | None]] = {
    # name: (raw request, status expected; None: the connection just closes)
    "content-length not a number": (
        b"GET / HTTP/1.1\r\n" + H + b"Content-Length: abc\r\n\r\n",
        400,
    ),
    "negative content-length": (b"GET / HTTP/1.1\r\n" + H + b"Content-Length: -1\r\n\r\n", 400),
    "conflicting content-lengths": (
        b"GET / HTTP/1.1\r\n" + H + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        400,
    ),
    "content-length overflow": (
        b"GET / HTTP/1.1\r\n" + H + b"Content-Length: 99999999999999999999\r\n\r\n",
        400,
    ),
    "body too large": (b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 10000000\r\n\r\n", 413),
    "obsolete line folding": (b"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
    "space before colon": (b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    "header without colon": (b"GET / HTTP/1.1\r\nHost x\r\n\r\n", 400),
    "space in header name": (b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n", 400),
    "empty header name": (b"GET / HTTP/1.1\r\n: x\r\n\r\n", 400),
    "NUL in header value": (b"GET / HTTP/1.1\r\nX-A: a\x00b\r\n\r\n", 400),
    "two host headers": (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    "101 headers": (b"GET / HTTP/1.1\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n", 431),
    "huge header": (b"GET / HTTP/1.1\r\nX-A: " + b"a" * 70000 + b"\r\n\r\n", 431),
    "huge request line": (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
    "HTTP/0.9": (b"GET /metrics\r\n\r\n", 400),
    "HTTP/2.0 version": (b"GET / HTTP/2.0\r\n\r\n", 505),
    "HTTP/1.1.1 version": (b"GET / HTTP/1.1.1\r\n\r\n", 400),
    "not HTTP": (b"GET / FOO/1.1\r\n\r\n", 400),
    "lower-case version": (b"GET / http/1.1\r\n\r\n", 400),
    "bad method characters": (b"G@T / HTTP/1.1\r\n\r\n", 400),
    "unknown method": (b"BREW /pot HTTP/1.1\r\n\r\n", 501),
    "double space": (b"GET  / HTTP/1.1\r\n\r\n", 400),
    "tabs as separators": (b"GET\t/\tHTTP/1.1\r\n\r\n", 400),
    "control character in target": (b"GET /\x01 HTTP/1.1\r\n\r\n", 400),
    "non-ASCII target": ("GET /é HTTP/1.1\r\n\r\n".encode(), 400),
    "target without slash": (b"GET metrics HTTP/1.1\r\n\r\n", 400),
    "ftp absolute target": (b"GET ftp://x/metrics HTTP/1.1\r\n\r\n", 400),
    "CONNECT authority": (b"CONNECT example.org:443 HTTP/1.1\r\n\r\n", 400),
    "binary garbage": (b"\x00\xff GARBAGE\r\n\r\n", 400),
    "TLS ClientHello on the plain port": (
        bytes.fromhex("16030100a5010000a10303") + b"\x00" * 32 + b"\r\n\r\n",
        400,
    ),
    "chunked POST": (
        b"POST /metrics HTTP/1.1\r\n"
        + H
        + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        405,
    ),
    "expect 100-continue POST": (
        b"POST /metrics HTTP/1.1\r\n" + H + b"Expect: 100-continue\r\nContent-Length: 5\r\n\r\n",
        405,
    ),
    "DELETE": (b"DELETE /metrics HTTP/1.1\r\n" + H + b"\r\n", 405),
    "OPTIONS *": (b"OPTIONS * HTTP/1.1\r\n" + H + b"\r\n", 405),
    "percent garbage": (b"GET /%zz%00 HTTP/1.1\r\n" + H + b"\r\n", 404),
    # issue 26, finding 10
    "xchunked": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: xchunked\r\n\r\n", 501),
    "gzip then chunked": (
        b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: gzip, chunked\r\n\r\n",
        501,
    ),
    "chunked twice": (
        b"POST / HTTP/1.1\r\n"
        + H
        + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
        501,
    ),
    "transfer-encoding and content-length": (
        b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\nabc",
        400,
    ),
    "bare LF after the request line": (b"GET /healthz HTTP/1.1\n" + H + b"\r\n", 400),
    "bare LF ending the head": (b"GET /healthz HTTP/1.1\r\n" + H + b"\n", 400),
    "bare CR": (b"GET /healthz HTTP/1.1\r\nX-A: a\rb\r\n" + H + b"\r\n", 400),
    "encoded slashes as route separators": (
        b"GET /api%2fv1%2fstate HTTP/1.1\r\n" + H + b"\r\n",
        404,
    ),
    "encoded slash in /metrics": (b"GET /metrics%2F HTTP/1.1\r\n" + H + b"\r\n", 404),
    "path traversal": (b"GET /../../etc/passwd HTTP/1.1\r\n" + H + b"\r\n", 404),
    "only blank lines": (b"\r\n\r\n\r\n", None),
    "nothing at all": (b"", None),
    "half a request line": (b"GET /met", None),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_request_gets_a_4xx_or_a_close(
    server: HttpServer, quiet_log: pytest.LogCaptureFixture, name: str
) -> None:
    data, status = MALFORMED[name]
    reply = exchange(server.address, data, close_write=status is None)
    if status is None:
        assert reply == b""
    else:
        head = reply.split(b"\r\n", 1)[0]
        assert head.startswith(b"HTTP/1.1 %d " % status), reply[:200]
    assert get(server.address)[0] == 200


def test_there_are_at_least_30_distinct_malformed_requests() -> None:
    assert len({data for data, _ in MALFORMED.values()}) >= 30


def test_leading_blank_lines_are_tolerated_and_bare_lf_refused(server: HttpServer) -> None:
    reply = exchange(server.address, b"\r\nGET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"ok\n")
    reply = exchange(server.address, b"GET /healthz HTTP/1.1\nConnection: close\n\n")
    assert reply.startswith(b"HTTP/1.1 400 "), reply


def test_pipelined_requests_are_answered_in_order(server: HttpServer) -> None:
    one = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    reply = exchange(server.address, one * 3 + b"GET /nope HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200 OK") == 3 and reply.count(b"HTTP/1.1 404 ") == 1


def test_a_dripping_client_gets_408_at_the_whole_request_deadline(server: HttpServer) -> None:
    with socket.create_connection(server.address, timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        reply = b""
        while not reply and time.monotonic() - started < 5:
            time.sleep(0.1)  # a byte every 0.1 s: each read is quick, the request never ends
            sock.sendall(b"X")
            with contextlib.suppress(BlockingIOError):
                reply = sock.recv(65536, socket.MSG_DONTWAIT)
        answered = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert FAST.request_timeout_s - 0.2 < answered < FAST.request_timeout_s + 1.0


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(
    server: HttpServer,
) -> None:
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        assert sock.recv(1) == b""
        assert FAST.idle_timeout_s - 0.5 < time.monotonic() - started < FAST.idle_timeout_s + 1.5


def test_a_client_that_never_reads_is_dropped(board: StateBoard) -> None:
    limits = Limits(write_timeout_s=0.5)
    with HttpServer(
        board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0), limits=limits
    ) as srv:
        sock = socket.create_connection(srv.address, timeout=5)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        with pytest.raises(OSError):  # the server stops taking requests, then drops us
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                sock.sendall(request * 50)
        sock.close()
        time.sleep(0.2)
        assert srv.connection_count() == 0
        assert get(srv.address)[0] == 200


def test_the_connection_cap_sheds_the_longest_waiting_connection(board: StateBoard) -> None:
    limits = Limits(max_connections=16)
    registry = build_registry(board, DAEMON_INFO)
    with HttpServer(board, registry, ("127.0.0.1", 0), limits=limits) as srv:
        idle = [socket.create_connection(srv.address, timeout=5) for _ in range(40)]
        try:
            time.sleep(0.3)
            assert srv.connection_count() <= 16
            status, seconds = get(srv.address, "/metrics")  # a newcomer is still served
            assert status == 200 and seconds < 0.5
            assert closed_by_server(idle[0])  # the oldest were the ones closed
            assert srv.connection_count() <= 16
        finally:
            for sock in idle:
                sock.close()


class _FlakyListener(socket.socket):
    """A listening socket whose accept() fails with EMFILE ``failures`` times."""

    failures = 0
    calls = 0

    def accept(self) -> tuple[socket.socket, Any]:
        type(self).calls += 1
        if type(self).failures > 0:
            type(self).failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_accept_backs_off_when_out_of_file_descriptors(
    board: StateBoard, caplog: pytest.LogCaptureFixture
) -> None:
    plain = socket.create_server(("127.0.0.1", 0))
    listener = _FlakyListener(plain.family, plain.type, fileno=plain.detach())
    routes = Routes(MetricsRenderer(build_registry(board, DAEMON_INFO), board.all), lambda: {})
    server = LoopServer(listener, routes, lambda: None, FAST)
    server.start()
    address = listener.getsockname()
    try:
        with socket.create_connection(address, timeout=5) as idle, caplog.at_level(logging.INFO):
            time.sleep(0.2)
            _FlakyListener.calls, _FlakyListener.failures = 0, 10**9  # fds are gone
            waiting = socket.create_connection(address, timeout=5)  # stays in the backlog
            cpu = time.process_time()
            time.sleep(1.0)
            assert _FlakyListener.calls <= 15  # ~one try per 0.1 s back-off, not a spin
            assert time.process_time() - cpu < 0.5
            assert closed_by_server(idle)  # the longest-waiting connection was shed
            _FlakyListener.failures = 0  # fds are back
            waiting.sendall(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert waiting.recv(65536).startswith(b"HTTP/1.1 200 ")
            waiting.close()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "Too many open files" in warnings[0].getMessage()
        assert not any(r.exc_info for r in caplog.records)
    finally:
        server.stop()


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


def test_metrics_answer_fast_while_200_idle_and_dripping_connections_are_held(
    board: StateBoard, quiet_log: pytest.LogCaptureFixture
) -> None:
    held = 200
    _raise_fd_limit(4 * held + 256)
    registry = build_registry(board, DAEMON_INFO)
    limits = Limits(request_timeout_s=30.0)
    with HttpServer(board, registry, ("127.0.0.1", 0), limits=limits) as srv:
        socks = [socket.create_connection(srv.address, timeout=5) for _ in range(held)]
        stop = threading.Event()

        def drip() -> None:  # half the connections send a header byte every 0.5 s
            for sock in socks[::2]:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            while not stop.wait(0.5):
                for sock in socks[::2]:
                    sock.sendall(b"a")

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            time.sleep(1.0)
            assert srv.connection_count() == held
            timings = [get(srv.address, "/metrics") for _ in range(10)]
            assert all(status == 200 for status, _ in timings)
            # Not queued behind the slow clients (they hold on for request_timeout_s = 30 s);
            # the latency itself is bench/http_faults.py's figure.
            assert max(seconds for _, seconds in timings) < 5.0, timings
        finally:
            stop.set()
            dripper.join()
            for sock in socks:
                sock.close()


# -- a hung collector --------------------------------------------------------------------


class _Hung:
    name = "hung"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def collect(self) -> Iterator[Metric]:
        self.calls += 1
        self.release.wait(30)
        family = GaugeMetricFamily("gpuwatchd_hung_value", "A value from a slow source.")
        family.add_metric([], 1.0)
        yield family


def test_a_hung_collector_fails_alone_and_is_not_started_again(board: StateBoard) -> None:
    hung = _Hung()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuwatchdCollector([GpuCollector(board), hung], deadline_s=0.5))
    with HttpServer(board, registry, ("127.0.0.1", 0), metrics_max_age_s=0) as srv:
        for _ in range(3):
            started = time.monotonic()
            reply = exchange(srv.address, b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert time.monotonic() - started < 1.0
            assert b'gpuwatchd_scrape_collector_success{collector="hung"} 0.0' in reply
            assert b'gpuwatchd_scrape_collector_success{collector="gpu"} 1.0' in reply
            assert b"gpuwatchd_gpu_temperature_celsius" in reply
        assert hung.calls == 1  # still hung: never started again
        hung.release.set()
        time.sleep(0.1)
        text = generate_latest(registry)
        assert b'gpuwatchd_scrape_collector_success{collector="hung"} 1.0' in text
        assert hung.calls == 2
