"""Record any backend into a ``gpuwatchd-trace/1`` file (fixtures for replay and tests)."""

from __future__ import annotations

import logging
import time

from gpuwatchd.telemetry.backend import Backend, GpuLost
from gpuwatchd.telemetry.trace import TraceWriter

log = logging.getLogger(__name__)


def record_trace(
    backend: Backend,
    path: str,
    duration_s: float,
    period_s: float = 0.05,
    events: list[dict[str, object]] | None = None,
) -> int:
    """Sample every GPU each ``period_s`` for ``duration_s`` of real time; return the count.

    Sample times are rebased so the trace starts at 0. A lost GPU leaves a gap.
    """
    if duration_s <= 0 or period_s <= 0:
        raise ValueError("duration and interval must be > 0")
    gpus = backend.devices()
    infos = [backend.device_info(g) for g in gpus]
    t0: float | None = None
    count = 0
    with TraceWriter(path, infos, period_s, events or []) as writer:
        end = time.monotonic() + duration_s
        next_at = time.monotonic()
        while time.monotonic() < end:
            for g in gpus:
                try:
                    s = backend.read(g)
                except GpuLost as exc:
                    log.warning("%s", exc)
                    continue
                if t0 is None:
                    t0 = s.t
                writer.write(s, t=s.t - t0)
                count += 1
            next_at += period_s
            time.sleep(max(0.0, next_at - time.monotonic()))
    return count
