"""Store strings: which database one names, and how one is shown.

A store is named by a PostgreSQL connection string, either a URL (``postgresql://`` or
``postgres://``) or a libpq ``key=value`` string (``host=db dbname=gpuwatchd``), or by a
SQLite file path. Every command, the daemon and the client classify with
:func:`store_target`, so a connection string never becomes a file path; any other URL
scheme is refused in one line. A SQLite file whose name starts with ``word=`` is given
as ``./word=...``.

A store string is only ever shown through :func:`redact_url`: the password in a URL's
userinfo (``postgresql://user:pw@host``, and ``postgresql:user:pw@host`` without the
``//``), and every ``password``/``sslpassword`` value of a URL query or a key=value
string, shows as ``***``. Text that cannot be parsed is redacted too (hiding more rather
than less), so a malformed string never leaks its password into an error.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from os import PathLike
from pathlib import Path

from gpuwatchd.store.errors import StoreError

#: What a store string may be, for messages.
STORE_KINDS = (
    "a postgresql:// URL, a libpq key=value string (host=... dbname=...) or a SQLite file path"
)
_SECRET_KEYS = frozenset({"password", "sslpassword"})
_MASK = "***"
_POSTGRES_SCHEME = re.compile(r"postgres(?:ql)?:", re.IGNORECASE)
#: ``scheme:/`` and ``scheme://``: a URL (a ``pathlib.Path`` folds ``//`` into ``/``).
_ANY_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/")
_KEY_VALUE_START = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*=")
# libpq's key=value grammar: a value is single-quoted (backslash escapes) or runs to the
# next space. Hand-written: psycopg (libpq's parser) is optional, and a host on SQLite
# must still refuse a config whose connection string holds a password.
_PAIR = re.compile(
    r"\s*(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*=\s*"
    r"(?P<value>'(?:[^'\\]|\\.)*'|(?:[^\s'\\]|\\.)(?:[^\s\\]|\\.)*|)",
    re.DOTALL,
)


def _text(location: str | PathLike[str]) -> str:
    return os.fspath(location)


def is_postgres_url(location: str | PathLike[str]) -> bool:
    """Whether ``location`` names a PostgreSQL database: a ``postgresql://``/``postgres://``
    URL or a libpq key=value connection string (anything else is a file, or refused)."""
    text = _text(location)
    return bool(_POSTGRES_SCHEME.match(text) or _KEY_VALUE_START.match(text))


def store_target(location: str | PathLike[str]) -> str | Path:
    """What a store string names: a PostgreSQL connection string (returned as given) or a
    SQLite file (a Path). Any other URL scheme raises :class:`StoreError` in one line."""
    text = _text(location)
    if is_postgres_url(text):
        return text
    scheme = _ANY_SCHEME.match(text)
    if scheme:
        hint = "; give the SQLite file's path itself" if scheme[1].lower() == "sqlite" else ""
        raise StoreError(
            f"store {redact_url(text)}: unsupported URL scheme {scheme[1]!r}; expected"
            f" {STORE_KINDS}{hint}"
        )
    return Path(location)


def _key_value_secrets(text: str) -> list[tuple[int, int]]:
    """Spans of the secret values in a key=value string; ValueError where it is malformed."""
    spans = []
    pos = 0
    while text[pos:].strip():
        m = _PAIR.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError("not a key=value connection string")
        if m["key"].lower() in _SECRET_KEYS:
            spans.append(m.span("value"))
        pos = m.end()
    return spans


def _url_secrets(text: str) -> list[tuple[int, int]]:
    """Spans of a URL's secrets: the userinfo's password and secret query values.

    Read by hand, not with :mod:`urllib.parse`: it follows libpq's reading (credentials
    end at the first ``@`` before the path; several hosts) and copes with URLs nobody can
    parse, hiding what might be a password even where libpq would not read one.
    """
    base = text.index(":") + 1
    base += 2 if text.startswith("//", base) else 0
    path = text.find("/", base)
    at = text.find("@", base, len(text) if path < 0 else path)
    spans = []
    if at >= 0:
        colon = text.find(":", base, at)
        if colon >= 0:
            spans.append((colon + 1, at))
    else:  # a password holding '/' or '?': libpq misreads it, but it must not be shown
        last = text.rfind("@", base)
        colon = text.find(":", base, last) if last >= 0 else -1
        if colon >= 0 and "=" not in text[base:last]:
            spans.append((colon + 1, last))
    query = text.find("?", at + 1 if at >= 0 else base)
    if query >= 0:
        end = text.find("#", query)
        end = len(text) if end < 0 else end
        pos = query + 1
        for param in text[query + 1 : end].split("&"):
            key, eq, _ = param.partition("=")
            if eq and urllib.parse.unquote(key).strip().lower() in _SECRET_KEYS:
                spans.append((pos + len(key) + 1, pos + len(param)))
            pos += len(param) + 1
    return spans


def _secrets(text: str) -> list[tuple[int, int]]:
    if _ANY_SCHEME.match(text) or _POSTGRES_SCHEME.match(text):  # with or without ``//``
        return _url_secrets(text)
    if _KEY_VALUE_START.match(text):
        return _key_value_secrets(text)
    return []


def url_has_password(location: str | PathLike[str]) -> bool:
    """Whether a store string holds a password anywhere libpq would read one from.

    ValueError for a key=value string that libpq could not parse either.
    """
    return bool(_secrets(_text(location)))


def redact_url(location: str | PathLike[str]) -> str:
    """A store string as it may be shown: every password replaced by ``***``; a key=value
    string too malformed to tell where its values end shows its keys only."""
    text = _text(location)
    try:
        spans = _secrets(text)
    except ValueError:
        keys = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)\s*=", text)  # not inside values
        return "a malformed key=value string (keys: " + ", ".join(keys or ["none"]) + ")"
    shown, pos = [], 0
    for start, end in sorted(spans):
        if start >= pos:
            shown += [text[pos:start], _MASK]
        pos = max(pos, end)
    return "".join([*shown, text[pos:]])
