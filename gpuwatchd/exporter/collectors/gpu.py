"""Prometheus collector: turns the in-memory :class:`StateBoard` into metric families.

A scrape reads only immutable snapshots (``StateBoard.all()`` is lock-free), so it never
calls NVML and never waits behind a slow GPU read. The top-level collector runs a list
of named sub-collectors ("gpu" now, "tuning" later), each timed and isolated: one that
raises is reported through ``gpuwatchd_scrape_collector_success`` and the rest of the
scrape is still served.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry

import gpuwatchd
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import GpuSnapshot, StateBoard
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason

log = logging.getLogger(__name__)

#: Labels carried by every per-GPU series.
GPU_LABELS: tuple[str, str] = ("gpu", "uuid")
#: Every decoded NVML throttle reason, in bit order: each gets its own series.
ALL_REASONS: tuple[ThrottleReason, ...] = tuple(ThrottleReason)

_MHZ = 1e6
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DaemonInfo:
    """Build facts exported as ``gpuwatchd_build_info``."""

    version: str
    backend: str
    python_version: str

    @classmethod
    def current(cls, backend: str) -> DaemonInfo:
        """Facts for this process, given the telemetry backend's name."""
        return cls(gpuwatchd.__version__, backend, platform.python_version())


class SubCollector(Protocol):
    """A named source of metric families; ``name`` becomes the ``collector`` label."""

    name: str

    def collect(self) -> Iterable[Metric]: ...


def _gpu_labels(snap: GpuSnapshot) -> list[str]:
    return [str(snap.index), snap.info.uuid if snap.info is not None else ""]


def live_sample(snap: GpuSnapshot) -> Sample | None:
    """The sample if it is current, else None.

    A lost, stalled or failing GPU exports no readings at all: repeating the last
    good value would show a healthy flat line on a dashboard while the GPU is gone.
    Poll health and ``gpuwatchd_last_poll_timestamp_seconds`` tell that story instead.
    """
    health = snap.health
    if health.lost or health.stalled or not health.success:
        return None
    return snap.sample


@dataclass(frozen=True, slots=True)
class _Gauge(Generic[T]):
    """One per-GPU gauge read from a field of a sample or of the static device facts."""

    name: str
    help: str
    unit: str
    value: Callable[[T], float | None]


def _mhz_to_hz(mhz: float | None) -> float | None:
    return None if mhz is None else mhz * _MHZ


def _count(items: tuple[int, ...] | None) -> float | None:
    return None if items is None else float(len(items))


_SAMPLE_GAUGES: tuple[_Gauge[Sample], ...] = (
    _Gauge(
        "gpuwatchd_gpu_temperature_celsius",
        "GPU core temperature in degrees Celsius, from the latest poll.",
        "celsius",
        lambda s: s.temp_c,
    ),
    _Gauge(
        "gpuwatchd_gpu_memory_temperature_celsius",
        "GPU memory (HBM) temperature in degrees Celsius, from the latest poll.",
        "celsius",
        lambda s: s.mem_temp_c,
    ),
    _Gauge(
        "gpuwatchd_gpu_power_watts",
        "GPU board power draw in watts, from the latest poll.",
        "watts",
        lambda s: s.power_w,
    ),
    _Gauge(
        "gpuwatchd_gpu_sm_clock_hertz",
        "Current SM (graphics) clock in hertz; below the max while throttled.",
        "hertz",
        lambda s: _mhz_to_hz(s.sm_clock_mhz),
    ),
    _Gauge(
        "gpuwatchd_gpu_memory_clock_hertz",
        "Current memory clock in hertz.",
        "hertz",
        lambda s: _mhz_to_hz(s.mem_clock_mhz),
    ),
    _Gauge(
        "gpuwatchd_gpu_utilization_ratio",
        "Fraction (0-1) of the last sample period during which a kernel ran on the GPU.",
        "ratio",
        lambda s: s.util_gpu,
    ),
    _Gauge(
        "gpuwatchd_gpu_memory_utilization_ratio",
        "Fraction (0-1) of the last sample period during which device memory was read or written.",
        "ratio",
        lambda s: s.util_mem,
    ),
    _Gauge(
        "gpuwatchd_gpu_compute_processes",
        "Number of compute processes running on the GPU.",
        "",
        lambda s: _count(s.procs),
    ),
    _Gauge(
        "gpuwatchd_gpu_performance_state",
        "Current performance state (P-state): 0 is maximum performance, 15 minimum.",
        "",
        lambda s: s.pstate,
    ),
)

_INFO_GAUGES: tuple[_Gauge[DeviceInfo], ...] = (
    _Gauge(
        "gpuwatchd_gpu_slowdown_temperature_celsius",
        "Temperature in degrees Celsius at which the GPU starts thermal slowdown.",
        "celsius",
        lambda i: i.slowdown_temp_c,
    ),
    _Gauge(
        "gpuwatchd_gpu_shutdown_temperature_celsius",
        "Temperature in degrees Celsius at which the GPU shuts down to protect itself.",
        "celsius",
        lambda i: i.shutdown_temp_c,
    ),
    _Gauge(
        "gpuwatchd_gpu_power_limit_watts",
        "Enforced board power limit in watts; power draw at this value means SW power cap.",
        "watts",
        lambda i: i.power_limit_w,
    ),
    _Gauge(
        "gpuwatchd_gpu_max_sm_clock_hertz",
        "Maximum SM (graphics) clock in hertz the GPU can reach.",
        "hertz",
        lambda i: _mhz_to_hz(i.max_sm_clock_mhz),
    ),
    _Gauge(
        "gpuwatchd_gpu_max_memory_clock_hertz",
        "Maximum memory clock in hertz the GPU can reach.",
        "hertz",
        lambda i: _mhz_to_hz(i.max_mem_clock_mhz),
    ),
)


def _fill(
    spec: _Gauge[T], snaps: Sequence[GpuSnapshot], source: Callable[[GpuSnapshot], T | None]
) -> GaugeMetricFamily:
    """One gauge family with a series for every GPU whose source has the field (None: absent)."""
    family = GaugeMetricFamily(spec.name, spec.help, labels=GPU_LABELS, unit=spec.unit)
    for snap in snaps:
        obj = source(snap)
        value = None if obj is None else spec.value(obj)
        if value is not None:
            family.add_metric(_gpu_labels(snap), float(value))
    return family


def _info_of(snap: GpuSnapshot) -> DeviceInfo | None:
    return snap.info


class GpuCollector:
    """Per-GPU telemetry, gate and poll-health families, read from the state board only."""

    name = "gpu"

    def __init__(self, board: StateBoard) -> None:
        self._board = board

    def collect(self) -> Iterator[Metric]:
        # Like client_golang, drop families without series: a field no GPU supports
        # should not leave a bare HELP/TYPE header behind.
        return (family for family in self._families() if family.samples)

    def _families(self) -> Iterator[Metric]:
        snaps = self._board.all()
        yield self._gpu_info(snaps)
        for info_spec in _INFO_GAUGES:
            yield _fill(info_spec, snaps, _info_of)
        for sample_spec in _SAMPLE_GAUGES:
            yield _fill(sample_spec, snaps, live_sample)
        yield self._energy(snaps)
        yield from self._throttle(snaps)
        yield from self._gate(snaps)
        yield from self._health(snaps)

    @staticmethod
    def _gpu_info(snaps: Sequence[GpuSnapshot]) -> InfoMetricFamily:
        family = InfoMetricFamily(
            "gpuwatchd_gpu",
            "Identity of each GPU; always 1. Join on gpu/uuid to name other series.",
            labels=GPU_LABELS,
        )
        for snap in snaps:
            info = snap.info
            if info is None:
                continue
            family.add_metric(
                _gpu_labels(snap),
                {
                    "name": info.name,
                    "driver_version": info.driver_version or "",
                    "pci_bus_id": info.pci_bus_id or "",
                },
            )
        return family

    @staticmethod
    def _energy(snaps: Sequence[GpuSnapshot]) -> CounterMetricFamily:
        family = CounterMetricFamily(
            "gpuwatchd_gpu_energy_joules",
            "Energy consumed by the GPU in joules since the driver loaded (read at a lower "
            "rate than the other fields); use rate() for average watts.",
            labels=GPU_LABELS,
            unit="joules",
        )
        for snap in snaps:
            if snap.energy_j is not None and live_sample(snap) is not None:
                family.add_metric(_gpu_labels(snap), snap.energy_j)
        return family

    @staticmethod
    def _throttle(snaps: Sequence[GpuSnapshot]) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            "gpuwatchd_gpu_throttle_active",
            "1 if NVML reports this clocks-event (throttle) reason in the latest poll, else 0. "
            "sw_power_cap means the workload hit the power limit; *_thermal_slowdown means heat.",
            labels=(*GPU_LABELS, "reason"),
        )
        seconds = CounterMetricFamily(
            "gpuwatchd_gpu_throttle_seconds",
            "Seconds the daemon observed each throttle reason active since it started.",
            labels=(*GPU_LABELS, "reason"),
            unit="seconds",
        )
        for snap in snaps:
            labels = _gpu_labels(snap)
            sample = live_sample(snap)
            if sample is not None and sample.reasons is not None:
                for reason in ALL_REASONS:
                    active.add_metric([*labels, reason.label], float(reason in sample.reasons))
            # Accumulated seconds are the daemon's own count, still true while the GPU
            # is lost; they exist once reasons were ever readable on this GPU.
            reasons_known = snap.sample is not None and snap.sample.reasons is not None
            if snap.throttle_seconds or reasons_known:
                for reason in ALL_REASONS:
                    seconds.add_metric(
                        [*labels, reason.label], snap.throttle_seconds.get(reason, 0.0)
                    )
        yield active
        yield seconds

    @staticmethod
    def _gate(snaps: Sequence[GpuSnapshot]) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "gpuwatchd_gate_state",
            "Tuning gate state of each GPU, one-hot: exactly one state is 1. Only cool_stable "
            "lets gated tuning run.",
            labels=(*GPU_LABELS, "state"),
        )
        is_open = GaugeMetricFamily(
            "gpuwatchd_gate_open",
            "1 if the GPU is idle, cool and stable enough for gated tuning (cool_stable), else 0.",
            labels=GPU_LABELS,
        )
        duration = GaugeMetricFamily(
            "gpuwatchd_gate_state_duration_seconds",
            "Seconds the GPU had spent in its current gate state at the last gate decision; "
            "alert on a gate that stays shut for hours.",
            labels=GPU_LABELS,
            unit="seconds",
        )
        for snap in snaps:
            gate = snap.gate
            if gate is None:
                continue
            labels = _gpu_labels(snap)
            for member in GateState:
                state.add_metric([*labels, member.value], float(gate.state is member))
            is_open.add_metric(labels, float(gate.open))
            duration.add_metric(labels, max(0.0, gate.t - gate.since))
        yield state
        yield is_open
        yield duration

    @staticmethod
    def _health(snaps: Sequence[GpuSnapshot]) -> Iterator[Metric]:
        success = GaugeMetricFamily(
            "gpuwatchd_poll_success",
            "1 if the latest poll of the GPU succeeded, else 0.",
            labels=GPU_LABELS,
        )
        duration = GaugeMetricFamily(
            "gpuwatchd_poll_duration_seconds",
            "Wall time in seconds of the last completed telemetry read of the GPU.",
            labels=GPU_LABELS,
            unit="seconds",
        )
        stalled = GaugeMetricFamily(
            "gpuwatchd_poll_stalled",
            "1 if a telemetry read of the GPU has been in flight for more than two poll "
            "periods (a hung driver call), else 0.",
            labels=GPU_LABELS,
        )
        lost = GaugeMetricFamily(
            "gpuwatchd_gpu_lost",
            "1 if the GPU stopped answering (fell off the bus), else 0.",
            labels=GPU_LABELS,
        )
        last = GaugeMetricFamily(
            "gpuwatchd_last_poll_timestamp_seconds",
            "Unix time of the last successful poll of the GPU; time() minus this is staleness.",
            labels=GPU_LABELS,
            unit="seconds",
        )
        for snap in snaps:
            labels = _gpu_labels(snap)
            health = snap.health
            success.add_metric(labels, float(health.success))
            duration.add_metric(labels, health.duration_s)
            stalled.add_metric(labels, float(health.stalled))
            lost.add_metric(labels, float(health.lost))
            if health.last_success_unix is not None:
                last.add_metric(labels, health.last_success_unix)
        yield success
        yield duration
        yield stalled
        yield lost
        yield last


class GpuwatchdCollector:
    """Build info plus every sub-collector, each timed and isolated from the others.

    A sub-collector's families are emitted all-or-nothing: if it raises part-way, none
    of its output is served (half a family set would look like real absences).
    """

    def __init__(
        self,
        info: DaemonInfo,
        subcollectors: Sequence[SubCollector],
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        names = [sub.name for sub in subcollectors]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"subcollectors: duplicate collector name(s) {duplicates}")
        self._info = info
        self._subs = tuple(subcollectors)
        self._timer = timer
        self._failing: set[str] = set()
        self._failing_lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        yield InfoMetricFamily(
            "gpuwatchd_build",
            "gpuwatchd build and runtime facts; always 1.",
            value={
                "version": self._info.version,
                "backend": self._info.backend,
                "python_version": self._info.python_version,
            },
        )
        success = GaugeMetricFamily(
            "gpuwatchd_scrape_collector_success",
            "1 if the named gpuwatchd collector succeeded during this scrape, else 0 (its "
            "metrics are then missing).",
            labels=("collector",),
        )
        duration = GaugeMetricFamily(
            "gpuwatchd_scrape_collector_duration_seconds",
            "Seconds the named gpuwatchd collector took during this scrape.",
            labels=("collector",),
            unit="seconds",
        )
        for sub in self._subs:
            start = self._timer()
            families = self._run(sub)
            elapsed = self._timer() - start
            yield from families or ()
            success.add_metric([sub.name], float(families is not None))
            duration.add_metric([sub.name], elapsed)
        yield success
        yield duration

    def _run(self, sub: SubCollector) -> list[Metric] | None:
        """Collect one sub-collector; None if it failed. Logs once per failure streak."""
        try:
            families = list(sub.collect())
        except Exception:
            with self._failing_lock:
                first = sub.name not in self._failing
                self._failing.add(sub.name)
            if first:
                log.exception("collector %r failed; its metrics are missing", sub.name)
            return None
        with self._failing_lock:
            if sub.name in self._failing:
                self._failing.discard(sub.name)
                log.info("collector %r recovered", sub.name)
        return families


def build_registry(
    board: StateBoard, info: DaemonInfo, extra: Sequence[SubCollector] = ()
) -> CollectorRegistry:
    """A private registry (never the global one) holding gpuwatchd's collector.

    ``extra`` sub-collectors (e.g. a "tuning" one) are scraped after "gpu".
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuwatchdCollector(info, [GpuCollector(board), *extra]))
    return registry
