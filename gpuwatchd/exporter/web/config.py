"""The Prometheus exporter-toolkit web config (``--web-config``): TLS, basic auth, headers.

Operators reuse the ``web-config.yml`` they already give node_exporter: same keys, value
names and defaults (exporter-toolkit ``docs/web-configuration.md``). Parsing is strict
like the toolkit's ``yaml.UnmarshalStrict``: an unknown or duplicate key is an error, so a
typo can never silently switch authentication off. Relative paths are resolved against
the file's directory, as the toolkit does.

Where Python's :mod:`ssl` cannot do what Go's ``crypto/tls`` does, the file is refused or
the behaviour is stated here rather than approximated silently:

* ``RequireAnyClientCert`` (any certificate, unverified) cannot be expressed: refused.
* ``RequestClientCert`` asks for nothing; as in Go, every client gets in either way.
* Verifying client certificates needs ``client_ca_file``/``client_ca`` (Go would fall back
  to the system roots, i.e. any publicly trusted certificate).
* ``curve_preferences``: only the first (most preferred) curve is offered.
* ``http_server_config.http2`` is accepted and ignored: the server speaks HTTP/1.1.
* Certificates are re-read when :meth:`HttpServer.reload_web_config` runs (SIGHUP), not
  on every connection.
"""

from __future__ import annotations

import base64
import binascii
import collections
import enum
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import ssl
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import bcrypt
import yaml

log = logging.getLogger(__name__)

#: Realm sent in ``WWW-Authenticate`` with every 401.
AUTH_REALM = "gpuwatchd"
#: The challenge sent with every 401.
WWW_AUTHENTICATE = f'Basic realm="{AUTH_REALM}", charset="UTF-8"'
#: Successful verifications remembered, so a scrape every 15 s costs no bcrypt.
AUTH_CACHE_SIZE = 100


class ClientAuth(enum.StrEnum):
    """``client_auth_type`` values, named as Go's ``tls.ClientAuthType``."""

    NO_CLIENT_CERT = "NoClientCert"
    REQUEST_CLIENT_CERT = "RequestClientCert"
    REQUIRE_ANY_CLIENT_CERT = "RequireAnyClientCert"
    VERIFY_CLIENT_CERT_IF_GIVEN = "VerifyClientCertIfGiven"
    REQUIRE_AND_VERIFY_CLIENT_CERT = "RequireAndVerifyClientCert"


_CLIENT_AUTH_ALIASES = {"RequireClientCert": ClientAuth.REQUIRE_ANY_CLIENT_CERT}
_VERIFY_MODES = {
    ClientAuth.NO_CLIENT_CERT: ssl.CERT_NONE,
    ClientAuth.REQUEST_CLIENT_CERT: ssl.CERT_NONE,
    ClientAuth.VERIFY_CLIENT_CERT_IF_GIVEN: ssl.CERT_OPTIONAL,
    ClientAuth.REQUIRE_AND_VERIFY_CLIENT_CERT: ssl.CERT_REQUIRED,
}
_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
#: Go's ``tls.CipherSuites()`` names -> OpenSSL names. ``None``: a TLS 1.3 suite, which
#: neither Go nor OpenSSL's cipher list lets a server configure; accepted, no effect.
_CIPHERS: dict[str, str | None] = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
}
_CURVES = {
    "CurveP256": "prime256v1",
    "CurveP384": "secp384r1",
    "CurveP521": "secp521r1",
    "X25519": "X25519",
}
#: Headers the toolkit lets a config add, with their allowed values (None: free text).
_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
_BCRYPT_MAX_PASSWORD = 72  # bytes bcrypt looks at
_BCRYPT_HASH = re.compile(r"^\$2[abxy]?\$(\d\d)\$[./A-Za-z0-9]{53}$")
_GO_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
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
_RATE_KEYS = ("interval", "burst")


# -- configuration ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TlsServerConfig:
    """``tls_server_config`` after validation; exactly one of each ``*_file``/inline pair."""

    cert_file: Path | None = None
    cert: str | None = None
    key_file: Path | None = None
    key: str | None = field(default=None, repr=False)
    client_auth_type: ClientAuth = ClientAuth.NO_CLIENT_CERT
    client_ca_file: Path | None = None
    client_ca: str | None = None
    client_allowed_sans: tuple[str, ...] = ()
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3
    cipher_suites: tuple[str, ...] = ()  # Go names, as written in the file
    prefer_server_cipher_suites: bool = True
    curve_preferences: tuple[str, ...] = ()  # Go names, as written in the file


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
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
        doc = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
        config = parse_web_config(doc, source.parent, source=source)
        if config.tls is not None:
            build_ssl_context(config.tls)  # unreadable or mismatched files fail now
    except OSError as exc:
        raise ValueError(f"web config {source}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"web config {source}: not UTF-8 text") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"web config {source}: invalid YAML{where}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"web config {source}: invalid YAML: {_one_line(exc)}") from None
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
    if _VERIFY_MODES[client_auth] != ssl.CERT_NONE and not has_ca:
        raise ValueError(
            f"{where}.client_auth_type: {client_auth} needs client_ca_file (or client_ca)"
            " to verify client certificates against"
        )
    sans = _str_list(doc, "client_allowed_sans", where)
    if sans and client_auth is not ClientAuth.REQUIRE_AND_VERIFY_CLIENT_CERT:
        raise ValueError(
            f"{where}.client_allowed_sans: needs client_auth_type RequireAndVerifyClientCert"
        )
    min_version = _tls_version(doc, "min_version", ssl.TLSVersion.TLSv1_2)
    max_version = _tls_version(doc, "max_version", ssl.TLSVersion.TLSv1_3)
    if min_version > max_version:
        raise ValueError(f"{where}.min_version: {doc['min_version']} is above max_version")
    ciphers = _str_list(doc, "cipher_suites", where)
    for name in ciphers:
        if name not in _CIPHERS:
            raise ValueError(f"{where}.cipher_suites: unknown cipher {name!r}")
    curves = _str_list(doc, "curve_preferences", where)
    for name in curves:
        if name not in _CURVES:
            raise ValueError(
                f"{where}.curve_preferences: unknown curve {name!r}"
                f" (expected one of {', '.join(_CURVES)})"
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
        value = _CLIENT_AUTH_ALIASES.get(text) or ClientAuth(text)
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
    if text not in _TLS_VERSIONS:
        names = ", ".join(_TLS_VERSIONS)
        raise ValueError(f"tls_server_config.{key}: unknown TLS version {text!r} ({names})")
    return _TLS_VERSIONS[text]


def _parse_users(value: object) -> Mapping[str, str]:
    where = "basic_auth_users"
    users: dict[str, str] = {}
    for user, hashed in _mapping(value, where).items():
        if not isinstance(user, str):
            raise ValueError(f"{where}: user name {user!r} must be a string (quote it)")
        if ":" in user:
            raise ValueError(f"{where}.{user}: a user name cannot contain ':'")
        if not isinstance(hashed, str):
            raise ValueError(f"{where}.{user}: expected a bcrypt hash, got {_kind(hashed)}")
        match = _BCRYPT_HASH.match(hashed)
        if match is None:
            raise ValueError(f"{where}.{user}: not a bcrypt hash (expected $2y$10$ and 53 chars)")
        cost = int(match.group(1))
        if not 4 <= cost <= 31:
            raise ValueError(f"{where}.{user}: bcrypt cost {cost} is outside 4-31")
        users[user] = hashed
    return MappingProxyType(users)


def _parse_headers(value: object) -> tuple[tuple[str, str], ...]:
    where = "http_server_config.headers"
    headers: list[tuple[str, str]] = []
    for name, text in _mapping(value, where).items():
        if name not in _HEADERS:
            raise ValueError(
                f"{where}.{name}: this header cannot be configured"
                f" (expected one of {', '.join(_HEADERS)})"
            )
        if text is None or text == "":
            continue  # blank means unset, as in the toolkit
        if not isinstance(text, str) or "\r" in text or "\n" in text:
            raise ValueError(f"{where}.{name}: expected a one-line string")
        allowed = _HEADERS[name]
        if allowed is not None and text not in allowed:
            raise ValueError(f"{where}.{name}: {text!r} is not one of {', '.join(allowed)}")
        headers.append((name, text))
    return tuple(headers)


def _parse_rate_limit(value: object) -> RateLimit | None:
    where = "rate_limit"
    doc = _mapping(value, where)
    _known_keys(doc, _RATE_KEYS, where)
    interval = parse_go_duration(doc.get("interval", 0), f"{where}.interval")
    burst = doc.get("burst", 0)
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 0:
        raise ValueError(f"{where}.burst: expected a non-negative integer, got {burst!r}")
    if interval == 0:
        return None  # 0 disables the limiter, as in the toolkit
    if burst == 0:
        raise ValueError(f"{where}.burst: must be at least 1 when interval is set")
    return RateLimit(interval, burst)


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
    return total


# -- YAML helpers ----------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, as Go's ``yaml.UnmarshalStrict`` does."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[object] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark
            ) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _mapping(value: object, where: str) -> dict[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping, got {_kind(value)}")
    return value


def _known_keys(doc: Mapping[Any, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in doc:
        if key not in allowed:
            name = f"{where}.{key}" if where else str(key)
            raise ValueError(f"{name}: unknown key (expected one of {', '.join(allowed)})")


def _str(doc: Mapping[str, Any], key: str, where: str) -> str | None:
    value = doc.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key}: expected a string, got {_kind(value)}")
    return value


def _bool(doc: Mapping[str, Any], key: str, where: str, *, default: bool) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key}: expected true or false, got {value!r}")
    return value


def _str_list(doc: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = doc.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}.{key}: expected a list of strings")
    return tuple(value)


# -- TLS -------------------------------------------------------------------------------


def build_ssl_context(tls: TlsServerConfig) -> ssl.SSLContext:
    """A server-side SSLContext for ``tls``; reads every file it names now.

    Raises ValueError naming the key: ``tls_server_config.cert_file: cannot read /x: ...``.
    """
    where = "tls_server_config"
    cert = _pem(tls.cert_file, tls.cert, "cert")
    key = _pem(tls.key_file, tls.key, "key")
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ValueError(f"{_source(tls.cert_file, 'cert')}: no PEM certificate found")
    if b"PRIVATE KEY-----" not in key:
        raise ValueError(f"{_source(tls.key_file, 'key')}: no PEM private key found")
    if b"ENCRYPTED" in key:
        raise ValueError(
            f"{_source(tls.key_file, 'key')}: the key is encrypted; give it unencrypted"
        )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with warnings.catch_warnings():  # TLS10/TLS11 are deprecated, but the file asked
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = tls.min_version
        ctx.maximum_version = tls.max_version
    ctx.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_COMPRESSION
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    try:
        with _pem_files(cert, key) as (cert_path, key_path):
            ctx.load_cert_chain(cert_path, key_path, password=_refuse_password)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(
            f"{where}: cannot load the certificate and key: {_ssl_reason(exc)}"
        ) from None
    openssl_ciphers = [c for c in (_CIPHERS[n] for n in tls.cipher_suites) if c]
    if openssl_ciphers:
        try:
            ctx.set_ciphers(":".join(openssl_ciphers))
        except ssl.SSLError:
            raise ValueError(f"{where}.cipher_suites: this OpenSSL offers none of them") from None
    if tls.curve_preferences:
        ctx.set_ecdh_curve(_CURVES[tls.curve_preferences[0]])
    ctx.verify_mode = _VERIFY_MODES[tls.client_auth_type]
    if tls.client_ca_file is not None or tls.client_ca is not None:
        ca = _pem(tls.client_ca_file, tls.client_ca, "client_ca")
        ca_where = _source(tls.client_ca_file, "client_ca")
        if b"-----BEGIN CERTIFICATE-----" not in ca:
            raise ValueError(f"{ca_where}: no PEM certificate found")
        try:
            ctx.load_verify_locations(cadata=ca.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as exc:
            raise ValueError(f"{ca_where}: invalid CA certificate: {_ssl_reason(exc)}") from None
    return ctx


def _source(path: Path | None, inline_key: str) -> str:
    if path is None:
        return f"tls_server_config.{inline_key}"
    return f"tls_server_config.{inline_key}_file {path}"


def _pem(path: Path | None, inline: str | None, inline_key: str) -> bytes:
    if path is None:
        return (inline or "").encode("utf-8")
    try:
        return path.read_bytes()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ValueError(
            f"tls_server_config.{inline_key}_file: cannot read {path}: {reason}"
        ) from None


def _refuse_password() -> str:
    raise ValueError("the key is encrypted; give it unencrypted")


def _ssl_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    return _one_line(exc)


@contextmanager
def _pem_files(cert: bytes, key: bytes) -> Iterator[tuple[str, str]]:
    """Hand PEM bytes to ``load_cert_chain``, which only takes paths, without disk copies.

    Reading the files once into memory also means a certificate renewed between the
    check above and the load cannot pair an old key with a new certificate.
    """
    if hasattr(os, "memfd_create"):
        fds = [os.memfd_create(name, os.MFD_CLOEXEC) for name in ("cert", "key")]
        try:
            for fd, data in zip(fds, (cert, key), strict=True):
                os.write(fd, data)
            yield f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}"
        finally:
            for fd in fds:
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="gpuwatchd-tls-") as tmp:  # 0700
        paths = (os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem"))
        for path, data in zip(paths, (cert, key), strict=True):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(data)
        yield paths


def peer_has_allowed_san(peer: Mapping[str, Any] | None, allowed: tuple[str, ...]) -> bool:
    """Whether a verified client certificate (``getpeercert()``) names an allowed SAN.

    Matches DNS, IP, e-mail and URI entries exactly, as the toolkit's
    ``client_allowed_sans`` does; IP addresses are compared as addresses.
    """
    if not peer:
        return False
    wanted = {_normal_san(a) for a in allowed}
    for kind, value in peer.get("subjectAltName", ()):
        if kind in ("DNS", "email", "URI") and value in wanted:
            return True
        if kind == "IP Address" and _normal_san(value.strip()) in wanted:
            return True
    return False


def _normal_san(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return value


# -- basic auth ------------------------------------------------------------------------


def parse_basic_credentials(authorization: str | None) -> tuple[str, bytes] | None:
    """``Authorization: Basic base64(user:password)`` -> (user, password); None if not that."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        raw = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = raw.partition(b":")
    if not sep:
        return None
    try:
        return user.decode("utf-8"), password
    except UnicodeDecodeError:
        return None


class BasicAuth:
    """Checks basic-auth credentials against bcrypt hashes, remembering successes.

    bcrypt is slow on purpose (cost 10 is ~70 ms, 12 is ~300 ms), so a success is cached
    under an HMAC of (user, hash, password) with a per-process random key: the cache holds
    no password, and its lookup timing says nothing without the key. Failures are not
    cached, so guessing cannot evict the scrapers' entries; bcrypt runs one at a time so a
    flood of wrong passwords costs at most one core. An unknown user is checked against a
    real hash so timing does not reveal which users exist.
    """

    def __init__(self, users: Mapping[str, str], cache_size: int = AUTH_CACHE_SIZE) -> None:
        if not users:
            raise ValueError("BasicAuth needs at least one user")
        self._users = {user: hashed.encode("ascii") for user, hashed in users.items()}
        self._decoy = next(iter(self._users.values()))
        self._key = secrets.token_bytes(32)
        self._cache: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()

    def check(self, authorization: str | None) -> str | None:
        """The authenticated user name, or None."""
        credentials = parse_basic_credentials(authorization)
        if credentials is None:
            return None
        user, password = credentials
        hashed = self._users.get(user)
        known = hashed is not None
        target = hashed if hashed is not None else self._decoy
        cache_key = self._cache_key(user, target, password)
        with self._cache_lock:
            if known and cache_key in self._cache:
                self._cache.move_to_end(cache_key)
                return user
        if len(password) > _BCRYPT_MAX_PASSWORD:
            return None  # Go refuses these too; old bcrypt releases would truncate them
        with self._bcrypt_lock:
            try:
                ok = bcrypt.checkpw(password, target)
            except ValueError:
                ok = False
        if not (ok and known):
            return None
        with self._cache_lock:
            self._cache[cache_key] = None
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return user

    def _cache_key(self, user: str, hashed: bytes, password: bytes) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (user.encode("utf-8"), hashed, password):
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.digest()


class RateLimiter:
    """Token bucket like Go's ``rate.NewLimiter(rate.Every(interval), burst)``; starts full."""

    def __init__(
        self, interval_s: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval_s = interval_s
        self._burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            elapsed = max(0.0, now - self._last)
            self._tokens = min(self._burst, self._tokens + elapsed / self._interval_s)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


class Admission(enum.Enum):
    """What the HTTP layer does with a request before routing it."""

    ALLOW = "allow"
    UNAUTHORIZED = "unauthorized"  # 401 with WWW-Authenticate
    RATE_LIMITED = "rate_limited"  # 429


class WebSecurity:
    """A :class:`WebConfig` made live: SSL context, authenticator, limiter, headers.

    Built once per (re)load; the HTTP server swaps the whole object atomically so every
    connection and request sees one consistent config.
    """

    def __init__(self, config: WebConfig) -> None:
        self.config = config
        self.ssl_context = build_ssl_context(config.tls) if config.tls is not None else None
        self.allowed_sans = config.tls.client_allowed_sans if config.tls is not None else ()
        users = config.basic_auth_users
        self.auth = BasicAuth(users) if users else None
        limit = config.rate_limit
        self.limiter = RateLimiter(limit.interval_s, limit.burst) if limit else None
        self.headers = config.headers

    def admit(self, authorization: str | None) -> Admission:
        """Rate limit first, then basic auth, in the toolkit's order."""
        if self.limiter is not None and not self.limiter.allow():
            return Admission.RATE_LIMITED
        if self.auth is not None and self.auth.check(authorization) is None:
            return Admission.UNAUTHORIZED
        return Admission.ALLOW

    def peer_allowed(self, peer: Mapping[str, Any] | None) -> bool:
        """Whether a TLS client passes ``client_allowed_sans`` (always, when unset)."""
        return not self.allowed_sans or peer_has_allowed_san(peer, self.allowed_sans)
