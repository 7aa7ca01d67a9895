"""A throwaway PKI for TLS tests, made with ``cryptography``: CAs, server and client certs."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

Issuer = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def make_cert(
    cn: str,
    issuer: Issuer | None = None,
    *,
    ca: bool = False,
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
    client: bool = False,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    serial: int | None = None,
) -> Issuer:
    """A certificate and its key; self-signed when ``issuer`` is None."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    signer_name, signer_key = (issuer[0].subject, issuer[1]) if issuer else (name, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(signer_name)
        .public_key(key.public_key())
        .serial_number(serial if serial is not None else x509.random_serial_number())
        .not_valid_before(not_before or now - dt.timedelta(minutes=5))
        .not_valid_after(not_after or now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True)
    else:
        purpose = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
    return builder.sign(signer_key, hashes.SHA256()), key


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_pair(directory: Path, stem: str, pair: Issuer, *, cert_suffix: str = ".crt") -> None:
    """``stem.crt`` (or ``stem`` + ``cert_suffix``) and ``stem.key`` in ``directory``."""
    (directory / f"{stem}{cert_suffix}").write_bytes(cert_pem(pair[0]))
    (directory / f"{stem}.key").write_bytes(key_pem(pair[1]))


def server_for_localhost(ca: Issuer, **kwargs: object) -> Issuer:
    return make_cert("localhost", ca, dns=("localhost",), ips=("127.0.0.1",), **kwargs)  # type: ignore[arg-type]
