"""Session ends the store could not record yet, kept on disk until it can.

A session that ends while the store cannot take its end (unreachable, or a lock held
past every retry) leaves a :class:`PendingEnd`: its final status, when it ended, and
the results the worker sent that the store did not take. :class:`PendingEnds` keeps
them in one JSON file under the state directory (written whole, atomically, so a crash
leaves the old file or the new one), at most :data:`MAX_PENDING`: when full, the oldest
is dropped with a WARNING and counted. The runners record them when the store takes
writes again; the counts are exported (``gpuwatchd_store_pending_results``,
``gpuwatchd_store_late_results_total``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatchd.sessions.events import SessionFinished
from gpuwatchd.store import SqlStore, StoreError
from gpuwatchd.store.errors import StoreBusy, StoreUnavailable
from gpuwatchd.store.retry import BACKOFF_S, retrying
from gpuwatchd.tuning.types import RegimeResult, SessionStatus

log = logging.getLogger(__name__)

#: The file, under the state directory, that holds the ends waiting for the store.
PENDING_FILE = "pending-session-ends.json"
#: Ends kept at most; a daemon whose store refuses its writes for days stops growing.
MAX_PENDING = 256
#: The file's largest size read back (a file grown past it is not ours to trust).
MAX_FILE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class PendingEnd:
    """A session's end (and results) the store has not recorded yet."""

    session_id: int
    gpu_index: int
    gpu_uuid: str
    gpu_name: str
    status: SessionStatus
    why: str | None
    ended_at: float
    workloads: tuple[str, ...]
    #: Results the worker sent that the store did not take, recorded before the end.
    results: tuple[RegimeResult, ...] = ()

    def finished(self) -> SessionFinished:
        """What the session listeners hear once the store holds this end."""
        return SessionFinished(
            self.session_id, self.gpu_index, self.gpu_uuid, self.gpu_name, self.status,
            self.why, self.workloads,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        from gpuwatchd.tuning.session_spec import result_to_json  # with the first end kept

        return {
            "session_id": self.session_id,
            "gpu_index": self.gpu_index,
            "gpu_uuid": self.gpu_uuid,
            "gpu_name": self.gpu_name,
            "status": self.status.value,
            "why": self.why,
            "ended_at": self.ended_at,
            "workloads": list(self.workloads),
            "results": [result_to_json(r) for r in self.results],
        }

    @classmethod
    def from_json(cls, d: Any) -> PendingEnd:
        """Parse one entry; ValueError (or TypeError, KeyError) names what is wrong."""
        from gpuwatchd.tuning.session_spec import result_from_json  # with the first end kept

        if not isinstance(d, dict):
            raise ValueError(f"expected an object, got {type(d).__name__}")
        status = SessionStatus(d["status"])
        if status is SessionStatus.RUNNING:
            raise ValueError("status: a pending end cannot be running")
        ints = {k: d[k] for k in ("session_id", "gpu_index")}
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints.values()):
            raise ValueError(f"session_id, gpu_index: expected integers, got {ints}")
        texts = (d["gpu_uuid"], d["gpu_name"], *d["workloads"])
        if not all(isinstance(t, str) for t in texts) or not isinstance(d["workloads"], list):
            raise ValueError("gpu_uuid, gpu_name, workloads: expected text")
        why, ended = d["why"], d["ended_at"]
        if why is not None and not isinstance(why, str):
            raise ValueError(f"why: expected text or null, got {why!r}")
        if isinstance(ended, bool) or not isinstance(ended, int | float):
            raise ValueError(f"ended_at: expected a number, got {ended!r}")
        results = d["results"]
        if not isinstance(results, list):
            raise ValueError("results: expected a list")
        return cls(
            ints["session_id"],
            ints["gpu_index"],
            d["gpu_uuid"],
            d["gpu_name"],
            status,
            why,
            float(ended),
            tuple(d["workloads"]),
            tuple(result_from_json(r, f"results[{i}]") for i, r in enumerate(results)),
        )


class PendingEnds:
    """The ends waiting for the store, shared by a daemon's runners; ``path`` None keeps
    them in memory only (a test, ``gpuwatchd tune``). Thread-safe."""

    def __init__(self, path: Path | None = None, *, limit: int = MAX_PENDING) -> None:
        self._path = path
        self._limit = limit
        self._lock = threading.Lock()
        self._ends: list[PendingEnd] = self._load() if path is not None else []
        #: Ends recorded after waiting here, and ends dropped (the queue was full).
        self.recorded_late = 0
        self.dropped = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._ends)

    def add(self, end: PendingEnd) -> None:
        """Keep ``end`` until the store takes it (the oldest goes when full)."""
        with self._lock:
            self._ends = [e for e in self._ends if e.session_id != end.session_id] + [end]
            while len(self._ends) > self._limit:
                gone = self._ends.pop(0)
                self.dropped += 1
                log.warning(
                    "tuning session %d's end (%s) is dropped unrecorded: over %d session"
                    " ends wait for the store",
                    gone.session_id,
                    gone.status.value,
                    self._limit,
                )
            self._save()

    def take(self) -> list[PendingEnd]:
        """Every end waiting, oldest first; each is to be given back to :meth:`done` or
        :meth:`add`."""
        with self._lock:
            return list(self._ends)

    def done(self, end: PendingEnd, *, recorded: bool = True) -> None:
        """``end`` was recorded (or, ``recorded=False``, never can be): it waits no longer."""
        with self._lock:
            before = len(self._ends)
            self._ends = [e for e in self._ends if e.session_id != end.session_id]
            gone = before - len(self._ends)
            if recorded:
                self.recorded_late += gone
            else:
                self.dropped += gone
            self._save()

    def _load(self) -> list[PendingEnd]:
        assert self._path is not None
        try:
            with open(self._path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("cannot read %s (session ends waiting for the store): %s", self._path, e)
            return []
        try:
            if len(data) > MAX_FILE_BYTES:
                raise ValueError(f"over {MAX_FILE_BYTES} bytes")
            entries = json.loads(data)
            if not isinstance(entries, list):
                raise ValueError("expected a list")
        except ValueError as e:
            log.warning("ignoring %s (session ends waiting for the store): %s", self._path, e)
            return []
        out = []
        for i, entry in enumerate(entries[: self._limit]):
            try:
                out.append(PendingEnd.from_json(entry))
            except (ValueError, TypeError, KeyError) as e:
                log.warning("%s: entry %d skipped: %s", self._path, i, e)
        return out

    def _save(self) -> None:
        """Write the file whole (called with the lock held); a failure is logged, and the
        ends stay in memory."""
        if self._path is None:
            return
        tmp = self._path.with_name(self._path.name + ".tmp")
        try:
            if not self._ends:
                self._path.unlink(missing_ok=True)
                return
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump([e.to_json() for e in self._ends], f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
        except OSError as e:
            log.warning("cannot write %s (session ends waiting for the store): %s", self._path, e)


def record(
    store: SqlStore,
    end: PendingEnd,
    *,
    late: bool = False,
    backoff_s: Sequence[float] = BACKOFF_S,
    sleep: Callable[[float], None] = time.sleep,
) -> bool | None:
    """Record ``end`` (its results first, then the session's end; ``late``: at the time it
    ended, not now), trying again while the store is busy. True once recorded; False
    when the store cannot take it now (keep it); None when it never can (logged)."""

    def write() -> None:
        for result in end.results:  # recording a (workload, regime) again replaces it
            store.record_result(end.session_id, result)
        at = end.ended_at if late else None
        store.finish_session(end.session_id, end.status, end.why, ended_at=at)

    try:
        retrying(write, f"recording tuning session {end.session_id}'s end", backoff_s=backoff_s,
                 sleep=sleep)  # fmt: skip
    except (StoreUnavailable, StoreBusy):
        return False
    except StoreError as e:
        why = f" ({end.why})" if end.why else ""
        log.error("cannot end tuning session %d as %s%s: %s", end.session_id, end.status.value,
                  why, e)  # fmt: skip
        return None
    return True


def record_waiting(
    store: SqlStore, pending: PendingEnds, notify: Callable[[PendingEnd], None] | None = None
) -> int:
    """Record the ends waiting in ``pending``, oldest first, telling ``notify`` of each;
    stops at the first the store cannot take now. Returns how many still wait."""
    for end in pending.take():
        got = record(store, end, late=True, backoff_s=())
        if got is False:
            break  # the store takes no writes now: the later ones wait too
        pending.done(end, recorded=got is True)
        if got and notify is not None:
            notify(end)
    return len(pending)
