"""A scripted HTTP(S) server for the JSON readers, and a throwaway CA to serve TLS with."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

#: A route answers (status, body); a dict or list body is sent as JSON.
Route = Callable[[BaseHTTPRequestHandler], tuple[int, Any]]


class JsonServer:
    """Serves ``routes`` by path (404 for the rest) on 127.0.0.1 (``port``, else a free
    one); https with ``tls``.

    A route is looked up by the request's path without its query (see :meth:`route`);
    ``requests`` records each request's full path, ``headers`` its headers.
    """

    def __init__(
        self, routes: dict[str, Route], tls: ssl.SSLContext | None = None, port: int = 0
    ) -> None:
        self.routes = routes
        self.headers: list[dict[str, str]] = []
        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.headers.append(dict(self.headers))
                owner.requests.append(self.path)
                route = owner.route(urlsplit(self.path).path)
                status, body = route(self) if route else (404, b"")
                is_json = isinstance(body, dict | list)
                data = json.dumps(body).encode() if is_json else body
                self.send_response(status)
                if is_json:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def route(self, path: str) -> Route | None:
        """The route serving ``path``; a subclass may answer from other state."""
        return self.routes.get(path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class ScratchCa:
    """A CA file and a server context whose certificate (for 127.0.0.1) that CA signed."""

    ca_file: Path
    server: ssl.SSLContext


def make_scratch_ca(directory: Path) -> ScratchCa:
    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "json test ca")])

    def build(subject: x509.Name, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
        )

    ca = (
        build(ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    cert = (
        build(server_name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    (directory / "server.pem").write_bytes(cert.public_bytes(pem))
    (directory / "server.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(directory / "server.pem", directory / "server.key")
    return ScratchCa(directory / "ca.pem", server)
