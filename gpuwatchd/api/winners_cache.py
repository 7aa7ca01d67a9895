"""The daemon's ``/api/v1/winners``: the winners this host serves, kept in memory.

The whole document (of this host's GPU models, when it knows them: a host serves
winners for its own GPUs, and its read does not grow with the fleet's models) is read
from the store once per fleet sync and after every session (or fleet skip) of this
host, and each request is answered by filtering it in memory:
a request costs no query, and while the store is down the last known winners are still
served, marked ``stale`` with their ``age_s``. Before the first read has worked there
is nothing to serve: :meth:`WinnersCache.document` raises :class:`StoreUnavailable`
(the HTTP route answers 503 with one line). The store logs each outage once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from gpuwatchd.api.winners import WINNERS_FORMAT, JsonDict, parse_winners_query, winners_json
from gpuwatchd.store import SqlStore, StoreError
from gpuwatchd.store.errors import StoreUnavailable
from gpuwatchd.tuning.types import Regime


@dataclass(frozen=True, slots=True)
class _Read:
    """One read of the whole document, and when it was made (unix seconds)."""

    winners: tuple[JsonDict, ...]
    at: float
    models: tuple[str, ...]  # the GPU models it was read for (none: every model)


class WinnersCache:
    """Every winner ``host`` serves (its own per key, else the fleet's), read per
    :meth:`refresh`; only those of the GPU models ``models()`` names, when it names any."""

    def __init__(
        self,
        store: SqlStore,
        *,
        host: str,
        now: Callable[[], float] = time.time,
        models: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self._store = store
        self._host = host
        self._models = models
        self._now = now
        self._read: _Read | None = None
        self._stale = False

    def refresh(self) -> None:
        """Read the document again; a store error keeps the last one, marked stale."""
        mine = tuple(sorted(self._models()))
        try:
            winners = [
                w
                for model in mine or (None,)
                for w in winners_json(
                    self._store, gpu_model=model, prefer_host=self._host, now=self._now
                )["winners"]
            ]
        except StoreError:
            self._stale = True
            return
        self._read, self._stale = _Read(tuple(winners), self._now(), mine), False

    def document(self, target: str) -> JsonDict:
        """The document for a request target (its query filters it); ValueError for a
        bad query, StoreUnavailable when no read has worked yet."""
        query = parse_winners_query(target)
        if self._read is None or self._read.models != tuple(sorted(self._models())):
            self.refresh()  # never read, or this host's GPUs became known since
        read = self._read
        if read is None:
            raise StoreUnavailable(
                f"store {self._store.where} is unreachable and no winners were read yet"
            )
        wanted = {k: v.value if isinstance(v, Regime) else v for k, v in query.items()}
        now = self._now()
        return {
            "format": WINNERS_FORMAT,
            "generated_unix": now,
            "winners": [w for w in read.winners if _matches(w, wanted)],
            "stale": self._stale or not self._store.up,
            "age_s": max(0.0, now - read.at),
        }


def _matches(winner: JsonDict, wanted: dict[str, Any]) -> bool:
    return all(winner.get(k) == v for k, v in wanted.items())
