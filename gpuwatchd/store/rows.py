"""Plain, frozen data the store takes in and hands out.

The daemon never imports torch, so library versions arrive from the worker after a
session starts: :meth:`Versions.merge` combines what NVML knows (the driver) with
what the worker reports.
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.store.errors import StoreError
from gpuwatchd.telemetry.types import DeviceInfo, Sample
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus, Versions, Workload
from gpuwatchd.validate import field_error

_MHZ = 1e6

#: Names this host in a shared store; Kubernetes sets it from the node's name, since a
#: pod's own hostname is the pod's, and tests run several daemons on one machine.
HOST_ENV = "GPUWATCHD_HOST"
#: The longest DNS name, and so the longest host name the store accepts.
MAX_HOST_LEN = 253


def host_name() -> str:
    """This host's name in the store: ``$GPUWATCHD_HOST`` when set, else the hostname.

    A set value must be printable and at most 253 characters (StoreError otherwise).
    """
    value = os.environ.get(HOST_ENV, "")
    if not value:
        return socket.gethostname()
    ok = value.isprintable() and bool(value.strip()) and len(value) <= MAX_HOST_LEN
    if not ok:
        want = f"expected a printable host name of at most {MAX_HOST_LEN} characters"
        raise StoreError(field_error(HOST_ENV, want, value))
    return value


#: Names the file holding this machine's id (tests point it elsewhere).
MACHINE_ID_ENV = "GPUWATCHD_MACHINE_ID_FILE"
#: Where systemd (and dbus, before it) keep the machine id.
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")
#: A machine id is 32 hex digits; a longer line is cut to this many characters.
MAX_MACHINE_ID_LEN = 64


def machine_id() -> str:
    """This machine's id: what tells two machines apart that share a host name.

    The first line of ``$GPUWATCHD_MACHINE_ID_FILE``, else of ``/etc/machine-id`` or
    ``/var/lib/dbus/machine-id``; without any (a minimal container), the kernel's host
    name, which a container runtime makes unique per container.
    """
    override = os.environ.get(MACHINE_ID_ENV, "")
    for path in (override,) if override else MACHINE_ID_FILES:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                line = f.readline(MAX_MACHINE_ID_LEN + 1).strip()
        except OSError:
            continue
        if line and line.isprintable():
            return line[:MAX_MACHINE_ID_LEN]
    return socket.gethostname()[:MAX_MACHINE_ID_LEN]


#: Names the file holding this boot's id (tests point it elsewhere).
BOOT_ID_ENV = "GPUWATCHD_BOOT_ID_FILE"
#: Where Linux keeps a random id drawn at each boot.
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This boot's id: what tells a machine restarted from a clone of its image (same
    machine id, another boot). The first line of ``$GPUWATCHD_BOOT_ID_FILE``, else of
    the kernel's; without one, a random id (every start then counts as a new boot)."""
    path = os.environ.get(BOOT_ID_ENV, "") or BOOT_ID_FILE
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            line = f.readline(MAX_MACHINE_ID_LEN + 1).strip()
    except OSError:
        line = ""
    if line and line.isprintable():
        return line[:MAX_MACHINE_ID_LEN]
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class SessionMeta:
    """What is known when a tuning session starts: the GPU, the stack, the plan, the state."""

    gpu_uuid: str
    gpu_index: int
    gpu_model: str
    backend: str
    workloads: tuple[Workload, ...]
    regimes: tuple[Regime, ...]
    versions: Versions = field(default_factory=Versions)
    host: str = field(default_factory=host_name)
    started_at: float | None = None  # unix seconds; None: the store's clock
    max_sm_clock_hz: float | None = None
    power_limit_w: float | None = None
    sm_clock_at_start_hz: float | None = None
    temp_at_start_c: float | None = None
    power_at_start_w: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # anything else worth keeping (JSON)

    @classmethod
    def for_device(
        cls,
        info: DeviceInfo,
        *,
        backend: str,
        workloads: tuple[Workload, ...],
        regimes: tuple[Regime, ...],
        sample: Sample | None = None,
        versions: Versions | None = None,
        started_at: float | None = None,
    ) -> SessionMeta:
        """Build the meta from the telemetry types, converting MHz to Hz."""
        return cls(
            gpu_uuid=info.uuid,
            gpu_index=info.index,
            gpu_model=info.name,
            backend=backend,
            workloads=workloads,
            regimes=regimes,
            versions=Versions(driver=info.driver_version).merge(versions or Versions()),
            started_at=started_at,
            max_sm_clock_hz=_hz(info.max_sm_clock_mhz),
            power_limit_w=info.power_limit_w,
            sm_clock_at_start_hz=_hz(sample.sm_clock_mhz) if sample else None,
            temp_at_start_c=sample.temp_c if sample else None,
            power_at_start_w=sample.power_w if sample else None,
        )


@dataclass(frozen=True, slots=True)
class SessionRow:
    """One stored session: its meta (``meta.started_at`` is always set) and how it ended."""

    id: int
    meta: SessionMeta
    status: SessionStatus
    why: str | None
    ended_at: float | None

    @property
    def started_at(self) -> float:
        assert self.meta.started_at is not None  # the store always fills it
        return self.meta.started_at


@dataclass(frozen=True, slots=True)
class WinnerRow:
    """The current pick for one (GPU model, versions, workload, regime).

    On a tie ``candidate`` is the nominal fastest and ``tie`` is true: any of the
    tied candidates is as good within the measured noise.
    """

    gpu_model: str
    versions: Versions
    workload: str
    regime: Regime
    candidate: str
    family: str
    median_s: float | None
    sm_clock_hz: float | None
    margin: float | None
    tie: bool
    session_id: int
    gpu_uuid: str
    measured_at: float
    #: The host that measured it (its session's); keyword-only so rows built before hosts
    #: were recorded, and subclasses adding fields, still construct.
    host: str | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class StoredResult:
    """A recorded :class:`RegimeResult` with where and when it was measured."""

    session_id: int
    gpu_model: str
    gpu_uuid: str
    versions: Versions
    recorded_at: float
    result: RegimeResult


@dataclass(frozen=True, slots=True)
class Claim:
    """A lease on a piece of work: held by one (host, GPU) until ``expires_at`` (unix s)."""

    key: str
    host: str
    gpu_uuid: str
    claimed_at: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class Disagreement:
    """Two hosts picked different winners for one key, beyond noise; the fleet kept its own.

    ``kept_*`` is the fleet winner left in place (its median as measured on its host);
    ``new_*`` is the other host's pick. ``gap`` is how much slower the new host measured
    the kept candidate than its own pick (relative: 0.03 is 3%); ``noise`` is what the
    new result's margin had to beat.
    """

    gpu_model: str
    versions: Versions
    workload: str
    regime: Regime
    kept_candidate: str
    kept_host: str
    kept_gpu_uuid: str
    kept_median_s: float | None
    new_candidate: str
    new_host: str
    new_gpu_uuid: str
    new_median_s: float | None
    gap: float
    noise: float | None
    recorded_at: float


@dataclass(frozen=True, slots=True)
class HostClock:
    """A GPU's learned sustained SM clock, as its host reports it for fleet comparisons."""

    host: str
    gpu_uuid: str
    gpu_model: str
    power_limit_w: float | None
    sustained_clock_hz: float
    updated_at: float


def whole_watts(watts: float | None) -> int | None:
    """A power limit in whole watts, half a watt up: how clocks are grouped, in Python
    and in SQL (``FLOOR(power_limit_w + 0.5)``); NVML's 699.999 W is 700 W."""
    return None if watts is None else math.floor(watts + 0.5)


#: :func:`whole_watts` in SQL, on the ``host_clocks`` table.
WHOLE_WATTS_SQL = "FLOOR(power_limit_w + 0.5)"


@dataclass(frozen=True, slots=True)
class ClockMedian:
    """The median of one group's fresh sustained clocks (GPU model, whole watts), as the
    store computes it, and how many GPUs it is over."""

    gpu_model: str
    power_limit_w: int | None
    median_hz: float
    peers: int


def _hz(mhz: float | None) -> float | None:
    return None if mhz is None else mhz * _MHZ
