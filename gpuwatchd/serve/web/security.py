"""A web config made live: what the HTTP server checks on each connection and request.

:class:`WebSecurity` bundles the SSL context, the authenticator, the rate limiter and
the extra headers built from one :class:`~gpuwatchd.serve.web.config.WebConfig`; the
server swaps the whole object on a reload, so no request sees half of each config. What
a reload should not forget (verified credentials, the limiter's tokens while its settings
stay) is carried over from the object it replaces.
"""

from __future__ import annotations

import enum
import logging
import ssl
import time
from collections.abc import Mapping
from typing import Any

from gpuwatchd.serve.web.auth import BasicAuth
from gpuwatchd.serve.web.certinfo import CertInfo
from gpuwatchd.serve.web.config import WebConfig
from gpuwatchd.serve.web.ratelimit import RateLimiter
from gpuwatchd.serve.web.tls import VERIFY_MODES, load_tls, peer_has_allowed_san

log = logging.getLogger(__name__)

#: A served certificate this close to expiry is warned about at load and periodically.
EXPIRY_WARNING_S = 14 * 86400.0


def config_warnings(config: WebConfig) -> list[str]:
    """What a valid web config still gets wrong, one line each: the daemon logs them at
    load and ``check-config`` prints them (each is served, as the exporter toolkit would).

    Basic auth over plain HTTP sends passwords in clear text; verifying client
    certificates without ``client_ca_file`` trusts the system's public roots, so any
    publicly issued certificate passes.
    """
    out = []
    tls = config.tls
    if config.basic_auth_users and tls is None:
        out.append(
            "basic_auth_users without tls_server_config: passwords cross the network in"
            " clear text; serve TLS too"
        )
    verifies = tls is not None and VERIFY_MODES[tls.client_auth_type] != ssl.CERT_NONE
    if tls is not None and verifies and tls.client_ca_file is None and tls.client_ca is None:
        out.append(
            f"tls_server_config: client_auth_type {tls.client_auth_type.value} without"
            " client_ca_file trusts the system's public roots (any publicly issued"
            " certificate passes); set client_ca_file"
        )
    return out


def expiry_warnings(certificates: tuple[CertInfo, ...], now: float) -> list[str]:
    """A line per served certificate not yet expired but within :data:`EXPIRY_WARNING_S`
    of it (an expired one is an error for ``check-config``)."""
    return [
        f"{cert.shown} expires at {cert.expiry}, in {cert.seconds_left(now) / 86400:.1f} days;"
        " renew it"
        for cert in certificates
        if 0 < cert.seconds_left(now) <= EXPIRY_WARNING_S
    ]


class Admission(enum.Enum):
    """What the HTTP layer does with a request before routing it."""

    ALLOW = "allow"
    UNAUTHORIZED = "unauthorized"  # 401 with WWW-Authenticate
    RATE_LIMITED = "rate_limited"  # 429


class WebSecurity:
    """A :class:`WebConfig` made live: SSL context, authenticator, limiter, headers.

    Built once per (re)load; the HTTP server swaps the whole object atomically so every
    connection and request sees one consistent config. ``previous`` is the object being
    replaced: its credential cache is kept (an entry only matches while the user's hash
    is unchanged), and so is its limiter when ``rate_limit`` is unchanged.
    """

    def __init__(self, config: WebConfig, previous: WebSecurity | None = None) -> None:
        self.config = config
        tls = config.tls
        material = load_tls(tls) if tls is not None else None
        self.ssl_context = material.context if material is not None else None
        self.certificates: tuple[CertInfo, ...] = material.certificates if material else ()
        verifies = self.ssl_context is not None and self.ssl_context.verify_mode != ssl.CERT_NONE
        self.allowed_sans = tls.client_allowed_sans if tls is not None and verifies else ()
        users = config.basic_auth_users
        old_auth: BasicAuth | None = previous.auth if previous is not None else None
        cache = old_auth.cache if old_auth is not None else None
        self.auth: BasicAuth | None = BasicAuth(users, cache=cache) if users else None
        limit = config.rate_limit
        self.limiter: RateLimiter | None = None
        if limit is not None:
            same = previous is not None and previous.config.rate_limit == limit
            self.limiter = previous.limiter if same and previous is not None else None
            self.limiter = self.limiter or RateLimiter(limit.interval_s, limit.burst)
            if limit.burst == 0:
                log.warning("web config: rate_limit.burst is 0: every request is refused (429)")
        if tls is not None and tls.client_allowed_sans and not verifies:
            log.warning(
                "web config: client_allowed_sans has no effect with client_auth_type %s",
                tls.client_auth_type,
            )
        for line in config_warnings(config):
            log.warning("web config: %s", line)
        self.headers = config.headers

    def admit(self, authorization: str | None) -> Admission:
        """Rate limit first, then basic auth, in the toolkit's order (bcrypt inline)."""
        if self.limiter is not None and not self.limiter.allow():
            return Admission.RATE_LIMITED
        if self.auth is not None and self.auth.check(authorization) is None:
            return Admission.UNAUTHORIZED
        return Admission.ALLOW

    def peer_allowed(self, peer: Mapping[str, Any] | None) -> bool:
        """Whether a TLS client passes ``client_allowed_sans`` (always, when unset)."""
        return not self.allowed_sans or peer_has_allowed_san(peer, self.allowed_sans)

    def warn_about_expiry(self, now: float | None = None) -> int:
        """Log a WARNING per served certificate expired or within 14 days of it; the count."""
        now = time.time() if now is None else now
        warned = 0
        for cert in self.certificates:
            left = cert.seconds_left(now)
            if left > EXPIRY_WARNING_S:
                continue
            if left <= 0:
                log.warning(
                    "%s expired at %s: clients will refuse it; renew it and reload (SIGHUP)",
                    cert.shown,
                    cert.expiry,
                )
            else:
                (line,) = expiry_warnings((cert,), now)
                log.warning("%s", line)
            warned += 1
        return warned
