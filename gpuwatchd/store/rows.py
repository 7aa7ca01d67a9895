"""Plain, frozen data the store takes in and hands out.

The daemon never imports torch, so library versions arrive from the worker after a
session starts: :meth:`Versions.merge` combines what NVML knows (the driver) with
what the worker reports.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.telemetry.types import DeviceInfo, Sample
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus, Versions, Workload

_MHZ = 1e6


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
    host: str = field(default_factory=socket.gethostname)
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


@dataclass(frozen=True, slots=True)
class StoredResult:
    """A recorded :class:`RegimeResult` with where and when it was measured."""

    session_id: int
    gpu_model: str
    gpu_uuid: str
    versions: Versions
    recorded_at: float
    result: RegimeResult


def _hz(mhz: float | None) -> float | None:
    return None if mhz is None else mhz * _MHZ
