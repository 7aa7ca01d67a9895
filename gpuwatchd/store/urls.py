"""PostgreSQL URLs: recognising one, and showing it without its password.

A URL is only ever shown redacted: no password reaches a message or a log line.
"""

from __future__ import annotations

import urllib.parse
from os import PathLike

_SCHEMES = ("postgresql://", "postgres://")
_SECRET_PARAMS = frozenset({"password", "sslpassword"})


def is_postgres_url(location: str | PathLike[str]) -> bool:
    return isinstance(location, str) and location.lower().startswith(_SCHEMES)


def url_has_password(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    return parts.password is not None or any(k in _SECRET_PARAMS for k in query)


def redact_url(url: str) -> str:
    """The URL with any password (in the authority or a query parameter) shown as ``***``."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}"
    query = urllib.parse.urlencode(
        [
            (k, "***" if k in _SECRET_PARAMS else v)
            for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        ],
        safe="*/",
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
