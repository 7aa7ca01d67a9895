"""exporter-toolkit's verdicts on web configs, case by case, with configs of our own.

Every case of the toolkit's web/testdata suite has a config here (tests/data/webconfig):
``*.good.yml`` must pass ``gpuwatchd check-config --web-config`` (the toolkit loads it and
serves), ``*.bad.yml`` must fail with one line (the toolkit refuses to load or to serve
it), and ``*.python-exception.yml`` (RequireAnyClientCert, which Python's ssl module cannot
serve) must fail naming that reason, as README's TLS section says. Certificates are made
here; ``@SERVER_CERT@``/``@SERVER_KEY@``/``@HASH@`` in a file are filled in. The second half
serves the configs and checks the behaviour the toolkit's server tests check.
"""

from __future__ import annotations

import base64
import http.client
import ssl
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
from builders import DAEMON_INFO, board_of, full_h200
from tls_pki import cert_pem, key_pem, make_cert, server_for_localhost, write_pair

from gpuwatchd.cli.main import main
from gpuwatchd.exporter import build_registry
from gpuwatchd.serve import HttpServer
from gpuwatchd.serve.web.config import load_web_config

DATA = Path(__file__).parent / "data" / "webconfig"
CASES = sorted(p.name for p in DATA.glob("*.yml"))
PASSWORD = "correct horse"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case file next to the certificates it names, placeholders filled in."""
    root = tmp_path_factory.mktemp("webconfig")
    server_ca = make_cert("test server ca", ca=True)
    client_ca = make_cert("test client ca", ca=True)
    server = server_for_localhost(server_ca)
    write_pair(root, "server", server)
    write_pair(root, "server-ca", server_ca, cert_suffix=".pem")
    write_pair(root, "client-ca", client_ca, cert_suffix=".pem")
    write_pair(root, "client", make_cert("scraper", client_ca, dns=("scraper.test",), client=True))
    inline = {
        "@SERVER_CERT@": textwrap.indent(cert_pem(server[0]).decode(), "    ").rstrip("\n"),
        "@SERVER_KEY@": textwrap.indent(key_pem(server[1]).decode(), "    ").rstrip("\n"),
        "@HASH@": HASH,
    }
    for name in CASES:
        text = (DATA / name).read_text()
        for marker, value in inline.items():
            text = text.replace(marker, value)
        (root / name).write_text(text)
    return root


def test_every_toolkit_case_has_a_config() -> None:
    kinds = {name.split(".")[-2] for name in CASES}
    assert kinds == {"good", "bad", "python-exception"}
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("worker_has_everything")
def test_check_config_gives_the_toolkit_verdict(
    configs: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["check-config", "--web-config", str(configs / name)])
    out, err = capsys.readouterr()
    kind = name.split(".")[-2]
    if kind == "good":  # valid; what is unwise (no client CA, basic auth without TLS) warned
        warnings = err.splitlines()
        assert code == 0, err
        prefix = f"gpuwatchd: warning: web config {configs / name}: "
        assert all(w.startswith(prefix) for w in warnings), err
        counted = f", with {len(warnings)} warning{'s' if len(warnings) > 1 else ''}"
        assert out.splitlines()[0].endswith(": OK" + (counted if warnings else ""))
        return
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"gpuwatchd: web config {configs / name}: ")
    if kind == "python-exception":
        assert "RequireAnyClientCert" in err and "Python's ssl module" in err


def test_a_missing_file_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--web-config", "/no/such/web-config.yml"]) == 2
    assert "cannot read: No such file" in capsys.readouterr().err


# -- serving, as the toolkit's server tests do -------------------------------------------


@pytest.fixture
def serve(configs: Path) -> Iterator[object]:
    servers: list[HttpServer] = []
    board = board_of(full_h200())

    def start(name: str) -> HttpServer:
        config = load_web_config(configs / name)
        srv = HttpServer(
            board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0), web_config=config
        )
        srv.start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


def client(
    configs: Path,
    *,
    cert: bool = False,
    ciphers: str | None = None,
    curve: str | None = None,
    max_version: ssl.TLSVersion | None = None,
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(configs / "server-ca.pem"))
    if cert:
        ctx.load_cert_chain(configs / "client.crt", configs / "client.key")
    if ciphers:
        ctx.set_ciphers(ciphers)
    if curve:
        ctx.set_ecdh_curve(curve)
    if max_version:
        with warnings.catch_warnings():  # TLS 1.1 is deprecated: that is the point
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx.maximum_version = max_version
    return ctx


def get(
    srv: HttpServer, ctx: ssl.SSLContext | None, headers: dict[str, str] | None = None
) -> tuple[int, http.client.HTTPMessage, str | None]:
    """Status, headers and the negotiated cipher of GET /healthz."""
    host, port = srv.address
    conn = (
        http.client.HTTPSConnection(host, port, timeout=5, context=ctx)
        if ctx is not None
        else http.client.HTTPConnection(host, port, timeout=5)
    )
    try:
        conn.request("GET", "/healthz", headers=headers or {})
        response = conn.getresponse()
        response.read()
        sock = conn.sock
        negotiated = sock.cipher() if isinstance(sock, ssl.SSLSocket) else None
        return response.status, response.headers, negotiated[0] if negotiated else None
    finally:
        conn.close()


REFUSED = (ssl.SSLError, ConnectionError, http.client.HTTPException)


def test_verify_if_given_without_ca_checks_against_system_roots(serve, configs: Path) -> None:
    srv = serve("tls-verify-if-given-no-ca.good.yml")
    assert get(srv, client(configs))[0] == 200  # no certificate: fine
    with pytest.raises(REFUSED):
        get(srv, client(configs, cert=True))  # ours is not trusted by the system


def test_require_and_verify_without_ca_blocks_untrusted_clients(serve, configs: Path) -> None:
    srv = serve("tls-require-and-verify-no-ca.good.yml")
    for ctx in (client(configs), client(configs, cert=True)):
        with pytest.raises(REFUSED):
            get(srv, ctx)


def test_require_and_verify_with_ca(serve, configs: Path) -> None:
    srv = serve("tls-require-and-verify-ca.good.yml")
    assert get(srv, client(configs, cert=True))[0] == 200
    with pytest.raises(REFUSED):
        get(srv, client(configs))


def test_client_allowed_sans(serve, configs: Path) -> None:
    assert get(serve("tls-client-san-listed.good.yml"), client(configs, cert=True))[0] == 200
    with pytest.raises(REFUSED):
        get(serve("tls-client-san-not-listed.good.yml"), client(configs, cert=True))


def test_cipher_lists_and_who_chooses(serve, configs: Path) -> None:
    both = "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-ECDSA-AES128-GCM-SHA256"
    server_order = serve("tls12-two-ciphers.good.yml")
    assert get(server_order, client(configs, ciphers=both))[2] == "ECDHE-ECDSA-AES128-GCM-SHA256"
    client_order = serve("tls12-two-ciphers-client-order.good.yml")
    assert get(client_order, client(configs, ciphers=both))[2] == "ECDHE-ECDSA-AES256-GCM-SHA384"
    with pytest.raises(REFUSED):  # no common cipher
        get(server_order, client(configs, ciphers="ECDHE-ECDSA-CHACHA20-POLY1305"))
    assert get(serve("tls-every-cipher.good.yml"), client(configs))[0] == 200
    http2_off = serve("tls12-no-http2-cipher-http2-off.good.yml")
    assert get(http2_off, client(configs))[2] == "ECDHE-ECDSA-AES256-GCM-SHA384"


def test_curves(serve, configs: Path) -> None:
    srv = serve("tls13-one-curve.good.yml")
    assert get(srv, client(configs, curve="secp384r1"))[0] == 200
    with pytest.raises(REFUSED):  # no common curve
        get(srv, client(configs, curve="X25519"))
    assert get(serve("tls-every-curve.good.yml"), client(configs))[0] == 200


def test_old_tls_clients_are_refused(serve, configs: Path) -> None:
    srv = serve("tls-verify-if-given-no-ca.good.yml")
    with pytest.raises(REFUSED):
        get(srv, client(configs, max_version=ssl.TLSVersion.TLSv1_1))


def test_inline_certificate_and_key(serve, configs: Path) -> None:
    assert get(serve("tls-inline-cert-and-key.good.yml"), client(configs))[0] == 200


def test_plain_http_on_the_tls_port_gets_a_clear_400(serve, configs: Path) -> None:
    srv = serve("users-tls.good.yml")
    assert get(srv, None)[0] == 400


def test_configured_headers_are_sent_as_written(serve) -> None:
    status, headers, _ = get(serve("headers.good.yml"), None)
    assert status == 200
    assert headers["X-XSS-Protection"] == "1"  # YAML's number 1, as Go reads it: text
    assert headers["X-Frame-Options"] == "sameorigin"
    assert headers["Content-Security-Policy"] == "default-src 'self'"


def test_rate_limits(serve) -> None:
    assert [get(serve("rate-limit-off.good.yml"), None)[0] for _ in range(3)] == [200] * 3
    assert get(serve("rate-limit-no-burst.good.yml"), None)[0] == 429  # burst 0 admits none


def test_basic_auth_users(serve) -> None:
    srv = serve("users-plain.good.yml")
    assert get(srv, None)[0] == 401
    token = base64.b64encode(f"ben:{PASSWORD}".encode()).decode()
    assert get(srv, None, {"Authorization": f"Basic {token}"})[0] == 200
