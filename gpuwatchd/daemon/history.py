"""The daemon's recent samples per GPU, longer than the gate's window.

The gate itself keeps only ``window_s`` of samples and carries its settle timer in its
last decision. To judge a GPU *for a job* (its own processes left out) without
starting the settle time from scratch, the judgement replays the GPU's recent history
through a fresh gate; this listener keeps that history: every sample of the last
``horizon(cfg)`` seconds (backend clock), enough for the window plus the settle time,
twice over.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from gpuwatchd.gate import GateConfig
from gpuwatchd.monitor.board import GpuSnapshot
from gpuwatchd.telemetry.types import Sample

#: Never keep less than this much history (seconds on the backend's clock).
MIN_HORIZON_S = 60.0


def horizon(cfg: GateConfig) -> float:
    """How far back a job's judgement needs to look: window plus settle time, twice."""
    return max(MIN_HORIZON_S, 2.0 * (cfg.window_s + cfg.settle_s))


class SampleHistory:
    """Per-GPU samples of the last :func:`horizon` seconds; a poller listener. Thread-safe."""

    def __init__(self, gate_cfg: Callable[[], GateConfig]) -> None:
        self._gate_cfg = gate_cfg
        self._samples: dict[int, deque[Sample]] = {}
        self._lock = threading.Lock()

    def observe(self, snap: GpuSnapshot) -> None:
        """Keep the snapshot's sample (called on the poller's thread after each poll)."""
        sample = snap.sample
        if sample is None:
            return
        keep = horizon(self._gate_cfg())
        with self._lock:
            q = self._samples.setdefault(snap.index, deque())
            if q and sample.t <= q[-1].t:
                return  # the same reading again
            q.append(sample)
            while q[0].t < sample.t - keep:
                q.popleft()

    def samples(self, gpu: int, after: float | None = None) -> list[Sample]:
        """The GPU's samples, oldest first; only those newer than ``after`` when given."""
        with self._lock:
            q = self._samples.get(gpu)
            if not q:
                return []
            if after is None:
                return list(q)
            return [s for s in q if s.t > after]
