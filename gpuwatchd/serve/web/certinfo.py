# Hand-written: the daemon needs three fields of a certificate, and its only X.509 parser
# dependency would be `cryptography` (a test-only dependency here); DER is small to walk.
"""Expiry, serial number and subject CN of the PEM certificates the HTTP server serves.

The server exports each certificate's expiry as a metric and warns in the log when one
has expired or soon will, as exporters commonly do: an expired certificate is otherwise
served silently until every scrape fails.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import re
from dataclasses import dataclass

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.S)
_SEQUENCE, _SET, _INTEGER, _OID = 0x30, 0x31, 0x02, 0x06
_UTC_TIME, _GENERALIZED_TIME = 0x17, 0x18
_EXPLICIT_VERSION = 0xA0
_COMMON_NAME_OID = bytes([0x55, 0x04, 0x03])  # 2.5.4.3


@dataclass(frozen=True, slots=True)
class CertInfo:
    """One certificate of a served chain: who it names and when it expires."""

    source: str  # the file it came from, or "tls_server_config.cert" when inline
    subject_cn: str
    serial_number: str  # upper-case hex without leading zeros
    not_after: float  # Unix seconds

    def seconds_left(self, now: float) -> float:
        return self.not_after - now

    @property
    def expiry(self) -> str:
        """``not_after`` as messages show it: ``2026-01-31 12:00 UTC``."""
        return dt.datetime.fromtimestamp(self.not_after, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")

    @property
    def shown(self) -> str:
        """How messages name it: subject, serial number and file."""
        return f"TLS certificate {self.subject_cn!r} (serial {self.serial_number}, {self.source})"


def refuse_expired(certificates: tuple[CertInfo, ...], now: float) -> None:
    """ValueError naming the first certificate past its expiry, its file and the date.

    ``check-config`` asks: the daemon serves an expired certificate with a WARNING (its
    metrics stay up), but a config check that says OK for one hides what clients refuse.
    """
    for cert in certificates:
        if cert.seconds_left(now) <= 0:
            raise ValueError(f"{cert.shown} expired at {cert.expiry}; renew it")


def read_certificates(pem: bytes, source: str) -> tuple[CertInfo, ...]:
    """Every certificate in a PEM bundle, leaf first; ValueError if one is not X.509 DER."""
    found = []
    for index, match in enumerate(_PEM_CERT.finditer(pem)):
        try:
            der = base64.b64decode(b"".join(match.group(1).split()), validate=True)
            found.append(_parse(der, source))
        except (binascii.Error, ValueError, IndexError) as exc:
            raise ValueError(f"{source}: certificate {index + 1} is not valid X.509") from exc
    return tuple(found)


def _tlv(data: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of value, end of value) of the DER element at ``pos``."""
    tag = data[pos]
    length = data[pos + 1]
    pos += 2
    if length & 0x80:
        count = length & 0x7F
        if not 1 <= count <= 4:
            raise ValueError("unsupported DER length")
        length = int.from_bytes(data[pos : pos + count], "big")
        pos += count
    end = pos + length
    if end > len(data):
        raise ValueError("DER element runs past the end")
    return tag, pos, end


def _expect(data: bytes, pos: int, tag: int) -> tuple[int, int]:
    got, start, end = _tlv(data, pos)
    if got != tag:
        raise ValueError(f"expected DER tag {tag:#x}, got {got:#x}")
    return start, end


def _parse(der: bytes, source: str) -> CertInfo:
    cert_start, _ = _expect(der, 0, _SEQUENCE)
    pos, _ = _expect(der, cert_start, _SEQUENCE)  # tbsCertificate
    if der[pos] == _EXPLICIT_VERSION:
        pos = _tlv(der, pos)[2]
    serial_start, pos = _expect(der, pos, _INTEGER)
    serial = format(int.from_bytes(der[serial_start:pos], "big"), "X")
    pos = _expect(der, pos, _SEQUENCE)[1]  # signature algorithm
    pos = _expect(der, pos, _SEQUENCE)[1]  # issuer
    validity_start, pos = _expect(der, pos, _SEQUENCE)
    not_before_end = _tlv(der, validity_start)[2]
    not_after = _time(der, not_before_end)
    subject_start, subject_end = _expect(der, pos, _SEQUENCE)
    return CertInfo(source, _common_name(der, subject_start, subject_end), serial, not_after)


def _time(der: bytes, pos: int) -> float:
    tag, start, end = _tlv(der, pos)
    text = der[start:end].decode("ascii")
    if tag == _UTC_TIME:  # YYMMDDHHMMSSZ; RFC 5280: YY >= 50 is 19YY
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    elif tag != _GENERALIZED_TIME:
        raise ValueError("validity is not a UTCTime or GeneralizedTime")
    when = dt.datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=dt.UTC)
    return when.timestamp()


def _common_name(der: bytes, pos: int, end: int) -> str:
    """The last CN of a Name (the most specific), or "" when it has none."""
    name = ""
    while pos < end:
        rdn_start, rdn_end = _expect(der, pos, _SET)
        attr = rdn_start
        while attr < rdn_end:
            atv_start, atv_end = _expect(der, attr, _SEQUENCE)
            oid_start, oid_end = _expect(der, atv_start, _OID)
            if der[oid_start:oid_end] == _COMMON_NAME_OID:
                _, value_start, value_end = _tlv(der, oid_end)
                name = der[value_start:value_end].decode("utf-8", errors="replace")
            attr = atv_end
        pos = rdn_end
    return name
