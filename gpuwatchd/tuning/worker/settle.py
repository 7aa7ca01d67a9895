"""When a device loaded back-to-back has settled: the sustained regime's start condition.

Two rules over the samples read after each settling batch:

- the trend rule (``settle_horizon_s > 0``): the least-squares slope of the SM clock
  over the last window, carried ``horizon`` seconds ahead, moves it less than
  ``settle_clock_rel``, and so does power's unless the board is pinned at its power cap
  (every sample of the window shows SW_POWER_CAP: the controller then holds the power at
  the limit, and the clock is what tells whether anything still changes) and the load
  has lasted ``power_probe_s`` (NVML's power reading is a 1 s average: before that it
  still shows the idle time before the load, and the candidates' power would read low).
  A power cap engages within a quarter second of a heavy load and the die's time
  constant is ~0.3 s (H200 fit), so a flat trend comes long before a fixed 3 s window;
- the half-window rule (``settle_horizon_s == 0``, the earlier protocol's rule): the
  means of the two halves of the window agree within the same limits.

Candidates alternate round-robin while settling, and each runs at its own clock under
the cap (one draws more power than another): the trend is fitted with an intercept per
candidate, so that alternation is not mistaken for noise around one line. A candidate
seen only once in the window says nothing about the trend (its intercept absorbs it):
only candidates seen at least twice count towards ``MIN_TREND_SAMPLES``, and a window
too short for that is not judged yet (the protocol widens it to two rounds).

A device without clock or power telemetry (the CPU) is settled once a full window ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gpuwatchd.telemetry.types import Sample, ThrottleReason
from gpuwatchd.tuning.settings import ProtocolConfig

#: Fewest samples a trend is fitted to (of candidates seen at least twice in the window);
#: fewer and the window is not judged yet.
MIN_TREND_SAMPLES = 4


def settled(
    window: Sequence[Sample],
    cfg: ProtocolConfig,
    span: float,
    groups: Sequence[str] | None = None,
    loaded_s: float = float("inf"),
) -> bool:
    """Whether the last ``span`` seconds of ``window`` show a settled device.

    ``groups`` (parallel to ``window``) names the candidate each sample was read after;
    ``loaded_s`` is how long the device has been loaded back-to-back.
    """
    if not window:
        return False
    end = window[-1].t
    keep = [i for i, w in enumerate(window) if w.t >= end - span]
    recent = [window[i] for i in keep]
    if cfg.settle_horizon_s > 0:
        names = [groups[i] for i in keep] if groups is not None else [""] * len(keep)
        return _trend_flat(recent, names, cfg, loaded_s >= cfg.power_probe_s)
    return _halves_agree(recent, cfg, end - span / 2)


def _trend_flat(
    recent: Sequence[Sample], names: Sequence[str], cfg: ProtocolConfig, averaged: bool
) -> bool:
    if len(recent) < MIN_TREND_SAMPLES:
        return False
    capped = all(w.reasons is not None and w.reasons & ThrottleReason.SW_POWER_CAP for w in recent)
    fields = [("sm_clock_mhz", cfg.settle_clock_rel)]
    if not (capped and averaged):
        fields.append(("power_w", cfg.settle_power_rel))
    for field, limit in fields:
        by: dict[str, list[tuple[float, float]]] = {}
        for w, name in zip(recent, names, strict=True):
            v = getattr(w, field)
            if v is not None:
                by.setdefault(name, []).append((w.t, float(v)))
        if not by:
            continue  # not reported by this device
        repeated = [pts for pts in by.values() if len(pts) >= 2]
        values = [v for pts in repeated for _, v in pts]
        if len(values) < MIN_TREND_SAMPLES:
            return False  # too few candidates seen twice: no trend to judge yet
        mean = sum(values) / len(values)
        if mean <= 0:
            continue
        if abs(grouped_slope(repeated)) * cfg.settle_horizon_s / mean > limit:
            return False
    return True


def _halves_agree(recent: Sequence[Sample], cfg: ProtocolConfig, mid: float) -> bool:
    """The means of the two halves agree: tolerates candidates of different power
    alternating round-robin, but needs a long window to see a slow drift."""
    first = [w for w in recent if w.t < mid]
    second = [w for w in recent if w.t >= mid]
    if not first or not second:
        return False
    checks = (
        ([w.sm_clock_mhz for w in first], [w.sm_clock_mhz for w in second], cfg.settle_clock_rel),
        ([w.power_w for w in first], [w.power_w for w in second], cfg.settle_power_rel),
    )
    for a, b, limit in checks:
        ma, mb = _mean(a), _mean(b)
        if ma is None or mb is None or ma <= 0:
            continue
        if abs(mb - ma) / ma > limit:
            return False
    return True


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, value)`` points; 0 when time does not vary."""
    return grouped_slope([points])


def grouped_slope(groups: Sequence[Sequence[tuple[float, float]]]) -> float:
    """The common least-squares slope of several groups of ``(t, value)`` points, each
    with its own intercept; 0 when time does not vary within any group."""
    sxy = sxx = 0.0
    for points in groups:
        n = len(points)
        if n < 2:
            continue
        mt = sum(t for t, _ in points) / n
        mv = sum(v for _, v in points) / n
        sxx += sum((t - mt) ** 2 for t, _ in points)
        sxy += sum((t - mt) * (v - mv) for t, v in points)
    return sxy / sxx if sxx > 0 else 0.0


def _mean(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None
