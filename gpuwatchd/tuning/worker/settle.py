"""When a device loaded back-to-back has settled: the sustained regime's start condition.

Two rules over the samples read after each settling batch:

- the trend rule (``settle_horizon_s > 0``): the least-squares slope of the SM clock
  over the last window, carried ``horizon`` seconds ahead, moves it less than
  ``settle_clock_rel``, and so does power's unless the board is pinned at its power cap
  (every sample of the window shows SW_POWER_CAP: the controller then holds the power at
  the limit, and the clock is what tells whether anything still changes) and the load
  has lasted long enough for the power reading to show it: ``power_probe_s`` for NVML's
  1 s average (before that it still shows the idle time before the load, and the
  candidates' power would read low), ``power_probe_instant_s`` where the session reads
  instantaneous power, which is then the power judged
  (:mod:`~gpuwatchd.tuning.worker.load_power`).
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

Where the session reads instantaneous power, a window with a sample drawing near the
power limit with no power reason is not settled, whatever the trend says: the limiter
may not have engaged yet (it acts on filtered power, so a load just over the limit
takes longest to reach it, and a die still warming draws more as its leakage grows).
Near means ``skip_power_ratio`` of the limit until ``power_probe_s`` of load (the wait
the averaged reading needs anyway), then over the limit until ``transient_max_s`` (a
state that lasts that long is the steady state, as for hardware slowdowns), so a board
whose instantaneous reading and limit disagree in scope cannot hold settling for long.

A device without clock or power telemetry (the CPU) is settled once a full window ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from gpuwatchd.telemetry.types import POWER_REASONS, Sample, ThrottleReason, instant_power
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.worker.load_power import counts, load_power

#: Fewest samples a trend is fitted to (of candidates seen at least twice in the window);
#: fewer and the window is not judged yet.
MIN_TREND_SAMPLES = 4


def settled(
    window: Sequence[Sample],
    cfg: ProtocolConfig,
    span: float,
    groups: Sequence[str] | None = None,
    loaded_s: float = float("inf"),
    power_limit_w: float | None = None,
) -> bool:
    """Whether the last ``span`` seconds of ``window`` show a settled device.

    ``groups`` (parallel to ``window``) names the candidate each sample was read after;
    ``loaded_s`` is how long the device has been loaded back-to-back; ``power_limit_w``
    is the board's power limit, when known.
    """
    if not window:
        return False
    end = window[-1].t
    keep = [i for i, w in enumerate(window) if w.t >= end - span]
    recent = [window[i] for i in keep]
    if limiter_pending(recent, cfg, loaded_s, power_limit_w):
        return False
    if cfg.settle_horizon_s > 0:
        names = [groups[i] for i in keep] if groups is not None else [""] * len(keep)
        return _trend_flat(recent, names, cfg, counts(cfg, window[-1], loaded_s))
    return _halves_agree(recent, cfg, end - span / 2)


def limiter_pending(
    recent: Sequence[Sample], cfg: ProtocolConfig, loaded_s: float, power_limit_w: float | None
) -> bool:
    """Whether the power limiter may still engage on this load: some sample shows no power
    reason with instantaneous power near the limit (``skip_power_ratio`` of it) before
    ``power_probe_s`` of load, or over the limit before ``transient_max_s``."""
    if not power_limit_w:
        return False
    if loaded_s < cfg.power_probe_s:
        near_w = cfg.skip_power_ratio * power_limit_w
    elif loaded_s < cfg.transient_max_s:
        near_w = power_limit_w
    else:
        return False
    return any(_unlimited_at(w, near_w) for w in recent)


def _unlimited_at(s: Sample, near_w: float) -> bool:
    watts = instant_power(s)
    return watts is not None and watts >= near_w and not (s.reasons and s.reasons & POWER_REASONS)


def _clock(w: Sample) -> float | None:
    return w.sm_clock_mhz


def _trend_flat(
    recent: Sequence[Sample], names: Sequence[str], cfg: ProtocolConfig, shows_load: bool
) -> bool:
    if len(recent) < MIN_TREND_SAMPLES:
        return False
    capped = all(w.reasons is not None and w.reasons & ThrottleReason.SW_POWER_CAP for w in recent)
    fields: list[tuple[Callable[[Sample], float | None], float]] = [(_clock, cfg.settle_clock_rel)]
    if not (capped and shows_load):
        fields.append((load_power, cfg.settle_power_rel))
    for read, limit in fields:
        by: dict[str, list[tuple[float, float]]] = {}
        for w, name in zip(recent, names, strict=True):
            v = read(w)
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
        ([load_power(w) for w in first], [load_power(w) for w in second], cfg.settle_power_rel),
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
