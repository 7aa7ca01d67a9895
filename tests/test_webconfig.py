"""Web config (exporter-toolkit format): parsing, TLS, client certificates, basic auth.

Server tests use a real TLS client (ssl + http.client) against the real HttpServer, with a
throwaway PKI made here by the ``cryptography`` package.
"""

from __future__ import annotations

import base64
import datetime as dt
import http.client
import ipaddress
import json
import socket
import ssl
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from builders import DAEMON_INFO, board_of, full_h200
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpuwatchd.exporter import build_registry
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.serve import HttpServer
from gpuwatchd.serve.http import Limits
from gpuwatchd.serve.web import auth as webauth
from gpuwatchd.serve.web.auth import WWW_AUTHENTICATE, BasicAuth, parse_basic_credentials
from gpuwatchd.serve.web.config import (
    WebConfig,
    load_web_config,
    parse_go_duration,
    parse_web_config,
)
from gpuwatchd.serve.web.ratelimit import RateLimiter
from gpuwatchd.serve.web.security import Admission, WebSecurity
from gpuwatchd.serve.web.tls import ClientAuth

PASSWORD = "s3cret pass"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


# -- a throwaway PKI -------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    sans: list[x509.GeneralName] | None = None,
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    issuer_name = issuer[0].subject if issuer else _name(subject)
    signer = issuer[1] if issuer else key
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    if issuer:
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer[1].public_key())
        builder = builder.add_extension(aki, critical=False)
    if ca:
        usage_ext = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage_ext, critical=True)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(signer, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    dir: Path

    def path(self, name: str) -> Path:
        return self.dir / name


def _write(pki_dir: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey):
    (pki_dir / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (pki_dir / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """ca, server (127.0.0.1), client (CN scraper), other-ca, rogue client, server2 by other-ca."""
    root = tmp_path_factory.mktemp("pki")
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in ("ca", "other", "s", "c", "r")}
    ca = _cert("test ca", keys["ca"], None, ca=True)
    other = _cert("other ca", keys["other"], None, ca=True)
    server_sans: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.DNSName("localhost"),
    ]
    server = _cert(
        "server",
        keys["s"],
        (ca, keys["ca"]),
        sans=server_sans,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
    )
    server2 = _cert(
        "server2",
        keys["s"],
        (other, keys["other"]),
        sans=server_sans,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
    )
    client_sans: list[x509.GeneralName] = [
        x509.DNSName("scraper.example.org"),
        x509.IPAddress(ipaddress.ip_address("2001:db8::1")),
    ]
    client = _cert(
        "scraper",
        keys["c"],
        (ca, keys["ca"]),
        sans=client_sans,
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
    )
    rogue = _cert("rogue", keys["r"], (other, keys["other"]), usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    for name, cert, key in (
        ("ca", ca, keys["ca"]),
        ("other-ca", other, keys["other"]),
        ("server", server, keys["s"]),
        ("server2", server2, keys["s"]),
        ("client", client, keys["c"]),
        ("rogue", rogue, keys["r"]),
    ):
        _write(root, name, cert, key)
    return Pki(root)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "web-config.yml"
    path.write_text(textwrap.dedent(text))
    return path


def tls_yaml(pki: Pki, extra: str = "", *, cert: str = "server") -> str:
    return (
        "tls_server_config:\n"
        f"  cert_file: {pki.path(cert + '.pem')}\n"
        f"  key_file: {pki.path(cert + '.key')}\n" + textwrap.indent(textwrap.dedent(extra), "  ")
    )


# -- client helpers --------------------------------------------------------------------


def client_ctx(
    pki: Pki,
    *,
    ca: str = "ca",
    cert: str | None = None,
    max_version: ssl.TLSVersion | None = None,
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.path(f"{ca}.pem")))
    if cert:
        ctx.load_cert_chain(pki.path(f"{cert}.pem"), pki.path(f"{cert}.key"))
    if max_version:
        ctx.maximum_version = max_version
    return ctx


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def get(
    srv: HttpServer,
    path: str = "/healthz",
    *,
    ctx: ssl.SSLContext | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    host, port = srv.address
    conn: http.client.HTTPConnection
    if ctx is None:
        conn = http.client.HTTPConnection(host, port, timeout=5)
    else:
        conn = http.client.HTTPSConnection(host, port, timeout=5, context=ctx)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


@pytest.fixture
def board() -> StateBoard:
    return board_of(full_h200())


@pytest.fixture
def serve(board: StateBoard) -> Iterator[Any]:
    servers: list[HttpServer] = []

    def start(config: WebConfig | None) -> HttpServer:
        srv = HttpServer(
            board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0), web_config=config
        )
        srv.start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


# -- parsing ---------------------------------------------------------------------------

TOOLKIT_EXAMPLE = """\
# TLS and basic authentication configuration example.
#
# Additionally, a certificate and a key file are needed.
tls_server_config:
  cert_file: server.pem
  key_file: server.key

# Usernames and passwords required to connect.
basic_auth_users:
  alice: $2y$10$mDwo.lAisC94iLAyP81MCesa29IzH37oigHC/42V2pdJlUprsJPze
  bob: $2y$10$hLqFl9jSjoAAy95Z/zw8Ye8wkdMBM8c5Bn1ptYqP/AXyV0.oy0S8m

# Rate limiting requests on the endpoint using a token bucket
rate_limit:
  interval: "1s"
  burst: 20
"""


def test_toolkit_example_file_loads_with_paths_relative_to_it(pki: Pki) -> None:
    cfg = load_web_config(write_config(pki.dir, TOOLKIT_EXAMPLE))
    assert cfg.tls is not None
    assert cfg.tls.cert_file == pki.path("server.pem")  # next to the file, not the cwd
    assert cfg.tls.client_auth_type is ClientAuth.NO_CLIENT_CERT
    assert cfg.tls.min_version is ssl.TLSVersion.TLSv1_2
    assert cfg.tls.max_version is ssl.TLSVersion.TLSv1_3
    assert sorted(cfg.basic_auth_users) == ["alice", "bob"]
    assert cfg.rate_limit is not None and cfg.rate_limit.interval_s == 1.0
    assert cfg.rate_limit.burst == 20
    assert "$2y$" not in repr(cfg)  # hashes stay out of logs


def test_full_tls_section_and_headers(pki: Pki, tmp_path: Path) -> None:
    text = tls_yaml(
        pki,
        f"""\
        client_auth_type: RequireAndVerifyClientCert
        client_ca_file: {pki.path("ca.pem")}
        client_allowed_sans: [scraper.example.org]
        min_version: TLS13
        max_version: TLS13
        cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256]
        prefer_server_cipher_suites: false
        curve_preferences: [X25519, CurveP256]
        """,
    )
    text += "http_server_config:\n  http2: false\n  headers:\n    X-Frame-Options: deny\n"
    text += "    Strict-Transport-Security: max-age=31536000\n    X-XSS-Protection: ''\n"
    cfg = load_web_config(write_config(tmp_path, text))
    assert cfg.tls is not None and cfg.tls.min_version is ssl.TLSVersion.TLSv1_3
    assert cfg.tls.client_allowed_sans == ("scraper.example.org",)
    assert cfg.tls.curve_preferences == ("X25519", "CurveP256")
    assert cfg.tls.prefer_server_cipher_suites is False and cfg.http2 is False
    assert cfg.headers == (
        ("X-Frame-Options", "deny"),
        ("Strict-Transport-Security", "max-age=31536000"),
    )  # blank means unset


@pytest.mark.parametrize("text", ["", "# nothing\n", "tls_server_config:\n  min_version: TLS13\n"])
def test_no_tls_keys_means_plain_http(tmp_path: Path, text: str) -> None:
    cfg = load_web_config(write_config(tmp_path, text))
    assert cfg.tls is None and not cfg.basic_auth_users and cfg.rate_limit is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tls_config: {}\n", "tls_config: unknown key (expected one of tls_server_config"),
        ("tls_server_config:\n  certfile: x\n", "tls_server_config.certfile: unknown key"),
        ("http_server_config:\n  http3: true\n", "http_server_config.http3: unknown key"),
        ("rate_limit:\n  every: 1s\n", "rate_limit.every: unknown key"),
        ("- a\n- b\n", "web config: expected a mapping, got list"),
        ("basic_auth_users: [alice]\n", "basic_auth_users: expected a mapping, got list"),
        ("basic_auth_users:\n  alice: hunter2\n", "basic_auth_users.alice: not a bcrypt hash"),
        ("basic_auth_users:\n  bob: 12\n", "basic_auth_users.bob: not a bcrypt hash"),
        ("basic_auth_users:\n  bob: [x]\n", "basic_auth_users.bob: expected a bcrypt hash"),
        (f"basic_auth_users:\n  [a]: {HASH}\n", "invalid YAML"),
        (f"basic_auth_users:\n  'a:b': {HASH}\n", "basic_auth_users.a:b: a user name cannot"),
        (
            "basic_auth_users:\n  eve: $2y$03$" + "a" * 53 + "\n",
            "basic_auth_users.eve: bcrypt cost 3 is outside 4-31",
        ),
        ("tls_server_config:\n  cert_file: a.pem\n", "missing one of key or key_file"),
        ("tls_server_config:\n  key_file: a.key\n", "missing one of cert or cert_file"),
        (
            "tls_server_config:\n  cert_file: a\n  cert: x\n  key_file: k\n",
            "tls_server_config: give cert or cert_file, not both",
        ),
        (
            "tls_server_config:\n  cert_file: a\n  key_file: k\n  client_auth_type: Always\n",
            "tls_server_config.client_auth_type: 'Always' is not one of NoClientCert,",
        ),
        (
            "tls_server_config:\n  cert_file: a\n  key_file: k\n  client_auth_type: "
            "RequireAnyClientCert\n  client_ca_file: ca\n",
            "RequireAnyClientCert (any certificate, unverified) cannot be served",
        ),
        (
            "tls_server_config:\n  cert_file: a\n  key_file: k\n  client_ca_file: ca\n",
            "client_ca_file is set but client_auth_type is NoClientCert",
        ),
        (
            "tls_server_config:\n  cert_file: a\n  key_file: k\n  client_auth_type: "
            "RequestClientCert\n  client_allowed_sans: [x]\n",
            "client_allowed_sans: Python's ssl module cannot read the SANs",
        ),
        (
            "tls_server_config:\n  cert_file: a\n  key_file: k\n  max_version: TLS12\n"
            "  cipher_suites: [TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384]\n",
            "cipher_suites: missing an HTTP/2-required cipher",
        ),
        (
            "tls_server_config:\n  cert_file: a\n  key_file: k\n  min_version: TLS14\n",
            "tls_server_config.min_version: unknown TLS version 'TLS14'",
        ),
        (
            "tls_server_config:\n  cert_file: a\n  key_file: k\n  min_version: TLS13\n"
            "  max_version: TLS12\n",
            "tls_server_config.min_version: TLS13 is above max_version",
        ),
        (
            "tls_server_config:\n  cert_file: a\n  key_file: k\n  cipher_suites: [RC4]\n",
            "tls_server_config.cipher_suites: unknown cipher 'RC4'",
        ),
        (
            "tls_server_config:\n  cert_file: a\n  key_file: k\n  curve_preferences: [P256]\n",
            "tls_server_config.curve_preferences: unknown curve 'P256'",
        ),
        (
            "tls_server_config:\n  cert_file: a\n  key_file: k\n  prefer_server_cipher_suites: 1\n",
            "prefer_server_cipher_suites: expected true or false",
        ),
        (
            "tls_server_config:\n  cert_file: [7]\n",
            "tls_server_config.cert_file: expected a string",
        ),
        ("rate_limit:\n  interval: 1s\n  burst: lots\n", "rate_limit.burst: expected an integer"),
        ("http_server_config:\n  http2: 1\n", "http_server_config.http2: expected true or false"),
        (
            "http_server_config:\n  headers:\n    Server: x\n",
            "http_server_config.headers.Server: this header cannot be configured",
        ),
        (
            "http_server_config:\n  headers:\n    X-Frame-Options: allow\n",
            "X-Frame-Options: 'allow' is not one of deny, sameorigin",
        ),
        ("rate_limit:\n  interval: 1 sec\n  burst: 1\n", "rate_limit.interval: '1 sec' is not"),
        ("rate_limit:\n  interval: 1s\n  burst: -2\n", "rate_limit.burst: expected a non-neg"),
        ("basic_auth_users:\n  a: x\n  a: y\n", "invalid YAML at line 3, column 3: duplicate key"),
        ("tls_server_config: [\n", "invalid YAML"),
    ],
)
def test_bad_files_give_one_line_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = write_config(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_web_config(path)
    error = str(info.value)
    assert message in error and "\n" not in error
    assert error.startswith(f"web config {path}: ")


def test_unreadable_files_are_named(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ValueError, match=r"web config /nope\.yml: cannot read: No such file"):
        load_web_config("/nope.yml")
    cases = {
        "tls_server_config:\n  cert_file: /x.pem\n  key_file: k\n": (
            "tls_server_config.cert_file: cannot read /x.pem: No such file or directory"
        ),
        tls_yaml(pki, "client_auth_type: RequireAndVerifyClientCert\nclient_ca_file: ca.pem\n"): (
            f"tls_server_config.client_ca_file: cannot read {tmp_path / 'ca.pem'}: No such file"
        ),
        f"tls_server_config:\n  cert_file: {pki.path('server.key')}\n"
        f"  key_file: {pki.path('server.key')}\n": (
            f"tls_server_config.cert_file {pki.path('server.key')}: no PEM certificate found"
        ),
        f"tls_server_config:\n  cert_file: {pki.path('server.pem')}\n"
        f"  key_file: {pki.path('client.key')}\n": (
            "tls_server_config: cannot load the certificate and key: KEY_VALUES_MISMATCH"
        ),
    }
    for text, message in cases.items():
        with pytest.raises(ValueError) as info:
            load_web_config(write_config(tmp_path, text))
        assert message in str(info.value) and "\n" not in str(info.value)


def test_encrypted_key_is_refused_without_prompting(tmp_path: Path, pki: Pki) -> None:
    key = serialization.load_pem_private_key(pki.path("server.key").read_bytes(), None)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"),
    )
    (tmp_path / "enc.key").write_bytes(encrypted)
    text = f"tls_server_config:\n  cert_file: {pki.path('server.pem')}\n  key_file: enc.key\n"
    with pytest.raises(ValueError, match=r"key_file .*enc\.key: the key is encrypted"):
        load_web_config(write_config(tmp_path, text))


def test_parse_is_pure_and_hashes_are_validated_by_user() -> None:
    cfg = parse_web_config({"basic_auth_users": {"alice": HASH}}, Path("/etc/gpuwatchd"))
    assert dict(cfg.basic_auth_users) == {"alice": HASH} and cfg.tls is None
    with pytest.raises(ValueError, match=r"^basic_auth_users\.mallory: not a bcrypt hash"):
        parse_web_config({"basic_auth_users": {"mallory": HASH[:-1]}}, Path("/"))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(0, 0.0), ("0", 0.0), ("1s", 1.0), ("250ms", 0.25), ("1m30s", 90.0), ("1.5h", 5400.0)],
)
def test_go_durations(text: object, seconds: float) -> None:
    assert parse_go_duration(text, "x") == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1", "s", "1d", "-1s", True, 1.5, ""])
def test_bad_go_durations(text: object) -> None:
    with pytest.raises(ValueError, match=r"^x: "):
        parse_go_duration(text, "x")


# -- basic auth, unit ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("Basic " + base64.b64encode(b"alice:pa:ss").decode(), ("alice", b"pa:ss")),
        ("basic   " + base64.b64encode("ünï:x".encode()).decode(), ("ünï", b"x")),
        ("Bearer abc", None),
        ("Basic !!!", None),
        ("Basic " + base64.b64encode(b"no-colon").decode(), None),
        (None, None),
    ],
)
def test_parse_basic_credentials(header: str | None, expected: object) -> None:
    assert parse_basic_credentials(header) == expected


def test_bcrypt_runs_once_per_good_password_and_every_time_for_bad(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[bytes] = []
    real = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        calls.append(password)
        return real(password, hashed)

    monkeypatch.setattr(webauth.bcrypt, "checkpw", counting)
    auth = BasicAuth({"alice": HASH})
    good = basic("alice", PASSWORD)["Authorization"]
    assert [auth.check(good) for _ in range(3)] == ["alice"] * 3
    assert len(calls) == 1  # cached after the first success
    assert auth.check(basic("alice", "wrong")["Authorization"]) is None
    assert auth.check(basic("alice", "wrong")["Authorization"]) is None
    assert len(calls) == 3  # failures are never cached
    assert auth.check(basic("nobody", PASSWORD)["Authorization"]) is None
    assert len(calls) == 4  # unknown users still cost a bcrypt (no user enumeration)
    assert auth.check(basic("alice", "x" * 100)["Authorization"]) is None  # > 72 bytes


def test_auth_cache_is_bounded_and_holds_no_password() -> None:
    users = {f"u{i}": HASH for i in range(5)}
    auth = BasicAuth(users, cache_size=3)
    for user in users:
        assert auth.check(basic(user, PASSWORD)["Authorization"]) == user
    assert len(auth.cache) == 3
    assert all(PASSWORD.encode() not in key for key in auth.cache)


def test_rate_limiter_is_a_token_bucket() -> None:
    now = [0.0]
    limiter = RateLimiter(interval_s=1.0, burst=2, clock=lambda: now[0])
    assert [limiter.allow() for _ in range(3)] == [True, True, False]
    now[0] = 0.5
    assert limiter.allow() is False
    now[0] = 1.0
    assert limiter.allow() is True and limiter.allow() is False
    now[0] = 100.0  # refills up to burst, not beyond
    assert [limiter.allow() for _ in range(3)] == [True, True, False]


# -- a real server: TLS ----------------------------------------------------------------


def test_tls_serves_and_plain_http_on_the_tls_port_fails_cleanly(
    pki: Pki, tmp_path: Path, serve: Any
) -> None:
    srv = serve(load_web_config(write_config(tmp_path, tls_yaml(pki))))
    assert srv.tls and srv.url.startswith("https://127.0.0.1:")
    status, _, body = get(srv, ctx=client_ctx(pki))
    assert (status, body) == (200, b"ok\n")
    status, _, body = get(srv)  # plain HTTP: a clear 400, not a hang or garbage
    assert status == 400 and b"HTTP request to an HTTPS server" in body
    with pytest.raises(ssl.SSLCertVerificationError):
        get(srv, ctx=client_ctx(pki, ca="other-ca"))  # the client checks who we are
    status, _, body = get(srv, "/metrics", ctx=client_ctx(pki))
    assert status == 200 and b"gpuwatchd_gpu_temperature_celsius" in body


def test_min_version_is_enforced(pki: Pki, tmp_path: Path, serve: Any) -> None:
    srv = serve(load_web_config(write_config(tmp_path, tls_yaml(pki, "min_version: TLS13\n"))))
    with pytest.raises(ssl.SSLError):
        get(srv, ctx=client_ctx(pki, max_version=ssl.TLSVersion.TLSv1_2))
    assert get(srv, ctx=client_ctx(pki))[0] == 200


def test_cipher_suites_restrict_tls12(pki: Pki, tmp_path: Path, serve: Any) -> None:
    extra = "max_version: TLS12\ncipher_suites: [TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256]\n"
    text = tls_yaml(pki, extra) + "http_server_config:\n  http2: false\n"  # as the toolkit
    srv = serve(load_web_config(write_config(tmp_path, text)))
    host, port = srv.address
    with (
        socket.create_connection((host, port), timeout=5) as raw,
        client_ctx(pki).wrap_socket(raw, server_hostname=host) as tls,
    ):
        assert tls.version() == "TLSv1.2"
        cipher = tls.cipher()
        assert cipher is not None and cipher[0] == "ECDHE-ECDSA-CHACHA20-POLY1305"


def mtls_config(pki: Pki, tmp_path: Path, extra: str = "") -> WebConfig:
    text = tls_yaml(
        pki,
        f"client_auth_type: RequireAndVerifyClientCert\nclient_ca_file: {pki.path('ca.pem')}\n"
        + extra,
    )
    return load_web_config(write_config(tmp_path, text))


def test_required_client_certificate(pki: Pki, tmp_path: Path, serve: Any) -> None:
    srv = serve(mtls_config(pki, tmp_path))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        get(srv, ctx=client_ctx(pki))  # none presented
    with pytest.raises((ssl.SSLError, ConnectionError)):
        get(srv, ctx=client_ctx(pki, cert="rogue"))  # signed by another CA
    status, _, body = get(srv, ctx=client_ctx(pki, cert="client"))
    assert (status, body) == (200, b"ok\n")


def test_client_allowed_sans(pki: Pki, tmp_path: Path, serve: Any) -> None:
    allowed = serve(mtls_config(pki, tmp_path, "client_allowed_sans: ['2001:db8:0::1']\n"))
    assert get(allowed, ctx=client_ctx(pki, cert="client"))[0] == 200  # IPs compared as IPs
    other = serve(mtls_config(pki, tmp_path, "client_allowed_sans: [prometheus.example.org]\n"))
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        get(other, ctx=client_ctx(pki, cert="client"))


def test_slow_handshake_blocks_no_one_and_is_dropped(
    pki: Pki, tmp_path: Path, board: StateBoard
) -> None:
    config = load_web_config(write_config(tmp_path, tls_yaml(pki)))
    registry = build_registry(board, DAEMON_INFO)
    limits = Limits(handshake_timeout_s=0.5)
    with (
        HttpServer(board, registry, ("127.0.0.1", 0), web_config=config, limits=limits) as srv,
        socket.create_connection(srv.address, timeout=5) as silent,  # never sends ClientHello
    ):
        started = time.monotonic()
        assert get(srv, ctx=client_ctx(pki))[0] == 200
        assert time.monotonic() - started < 0.4  # served while the silent one waits
        assert silent.recv(1) == b""  # then the server gives up on it
        assert time.monotonic() - started < 3.0


def test_reload_switches_certificates_for_new_connections(
    pki: Pki, tmp_path: Path, serve: Any
) -> None:
    srv = serve(load_web_config(write_config(tmp_path, tls_yaml(pki))))
    assert get(srv, ctx=client_ctx(pki))[0] == 200
    host, port = srv.address
    kept = http.client.HTTPSConnection(host, port, timeout=5, context=client_ctx(pki))
    kept.request("GET", "/healthz")
    assert kept.getresponse().read() == b"ok\n"

    renewed = tls_yaml(pki, cert="server2") + f"basic_auth_users:\n  alice: {HASH}\n"
    srv.reload_web_config(load_web_config(write_config(tmp_path, renewed)))
    with pytest.raises(ssl.SSLCertVerificationError):
        get(srv, ctx=client_ctx(pki))  # the new certificate is from the other CA
    status, _, _ = get(srv, ctx=client_ctx(pki, ca="other-ca"), headers=basic("alice", PASSWORD))
    assert status == 200
    kept.request("GET", "/healthz")  # an open connection keeps its TLS session...
    assert kept.getresponse().status == 401  # ...but the new users apply at once
    kept.close()

    broken = parse_web_config(
        {"tls_server_config": {"cert_file": "gone.pem", "key_file": "gone.key"}}, tmp_path
    )
    with pytest.raises(ValueError, match=r"^tls_server_config\.cert_file: cannot read"):
        srv.reload_web_config(broken)
    assert get(srv, ctx=client_ctx(pki, ca="other-ca"))[0] == 401  # the running config stays

    srv.reload_web_config(None)  # back to plain, open HTTP
    assert not srv.tls and get(srv)[0] == 200


# -- a real server: basic auth, headers, rate limit -----------------------------------


def test_basic_auth_over_tls(pki: Pki, tmp_path: Path, serve: Any) -> None:
    text = tls_yaml(pki) + f"basic_auth_users:\n  alice: {HASH}\n"
    text += "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"
    srv = serve(load_web_config(write_config(tmp_path, text)))
    ctx = client_ctx(pki)
    for headers in ({}, basic("alice", "wrong"), basic("bob", PASSWORD), {"Authorization": "x"}):
        status, reply, body = get(srv, "/metrics", ctx=ctx, headers=headers)
        assert status == 401 and reply["WWW-Authenticate"] == WWW_AUTHENTICATE
        assert json.loads(body)["error"] == "unauthorized"
        assert b"gpuwatchd_" not in body
        assert reply["X-Content-Type-Options"] == "nosniff"  # on refusals too
    status, reply, body = get(srv, "/metrics", ctx=ctx, headers=basic("alice", PASSWORD))
    assert status == 200 and b"gpuwatchd_gpu_temperature_celsius" in body
    assert reply["X-Content-Type-Options"] == "nosniff"


def test_basic_auth_and_rate_limit_without_tls(tmp_path: Path, serve: Any) -> None:
    text = f"basic_auth_users:\n  alice: {HASH}\nrate_limit:\n  interval: 1h\n  burst: 2\n"
    srv = serve(load_web_config(write_config(tmp_path, text)))
    assert not srv.tls and srv.url.startswith("http://")
    assert get(srv)[0] == 401
    assert get(srv, headers=basic("alice", PASSWORD))[0] == 200
    status, _, body = get(srv, headers=basic("alice", PASSWORD))
    assert status == 429 and json.loads(body)["error"] == "too many requests"


def test_protocol_errors_carry_configured_headers(tmp_path: Path, serve: Any) -> None:
    text = "http_server_config:\n  headers:\n    X-Frame-Options: sameorigin\n"
    srv = serve(load_web_config(write_config(tmp_path, text)))
    with socket.create_connection(srv.address, timeout=5) as sock:
        sock.sendall(b"BREW /metrics HTTP/1.1\r\n\r\n")
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 501 ") and b"X-Frame-Options: sameorigin" in reply


def test_board_is_never_touched_by_refused_requests(tmp_path: Path, board: StateBoard) -> None:
    calls: list[int] = []

    def state_json() -> dict[str, object]:
        calls.append(1)
        return {"ok": True}

    cfg = load_web_config(write_config(tmp_path, f"basic_auth_users:\n  alice: {HASH}\n"))
    with HttpServer(
        board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0), state_json, web_config=cfg
    ) as srv:
        assert get(srv, "/api/v1/state")[0] == 401
        assert calls == []
        assert get(srv, "/api/v1/state", headers=basic("alice", PASSWORD))[0] == 200
        assert calls == [1]


# -- bcrypt under load and across reloads ---------------------------------------------


def test_credentials_stay_verified_across_a_reload_while_the_hash_is_unchanged(
    tmp_path: Path, board: StateBoard, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bytes] = []
    real = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        calls.append(password)
        return real(password, hashed)

    monkeypatch.setattr(webauth.bcrypt, "checkpw", counting)
    other = bcrypt.hashpw(b"new password", bcrypt.gensalt(4)).decode()
    users = f"basic_auth_users:\n  alice: {HASH}\n  bob: {HASH}\n"
    changed = f"basic_auth_users:\n  alice: {other}\n  bob: {HASH}\n"
    registry = build_registry(board, DAEMON_INFO)
    with HttpServer(
        board, registry, ("127.0.0.1", 0), web_config=load_web_config(write_config(tmp_path, users))
    ) as srv:
        assert get(srv, headers=basic("alice", PASSWORD))[0] == 200
        assert get(srv, headers=basic("bob", PASSWORD))[0] == 200
        assert len(calls) == 2
        srv.reload_web_config(load_web_config(write_config(tmp_path, users)))  # SIGHUP, same file
        assert get(srv, headers=basic("alice", PASSWORD))[0] == 200
        assert len(calls) == 2  # still verified: no bcrypt
        srv.reload_web_config(load_web_config(write_config(tmp_path, changed)))
        assert get(srv, headers=basic("bob", PASSWORD))[0] == 200
        assert len(calls) == 2  # bob's hash is unchanged
        assert get(srv, headers=basic("alice", PASSWORD))[0] == 401  # alice's is not
        assert get(srv, headers=basic("alice", "new password"))[0] == 200
        assert len(calls) == 4


def test_a_reload_keeps_the_rate_limiter_while_its_settings_stay(tmp_path: Path) -> None:
    text = "rate_limit:\n  interval: 1m\n  burst: 1\n"
    first = WebSecurity(load_web_config(write_config(tmp_path, text)))
    assert first.admit(None) is Admission.ALLOW
    same = WebSecurity(load_web_config(write_config(tmp_path, text)), first)
    assert same.admit(None) is Admission.RATE_LIMITED  # the spent token stays spent
    looser = text.replace("burst: 1", "burst: 5")
    assert WebSecurity(load_web_config(write_config(tmp_path, looser)), same).admit(None) is (
        Admission.ALLOW
    )


def _flood(address: tuple[str, int], stop: threading.Event, statuses: list[int]) -> None:
    """Wrong passwords back to back from 127.0.0.1 on one kept-alive connection."""
    conn = http.client.HTTPConnection(*address, timeout=10)
    try:
        while not stop.is_set():
            conn.request("GET", "/metrics", headers=basic("alice", "guess"))
            response = conn.getresponse()
            response.read()
            statuses.append(response.status)
    finally:
        conn.close()


def test_a_flood_of_wrong_passwords_leaves_room_for_a_scrapers_first_login(
    tmp_path: Path, board: StateBoard
) -> None:
    slow_hash = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()  # ~70 ms a check
    config = load_web_config(write_config(tmp_path, f"basic_auth_users:\n  alice: {slow_hash}\n"))
    registry = build_registry(board, DAEMON_INFO)
    with HttpServer(board, registry, ("127.0.0.1", 0), web_config=config) as srv:
        stop = threading.Event()
        statuses: list[int] = []
        flood = [
            threading.Thread(target=_flood, args=(srv.address, stop, statuses)) for _ in range(8)
        ]
        for thread in flood:
            thread.start()
        try:
            time.sleep(0.5)
            # The scraper comes from another address (all of 127/8 is loopback on Linux).
            conn = http.client.HTTPConnection(
                *srv.address, timeout=10, source_address=("127.0.0.2", 0)
            )
            conn.request("GET", "/metrics", headers=basic("alice", PASSWORD))
            response = conn.getresponse()
            response.read()
            conn.close()
            flooding = not stop.is_set() and all(t.is_alive() for t in flood)
        finally:
            stop.set()
            for thread in flood:
                thread.join()
    # The scraper got in while the flood went on (how fast is a timing, not this test's).
    assert response.status == 200 and flooding
    assert 401 in statuses and 429 in statuses  # one check at a time per address


def test_one_address_has_one_password_check_in_flight_however_fast_it_asks(
    tmp_path: Path, board: StateBoard
) -> None:
    """Two wrong passwords from one address arriving together: one bcrypt check, one 429."""
    slow_hash = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    config = load_web_config(write_config(tmp_path, f"basic_auth_users:\n  alice: {slow_hash}\n"))
    request = (
        "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {}\r\n\r\n".format(
            basic("alice", "guess")["Authorization"]
        )
    ).encode()
    with HttpServer(
        board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0), web_config=config
    ) as srv:
        conns = [
            socket.create_connection(srv.address, timeout=10, source_address=("127.0.0.3", 0))
            for _ in range(2)
        ]
        try:
            for conn in conns:
                conn.sendall(request)
            firsts = sorted(int(conn.recv(65536).split(b" ", 2)[1]) for conn in conns)
        finally:
            for conn in conns:
                conn.close()
    assert firsts == [401, 429]
