"""TLS for the HTTP endpoint: Go ``crypto/tls`` names mapped to Python's :mod:`ssl`.

:func:`build_ssl_context` turns a validated ``tls_server_config`` into a server
SSLContext, reading every certificate and key file each time it runs: the HTTP server
calls it again on a reload (SIGHUP), which is how renewed certificates are picked up.
Where :mod:`ssl` cannot do what Go does, the web config refuses the setting or
:mod:`gpuwatchd.serve.web.config` states the difference.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import ssl
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatchd.serve.web.certinfo import CertInfo, read_certificates
from gpuwatchd.validate import one_line


class ClientAuth(enum.StrEnum):
    """``client_auth_type`` values, named as Go's ``tls.ClientAuthType``."""

    NO_CLIENT_CERT = "NoClientCert"
    REQUEST_CLIENT_CERT = "RequestClientCert"
    REQUIRE_ANY_CLIENT_CERT = "RequireAnyClientCert"
    VERIFY_CLIENT_CERT_IF_GIVEN = "VerifyClientCertIfGiven"
    REQUIRE_AND_VERIFY_CLIENT_CERT = "RequireAndVerifyClientCert"


#: Older spellings the toolkit still accepts.
CLIENT_AUTH_ALIASES = {"RequireClientCert": ClientAuth.REQUIRE_ANY_CLIENT_CERT}
#: What :mod:`ssl` does for each servable ``client_auth_type``.
VERIFY_MODES = {
    ClientAuth.NO_CLIENT_CERT: ssl.CERT_NONE,
    ClientAuth.REQUEST_CLIENT_CERT: ssl.CERT_NONE,
    ClientAuth.VERIFY_CLIENT_CERT_IF_GIVEN: ssl.CERT_OPTIONAL,
    ClientAuth.REQUIRE_AND_VERIFY_CLIENT_CERT: ssl.CERT_REQUIRED,
}
#: ``min_version``/``max_version`` names.
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
#: Go's ``tls.CipherSuites()`` names -> OpenSSL names. ``None``: a TLS 1.3 suite, which
#: neither Go nor OpenSSL's cipher list lets a server configure; accepted, no effect.
CIPHERS: dict[str, str | None] = {
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
#: ``curve_preferences`` names -> OpenSSL curve names.
CURVES = {
    "CurveP256": "prime256v1",
    "CurveP384": "secp384r1",
    "CurveP521": "secp521r1",
    "X25519": "X25519",
}


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
class TlsMaterial:
    """What one read of the files gave: the context, and the certificates it serves."""

    context: ssl.SSLContext
    certificates: tuple[CertInfo, ...]


def build_ssl_context(tls: TlsServerConfig) -> ssl.SSLContext:
    """A server-side SSLContext for ``tls``; reads every file it names now.

    Raises ValueError naming the key: ``tls_server_config.cert_file: cannot read /x: ...``.
    """
    return load_tls(tls).context


def load_tls(tls: TlsServerConfig) -> TlsMaterial:
    """:func:`build_ssl_context` plus the served certificates' facts, from one read."""
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
    openssl_ciphers = [c for c in (CIPHERS[n] for n in tls.cipher_suites) if c]
    if openssl_ciphers:
        try:
            ctx.set_ciphers(":".join(openssl_ciphers))
        except ssl.SSLError:
            raise ValueError(f"{where}.cipher_suites: this OpenSSL offers none of them") from None
    if tls.curve_preferences:
        ctx.set_ecdh_curve(CURVES[tls.curve_preferences[0]])
    ctx.verify_mode = VERIFY_MODES[tls.client_auth_type]
    if ctx.verify_mode != ssl.CERT_NONE and tls.client_ca_file is None and tls.client_ca is None:
        ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)  # Go's fallback: the system roots
    if tls.client_ca_file is not None or tls.client_ca is not None:
        ca = _pem(tls.client_ca_file, tls.client_ca, "client_ca")
        ca_where = _source(tls.client_ca_file, "client_ca")
        if b"-----BEGIN CERTIFICATE-----" not in ca:
            raise ValueError(f"{ca_where}: no PEM certificate found")
        try:
            ctx.load_verify_locations(cadata=ca.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as exc:
            raise ValueError(f"{ca_where}: invalid CA certificate: {_ssl_reason(exc)}") from None
    source = str(tls.cert_file) if tls.cert_file is not None else f"{where}.cert"
    return TlsMaterial(ctx, read_certificates(cert, source))


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
    return one_line(exc)


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
