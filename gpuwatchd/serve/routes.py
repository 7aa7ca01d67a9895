"""The exporter's routes: a :class:`Request` in, a :class:`Response` out, no sockets.

/metrics, the /api/v1 JSON documents, /healthz and an index. Every route reads
in-memory state only; no request ever starts GPU work. The HTTP server
(:mod:`gpuwatchd.serve.http`) handles the wire, TLS and admission around it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import gpuwatchd
from gpuwatchd.exporter.render import MetricsRenderer, Rendered
from gpuwatchd.store.errors import StoreBusy, StoreUnavailable

log = logging.getLogger(__name__)

#: Methods any route accepts; everything else is answered 405.
ALLOWED_METHODS: tuple[str, ...] = ("GET", "HEAD")
JSON_TYPE = "application/json; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"


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
    return Response(status, JSON_TYPE, body)


def error_response(
    status: int, message: str, *, headers: tuple[tuple[str, str], ...] = (), **detail: str
) -> Response:
    doc = {"error": message, "status": status, **detail}
    body = json.dumps(doc, indent=2).encode() + b"\n"
    return Response(status, JSON_TYPE, body, headers)


def request_path(target: str) -> str:
    """The decoded path of a request-target, ignoring query and fragment; "" if unusable,
    as is one where an encoded ``/`` (``%2f``) would become a separator of the route."""
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
    segments = [unquote(segment, errors="replace") for segment in path.split("/")]
    if any("/" in segment for segment in segments):
        return ""
    return "/".join(segments)


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
                return error_response(400, "bad request", detail=str(exc)[:300])
            except StoreUnavailable as exc:  # the store logs its outage once, not per request
                return error_response(503, "store unavailable", detail=str(exc)[:300])
            except StoreBusy as exc:  # up, but a statement ran over its timeout: try again
                return error_response(503, "store busy", detail=str(exc)[:300])

        return serve

    def handle_at_once(self, request: Request) -> Response | None:
        """The response when it needs no waiting (a liveness probe, a /metrics body kept or
        rendered from in-memory state), else None: then :meth:`handle` must run, off the
        event loop."""
        if request.method not in ALLOWED_METHODS:
            return None
        path = request_path(request.target)
        if path == "/healthz":
            return self._healthz(request)
        if path == "/metrics":
            try:
                rendered = self._renderer.render_at_once(request.accept, request.accept_encoding)
            except Exception:  # handle() renders again, and logs and answers the failure
                return None
            return self._metrics_response(rendered) if rendered is not None else None
        return None

    def handle(self, request: Request) -> Response:
        if request.method not in ALLOWED_METHODS:
            allow = (("Allow", ", ".join(ALLOWED_METHODS)),)
            return error_response(
                405, "method not allowed", headers=allow, method=request.method[:32]
            )
        path = request_path(request.target)
        route = self._routes.get(path)
        if route is None:
            return error_response(404, "not found", path=path[:200])
        try:
            return route(request)
        except Exception:
            log.exception("error serving %s", path)
            return error_response(500, "internal error", path=path)

    def _index(self, request: Request) -> Response:
        text = (
            f"gpuwatchd {gpuwatchd.__version__}\n"
            "/metrics        Prometheus metrics (OpenMetrics when the Accept header asks)\n"
            "/api/v1/state   read-only JSON state of every GPU\n"
            "/api/v1/winners read-only JSON winners per workload and regime\n"
            "/healthz        liveness check\n"
        )
        return Response(200, TEXT_TYPE, text.encode())

    def _metrics(self, request: Request) -> Response:
        return self._metrics_response(
            self._renderer.render(request.accept, request.accept_encoding)
        )

    @staticmethod
    def _metrics_response(rendered: Rendered) -> Response:
        headers: tuple[tuple[str, str], ...] = (("Vary", "Accept, Accept-Encoding"),)
        if rendered.gzipped:
            headers += (("Content-Encoding", "gzip"),)
        return Response(200, rendered.content_type, rendered.body, headers)

    def _state(self, request: Request) -> Response:
        return json_response(200, self._state_json())

    def _healthz(self, request: Request) -> Response:
        return Response(200, TEXT_TYPE, b"ok\n")
