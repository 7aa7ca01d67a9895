"""Renders /metrics bodies, reusing a recent one while the state board is unchanged.

The daemon's poller shares the GIL with the HTTP server, so a scrape storm must not
turn into a render storm. A rendered body is reused while every GPU snapshot on the
board is the very same object as when it was rendered (so board data is never older
than the render in flight when a scrape arrived) and for at most ``max_age_s``, which
bounds the staleness of what the board does not version: the tuning and drift
collectors' views and the collector self-metrics (they describe the render that
produced the body). Concurrent misses share one render. When every collector that
must run reads in-memory state in the caller's thread (``runs_inline``), the HTTP
server renders on its event loop (:meth:`MetricsRenderer.render_at_once`): a hand-off to
a thread and back costs more than such a render.

A render after a board change encodes each collector on its own (an
:class:`~gpuwatchd.exporter.registry.ExporterRegistry` lists them): the aggregator
reuses the text of every sub-collector whose version did not change (tuning, drift,
fleet, and health between slow reads), so the poll's GPU families are what a scrape
re-renders. The pieces join into exactly the body one encoding of the whole registry
gives, in the text format and in OpenMetrics (its ``# EOF`` written once, at the end).
Both formats are written by our own encoders (the same bytes as prometheus_client's, with
label text remembered between scrapes) where the client's escaping allows; any other
encoding ``choose_encoder`` picks is the library's.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from prometheus_client.exposition import choose_encoder, generate_latest, gzip_accepted
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector, CollectorRegistry

from gpuwatchd.exporter.collectors.base import GpuwatchdCollector
from gpuwatchd.exporter.openmetrics_format import (
    EOF,
    FAST_ESCAPINGS,
    OPENMETRICS_VERSION,
    OpenMetricsEncoder,
)
from gpuwatchd.exporter.registry import ExporterRegistry
from gpuwatchd.exporter.singleflight import SingleFlight
from gpuwatchd.exporter.text_format import Collected, TextEncoder

#: Default upper bound on how long a rendered body is reused.
DEFAULT_MAX_AGE_S = 1.0
#: Encodes a whole registry (a body); encodes one collector's families (a part of one).
EncodeRegistry = Callable[[Collector], bytes]
EncodeFamilies = Callable[[list[Metric]], bytes]


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
        self._flights: SingleFlight[_Entry | None] = SingleFlight()
        self._text = TextEncoder()  # the plain text format, Prometheus' default
        self._openmetrics: dict[str, OpenMetricsEncoder] = {}  # by escaping

    def render(self, accept: str, accept_encoding: str) -> Rendered:
        rendered = self._render(accept, accept_encoding, wait=True)
        assert rendered is not None
        return rendered

    def render_at_once(self, accept: str, accept_encoding: str) -> Rendered | None:
        """The body, rendered here if that needs no waiting: every collector to run reads
        in-memory state in the caller's thread, no render of it is in flight, and the
        format is one of our own fast encoders (a kept body of any format is returned).
        None otherwise (then :meth:`render`, off the event loop)."""
        return self._render(accept, accept_encoding, wait=False)

    def _render(self, accept: str, accept_encoding: str, *, wait: bool) -> Rendered | None:
        encoder, content_type = choose_encoder(accept)
        encoders = self._encoders(encoder)
        key = (content_type, gzip_accepted(accept_encoding))
        version = tuple(self._version())
        entry = self._entries.get(key)
        if entry is not None and self._fresh(entry, version):
            return entry.rendered
        if not wait and encoders[0] is encoder:  # the library's slow encoder: off the loop
            return None

        def fresh_entry() -> _Entry | None:
            body = self._encode(*encoders, content_type, wait=wait)
            if body is None:
                return None
            if key[1]:
                body = gzip.compress(body, compresslevel=1)
            return _Entry(version, self._clock(), Rendered(body, content_type, key[1]))

        if wait:
            made = self._flights.run(key, fresh_entry)
            while made is None:  # joined a render that could not go on without waiting
                made = self._flights.run(key, fresh_entry)
        else:
            _, made = self._flights.lead(key, fresh_entry)  # never joins: that would wait
        if made is None:
            return None
        with self._entries_lock:
            current = self._entries.get(key)
            if current is None or current.created <= made.created:
                self._entries[key] = made
        return made.rendered

    def _encoders(self, chosen: EncodeRegistry) -> tuple[EncodeRegistry, EncodeFamilies]:
        """Ours for what ``choose_encoder`` chose where we write the same bytes, else the
        library's: a whole registry's encoder and one collector's families' encoder."""
        if chosen is generate_latest:
            return self._text.encode, self._text.encode_families
        is_openmetrics = _is_openmetrics(chosen)
        if is_openmetrics:
            assert isinstance(chosen, partial)
            escaping = chosen.keywords.get("escaping", openmetrics.UNDERSCORES)
            version = chosen.keywords.get("version", OPENMETRICS_VERSION)
            if escaping in FAST_ESCAPINGS and version == OPENMETRICS_VERSION:
                ours = self._openmetrics.get(escaping)
                if ours is None:
                    ours = self._openmetrics[escaping] = OpenMetricsEncoder(escaping)
                return ours.encode, ours.encode_families
        eof = EOF if is_openmetrics else b""

        def library_part(families: list[Metric]) -> bytes:
            body = chosen(Collected(families))
            return body[: -len(eof)] if eof and body.endswith(eof) else body

        return chosen, library_part

    def _encode(
        self, whole: EncodeRegistry, part: EncodeFamilies, content_type: str, *, wait: bool
    ) -> bytes | None:
        """The registry in one format; collector by collector when it lists them. Without
        ``wait``, None where that could wait: a registry that does not list its
        collectors, or a collector that does not say ``runs_inline``."""
        registry = self._registry
        if not isinstance(registry, ExporterRegistry):
            return whole(registry) if wait else None
        now = self._clock()
        bodies = []
        for c in registry.parts:
            if isinstance(c, GpuwatchdCollector):
                body = c.render(part, content_type, self._max_age_s, now, wait=wait)
                if body is None:
                    return None
                bodies.append(body)
            elif wait or getattr(c, "runs_inline", False):  # build info, TLS expiry
                bodies.append(part(list(c.collect())))
            else:
                return None
        eof = EOF if content_type.startswith("application/openmetrics-text") else b""
        return b"".join(bodies) + eof

    def _fresh(self, entry: _Entry, version: tuple[object, ...]) -> bool:
        age = self._clock() - entry.created
        return 0 <= age < self._max_age_s and _same(entry.version, version)


def _is_openmetrics(encoder: EncodeRegistry) -> bool:
    return isinstance(encoder, partial) and encoder.func is openmetrics.generate_latest
