"""The daemon's in-memory view of every GPU: written by the poller, read by scrapes.

Writers replace a GPU's :class:`GpuSnapshot` atomically (one reference assignment),
so a reader never waits on a lock held by a slow NVML read. A published snapshot is
never changed (its throttle-seconds dict included): writers build a new one.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpuwatchd.gate import GateDecision
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason


@dataclass(frozen=True, slots=True)
class PollHealth:
    """How the last poll of one GPU went."""

    success: bool
    duration_s: float  # of the last completed read
    stalled: bool = False  # a read has been in flight for more than two periods
    lost: bool = False
    error: str | None = None
    last_success_t: float | None = None  # backend clock
    last_success_unix: float | None = None  # wall clock, for staleness alerts


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """Everything the exporter and the JSON API need about one GPU, immutable."""

    index: int
    info: DeviceInfo | None
    sample: Sample | None
    gate: GateDecision | None
    health: PollHealth
    energy_j: float | None = None
    throttle_seconds: dict[ThrottleReason, float] = field(default_factory=dict)


class StateBoard:
    """Latest snapshot per GPU. Reads never block on polls."""

    def __init__(self) -> None:
        self._snapshots: dict[int, GpuSnapshot] = {}
        self._write_lock = threading.Lock()  # serialises writers adding a GPU
        self._puts = itertools.count(1)
        #: Differs after every put (read it before the snapshots it versions).
        self.version = 0

    def put(self, snap: GpuSnapshot) -> None:
        snaps = self._snapshots
        if snap.index in snaps:
            snaps[snap.index] = snap  # one item assignment: readers see old or new
        else:
            with self._write_lock:  # a new GPU: copy, so no reader iterates a growing dict
                new = dict(self._snapshots)
                new[snap.index] = snap
                self._snapshots = new
        # After the snapshot is in: a reader that sees this version sees the snapshot.
        # next() is atomic; two writers may store out of order, but never a value seen before.
        self.version = next(self._puts)

    def get(self, gpu: int) -> GpuSnapshot | None:
        return self._snapshots.get(gpu)

    def all(self) -> list[GpuSnapshot]:
        snaps = self._snapshots
        return [snaps[k] for k in sorted(snaps)]

    def __iter__(self) -> Iterator[GpuSnapshot]:
        return iter(self.all())
