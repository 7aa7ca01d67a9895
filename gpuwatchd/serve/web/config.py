# Hand-written: no maintained Python library reads the exporter-toolkit web-config format.
"""The Prometheus exporter-toolkit web config (``--web-config``): TLS, basic auth, headers.

Operators reuse the ``web-config.yml`` they already give node_exporter: same keys, value
names and defaults (exporter-toolkit ``docs/web-configuration.md``). Parsing is strict
like the toolkit's ``yaml.UnmarshalStrict``: an unknown or duplicate key is an error, so a
typo can never silently switch authentication off. Relative paths are resolved against
the file's directory, as the toolkit does. This module only parses: :mod:`.tls` builds
the SSLContext, :mod:`.auth` checks passwords, :mod:`.security` puts them to work.

Values are read as Go's YAML decoder reads them into the toolkit's Go structs: every
scalar is text until a field asks for a number or a boolean, so ``X-XSS-Protection: 1``
is the header value "1", as in the toolkit.

Where Python's :mod:`ssl` cannot do what Go's ``crypto/tls`` does, the file is refused or
the behaviour is stated here rather than approximated silently:

* ``RequireAnyClientCert`` (any certificate, unverified) cannot be expressed: refused.
* ``RequestClientCert`` asks for nothing; as in Go, every client gets in either way.
* Verifying client certificates without ``client_ca_file``/``client_ca`` uses the system's
  trusted CAs, as Go does (so any publicly trusted client certificate passes).
* ``curve_preferences``: only the first (most preferred) curve is offered.
* ``http_server_config.http2`` is accepted and ignored: the server speaks HTTP/1.1. As in
  the toolkit, a TLS 1.2 ``cipher_suites`` list without an HTTP/2-required suite is
  refused while ``http2`` is true (Go's server refuses to start with it).
* ``rate_limit.burst: 0`` with an interval refuses every request (429), as in the toolkit.
* Certificates are re-read when :meth:`HttpServer.reload_web_config` runs (SIGHUP), not
  on every connection.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gpuwatchd.serve.web.tls import (
    CIPHERS,
    CLIENT_AUTH_ALIASES,
    CURVES,
    TLS_VERSIONS,
    ClientAuth,
    TlsServerConfig,
    build_ssl_context,
)

#: Headers the toolkit lets a config add, with their allowed values (None: free text).
_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
_BCRYPT_HASH = re.compile(r"\$2[abxy]?\$(\d\d)\$[./A-Za-z0-9]{53}")
_GO_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_GO_DURATION_MAX_S = (2**63 - 1) / 1e9
_GO_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit")
_TLS_KEYS = (
    "cert",
    "key",
    "client_ca",
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "client_allowed_sans",
    "min_version",
    "max_version",
    "cipher_suites",
    "prefer_server_cipher_suites",
    "curve_preferences",
)
#: Keys whose presence switches TLS on (the toolkit's ``TLSConfig.IsEnabled``).
_TLS_ENABLING = ("cert", "key", "client_ca", "cert_file", "key_file", "client_ca_file")
_HTTP_KEYS = ("http2", "headers")
#: One of these must be in a TLS 1.2 ``cipher_suites`` list while HTTP/2 is on (Go's
#: ``http2.ConfigureServer`` refuses to serve without one).
HTTP2_REQUIRED_CIPHERS = (
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
)
#: yaml.v2's words for booleans (YAML 1.1), which the toolkit's Go structs accept.
_YAML_TRUE = ("y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON")
_YAML_FALSE = ("n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF")
_RATE_KEYS = ("interval", "burst")


@dataclass(frozen=True, slots=True)
class RateLimit:
    """Token bucket over all requests: ``burst`` at once, then one per ``interval_s``."""

    interval_s: float
    burst: int


@dataclass(frozen=True, slots=True)
class WebConfig:
    """A validated web config; ``tls`` None serves plain HTTP, no users means no auth."""

    tls: TlsServerConfig | None = None
    basic_auth_users: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({}), repr=False
    )
    headers: tuple[tuple[str, str], ...] = ()
    rate_limit: RateLimit | None = None
    http2: bool = True
    source: Path | None = None


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read, parse and validate a web config file, certificates included.

    Raises ValueError with one line naming the file and the bad key.
    """
    from gpuwatchd.serve.web.strict_yaml import load_strict  # PyYAML: only to read one

    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
        doc = load_strict(text)
        config = parse_web_config(doc, source.parent, source=source)
        if config.tls is not None:
            build_ssl_context(config.tls)  # unreadable or mismatched files fail now
    except OSError as exc:
        raise ValueError(f"web config {source}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"web config {source}: not UTF-8 text") from None
    except ValueError as exc:
        raise ValueError(f"web config {source}: {exc}") from None
    return config


def parse_web_config(doc: object, base_dir: Path, *, source: Path | None = None) -> WebConfig:
    """Validate a decoded YAML document; file paths are made absolute against ``base_dir``.

    Reads no files: :func:`build_ssl_context` does.
    """
    top = _mapping(doc, "web config")
    _known_keys(top, _TOP_KEYS, "")
    tls = _parse_tls(_mapping(top.get("tls_server_config"), "tls_server_config"), base_dir)
    http = _mapping(top.get("http_server_config"), "http_server_config")
    _known_keys(http, _HTTP_KEYS, "http_server_config")
    http2 = _bool(http, "http2", "http_server_config", default=True)
    if tls is not None and http2:
        _check_http2_ciphers(tls)
    return WebConfig(
        tls=tls,
        basic_auth_users=_parse_users(top.get("basic_auth_users")),
        headers=_parse_headers(http.get("headers")),
        rate_limit=_parse_rate_limit(top.get("rate_limit")),
        http2=http2,
        source=source,
    )


def _parse_tls(doc: dict[str, Any], base_dir: Path) -> TlsServerConfig | None:
    where = "tls_server_config"
    _known_keys(doc, _TLS_KEYS, where)
    strings = {key: _str(doc, key, where) for key in _TLS_ENABLING}
    auth_text = _str(doc, "client_auth_type", where)
    if not any(strings.values()) and not auth_text:
        return None  # as the toolkit: only min_version & co. set means plain HTTP
    for inline, name in (
        ("cert", "cert_file"),
        ("key", "key_file"),
        ("client_ca", "client_ca_file"),
    ):
        if strings[inline] and strings[name]:
            raise ValueError(f"{where}: give {inline} or {name}, not both")
    if not (strings["cert"] or strings["cert_file"]):
        raise ValueError(f"{where}: missing one of cert or cert_file")
    if not (strings["key"] or strings["key_file"]):
        raise ValueError(f"{where}: missing one of key or key_file")
    client_auth = _parse_client_auth(auth_text)
    has_ca = bool(strings["client_ca"] or strings["client_ca_file"])
    if has_ca and client_auth is ClientAuth.NO_CLIENT_CERT:
        raise ValueError(
            f"{where}: client_ca_file is set but client_auth_type is NoClientCert;"
            " set client_auth_type: RequireAndVerifyClientCert"
        )
    sans = _str_list(doc, "client_allowed_sans", where)
    if sans and client_auth is ClientAuth.REQUEST_CLIENT_CERT:
        raise ValueError(
            f"{where}.client_allowed_sans: Python's ssl module cannot read the SANs of a"
            " certificate it does not verify; use VerifyClientCertIfGiven or"
            " RequireAndVerifyClientCert"
        )
    min_version = _tls_version(doc, "min_version", ssl.TLSVersion.TLSv1_2)
    max_version = _tls_version(doc, "max_version", ssl.TLSVersion.TLSv1_3)
    if min_version > max_version:
        raise ValueError(f"{where}.min_version: {doc['min_version']} is above max_version")
    ciphers = _str_list(doc, "cipher_suites", where)
    for name in ciphers:
        if name not in CIPHERS:
            raise ValueError(f"{where}.cipher_suites: unknown cipher {name!r}")
    curves = _str_list(doc, "curve_preferences", where)
    for name in curves:
        if name not in CURVES:
            raise ValueError(
                f"{where}.curve_preferences: unknown curve {name!r}"
                f" (expected one of {', '.join(CURVES)})"
            )

    def path(key: str) -> Path | None:
        value = strings[key]
        return base_dir / value if value else None

    return TlsServerConfig(
        cert_file=path("cert_file"),
        cert=strings["cert"],
        key_file=path("key_file"),
        key=strings["key"],
        client_auth_type=client_auth,
        client_ca_file=path("client_ca_file"),
        client_ca=strings["client_ca"],
        client_allowed_sans=sans,
        min_version=min_version,
        max_version=max_version,
        cipher_suites=ciphers,
        prefer_server_cipher_suites=_bool(doc, "prefer_server_cipher_suites", where, default=True),
        curve_preferences=curves,
    )


def _parse_client_auth(text: str | None) -> ClientAuth:
    where = "tls_server_config.client_auth_type"
    if not text:
        return ClientAuth.NO_CLIENT_CERT
    try:
        value = CLIENT_AUTH_ALIASES.get(text) or ClientAuth(text)
    except ValueError:
        names = ", ".join(a.value for a in ClientAuth)
        raise ValueError(f"{where}: {text!r} is not one of {names}") from None
    if value is ClientAuth.REQUIRE_ANY_CLIENT_CERT:
        raise ValueError(
            f"{where}: {text} (any certificate, unverified) cannot be served by Python's ssl"
            " module; use RequireAndVerifyClientCert with client_ca_file"
        )
    return value


def _tls_version(doc: Mapping[str, Any], key: str, default: ssl.TLSVersion) -> ssl.TLSVersion:
    text = _str(doc, key, "tls_server_config")
    if not text:
        return default
    if text not in TLS_VERSIONS:
        names = ", ".join(TLS_VERSIONS)
        raise ValueError(f"tls_server_config.{key}: unknown TLS version {text!r} ({names})")
    return TLS_VERSIONS[text]


def _parse_users(value: object) -> Mapping[str, str]:
    where = "basic_auth_users"
    users: dict[str, str] = {}
    for name, value_hashed in _mapping(value, where).items():
        user, hashed = _text(name), _text(value_hashed)
        if user is None:
            raise ValueError(f"{where}: user name {name!r} must be a string")
        if ":" in user:
            raise ValueError(f"{_dotted(where, user)}: a user name cannot contain ':'")
        if hashed is None:
            raise ValueError(
                f"{_dotted(where, user)}: expected a bcrypt hash, got {_kind(value_hashed)}"
            )
        match = _BCRYPT_HASH.fullmatch(hashed)
        if match is None:
            raise ValueError(
                f"{_dotted(where, user)}: not a bcrypt hash (expected $2y$10$ and 53 chars)"
            )
        cost = int(match.group(1))
        if not 4 <= cost <= 31:
            raise ValueError(f"{_dotted(where, user)}: bcrypt cost {cost} is outside 4-31")
        users[user] = hashed
    return MappingProxyType(users)


def _parse_headers(value: object) -> tuple[tuple[str, str], ...]:
    where = "http_server_config.headers"
    headers: list[tuple[str, str]] = []
    for name, raw in _mapping(value, where).items():
        if name not in _HEADERS:
            raise ValueError(
                f"{_dotted(where, name)}: this header cannot be configured"
                f" (expected one of {', '.join(_HEADERS)})"
            )
        text = "" if raw is None else _text(raw)
        if text is None or "\r" in text or "\n" in text:
            raise ValueError(f"{_dotted(where, name)}: expected a one-line string")
        allowed = _HEADERS[name]
        if allowed is not None and text not in allowed:
            raise ValueError(f"{_dotted(where, name)}: {text!r} is not one of {', '.join(allowed)}")
        if text:  # blank free-text means unset
            headers.append((name, text))
    return tuple(headers)


def _parse_rate_limit(value: object) -> RateLimit | None:
    where = "rate_limit"
    doc = _mapping(value, where)
    _known_keys(doc, _RATE_KEYS, where)
    interval = parse_go_duration(doc.get("interval", 0), f"{where}.interval")
    burst = _int(doc.get("burst", 0), f"{where}.burst")
    if burst < 0:
        raise ValueError(f"{where}.burst: expected a non-negative integer, got {burst}")
    if interval == 0:
        return None  # 0 disables the limiter, as in the toolkit
    return RateLimit(interval, burst)  # burst 0 refuses every request, as in the toolkit


def _check_http2_ciphers(tls: TlsServerConfig) -> None:
    """Refuse what Go's HTTP/2 setup refuses, so the verdict matches the toolkit's."""
    if not tls.cipher_suites or tls.min_version >= ssl.TLSVersion.TLSv1_3:
        return
    if not any(name in HTTP2_REQUIRED_CIPHERS for name in tls.cipher_suites):
        raise ValueError(
            "tls_server_config.cipher_suites: missing an HTTP/2-required cipher (one of"
            f" {', '.join(HTTP2_REQUIRED_CIPHERS)}); add one or set"
            " http_server_config.http2: false, as exporter-toolkit requires"
        )


def parse_go_duration(value: object, where: str) -> float:
    """A Go ``time.Duration`` string ("1s", "1m30s", "250ms") -> seconds; bare 0 is 0."""
    if value == 0 and not isinstance(value, bool):
        return 0.0
    if not isinstance(value, str) or not value or value == "-":
        raise ValueError(f"{where}: expected a duration such as 1s or 500ms, got {value!r}")
    text = value.removeprefix("+")
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(text):
        match = _GO_DURATION_PART.match(text, pos)
        if match is None:
            raise ValueError(f"{where}: {value!r} is not a duration such as 1s or 500ms")
        total += float(match.group(1)) * _GO_DURATION_UNITS[match.group(2)]
        pos = match.end()
    if total > _GO_DURATION_MAX_S:  # Go's is int64 nanoseconds (and inf is no interval)
        raise ValueError(f"{where}: {value[:40]!r} is longer than Go's longest duration")
    return total


# -- field readers ------------------------------------------------------------------


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


def _mapping(value: object, where: str) -> dict[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping, got {_kind(value)}")
    return value


def _known_keys(doc: Mapping[Any, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in doc:
        if key not in allowed:
            name = _dotted(where, key) if where else _shown_key(key)
            raise ValueError(f"{name}: unknown key (expected one of {', '.join(allowed)})")


def _shown_key(key: object) -> str:
    """A key from the file as a message shows it: as written when printable, else quoted
    (a newline in a key must not split a one-line error)."""
    text = str(key)
    return text if text.isprintable() else repr(text)


def _dotted(where: str, key: object) -> str:
    return f"{where}.{_shown_key(key)}"


def _text(value: object) -> str | None:
    """A scalar as Go reads it into a string field; None for null or a collection."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    return None


def _str(doc: Mapping[str, Any], key: str, where: str) -> str | None:
    value = doc.get(key)
    if value is None or value == "":
        return None
    text = _text(value)
    if text is None:
        raise ValueError(f"{where}.{key}: expected a string, got {_kind(value)}")
    return text


def _bool(doc: Mapping[str, Any], key: str, where: str, *, default: bool) -> bool:
    value = doc.get(key, default)
    if isinstance(value, bool):
        return value
    if value in _YAML_TRUE:
        return True
    if value in _YAML_FALSE:
        return False
    raise ValueError(f"{where}.{key}: expected true or false, got {value!r}")


def _int(value: object, where: str) -> int:
    """An integer field: a number, or text in the forms yaml.v2 reads (1_000, 0x10, 010)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.replace("_", "")
        try:
            if re.fullmatch(r"[-+]?0[0-7]+", text):
                return int(text, 8)
            return int(text, 0)
        except ValueError:
            pass
    raise ValueError(f"{where}: expected an integer, got {value!r}")


def _str_list(doc: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = doc.get(key)
    if value is None:
        return ()
    texts = [_text(v) for v in value] if isinstance(value, list) else [None]
    if not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{where}.{key}: expected a list of strings")
    return tuple(t for t in texts if t is not None)
