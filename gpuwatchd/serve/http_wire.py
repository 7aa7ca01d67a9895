"""HTTP/1.1 on the wire, without I/O: find and parse a request head, frame a response.

Strict where leniency lets one request be read two ways (RFC 9112 section 11: request
smuggling): a line not ended by CRLF (a bare LF), obsolete line folding, whitespace
before a header's colon, conflicting Content-Length values, Transfer-Encoding beside
Content-Length and control characters are refused with 400, a transfer coding other than
``chunked`` with 501. Lenient where it costs nothing: empty lines before the request
line are skipped. Bodies are never used by a route; one announced by Content-Length (up
to a limit) is read and discarded so keep-alive survives; a chunked one ends the
connection after the answer.
"""

from __future__ import annotations

import email.utils
import re
import time
from dataclasses import dataclass
from http import HTTPStatus

#: The request line, the head (request line and headers) and a discarded body, in bytes.
MAX_REQUEST_LINE = 8 * 1024
MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
MAX_BODY = 64 * 1024
#: Methods this server knows; a well-formed unknown one is answered 501, as by Go.
KNOWN_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT")
)

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_TARGET_CONTROL = re.compile(rb"[\x00-\x20\x7f-\xff]")


class HttpError(Exception):
    """A request that cannot be served; answered with ``status`` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class RequestHead:
    """A parsed request head; header names are lower case, values latin-1 text."""

    method: str
    target: str
    version: tuple[int, int]
    headers: tuple[tuple[str, str], ...]
    body_length: int  # bytes of body that follow the head and are to be discarded
    keep_alive: bool  # False: close after answering (asked, HTTP/1.0, or body unframed)

    def header(self, name: str) -> str:
        """The first value of header ``name`` (lower case), or ""."""
        for key, value in self.headers:
            if key == name:
                return value
        return ""


class HeadScanner:
    """Finds where a request head ends in a growing buffer, looking at each byte once.

    A head arriving a byte at a time is scanned once, not once per byte. Raises 414 or
    431 (:class:`HttpError`) as soon as the request line or the head is past its limit.
    """

    __slots__ = ("_line_start", "_searched")

    def __init__(self) -> None:
        self._line_start = 0
        self._searched = 0

    def reset(self) -> None:
        """Start over on a buffer that now begins with a new request."""
        self._line_start = self._searched = 0

    def end(self, buf: bytes | bytearray) -> int | None:
        """The offset just past the head's blank line, or None while it is incomplete."""
        while True:
            nl = buf.find(b"\n", self._searched)
            upto = len(buf) if nl < 0 else nl
            if self._line_start == 0 and upto > MAX_REQUEST_LINE:
                raise HttpError(HTTPStatus.REQUEST_URI_TOO_LONG, "request line too long")
            if upto > MAX_HEAD:
                raise HttpError(
                    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large"
                )
            if nl < 0:
                self._searched = len(buf)
                return None
            blank = self._line_start > 0 and nl - self._line_start <= 1
            if blank and buf[self._line_start : nl] in (b"", b"\r"):
                return nl + 1
            self._line_start = self._searched = nl + 1


def parse_head(head: bytes) -> RequestHead:
    """Parse one request head (request line, headers, blank line); HttpError if malformed."""
    lines = head.split(b"\n")
    if not all(line.endswith(b"\r") for line in lines[:-1]):
        raise HttpError(HTTPStatus.BAD_REQUEST, "a line of the request head does not end in CRLF")
    method, target, version = _request_line(lines[0].removesuffix(b"\r"))
    headers: list[tuple[str, str]] = []
    for raw in lines[1:]:
        line = raw.removesuffix(b"\r")
        if not line:
            break
        headers.append(_header(line))
        if len(headers) > MAX_HEADERS:
            raise HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "too many headers")
    return _framing(method, target, version, tuple(headers))


def _request_line(line: bytes) -> tuple[str, str, tuple[int, int]]:
    parts = line.split(b" ")
    if len(parts) == 2 and parts[1].startswith(b"/"):
        raise HttpError(HTTPStatus.BAD_REQUEST, "HTTP/0.9 requests are not served")
    if len(parts) != 3 or not all(parts):
        raise HttpError(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        raise HttpError(HTTPStatus.BAD_REQUEST, "malformed method")
    match = _VERSION.fullmatch(version)
    if match is None:
        raise HttpError(HTTPStatus.BAD_REQUEST, "malformed HTTP version")
    major, minor = int(match.group(1)), int(match.group(2))
    if major != 1:
        raise HttpError(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "only HTTP/1.x is served")
    if _TARGET_CONTROL.search(target):
        raise HttpError(HTTPStatus.BAD_REQUEST, "malformed request target")
    is_origin = target.startswith(b"/")
    is_absolute = target.startswith((b"http://", b"https://"))
    if not (is_origin or is_absolute or (target == b"*" and method == b"OPTIONS")):
        raise HttpError(HTTPStatus.BAD_REQUEST, "malformed request target")
    name = method.decode("ascii")
    if name not in KNOWN_METHODS:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, f"method {name[:32]} is not implemented")
    return name, target.decode("ascii"), (major, minor)


def _header(line: bytes) -> tuple[str, str]:
    if line[:1] in (b" ", b"\t"):
        raise HttpError(HTTPStatus.BAD_REQUEST, "obsolete header line folding")
    name, sep, value = line.partition(b":")
    if not sep or not _TOKEN.fullmatch(name):
        raise HttpError(HTTPStatus.BAD_REQUEST, "malformed header line")
    value = value.strip(b" \t")
    if _CONTROL.search(value):
        raise HttpError(HTTPStatus.BAD_REQUEST, "control character in a header value")
    return name.decode("ascii").lower(), value.decode("latin-1")


def _framing(
    method: str, target: str, version: tuple[int, int], headers: tuple[tuple[str, str], ...]
) -> RequestHead:
    lengths = {value for key, value in headers if key == "content-length"}
    codings = [
        coding.strip().lower()
        for key, value in headers
        if key == "transfer-encoding"
        for coding in value.split(",")
    ]
    chunked = bool(codings)
    if codings and codings != ["chunked"]:
        shown = ", ".join(codings)[:64]
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, f"transfer coding {shown!r} is not supported")
    if chunked and lengths:
        raise HttpError(HTTPStatus.BAD_REQUEST, "both Transfer-Encoding and Content-Length")
    connection = {
        token.strip().lower()
        for key, value in headers
        if key == "connection"
        for token in value.split(",")
    }
    keep_alive = "keep-alive" in connection if version == (1, 0) else "close" not in connection
    body = 0
    if sum(key == "host" for key, _ in headers) > 1:
        raise HttpError(HTTPStatus.BAD_REQUEST, "more than one Host header")
    if len(lengths) > 1:
        raise HttpError(HTTPStatus.BAD_REQUEST, "conflicting Content-Length headers")
    if lengths:
        text = lengths.pop()
        if not (text.isascii() and text.isdigit()) or len(text) > 18:
            raise HttpError(HTTPStatus.BAD_REQUEST, "malformed Content-Length")
        body = int(text)
        if body > MAX_BODY:
            raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "request body too large")
    expects = any(key == "expect" for key, _ in headers)
    if chunked or (expects and body):
        # A body we will not read: answer without it, then close (its bytes are not a request).
        body, keep_alive = 0, False
    return RequestHead(method, target, version, headers, body, keep_alive)


_date_cache: tuple[int, str] = (0, "")


def http_date() -> str:
    """The Date header's value, formatted once per second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True))
    return _date_cache[1]


def frame_response(
    status: int,
    headers: tuple[tuple[str, str], ...],
    body: bytes,
    *,
    head_only: bool,
    keep_alive: bool,
    http10_keep_alive: bool = False,
) -> bytes:
    """Status line, headers (Date and Content-Length added), blank line and body."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    lines = [f"HTTP/1.1 {status} {phrase}", f"Date: {http_date()}"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append(f"Content-Length: {len(body)}")
    if not keep_alive:
        lines.append("Connection: close")
    elif http10_keep_alive:
        lines.append("Connection: keep-alive")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body
