"""Whether the sustained regime can be skipped, judged from the unthrottled regime's data.

The sustained regime exists because a kernel run back-to-back may draw enough power to
hit the limit (or heat the GPU into a thermal limit) and run at a lower clock. The
unthrottled regime alone cannot show that: its batches are short and paused on purpose.
So it first runs its warm-ups, and if need be a short probe, back-to-back for at least
``power_probe_s`` (NVML's power reading is a 1 s average on current GPUs) and reads the
power. The sustained regime is skipped only when all of this holds:

- the device reports its power limit and maximum SM clock (else nothing can be judged);
- the loaded power reading stayed under ``skip_power_ratio`` of the limit: the margin
  covers candidates hungrier than the mix the reading averaged, and the leakage growth
  of a warmer die;
- no power or thermal throttle reason appeared on any sample of the regime;
- the SM clock never left its maximum (within ``CLOCK_STEADY_REL``: a busy GPU dithers
  a bin or two below it) after any batch, rejected ones included;
- the temperature stayed ``TEMP_MARGIN_C`` under the slowdown threshold, when both are known.

Then running back-to-back cannot lower any candidate's clock, and the sustained result
would repeat the unthrottled one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuwatchd.telemetry.types import (
    POWER_REASONS,
    THERMAL_REASONS,
    DeviceInfo,
    Sample,
    ThrottleReason,
)

#: A busy GPU at full clock reads a bin or two under max now and then; a power cap pulls
#: it down 10-30% (and says so in its reasons). Only a clock this far under max counts.
CLOCK_STEADY_REL = 0.05
#: Degrees under the slowdown threshold the hottest sample must stay.
TEMP_MARGIN_C = 15.0


@dataclass(slots=True)
class LoadEvidence:
    """What the unthrottled regime saw, accumulated sample by sample."""

    loaded_power_w: float | None = None  # highest power read after a long enough load
    loaded_s: float = 0.0  # longest back-to-back load that ended at such a reading
    reasons: ThrottleReason = field(default_factory=lambda: ThrottleReason(0))
    min_clock_mhz: float | None = None
    max_temp_c: float | None = None

    def after_load(self, s: Sample, loaded_s: float, probe_s: float) -> None:
        """A sample read after ``loaded_s`` seconds of back-to-back load.

        Readings before ``probe_s`` are ignored: they still show the state the device
        was in when the regime began (another job's power cap, say), not our own load.
        """
        if loaded_s < probe_s:
            return
        self.after_batch(s)
        if s.power_w is not None:
            self.loaded_s = max(self.loaded_s, loaded_s)
            if self.loaded_power_w is None or s.power_w > self.loaded_power_w:
                self.loaded_power_w = s.power_w

    def after_batch(self, s: Sample) -> None:
        """A sample read right after a batch (the GPU was busy until then)."""
        self.seen(s)
        clock = s.sm_clock_mhz
        if clock is not None and (self.min_clock_mhz is None or clock < self.min_clock_mhz):
            self.min_clock_mhz = clock

    def seen(self, s: Sample) -> None:
        """Any sample of the regime: its reasons and temperature count."""
        self.reasons |= s.reasons or ThrottleReason(0)
        if s.temp_c is not None and (self.max_temp_c is None or s.temp_c > self.max_temp_c):
            self.max_temp_c = s.temp_c


def skip_reason(ev: LoadEvidence, info: DeviceInfo, power_ratio: float) -> str | None:
    """Why the sustained regime need not run, in one line; None when it must."""
    limit, fmax = info.power_limit_w, info.max_sm_clock_mhz
    if not limit or not fmax or ev.loaded_power_w is None or ev.min_clock_mhz is None:
        return None
    if ev.loaded_power_w >= power_ratio * limit:
        return None
    if ev.reasons & (POWER_REASONS | THERMAL_REASONS):
        return None
    if ev.min_clock_mhz < (1.0 - CLOCK_STEADY_REL) * fmax:
        return None
    slowdown = info.slowdown_temp_c
    if slowdown and ev.max_temp_c is not None and ev.max_temp_c > slowdown - TEMP_MARGIN_C:
        return None
    return (
        f"not power or thermally limited: {ev.loaded_power_w:.0f} W after "
        f"{ev.loaded_s:.1f} s back-to-back, under {power_ratio:.0%} of the "
        f"{limit:.0f} W limit; SM clock never under {ev.min_clock_mhz:.0f} MHz; no throttle"
    )


def shows_limit(s: Sample, info: DeviceInfo) -> bool:
    """A power or thermal reason, or a clock well under max, in one sample: once such a
    sample comes after half the probe's load, the sustained regime cannot be skipped and
    the rest of the probe would only spend time."""
    if s.reasons and s.reasons & (POWER_REASONS | THERMAL_REASONS):
        return True
    fmax, clock = info.max_sm_clock_mhz, s.sm_clock_mhz
    return bool(fmax and clock is not None and clock < (1 - CLOCK_STEADY_REL) * fmax)
