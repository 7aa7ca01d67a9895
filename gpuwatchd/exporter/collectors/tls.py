"""``gpuwatchd_tls_certificate_expiry_timestamp_seconds``: when each served certificate expires.

One series per certificate in the served chain (leaf first), labelled with the file it
came from, its subject CN and serial number, so an alert can fire days before scrapes
start failing (``... - time() < 14 * 86400``). Absent while the server speaks plain HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric


class ServedCertificate(Protocol):
    """What the exporter shows of one certificate the HTTP server serves."""

    @property
    def source(self) -> str: ...
    @property
    def subject_cn(self) -> str: ...
    @property
    def serial_number(self) -> str: ...
    @property
    def not_after(self) -> float: ...


class TlsCertificateCollector:
    """Asks the HTTP server for its certificates at each scrape, so a reload shows the
    renewed certificate."""

    runs_inline = True  # the server's loaded certificates: an in-memory tuple

    def __init__(self, certificates: Callable[[], Sequence[ServedCertificate]]) -> None:
        self._certificates = certificates

    def collect(self) -> Iterator[Metric]:
        certificates = self._certificates()
        if not certificates:
            return
        family = GaugeMetricFamily(
            "gpuwatchd_tls_certificate_expiry_timestamp_seconds",
            "Unix time at which a TLS certificate served by the HTTP endpoint expires "
            "(its notAfter).",
            labels=("cert", "subject_cn", "serial_number"),
            unit="seconds",
        )
        for cert in certificates:
            family.add_metric([cert.source, cert.subject_cn, cert.serial_number], cert.not_after)
        yield family
