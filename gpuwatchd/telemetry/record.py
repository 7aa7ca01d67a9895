"""Record any backend into a ``gpuwatchd-trace/1`` file (fixtures for replay and tests)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gpuwatchd.telemetry.backend import Backend, GpuLost
from gpuwatchd.telemetry.trace import TraceWriter
from gpuwatchd.telemetry.types import Sample

log = logging.getLogger(__name__)


def record_trace(
    backend: Backend,
    path: str,
    duration_s: float,
    period_s: float = 0.05,
    events: list[dict[str, object]] | None = None,
    on_sample: Callable[[Sample], None] | None = None,
) -> int:
    """Sample every GPU each ``period_s`` for ``duration_s`` of real time; return the count.

    Times are rebased so the trace starts at 0, and the header's ``t0_unix`` says when
    that was (``plot-timeline`` uses it to shade stored tuning sessions). A lost GPU
    leaves a gap. ``on_sample`` (a progress display) hears of each sample written.
    """
    if duration_s <= 0 or period_s <= 0:
        raise ValueError("duration and interval must be > 0")
    gpus = backend.devices()
    infos = [backend.device_info(g) for g in gpus]
    t0 = backend.clock.now()  # t = 0 of the trace, at the wall time written in its header
    count = 0
    with TraceWriter(path, infos, period_s, events or [], t0_unix=time.time()) as writer:
        end = time.monotonic() + duration_s
        next_at = time.monotonic()
        while time.monotonic() < end:
            for g in gpus:
                try:
                    s = backend.read(g)
                except GpuLost as exc:
                    log.warning("%s", exc)
                    continue
                writer.write(s, t=max(0.0, s.t - t0))
                count += 1
                if on_sample is not None:
                    on_sample(s)
            next_at += period_s
            time.sleep(max(0.0, next_at - time.monotonic()))
    return count
