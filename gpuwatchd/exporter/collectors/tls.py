"""``gpuwatchd_tls_certificate_expiry_timestamp_seconds``: when each served certificate expires.

One series per certificate in the served chain (leaf first), labelled with the file it
came from, its subject CN and serial number, so an alert can fire days before scrapes
start failing (``... - time() < 14 * 86400``). Absent while the server speaks plain HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from gpuwatchd.exporter.web.security import WebSecurity


class TlsCertificateCollector:
    """Reads the HTTP server's live web config, so a reload shows the renewed certificate."""

    def __init__(self, security: Callable[[], WebSecurity | None]) -> None:
        self._security = security

    def collect(self) -> Iterator[Metric]:
        security = self._security()
        if security is None or not security.certificates:
            return
        family = GaugeMetricFamily(
            "gpuwatchd_tls_certificate_expiry_timestamp_seconds",
            "Unix time at which a TLS certificate served by the HTTP endpoint expires "
            "(its notAfter).",
            labels=("cert", "subject_cn", "serial_number"),
            unit="seconds",
        )
        for cert in security.certificates:
            family.add_metric([cert.source, cert.subject_cn, cert.serial_number], cert.not_after)
        yield family
