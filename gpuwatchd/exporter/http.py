"""The read-only HTTP server: /metrics, /api/v1/state, /healthz and a tiny index.

Three layers, so TLS and basic auth wrap the socket side without touching routing:
:class:`Routes` maps a :class:`Request` to a :class:`Response` (no sockets), ``_Handler``
speaks HTTP/1.1 framing and admits requests (basic auth, rate limit, extra headers), and
:class:`HttpServer` owns the listening socket, the serving thread and the TLS handshake.
The web config (:mod:`gpuwatchd.exporter.web.config`) is the exporter-toolkit format.
Every route reads in-memory state only; no request ever starts GPU work.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import re
import socket
import socketserver
import ssl
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from prometheus_client.registry import CollectorRegistry

import gpuwatchd
from gpuwatchd.api.state import build_state_json
from gpuwatchd.exporter.render import DEFAULT_MAX_AGE_S, MetricsRenderer
from gpuwatchd.exporter.web.config import WWW_AUTHENTICATE, Admission, WebConfig, WebSecurity
from gpuwatchd.monitor.board import StateBoard

log = logging.getLogger(__name__)

#: Methods any route accepts; everything else is answered 405.
ALLOWED_METHODS: tuple[str, ...] = ("GET", "HEAD")
_JSON = "application/json; charset=utf-8"
_TEXT = "text/plain; charset=utf-8"
_MAX_DISCARDED_BODY = 64 * 1024
#: A client must finish its TLS handshake within this many seconds or is dropped. The
#: handshake runs in the connection's own thread, so a slow client never blocks accept().
TLS_HANDSHAKE_TIMEOUT_S = 10.0
#: What a plain-HTTP client on the TLS port gets (the words Go's net/http uses).
_PLAIN_HTTP_ON_TLS = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
)
_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def parse_listen(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; ``":9844"`` is every interface, IPv6 in brackets.

    Raises ValueError with a one-line message naming the bad part.
    """
    value = text.strip()
    where = f"listen address {text!r}"
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError(f"{where}: missing ']' after the IPv6 address")
        host, rest = value[1:end], value[end + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{where}: {host!r} is not an IPv6 address") from None
        if not rest.startswith(":"):
            raise ValueError(f"{where}: expected ':PORT' after ']', e.g. [::1]:9844")
        port_text = rest[1:]
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep:
            raise ValueError(f"{where}: expected HOST:PORT, e.g. 127.0.0.1:9844 or :9844")
        if ":" in host:
            raise ValueError(f"{where}: put an IPv6 address in brackets, e.g. [::1]:9844")
        if host and not _HOSTNAME.match(host):
            raise ValueError(f"{where}: host {host!r} is not a valid hostname or IP address")
    if not port_text:
        raise ValueError(f"{where}: missing port")
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"{where}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{where}: port {port} is out of range 0-65535")
    return host, port


def format_listen(host: str, port: int) -> str:
    """Inverse of :func:`parse_listen` (brackets IPv6 hosts)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class Request:
    """What routing needs from an HTTP request; ``target`` is raw and may hold a query."""

    method: str
    target: str
    accept: str = ""
    accept_encoding: str = ""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


def json_response(status: int, doc: Mapping[str, Any]) -> Response:
    """Strict JSON (NaN refused) with a trailing newline for curl users."""
    body = json.dumps(doc, indent=2, allow_nan=False).encode() + b"\n"
    return Response(status, _JSON, body)


def _error(
    status: int, message: str, *, headers: tuple[tuple[str, str], ...] = (), **detail: str
) -> Response:
    doc = {"error": message, "status": status, **detail}
    body = json.dumps(doc, indent=2).encode() + b"\n"
    return Response(status, _JSON, body, headers)


def request_path(target: str) -> str:
    """The decoded path of a request-target, ignoring query and fragment; "" if unusable."""
    if not target.startswith("/"):
        # absolute-form, as sent to proxies (RFC 9112 section 3.2.2), or garbage
        try:
            parts = urlsplit(target)
        except ValueError:
            return ""
        if parts.scheme not in ("http", "https"):
            return ""
        target = parts.path or "/"
    path = target.split("?", 1)[0].split("#", 1)[0]
    return unquote(path, errors="replace")


#: A read-only JSON endpoint: request target (path and query) -> document.
JsonRoute = Callable[[str], Mapping[str, Any]]


class Routes:
    """Maps requests to responses. Knows nothing about sockets, TLS or authentication."""

    def __init__(
        self,
        renderer: MetricsRenderer,
        state_json: Callable[[], Mapping[str, Any]],
        json_routes: Mapping[str, JsonRoute] | None = None,
    ) -> None:
        self._renderer = renderer
        self._state_json = state_json
        self._routes: dict[str, Callable[[Request], Response]] = {
            "/": self._index,
            "/metrics": self._metrics,
            "/api/v1/state": self._state,
            "/healthz": self._healthz,
        }
        for path, fn in (json_routes or {}).items():
            self._routes[path] = self._json_route(fn)

    @staticmethod
    def _json_route(fn: JsonRoute) -> Callable[[Request], Response]:
        """A read-only JSON document built from the request target (query string)."""

        def serve(request: Request) -> Response:
            try:
                return json_response(200, fn(request.target))
            except ValueError as exc:  # a bad query parameter: the client's mistake
                return _error(400, "bad request", detail=str(exc)[:300])

        return serve

    def handle(self, request: Request) -> Response:
        if request.method not in ALLOWED_METHODS:
            allow = (("Allow", ", ".join(ALLOWED_METHODS)),)
            return _error(405, "method not allowed", headers=allow, method=request.method[:32])
        path = request_path(request.target)
        route = self._routes.get(path)
        if route is None:
            return _error(404, "not found", path=path[:200])
        try:
            return route(request)
        except Exception:
            log.exception("error serving %s", path)
            return _error(500, "internal error", path=path)

    def _index(self, request: Request) -> Response:
        text = (
            f"gpuwatchd {gpuwatchd.__version__}\n"
            "/metrics        Prometheus metrics (OpenMetrics when the Accept header asks)\n"
            "/api/v1/state   read-only JSON state of every GPU\n"
            "/api/v1/winners read-only JSON winners per workload and regime\n"
            "/healthz        liveness check\n"
        )
        return Response(200, _TEXT, text.encode())

    def _metrics(self, request: Request) -> Response:
        rendered = self._renderer.render(request.accept, request.accept_encoding)
        headers: tuple[tuple[str, str], ...] = (("Vary", "Accept, Accept-Encoding"),)
        if rendered.gzipped:
            headers += (("Content-Encoding", "gzip"),)
        return Response(200, rendered.content_type, rendered.body, headers)

    def _state(self, request: Request) -> Response:
        return json_response(200, self._state_json())

    def _healthz(self, request: Request) -> Response:
        return Response(200, _TEXT, b"ok\n")


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 framing around :meth:`Routes.handle`; keeps connections alive."""

    protocol_version = "HTTP/1.1"
    server_version = f"gpuwatchd/{gpuwatchd.__version__}"
    sys_version = ""
    timeout = 30  # an idle keep-alive connection is closed after this many seconds
    # Buffer each response (flushed once per request by the base class) so headers and
    # an 8-GPU body leave in one send; larger bodies take two, and with Nagle on the
    # second would wait for the client's delayed ACK (~40 ms on Linux).
    wbufsize = 64 * 1024
    disable_nagle_algorithm = True
    server: _Server

    def _dispatch(self) -> None:
        self._discard_body()
        security = self.server.security  # one consistent config for the whole request
        response = self._refusal(security) if security is not None else None
        if response is None:
            request = Request(
                method=self.command,
                target=self.path,
                accept=self.headers.get("Accept", ""),
                accept_encoding=self.headers.get("Accept-Encoding", ""),
            )
            response = self.server.routes.handle(request)
        self._send(response, security)

    def _refusal(self, security: WebSecurity) -> Response | None:
        """401 or 429 before any routing, or None to serve the request."""
        admission = security.admit(self.headers.get("Authorization"))
        if admission is Admission.UNAUTHORIZED:
            log.debug("unauthorized request from %s", self.address_string())
            return _error(401, "unauthorized", headers=(("WWW-Authenticate", WWW_AUTHENTICATE),))
        if admission is Admission.RATE_LIMITED:
            return _error(429, "too many requests")
        return None

    def _send(self, response: Response, security: WebSecurity | None) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        extra = security.headers if security is not None else ()
        for name, value in (*response.headers, *extra):
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    def _discard_body(self) -> None:
        """Read a small request body so keep-alive framing survives; else close after."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            return
        length_text = self.headers.get("Content-Length")
        if not length_text:
            return
        try:
            length = int(length_text)
        except ValueError:
            length = -1
        if 0 <= length <= _MAX_DISCARDED_BODY:
            self.rfile.read(length)
        else:
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Protocol-level errors (400, 414, 501, ...) as JSON, like every other error."""
        self.log_error("code %d, message %s", code, message)
        phrase = self.responses.get(code, ("error",))[0].lower()
        response = _error(code, phrase, detail=message[:200]) if message else _error(code, phrase)
        self.close_connection = True
        self._send(response, self.server.security)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch
    do_OPTIONS = do_TRACE = do_CONNECT = _dispatch

    def log_message(self, format: str, *args: Any) -> None:  # every request and error
        if log.isEnabledFor(logging.DEBUG):  # formatting costs ~10% of a cached scrape
            log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    """Threaded server that can cut its open keep-alive connections on stop."""

    daemon_threads = True
    block_on_close = False  # stop() must not wait for idle keep-alive clients
    request_queue_size = 128  # the default 5 drops SYNs when scrapers connect at once

    def __init__(
        self,
        address: tuple[str, int],
        family: socket.AddressFamily,
        routes: Routes,
        security: WebSecurity | None,
    ) -> None:
        self.address_family = family
        self.routes = routes
        self.security = security  # replaced whole on reload; read once per connection/request
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":
            # Dual stack: "::" also accepts IPv4 where the platform allows it.
            try:
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except OSError:
                log.debug("cannot clear IPV6_V6ONLY; serving IPv6 only on '::'")
        # HTTPServer.server_bind would resolve our own FQDN, which can stall on DNS.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        conn = request
        try:
            security = self.security
            if security is not None and security.ssl_context is not None:
                conn = self._tls_accept(request, client_address, security.ssl_context, security)
            if conn is not None:
                super().process_request_thread(conn, client_address)
        finally:
            with self._connections_lock:
                self._connections.discard(request)
                self._connections.discard(conn)

    def _tls_accept(
        self, sock: socket.socket, client_address: Any, ctx: ssl.SSLContext, security: WebSecurity
    ) -> ssl.SSLSocket | None:
        """Handshake in this connection's thread; None (connection closed) on failure."""
        try:
            conn = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError as exc:  # the client left before we got to it
            log.debug("TLS from %s: %s", client_address, exc)
            self.shutdown_request(sock)
            return None
        ok = False
        with self._connections_lock:  # wrap_socket detached sock; track the TLS socket
            self._connections.discard(sock)
            self._connections.add(conn)
        try:
            conn.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
            conn.do_handshake()
            ok = security.peer_allowed(conn.getpeercert())
            if not ok:
                log.info("TLS from %s: client certificate has no allowed SAN", client_address)
        except ssl.SSLError as exc:
            log.debug("TLS handshake with %s failed: %s", client_address, exc)
            if exc.reason == "HTTP_REQUEST":  # plain HTTP on the TLS port
                with contextlib.suppress(OSError):
                    socket.socket.sendall(conn, _PLAIN_HTTP_ON_TLS)
        except OSError as exc:  # timeout, reset
            log.debug("TLS handshake with %s failed: %s", client_address, exc)
        if ok:
            return conn
        with self._connections_lock:
            self._connections.discard(conn)
        self.shutdown_request(conn)
        return None

    def close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):  # already closed by the client
                # The plain socket's shutdown, also for TLS: SSLSocket.shutdown would
                # drop its SSL object under the handler thread still reading from it.
                socket.socket.shutdown(conn, socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError | TimeoutError | ssl.SSLError):
            log.debug("client %s went away: %s", client_address, exc)
        else:
            log.exception("unexpected error serving %s", client_address)


def _bind_family(host: str) -> tuple[socket.AddressFamily, str]:
    if host == "":
        return (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "0.0.0.0")
    if ":" in host:
        return socket.AF_INET6, host
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"listen address {host!r}: cannot resolve host: {exc.strerror}") from None
    return infos[0][0], host


def _make_server(host: str, port: int, routes: Routes, security: WebSecurity | None) -> _Server:
    family, bind_host = _bind_family(host)
    try:
        return _Server((bind_host, port), family, routes, security)
    except OSError as exc:
        error = exc
    if host == "" and family == socket.AF_INET6:
        # IPv6 compiled in but disabled on this host: all IPv4 interfaces instead.
        try:
            return _Server(("0.0.0.0", port), socket.AF_INET, routes, security)
        except OSError as exc:
            error = exc
    raise OSError(
        error.errno, f"cannot listen on {format_listen(host, port)}: {error.strerror or error}"
    ) from None


class HttpServer:
    """Serves the exporter's routes from a daemon thread; ``port=0`` picks a free port.

    ``metrics_max_age_s`` bounds how long a rendered /metrics body is reused while the
    board is unchanged (see :mod:`gpuwatchd.exporter.render`); 0 renders every scrape.
    ``web_config`` adds TLS, basic auth, rate limiting and response headers; None serves
    plain, open HTTP. Raises ValueError when its certificate files cannot be loaded.
    """

    def __init__(
        self,
        board: StateBoard,
        collector_registry: CollectorRegistry,
        listen: tuple[str, int],
        state_json: Callable[[], Mapping[str, Any]] | None = None,
        *,
        metrics_max_age_s: float = DEFAULT_MAX_AGE_S,
        web_config: WebConfig | None = None,
        json_routes: Mapping[str, JsonRoute] | None = None,
    ) -> None:
        host, port = listen
        if not 0 <= port <= 65535:
            raise ValueError(f"listen port {port} is out of range 0-65535")
        self._listen = (host, port)
        renderer = MetricsRenderer(collector_registry, board.all, metrics_max_age_s)
        self.routes = Routes(renderer, state_json or (lambda: build_state_json(board)), json_routes)
        self._security = WebSecurity(web_config) if web_config is not None else None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def reload_web_config(self, web_config: WebConfig | None) -> None:
        """Switch to a new web config (SIGHUP): renewed certificates, users, headers.

        New connections use the new TLS context; every request from now on, kept-alive
        connections included, is checked against the new users. On ValueError (files
        unreadable) the running config stays.
        """
        security = WebSecurity(web_config) if web_config is not None else None
        self._security = security
        if self._server is not None:
            self._server.security = security
        log.info(
            "web config: %s, %s",
            "TLS" if security is not None and security.ssl_context else "plain HTTP",
            "basic auth" if security is not None and security.auth else "no authentication",
        )

    @property
    def tls(self) -> bool:
        """Whether new connections are served over TLS."""
        return self._security is not None and self._security.ssl_context is not None

    def start(self) -> None:
        """Bind and serve in the background; raises OSError naming the address on failure."""
        if self._server is not None:
            raise RuntimeError("HttpServer already started")
        server = _make_server(*self._listen, self.routes, self._security)
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"gpuwatchd-http-{server.server_address[1]}",
            daemon=True,
        )
        self._server, self._thread = server, thread
        thread.start()
        log.info("serving %s", self.url)

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); the real port when started with port 0."""
        if self._server is None:
            raise RuntimeError("HttpServer not started")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{format_listen(*self.address)}"

    def stop(self, timeout: float = 1.0) -> None:
        """Stop accepting, cut open connections and wait up to ``timeout`` s. Idempotent."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        self._server = self._thread = None
        server.shutdown()  # returns within poll_interval
        server.server_close()
        server.close_connections()
        thread.join(timeout)

    def __enter__(self) -> HttpServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
