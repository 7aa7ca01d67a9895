"""GET one JSON document from a daemon: the HTTP path the client and ``status`` share.

Proxy settings in the environment are ignored: a job's ``http_proxy`` is meant for the
internet, not for the daemon on its own host. Every failure is a :class:`FetchError`
whose ``str()`` is one line naming the URL; the subclasses let a caller word the
common cases its own way (the CLI names its flags, the client its arguments).
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gpuwatchd.api.errors import GpuwatchdError
from gpuwatchd.validate import describe, one_line


class FetchError(GpuwatchdError):
    """No JSON document came back from ``where``; ``detail`` says why, on one line."""

    def __init__(self, where: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.where = where
        self.detail = detail


class HttpStatusError(FetchError):
    """The daemon answered with an HTTP error status (``code``)."""

    def __init__(self, url: str, code: int, reason: str) -> None:
        super().__init__(url, f"HTTP {code} {reason}")
        self.code = code


class UnreachableError(FetchError):
    """No answer: connection refused, timeout, TLS handshake failure, ..."""


class NotJsonError(FetchError):
    """The daemon answered, but not with JSON."""


class CaFileError(FetchError):
    """The CA certificate file (``where``) could not be loaded."""


def is_base_url(url: str) -> bool:
    """``http(s)://HOST[:PORT]``, the base every document path is appended to."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def get_json(
    url: str,
    *,
    timeout: float,
    cafile: str | None = None,
    auth: tuple[str, str] | None = None,
) -> Any:
    """GET ``url`` and decode its JSON body.

    ``cafile`` is the CA that signed an https daemon's certificate (else the system's
    CAs); ``auth`` is a (user, password) pair for basic auth.
    """
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if cafile is not None:
        handlers.append(urllib.request.HTTPSHandler(context=_tls_context(cafile)))
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.build_opener(*handlers).open(request, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        exc.close()
        raise HttpStatusError(url, exc.code, one_line(exc.reason)) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        if isinstance(reason, BaseException):
            raise UnreachableError(url, describe(reason, with_type=False)) from None
        raise UnreachableError(url, one_line(reason)) from None
    try:
        return json.loads(body)
    except ValueError:
        raise NotJsonError(url, "response is not JSON") from None


def _tls_context(cafile: str) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise CaFileError(cafile, describe(exc, with_type=False)) from None
