"""Renders /metrics bodies, reusing a recent one while the state board is unchanged.

The daemon's poller shares the GIL with the HTTP server, so a scrape storm must not
turn into a render storm: rendering 8 GPUs costs about 2 ms of Python. A rendered body
is reused while every GPU snapshot on the board is the very same object as when it was
rendered (so board data is never older than the render in flight when a scrape arrived)
and for at most ``max_age_s``, which bounds the staleness of what the board does not
version: the tuning and drift collectors' views and the collector self-metrics (they
describe the render that produced the body). Concurrent misses share one render.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.exposition import choose_encoder, generate_latest, gzip_accepted
from prometheus_client.registry import CollectorRegistry

from gpuwatchd.exporter.singleflight import SingleFlight
from gpuwatchd.exporter.text_format import TextEncoder

#: Default upper bound on how long a rendered body is reused.
DEFAULT_MAX_AGE_S = 1.0


@dataclass(frozen=True, slots=True)
class Rendered:
    body: bytes
    content_type: str
    gzipped: bool


@dataclass(frozen=True, slots=True)
class _Entry:
    version: tuple[object, ...]
    created: float
    rendered: Rendered


def _same(a: Sequence[object], b: Sequence[object]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class MetricsRenderer:
    """``render(accept, accept_encoding)`` -> body in the encoding the client asked for.

    ``version`` returns objects whose identity changes whenever the exported data does
    (the board's snapshots); an entry holds them, so identities cannot be recycled.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        version: Callable[[], Sequence[object]],
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_age_s < 0:
            raise ValueError(f"max_age_s must be >= 0, got {max_age_s}")
        self._registry = registry
        self._version = version
        self._max_age_s = max_age_s
        self._clock = clock
        self._entries: dict[tuple[str, bool], _Entry] = {}
        self._entries_lock = threading.Lock()
        self._flights: SingleFlight[_Entry] = SingleFlight()
        self._text = TextEncoder()  # the plain text format, Prometheus' default

    def cached(self, accept: str, accept_encoding: str) -> Rendered | None:
        """The body :meth:`render` would reuse right now, or None; never blocks."""
        _, content_type = choose_encoder(accept)
        entry = self._entries.get((content_type, gzip_accepted(accept_encoding)))
        if entry is not None and self._fresh(entry, tuple(self._version())):
            return entry.rendered
        return None

    def render(self, accept: str, accept_encoding: str) -> Rendered:
        encoder, content_type = choose_encoder(accept)
        if encoder is generate_latest:
            encoder = self._text.encode
        key = (content_type, gzip_accepted(accept_encoding))
        version = tuple(self._version())
        entry = self._entries.get(key)
        if entry is not None and self._fresh(entry, version):
            return entry.rendered

        def fresh_entry() -> _Entry:
            body = encoder(self._registry)
            if key[1]:
                body = gzip.compress(body, compresslevel=1)
            return _Entry(version, self._clock(), Rendered(body, content_type, key[1]))

        entry = self._flights.run(key, fresh_entry)
        with self._entries_lock:
            current = self._entries.get(key)
            if current is None or current.created <= entry.created:
                self._entries[key] = entry
        return entry.rendered

    def _fresh(self, entry: _Entry, version: tuple[object, ...]) -> bool:
        age = self._clock() - entry.created
        return 0 <= age < self._max_age_s and _same(entry.version, version)
