"""Telemetry value types shared by every backend and every consumer.

Units follow NVML where it is natural to read them (MHz, watts, degrees Celsius) and
are converted to base units only at the export boundary. A field a GPU does not
support is ``None``: absent, never 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ThrottleReason(enum.IntFlag):
    """NVML clocks-event (throttle) reasons, decoded. Bit values are NVML's."""

    GPU_IDLE = 0x1
    APPLICATIONS_CLOCKS_SETTING = 0x2
    SW_POWER_CAP = 0x4
    HW_SLOWDOWN = 0x8
    SYNC_BOOST = 0x10
    SW_THERMAL_SLOWDOWN = 0x20
    HW_THERMAL_SLOWDOWN = 0x40
    HW_POWER_BRAKE_SLOWDOWN = 0x80
    DISPLAY_CLOCK_SETTING = 0x100

    @classmethod
    def decode(cls, mask: int) -> ThrottleReason:
        """Keep the known bits of a raw NVML mask; unknown future bits are dropped."""
        return cls(mask & _KNOWN_MASK)

    @property
    def label(self) -> str:
        """The Prometheus label value, e.g. ``sw_power_cap``."""
        return (self.name or "none").lower()

    def names(self) -> list[str]:
        """Label values of every bit set, in bit order."""
        return [r.label for r in ThrottleReason if r in self]


_KNOWN_MASK = 0x1FF

#: Reasons that mean the clock is being held down by something other than idleness.
LIMITING_REASONS = ThrottleReason(_KNOWN_MASK & ~ThrottleReason.GPU_IDLE)
#: Reasons caused by heat.
THERMAL_REASONS = (
    ThrottleReason.SW_THERMAL_SLOWDOWN
    | ThrottleReason.HW_THERMAL_SLOWDOWN
    | ThrottleReason.HW_SLOWDOWN
)
#: Reasons caused by the power limit.
POWER_REASONS = ThrottleReason.SW_POWER_CAP | ThrottleReason.HW_POWER_BRAKE_SLOWDOWN


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Static facts about one GPU, read once and refreshed rarely."""

    index: int
    uuid: str
    name: str
    driver_version: str | None = None
    pci_bus_id: str | None = None
    memory_total_bytes: int | None = None
    max_sm_clock_mhz: float | None = None
    max_mem_clock_mhz: float | None = None
    power_limit_w: float | None = None
    slowdown_temp_c: float | None = None
    shutdown_temp_c: float | None = None
    cuda_capability: str | None = None


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of the fast fields of one GPU.

    ``t`` is seconds on the backend's clock (monotonic; simulated time for the sim
    and replay backends). ``procs`` holds the PIDs of compute processes on the GPU.
    """

    gpu: int
    t: float
    temp_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    reasons: ThrottleReason | None = None
    util_gpu: float | None = None  # ratio 0-1
    util_mem: float | None = None  # ratio 0-1
    procs: tuple[int, ...] | None = None
    mem_temp_c: float | None = None
    pstate: int | None = None
    extra: dict[str, float] = field(default_factory=dict, compare=False)
