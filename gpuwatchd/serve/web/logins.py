"""Admission on the HTTP server's event loop, with bcrypt checks on a small thread pool.

A cached credential is admitted on the loop in microseconds. A credential the cache
cannot vouch for costs a bcrypt check (slow on purpose), run on a pool of a few
threads (bcrypt releases the GIL), with at most one check per client address in flight:
a flood of wrong passwords from one address takes one thread and gets 429 for the rest,
so a scraper logging in from another address finds a free thread at once.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from gpuwatchd.serve.web.auth import Attempt
from gpuwatchd.serve.web.security import Admission, WebSecurity

#: Concurrent bcrypt checks: enough that one flood leaves room for scrapers, few enough
#: that a flood from many addresses cannot take every core.
BCRYPT_WORKERS = max(2, min(4, os.cpu_count() or 2))
#: bcrypt checks queued or running at once, over all addresses; more get 429.
MAX_PENDING_CHECKS = 64


class LoginPool:
    """Admits requests for one HTTP server; call it on its event loop only."""

    def __init__(
        self, workers: int = BCRYPT_WORKERS, max_pending: int = MAX_PENDING_CHECKS
    ) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="gpuwatchd-bcrypt")
        self._checking: set[str] = set()  # client addresses with a check in flight
        self._max_pending = max_pending

    def admit_at_once(
        self, security: WebSecurity, authorization: str | None, address: str
    ) -> Admission | Attempt:
        """Rate limit first, then basic auth, in the toolkit's order: the verdict, or the
        attempt a bcrypt check must decide (:meth:`check`)."""
        if security.limiter is not None and not security.limiter.allow():
            return Admission.RATE_LIMITED
        auth = security.auth
        if auth is None:
            return Admission.ALLOW
        attempt = auth.begin(authorization)
        if attempt is None:
            return Admission.UNAUTHORIZED
        if attempt.user is not None:
            return Admission.ALLOW
        if address in self._checking or len(self._checking) >= self._max_pending:
            return Admission.RATE_LIMITED
        return attempt

    def check(
        self, security: WebSecurity, attempt: Attempt, address: str
    ) -> asyncio.Future[str | None]:
        """Start the bcrypt check :meth:`admit_at_once` left open; its future gives the
        user name or None. ``address`` counts as checking from now until the check ends,
        whether or not its request still waits for it."""
        auth = security.auth
        assert auth is not None
        future = asyncio.get_running_loop().run_in_executor(self._pool, auth.verify, attempt)
        self._checking.add(address)
        future.add_done_callback(lambda _: self._checking.discard(address))
        return future

    def close(self) -> None:
        """Stop taking checks; one in progress finishes in its thread (under a second)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
