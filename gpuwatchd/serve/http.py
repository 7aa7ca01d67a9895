# asyncio, not cheroot/waitress: only it kept /metrics up under 1000 slow clients (bench/RESULTS.md)
"""The read-only HTTP server: /metrics, the /api/v1 JSON documents, /healthz, an index.

Three layers, so TLS and basic auth wrap the socket side without touching routing:
:class:`~gpuwatchd.serve.routes.Routes` maps a request to a response (no sockets),
:mod:`~gpuwatchd.serve.http_loop` holds the connections on one event loop (cap,
deadlines, TLS, admission) and :class:`HttpServer` owns the listening socket and the
web config. The web config (:mod:`gpuwatchd.serve.web.config`) is the exporter-toolkit
format; :class:`~gpuwatchd.serve.web.security.WebSecurity` is that config made live.
Every route reads in-memory state only; no request ever starts GPU work.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.registry import CollectorRegistry

from gpuwatchd.api.state import build_state_json
from gpuwatchd.config.listen import format_listen
from gpuwatchd.exporter.render import DEFAULT_MAX_AGE_S, MetricsRenderer
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.serve.http_loop import DEFAULT_LIMITS, Limits, LoopServer
from gpuwatchd.serve.loop import ServeLoop
from gpuwatchd.serve.routes import (
    ALLOWED_METHODS,
    JsonRoute,
    Request,
    Response,
    Routes,
    error_response,
    json_response,
    request_path,
)

if TYPE_CHECKING:  # the web-config modules load only with a web config
    from gpuwatchd.serve.web.certinfo import CertInfo
    from gpuwatchd.serve.web.config import WebConfig
    from gpuwatchd.serve.web.security import WebSecurity

__all__ = [
    "ALLOWED_METHODS",
    "HttpServer",
    "JsonRoute",
    "Limits",
    "Request",
    "Response",
    "Routes",
    "error_response",
    "json_response",
    "request_path",
]

log = logging.getLogger(__name__)

#: How often served certificates are checked for (coming) expiry after the load-time check.
CERT_CHECK_INTERVAL_S = 3600.0
_LISTEN_BACKLOG = 512  # scrapers connecting at once must not find the SYN queue full


class ListenError(OSError):
    """The HTTP address cannot be bound; its message names the address and the reason."""


def _bind_family(host: str) -> tuple[socket.AddressFamily, str]:
    if host == "":
        return (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "0.0.0.0")
    if ":" in host:
        return socket.AF_INET6, host
    # An ASCII name goes as bytes: a str is always run through the IDNA codec, which
    # would load encodings.idna, stringprep and unicodedata for the daemon's lifetime.
    name: str | bytes = host.encode("ascii") if host.isascii() else host
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ListenError(f"listen address {host!r}: cannot resolve host: {exc.strerror}") from None
    return infos[0][0], host


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket for ``host:port``; :class:`ListenError` on failure."""
    family, bind_host = _bind_family(host)
    try:
        return _listen(family, bind_host, port)
    except OSError as exc:
        error = exc
    if host == "" and family == socket.AF_INET6:
        # IPv6 compiled in but disabled on this host: all IPv4 interfaces instead.
        try:
            return _listen(socket.AF_INET, "0.0.0.0", port)
        except OSError as exc:
            error = exc
    raise ListenError(
        error.errno, f"cannot listen on {format_listen(host, port)}: {error.strerror or error}"
    ) from None


def _listen(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            # Dual stack: "::" also accepts IPv4 where the platform allows it.
            try:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except OSError:
                log.debug("cannot clear IPV6_V6ONLY; serving IPv6 only on '::'")
        sock.bind((host, port))
        sock.listen(_LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


class HttpServer:
    """Serves the exporter's routes from a daemon thread; ``port=0`` picks a free port.

    ``metrics_max_age_s`` bounds how long a rendered /metrics body is reused while the
    board is unchanged (see :mod:`gpuwatchd.exporter.render`); 0 renders every scrape.
    ``web_config`` adds TLS, basic auth, rate limiting and response headers; None serves
    plain, open HTTP. Raises ValueError when its certificate files cannot be loaded.
    ``limits`` sets the connection cap and deadlines; ``serve_loop`` is the loop shared
    with the control socket (None: a loop of its own). The served TLS certificates'
    expiry is warned about in the log; :meth:`certificates` lists them for the exporter.
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
        limits: Limits = DEFAULT_LIMITS,
        serve_loop: ServeLoop | None = None,
    ) -> None:
        host, port = listen
        if not 0 <= port <= 65535:
            raise ValueError(f"listen port {port} is out of range 0-65535")
        self._listen = (host, port)
        self._limits = limits
        renderer = MetricsRenderer(collector_registry, board.all, metrics_max_age_s)
        self.routes = Routes(renderer, state_json or (lambda: build_state_json(board)), json_routes)
        self._security: WebSecurity | None = None
        if web_config is not None:
            from gpuwatchd.serve.web.security import WebSecurity

            self._security = WebSecurity(web_config)
            self._security.warn_about_expiry()
        self._serve_loop = serve_loop
        self._server: LoopServer | None = None

    def reload_web_config(self, web_config: WebConfig | None) -> None:
        """Switch to a new web config (SIGHUP): renewed certificates, users, headers.

        New connections use the new TLS context; every request from now on, kept-alive
        connections included, is checked against the new users (verified credentials of
        users whose hash is unchanged stay verified). On ValueError (files unreadable)
        the running config stays.
        """
        previous = self._security
        security = None
        if web_config is not None:
            from gpuwatchd.serve.web.security import WebSecurity

            security = WebSecurity(web_config, previous)
        self._security = security
        log.info(
            "web config: %s, %s",
            "TLS" if security is not None and security.ssl_context else "plain HTTP",
            "basic auth" if security is not None and security.auth else "no authentication",
        )
        if security is not None:
            security.warn_about_expiry()

    def certificates(self) -> tuple[CertInfo, ...]:
        """The certificates served now (leaf first); empty over plain HTTP."""
        security = self._security
        return security.certificates if security is not None else ()

    @property
    def tls(self) -> bool:
        """Whether new connections are served over TLS."""
        return self._security is not None and self._security.ssl_context is not None

    def start(self) -> None:
        """Bind and serve in the background; raises :class:`ListenError` on failure."""
        if self._server is not None:
            raise RuntimeError("HttpServer already started")
        server = LoopServer(
            _bind(*self._listen),
            self.routes,
            lambda: self._security,
            self._limits,
            self._serve_loop,
        )
        server.call_every(CERT_CHECK_INTERVAL_S, self._check_certificates)
        server.start()
        self._server = server
        log.info("serving %s (at most %d connections)", self.url, server.cap)

    def _check_certificates(self) -> None:
        if self._security is not None:
            self._security.warn_about_expiry()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); the real port when started with port 0."""
        if self._server is None:
            raise RuntimeError("HttpServer not started")
        host, port = self._server.listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{format_listen(*self.address)}"

    def connection_count(self) -> int:
        """Connections open now (0 when stopped)."""
        return self._server.connection_count() if self._server is not None else 0

    def stop(self, timeout: float = 1.0) -> None:
        """Stop accepting, cut open connections and wait up to ``timeout`` s. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(timeout)

    def __enter__(self) -> HttpServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
