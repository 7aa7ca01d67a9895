"""HTTP basic auth against bcrypt hashes, with a cache of verified credentials.

The ``basic_auth_users`` of the web config map user names to bcrypt hashes, as in the
exporter-toolkit; bcrypt is slow on purpose, so a success is remembered and a scrape
every 15 s costs no bcrypt. Checking is split in two so the HTTP server can keep the
slow half off its event loop: :meth:`BasicAuth.begin` (parse, cache lookup: microseconds)
and :meth:`BasicAuth.verify` (bcrypt: tens of milliseconds, releases the GIL), which the
server runs in a small pool with at most one check per client address at a time.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import secrets
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

#: Realm sent in ``WWW-Authenticate`` with every 401.
AUTH_REALM = "gpuwatchd"
#: The challenge sent with every 401.
WWW_AUTHENTICATE = f'Basic realm="{AUTH_REALM}", charset="UTF-8"'
#: Successful verifications remembered, so a scrape every 15 s costs no bcrypt.
AUTH_CACHE_SIZE = 100
_BCRYPT_MAX_PASSWORD = 72  # bytes bcrypt looks at


def parse_basic_credentials(authorization: str | None) -> tuple[str, bytes] | None:
    """``Authorization: Basic base64(user:password)`` -> (user, password); None if not that."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        raw = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = raw.partition(b":")
    if not sep:
        return None
    try:
        return user.decode("utf-8"), password
    except UnicodeDecodeError:
        return None


class CredentialCache:
    """Verified credentials, stored as HMACs under a per-process random key; LRU-bounded.

    Entries hash (user, bcrypt hash, password) together, so one survives a config reload
    exactly when that user's hash is unchanged, and the cache holds no password: its
    lookup timing says nothing without the key.
    """

    def __init__(self, size: int = AUTH_CACHE_SIZE) -> None:
        self._key = secrets.token_bytes(32)
        self._entries: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def key(self, user: str, hashed: bytes, password: bytes) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (user.encode("utf-8"), hashed, password):
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.digest()

    def hit(self, key: bytes) -> bool:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            return False

    def add(self, key: bytes) -> None:
        with self._lock:
            self._entries[key] = None
            self._entries.move_to_end(key)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._entries))


@dataclass(frozen=True, slots=True)
class Attempt:
    """Credentials that passed the cheap checks; ``user`` is set when the cache vouched."""

    user: str | None
    name: str
    password: bytes
    target: bytes  # the user's hash, or a decoy hash for an unknown user
    known: bool
    cache_key: bytes


class BasicAuth:
    """Checks basic-auth credentials against bcrypt hashes, remembering successes.

    bcrypt is slow on purpose (its cost factor sets how slow), so a success is cached
    (see :class:`CredentialCache`; pass the previous one on reload to keep it). Failures
    are not cached, so guessing cannot evict the scrapers' entries. An unknown user is
    checked against a real hash so timing does not reveal which users exist.
    """

    def __init__(
        self,
        users: Mapping[str, str],
        cache_size: int = AUTH_CACHE_SIZE,
        *,
        cache: CredentialCache | None = None,
    ) -> None:
        if not users:
            raise ValueError("BasicAuth needs at least one user")
        self._users = {user: hashed.encode("ascii") for user, hashed in users.items()}
        self._decoy = next(iter(self._users.values()))
        self.cache = cache if cache is not None else CredentialCache(cache_size)

    def begin(self, authorization: str | None) -> Attempt | None:
        """None for missing, malformed or over-long credentials (a 401 without bcrypt)."""
        credentials = parse_basic_credentials(authorization)
        if credentials is None:
            return None
        name, password = credentials
        hashed = self._users.get(name)
        known = hashed is not None
        target = hashed if hashed is not None else self._decoy
        cache_key = self.cache.key(name, target, password)
        if known and self.cache.hit(cache_key):
            return Attempt(name, name, password, target, known, cache_key)
        if len(password) > _BCRYPT_MAX_PASSWORD:
            return None  # Go refuses these too; old bcrypt releases would truncate them
        return Attempt(None, name, password, target, known, cache_key)

    def verify(self, attempt: Attempt) -> str | None:
        """Run bcrypt for an attempt the cache did not vouch for; the user name or None."""
        if attempt.user is not None:
            return attempt.user
        import bcrypt  # here: most daemons check no passwords and never load it

        try:
            ok = bcrypt.checkpw(attempt.password, attempt.target)
        except ValueError:
            ok = False
        if not (ok and attempt.known):
            return None
        self.cache.add(attempt.cache_key)
        return attempt.name

    def check(self, authorization: str | None) -> str | None:
        """The authenticated user name, or None (both halves in the calling thread)."""
        attempt = self.begin(authorization)
        return None if attempt is None else self.verify(attempt)


def __getattr__(name: str) -> Any:
    """``auth.bcrypt``: the bcrypt module, imported on first use (PEP 562)."""
    if name == "bcrypt":
        import bcrypt

        return bcrypt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
