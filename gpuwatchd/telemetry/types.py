"""Telemetry value types shared by every backend and every consumer.

Units follow NVML where it is natural to read them (MHz, watts, degrees Celsius) and
are converted to base units only at the export boundary. A field a GPU does not
support is ``None``: absent, never 0.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


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
    mig_mode: bool | None = None  # MIG mode on (None: a GPU without MIG)


#: ECC counter scopes: since the driver loaded, and over the GPU's lifetime (NVML's names).
ECC_SCOPES: tuple[str, str] = ("volatile", "aggregate")
#: ECC error kinds: single-bit errors are corrected, double-bit ones are not.
ECC_TYPES: tuple[str, str] = ("corrected", "uncorrected")

#: The shared empty ``field_errors`` of a sample whose fields all read.
_NO_COUNTS: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RemappedRows:
    """HBM row remapping (Ampere and later): rows replaced so far, and its state.

    ``pending`` means a remap waits for the next GPU reset; ``failed`` means a remap
    could not be done (the GPU should be serviced).
    """

    correctable: int
    uncorrectable: int
    pending: bool
    failed: bool


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """Device memory one compute process holds, in bytes."""

    pid: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class PodRef:
    """The Kubernetes container a GPU is assigned to (the kubelet's pod-resources API)."""

    namespace: str
    pod: str
    container: str


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device (a compute instance of a GPU instance) of a GPU in MIG mode.

    ``profile`` is NVIDIA's profile name (``1g.18gb``); ``util_gpu`` a ratio 0-1, None
    where NVML does not give it for a MIG device (most drivers).
    """

    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    util_gpu: float | None = None


@dataclass(frozen=True, slots=True)
class SlowReading:
    """The GPU health fields read off the fast poll, at the energy counter's period.

    Each is ``None`` when the GPU does not support it (absent, never 0). Counters
    (ECC, PCIe and NVLink bytes, PCIe replays) count since an origin the driver picks;
    ``xid_errors`` counts each XID code seen since the backend started. ``processes``
    holds the few compute processes using the most memory, largest first. ``mig``
    holds the MIG devices while MIG mode is on (None: off, or a GPU without MIG).
    """

    t: float
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_total_bytes: int | None = None
    ecc_errors: Mapping[tuple[str, str], int] | None = None  # (scope, type) -> count
    remapped_rows: RemappedRows | None = None
    pcie_tx_bytes: float | None = None
    pcie_rx_bytes: float | None = None
    pcie_replay_errors: int | None = None
    nvlink_tx_bytes: float | None = None
    nvlink_rx_bytes: float | None = None
    fan_speed_ratio: float | None = None
    processes: tuple[ProcessMemory, ...] | None = None
    xid_errors: Mapping[int, int] | None = None  # XID code -> count
    mig: tuple[MigDevice, ...] | None = None


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of the fast fields of one GPU.

    ``t`` is seconds on the backend's clock (monotonic; simulated time for the sim
    and replay backends). The attributes from ``temp_c`` to ``pstate`` are the fields
    of :data:`gpuwatchd.telemetry.fields.FIELDS`, which says how each is read, exported
    and traced; each is typed here, in one line, between ``t`` and ``extra``.
    ``procs`` holds the PIDs of compute processes on the GPU.
    ``slow`` is the latest :class:`SlowReading` (as old as the energy period; ``None``
    before the first one). ``field_errors`` counts, per field, the reads that failed
    with a transient error (that field was ``None`` in those samples, the others
    were read): a gap in one series, explained.
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
    enc_util: float | None = None  # ratio 0-1
    extra: dict[str, float] = field(default_factory=dict, compare=False)
    slow: SlowReading | None = field(default=None, compare=False)
    field_errors: Mapping[str, int] = field(default_factory=lambda: _NO_COUNTS, compare=False)


def normalize_uuid(uuid: str) -> str:
    """``GPU-4AE2...`` (NVML) and ``4ae2...`` (torch) name the same GPU."""
    u = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            return u[len(prefix) :]
    return u
